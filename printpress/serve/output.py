"""One choice's output text, as the API promises it: cut at EOS, at `max_tokens` and at the first stop sequence.

The engine commits whole canvases (a diffusion request rounds its token budget up to whole canvases, as the
reference does), while an OpenAI client asks for at most `max_tokens` tokens and may name stop sequences.
`ChoiceText` keeps the committed token ids of one choice and hands out text deltas that respect all three
cuts; the streamed deltas always add up to the final text.

Text is decoded from the whole kept id list each time (a byte-level token can hold half a character), and a
tail that may still change is held back until the choice ends: a trailing U+FFFD (an unfinished character)
and any tail that could be the start of a stop sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]
REPLACEMENT = "\ufffd"


class ChoiceText:
    def __init__(self, decode: Decode, max_tokens: int, eos_token_ids: Sequence[int] = (),
                 stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.max_tokens = max_tokens
        self.eos = set(eos_token_ids)
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []  # every committed id, pad after EOS included
        self.text = ""  # the text up to the cuts known so far
        self.sent = ""  # what deltas have handed out
        self.hit_eos = False
        self.hit_stop = False

    # -- feeding ------------------------------------------------------------------------------------------
    def add(self, token_ids: Sequence[int]) -> str:
        """Take committed ids; return the text that can be sent now (maybe "")."""
        if self.done:
            return ""
        self.ids.extend(token_ids)
        self._update()
        return self._delta(final=self.done)

    def finish(self) -> str:
        """The request ended: return whatever was held back."""
        return self._delta(final=True)

    # -- state --------------------------------------------------------------------------------------------
    @property
    def kept_ids(self) -> list[int]:
        """Ids up to (not including) the first EOS, at most max_tokens of them."""
        end = len(self.ids)
        for i, token in enumerate(self.ids):
            if token in self.eos:
                end = i
                break
        return self.ids[: min(end, self.max_tokens)]

    @property
    def eos_within_limit(self) -> bool:
        for i, token in enumerate(self.ids[: self.max_tokens]):
            if token in self.eos:
                return True
        return False

    @property
    def done(self) -> bool:
        """Nothing later can change the text: EOS, max_tokens or a stop sequence was reached."""
        return self.hit_stop or self.eos_within_limit or len(self.ids) >= self.max_tokens

    @property
    def finish_reason(self) -> str:
        return "stop" if self.hit_stop or self.eos_within_limit else "length"

    @property
    def text_tokens(self) -> int:
        """Leading kept ids the text stands for: all of them, or through the one that reaches a stop sequence."""
        kept = self.kept_ids
        return self._tokens_covering(kept, len(self.text)) if self.hit_stop else len(kept)

    @property
    def completion_tokens(self) -> int:
        """Generated tokens the text stands for: the kept ids (through the stop sequence) and the EOS."""
        if self.hit_stop:
            return self.text_tokens
        return self.text_tokens + (1 if self.eos_within_limit else 0)

    # -- internals ----------------------------------------------------------------------------------------
    def _update(self) -> None:
        text = self.decode(self.kept_ids)
        cut = self._first_stop(text)
        if cut is not None:
            text = text[:cut]
            self.hit_stop = True
        self.text = text

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i != -1]
        return min(hits) if hits else None

    def _delta(self, final: bool) -> str:
        ready = self.text if final else self.text[: len(self.text) - self._held_back(self.text)]
        if not ready.startswith(self.sent):
            # Only possible if decoding earlier ids changed (never for the tokenizers used here): send the rest.
            ready = self.sent + ready[len(self.sent):]
        delta = ready[len(self.sent):]
        self.sent = ready
        return delta

    def _held_back(self, text: str) -> int:
        hold = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def _tokens_covering(self, ids: list[int], chars: int) -> int:
        """Fewest leading ids whose text reaches `chars` characters (binary search; decode grows with ids)."""
        low, high = 0, len(ids)
        while low < high:
            mid = (low + high) // 2
            if len(self.decode(ids[:mid])) >= chars:
                high = mid
            else:
                low = mid + 1
        return low
