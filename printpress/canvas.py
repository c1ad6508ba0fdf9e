"""One denoising step of a canvas: the sampler that diffusion decoding, speculative drafts and editing share.

After each decoder pass (`denoise`), a step is (docs/generation.md, "The algorithm"):

    temperature -> softmax -> entropy -> entropy-bound acceptance (within a window, opt-in) -> sample the
    accepted positions, re-noise the others -> the adaptive stop

`denoise_step` does the first five for a batch of rows, each with its own settings, step count and generator;
`advance` applies the stop to one row. The callers differ only around it: the diffusion loop batches requests
and commits the argmax, a speculative draft clamps its first slot to the last committed token and runs every
step, editing restricts the step to the free positions in front of a clamped suffix (`free`) and bans special
tokens there (`banned`).

Every random draw keeps the reference's order and shape per row: one multinomial over the free positions, then
one randint re-noising them (with `sample_accepted_only`: the randint first, then one multinomial over the
accepted positions only). Changing the order, the shapes or the arithmetic breaks token-exact parity with the
reference (printpress/sampling.py says why each expression is written as it is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from printpress import native
from printpress.events import StepEvent
from printpress.sampling import (
    SamplerSettings,
    StabilityTracker,
    entropy_bound_accept,
    row_argmax,
    sample_canvas,
    softmax_kernels,
    step_temperature,
    token_entropy,
    top_k_only,
    uniform_tokens,
    window_open,
)


class CanvasRow(Protocol):
    """What the step reads and moves on of one row (`printpress.request.RequestState` is one)."""

    index: int
    generator: torch.Generator
    tracker: StabilityTracker | None
    step: int  # steps left in this canvas, N down to 1; the temperature depends on it

    @property
    def settings(self) -> SamplerSettings: ...


@dataclass
class StepOutcome:
    """What one step decided, for a batch of b rows over canvases of C positions, F of them free."""

    processed: torch.Tensor  # (b, C, V) temperature-scaled logits of every position
    probs: torch.Tensor  # (b, C, V) their float32 softmax
    argmax: torch.Tensor  # (b, F) the current best guess: what would be committed now
    entropy: torch.Tensor  # (b, F) per-position entropy of the scaled logits
    mean_entropy: torch.Tensor  # (b,) the confidence the adaptive stop compares
    accepted: torch.Tensor  # (b, F) bool: kept their sample; every other free position was re-noised
    next_canvas: torch.Tensor  # (b, F) the free positions fed to the next step

    def feedback(self, dtype: torch.dtype) -> torch.Tensor:
        """The next step's self-conditioning input, as probabilities (`denoise` passes them as such): the float32
        softmax of the *scaled* logits, as the reference feeds them back.

        In float32 that is `probs` bit for bit (saving a softmax per step); in half precision the reference casts
        the logits to the weights' dtype first, so this is the softmax the decoder would take of those. As
        probabilities, a position can also be given no signal at all (zeros), which a sliding canvas's fresh
        positions get.
        """
        if dtype == torch.float32:
            return self.probs
        return torch.softmax(self.processed.to(dtype), dim=-1, dtype=torch.float32)


def denoise(model: torch.nn.Module, canvas: torch.Tensor, cache, feedback: torch.Tensor | None,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder pass over `canvas` (b, C), self-conditioned on the previous step's `StepOutcome.feedback`
    (None at a canvas's first step; `mask` (b,) marks the rows that have one)."""
    return model.denoise(canvas, cache, self_conditioning_probs=feedback, self_conditioning_mask=mask)


def probabilities_and_entropy(processed: torch.Tensor, free: int,
                              exact: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(processed) in float32 (b, C, V), and the entropy (b, free) of the first `free` positions, computed a
    row at a time on a CPU: the same numbers as over the whole batch (each is a function of one position's logits),
    and faster from two rows on, because one row's (C, V) floats stay in the L2 cache (6 rows of 32 x 4096: 3.4
    against 6.2 ms on one thread, an Intel Xeon). A GPU takes the batch whole (one kernel each, not one per row).

    Exact, float32 on a CPU: printpress's one-pass form (printpress/kernels/softmax.cpp, `sampling.softmax_kernels`)
    gives these bits a row at a time in cache, where it is built and its check against ATen holds. Not `exact` (a
    compiled decoder's step), where printpress's fast kernels are loaded: both in one pass per position
    (`printpress_fast::softmax_entropy`), ~5x faster, within float32's rounding of these (not their bits, which are
    the reference's)."""
    if not exact and processed.dtype == torch.float32 and processed.device.type == "cpu" \
            and native.loaded("rows_linear.cpp"):
        probs, entropy = torch.ops.printpress_fast.softmax_entropy(processed.reshape(-1, processed.shape[-1]))
        return probs.view(processed.shape), entropy.view(processed.shape[:-1])[:, :free]
    if processed.dtype == torch.float32 and processed.device.type == "cpu" and processed.is_contiguous() \
            and softmax_kernels():
        rows = [torch.ops.printpress_softmax.sampler_numbers(row, free) for row in processed]
        if len(rows) == 1:
            return rows[0][0][None], rows[0][1][None]
        return torch.stack([probs for probs, _ in rows]), torch.stack([entropy for _, entropy in rows])
    if processed.shape[0] == 1 or processed.device.type != "cpu":
        return torch.softmax(processed, dim=-1, dtype=torch.float32), token_entropy(processed[:, :free])
    probs = torch.stack([torch.softmax(row, dim=-1, dtype=torch.float32) for row in processed])
    entropy = torch.stack([token_entropy(row[:free]) for row in processed])
    return probs, entropy


def denoise_step(
    logits: torch.Tensor,
    rows: Sequence[CanvasRow],
    vocab_size: int,
    free: int | None = None,
    banned: torch.Tensor | None = None,
    exact: bool = True,
) -> StepOutcome:
    """Temperature, acceptance and sampling for the decoder's `logits` (b, C, V), row j being `rows[j]`.

    `free`: only the first `free` positions are denoised (default: all); the rest are clamped by the caller and
    take no part in the entropy, the acceptance or the draws. `banned`: token ids no free position may take.
    `exact=False` (logits of a compiled pass, not the reference's anyway): the probabilities and entropies in one
    fused call (`probabilities_and_entropy`); the draws are the same either way.
    """
    processed = torch.empty_like(logits)
    for j, row in enumerate(rows):
        torch.div(logits[j], step_temperature(row.step, row.settings), out=processed[j])
    free = logits.shape[1] if free is None else free
    if banned is not None:
        processed[:, :free, banned] = float("-inf")
    for j, row in enumerate(rows):
        if 0 < row.settings.canvas_top_k < processed.shape[-1]:  # opt-in, not the reference's: see the setting
            processed[j, :free] = top_k_only(processed[j, :free], row.settings.canvas_top_k)
    probs, entropy = probabilities_and_entropy(processed, free, exact)
    scaled = processed[:, :free]
    argmax = row_argmax(scaled)
    accepted = torch.empty(argmax.shape, dtype=torch.bool, device=argmax.device)
    next_canvas = torch.empty_like(argmax)
    for j, row in enumerate(rows):
        # The bound is compared row by row as a Python float, exactly as the reference compares it. With a window
        # (`window_lead`, opt-in) only its leading positions may be kept; the rest are re-noised. A sliding canvas
        # (`sliding`, opt-in) has no window: it keeps its first position once that has waited its last step.
        settings = row.settings
        opened = free if settings.sliding else window_open(free, settings.window_lead, row.step,
                                                            settings.max_denoising_steps)
        if opened < free:
            accepted[j, opened:] = False
        accepted[j, :opened] = entropy_bound_accept(entropy[j : j + 1, :opened], settings.entropy_bound)[0]
        if settings.sliding and row.step == 1:
            accepted[j, 0] = True
        next_canvas[j] = renoise(probs[j, :free], accepted[j], settings, row.generator, vocab_size)
    return StepOutcome(processed, probs, argmax, entropy, entropy.mean(dim=-1), accepted, next_canvas)


def renoise(probs: torch.Tensor, accepted: torch.Tensor, settings: SamplerSettings, generator: torch.Generator,
            vocab_size: int) -> torch.Tensor:
    """One row's next tokens (F,): a sample from `probs` (F, V) where accepted, fresh uniform noise elsewhere."""
    length, device = probs.shape[0], probs.device
    if settings.sample_accepted_only:
        # Opt-in (not the reference's stream): acceptance does not depend on the sample, so draw only where it is
        # kept. Each kept token has the same distribution; the multinomial shrinks to the accepted positions.
        tokens = uniform_tokens(length, vocab_size, generator, device)[0]
        tokens[accepted] = sample_canvas(probs[accepted], generator)
        return tokens
    sampled = sample_canvas(probs, generator)  # the reference's order: sample every position, then re-noise
    return torch.where(accepted, sampled, uniform_tokens(length, vocab_size, generator, device)[0])


def advance(row: CanvasRow, outcome: StepOutcome, j: int) -> bool:
    """Count row j's step down and say whether its adaptive stop fired: this argmax equals each of the previous
    `stability_threshold` argmaxes of the canvas and the mean entropy is below `confidence_threshold`."""
    stable = bool(row.tracker.update(outcome.argmax[j : j + 1])[0])
    row.step -= 1
    return stable and bool(outcome.mean_entropy[j] < row.settings.confidence_threshold)


def step_event(row: CanvasRow, canvas_index: int, outcome: StepOutcome, j: int, stopped: bool) -> StepEvent:
    """The `StepEvent` of row j's step (after `advance`, so `row.step` counts the steps left)."""
    return StepEvent(
        request=row.index,
        canvas=canvas_index,
        step=row.settings.max_denoising_steps - row.step,
        max_steps=row.settings.max_denoising_steps,
        tokens=outcome.next_canvas[j].tolist(),
        argmax=outcome.argmax[j].tolist(),
        accepted=outcome.accepted[j].tolist(),
        stopped=stopped,
        entropy=outcome.entropy[j].tolist(),
    )
