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

import functools
import math

import torch

from printpress import native
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

    Computed from an int32 tensor exactly as the reference does, so the float32 rounding matches; remembered per
    schedule and step (a 0-dimensional tensor that callers only read), as every step of every canvas asks again.
    """
    return _temperature(step, settings.t_min, settings.t_max, settings.max_denoising_steps)


@functools.lru_cache(maxsize=4096)
def _temperature(step: int, t_min: float, t_max: float, steps: int) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor, whichever mode the first caller was in
        return t_min + (t_max - t_min) * (torch.tensor(step, dtype=torch.int32) / steps)


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


def window_open(free: int, lead: float, step: int, steps: int) -> int:
    """How many leading positions of `free` the left-to-right window lets a step keep (`window_lead`): at step j of
    N (j = N - step + 1, `step` counting down from N), the first ceil(free * lead * j / N), all of them once
    lead * j >= N, and all of them when `lead` is 0 (off: the entropy bound alone, as the reference)."""
    done = steps - step + 1
    if not lead or lead * done >= steps:
        return free
    return math.ceil(free * lead * done / steps)


def uniform_tokens(length: int, vocab_size: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A (1, length) canvas of uniformly random tokens; one randint call, as the reference draws."""
    return torch.randint(0, vocab_size, (1, length), generator=generator, device=device)


def sample_canvas(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per canvas position from probs (C, V): one multinomial over all positions."""
    return multinomial_one(probs, generator)


# Up to this many elements (an AR step's one or two rows of a 4096 vocabulary) torch.multinomial itself is faster
# than the ATen draw below: 125 against 188 us for one row of 4096, 224 against 250 for two; from four rows (or one
# of 32768) that draw wins, 0.66-0.87x torch's time (one thread). printpress's kernel wins at every size.
_DIRECT_MAX = 8192

# In the ATen draw, exponentials are made this many at a time: the double buffers of a chunk (512 KiB) stay in a
# core's L2 cache, which made it 1.5x faster at 32 and 64 x 4096 than one pass over the whole tensor.
_DRAW_CHUNK = 65536

# A double within this relative distance of the true -log1p(-u) rounds to the same float as it, unless a float
# rounding boundary lies in between (see `exponential_like_torch`). Vectorised log1p is within 1 ulp (2**-52).
_LOG1P_SLACK = 2.0**-50


def draw_kernels() -> bool:
    """Whether printpress's exact sampling kernels (printpress/kernels/draw.cpp: `multinomial_one`, `row_argmax`)
    are loaded: built on this machine's first draw (about 6 s, then cached); where they cannot be
    built, one warning, and ATen's operators draw the same tokens, slower."""
    return native.load("draw.cpp", "draws run through ATen's operators (the same tokens, slower)", lambda: None)


def softmax_kernels() -> bool:
    """Whether printpress's one-pass softmax and entropy (printpress/kernels/softmax.cpp) stand in for ATen's operators
    in the exact sampler: built on this machine's first step (about 10 s, then cached) and checked once per process
    against ATen's operators (`printpress_softmax::holds`); where either fails, ATen's operators run (the same
    numbers, slower)."""
    return native.load("softmax.cpp", "the sampler's softmax and entropy run through ATen's operators (the same "
                       "numbers, slower)", lambda: None) and torch.ops.printpress_softmax.holds()


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)`, the same indices (both are documented to return the first of equal maxima, and
    both take a NaN as the maximum): for float32 on a CPU, `printpress_draw::row_argmax`, 3x faster than
    `torch.max` on a verification's 8 rows of 4096 (5 against 15 us); elsewhere (or without the kernel)
    `torch.max`, whose CPU reduction over many rows is itself about 3x faster than argmax's (32 x 4096 floats: 64
    against 195 us on one thread; 192 x 4096: 0.41 against 1.17 ms)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() and x.shape[-1] and draw_kernels():
        return torch.ops.printpress_draw.row_argmax(x)
    return torch.max(x, dim=-1).indices


def capped_argmax(raw: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`row_argmax` of the logits a final softcap makes of `raw` (`cap * tanh(raw / cap)`, the model's
    `final_logit_softcapping`; none when `cap` is None or 0): the same indices. For float32 on a CPU,
    `printpress_draw::capped_row_argmax` takes the tanh only of the few elements near each row's largest (a
    verification's 8 rows of 4096: ~15 against ~105 us); elsewhere the softcap, then `row_argmax`."""
    if not cap:
        return row_argmax(raw)
    if raw.dtype == torch.float32 and raw.device.type == "cpu" and raw.dim() and raw.shape[-1] and draw_kernels():
        return torch.ops.printpress_draw.capped_row_argmax(raw, float(cap))
    return row_argmax(raw.float().div(cap).tanh_().mul_(cap))


def multinomial_one(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of `probs` (..., V): the tokens `torch.multinomial(probs, 1, generator=generator)` draws
    (without its last dimension), with the generator left in the same state, faster on a CPU.

    For one sample, torch.multinomial returns argmax(probs / q) with q ~ Exp(1) from `exponential_`, which computes
    each q one element at a time from a double uniform u as -log1p(-u), then rounds it to float (2.3 ms of a
    diffusion step's 32 x 4096 draw on one thread). `printpress_draw::multinomial_one` checks the probabilities as
    torch.multinomial does, then makes the same u and the same argmax a row at a time in cache, taking the logarithm
    only where an element could hold its row's largest ratio (0.2 ms); without the kernel, the same u come from
    `uniform_` of doubles (the stream is the same however it is cut) and `exponential_like_torch` makes every float
    in ATen's vectorised passes, from four rows of 4096 (1.3 ms). Anything else (other dtypes, devices, or
    probabilities torch.multinomial would refuse) goes to torch.multinomial itself."""
    if probs.dtype != torch.float32 or probs.device.type != "cpu" or generator.device.type != "cpu" \
            or not probs.dim() or not probs.numel():
        return _torch_multinomial(probs, generator)
    if draw_kernels():
        try:
            return torch.ops.printpress_draw.multinomial_one(probs, generator)
        except RuntimeError:  # refused before drawing: torch.multinomial says what is wrong with the probabilities
            return _torch_multinomial(probs, generator)
    if probs.numel() <= _DIRECT_MAX or not _valid_probabilities(probs):
        return _torch_multinomial(probs, generator)
    q = torch.empty_like(probs, memory_format=torch.contiguous_format)
    flat = q.view(-1)
    for start in range(0, flat.numel(), _DRAW_CHUNK):  # consecutive draws continue one stream, in memory order
        chunk = flat[start:start + _DRAW_CHUNK]
        chunk.copy_(exponential_like_torch(torch.empty(chunk.shape, dtype=torch.float64).uniform_(generator=generator)))
    return row_argmax(probs / q)


def _torch_multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    rows = probs.reshape(-1, probs.shape[-1])  # torch.multinomial takes one or two dimensions
    return torch.multinomial(rows, num_samples=1, generator=generator).view(probs.shape[:-1])


def exponential_like_torch(uniform: torch.Tensor) -> torch.Tensor:
    """float32 (-log1p(-u)) of double uniforms u, bit-identical to what `Tensor.exponential_` makes of the same u.

    `exponential_` uses the scalar libm log1p; torch's vectorised log1p can differ from it in the last bit of the
    double. That changes the float only where a float rounding boundary lies within that bit, so those few
    elements (about 1 in 10**8) are found (their doubles a little above and below round to different floats) and
    recomputed with the scalar log1p of Python's math module (the same libm)."""
    values = uniform.neg().log1p_().neg_()  # one double buffer, worked in place
    rounded = values.float()
    low = values.mul_(1 - _LOG1P_SLACK).float()
    near = values.mul_((1 + _LOG1P_SLACK) / (1 - _LOG1P_SLACK)).float().ne_(low)
    if bool(near.any()):
        flat, where = rounded.view(-1), near.view(-1).nonzero().squeeze(-1)
        values = uniform.reshape(-1)[where].tolist()
        flat[where] = torch.tensor([-math.log1p(-u) for u in values], dtype=torch.float64).float()
    return rounded


def _valid_probabilities(probs: torch.Tensor) -> bool:
    """What torch.multinomial checks before drawing (finite, non-negative, no row summing to zero), in two
    reductions: a NaN or an infinity makes its row's sum one. (A finite sum that overflows also sends the draw to
    torch.multinomial, which is never wrong, only slower.)"""
    sums = probs.sum(dim=-1)
    return bool(torch.isfinite(sums).all() and (sums > 0).all() and probs.min() >= 0)


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


def top_k_only(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`logits` (..., V) with every value below its row's k-th largest set to -inf (ties with the k-th stay)."""
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def next_token_probs(logits: torch.Tensor, settings: SamplerSettings) -> torch.Tensor:
    """AR sampling's next-token probabilities (..., V) from logits (temperature > 0): scaled, cut to top_k.

    With a cut, float32 logits on a CPU go to `printpress_draw::top_k_probs`: ATen's division and softmax around a
    cut of its own (the same bits; 4 rows of 4096 and k = 50 in ~23 us against ~78, one row ~10 against ~31)."""
    top_k = settings.top_k
    if top_k is not None and 1 <= top_k < logits.shape[-1] and logits.dtype == torch.float32 \
            and logits.device.type == "cpu" and draw_kernels():
        probs = torch.ops.printpress_draw.top_k_probs(logits, settings.temperature, top_k)
        if probs is not None:  # (None: a row holds a NaN, whose place in the order topk decides)
            return probs
    scaled = logits / settings.temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        scaled = top_k_only(scaled, top_k)
    return torch.softmax(scaled, dim=-1, dtype=torch.float32)


def sample_next_token(logits: torch.Tensor, settings: SamplerSettings, generator: torch.Generator) -> int:
    """Next token from one row of next-token logits (V,): greedy at temperature 0, else sampled."""
    if settings.temperature == 0:
        return int(torch.argmax(logits))
    return int(multinomial_one(next_token_probs(logits, settings), generator))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-probability of `token` under one row of next-token logits (V,), and the `top` most likely tokens'.

    The model's own distribution, log_softmax of the raw logits: the temperature and top-k that shaped the draw do
    not enter (OpenAI reports the same). Computed only for a request that asks (`Request.logprobs`).
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(log_probs, min(top, log_probs.shape[-1]))
    return TokenLogprob(token, float(log_probs[token]), list(zip(ids.tolist(), values.tolist())))
