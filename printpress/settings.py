"""The sampler settings, defined once.

`SETTINGS` is the one definition of every knob a caller may set per request: its name, type, default and where
the default comes from, which decoding modes read it, the range its value must lie in, the sentence that
explains it, and the name people write. Everything else is derived from it:

- `SamplerSettings`, the engine's record of one request's settings: one field per stored setting;
- `SamplerSettings.validate` and `check_setting` (the ranges), `refuse_unread` (a setting the mode does not read
  is refused by name, with the modes that do read it);
- the command-line flags (`printpress.cli_flags`: `--<wire name>`, its help), the HTTP fields of the completion
  and edit requests (`printpress.serve.protocol`: the wire name, the bounds, the description), and the
  `key=value` settings of the benchmark (`parse_assignments`).

So a new knob is one `Setting` here, plus the code that reads it (docs/generation.md, "Extension points").

Imports nothing heavy: the CLI builds its parser and checks its flags with it, without torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from printpress.config import GenerationConfig
from printpress.errors import GenerationError

MODES = ("diffusion", "ar", "speculative")
# mode speculative's drafts (printpress/speculative.py)
DRAFT_SOURCES = ("diffusion", "lookup", "both", "table", "auto")
CANVAS_STARTS = ("noise", "table")  # how a diffusion canvas starts (printpress/diffusion.py)
CANVAS_MODES = ("diffusion", "speculative")  # the modes that denoise canvases (speculative: its drafts)

# mode="speculative": decoder passes per draft unless told (`draft_steps`). One is the fastest setting measured on
# the shipped model (docs/benchmarks-speculative.md); a whole canvas's step count (32) would run at a tenth of it.
SPECULATIVE_DRAFT_STEPS = 1

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

# The OpenAPI document marks temperatures between 0 and MIN_TEMPERATURE as refused (the engine refuses them with
# its own message), so that generated clients and fuzzers do not send them.
NOT_TINY = {"json_schema_extra": {"not": {"type": "number", "exclusiveMinimum": 0,
                                          "exclusiveMaximum": MIN_TEMPERATURE}}}


# --------------------------------------------------------------------------------------------
# Per-value rules: each raises GenerationError naming the setting (by its label) and the value
# --------------------------------------------------------------------------------------------

Check = Callable[[str, object], None]


def _integer(low: int, high: int | None = None) -> Check:
    words = "a positive integer" if low == 1 else f"an integer >= {low}"
    words += "" if high is None else f" no larger than {high}"

    def check(label: str, value: object) -> None:
        _require(_is_int(value) and low <= value and (high is None or value <= high),
                 f"{label} must be {words}, got {value!r}")

    return check


def _positive(label: str, value: object) -> None:
    _require(_is_real(value) and math.isfinite(value) and value > 0, f"{label} must be > 0 and finite, got {value!r}")


def _non_negative(label: str, value: object) -> None:
    _require(_is_real(value) and math.isfinite(value) and value >= 0, f"{label} must be >= 0 and finite, got {value!r}")


def _temperature(zero: str | None) -> Check:
    """A temperature: within [MIN_TEMPERATURE, MAX_TEMPERATURE], or exactly 0 when `zero` says what 0 means."""
    span = f"between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}"
    words = f"> 0 and finite: {span}" if zero is None else f">= 0 and finite: 0{zero} or {span}"

    def check(label: str, value: object) -> None:
        in_range = _is_real(value) and MIN_TEMPERATURE <= value <= MAX_TEMPERATURE  # NaN fails both comparisons
        _require(in_range or (zero is not None and _is_real(value) and value == 0),
                 f"{label} must be {words}, got {value!r}")

    return check


def _optional_positive_integer(label: str, value: object) -> None:
    _require(value is None or (_is_int(value) and value > 0), f"{label} must be a positive integer, got {value!r}")


def _flag(label: str, value: object) -> None:
    _require(isinstance(value, bool), f"{label} must be true or false, got {value!r}")


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(label: str, value: object) -> None:
        _require(value in choices, f"unknown {label} {value!r}; expected one of {', '.join(choices)}")
    return check


_mode = _one_of(MODES)


# --------------------------------------------------------------------------------------------
# The definition
# --------------------------------------------------------------------------------------------

REFERENCE = GenerationConfig()  # the reference's defaults (printpress.config), for settings a checkpoint can set


@dataclass(frozen=True)
class Setting:
    """One sampler knob. `SETTINGS` lists them; each attribute says what is derived from it."""

    name: str  # the SamplerSettings field and the `Pipeline.generate` / `Pipeline.settings` keyword
    kind: type  # int, float, bool, str, or tuple (token ids): the value's type, the flag's and the HTTP field's
    help: str  # one phrase: the flag's help, and (as a sentence) the HTTP field's description
    default: object = None  # SamplerSettings' default (a checkpoint setting: the reference's, `REFERENCE`)
    # What leaving it out means in the modes where that is not `default` (temperature in diffusion mode: the schedule
    # as set, a multiplier of 1): the page's placeholders show it (GET /v1/settings `mode_defaults`).
    mode_defaults: tuple[tuple[str, object], ...] = ()
    checkpoint: str | None = None  # the GenerationConfig field that gives `Pipeline`'s default (generation_config.json,
    # or printpress_generation.json for printpress's own)
    modes: tuple[str, ...] = MODES  # the modes that read it; given for another mode, it is refused (`refuse_unread`)
    check: Check | None = None  # the value's range, wherever it comes from (`check_setting`)
    wire: str = ""  # the name people write: the flag `--<wire>`, the HTTP field, the benchmark key (default: name)
    http: dict | None = None  # the HTTP field's bounds (pydantic `Field` keywords); None: not an HTTP sampler field
    choices: tuple = ()  # the values allowed, for a setting that names one of a few (the HTTP field is a Literal)
    editing: bool = False  # editing (`printpress edit`, POST /v1/edits) takes it: a setting of the diffusion sampler
    stored: bool = True  # a SamplerSettings field (draft_steps is not: it is stored in max_denoising_steps)
    default_passes: bool = True  # given for a mode that does not read it, a value equal to the default passes
    step_count: bool = False  # decoder passes per canvas: the server caps it (`printpress serve --max-steps`)

    def __post_init__(self) -> None:
        if not self.wire:
            object.__setattr__(self, "wire", self.name)

    @property
    def label(self) -> str:
        """How messages name it: the wire name, and the engine's name when that differs ("steps (max_denoising_steps)")."""
        return self.name if self.wire == self.name else f"{self.wire} ({self.name})"

    @property
    def flag(self) -> str:
        return "--" + self.wire.replace("_", "-")

    @property
    def description(self) -> str:
        """The help as a sentence (the HTTP field's description)."""
        return self.help[:1].upper() + self.help[1:] + "."

    def parse(self, text: str) -> object:
        """The value written as text (a command line, a `key=value` pair); ValueError when it is not one."""
        if self.kind is bool:
            return _boolean(text)
        if self.kind is tuple:
            return token_ids(text)
        return self.kind(text)


SETTINGS: tuple[Setting, ...] = (
    Setting("mode", str, "diffusion (default), ar (the encoder as a causal LM), or speculative (diffusion drafts, "
            "AR verifies: AR's output)", default="diffusion", check=_mode, http={}, choices=MODES),
    Setting("max_new_tokens", int, "new tokens to print (diffusion computes whole canvases and keeps this many)",
            default=REFERENCE.max_new_tokens, checkpoint="max_new_tokens", check=_integer(1)),
    Setting("max_denoising_steps", int, "maximum denoising steps per diffusion canvas (refused in mode speculative: "
            "see draft_steps)", default=REFERENCE.max_denoising_steps, checkpoint="max_denoising_steps",
            modes=CANVAS_MODES, check=_integer(1, MAX_DENOISING_STEPS), wire="steps",
            http=dict(ge=1, le=MAX_DENOISING_STEPS), editing=True, step_count=True),
    Setting("draft_steps", int, f"mode speculative: denoising steps per draft (default {SPECULATIVE_DRAFT_STEPS})",
            default=SPECULATIVE_DRAFT_STEPS, modes=("speculative",), check=_integer(1, MAX_DENOISING_STEPS),
            http=dict(ge=1, le=MAX_DENOISING_STEPS), stored=False, default_passes=False, step_count=True),
    Setting("entropy_bound", float, "entropy bound for accepting positions per step",
            default=REFERENCE.entropy_bound, checkpoint="entropy_bound", modes=CANVAS_MODES, check=_positive,
            http=dict(gt=0, le=1e6), editing=True),
    Setting("t_min", float, "temperature at the last denoising step", default=REFERENCE.t_min, checkpoint="t_min",
            modes=CANVAS_MODES, check=_temperature(zero=""), http=dict(ge=0, le=100, **NOT_TINY), editing=True),
    Setting("t_max", float, "temperature at the first denoising step", default=REFERENCE.t_max, checkpoint="t_max",
            modes=CANVAS_MODES, check=_temperature(zero=None), http=dict(gt=0, le=100, **NOT_TINY), editing=True),
    Setting("stability_threshold", int, "stable steps needed to stop a canvas early",
            default=REFERENCE.stability_threshold, checkpoint="stability_threshold", modes=("diffusion",),
            check=_integer(0, MAX_DENOISING_STEPS), http=dict(ge=0, le=MAX_DENOISING_STEPS), editing=True),
    Setting("confidence_threshold", float, "mean entropy needed to stop a canvas early",
            default=REFERENCE.confidence_threshold, checkpoint="confidence_threshold", modes=("diffusion",),
            check=_positive, http=dict(gt=0, le=1e6), editing=True),
    # A bare SamplerSettings is greedy; a Pipeline's default is the checkpoint's (0.8 unless it says otherwise).
    # In diffusion mode (and editing) a given temperature scales the schedule (`SamplerSettings.scale_schedule`).
    Setting("temperature", float, "modes ar and speculative: the sampling temperature (0 = greedy; default: the "
            "checkpoint's, else 0.8); mode diffusion and editing: a multiplier of the t_max -> t_min schedule (1 = as "
            "set, 0 = the coldest the sampler allows)", default=0.0, checkpoint="temperature",
            mode_defaults=(("diffusion", 1.0),), check=_temperature(zero=" (greedy)"),
            http=dict(ge=0, le=10, **NOT_TINY), editing=True),
    # Opt-in, off (0) in the reference: the canvas opens left to right in coarse strides (after semi-autoregressive
    # decoding of masked models), so a step keeps only positions of the window, under the same entropy bound. It
    # made the code model's text better at its 32-step default and worse at 8 steps (docs/benchmarks.md §7,
    # "Decoding screens"). Not token-exact to the reference when set: it changes which positions are kept.
    Setting("window_lead", float, "left-to-right window (0 = off): at step j of N a step may keep only the first "
            "ceil(canvas * min(1, window_lead * j / N)) positions, so 1 opens the whole canvas at the last step and "
            "1.5 two thirds of the way", default=0.0, checkpoint="window_lead", modes=("diffusion",),
            check=_non_negative, http=dict(ge=0, le=1e6), editing=True),
    # Opt-in, off (0) in the reference: a canvas position's distribution cut to its k most likely tokens before the
    # step's entropy, acceptance and draw, as AR sampling's top_k cuts the next token's. Not token-exact to the
    # reference when set. Measured on the shipped model in docs/benchmarks.md §7 ("Decoding screens").
    Setting("canvas_top_k", int, "canvas steps: keep only each position's k most likely tokens for the entropy, the "
            "acceptance and the draw (0 = off, as the reference)", default=0, modes=CANVAS_MODES,
            check=_integer(0), http=dict(ge=0), editing=True),
    # Opt-in, "noise" in the reference: a canvas that starts from tokens drawn from the model's draft table's sampled
    # counts (printpress/draft_table.py) instead of uniform noise. Not the reference's; screened as L16 in
    # docs/benchmarks.md §7 (faster and better judged on the shipped model, mostly the table's doing).
    Setting("canvas_start", str, "mode diffusion: what each canvas starts from: noise (uniform, as the reference) or "
            "table (tokens drawn one after another from the model's draft table, then denoised; opt-in)",
            default="noise", modes=("diffusion",), check=_one_of(CANVAS_STARTS), http={}, choices=CANVAS_STARTS),
    # top_k asks for AR sampling, which diffusion never does: any value of it is refused there.
    Setting("top_k", int, "modes ar and speculative: sample among the k most likely tokens (default: the "
            "checkpoint's, else 50)", checkpoint="top_k", modes=("ar", "speculative"),
            check=_optional_positive_integer, http=dict(ge=1), default_passes=False),
    Setting("eos_token_ids", tuple, "end-of-sequence ids, comma separated ('' for none)", default=(),
            checkpoint="eos_token_id", wire="eos"),
    # Opt-in, not the reference's sampler: the canvas slides along the text instead of being committed whole. Each
    # step commits the canvas's leading run of fixed points (kept positions whose sample is the token the pass read
    # there; the first position alone once it has waited `steps` steps), writes them to the cache and opens as many
    # noise positions at the canvas's end (printpress/diffusion.py), so the decoder reads the text before the canvas
    # from the cache, which it trusts, and never from clean canvas tokens it cannot tell from noise
    # (docs/benchmarks.md §8, "The sliding sampler").
    Setting("sliding", bool, "mode diffusion: slide the canvas along the text: each step commits its leading "
            "positions whose sample repeats the token the step read there (the first position after at most `steps` "
            "steps) to the cache and appends as much noise; not the reference's sampler (opt-in)", default=False,
            checkpoint="sliding", modes=("diffusion",), check=_flag, http={}),
    # Opt-in, not token-exact to the reference: draw samples only at the positions the entropy bound accepts. The
    # tokens follow the same distribution (a sample at a re-noised position is thrown away anyway), but the random
    # stream differs, and the multinomial over canvas x vocabulary shrinks.
    Setting("sample_accepted_only", bool, "sample only the positions the entropy bound accepts: the same "
            "distribution, not token-exact to the reference; faster where printpress's CPU draw kernel is not "
            "built (a GPU, no compiler), not with it", default=False, modes=CANVAS_MODES,
            check=_flag, http={}, editing=True),
    # TiDAR-style rounds: after the first, one pass verifies the drafts and drafts the next round for every outcome
    # (printpress/speculative.py). Needs one draft step: the fused canvases get a single decoder step.
    Setting("fused_draft", bool, "mode speculative with draft_steps 1: one pass per round both verifies the drafts "
            "and drafts the next round (same output, fewer passes)", default=False, modes=("speculative",),
            check=_flag, http={}),
    # Where mode speculative's drafts come from; the output is AR's whatever they are. "lookup" is prompt-lookup
    # decoding (vLLM's n-gram proposer, llama.cpp's lookup decoding): no decoder pass, so a round that finds no
    # draft costs what an AR step costs. "table" reads the model's draft table (printpress/draft_table.py), which
    # beat diffusion drafts greedy and sampled on the shipped model, so "auto" (the default) takes it where there is
    # one. Measured in docs/benchmarks-speculative.md ("Drafts from the context", "Drafts from a draft table").
    Setting("draft_source", str, "mode speculative: what writes the drafts AR verifies: diffusion (the decoder "
            "denoises a canvas), lookup (the tokens that followed the latest earlier occurrence of the text's last "
            "1-3 tokens; no decoder pass), both (lookup where it finds a match, diffusion elsewhere), table (the "
            "model's draft table, made by `printpress draft-table`; lookup where it has no entry) or auto (the "
            "default: table where the model has one, else diffusion; diffusion when draft_steps or fused_draft is "
            "set)",
            default="auto", modes=("speculative",), check=_one_of(DRAFT_SOURCES), http={},
            choices=DRAFT_SOURCES),
)

BY_NAME = {s.name: s for s in SETTINGS}
BY_WIRE = {s.wire: s for s in SETTINGS}
EDITING = tuple(s for s in SETTINGS if s.editing)


def check_setting(name: str, value: object) -> None:
    """Raise GenerationError when `value` cannot work for the setting `name`, whatever the other settings are.

    The per-value half of `SamplerSettings.validate`, so a command line can refuse a bad flag before it loads
    a model (the checks between settings, t_min <= t_max, need the checkpoint's defaults). Names without a
    rule (eos_token_ids) pass.
    """
    setting = BY_NAME.get(name)
    if setting is not None and setting.check is not None:
        setting.check(setting.label, value)


def refuse_unread(mode: str, given: dict, defaults: SamplerSettings) -> None:
    """Raise GenerationError for a setting given for a mode that does not read it, rather than ignore it.

    A value that asks for nothing the request does not get anyway passes, so a client may send the same
    settings to every mode: the default (the checkpoint's, for the diffusion settings) of a setting whose
    `default_passes`, such as sample_accepted_only=False. top_k asks for AR sampling, which diffusion mode (and
    so editing) never does, and draft_steps for drafts, so any value of them is refused where they are not read;
    temperature has a meaning in every mode (in diffusion it scales the schedule). (The rule is written down in
    docs/generation.md.)
    """
    if mode not in MODES:
        return  # validate() names the unknown mode
    for name, value in given.items():
        setting = BY_NAME.get(name)
        if value is None or setting is None or mode in setting.modes:
            continue
        if setting.default_passes and value == getattr(defaults, name):
            continue
        readers = [repr(m) for m in MODES if m in setting.modes]
        only = f"only mode {readers[0]} uses it" if len(readers) == 1 else f"only modes {' and '.join(readers)} use it"
        raise GenerationError(f"{setting.label}={value!r} does not apply to mode={mode!r} ({only}); leave it out")


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


def from_wire(values: dict[str, object]) -> dict[str, object]:
    """Settings keyed by the names people write (`steps`, `eos`, ...) as `Pipeline.settings` keywords; None (not
    given) is left out."""
    return {BY_WIRE[key].name: value for key, value in values.items() if value is not None}


def parse_assignments(text: str, keys: Iterable[str] | None = None) -> dict[str, object]:
    """`steps=8,entropy_bound=4,t_max=0.4` (the names people write, as in the HTTP API) -> `Pipeline.settings`
    keywords, each value parsed by its setting's type and checked on its own (`check_setting`).

    `keys` limits the wire names accepted (default: every setting's). The checks between settings (t_min <= t_max,
    a setting the mode does not read) are `Pipeline.settings`'s. `steps` is `max_denoising_steps` in every mode
    here (with mode=speculative: the drafts' steps).
    """
    allowed = list(BY_WIRE) if keys is None else [key for key in BY_WIRE if key in set(keys)]
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in allowed:
            raise GenerationError(f"{text!r}: expected key=value pairs with keys among {', '.join(allowed)}, "
                                  f"got {item!r}")
        try:
            values[key] = BY_WIRE[key].parse(value)
        except ValueError:
            raise GenerationError(f"{text!r}: {key} cannot be {value!r}") from None
    if not values:
        raise GenerationError(f"{text!r}: give at least one key=value pair")
    settings = from_wire(values)
    for name, value in settings.items():
        try:
            check_setting(name, value)
        except GenerationError as exc:
            raise GenerationError(f"{text!r}: {exc}") from None  # every message names the text, as those above
    return settings


def token_ids(text: str) -> tuple[int, ...]:
    """'2,651 1234' -> (2, 651, 1234): integers separated by commas or spaces ('' is no ids)."""
    try:
        return tuple(int(part) for part in text.replace(",", " ").split())
    except ValueError:
        raise GenerationError(f"token ids must be integers separated by commas or spaces, got {text!r}") from None


def _boolean(text: str) -> bool:
    words = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    if text.lower() not in words:
        raise ValueError(text)
    return words[text.lower()]


# --------------------------------------------------------------------------------------------
# The engine's record of one request's settings
# --------------------------------------------------------------------------------------------


def _setting_fields(cls: type) -> type:
    """Give a class (before @dataclass makes it one) a field per stored entry of SETTINGS, with its default, ahead of
    the fields it declares itself."""
    annotations = {s.name: s.kind if s.kind is not tuple else tuple[int, ...] for s in SETTINGS if s.stored}
    for s in SETTINGS:
        if s.stored:
            setattr(cls, s.name, s.default)
    cls.__annotations__ = {**annotations, **cls.__dict__.get("__annotations__", {})}
    return cls


@dataclass(frozen=True)
@_setting_fields
class SamplerSettings:
    """Everything that decides the tokens of one request, apart from the prompt and the seed.

    One field per stored entry of `SETTINGS` (mode, max_new_tokens, max_denoising_steps, entropy_bound, t_min,
    t_max, stability_threshold, confidence_threshold, window_lead, canvas_top_k, canvas_start, temperature, top_k,
    eos_token_ids, sliding, sample_accepted_only, fused_draft, draft_source),
    with that entry's default, plus the checkpoint's pad id. Names follow the checkpoint's generation_config.json.
    `temperature` and `top_k` are the AR model's sampling (`mode="ar"` and `"speculative"`); the diffusion
    sampler uses the linear schedule `t_max -> t_min` instead, which a `temperature` given in diffusion mode
    scales (`scale_schedule`). Each entry's `modes` says which mode reads it.
    """

    pad_token_id: int | None = REFERENCE.pad_token_id  # the checkpoint's; not a setting a request changes

    def __post_init__(self) -> None:
        eos = self.eos_token_ids
        eos = () if eos is None else (eos,) if isinstance(eos, int) else eos
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in eos))

    def with_overrides(self, **overrides) -> SamplerSettings:
        """Copy with every override that is not None applied (None means "keep the default")."""
        return replace(self, **{key: value for key, value in overrides.items() if value is not None})

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

        Only the settings the mode reads are checked (`refuse_unread` refuses the others), and the flags, which
        can only be true or false, each against the range where the sampler's arithmetic stays finite
        (`check_setting`), then t_min against t_max.
        """
        _mode("mode", self.mode)  # before the loop, which checks the settings of a known mode
        for s in SETTINGS:
            if s.stored and (self.mode in s.modes or s.kind is bool):
                check_setting(s.name, getattr(self, s.name))
        if self.mode in BY_NAME["t_max"].modes:
            _require(self.t_min <= self.t_max, f"t_min ({self.t_min}) must not exceed t_max ({self.t_max})")
        if self.mode == "diffusion" and self.sliding:
            _require(self.canvas_start == "noise",
                     f"sliding appends noise where the canvas moves on; it starts from noise, not canvas_start="
                     f"{self.canvas_start!r}: leave canvas_start out or sliding off")
        if self.mode == "speculative" and self.fused_draft:
            _require(self.max_denoising_steps == 1,
                     f"fused_draft needs draft_steps (max_denoising_steps) = 1, got {self.max_denoising_steps}: a "
                     "fused pass drafts with a single decoder step; set draft_steps=1 or leave fused_draft off")
            _require(self.draft_source in ("diffusion", "auto"),
                     f"fused_draft drafts with the decoder; it needs draft_source diffusion, got {self.draft_source!r}")
        return self


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise GenerationError(message)

