"""Sampling building blocks for diffusion and autoregressive decoding.

Every function here is written so that, fed the same tensors and a generator in the same state,
it produces bit-identical results to the transformers 5.23 reference sampler
(`generation_diffusion_gemma.py`). That is why some expressions look roundabout: the temperature
is computed from an int32 step tensor, the entropy repeats the normalisation that
`torch.distributions.Categorical` performs, and every random draw has exactly the shape the
reference draws. Changing any of these changes the floating-point rounding or the random stream
and breaks token-exact parity (see docs/generation.md).

Random draws take an explicit `torch.Generator` per request, so a request's tokens do not depend
on which other requests share its batch.
"""

from __future__ import annotations

import math

import torch

from printpress.events import TokenLogprob

# The settings are defined in printpress.settings (torch-free, so the CLI reads them without torch); these names are
# kept here for callers that import them with the sampler.
from printpress.settings import (  # noqa: F401
    MAX_DENOISING_STEPS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    MODES,
    SPECULATIVE_DRAFT_STEPS,
    SamplerSettings,
    check_setting,
)


def canvases_for(max_new_tokens: int, canvas_length: int) -> int:
    """Number of canvases generated for a token budget: whole canvases, rounded up (as the reference)."""
    return math.ceil(max_new_tokens / canvas_length)


# --------------------------------------------------------------------------------------------
# Diffusion sampler
# --------------------------------------------------------------------------------------------


def step_temperature(step: int, settings: SamplerSettings) -> torch.Tensor:
    """Temperature at denoising step `step` (counting down from N to 1): t_min + (t_max - t_min) * step/N.

    Computed from an int32 tensor exactly as the reference does, so the float32 rounding matches.
    """
    step_tensor = torch.tensor(step, dtype=torch.int32)
    return settings.t_min + (settings.t_max - settings.t_min) * (step_tensor / settings.max_denoising_steps)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, with the same operations as Categorical.entropy()."""
    log_probs = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(log_probs, dim=-1)
    log_probs = torch.clamp(log_probs, min=torch.finfo(log_probs.dtype).min)
    return -(log_probs * probs).sum(-1)


def entropy_bound_accept(entropy: torch.Tensor, entropy_bound: float) -> torch.Tensor:
    """Mask of positions accepted by the entropy-bound rule (Ben-Hamu et al. 2025).

    Positions sorted by entropy, the k lowest are accepted while sum(H_1..H_k) - H_k <= bound,
    i.e. the bound on their joint mutual information. The lowest-entropy position is always
    accepted, so every step makes progress.
    """
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
    sorted_accept = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= entropy_bound
    return torch.scatter(torch.zeros_like(sorted_accept), dim=-1, index=order, src=sorted_accept)


def uniform_tokens(length: int, vocab_size: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A (1, length) canvas of uniformly random tokens; one randint call, as the reference draws."""
    return torch.randint(0, vocab_size, (1, length), generator=generator, device=device)


def sample_canvas(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per canvas position from probs (C, V): one multinomial over all positions."""
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


class StabilityTracker:
    """Per-row history of argmax canvases for the "stable" half of the adaptive stop.

    A row is stable when its argmax canvas equals each of the previous `threshold` argmax canvases
    of the current canvas loop; with threshold 0 every row is stable.
    """

    def __init__(self, threshold: int, batch_size: int, canvas_length: int, device: torch.device):
        self.threshold = threshold
        # -1 is never a token, so the first `threshold` steps can never count as stable.
        self.history = torch.full((batch_size, threshold, canvas_length), -1, dtype=torch.long, device=device)

    def update(self, argmax: torch.Tensor) -> torch.Tensor:
        """Record this step's argmax (B, C) and return which rows are stable (B,)."""
        if self.threshold == 0:
            return torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
        stable = (self.history == argmax[:, None, :]).all(dim=-1).all(dim=-1)
        self.history = torch.cat([self.history[:, 1:], argmax[:, None, :]], dim=1)
        return stable

    def select(self, rows: torch.Tensor) -> None:
        self.history = self.history[rows]


def pad_after_eos(tokens: torch.Tensor, eos_token_ids: tuple[int, ...], pad_token_id: int | None) -> tuple[torch.Tensor, bool]:
    """Replace every token after the first EOS of a committed canvas (1-D) by pad.

    Returns the canvas and whether it held an EOS (the request then finishes).
    """
    if not eos_token_ids:
        return tokens, False
    is_eos = torch.isin(tokens, torch.tensor(eos_token_ids, device=tokens.device))
    if not bool(is_eos.any()):
        return tokens, False
    if pad_token_id is not None:
        seen = is_eos.cumsum(dim=-1)
        after_first = (seen > 0) & ~((seen == 1) & is_eos)
        tokens = tokens.masked_fill(after_first, pad_token_id)
    return tokens, True


# --------------------------------------------------------------------------------------------
# Autoregressive sampler
# --------------------------------------------------------------------------------------------


def sample_next_token(logits: torch.Tensor, settings: SamplerSettings, generator: torch.Generator) -> int:
    """Next token from one row of next-token logits (V,): greedy at temperature 0, else sampled."""
    if settings.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / settings.temperature
    if settings.top_k is not None and settings.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, settings.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-probability of `token` under one row of next-token logits (V,), and the `top` most likely tokens'.

    The model's own distribution, log_softmax of the raw logits: the temperature and top-k that shaped the draw do
    not enter (OpenAI reports the same). Computed only for a request that asks (`Request.logprobs`).
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(log_probs, min(top, log_probs.shape[-1]))
    return TokenLogprob(token, float(log_probs[token]), list(zip(ids.tolist(), values.tolist())))
