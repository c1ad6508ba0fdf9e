"""The server's state (`ServerState`: the pipeline, the scheduler, the limits; the `state` dependency reaches it) and
the checks of a request against the server's limits, which a route makes before it queues anything.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from printpress.serve import protocol as p
from printpress.serve.chat import ChatFormatter
from printpress.serve.errors import ApiError
from printpress.settings import SETTINGS
from printpress.tokenizer import token_bytes


@dataclass
class ServerState:
    pipeline: object  # printpress.pipeline.Pipeline
    scheduler: object  # printpress.serve.scheduler.Scheduler
    model_name: str
    max_new_tokens: int  # the longest output a request may ask for
    max_prompt_tokens: int
    max_steps: int = 1024  # the most denoising steps per canvas a request may ask for
    max_prompt_chars: int | None = None  # longer text cannot fit max_prompt_tokens (`prompt_chars_limit`)
    api_key: str | None = None
    chat: ChatFormatter = field(default_factory=ChatFormatter)
    created: int = field(default_factory=lambda: int(time.time()))
    _pieces: dict[int, str] = field(default_factory=dict)

    @property
    def default_max_tokens(self) -> int:
        return min(self.pipeline.generation_config.max_new_tokens, self.max_new_tokens)

    def setting_list(self) -> p.SettingList:
        """The sampler settings a request may give, with this model's defaults and this server's step cap
        (GET /v1/settings, and the page's fields)."""
        return p.setting_list(self.pipeline.default_settings(), self.max_steps)

    def decode(self, ids: list[int]) -> str:
        if self.pipeline.tokenizer is None:
            return " ".join(map(str, ids))
        return self.pipeline.decode(ids)

    def piece(self, token: int) -> str:
        """One token as text, special tokens included (cached: the step stream asks for the same ids often)."""
        text = self._pieces.get(token)
        if text is None:
            tok = self.pipeline.tokenizer
            text = str(token) if tok is None else tok.decode([token], skip_special_tokens=False)
            if len(self._pieces) < 1_000_000:
                self._pieces[token] = text
        return text

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, part of a character or not (`printpress.tokenizer.token_bytes`)."""
        tok = self.pipeline.tokenizer
        return self.piece(token).encode("utf-8") if tok is None else token_bytes(tok, token)


def state(request: Request) -> ServerState:
    return request.app.state.printpress


StateDep = Annotated[ServerState, Depends(state)]


def check_model(st: ServerState, name: str | None) -> None:
    if name is not None and name != st.model_name:
        raise ApiError(404, f"the model '{name}' does not exist; this server serves '{st.model_name}'",
                       "not_found_error", param="model", code="model_not_found")


def max_tokens_for(st: ServerState, asked: int | None, param: str) -> int:
    if asked is None:
        return st.default_max_tokens
    if asked > st.max_new_tokens:
        raise ApiError(400, f"{param} is {asked}; this server generates at most {st.max_new_tokens} tokens per request",
                       param=param, code="max_tokens_too_large")
    return asked


def check_steps(st: ServerState, body: p.SamplingRequest) -> None:
    """400 for a step count (`steps`, `draft_steps`: the settings that count decoder passes per canvas) over the
    server's limit."""
    for s in SETTINGS:
        asked = getattr(body, s.wire, None) if s.step_count else None
        if asked is not None and asked > st.max_steps:
            raise ApiError(400, f"{s.wire} is {asked}; this server runs at most {st.max_steps} denoising steps per "
                                "canvas", param=s.wire)


def prompt_chars_limit(tokenizer, max_prompt_tokens: int) -> int | None:
    """The longest text that can tokenise to `max_prompt_tokens` tokens or fewer: that many times the longest
    token of the vocabulary, in characters of its stored form (one per byte for byte-level BPE, so never fewer
    than the text it stands for). Text over it is refused before it is tokenised, which for a body of a few
    megabytes takes seconds of a server thread. None without a tokenizer (text is refused anyway)."""
    if tokenizer is None:
        return None
    return max_prompt_tokens * max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)


def check_text_size(st: ServerState, text: str, what: str, param: str) -> None:
    """400 `prompt_too_long` for text too long to fit the prompt limit, before tokenising it."""
    if st.max_prompt_chars is not None and len(text) > st.max_prompt_chars:
        raise ApiError(400, f"{what} has {len(text)} characters; this server accepts at most "
                            f"{st.max_prompt_tokens} tokens, which no text over {st.max_prompt_chars} characters "
                            "fits in", param=param, code="prompt_too_long")


def check_prompt(st: ServerState, ids: list[int]) -> None:
    if len(ids) > st.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {st.max_prompt_tokens}",
                       param="prompt", code="prompt_too_long")


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"
