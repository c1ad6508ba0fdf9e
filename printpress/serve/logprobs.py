"""Log-probabilities of a choice's tokens (mode ar), in OpenAI's two wire formats.

The engine hands each generated token's `TokenLogprob` over with its commit (`Request.logprobs`); `ChoiceLogprobs`
keeps them for one choice and gives them out with the text they stand for: in a stream, a token's entry goes out
in the first chunk after its whole text has (so the entries never run ahead of the text), and at the end every
remaining entry of the tokens the final text stands for (`ChoiceText.text_tokens`: before EOS, within
`max_tokens`, through the token that reaches a stop sequence).

Each token's text is what it adds to the decoded completion, so the tokens join to the choice's text: a token that
holds part of a character adds "" and the one that completes it adds the character (its `bytes`, chat's field,
are the token's own bytes all the same). The most likely alternatives are each token decoded alone, special
tokens included. After a stop sequence the last token's text may run into the stop sequence the text was cut at.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from printpress.events import TokenLogprob
from printpress.serve import protocol as p
from printpress.serve.output import REPLACEMENT, ChoiceText


@dataclass(frozen=True)
class Entry:
    """One token's log-probabilities with its text and where that text starts in the choice's text."""

    logprob: TokenLogprob
    text: str
    offset: int


class ChoiceLogprobs:
    """One choice's `TokenLogprob`s (one per committed token), given out with their text (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode  # as the choice's text is decoded (`ChoiceText.decode`)
        self.logprobs: list[TokenLogprob] = []
        self.texts: list[str] = []  # what each token adds to the text, for the tokens whose part is settled
        self.offsets: list[int] = []  # where each of those starts
        self.sent = 0  # entries given out

    def add(self, logprobs: list[TokenLogprob] | None) -> None:
        self.logprobs.extend(logprobs or ())

    def take(self, text: ChoiceText, final: bool) -> list[Entry]:
        """The entries not given out yet whose text has been (`final`: every one of the tokens the text stands for)."""
        count = text.text_tokens
        self._settle(count, final)
        end, known = self.sent, min(len(self.texts), count)
        while end < known and (final or self.offsets[end] + len(self.texts[end]) <= len(text.sent)):
            end += 1
        entries = [Entry(self.logprobs[i], self.texts[i], self.offsets[i]) for i in range(self.sent, end)]
        self.sent = end
        return entries

    def _settle(self, count: int, final: bool) -> None:
        """Find what tokens [len(texts), count) add to the decoded text. A character still unfinished at the end
        (U+FFFD) belongs to the token that finishes it: the last token waits for the next one unless `final`."""
        ids = [logprob.token_id for logprob in self.logprobs[:count]]
        for i in range(len(self.texts), count):
            full = self.decode(ids[: i + 1])
            last = i == count - 1
            if last and not final and full.endswith(REPLACEMENT):
                return
            settled = full if last and final else full.rstrip(REPLACEMENT)
            length = self.offsets[-1] + len(self.texts[-1]) if self.texts else 0
            self.offsets.append(length)
            self.texts.append(settled[length:])


def completion_logprobs(entries: list[Entry], piece: Callable[[int], str]) -> p.CompletionLogprobs:
    """Legacy completions' format: `top_logprobs` holds the most likely tokens and the generated one."""
    tops = []
    for entry in entries:
        top: dict[str, float] = {}
        for token, logprob in [*entry.logprob.top, (entry.logprob.token_id, entry.logprob.logprob)]:
            top.setdefault(piece(token), logprob)
        tops.append(top)
    return p.CompletionLogprobs(tokens=[e.text for e in entries], token_logprobs=[e.logprob.logprob for e in entries],
                                top_logprobs=tops, text_offset=[e.offset for e in entries])


def chat_logprobs(entries: list[Entry], piece: Callable[[int], str],
                  token_bytes: Callable[[int], bytes]) -> p.ChatLogprobs:
    """Chat's format: per token its text, log-probability, bytes and the most likely tokens."""
    return p.ChatLogprobs(content=[
        p.ChatTokenLogprob(token=e.text, logprob=e.logprob.logprob, bytes=list(token_bytes(e.logprob.token_id)),
                           top_logprobs=[p.TopLogprob(token=piece(t), logprob=lp, bytes=list(token_bytes(t)))
                                         for t, lp in e.logprob.top])
        for e in entries])
