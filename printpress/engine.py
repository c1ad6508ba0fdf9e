"""The generation engine: the canvas loop (diffusion), the token loop (AR), batching and events.

Every request owns a `torch.Generator` seeded from its own seed, and every random draw is made per
request with the shape the reference uses for a batch of one. So a request gets the same tokens
whichever requests share its batch, and a request alone matches transformers' `generate` under
`torch.manual_seed`.

Diffusion requests are served by `DiffusionBatch` (continuous batching): each request keeps its own
KV cache, requests join and leave between decoder steps, and each step is one decoder pass over the
canvases of every request still denoising, so a finished request stops costing compute at once. The
server's scheduler drives the same object. AR batches are left padded into one cache; rows that
finish are dropped from it.

The loops are generators of small event dataclasses (`StepEvent`, `CommitEvent`, `DoneEvent`):
the CLI, the server and `Pipeline.generate` are all consumers of the same stream.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch

from printpress.cache import KVCache, StackedCache
from printpress.errors import GenerationError, PrintpressError
from printpress.sampling import (
    SamplerSettings,
    StabilityTracker,
    canvases_for,
    entropy_bound_accept,
    pad_after_eos,
    sample_canvas,
    sample_next_token,
    step_temperature,
    token_entropy,
    uniform_tokens,
)

logger = logging.getLogger(__name__)

Decode = Callable[[list[int]], str]


# --------------------------------------------------------------------------------------------
# Public data types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepEvent:
    """One denoising step of one request's canvas.

    `tokens` is the canvas fed to the next step: accepted positions hold the sampled token, the
    others fresh uniform noise. `argmax` is the current best guess, what would be committed if
    denoising stopped now.
    """

    request: int
    canvas: int
    step: int  # 1-based count of decoder passes in this canvas
    max_steps: int
    tokens: list[int]
    argmax: list[int]
    accepted: list[bool]  # accepted this step; every other position was re-noised
    stopped: bool  # the adaptive stop fired: this argmax is committed

    @property
    def renoised(self) -> list[bool]:
        return [not a for a in self.accepted]


@dataclass(frozen=True)
class CommitEvent:
    """Tokens appended to a request's output: a whole canvas (diffusion) or one token (AR)."""

    request: int
    canvas: int  # canvas index (diffusion) or token index (AR)
    token_ids: list[int]
    text: str  # text newly added by these tokens ("" without a tokenizer)
    finished: bool


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int  # generated tokens that are not pad (the EOS counts; the pad after it does not)
    canvases: int  # committed canvases (diffusion) or 0 (AR)
    forward_passes: int  # decoder passes (diffusion) or token-producing encoder passes (AR)
    denoising_steps: int  # decoder passes, as the reference counts them
    tokens_per_forward: float  # new_tokens / forward_passes, as the reference defines it
    wall_time_s: float
    time_to_first_commit_s: float | None  # until the first canvas (or token) was committed
    finish_reason: str  # "eos" or "length"


@dataclass
class GenerationResult:
    """What one request produced.

    `token_ids` holds every committed token. In diffusion mode that is whole canvases, with pad
    after the first EOS, exactly the new part of the reference's `sequences`. `text` is the
    completion up to (not including) the first EOS, or None without a tokenizer.
    """

    token_ids: list[int]
    completion_ids: list[int]  # the generated tokens up to (not including) the first EOS
    text: str | None
    prompt_ids: list[int]
    stats: GenerationStats
    mode: str = "diffusion"
    seed: int = 0


@dataclass(frozen=True)
class DoneEvent:
    request: int
    result: GenerationResult


Event = Union[StepEvent, CommitEvent, DoneEvent]


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    settings: SamplerSettings
    seed: int


# --------------------------------------------------------------------------------------------
# Per-request running state
# --------------------------------------------------------------------------------------------


@dataclass
class _Row:
    index: int
    request: Request
    generator: torch.Generator
    started: float
    canvases_left: int = 0
    tokens: list[int] = field(default_factory=list)
    forward_passes: int = 0
    canvases: int = 0
    first_commit: float | None = None
    eos_at: int | None = None  # index of the first EOS in `tokens`
    text: str = ""
    step_events: bool = True
    # Inside a canvas (diffusion only):
    cache: KVCache | None = None
    canvas: torch.Tensor | None = None  # (1, C): the canvas the next decoder pass reads
    self_conditioning: torch.Tensor | None = None  # the previous step's probabilities (or logits), (1, C, V)
    tracker: StabilityTracker | None = None
    step: int = 0
    committed_canvas: torch.Tensor | None = None

    @property
    def settings(self) -> SamplerSettings:
        return self.request.settings

    def completion(self) -> list[int]:
        return self.tokens if self.eos_at is None else self.tokens[: self.eos_at]


def _new_row(index: int, request: Request, device: torch.device, started: float) -> _Row:
    generator = torch.Generator(device=device)
    generator.manual_seed(request.seed)
    return _Row(index=index, request=request, generator=generator, started=started)


# --------------------------------------------------------------------------------------------
# Engine entry point
# --------------------------------------------------------------------------------------------


def run(
    model: torch.nn.Module,
    canvas_length: int,
    requests: Sequence[Request],
    decode: Decode | None = None,
    step_events: bool = True,
) -> Iterator[Event]:
    """Generate for a batch of requests, yielding events as they happen.

    All requests must share a mode. `decode` turns token ids into text (for CommitEvent.text and
    results). With `step_events=False` no StepEvent is built (saves a little work per step).
    """
    if not requests:
        return
    modes = {r.settings.mode for r in requests}
    if len(modes) != 1:
        raise GenerationError(f"one batch must use one mode, got {sorted(modes)}")
    for request in requests:
        request.settings.validate()
    check_prompts(model.config, canvas_length, requests)
    mode = requests[0].settings.mode
    if mode == "ar":
        yield from _autoregressive(model, requests, decode)
    elif mode == "speculative":
        from printpress.speculative import speculative

        yield from speculative(model, requests, decode, canvas_length=canvas_length, step_events=step_events)
    else:
        yield from _diffusion(model, canvas_length, requests, decode, step_events)


def new_token_budget(settings: SamplerSettings, canvas_length: int) -> int:
    """Positions a request may add to its sequence: whole canvases in diffusion mode."""
    if settings.mode in ("ar", "speculative"):
        return settings.max_new_tokens
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


def _left_pad(rows: list[_Row], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    longest = max(len(r.request.prompt_ids) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        prompt = row.request.prompt_ids
        ids[i, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, longest - len(prompt):] = True
    # A batch without padding passes no mask, like a single reference prompt.
    return ids, (None if bool(mask.all()) else mask)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------------------------
# Diffusion: the canvas loop
# --------------------------------------------------------------------------------------------


def _diffusion(
    model: torch.nn.Module,
    canvas_length: int,
    requests: Sequence[Request],
    decode: Decode | None,
    step_events: bool,
) -> Iterator[Event]:
    batch = DiffusionBatch(model, canvas_length, decode)
    for index, request in enumerate(requests):
        batch.add(index, request, step_events)
    while batch:
        yield from batch.step()


def _pad_id(model: torch.nn.Module, rows: list[_Row]) -> int:
    pad = rows[0].settings.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


class DiffusionBatch:
    """Diffusion requests decoded together: one shared decoder pass per step (continuous batching).

    Requests join (`add`) and leave (`remove`, or when they finish) between steps, and each request
    moves through its canvases on its own clock: a request whose canvas stopped early commits it,
    encodes it into its cache and starts its next canvas at the next step, while the others go on.

    Each request owns a one-row `KVCache` and its own generator. A step stacks the caches of the
    requests it serves (`StackedCache`, rebuilt only when a request joins, commits or leaves; a request
    alone reads its own cache), runs one decoder pass, and samples each row with its own generator
    in the reference's order. So a request's tokens do not depend on who shares its steps.
    """

    def __init__(self, model: torch.nn.Module, canvas_length: int, decode: Decode | None = None) -> None:
        self.model = model
        self.canvas_length = canvas_length
        self.decode = decode
        self.device = _model_device(model)
        self.rows: list[_Row] = []
        self._stacked: StackedCache | None = None
        self._stacked_key: tuple | None = None
        # In fp32 the reference's self-conditioning softmax equals the sampler's probabilities bit for bit, so
        # they are passed on; in half precision it first casts the logits, so the logits are passed instead.
        self._pass_probs = model.dtype == torch.float32

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def add(self, handle: int, request: Request, step_events: bool = True) -> None:
        """Encode the prompt of a new request and start its first canvas; events carry `handle`."""
        request.settings.validate()
        check_prompts(self.model.config, self.canvas_length, [request])
        row = _new_row(handle, request, self.device, time.perf_counter())
        row.step_events = step_events
        row.canvases_left = canvases_for(row.settings.max_new_tokens, self.canvas_length)
        prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        row.cache = self.model.new_cache(1, prompt.shape[1] + row.canvases_left * self.canvas_length)
        self.model.encode(prompt, row.cache, logits="none")
        self._start_canvas(row)
        self.rows.append(row)

    def remove(self, handle: int) -> None:
        """Drop a request (cancelled): it costs nothing from the next step on."""
        self.rows = [row for row in self.rows if row.index != handle]

    def _start_canvas(self, row: _Row) -> None:
        row.canvas = uniform_tokens(self.canvas_length, self.model.config.vocab_size, row.generator, self.device)
        row.step = row.settings.max_denoising_steps
        row.self_conditioning = None
        row.tracker = StabilityTracker(row.settings.stability_threshold, 1, self.canvas_length, self.device)

    @torch.no_grad()
    def step(self) -> list[Event]:
        """One decoder pass over every request; returns its step, commit and done events."""
        model, rows = self.model, self.rows
        canvas = torch.cat([row.canvas for row in rows])
        conditioning, mask = self._self_conditioning(rows)
        cache = self._cache(rows)
        if self._pass_probs:
            logits = model.denoise(canvas, cache, self_conditioning_probs=conditioning, self_conditioning_mask=mask)
        else:
            logits = model.denoise(canvas, cache, conditioning, self_conditioning_mask=mask)
        outcome = _sample_step(logits, canvas, rows, model.config.vocab_size, self.canvas_length, self.device)
        fed_back = outcome.probs if self._pass_probs else outcome.processed.to(model.dtype)
        confident = outcome.entropy.mean(dim=-1)
        events: list[Event] = []
        finished: list[_Row] = []
        for j, row in enumerate(rows):
            row.forward_passes += 1
            stable = bool(row.tracker.update(outcome.argmax[j : j + 1])[0])
            stopped = stable and bool(confident[j] < row.settings.confidence_threshold)
            row.step -= 1
            if row.step_events:
                events.append(_step_event(row, row.canvases, outcome, j, stopped))
            if stopped or row.step == 0:
                row.committed_canvas = outcome.argmax[j].clone()
                finished.append(row)
            else:
                row.canvas = outcome.next_canvas[j : j + 1]
                row.self_conditioning = fed_back[j : j + 1]
        for row in finished:
            events.extend(_commit_canvas(row, row.canvases, self.decode))
            if row.canvases_left > 0 and row.eos_at is None:
                # The next canvas sees the committed one through the cache, as the reference re-encodes it.
                model.encode(row.committed_canvas[None], row.cache, logits="none")
                self._start_canvas(row)
            else:
                result = _result(row, "diffusion", self.decode)
                logger.info("request %d done: %s", row.index, result.stats)
                events.append(DoneEvent(row.index, result))
                self.rows.remove(row)
        return events

    def _cache(self, rows: list[_Row]):
        if len(rows) == 1:
            return rows[0].cache
        key = tuple((id(row), row.cache.length) for row in rows)
        if key != self._stacked_key:
            self._stacked = StackedCache([row.cache for row in rows], self.canvas_length)
            self._stacked_key = key
        return self._stacked

    def _self_conditioning(self, rows: list[_Row]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The previous step's signal per row; rows at their first step get zeros, masked out."""
        previous = [row.self_conditioning for row in rows]
        if all(p is None for p in previous):
            return None, None
        template = next(p for p in previous if p is not None)
        stacked = torch.cat([template.new_zeros(template.shape) if p is None else p for p in previous])
        if all(p is not None for p in previous):
            return stacked, None
        mask = torch.tensor([p is not None for p in previous], device=self.device)
        return stacked, mask


@dataclass
class _StepOutcome:
    processed: torch.Tensor  # temperature-scaled logits (b, C, V)
    probs: torch.Tensor  # their float32 softmax
    argmax: torch.Tensor  # (b, C)
    entropy: torch.Tensor  # (b, C)
    accepted: torch.Tensor  # (b, C) bool
    next_canvas: torch.Tensor  # (b, C)


def _sample_step(
    logits: torch.Tensor,
    canvas: torch.Tensor,
    rows: list[_Row],
    vocab: int,
    canvas_length: int,
    device: torch.device,
) -> _StepOutcome:
    """Temperature, sampling, entropy-bound acceptance and re-noising for one decoder pass.

    Random draws per row, in the reference's order: one multinomial over the canvas, then one
    randint for re-noising.
    """
    processed = torch.empty_like(logits)
    for j, row in enumerate(rows):
        processed[j] = logits[j] / step_temperature(row.step, row.settings)
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    entropy = token_entropy(processed)
    argmax = torch.argmax(processed, dim=-1)
    accepted = torch.empty_like(canvas, dtype=torch.bool)
    next_canvas = torch.empty_like(canvas)
    for j, row in enumerate(rows):
        # The bound is compared row by row as a Python float, exactly as the reference compares it.
        row_accepted = entropy_bound_accept(entropy[j : j + 1], row.settings.entropy_bound)[0]
        accepted[j] = row_accepted
        if row.settings.sample_accepted_only:
            noise = uniform_tokens(canvas_length, vocab, row.generator, device)[0]
            noise[row_accepted] = sample_canvas(probs[j][row_accepted], row.generator)
            next_canvas[j] = noise
            continue
        sampled = sample_canvas(probs[j], row.generator)  # the reference's order: sample, then re-noise
        noise = uniform_tokens(canvas_length, vocab, row.generator, device)[0]
        next_canvas[j] = torch.where(row_accepted, sampled, noise)
    return _StepOutcome(processed, probs, argmax, entropy, accepted, next_canvas)


def _step_event(row: _Row, canvas_index: int, outcome: _StepOutcome, j: int, stopped: bool) -> StepEvent:
    return StepEvent(
        request=row.index,
        canvas=canvas_index,
        step=row.settings.max_denoising_steps - row.step,
        max_steps=row.settings.max_denoising_steps,
        tokens=outcome.next_canvas[j].tolist(),
        argmax=outcome.argmax[j].tolist(),
        accepted=outcome.accepted[j].tolist(),
        stopped=stopped,
    )


def _commit_canvas(row: _Row, canvas_index: int, decode: Decode | None) -> Iterator[CommitEvent]:
    settings = row.settings
    tokens, has_eos = pad_after_eos(row.committed_canvas, settings.eos_token_ids, settings.pad_token_id)
    row.committed_canvas = tokens
    new = tokens.tolist()
    if has_eos:
        eos = set(settings.eos_token_ids)
        row.eos_at = len(row.tokens) + next(i for i, t in enumerate(new) if t in eos)
    row.tokens.extend(new)
    logger.debug("request %d: canvas %d committed after %d decoder passes in all", row.index, canvas_index,
                 row.forward_passes)
    row.canvases += 1
    row.canvases_left -= 1
    if row.first_commit is None:
        row.first_commit = time.perf_counter()
    finished = has_eos or row.canvases_left == 0
    yield CommitEvent(row.index, canvas_index, new, _text_delta(row, decode), finished)


def _text_delta(row: _Row, decode: Decode | None) -> str:
    """Text added since the last commit (decoding the whole completion keeps multi-token characters whole)."""
    if decode is None:
        return ""
    full = decode(row.completion())
    delta = full[len(row.text):] if full.startswith(row.text) else full
    row.text = full
    return delta


def _result(row: _Row, mode: str, decode: Decode | None) -> GenerationResult:
    now = time.perf_counter()
    pad = row.settings.pad_token_id
    if mode == "diffusion" and pad is not None:
        new_tokens = sum(1 for t in row.tokens if t != pad)
    else:
        new_tokens = len(row.tokens)
    stats = GenerationStats(
        prompt_tokens=len(row.request.prompt_ids),
        new_tokens=new_tokens,
        canvases=row.canvases,
        forward_passes=row.forward_passes,
        denoising_steps=row.forward_passes if mode == "diffusion" else 0,
        tokens_per_forward=new_tokens / row.forward_passes if row.forward_passes else 0.0,
        wall_time_s=now - row.started,
        time_to_first_commit_s=None if row.first_commit is None else row.first_commit - row.started,
        finish_reason="eos" if row.eos_at is not None else "length",
    )
    text = decode(row.completion()) if decode is not None else None
    return GenerationResult(
        token_ids=list(row.tokens),
        completion_ids=list(row.completion()),
        text=text,
        prompt_ids=list(row.request.prompt_ids),
        stats=stats,
        mode=mode,
        seed=row.request.seed,
    )


# --------------------------------------------------------------------------------------------
# Autoregressive: the encoder as a causal LM
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def _autoregressive(model: torch.nn.Module, requests: Sequence[Request], decode: Decode | None) -> Iterator[Event]:
    device = _model_device(model)
    started = time.perf_counter()
    rows = [_new_row(i, r, device, started) for i, r in enumerate(requests)]
    ids, mask = _left_pad(rows, _pad_id(model, rows), device)
    longest_budget = max(row.settings.max_new_tokens for row in rows)
    cache = model.new_cache(len(rows), ids.shape[1] + longest_budget)
    logits = model.encode(ids, cache, attention_mask=mask, logits="last")
    while True:
        keep: list[int] = []
        next_ids: list[int] = []
        for position, row in enumerate(rows):
            token = sample_next_token(logits[position, -1], row.settings, row.generator)
            row.forward_passes += 1
            if token in row.settings.eos_token_ids:
                row.eos_at = len(row.tokens)
            row.tokens.append(token)
            if row.first_commit is None:
                row.first_commit = time.perf_counter()
            finished = row.eos_at is not None or len(row.tokens) >= row.settings.max_new_tokens
            yield CommitEvent(row.index, len(row.tokens) - 1, [token], _text_delta(row, decode), finished)
            if finished:
                result = _result(row, "ar", decode)
                logger.info("request %d done: %s", row.index, result.stats)
                yield DoneEvent(row.index, result)
            else:
                keep.append(position)
                next_ids.append(token)
        if not keep:
            return
        if len(keep) < len(rows):
            cache.select(torch.tensor(keep, dtype=torch.long, device=device))
            rows = [rows[k] for k in keep]
        step_ids = torch.tensor(next_ids, dtype=torch.long, device=device)[:, None]
        logits = model.encode(step_ids, cache, logits="last")


# --------------------------------------------------------------------------------------------
# Pipeline: model + tokenizer + defaults, the Python API
# --------------------------------------------------------------------------------------------

Prompt = Union[str, Sequence[str], Sequence[int], Sequence[Sequence[int]], torch.Tensor]


DEFAULT_MODEL = "shakespeare-joint"
SPECULATIVE_DRAFT_STEPS = 1  # mode="speculative": decoder passes per draft unless max_denoising_steps is given


def default_model_path() -> Path:
    """The model `printpress.load()` uses when given no path: the one shipped in the repo's models/.

    `PRINTPRESS_DEFAULT_MODEL` may name another folder or hub id.
    """
    override = os.environ.get("PRINTPRESS_DEFAULT_MODEL")
    if override:
        return Path(override)
    folder = Path(__file__).resolve().parents[1] / "models" / DEFAULT_MODEL
    if not (folder / "config.json").exists():
        raise PrintpressError(f"the default model is not at {folder} (it ships with the source repository); "
                              "pass a model folder or hub id")
    return folder


class Pipeline:
    """A loaded model with its tokenizer and generation defaults.

    >>> pipe = printpress.load("path/to/model")
    >>> pipe.generate("Once upon a time", max_new_tokens=64, seed=0).text
    """

    def __init__(self, model: torch.nn.Module, config, generation_config, tokenizer=None) -> None:
        self.model = model
        self.config = config
        self.generation_config = generation_config
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path | None = None,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> Pipeline:
        from printpress.checkpoint import load_model

        if path_or_id is None:
            path_or_id = default_model_path()
        model, config, generation_config, tokenizer = load_model(str(path_or_id), dtype=dtype, device=device)
        model.eval()
        return cls(model, config, generation_config, tokenizer)

    @property
    def canvas_length(self) -> int:
        return self.config.canvas_length

    def default_settings(self) -> SamplerSettings:
        """The checkpoint's generation_config.json as sampler settings."""
        g = self.generation_config
        eos = g.eos_token_id
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        return SamplerSettings(
            max_new_tokens=g.max_new_tokens,
            max_denoising_steps=g.max_denoising_steps,
            entropy_bound=g.entropy_bound,
            t_min=g.t_min,
            t_max=g.t_max,
            stability_threshold=g.stability_threshold,
            confidence_threshold=g.confidence_threshold,
            eos_token_ids=eos_ids,
            pad_token_id=g.pad_token_id,
        )

    def settings(self, **overrides) -> SamplerSettings:
        """Checkpoint defaults with the given overrides (any `SamplerSettings` field but the pad id; None keeps
        the default), validated."""
        unknown = sorted(set(overrides) - SETTING_NAMES)
        if unknown:
            raise GenerationError(f"unknown generation setting(s): {', '.join(unknown)}")
        mode = overrides.get("mode") or self.default_settings().mode
        if mode == "diffusion" and (overrides.get("temperature") is not None or overrides.get("top_k") is not None):
            raise GenerationError("temperature and top_k apply to mode='ar' and 'speculative'; diffusion uses "
                                  "t_min/t_max")
        if mode == "speculative" and overrides.get("max_denoising_steps") is None:
            # Draft steps: one is the fastest setting measured on the shipped model (docs/benchmarks-speculative.md);
            # the checkpoint's step count is meant for whole canvases.
            overrides = {**overrides, "max_denoising_steps": SPECULATIVE_DRAFT_STEPS}
        return self.default_settings().with_overrides(**overrides).validate()

    # -- text <-> ids ---------------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Token ids of a text prompt, after the checkpoint's BOS token.

        BOS is added here rather than by the tokenizer's post-processor, which not every
        tokenizer.json has; special-token text in the prompt (chat markup) is parsed as such.
        """
        if self.tokenizer is None:
            raise GenerationError("this model has no tokenizer (tokenizer.json); pass token ids instead of text")
        if not text:
            raise GenerationError("the prompt is empty; give at least one character")
        # A flag of the shared Tokenizer object that other code may have flipped: set it every time.
        self.tokenizer.encode_special_tokens = False
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        bos = self.generation_config.bos_token_id
        return ids if bos is None or ids[:1] == [bos] else [bos] + ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise GenerationError("this model has no tokenizer (tokenizer.json); cannot turn ids into text")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decoder(self) -> Decode | None:
        return None if self.tokenizer is None else self.decode

    def prompt_ids(self, prompt: Prompt) -> tuple[list[list[int]], bool]:
        """Normalise a prompt argument to a list of token-id lists; the flag says "a single prompt"."""
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() not in (1, 2):
                raise GenerationError(f"a tensor prompt must be 1-D or 2-D, got shape {tuple(prompt.shape)}")
            single = prompt.dim() == 1
            rows = [prompt.tolist()] if single else prompt.tolist()
            return rows, single
        if isinstance(prompt, str):
            return [self.encode_text(prompt)], True
        if not isinstance(prompt, Sequence) or len(prompt) == 0:
            raise GenerationError("the prompt is empty; give text, token ids, or a non-empty list of them")
        if all(isinstance(p, str) for p in prompt):
            return [self.encode_text(p) for p in prompt], False
        if all(_is_token(p) for p in prompt):
            return [[int(p) for p in prompt]], True
        if all(isinstance(p, Sequence) and not isinstance(p, str) and all(_is_token(t) for t in p) for p in prompt):
            return [[int(t) for t in p] for p in prompt], False
        raise GenerationError("a prompt must be text, a list of token ids, or a list of either")

    # -- generation -----------------------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt,
        *,
        seed: int | Sequence[int] | None = None,
        step_events: bool = True,
        **overrides,
    ) -> Iterator[Event]:
        """Events for each denoising step, each commit and each finished request (see `run`)."""
        requests, _ = self._requests(prompt, seed, overrides)
        return run(self.model, self.canvas_length, requests, self._decoder(), step_events=step_events)

    def generate(
        self,
        prompt: Prompt,
        *,
        seed: int | Sequence[int] | None = None,
        on_event: Callable[[Event], None] | None = None,
        **overrides,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (returns a result) or a list of prompts (returns a list).

        `seed` seeds each request's own generator (one seed for all, or one per prompt); without a
        seed one is drawn from torch's global generator, so `torch.manual_seed` still makes runs
        repeatable. Other keyword arguments override the checkpoint defaults: mode ("diffusion"
        or "ar"), max_new_tokens, max_denoising_steps, entropy_bound, t_min, t_max,
        stability_threshold, confidence_threshold, eos_token_ids, temperature and top_k (AR).
        """
        requests, single = self._requests(prompt, seed, overrides)
        results: list[GenerationResult | None] = [None] * len(requests)
        events = run(self.model, self.canvas_length, requests, self._decoder(), step_events=on_event is not None)
        for event in events:
            if on_event is not None:
                on_event(event)
            if isinstance(event, DoneEvent):
                results[event.request] = event.result
        return results[0] if single else list(results)

    def infill(self, prefix, suffix, **kwargs):
        """Generate the text between `prefix` and `suffix` (printpress.editing.infill): an EditResult."""
        from printpress.editing import infill

        return infill(self, prefix, suffix, **kwargs)

    def rewrite(self, text: str, start: int, end: int, **kwargs):
        """Regenerate the characters text[start:end] in place (printpress.editing.rewrite): an EditResult."""
        from printpress.editing import rewrite

        return rewrite(self, text, start, end, **kwargs)

    def _requests(self, prompt: Prompt, seed, overrides: dict) -> tuple[list[Request], bool]:
        settings = self.settings(**overrides)
        prompts, single = self.prompt_ids(prompt)
        seeds = _seeds(seed, len(prompts))
        return [Request(ids, settings, s) for ids, s in zip(prompts, seeds)], single


# What a caller may set per request: every sampler field except the pad id, which is the checkpoint's.
SETTING_NAMES = {f.name for f in dataclasses.fields(SamplerSettings)} - {"pad_token_id"}


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seeds(seed: int | Sequence[int] | None, count: int) -> list[int]:
    if seed is None:
        # Drawn from the global generator so that torch.manual_seed makes unseeded calls repeatable.
        return [int(torch.randint(0, 2**62, (1,)))] * count
    seeds = [seed] * count if _is_token(seed) else list(seed)
    if len(seeds) != count:
        raise GenerationError(f"got {len(seeds)} seeds for {count} prompts")
    for s in seeds:
        if not _is_token(s) or not 0 <= s < 2**64:
            raise GenerationError(f"a seed must be an integer in [0, 2**64), got {s!r}")
    return seeds
