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
import numbers
from dataclasses import dataclass, replace

import torch

from printpress.config import GenerationConfig
from printpress.errors import GenerationError

MODES = ("diffusion", "ar", "speculative")

# The settings each mode reads, besides max_new_tokens and eos_token_ids, which every mode reads.
DIFFUSION_SAMPLER = ("max_denoising_steps", "entropy_bound", "t_min", "t_max", "sample_accepted_only")
ADAPTIVE_STOP = ("stability_threshold", "confidence_threshold")
AR_SAMPLER = ("temperature", "top_k")
MODE_SETTINGS = {
    # temperature in diffusion mode multiplies the t_max -> t_min schedule (`scale_schedule`)
    "diffusion": DIFFUSION_SAMPLER + ADAPTIVE_STOP + ("temperature",),
    "ar": AR_SAMPLER,
    "speculative": AR_SAMPLER + DIFFUSION_SAMPLER,  # the AR model samples; the drafts run every step, no stop
}
_MODE_SPECIFIC = frozenset(name for names in MODE_SETTINGS.values() for name in names)

# mode="speculative": decoder passes per draft unless told (`draft_steps`). One is the fastest setting measured on
# the shipped model (docs/benchmarks-speculative.md); a whole canvas's step count (32) would run at a tenth of it.
SPECULATIVE_DRAFT_STEPS = 1


_DEFAULTS = GenerationConfig()


@dataclass(frozen=True)
class SamplerSettings:
    """Everything that decides the tokens of one request, apart from the prompt and the seed.

    Names follow the checkpoint's generation_config.json. `temperature` and `top_k` are the AR
    model's sampling (`mode="ar"` and `"speculative"`); the diffusion sampler uses the linear schedule
    `t_max -> t_min` instead, which a `temperature` given in diffusion mode scales (`scale_schedule`).
    `MODE_SETTINGS` says which mode reads which setting.
    """

    # The reference's defaults, kept in one place (printpress.config.GenerationConfig).
    max_new_tokens: int = _DEFAULTS.max_new_tokens
    max_denoising_steps: int = _DEFAULTS.max_denoising_steps
    entropy_bound: float = _DEFAULTS.entropy_bound
    t_min: float = _DEFAULTS.t_min
    t_max: float = _DEFAULTS.t_max
    stability_threshold: int = _DEFAULTS.stability_threshold
    confidence_threshold: float = _DEFAULTS.confidence_threshold
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = _DEFAULTS.pad_token_id
    mode: str = "diffusion"
    temperature: float = 0.0
    top_k: int | None = None
    # Opt-in, not token-exact to the reference: draw samples only at the positions the entropy bound
    # accepts. The tokens follow the same distribution (a sample at a re-noised position is thrown away
    # anyway), but the random stream differs, and the multinomial over canvas x vocabulary shrinks.
    sample_accepted_only: bool = False

    def with_overrides(self, **overrides) -> SamplerSettings:
        """Copy with every override that is not None applied (None means "keep the default")."""
        kept = {key: value for key, value in overrides.items() if value is not None}
        if "eos_token_ids" in kept:
            kept["eos_token_ids"] = tuple(int(t) for t in kept["eos_token_ids"])
        return replace(self, **kept)

    def scale_schedule(self, temperature: float) -> SamplerSettings:
        """Diffusion mode's reading of `temperature`: a multiplier of the whole t_max -> t_min schedule.

        1 keeps the schedule as set (the checkpoint's, or the given t_min / t_max), 0.5 halves both ends, 0 is the
        coldest the sampler allows (t_max = MIN_TEMPERATURE, t_min = 0: every position all but greedy). Ends are
        clamped into the accepted ranges, so any valid temperature gives a valid schedule.
        """
        if temperature == 1:
            return self
        t_max = min(max(self.t_max * temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
        t_min = self.t_min * temperature
        t_min = 0.0 if t_min == 0 else min(max(t_min, MIN_TEMPERATURE), t_max)
        return replace(self, t_min=t_min, t_max=t_max, temperature=temperature)

    def validate(self) -> SamplerSettings:
        """Raise GenerationError with one clear message for the first setting that cannot work.

        Only the settings the mode reads are checked (`refuse_unread` refuses the others), each against the
        range where the sampler's arithmetic stays finite (`check_setting`), then t_min against t_max.
        """
        if self.mode not in MODES:
            raise GenerationError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        for name in ("max_new_tokens", "sample_accepted_only", *MODE_SETTINGS[self.mode]):
            check_setting(name, getattr(self, name))
        if "t_max" in MODE_SETTINGS[self.mode]:
            _require(self.t_min <= self.t_max, f"t_min ({self.t_min}) must not exceed t_max ({self.t_max})")
        return self


# Ranges where the sampler's arithmetic stays finite. Logits are divided by the temperature in float32: below
# MIN_TEMPERATURE sampling is greedy in all but name (a logit gap of 0.01 already weighs e^100) while logits / T
# heads for float32's overflow (T = 1e-38 made every logit inf, the softmax NaN, and the multinomial raise);
# above MAX_TEMPERATURE every token is equally likely for any logits a model produces, and inf or NaN make the
# logits NaN (t_max = inf silently generated nothing). The last diffusion step runs at t_min + (t_max - t_min)
# / N, at least MIN_TEMPERATURE / MAX_DENOISING_STEPS, still far from overflow.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
# The step counter is an int32 tensor (as the reference's), and the adaptive stop keeps `stability_threshold`
# argmax canvases per request: a bound keeps a typo from becoming an endless loop or a 25 GB allocation. It is
# 85 times the reference's default of 48 steps; a threshold above the step count could never fire anyway.
MAX_DENOISING_STEPS = 4096


def check_setting(name: str, value: object) -> None:
    """Raise GenerationError when `value` cannot work for the setting `name`, whatever the other settings are.

    The per-value half of `SamplerSettings.validate`, so a command line can refuse a bad flag before it loads
    a model (the checks between settings, t_min <= t_max, need the checkpoint's defaults). Names without a
    rule (eos_token_ids) pass.
    """
    check = _CHECKS.get(name)
    if check is not None:
        check(value)


def _integer(label: str, low: int, high: int | None = None):
    words = "a positive integer" if low == 1 else f"an integer >= {low}"
    words += "" if high is None else f" no larger than {high}"

    def check(value: object) -> None:
        _require(_is_int(value) and low <= value and (high is None or value <= high),
                 f"{label} must be {words}, got {value!r}")

    return check


def _positive(label: str):
    def check(value: object) -> None:
        _require(_is_real(value) and math.isfinite(value) and value > 0,
                 f"{label} must be > 0 and finite, got {value!r}")

    return check


def _temperature(label: str, zero: str | None):
    """A temperature: within [MIN_TEMPERATURE, MAX_TEMPERATURE], or exactly 0 when `zero` says what 0 means."""
    span = f"between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}"
    words = f"> 0 and finite: {span}" if zero is None else f">= 0 and finite: 0{zero} or {span}"

    def check(value: object) -> None:
        in_range = _is_real(value) and MIN_TEMPERATURE <= value <= MAX_TEMPERATURE  # NaN fails both comparisons
        _require(in_range or (zero is not None and _is_real(value) and value == 0),
                 f"{label} must be {words}, got {value!r}")

    return check


def _check_top_k(value: object) -> None:
    _require(value is None or (_is_int(value) and value > 0), f"top_k must be a positive integer, got {value!r}")


def _check_flag(value: object) -> None:
    _require(isinstance(value, bool), f"sample_accepted_only must be true or false, got {value!r}")


def _check_mode(value: object) -> None:
    _require(value in MODES, f"unknown mode {value!r}; expected one of {', '.join(MODES)}")


_CHECKS = {
    "mode": _check_mode,
    "max_new_tokens": _integer("max_new_tokens", 1),
    "max_denoising_steps": _integer("steps (max_denoising_steps)", 1, MAX_DENOISING_STEPS),
    "draft_steps": _integer("draft_steps", 1, MAX_DENOISING_STEPS),
    "stability_threshold": _integer("stability_threshold", 0, MAX_DENOISING_STEPS),
    "entropy_bound": _positive("entropy_bound"),
    "confidence_threshold": _positive("confidence_threshold"),
    "t_min": _temperature("t_min", zero=""),
    "t_max": _temperature("t_max", zero=None),
    "temperature": _temperature("temperature", zero=" (greedy)"),
    "top_k": _check_top_k,
    "sample_accepted_only": _check_flag,
}


def refuse_unread(mode: str, given: dict, defaults: SamplerSettings) -> None:
    """Raise GenerationError for a setting given for a mode that does not read it, rather than ignore it.

    A value that asks for nothing the request does not get anyway passes, so a client may send the same
    settings to every mode: the default (the checkpoint's, for the diffusion settings) of a diffusion
    setting, or sample_accepted_only=False. top_k asks for AR sampling, which diffusion mode (and so editing)
    never does, so any value of it is refused there; temperature has a meaning in every mode (in diffusion it
    scales the schedule). (The rule is written down in docs/generation.md.)
    """
    if mode not in MODE_SETTINGS:
        return  # validate() names the unknown mode
    for name, value in given.items():
        if value is None or name not in _MODE_SPECIFIC or name in MODE_SETTINGS[mode]:
            continue
        if name not in AR_SAMPLER and value == getattr(defaults, name):
            continue
        readers = [repr(m) for m in MODES if name in MODE_SETTINGS[m]]
        only = f"only mode {readers[0]} uses it" if len(readers) == 1 else f"only modes {' and '.join(readers)} use it"
        label = "steps (max_denoising_steps)" if name == "max_denoising_steps" else name
        raise GenerationError(f"{label}={value!r} does not apply to mode={mode!r} ({only}); leave it out")


def refuse_canvas_steps(mode: str | None, steps: object) -> None:
    """`steps` where a person or a client writes it (the CLI's --steps, the HTTP API's `steps`) means a diffusion
    canvas's denoising steps. Speculative drafts are canvases too, but a draft wants one or two steps where a
    canvas wants 32, so the same number copied from a diffusion request would be a slow surprise (16 steps per
    draft ran at 3.9 tokens/s): there the drafts' steps are `draft_steps`, and `steps` is refused. (The Python
    API's `max_denoising_steps` keeps meaning "steps of each canvas the mode denoises", drafts included.)"""
    if mode == "speculative" and steps is not None:
        raise GenerationError(
            f"steps={steps!r} does not apply to mode='speculative' (it sets the denoising steps of a diffusion "
            f"canvas); the speculative drafts run draft_steps steps (default {SPECULATIVE_DRAFT_STEPS}, the fastest "
            "measured): set draft_steps, or leave steps out")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise GenerationError(message)


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
