"""The sides of `printpress bench` and decoding them: which model with which settings, and every side on every
prompt and seed, measured.

A side decodes through `Pipeline.generate` on a pipeline whose model is a `MeteredModel`: the model itself,
with each network pass (`encode`, `denoise`) counted and timed on the way through. What the diffusion sampler
decided at each step comes from the engine's own `StepEvent`s. Nothing of the engine is replaced to measure it,
so every side decodes exactly the tokens `printpress generate` would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from printpress.errors import GenerationError, PrintpressError
from printpress.events import Event, StepEvent
from printpress.settings import BY_NAME, BY_WIRE, parse_assignments

# AR sampling as in the model cards: what the twins' published samples and judged NLLs used.
AR_SAMPLING = {"temperature": 0.8, "top_k": 50}

# --setting keys: the sampler settings' wire names (printpress.settings), as in the HTTP API, but for the token budget,
# which the bench sets for every side itself (--max-new-tokens).
SETTING_KEYS = tuple(key for key in BY_WIRE if key != "max_new_tokens")


# The two AR sides every run has: the reference for speed (and a judge), and AR decoding on the diffusion
# model's own weights, the reference for diversity (issue 11 compares diffusion with AR on the same weights).
AR_TWIN, OWN_AR = "AR twin", "diffusion model, AR decoding"

# The control every run with a `canvas_start="table"` side gets: the draft table's chain alone, the tokens a canvas
# would start from, with no network pass. Where it is judged as well as the canvases revised from it, the quality
# is the table's, not diffusion's (docs/benchmarks.md §7, L16 and L17).
TABLE_CHAIN = "draft table's chain alone (no pass)"


class BenchError(PrintpressError):
    """A benchmark that cannot run as asked (bad setting, missing judge, no held-out data)."""


# --------------------------------------------------------------------------------------------
# Sides
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One way of decoding: which model (`diffusion` or `ar`), and the generate() overrides."""

    label: str
    model: str
    overrides: dict[str, Any] = field(default_factory=dict)
    chain: bool = False  # `TABLE_CHAIN`: the model's draft table's chain, drawn without the network

    @property
    def kind(self) -> str:
        """ar | diffusion | speculative | chain: how it decodes."""
        return "chain" if self.chain else self.overrides.get("mode", "diffusion")


def named_sampler(overrides: dict[str, Any]) -> dict[str, Any]:
    """A side names its sampler: in diffusion mode whole canvases unless it asks for sliding=true, whatever the
    checkpoint's default, so a bench command measures the same sampler on any model."""
    return {"sliding": False, **overrides} if overrides.get("mode", "diffusion") == "diffusion" else overrides


def default_sides(steps: list[int], bounds: list[float], extra: list[dict[str, Any]]) -> list[Side]:
    sides = [Side(AR_TWIN, "ar", {"mode": "ar", **AR_SAMPLING}), Side(OWN_AR, "diffusion", {"mode": "ar", **AR_SAMPLING})]
    for n in steps:
        for bound in bounds:
            sides.append(Side(f"diffusion, {n} steps, bound {bound:g}", "diffusion",
                              named_sampler({"max_denoising_steps": n, "entropy_bound": bound})))
    for overrides in extra:
        sides.append(Side(describe(overrides), "diffusion", named_sampler(overrides)))
    if any(side.overrides.get("canvas_start") == "table" for side in sides):
        sides.append(Side(TABLE_CHAIN, "diffusion", chain=True))
    labels = [s.label for s in sides]
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        raise BenchError(f"the same setting is asked for twice: {', '.join(duplicates)}")
    return sides


def parse_setting(text: str) -> dict[str, Any]:
    """`steps=8,entropy_bound=4,t_max=0.4` -> generate() overrides (`settings.parse_assignments`; mode=speculative
    and mode=ar get AR sampling unless told)."""
    try:
        out = parse_assignments(text, SETTING_KEYS)
    except GenerationError as exc:
        raise BenchError(f"--setting {exc}") from None
    if out.get("mode") in ("ar", "speculative"):
        out = {**AR_SAMPLING, **out}
    return out


def describe(overrides: dict[str, Any]) -> str:
    """A short label: `diffusion, 16 steps, bound 1, t 0.4->0.1, accepted-only`."""
    o = dict(overrides)
    mode = o.pop("mode", "diffusion")
    if mode != "diffusion":
        for key, value in AR_SAMPLING.items():
            if o.get(key) == value:
                o.pop(key)
    parts = []
    if "max_denoising_steps" in o:
        parts.append(f"{o.pop('max_denoising_steps')} steps")
    if "entropy_bound" in o:
        parts.append(f"bound {o.pop('entropy_bound'):g}")
    if "t_max" in o or "t_min" in o:
        parts.append(f"t {o.pop('t_max', 'default')}->{o.pop('t_min', 'default')}")
    if o.pop("sample_accepted_only", False):
        parts.append("accepted-only")
    parts += [f"{_wire(k).replace('_threshold', '')} {v:g}" if isinstance(v, float) else f"{_wire(k)} {v}"
              for k, v in o.items()]
    return ", ".join([mode, *parts])


def _wire(name: str) -> str:
    """The name people write for a generate() keyword (`max_denoising_steps` -> `steps`)."""
    setting = BY_NAME.get(name)
    return name if setting is None else setting.wire


# --------------------------------------------------------------------------------------------
# Decoding every side on every prompt, interleaved and measured
# --------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """What one generate call did inside: the network passes of its model and their time (`MeteredModel`), and
    for diffusion the sampler's steps as the engine reported them (its `StepEvent`s, in order)."""

    decoder_calls: int = 0
    decoder_s: float = 0.0
    encoder_calls: int = 0
    encoder_s: float = 0.0
    steps: list[StepEvent] = field(default_factory=list)

    def record(self, event: Event) -> None:
        """`Pipeline.generate`'s `on_event`: keeps the step events (the result comes back from `generate`)."""
        if isinstance(event, StepEvent):
            self.steps.append(event)


class MeteredModel:
    """A model whose network passes are counted and timed into `trace`: `encode` (the prefill, AR steps, the pass
    that caches a committed canvas) and `encode_tentatively` (speculative verifications) as encoder passes, `denoise`
    as decoder passes, and the passes that do both at once as one decoder pass each (`verify_and_draft`: a fused
    speculative round; `encode_and_denoise`: a sliding canvas's step after a commit). Every other attribute is the model's own, so a `Pipeline` built on it
    decodes exactly as on the model.

    Recording is two counters and a clock read per pass, next to nothing beside a forward.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.trace = Trace()

    def __getattr__(self, name: str) -> Any:  # called only for what the wrapper itself does not define
        return getattr(self.model, name)

    def encode(self, *args, **kwargs):
        return self._pass("encoder", self.model.encode, *args, **kwargs)

    def encode_tentatively(self, *args, **kwargs):  # a speculative verification
        return self._pass("encoder", self.model.encode_tentatively, *args, **kwargs)

    def denoise(self, *args, **kwargs):
        return self._pass("decoder", self.model.denoise, *args, **kwargs)

    def verify_and_draft(self, *args, **kwargs):
        return self._pass("decoder", self.model.verify_and_draft, *args, **kwargs)

    def encode_and_denoise(self, *args, **kwargs):
        return self._pass("decoder", self.model.encode_and_denoise, *args, **kwargs)

    def _pass(self, kind: str, method, *args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        seconds = time.perf_counter() - start
        if kind == "encoder":
            self.trace.encoder_calls += 1
            self.trace.encoder_s += seconds
        else:
            self.trace.decoder_calls += 1
            self.trace.decoder_s += seconds
        return out


@dataclass
class Sample:
    side: str
    prompt: str
    seed: int
    text: str
    new_tokens: int
    forward_passes: int
    seconds: float
    cpu_seconds: float
    first_commit_s: float | None
    trace: Trace
    extra: dict[str, Any]


def seed_plan(prompts: Sequence[str], seeds: int = 1, first_seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, seed) for every sample: K rounds over the P prompts, prompt i of round r with seed
    first_seed + r*P + i, so every sample has its own seed and round r is what `--seed first_seed + r*P` gives."""
    if seeds < 1:
        raise BenchError(f"--seeds must be a positive number of seeds per prompt, got {seeds}")
    return [(prompt, first_seed + r * len(prompts) + i) for r in range(seeds) for i, prompt in enumerate(prompts)]


def chain_sample(pipe, label: str, prompt: str, seed: int, max_new_tokens: int) -> Sample:
    """`TABLE_CHAIN`'s sample: up to `max_new_tokens` tokens drawn from the draft table's counts after `prompt` with
    a generator seeded `seed` (fewer where it knows no context), timed; no network pass."""
    import torch

    start, cpu_start = time.perf_counter(), time.process_time()
    tokens, _ = pipe.model.draft_table.sample(pipe.encode_text(prompt), max_new_tokens,
                                              torch.Generator().manual_seed(seed))
    text = pipe.decode(tokens)
    return Sample(label, prompt, seed, text, len(tokens), 0, time.perf_counter() - start,
                  time.process_time() - cpu_start, None, Trace(), {})


def decode_all(pipes: dict[str, Any], sides: list[Side], plan: list[tuple[str, int]], max_new_tokens: int,
               progress: bool) -> dict[str, list[Sample]]:
    """Every side on every (prompt, seed) of `plan`, sample-major, side order rotated per sample."""
    from tqdm import tqdm

    from printpress.engine import Pipeline

    samples: dict[str, list[Sample]] = {s.label: [] for s in sides}
    # Warm-up (allocator, first-call costs) on a short budget, untimed.
    for side in sides:
        if not side.chain:
            pipes[side.model].generate(plan[0][0], seed=0, max_new_tokens=min(max_new_tokens, 8), **side.overrides)
    metered = {name: Pipeline(MeteredModel(pipe.model), pipe.config, pipe.generation_config, pipe.tokenizer)
               for name, pipe in pipes.items()}
    bar = tqdm(total=len(sides) * len(plan), desc="decode", disable=not progress, dynamic_ncols=True)
    for index, (prompt, seed) in enumerate(plan):
        order = sides[index % len(sides):] + sides[: index % len(sides)]
        for side in order:
            bar.set_postfix_str(side.label)
            if side.chain:
                samples[side.label].append(chain_sample(pipes[side.model], side.label, prompt, seed, max_new_tokens))
                bar.update(1)
                continue
            pipe = metered[side.model]
            trace = pipe.model.trace = Trace()
            # Step events only where the figures read them (`confidence`): building them costs a little per step.
            on_event = trace.record if side.kind == "diffusion" else None
            start, cpu_start = time.perf_counter(), time.process_time()
            result = pipe.generate(prompt, seed=seed, max_new_tokens=max_new_tokens, on_event=on_event,
                                   **side.overrides)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            stats = result.stats
            extra = {k: getattr(stats, k) for k in ("verifications", "drafted_tokens", "accepted_drafts",
                                                    "accepted_per_verification") if hasattr(stats, k)}
            samples[side.label].append(Sample(side.label, prompt, seed, result.text or "", stats.new_tokens,
                                              stats.forward_passes, seconds, cpu_seconds,
                                              stats.time_to_first_commit_s, trace, extra))
            bar.update(1)
    bar.close()
    return samples
