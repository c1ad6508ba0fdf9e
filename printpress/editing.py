"""Infilling and span rewriting: generate a middle conditioned on the text on both sides of it.

The shipped models were trained with block diffusion only (a clean prefix through the encoder's KV
cache, a uniformly noised canvas through the bidirectional decoder) and have no mask token. So the
right-hand context enters the one place the decoder can see it, the canvas itself:

    cache:  <bos> prefix                    (encoded once, causal, as any prompt)
    canvas: [ m_1 ... m_L | s_1 ... s_K ]   (L free positions, then K suffix tokens *clamped*)

The free positions start as uniform noise and are denoised by the engine's canvas step
(printpress/canvas.py); the clamped positions always hold the true suffix tokens: they are never
sampled, never re-noised and never count towards acceptance, the entropy bound or the stopping rule.
During training a canvas position is left clean with probability 1 - t, so "some canvas positions are
already right" is a state the decoder has seen; a clean run at the canvas end is just a low-noise
corner of it. K defaults to what fills the trained canvas (canvas_length - L); `suffix_window` may
show more (a canvas longer than trained) or none. The length L is either given, taken from the
original span (rewrite), or searched: each candidate length is denoised and the one after which the
start of the suffix is most probable under the model's own causal head wins (the same text scored for
every candidate, so no per-character or per-token normalisation tilts the choice towards long or short
middles; the earlier per-character score of middle + suffix chose middles full of cheap newlines and speaker
names). Design and measurements: docs/decisions/0005-infilling.md, docs/benchmarks-infill.md.

    >>> pipe = printpress.load()
    >>> pipe.infill("ROMEO:\nBut soft, what light", " breaks?\n", length=6, seed=0).text
    >>> pipe.rewrite(text, start, end, seed=0)          # EditResult: text, middle, start, end, stats
    >>> for event in infill_stream(pipe, prefix, suffix, seed=0): ...   # SpanStepEvent, CommitEvent, DoneEvent

Everything is a generator of the engine's events (a `SpanStepEvent` per denoising step, one
`CommitEvent` for the chosen middle, one `DoneEvent` holding an `EditResult`), so the CLI and an HTTP
endpoint only consume `infill_stream` / `rewrite_stream`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from printpress.canvas import advance, denoise, denoise_step
from printpress.errors import GenerationError
from printpress.events import (
    Candidate,
    CommitEvent,
    DoneEvent,
    EditResult,
    EditStats,
    Event,
    SpanStepEvent,
)
from printpress.request import Request, RequestState, model_device
from printpress.sampling import SamplerSettings

Text = str | Sequence[int]

# Fractions of the canvas tried when no length is given to `infill` (canvas 32: 4, 8, 12, 16, 24 tokens).
SEARCH_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4)
FEEDBACK = ("predicted", "exact")


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def infill(pipe, prefix: Text, suffix: Text, *, on_event: Callable[[Event], None] | None = None, **kwargs) -> EditResult:
    """Generate the text between `prefix` and `suffix` (see `infill_stream` for the arguments)."""
    return _consume(infill_stream(pipe, prefix, suffix, step_events=on_event is not None, **kwargs), on_event)


def rewrite(pipe, text: str, start: int, end: int, *, on_event: Callable[[Event], None] | None = None,
            **kwargs) -> EditResult:
    """Regenerate the characters `text[start:end]` in place (see `rewrite_stream`)."""
    return _consume(rewrite_stream(pipe, text, start, end, step_events=on_event is not None, **kwargs), on_event)


def rewrite_stream(pipe, text: str, start: int, end: int, *, length: int | Sequence[int] | None = None,
                   **kwargs) -> Iterator[Event]:
    """Events of `rewrite`: the span's new text is generated between `text[:start]` and `text[end:]`.

    Without `length` the new span has as many tokens as the old one (tokenised on its own); pass an
    int, or a list of lengths to search. An empty span (start == end) inserts text and needs a length.
    """
    check_span(text, start, end)
    if pipe.tokenizer is None:
        raise GenerationError("rewrite works on text and this model has no tokenizer (tokenizer.json)")
    if length is None:
        if start == end:
            raise GenerationError("the span is empty (start == end); give a length to insert text there")
        # Counted as the model will write it: with the blank before it, which a byte-level BPE puts on the word.
        length = len(_tokenize(pipe, _trailing_blank(text[:start]) + text[start:end]))
        if length > pipe.canvas_length:
            raise GenerationError(
                f"the span [{start}, {end}) is {length} tokens but a span is rewritten in one canvas of "
                f"{pipe.canvas_length}; choose a shorter span or pass a length")
    return infill_stream(pipe, text[:start], text[end:], length=length, **kwargs)


def infill_stream(
    pipe,
    prefix: Text,
    suffix: Text,
    *,
    length: int | Sequence[int] | None = None,
    seed: int | None = None,
    suffix_window: int | None = None,
    suffix_feedback: str = "predicted",
    step_events: bool = True,
    **overrides,
) -> Iterator[Event]:
    """Events for infilling the middle between `prefix` and `suffix` (text, or token ids without <bos>).

    length: tokens of the middle, at most the canvas length; a list of lengths to search; None to search
        `default_lengths(canvas_length)`. A search denoises every candidate (candidate i with seed + i)
        and keeps the one after which the first `canvas_length` suffix tokens have the lowest NLL under the
        model's own causal head (`Candidate.score`; without a suffix, the middle's NLL per token).
    suffix_window: suffix tokens clamped into the canvas; default canvas_length - length (the trained
        canvas size); larger values lengthen the canvas beyond what the model was trained on.
    suffix_feedback: the self-conditioning signal at clamped positions: "predicted" (the model's own
        distribution there, as in training) or "exact" (a one-hot of the true token).
    seed: seeds the sampler (default: drawn from torch's global generator).
    overrides: sampler settings as for `Pipeline.generate` (max_denoising_steps, entropy_bound, t_min,
        t_max, stability_threshold, confidence_threshold, eos_token_ids, sample_accepted_only).
    """
    if overrides.get("mode") not in (None, "diffusion"):
        raise GenerationError(f"editing uses the diffusion sampler; mode={overrides['mode']!r} is not supported")
    if overrides.get("max_new_tokens") is not None:
        raise GenerationError("editing generates `length` tokens; max_new_tokens does not apply")
    if overrides.get("sliding"):
        raise GenerationError("editing denoises its canvas in place between the prefix and the suffix; sliding does "
                              "not apply")
    # Whole canvases whatever the checkpoint's default or the request says (an explicit False included), with their steps.
    settings = pipe.settings(**{**overrides, "sliding": False})
    # A blank at the end of a text prefix is left out of the context: the model writes it as the start of the
    # middle's first word (" light", as the BPE tokenises words), and `_fit_middle` joins the two without doubling it.
    context_prefix = prefix[: len(prefix) - len(_trailing_blank(prefix))] if isinstance(prefix, str) else prefix
    prefix_ids, suffix_ids = _ids(pipe, context_prefix, "prefix"), _ids(pipe, suffix, "suffix")
    if not prefix_ids and not suffix_ids:
        raise GenerationError("nothing to condition on: the prefix and the suffix are both empty")
    lengths = _lengths(length, pipe.canvas_length)
    if suffix_window is not None and (not _is_int(suffix_window) or suffix_window < 0):
        raise GenerationError(f"suffix_window must be an integer >= 0, got {suffix_window!r}")
    if suffix_feedback not in FEEDBACK:
        raise GenerationError(f"suffix_feedback must be one of {', '.join(FEEDBACK)}, got {suffix_feedback!r}")
    seed = _seed(seed)
    bos = pipe.generation_config.bos_token_id
    context = ([] if bos is None else [int(bos)]) + prefix_ids
    if not context:
        raise GenerationError("this model has no <bos> token, so the prefix cannot be empty")
    windows = [len(suffix_ids[: pipe.canvas_length - n if suffix_window is None else suffix_window]) for n in lengths]
    scored = suffix_ids[: pipe.canvas_length]
    limit = pipe.config.text.max_position_embeddings
    longest = len(context) + max(max(n + k for n, k in zip(lengths, windows)), max(lengths) + len(scored))
    if longest > limit:
        raise GenerationError(f"the prefix ({len(context)} tokens) plus the canvas and scored suffix need {longest} "
                              f"positions; the model's position limit is {limit}; shorten the prefix")
    _check_vocab(context + suffix_ids, pipe.config.text.vocab_size)
    return _edit(pipe, settings, context, prefix, suffix, suffix_ids, lengths, windows, seed, step_events,
                 suffix_feedback == "exact")


def default_lengths(canvas_length: int) -> list[int]:
    """Candidate lengths of a search: fractions of the canvas (canvas 32 -> 4, 8, 12, 16, 24)."""
    return sorted({max(1, round(canvas_length * f)) for f in SEARCH_FRACTIONS})


def check_span(text: str, start: int, end: int) -> None:
    """One clear error for a character span that does not fit `text`."""
    if not isinstance(text, str):
        raise GenerationError(f"the text to rewrite must be a string, got {type(text).__name__}")
    if not _is_int(start) or not _is_int(end):
        raise GenerationError(f"a span is two integer character offsets, got {start!r}:{end!r}")
    if start < 0:
        raise GenerationError(f"the span start {start} is negative")
    if start > end:
        raise GenerationError(f"the span start {start} is after its end {end}")
    if end > len(text):
        raise GenerationError(f"the span end {end} is beyond the text's {len(text)} characters")


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def _edit(pipe, settings: SamplerSettings, context: list[int], prefix: Text, suffix: Text, suffix_ids: list[int],
          lengths: list[int], windows: list[int], seed: int, step_events: bool, exact_feedback: bool) -> Iterator[Event]:
    started = time.perf_counter()
    model = pipe.model
    device = model_device(model)
    prefix_text, suffix_text = _as_text(pipe, prefix), _as_text(pipe, suffix)
    scored = suffix_ids[: pipe.canvas_length]
    room = max(max(n + k for n, k in zip(lengths, windows)), max(lengths) + len(scored))
    cache = model.new_cache(1, len(context) + room)
    # The prefix's last next-token logits predict the middle's first token: kept for scoring the join.
    first_logits = model.encode(torch.tensor([context], device=device), cache, logits="last")[0, -1]
    banned = _banned_ids(pipe, settings)
    candidates: list[Candidate] = []
    scoring_passes = 0
    for index, (length, window) in enumerate(zip(lengths, windows)):
        clamp = torch.tensor([suffix_ids[:window]], dtype=torch.long, device=device)
        # Candidate i is request 0's canvas i, sampled with its own seed.
        state = RequestState.start(0, Request(context, settings, (seed + index) % 2**64), device, budget=length,
                                   step_events=step_events)
        middle = yield from _denoise_span(model, cache, state, length, clamp, banned, index, exact_feedback)
        middle_nll = suffix_nll = 0.0
        if len(lengths) > 1:
            middle_nll, suffix_nll = _join_nll(pipe, cache, first_logits, middle, scored)
            scoring_passes += 1
        text = None if pipe.tokenizer is None else _fit_middle(pipe.decode(middle), prefix_text, suffix_text)
        candidates.append(Candidate(length, state.request.seed, middle, text, middle_nll, suffix_nll, len(scored),
                                    state.decoder_passes))
    chosen = min(range(len(candidates)), key=lambda i: candidates[i].score) if len(candidates) > 1 else 0
    best = candidates[chosen]
    yield CommitEvent(0, chosen, list(best.middle_ids), best.middle or "", True)
    text = None if best.middle is None or prefix_text is None else prefix_text + best.middle + suffix_text
    start = len(prefix_text) if prefix_text is not None else 0
    stats = EditStats(
        prefix_tokens=len(context),
        suffix_tokens=len(suffix_ids),
        clamped_tokens=windows[chosen],
        length=best.length,
        candidates=len(candidates),
        forward_passes=sum(c.forward_passes for c in candidates),
        scoring_passes=scoring_passes,
        wall_time_s=time.perf_counter() - started,
    )
    result = EditResult(text=text, middle=best.middle, start=start, end=start + len(best.middle or ""),
                        middle_ids=list(best.middle_ids), seed=seed, stats=stats,
                        candidates=candidates if len(candidates) > 1 else [])
    yield DoneEvent(0, result)


def _denoise_span(model, cache, state: RequestState, length: int, clamp: torch.Tensor, banned: torch.Tensor,
                  canvas_index: int, exact_feedback: bool = False) -> Iterator[SpanStepEvent]:
    """Denoise `length` free positions in front of the clamped suffix tokens `clamp` (1, K).

    The engine's canvas step (printpress/canvas.py) restricted to the free positions, with its adaptive stop;
    `state.canvas` holds the free positions. Yields SpanStepEvents; returns the committed argmax middle.
    """
    vocab = model.config.vocab_size
    clamped = clamp.shape[1]
    state.start_canvas(length, vocab, clamp.device)
    while True:
        logits = denoise(model, torch.cat([state.canvas, clamp], dim=1), cache, state.self_conditioning)
        state.count_decoder_pass()
        # A middle is text inside a document: no <bos>, <eos> or <pad> may be chosen for a free position.
        outcome = denoise_step(logits, [state], vocab, free=length, banned=banned)
        stopped = advance(state, outcome, 0)
        state.canvas = outcome.next_canvas
        if state.step_events:
            yield SpanStepEvent(
                request=state.index, canvas=canvas_index, step=state.settings.max_denoising_steps - state.step,
                max_steps=state.settings.max_denoising_steps,
                tokens=outcome.next_canvas[0].tolist() + clamp[0].tolist(),
                argmax=outcome.argmax[0].tolist() + clamp[0].tolist(),
                accepted=outcome.accepted[0].tolist() + [True] * clamped,
                stopped=stopped, span=length,
            )
        if stopped or state.step == 0:
            return outcome.argmax[0].tolist()
        if exact_feedback and clamped:
            # A one-hot at each clamped position: probabilities in fp32, logits of 0 / -inf otherwise.
            onehot = torch.nn.functional.one_hot(clamp, vocab).bool()
            if model.dtype == torch.float32:
                outcome.probs[:, length:] = onehot.float()
            else:
                processed = outcome.processed
                processed[:, length:] = torch.zeros_like(processed[:, length:]).masked_fill(~onehot, float("-inf"))
        state.self_conditioning = outcome.feedback(model.dtype)


def _join_nll(pipe, cache, first_logits: torch.Tensor, middle: list[int], scored: list[int]) -> tuple[float, float]:
    """Summed NLLs of the middle, and of the scored suffix tokens after it, following the cached prefix, under the
    model's causal head (one encoder pass)."""
    scratch = cache.rows([0])  # a copy: the prefix cache stays as it is for the next candidate
    ids = middle + scored
    logits = pipe.model.encode(torch.tensor([ids], device=cache.device), scratch, logits="all")[0]
    logits = torch.cat([first_logits[None], logits[:-1]]).float()
    targets = torch.tensor(ids, device=cache.device)
    nll = -torch.log_softmax(logits, dim=-1)[torch.arange(len(ids)), targets]
    return float(nll[: len(middle)].sum()), float(nll[len(middle):].sum())


# --------------------------------------------------------------------------------------------
# Input handling
# --------------------------------------------------------------------------------------------


def _consume(events: Iterator[Event], on_event: Callable[[Event], None] | None) -> EditResult:
    result = None
    for event in events:
        if on_event is not None:
            on_event(event)
        if isinstance(event, DoneEvent):
            result = event.result
    return result


def _tokenize(pipe, text: str) -> list[int]:
    # A flag of the shared Tokenizer object that other code may flip: set it every time (as Pipeline does).
    pipe.tokenizer.encode_special_tokens = False
    return list(pipe.tokenizer.encode(text, add_special_tokens=False).ids)


def _ids(pipe, value: Text, name: str) -> list[int]:
    if isinstance(value, str):
        if not value:
            return []
        if pipe.tokenizer is None:
            raise GenerationError(f"this model has no tokenizer (tokenizer.json); give the {name} as token ids")
        return _tokenize(pipe, value)
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, Sequence) or not all(_is_int(t) for t in value):
        raise GenerationError(f"the {name} must be text or a list of token ids")
    return [int(t) for t in value]


def _as_text(pipe, value: Text) -> str | None:
    if isinstance(value, str):
        return value
    return None if pipe.tokenizer is None else pipe.decode(list(value))


BLANKS = " \t"


def _trailing_blank(text: Text) -> str:
    """The spaces and tabs that end a text prefix ("" for token ids)."""
    return text[len(text.rstrip(BLANKS)):] if isinstance(text, str) else ""


def _fit_middle(middle: str, prefix: str | None, suffix: str | None) -> str:
    """The middle as it goes between the prefix and the suffix: without a leading blank where the prefix ends with
    one (the model wrote the word's blank itself, the context having been given without it) and without a trailing
    blank where the suffix starts with whitespace. The text around it is never changed."""
    if prefix and _trailing_blank(prefix):
        middle = middle.lstrip(BLANKS)
    if suffix and suffix[0].isspace():
        middle = middle.rstrip(BLANKS)
    return middle


def _check_vocab(ids: list[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise GenerationError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")


def _lengths(length, canvas_length: int) -> list[int]:
    if length is None:
        return default_lengths(canvas_length)
    lengths = [length] if _is_int(length) else length
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise GenerationError(f"length must be a positive integer or a list of them, got {length!r}")
    for n in lengths:
        if not _is_int(n) or n <= 0:
            raise GenerationError(f"length must be a positive integer, got {n!r}")
        if n > canvas_length:
            raise GenerationError(f"length {n} exceeds the canvas of {canvas_length} tokens; "
                                  "a middle is generated in one canvas")
    return [int(n) for n in lengths]


def _banned_ids(pipe, settings: SamplerSettings) -> torch.Tensor:
    g = pipe.generation_config
    ids = set(settings.eos_token_ids)
    ids.update(t for t in (settings.pad_token_id, g.bos_token_id, pipe.config.text.pad_token_id) if t is not None)
    vocab = pipe.config.text.vocab_size
    return torch.tensor(sorted(t for t in ids if 0 <= t < vocab), dtype=torch.long)


def _seed(seed) -> int:
    if seed is None:
        # Drawn from the global generator so that torch.manual_seed makes unseeded calls repeatable.
        return int(torch.randint(0, 2**62, (1,)))
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise GenerationError(f"a seed must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def result_json(result: EditResult) -> dict:
    """A JSON-ready dict of an EditResult (the CLI's --json and an HTTP endpoint's answer)."""
    payload = dataclasses.asdict(result)
    for candidate, raw in zip(result.candidates, payload["candidates"]):
        raw["score"] = candidate.score
    return payload
