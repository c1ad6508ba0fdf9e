"""`dtype="auto"`: bf16 where the hardware runs it natively and it is measured faster for this model, fp32 elsewhere.

Three parts, so the decision can be tested without the hardware:

- `native_bf16_flags(cpuinfo)`: which native bf16 matmul flags (Intel AMX `amx_bf16`, `avx512_bf16`) a
  /proc/cpuinfo text lists. Without them torch emulates bf16 matmuls, ~70x slower than fp32 on the AMD EPYC this
  project is measured on (docs/benchmarks.md, "Roofline"), so no measurement is needed to say no;
- `decide(fp32_ms, bf16_ms)`: given measured times of the same work in both dtypes, bf16 only when it takes at most
  `BF16_MARGIN` of fp32's time (bf16 gives up exactness, so it must buy a clear gain);
- `measure(model, canvas_length)`: the times themselves, a few forwards of this model's own shapes (one AR step
  after a short prefix and one self-conditioned decoder pass over a canvas), fp32 and a bf16 copy interleaved,
  the best of a few rounds, within a fraction of a second.

`choose(device, ...)` puts them together: on CUDA, bf16 when `torch.cuda.is_bf16_supported()`; on a CPU with the
flags, the measurement decides; everywhere else fp32. The loader logs the choice and its reason at INFO
(`printpress -v ...`) and keeps it as `Pipeline.dtype_choice`.

fp32 stays the default dtype: the parity tests and seeded reproducibility are promised in fp32 (bf16 logits differ
from fp32's by ~1e-2, enough to change sampled tokens), and `auto` gives the same tokens as fp32 only where it
picks fp32.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

NATIVE_BF16 = ("amx_bf16", "avx512_bf16")  # x86 flags of native bf16 matmul (AMX tiles, AVX-512 dot products)
BF16_MARGIN = 0.9  # bf16 is chosen when it takes at most this fraction of fp32's time
MEASURE_BUDGET_S = 0.4  # the measurement stops starting new rounds after this long (it runs at least one)
PREFIX = 16  # tokens cached before the timed AR step and decoder pass


@dataclass(frozen=True)
class DtypeChoice:
    """What `dtype="auto"` picked and why; `timings_ms` holds the measured work (name -> (fp32, bf16)) if any."""

    dtype: torch.dtype
    reason: str
    timings_ms: dict[str, tuple[float, float]] = field(default_factory=dict)

    def describe(self) -> str:
        return f"dtype auto -> {str(self.dtype).removeprefix('torch.')}: {self.reason}"


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> str:
    """The text of /proc/cpuinfo ('' where there is none: not Linux)."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor a /proc/cpuinfo text lists (its `flags` line)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


def native_bf16_flags(cpuinfo: str) -> tuple[str, ...]:
    """The native bf16 matmul flags (`NATIVE_BF16`) a /proc/cpuinfo text lists, in that order; () for none."""
    flags = cpu_flags(cpuinfo)
    return tuple(flag for flag in NATIVE_BF16 if flag in flags)


def decide(fp32_ms: dict[str, float], bf16_ms: dict[str, float], margin: float = BF16_MARGIN) -> DtypeChoice:
    """bf16 when the measured work takes at most `margin` of fp32's time in bf16 (summed over the workloads),
    else fp32; the reason quotes the times."""
    fp32_total, bf16_total = sum(fp32_ms.values()), sum(bf16_ms[name] for name in fp32_ms)
    ratio = bf16_total / fp32_total if fp32_total > 0 else float("inf")
    quoted = "; ".join(f"{name} {fp32_ms[name]:.2f} ms fp32, {bf16_ms[name]:.2f} ms bf16" for name in fp32_ms)
    timings = {name: (fp32_ms[name], bf16_ms[name]) for name in fp32_ms}
    if ratio <= margin:
        return DtypeChoice(torch.bfloat16, f"bf16 measured {1 / ratio:.2f}x faster ({quoted})", timings)
    return DtypeChoice(torch.float32, f"bf16 measured not faster enough, {ratio:.2f}x fp32's time, more than "
                                      f"{margin:g} ({quoted})", timings)


def choose(device: torch.device, cpuinfo: str | None = None,
           measure_times: Callable[[], tuple[dict[str, float], dict[str, float]]] | None = None) -> DtypeChoice:
    """The dtype `auto` means on `device`. On a CPU with native bf16, `measure_times()` gives (fp32 ms, bf16 ms)
    per workload (`measure` on the loaded model); None there means "fp32 without measuring" (the caller asked
    for something only fp32 runs, e.g. the int8 kernel)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "this CUDA device supports bf16")
        return DtypeChoice(torch.float32, "this CUDA device does not support bf16")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"no measured choice on {device.type} yet")
    found = native_bf16_flags(read_cpuinfo() if cpuinfo is None else cpuinfo)
    if not found:
        return DtypeChoice(torch.float32, f"this CPU has no native bf16 matmul (neither {' nor '.join(NATIVE_BF16)} "
                                          "in /proc/cpuinfo): bf16 would be emulated")
    if measure_times is None:
        return DtypeChoice(torch.float32, "the int8 kernel runs on fp32 activations")
    fp32_ms, bf16_ms = measure_times()
    choice = decide(fp32_ms, bf16_ms)
    return DtypeChoice(choice.dtype, f"{', '.join(found)} present; {choice.reason}", choice.timings_ms)


@torch.no_grad()
def measure(model: nn.Module, canvas_length: int, budget_s: float = MEASURE_BUDGET_S,
            max_rounds: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """Best-of-rounds milliseconds (fp32, bf16) of one AR step and one self-conditioned decoder pass of `model`
    (fp32) and of a bf16 copy (dropped afterwards), interleaved round by round so that a change in the machine's
    load hits both alike; the rounds stop after `budget_s`."""
    low = copy.deepcopy(model).to(torch.bfloat16)
    runs = {torch.float32: forward_workloads(model, canvas_length),
            torch.bfloat16: forward_workloads(low, canvas_length)}
    best: dict[torch.dtype, dict[str, float]] = {dtype: {} for dtype in runs}
    for loads in runs.values():  # warm-up: first calls allocate and pick kernels
        for run in loads.values():
            run()
    start = time.perf_counter()
    for _ in range(max_rounds):
        for dtype, loads in runs.items():
            for name, run in loads.items():
                began = time.perf_counter()
                run()
                ms = 1e3 * (time.perf_counter() - began)
                best[dtype][name] = min(ms, best[dtype].get(name, ms))
        if time.perf_counter() - start > budget_s:
            break
    return best[torch.float32], best[torch.bfloat16]


def forward_workloads(model: nn.Module, canvas_length: int, prefix: int = PREFIX) -> dict[str, Callable[[], None]]:
    """One AR step (1 token, `logits="last"`) and one self-conditioned decoder pass over a canvas, each after the
    same `prefix`-token context; the cache is rolled back after each AR step, so every call does the same work.
    (Also bench/quantize.py's workloads.)"""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    device = model.embed_tokens.weight.device
    context = torch.randint(3, vocab, (1, prefix), generator=gen).to(device)
    cache = model.new_cache(1, prefix + max(canvas_length, 1))
    model.encode(context, cache, logits="none")
    token = torch.randint(3, vocab, (1, 1), generator=gen).to(device)
    canvas = torch.randint(3, vocab, (1, canvas_length), generator=gen).to(device)
    probs = torch.softmax(torch.randn(1, canvas_length, vocab, generator=gen), dim=-1).to(device)

    def ar_step() -> None:
        snapshot = cache.snapshot(1)
        model.encode(token, cache, logits="last")
        cache.truncate(prefix, snapshot)

    def decoder_pass() -> None:
        model.denoise(canvas, cache, self_conditioning_probs=probs)

    return {"AR step": ar_step, f"decoder pass (canvas {canvas_length})": decoder_pass}
