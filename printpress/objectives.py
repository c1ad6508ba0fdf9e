"""The objectives on the shared backbone: diffusion, autoregressive (AR) and joint. Training minimises them
(printpress/train/loop.py), evaluation measures them (`evaluate_losses`, the held-out losses the training loop
logs and `printpress bench` reports; the lm-eval adapter's and the Sudoku probe's noise), so they live here,
below both.

Block diffusion in one forward (after BD3-LM): the sequence is cut into canvases of `block` tokens. The
model runs on `[clean sequence ; noisy sequence]` (2L tokens) with one attention mask:

- a clean token attends causally to clean tokens (the encoder; its outputs are the AR logits);
- a noisy token of block b attends to the clean tokens before block b (what the KV cache holds at
  inference) and bidirectionally to the noisy tokens of its own block (the canvas).

Sliding-window layers see exactly what inference sees: clean tokens within the window behind a clean
query, and the last `sliding_window - 1` clean tokens before a canvas (the cache's ring), plus the whole
canvas. Clean tokens use the encoder's layer scalars, noisy ones the decoder's, and only the noisy half
goes through self-conditioning, so every block's logits equal `encode(prefix)` then `denoise(noisy block)`
(a test checks this exactly).

Noise is uniform-state, as in DiffusionGemma: each canvas token is replaced, with probability t, by a
token drawn uniformly from the vocabulary (which may be the token itself); t ~ U(t_low, 1) per block.
Training draws it per row (`row_noise`) from a generator keyed by (seed, step, global row), so that any
number of ranks draws the same; held-out evaluation uses the same draws at a fixed key, so its figures never
move with the step. Loss weighting: see docs/decisions/0002-diffusion-loss.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from printpress.draft_table import DraftTable, draw
from printpress.model import DiffusionGemma, Masks

Objective = Literal["diffusion", "ar", "joint"]
Weighting = Literal["uniform", "inverse_t"]
Divergence = Literal["reverse", "forward"]


@dataclass
class DiffusionSettings:
    block: int  # canvas length used in training (the model's canvas_length)
    t_low: float = 0.0  # noise levels are drawn from U(t_low, 1)
    self_conditioning: float = 0.5  # fraction of examples trained with a first no-grad pass fed back
    weighting: Weighting = "uniform"
    ar_weight: float = 1.0  # weight of the AR term in the joint objective
    # Certainty forcing (dParallel, arXiv 2509.26488): weight of the entropy of softmax(logits / temperature) at the
    # noised canvas positions the model already predicts right. 0 turns it off.
    certainty_weight: float = 0.0
    certainty_temperature: float = 0.5
    # Few-step self-distillation (after SDTT, arXiv 2410.21035): weight of the reverse KL from the student's one
    # step to a frozen teacher's two sampler steps (`step_distillation_loss`). 0 turns it off.
    step_distill_weight: float = 0.0
    step_distill_temperature: float = 0.6  # the teacher's sampling temperature for the tokens it keeps
    step_distill_divergence: Divergence = "reverse"  # KL(student || teacher), or "forward": KL(teacher || student)
    # Draft rows (for mode="speculative"): the share of rows noised as a speculative draft sees its canvas, every
    # canvas's first token clean and the rest pure noise, with no self-conditioning (`row_noise`). 0 turns it off.
    draft_fraction: float = 0.0
    # Of those rows, the share shaped as a fused draft sees its canvas (`fused_draft`: the canvas starts where the
    # token being committed goes, so its first position is noise too).
    draft_fused_share: float = 0.0
    # Sampler states (after d3LLM's trajectory states, for a uniform-state sampler): the share of self-conditioned
    # rows whose canvas is what a later sampler step sees: a share of the noised positions, the first pass's most
    # certain ones, hold that pass's own samples (at `sampler_states_temperature`) instead of uniform noise, and
    # the pass is fed back. The target stays the clean token, so the model learns to revise its own plausible
    # mistakes, not only to replace noise (`sampler_state`). 0 turns it off.
    sampler_states: float = 0.0
    sampler_states_temperature: float = 0.4
    # AR soft targets: at a noised canvas position i the target becomes (1 - w) one-hot(x_i) + w p_AR(. | x_<i),
    # the joint model's own AR distribution from the same forward (detached), with w = ar_target_weight *
    # t ** ar_target_power per block (`ar_target_loss`). 0 turns it off.
    ar_target_weight: float = 0.0
    ar_target_power: float = 1.0
    # Front distillation: weight of the cross-entropy from the joint model's own AR distribution p_AR(. | x_<i)
    # (detached) to the decoder's at each canvas's first position where it is noised (`front_distill_loss`), as a
    # mean over those fronts. 0 turns it off.
    front_distill_weight: float = 0.0
    # Table noise (for `canvas_start="table"`): the share of rows whose noised positions hold tokens drawn from the
    # draft table's sampled counts after the text before them, instead of uniform ones (`table_noise`), so the
    # denoiser learns to revise a plausible draft rather than take plausible tokens for clean ones. 0 turns it off.
    # Measured (docs/benchmarks.md §7, L17): it learns to distrust every canvas and writes worse; no recipe uses it.
    table_noise: float = 0.0
    # Left-to-right rows: the share of rows (not draft rows) whose canvases are each clean before a position drawn
    # uniformly in [0, block) and uniform noise from it on (`left_to_right_noise`): the states a sampler that commits
    # from the left (`window_lead`) is in, where the decoder predicts what the AR side predicts from the same text.
    # Such a row is not a sampler-state row. 0 turns it off. Measured (docs/benchmarks.md §8, the code model's
    # seventh round): at 0.5 it narrows the text and closes little of the decoder's gap there; no recipe uses it.
    left_to_right: float = 0.0
    # Rolling rows: the share of rows (not draft rows, not left-to-right rows) whose canvases are noised more towards
    # their end, each position i of a canvas with probability t0 + (1 - t0) (i + 1) / block, t0 ~ U(0, 1) per canvas
    # (`rolling_noise`): the shape of the canvas the sliding sampler denoises, its front long revised and its end
    # fresh noise. Unlike left-to-right rows they stay sampler-state rows (their most certain noised positions, most
    # often near the front, may take the first pass's samples, as the sliding sampler's front holds its own). 0 = off.
    rolling: float = 0.0


def block_diffusion_masks(length: int, block: int, sliding_window: int, device=None) -> Masks:
    """Boolean (1, 1, 2L, 2L) masks for `[clean ; noisy]`, per layer kind (see the module docstring)."""
    pos = torch.arange(length, device=device)
    q, k = pos[:, None], pos[None, :]
    block_start = (pos // block * block)[:, None]
    clean_clean = k <= q
    noisy_clean = k < block_start
    noisy_noisy = (k // block) == (q // block)
    nothing = torch.zeros(length, length, dtype=torch.bool, device=device)

    def assemble(cc: torch.Tensor, nc: torch.Tensor) -> torch.Tensor:
        top = torch.cat([cc, nothing], dim=1)
        bottom = torch.cat([nc, noisy_noisy], dim=1)
        return torch.cat([top, bottom], dim=0)[None, None]

    return Masks(
        full=assemble(clean_clean, noisy_clean),
        sliding=assemble(clean_clean & (q - k < sliding_window), noisy_clean & (k >= block_start - (sliding_window - 1))),
    )


def causal_masks(length: int, sliding_window: int, device=None) -> Masks:
    pos = torch.arange(length, device=device)
    q, k = pos[:, None], pos[None, :]
    causal = k <= q
    return Masks(full=causal[None, None], sliding=(causal & (q - k < sliding_window))[None, None])


def add_uniform_noise(
    tokens: torch.Tensor, block: int, vocab_size: int, generator: torch.Generator | None, t_low: float = 0.0,
    t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace each token with a uniform random one with probability t (one t per block). Returns (noisy, t)."""
    batch, length = tokens.shape
    blocks = length // block
    if t is None:
        t = t_low + (1 - t_low) * torch.rand(batch, blocks, generator=generator, device=tokens.device)
    per_token = t.repeat_interleave(block, dim=1)
    replace = torch.rand(batch, length, generator=generator, device=tokens.device) < per_token
    random_tokens = torch.randint(0, vocab_size, (batch, length), generator=generator, device=tokens.device)
    return torch.where(replace, random_tokens, tokens), t


def row_noise(tokens: torch.Tensor, first_row: int, step: int, seed: int, settings: DiffusionSettings,
              vocab_size: int, teacher_draws: bool = False, draft_rows: torch.Tensor | None = None,
              sampler_states: bool = False, table: DraftTable | None = None):
    """Noise per row from a generator keyed by (seed, step, global row): the same on any number of ranks.

    Returns (noisy, t, self-conditioning flags), plus, with `teacher_draws`, the per-token draws of the few-step
    teacher's sampler step (uniforms, re-noise tokens), taken after the others so the noise stream is unchanged.

    With `settings.draft_fraction` > 0, that share of rows (drawn last, for the same reason) becomes draft rows:
    what `mode="speculative"` asks of the decoder, one step from a canvas whose first token is the last committed
    one (clean) and whose other positions are all noise (t = 1), with no previous step to condition on.
    `draft_rows` (B,) bool names the draft rows instead (`train.draft_teacher_rows`: the teacher's rows), with no
    draw for the choice.

    With `sampler_states` (and `settings.sampler_states` > 0), two more tensors come last, drawn last per row:
    the share of each canvas's noised positions `sampler_state` fills with the model's own samples (B,), 0 for a
    row left as it is (not chosen, not self-conditioned, or a draft row), and the inverse-CDF draws (B, L).

    With `table` (and `settings.table_noise` > 0), that share of the rows that are not draft rows has its noise
    redrawn from the table (`table_noise`), chosen and drawn after everything else, so the other draws stay the same.
    With `settings.left_to_right` > 0, that share of the rows that are not draft rows is noised left to right
    instead (`left_to_right_noise`; t becomes each canvas's noised share), chosen and drawn after all of that.
    With `settings.rolling` > 0, that share of the rows that are neither draft nor left-to-right rows is noised
    more towards each canvas's end (`rolling_noise`; t becomes each canvas's mean level), chosen and drawn last.
    """
    if settings.table_noise > 0 and table is None:
        raise ValueError("table_noise draws noise from a draft table, and none was given")
    noisy, levels, use, uniform, renoise, keep, state_uniform = [], [], [], [], [], [], []
    length = tokens.shape[1]
    for offset in range(tokens.shape[0]):
        g = torch.Generator().manual_seed(hash_seed(seed, step, first_row + offset))
        row, t = add_uniform_noise(tokens[offset : offset + 1], settings.block, vocab_size, g, settings.t_low)
        flag = torch.rand(1, generator=g) < settings.self_conditioning
        if teacher_draws:
            uniform.append(torch.rand(1, length, generator=g))
            renoise.append(torch.randint(0, vocab_size, (1, length), generator=g))
        if draft_rows is not None:
            drafted = bool(draft_rows[offset])
        else:
            drafted = settings.draft_fraction > 0 and float(torch.rand(1, generator=g)) < settings.draft_fraction
        if drafted:
            fused = settings.draft_fused_share > 0 and float(torch.rand(1, generator=g)) < settings.draft_fused_share
            row = draft_noise(tokens[offset : offset + 1], settings.block, vocab_size, g, keep_first=not fused)
            t, flag = torch.ones_like(t), torch.zeros_like(flag)
        if sampler_states and settings.sampler_states > 0:
            chosen = bool(flag) and float(torch.rand(1, generator=g)) < settings.sampler_states
            share = torch.rand(1, generator=g)
            keep.append(share if chosen else torch.zeros(1))
            state_uniform.append(torch.rand(1, length, generator=g))
        if settings.table_noise > 0 and not drafted:  # a table is there: checked above
            if float(torch.rand(1, generator=g)) < settings.table_noise:
                row = table_noise(tokens[offset : offset + 1], row, table, settings.block, g)
        left_to_right = (settings.left_to_right > 0 and not drafted
                         and float(torch.rand(1, generator=g)) < settings.left_to_right)
        if left_to_right:
            row, t = left_to_right_noise(tokens[offset : offset + 1], settings.block, vocab_size, g)
            if keep:
                keep[-1] = torch.zeros(1)
        if (settings.rolling > 0 and not drafted and not left_to_right
                and float(torch.rand(1, generator=g)) < settings.rolling):
            row, t = rolling_noise(tokens[offset : offset + 1], settings.block, vocab_size, g)
        noisy.append(row)
        levels.append(t)
        use.append(flag)
    noise = (torch.cat(noisy), torch.cat(levels), torch.cat(use))
    if teacher_draws:
        noise = (*noise, torch.cat(uniform), torch.cat(renoise))
    if keep:
        noise = (*noise, torch.cat(keep), torch.cat(state_uniform))
    return noise


def table_noise(clean: torch.Tensor, noisy: torch.Tensor, table: DraftTable, block: int,
                generator: torch.Generator) -> torch.Tensor:
    """`noisy` (1, L) with each noised position (one whose token is not `clean`'s) redrawn, in order, from `table`'s
    sampled counts after the tokens the decoder sees before it: the clean text of the earlier canvases, then this
    canvas's tokens as noised so far. A position whose context the table does not know keeps its uniform token. At
    t = 1 a canvas is a chain as `canvas_start="table"` starts one; at lower t, the table's guesses sit among clean
    tokens, plausible after what precedes them and wrong as often as the table is, which the denoiser must find.
    (A uniform draw that happened to be the clean token counts as kept: one chance in the vocabulary size.)"""
    clean_ids, ids = clean[0].tolist(), noisy[0].tolist()
    for position, token in enumerate(ids):
        if token == clean_ids[position]:
            continue
        start = position - position % block
        context = clean_ids[max(0, start - table.longest) : start] + ids[start:position]
        found = table.distribution(context)
        if found is not None:
            ids[position] = draw(found, generator)
    return torch.tensor([ids], dtype=noisy.dtype, device=noisy.device)


def left_to_right_noise(tokens: torch.Tensor, block: int, vocab_size: int,
                        generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every canvas of `tokens` (B, L) clean before a position k drawn uniformly in [0, block) (one per canvas) and
    uniform noise from k on; returns (noisy, t), t (B, L // block) the noised share of each canvas."""
    batch, length = tokens.shape
    first_noised = torch.randint(0, block, (batch, length // block), generator=generator, device=tokens.device)
    noise = torch.randint(0, vocab_size, tokens.shape, generator=generator, device=tokens.device)
    at = torch.arange(length, device=tokens.device) % block
    noised = at >= first_noised.repeat_interleave(block, dim=1)
    return torch.where(noised, noise, tokens), (block - first_noised).float() / block


def rolling_noise(tokens: torch.Tensor, block: int, vocab_size: int,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every canvas of `tokens` (B, L) noised more towards its end: position i (0-based) replaced by a uniform
    token with probability t0 + (1 - t0) (i + 1) / block, t0 drawn from U(0, 1) per canvas, so the last position is
    always noise; returns (noisy, t), t (B, L // block) each canvas's mean level."""
    batch, length = tokens.shape
    start = torch.rand(batch, length // block, generator=generator, device=tokens.device)
    ramp = (torch.arange(block, device=tokens.device) + 1).float() / block
    levels = start[..., None] + (1 - start[..., None]) * ramp  # (B, canvases, block)
    replace = torch.rand(batch, length, generator=generator, device=tokens.device) < levels.view(batch, length)
    noise = torch.randint(0, vocab_size, tokens.shape, generator=generator, device=tokens.device)
    return torch.where(replace, noise, tokens), levels.mean(-1)


def draft_noise(tokens: torch.Tensor, block: int, vocab_size: int, generator: torch.Generator | None,
                keep_first: bool = True) -> torch.Tensor:
    """Every canvas of `tokens` (B, L) as a speculative draft starts: its first token kept (the committed token an
    unfused draft is clamped to) or not (a fused draft), the rest uniform noise."""
    noisy = torch.randint(0, vocab_size, tokens.shape, generator=generator, device=tokens.device)
    if not keep_first:
        return noisy
    first = torch.arange(tokens.shape[1], device=tokens.device) % block == 0
    return torch.where(first, tokens, noisy)


def hash_seed(*parts: int) -> int:
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value * 6364136223846793005 + int(part) + 1442695040888963407) % (1 << 63)
    return value


def forward_ar(model: DiffusionGemma, tokens: torch.Tensor) -> torch.Tensor:
    """Encoder (causal) logits for every position of `tokens`."""
    length = tokens.shape[1]
    masks = causal_masks(length, model.config.sliding_window, tokens.device)
    hidden = model.run_layers(model.embed(tokens), torch.arange(length, device=tokens.device), masks, None, True)
    return model.logits(hidden)


def forward_block_diffusion(
    model: DiffusionGemma, clean: torch.Tensor, noisy: torch.Tensor, block: int,
    self_conditioning_logits: torch.Tensor | None = None, self_conditioning_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over `[clean ; noisy]`: (AR logits of the clean half, denoising logits of the noisy half)."""
    batch, length = clean.shape
    if length % block:
        raise ValueError(f"sequence length {length} is not a multiple of the canvas length {block}")
    device = clean.device
    canvas = model.embed_canvas(noisy, self_conditioning_logits, self_conditioning_mask)
    x = torch.cat([model.embed(clean), canvas], dim=1)
    positions = torch.arange(length, device=device).repeat(2)
    is_encoder = torch.arange(2 * length, device=device) < length
    masks = block_diffusion_masks(length, block, model.config.sliding_window, device)
    logits = model.logits(model.run_layers(x, positions, masks, None, is_encoder))
    return logits[:, :length], logits[:, length:]


def mean_over_ranks(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """`total / count` for a loss that averages over counted items (kept targets, chosen positions), made exact under
    data parallelism: each rank returns its `total` over the global count times the world size, so the ranks'
    average (what DDP does to gradients and the training loop to logged figures) is the mean over every rank's
    items, even when ranks hold different numbers of them (a batch whose real rows all sit on one rank). One
    process: `total / count`, unchanged."""
    if dist.is_available() and dist.is_initialized() and (world := dist.get_world_size()) > 1:
        count = count.detach().clone()
        dist.all_reduce(count)
        return total * world / count.clamp(min=1)
    return total / count.clamp(min=1)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, pad_id: int | None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token NLL over the kept targets: not pads, and only in `rows` (a (B,) bool mask) when given."""
    target = tokens[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    keep = torch.ones_like(target, dtype=torch.bool) if pad_id is None else target != pad_id
    if rows is not None:
        keep = keep & rows[:, None]
    return mean_over_ranks((loss * keep.reshape(-1)).sum(), keep.sum())


def certainty_loss(logits: torch.Tensor, clean: torch.Tensor, noisy: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean entropy of softmax(logits / temperature) over the noised positions whose argmax is already right.

    Gated on correctness, so it only sharpens what the model gets right: those positions fall under the
    sampler's entropy bound and are accepted together, instead of one per step (dParallel's certainty forcing).
    """
    with torch.no_grad():
        chosen = (noisy != clean) & (logits.argmax(dim=-1) == clean)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return mean_over_ranks((entropy * chosen).sum(), chosen.sum())


def ar_target_loss(logits: torch.Tensor, ar_logits: torch.Tensor, clean: torch.Tensor, noisy: torch.Tensor,
                   t: torch.Tensor, settings: DiffusionSettings) -> torch.Tensor:
    """What soft AR targets add to the denoising loss: the mean over canvas positions of
    w_i * (CE(p_AR(. | x_<i), q_i) - CE(one-hot x_i, q_i)), so that the sum with `denoising_loss` is the
    cross-entropy against the mixed target (1 - w_i) one-hot(x_i) + w_i p_AR(. | x_<i).

    w_i = ar_target_weight * t ** ar_target_power at noised positions (0 where the canvas shows the clean token,
    and at the sequence's first token, which has no AR prediction). The idea: a decoder that sees only the prefix
    and noise cannot know x_i beyond p(x_i | prefix), and p_AR(. | x_<i) is the one-hot target averaged over x_i
    given the true tokens before it, a lower-variance target with the same mean (Rao-Blackwell). Where the canvas
    shows clean tokens after i it ignores them, hence the weight's fall with t. Measured on the shipped model with
    w = t, the diffusion text came out worse (docs/benchmarks.md §7, L10). `ar_logits` are the clean half's
    logits (AR logits[:, i] predict token i + 1), not differentiated.
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)
    hard = -log_q.gather(-1, clean.unsqueeze(-1)).squeeze(-1)
    teacher = torch.softmax(ar_logits.detach().float()[:, :-1], dim=-1)  # p_AR(. | x_<i) for i = 1..L-1
    soft = torch.zeros_like(hard)
    soft[:, 1:] = -(teacher * log_q[:, 1:]).sum(dim=-1)
    weight = settings.ar_target_weight * t.repeat_interleave(settings.block, dim=1) ** settings.ar_target_power
    weight = weight * (noisy != clean)
    weight[:, 0] = 0.0
    return (weight * (soft - hard)).mean()


def front_distill_loss(logits: torch.Tensor, ar_logits: torch.Tensor, clean: torch.Tensor, noisy: torch.Tensor,
                       block: int) -> torch.Tensor:
    """Mean over the noised first positions of the canvases (the sequence's first token excepted: it has no AR
    prediction) of the cross-entropy from p_AR(. | x_<i), the clean half's logits at i - 1 (not differentiated),
    to the decoder's distribution at i.

    A canvas's noised front knows what the AR side knows, the text before it, and little more where the rest of the
    canvas is noise too: the state a sliding canvas's front is in (`sliding`), which must wait while its entropy is
    over the bound (bench/sliding_front.py). There the joint model's AR side predicts far better than its decoder
    (bench/sliding_canvas.py), so the decoder's front learns the AR side's distribution, at full weight whatever the
    noise level (unlike `ar_target_loss`, a mixed target at every noised position that falls with t).
    """
    fronts = torch.zeros_like(clean, dtype=torch.bool)
    fronts[:, block::block] = True
    chosen = fronts & (noisy != clean)
    rows, positions = chosen.nonzero(as_tuple=True)
    teacher = torch.softmax(ar_logits.detach().float()[rows, positions - 1], dim=-1)
    ce = -(teacher * torch.log_softmax(logits.float()[rows, positions], dim=-1)).sum(dim=-1)
    return mean_over_ranks(ce.sum(), chosen.sum())


@dataclass
class TeacherDraws:
    """What few-step self-distillation needs beyond the batch: the frozen teacher and, per token, the random
    numbers of its first sampler step (drawn per row by the caller, so any number of ranks draws the same)."""

    teacher: DiffusionGemma
    uniform: torch.Tensor  # (B, L) in [0, 1): inverse-CDF draws for the kept positions' samples
    renoise: torch.Tensor  # (B, L) uniform token ids for the re-noised positions


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per position from `probs` (..., V), given a uniform draw per position (...)."""
    cdf = probs.cumsum(dim=-1)
    # right=True: the first token whose cumulative mass exceeds the draw, so a zero-mass token is never chosen.
    index = torch.searchsorted(cdf, (uniform * cdf[..., -1]).unsqueeze(-1).contiguous(), right=True)
    return index.squeeze(-1).clamp(max=probs.shape[-1] - 1)


def most_certain_samples(logits: torch.Tensor, uniform: torch.Tensor, block: int, count: torch.Tensor,
                         temperature: float, eligible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sampler step keeps: in each canvas of `block` positions, the `count` (B, blocks) positions (of the
    `eligible` ones (B, L), default all) where softmax(logits / temperature) has the lowest entropy, as a (B, L)
    mask, and a sample of that softmax at every position (inverse CDF with `uniform` (B, L))."""
    batch, length = uniform.shape
    scaled = logits.float() / temperature
    probs = torch.softmax(scaled, dim=-1)
    entropy = -(probs * torch.log_softmax(scaled, dim=-1)).sum(-1)
    if eligible is not None:
        entropy = entropy.masked_fill(~eligible, float("inf"))
    rank = entropy.view(batch, -1, block).argsort(dim=-1).argsort(dim=-1)  # 0 = the most certain position
    kept = (rank < count[..., None]).view(batch, length)
    if eligible is not None:
        kept = kept & eligible
    return kept, sample_inverse_cdf(probs, uniform)


@torch.no_grad()
def two_step_targets(clean: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor, draws: TeacherDraws,
                     settings: DiffusionSettings) -> torch.Tensor:
    """The teacher's log-probabilities (B, L, V) after two steps of the sampler from `noisy`.

    Step one predicts every canvas position, keeps the lowest-entropy C - round(tC/2) of each canvas (sampled at
    `step_distill_temperature`) and re-noises the rest, which halves the canvas's noise level t; step two
    predicts again from there, self-conditioned on step one. A position kept at step one takes step one's
    prediction as its target, every other position step two's (SDTT's rule: a token's target is the prediction
    at the step that committed it).
    """
    block = settings.block
    _, first = forward_block_diffusion(draws.teacher, clean, noisy, block)
    first = first.float()
    keep = block - torch.round(t * block / 2)  # (B, blocks)
    kept, sampled = most_certain_samples(first, draws.uniform, block, keep, settings.step_distill_temperature)
    second_input = torch.where(kept, sampled, draws.renoise)
    _, second = forward_block_diffusion(draws.teacher, clean, second_input, block, first)
    return torch.where(kept[..., None], torch.log_softmax(first, dim=-1), torch.log_softmax(second.float(), dim=-1))


def step_distillation_loss(logits: torch.Tensor, clean: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor,
                           draws: TeacherDraws, settings: DiffusionSettings) -> torch.Tensor:
    """Mean KL between the student's one step and the teacher's two over the noised canvas positions.

    The student's one pass at noise level t learns what the teacher reaches in two (`two_step_targets`); with the
    teacher refreshed to the student every round, each round halves the steps the sampler needs. Reverse KL
    (student || teacher, the default) is SDTT's choice, the one divergence that kept quality as steps fell; it is
    mode-seeking, so it also sharpens and narrows. Forward KL (teacher || student) covers the teacher's modes
    instead: the option to try where the narrowing costs too much diversity.
    """
    target = two_step_targets(clean, noisy, t, draws, settings)
    log_q = torch.log_softmax(logits.float(), dim=-1)
    if settings.step_distill_divergence == "forward":
        kl = (target.exp() * (target - log_q)).sum(dim=-1)
    else:
        kl = (log_q.exp() * (log_q - target)).sum(dim=-1)
    chosen = noisy != clean
    return mean_over_ranks((kl * chosen).sum(), chosen.sum())


@torch.no_grad()
def sampler_state(clean: torch.Tensor, noisy: torch.Tensor, first: torch.Tensor, keep: torch.Tensor,
                  uniform: torch.Tensor, block: int, temperature: float) -> torch.Tensor:
    """`noisy` (B, L) turned into a state the sampler visits after a step from it (`settings.sampler_states`).

    `first` (B, L, V) is the first (self-conditioning) pass's logits on `noisy`. In each canvas of row b, the
    round(keep[b] * n) noised positions (of its n) where that pass is most certain take a sample of it at
    `temperature` (inverse CDF with `uniform`), as the sampler keeps its lowest-entropy samples and re-noises
    the rest; the other noised positions keep their uniform noise. A sample can be wrong, and the denoiser is
    still asked for the clean token there: that is the point.
    """
    noised = noisy != clean
    count = torch.round(keep.view(-1, 1) * noised.view(clean.shape[0], -1, block).sum(-1))  # (B, blocks)
    chosen, sampled = most_certain_samples(first, uniform, block, count, temperature, eligible=noised)
    return torch.where(chosen, sampled, noisy)


def denoising_loss(logits: torch.Tensor, clean: torch.Tensor, t: torch.Tensor, settings: DiffusionSettings) -> torch.Tensor:
    """Cross-entropy of the clean token at every canvas position, weighted per block by the noise level."""
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), clean.reshape(-1), reduction="none")
    per_token = per_token.view(clean.shape)
    if settings.weighting == "inverse_t":
        # ELBO-style 1/t weights, divided by their mean under t ~ U(t_low, 1) so the loss keeps the scale of
        # a cross-entropy; a plain mean over tokens, so data-parallel ranks average to the global loss.
        weights = (1.0 / t).repeat_interleave(settings.block, dim=1)
        return (per_token * weights).mean() / expected_inverse_t(settings.t_low)
    return per_token.mean()


def expected_inverse_t(t_low: float) -> float:
    """E[1/t] for t ~ U(t_low, 1)."""
    if not 0 < t_low < 1:
        raise ValueError(f"inverse_t weighting needs 0 < t_low < 1 (got {t_low})")
    return math.log(1 / t_low) / (1 - t_low)


class TrainStep(nn.Module):
    """The whole training computation as one module, so DDP/FSDP can wrap it without the model knowing."""

    def __init__(self, model: DiffusionGemma, objective: Objective, settings: DiffusionSettings) -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        self.settings = settings

    def forward(
        self,
        tokens: torch.Tensor,
        noise: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        ar_rows: torch.Tensor | None = None,
        teacher: TeacherDraws | None = None,
    ) -> dict[str, torch.Tensor]:
        """Losses for a batch. `noise` = (noisy tokens, per-block t, per-row self-conditioning flag); drawn
        from `generator` when not given (the training loop draws it per row, for rank-independence).
        `ar_rows` (B,) bool keeps the AR loss to those rows (real text, not a teacher's continuations).
        `teacher` adds few-step self-distillation (with `settings.step_distill_weight` > 0)."""
        model, settings = self.model, self.settings
        pad = model.config.pad_token_id
        if self.objective == "ar":
            loss = next_token_loss(forward_ar(model, tokens), tokens, pad, ar_rows)
            return {"loss": loss, "ar": loss.detach()}
        if noise is None:
            noisy, t = add_uniform_noise(tokens, settings.block, model.config.vocab_size, generator, settings.t_low)
            use = torch.rand(tokens.shape[0], generator=generator, device=tokens.device) < settings.self_conditioning
            states = []
        else:
            noisy, t, use, *states = noise
        self_cond = None
        # Decided by the setting, not by this batch's draws: under data parallelism every rank must run the
        # same passes (FSDP gathers each layer's weights in lockstep).
        if settings.self_conditioning > 0:
            # Self-conditioning as trained in Analog Bits: a first pass without it, fed back detached to the
            # chosen rows; the others get a zero signal, exactly like the first denoising step at inference.
            with torch.no_grad():
                _, self_cond = forward_block_diffusion(model, tokens, noisy, settings.block)
            if states:  # (keep, uniform) from row_noise: some rows move on to a later sampler step's state
                noisy = sampler_state(tokens, noisy, self_cond, *states, settings.block,
                                      settings.sampler_states_temperature)
        ar_logits, denoise_logits = forward_block_diffusion(model, tokens, noisy, settings.block, self_cond, use)
        diffusion = denoising_loss(denoise_logits, tokens, t, settings)
        out = {"diffusion": diffusion.detach()}
        loss = diffusion
        if settings.certainty_weight > 0:
            certainty = certainty_loss(denoise_logits, tokens, noisy, settings.certainty_temperature)
            out["certainty"] = certainty.detach()
            loss = loss + settings.certainty_weight * certainty
        if settings.ar_target_weight > 0:
            soft = ar_target_loss(denoise_logits, ar_logits, tokens, noisy, t, settings)
            out["ar_target"] = soft.detach()
            loss = loss + soft
        if settings.front_distill_weight > 0:
            front = front_distill_loss(denoise_logits, ar_logits, tokens, noisy, settings.block)
            out["front_distill"] = front.detach()
            loss = loss + settings.front_distill_weight * front
        if settings.step_distill_weight > 0 and teacher is not None:
            distill = step_distillation_loss(denoise_logits, tokens, noisy, t, teacher, settings)
            out["step_distill"] = distill.detach()
            loss = loss + settings.step_distill_weight * distill
        if self.objective == "joint":
            ar = next_token_loss(ar_logits, tokens, pad, ar_rows)
            out["ar"] = ar.detach()
            out["loss"] = loss + settings.ar_weight * ar
        else:
            out["loss"] = loss + 0.0 * ar_logits.sum()  # keeps every parameter in the graph for DDP
        return out


@torch.no_grad()
def evaluate_losses(step: Callable[..., dict[str, torch.Tensor]], windows: Sequence[torch.Tensor], objective: Objective,
                    settings: DiffusionSettings, vocab_size: int, seed: int = 0, rank: int = 0) -> dict[str, float]:
    """Held-out losses on fixed windows with fixed noise: `val_ar`, the AR NLL per token, and `val_diffusion`,
    the diffusion loss (the training objective under `settings`' weighting, an ELBO-style bound), each the mean
    over `windows` of what `step` returns for a window (a `TrainStep`, or the DDP/FSDP module wrapping one, so
    sharded weights are gathered).

    The one held-out evaluation: the training loop's validation (`Trainer.evaluate`, which averages the ranks'
    figures) and `printpress bench` on a saved model both call it. `windows` are this rank's shards of the global
    validation batches (`data.eval_batches`), and the noise of a row is `row_noise` at step -1 keyed by its place
    in the global batch (batch i's rows from i * 10_000): the same draws at every evaluation of a run and on any
    number of ranks, so two evaluations differ only by the weights.
    """
    settings = dataclasses.replace(settings, draft_fraction=0.0, table_noise=0.0,  # comparable across runs
                                   left_to_right=0.0, rolling=0.0)
    sums: dict[str, float] = {}
    for index, tokens in enumerate(windows):
        noise = None
        if objective != "ar":
            noise = row_noise(tokens, index * 10_000 + rank * len(tokens), -1, seed, settings, vocab_size)
        out = step(tokens, noise)
        for key in ("ar", "diffusion"):
            if key in out:
                sums[f"val_{key}"] = sums.get(f"val_{key}", 0.0) + float(out[key]) / len(windows)
    return sums
