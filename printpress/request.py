"""A request and its state while it runs: the one per-request record every decoding loop keeps.

A request owns a `torch.Generator` seeded from its own seed, and every random draw it needs is made from
that generator with the shape the reference uses for a batch of one. So a request gets the same tokens
whichever requests share its batch, and a request alone matches transformers' `generate` under
`torch.manual_seed`.

`RequestState` is shared by the diffusion loop, the AR loop, speculative decoding and editing: what was
committed (and where the first EOS is), the counters its statistics come from, and, while a canvas is
being denoised, that canvas and its sampler state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from printpress.cache import KVCache
from printpress.errors import GenerationError
from printpress.events import Decode, DoneEvent, GenerationResult, GenerationStats, TokenLogprob
from printpress.sampling import SamplerSettings, StabilityTracker, canvases_for, uniform_tokens

logger = logging.getLogger(__name__)
REPLACEMENT = "\ufffd"  # what decoding puts for bytes that are not (yet) a whole character


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    settings: SamplerSettings
    seed: int
    # Log-probabilities of the generated tokens and of the `logprobs` most likely at each position (0: the token's
    # own only); None asks for none. AR mode only (`check_logprobs`). Not a sampler setting: it changes no token.
    logprobs: int | None = None


def check_logprobs(request: Request) -> None:
    """Refuse log-probabilities where the mode has no next-token distribution per generated token to report."""
    k, mode = request.logprobs, request.settings.mode
    if k is None:
        return
    if mode != "ar":
        raise GenerationError(f"logprobs (each generated token's log-probability under the model's next-token "
                              f"distribution) are returned in mode 'ar' only, not in mode={mode!r}; use mode='ar' or "
                              "leave logprobs out")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise GenerationError(f"logprobs must be an integer >= 0 (the most likely tokens listed per position), "
                              f"got {k!r}")


def new_token_budget(settings: SamplerSettings, canvas_length: int) -> int:
    """Positions a request may add to its sequence: whole canvases in diffusion mode; with a sliding canvas its
    tokens and the canvas after the last commit's front."""
    if settings.mode in ("ar", "speculative"):
        return settings.max_new_tokens
    if settings.sliding:
        return settings.max_new_tokens + canvas_length - 1
    return canvases_for(settings.max_new_tokens, canvas_length) * canvas_length


def check_prompts(text_config, canvas_length: int, requests: Sequence[Request]) -> None:
    """Reject empty prompts, unknown token ids and sequences beyond the position limit."""
    limit, vocab = text_config.max_position_embeddings, text_config.vocab_size
    for request in requests:
        ids = request.prompt_ids
        if not ids:
            raise GenerationError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise GenerationError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) >= limit:
            raise GenerationError(f"the prompt has {len(ids)} tokens; the model's position limit is {limit}")
    # AR batches are left padded, which puts every row at the longest prompt's positions; diffusion requests
    # each keep their own cache, so each is checked alone.
    groups = [requests] if requests[0].settings.mode == "ar" else [[r] for r in requests]
    for group in groups:
        longest = max(len(r.prompt_ids) for r in group)
        budget = max(new_token_budget(r.settings, canvas_length) for r in group)
        if longest + budget > limit:
            raise GenerationError(
                f"a prompt of {longest} tokens plus {budget} new tokens exceeds the model's position limit of "
                f"{limit}; lower max_new_tokens or shorten the prompt"
            )


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@dataclass
class RequestState:
    """One request in flight, in any mode.

    `forward_passes` counts every pass the mode's `tokens_per_forward` divides by (diffusion: decoder passes;
    AR: token-producing encoder passes; speculative: the prompt pass, drafts and verifications);
    `decoder_passes` counts the denoising steps among them.
    """

    index: int  # the handle events carry (the prompt's index in a call)
    request: Request
    generator: torch.Generator
    started: float
    budget: int  # tokens it may commit (diffusion: whole canvases)
    step_events: bool = True
    tokens: list[int] = field(default_factory=list)
    eos_at: int | None = None  # index of the first EOS in `tokens`
    text: str = ""  # the completion's text handed out so far in text deltas
    # Where `text_delta` decodes from: tokens [0, read) decode to `read_text` (whole characters), and each call decodes
    # from `prefix` (the `read` before), so a call costs a few tokens' decoding, not the whole completion's.
    prefix: int = 0
    read: int = 0
    read_text: str = ""
    first_commit: float | None = None
    forward_passes: int = 0
    decoder_passes: int = 0
    canvases: int = 0  # committed canvases
    logprobs: list[TokenLogprob] | None = None  # one per committed token, when the request asked (AR)
    # While a canvas is denoised (diffusion, speculative drafts, editing):
    cache: KVCache | None = None
    canvas: torch.Tensor | None = None  # (1, C): the canvas the next decoder pass reads
    self_conditioning: torch.Tensor | None = None  # the previous step's probabilities (or logits), (1, C, V)
    tracker: StabilityTracker | None = None
    step: int = 0  # steps left in this canvas: N at its start, 0 when it runs out
    committed_canvas: torch.Tensor | None = None
    pending: torch.Tensor | None = None  # a sliding canvas's last commit, which its next pass encodes (diffusion.py)

    @classmethod
    def start(cls, index: int, request: Request, device: torch.device, budget: int,
              started: float | None = None, step_events: bool = True) -> RequestState:
        """The state of a request that starts now (or at `started`), its generator seeded with its seed."""
        generator = torch.Generator(device=device)
        generator.manual_seed(request.seed)
        state = cls(index, request, generator, time.perf_counter() if started is None else started, budget,
                    step_events)
        if request.logprobs is not None:
            state.logprobs = []
        return state

    @property
    def settings(self) -> SamplerSettings:
        return self.request.settings

    @property
    def finished(self) -> bool:
        return self.eos_at is not None or len(self.tokens) >= self.budget

    def completion(self) -> list[int]:
        """The generated tokens before the first EOS, at most max_new_tokens of them: a diffusion request commits
        whole canvases (as the reference does), but its text stops where the budget asked (as the server's
        max_tokens does), so `max_new_tokens=10` means ten tokens of text in every mode."""
        end = len(self.tokens) if self.eos_at is None else self.eos_at
        return self.tokens[: min(end, self.settings.max_new_tokens)]

    # -- the canvas loop ----------------------------------------------------------------------------------------
    def start_canvas(self, length: int, vocab_size: int, device: torch.device) -> None:
        """A canvas of uniform noise (the reference's first draw of each canvas) and a fresh step count."""
        self.canvas = uniform_tokens(length, vocab_size, self.generator, device)
        self.step = self.settings.max_denoising_steps
        self.self_conditioning = None
        self.tracker = StabilityTracker(self.settings.stability_threshold, 1, length, device)

    def count_decoder_pass(self) -> None:
        self.forward_passes += 1
        self.decoder_passes += 1

    # -- output -------------------------------------------------------------------------------------------------
    def commit(self, new: list[int]) -> None:
        """Append committed tokens, noting the first EOS among them."""
        if self.eos_at is None:
            eos = self.settings.eos_token_ids
            first = next((i for i, t in enumerate(new) if t in eos), None)
            if first is not None:
                self.eos_at = len(self.tokens) + first
        self.tokens.extend(new)
        if self.first_commit is None:
            self.first_commit = time.perf_counter()

    def text_delta(self, decode: Decode | None) -> str:
        """Text added since the last call, so that a request's deltas add up to its final text.

        A character still unfinished at the completion's end (a byte-level token can hold part of one, which only
        the tokens around it decode), which decodes as U+FFFD, is held back until a later token completes it; once
        the request has finished nothing is held back, and its final text is the whole completion decoded. Until
        then each call decodes only the tokens from `prefix` on (as vLLM's incremental detokenizer does): what
        tokens [prefix, read) decode to is already in `read_text`, so the new text is the rest of that decoding
        (decoding from a token both share, a decoder that drops a leading space drops it from both). A decoding
        that does not extend it (no byte-level tokenizer does that) falls back to decoding the whole completion.
        """
        if decode is None:
            return ""
        tokens = self.completion()
        if self.finished:
            ready = decode(tokens)
        else:
            settled, new = decode(tokens[self.prefix : self.read]), decode(tokens[self.prefix :])
            if new.startswith(settled):
                full = self.read_text + new[len(settled) :]
                if not full.endswith(REPLACEMENT):  # whole characters: the next call decodes from here
                    self.prefix, self.read, self.read_text = self.read, len(tokens), full
            else:
                full = decode(tokens)
            ready = full.rstrip(REPLACEMENT)
        if not ready.startswith(self.text):
            # Decoding more tokens changed earlier text (no byte-level tokenizer does): keep what was sent.
            ready = self.text + ready[len(self.text):]
        delta = ready[len(self.text):]
        self.text = ready
        return delta

    def stats(self, mode: str) -> GenerationStats:
        pad = self.settings.pad_token_id
        if mode == "diffusion" and pad is not None:  # whole canvases: the pad after the EOS is not generated text
            new_tokens = sum(1 for t in self.tokens if t != pad)
        else:
            new_tokens = len(self.tokens)
        return GenerationStats(
            prompt_tokens=len(self.request.prompt_ids),
            new_tokens=new_tokens,
            canvases=self.canvases,
            forward_passes=self.forward_passes,
            denoising_steps=self.decoder_passes,
            tokens_per_forward=new_tokens / self.forward_passes if self.forward_passes else 0.0,
            wall_time_s=time.perf_counter() - self.started,
            time_to_first_commit_s=None if self.first_commit is None else self.first_commit - self.started,
            finish_reason="eos" if self.eos_at is not None else "length",
        )

    def done(self, mode: str, decode: Decode | None, stats: GenerationStats | None = None) -> DoneEvent:
        """The request's `DoneEvent`: its result, with `stats` (default: `self.stats(mode)`)."""
        stats = self.stats(mode) if stats is None else stats
        logger.info("request %d done: %s", self.index, stats)
        completion = self.completion()
        result = GenerationResult(
            token_ids=list(self.tokens),
            completion_ids=list(completion),
            text=None if decode is None else decode(completion),
            prompt_ids=list(self.request.prompt_ids),
            stats=stats,
            mode=mode,
            seed=self.request.seed,
            logprobs=None if self.logprobs is None else self.logprobs[: len(completion)],
        )
        return DoneEvent(self.index, result)
