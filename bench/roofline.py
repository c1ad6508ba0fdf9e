"""Roofline: how far each hot-path operation of the engine is from this machine's limits.

One process, one thread (by default). It measures the machine, then the engine:

1. **The roofs.** fp32 GEMM throughput (square `torch.mm`, the best of a few sizes: the peak a forward could reach
   if it were all large GEMMs), bf16 GEMM throughput *only as a note* when the CPU has no native bf16
   (`avx512_bf16` / `amx_bf16` absent from /proc/cpuinfo: then bf16 matmuls are emulated and far slower than fp32),
   read bandwidth (`x.sum()` over an array sized for the L2, the L3 and DRAM), and the rate of an element-wise
   transcendental (`torch.exp` over a canvas x vocabulary tensor, in cache), the sampler's kind of work.
2. **The work.** For the shipped model (models/shakespeare-joint) and the bandwidth-bound benchmark size (the
   99.7M-parameter `large` config of bench/engine_speed.py, random weights), after a 64-token prefix: one AR step
   (`model.encode` of 1 token, `logits="last"`; consecutive steps, as generation runs them, the prefix put back
   every 32), one self-conditioned decoder pass (`model.denoise`) per canvas
   length, and one sampler step (`printpress.canvas.denoise_step` on that canvas's logits), in exact mode and with
   `sample_accepted_only`. Each gets a predicted time from an analytic count of its FLOPs and bytes (`ar_work`,
   `decoder_work`, `sampler_work`): compute = FLOPs / GEMM peak, memory = bytes / the read bandwidth of the
   smallest memory level its working set fits in, roofline = the larger. The ratio measured / roofline says how
   far the engine is from the machine (1.0 = at the limit). `--compiled` adds the opt-in compiled AR step
   (`printpress.fast.compile_ar_step`, not bit-exact) on the same weights. Where the CPU has native bf16 (or with
   `--bf16`) the AR step and the decoder passes are timed again on a bf16 copy of the weights (`dtype="bfloat16"`,
   not exact), predicted with 2-byte weights at the bf16 GEMM roof. `--warm-ab` times the AR step and the decoder
   passes again with the C++ layers' weights not read ahead of their products (`printpress.model.choose_warm_weights`
   decides that per process; the report's machine entry says what it chose), interleaved with the rest: an A/B of
   the same bits. Where the C++ layers read a model's weights from half-width copies (a float32 model whose weights
   are float16s or bfloat16s: the shipped model, or a benchmark size with `--stored-as float16`), the AR step and the
   passes over canvases of up to 8 rows are predicted with 2 bytes a weight.

The workloads of one model are timed interleaved (one repetition of each in turn), so a change in the machine's
load hits them alike; medians and minima are reported, and the 1-minute load average at the start and the end
(the machine may be shared: ratios measured in one run are what matter). The read of each memory level a workload's
roof comes from is timed in the same rounds, and each row also gets the median over rounds of measured / roofline
with the memory roof at that round's read speed (`ratio_paired_median`): on a machine whose read speed drifts with
its neighbours' load, the ratio that a step at the memory roof keeps at 1.0 whatever the spell.

    OMP_NUM_THREADS=1 .venv/bin/python bench/roofline.py --compiled --out docs/results/roofline.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/roofline.py --models shipped --reps 3 --out /tmp/roofline.json  # smoke

Writes the JSON and, beside it, the markdown table (`.md`) that docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import printpress
from printpress import canvas as canvas_step
from printpress import model as model_module
from printpress.checkpoint import convert
from printpress.config import TextConfig
from printpress.eval.report import cpu_name
from printpress.fast import compile_ar_step
from printpress.model import DiffusionGemma, allow_half_width, native_layers
from printpress.precision import native_bf16_flags, read_cpuinfo
from printpress.sampling import SamplerSettings, StabilityTracker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_speed import SIZES, cpu_caches  # noqa: E402  (the benchmark sizes live there)

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "shakespeare-joint"
FP32 = 4  # bytes
ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2}
PEAK = {torch.float32: "fp32_gemm", torch.bfloat16: "bf16_gemm"}  # the roof a model of this dtype computes at


# --------------------------------------------------------------------------------------------
# The machine's roofs
# --------------------------------------------------------------------------------------------


def timings(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds per call over `reps` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def gemm_rate(dtype: torch.dtype, sizes: tuple[int, ...], reps: int) -> dict[str, Any]:
    """FLOP/s of square n x n matmuls: the median and best call per size; `peak` is the best over all."""
    per_size = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        seconds = timings(lambda: a @ b, reps)
        per_size[n] = {"median_gflop_s": 2 * n**3 / statistics.median(seconds) / 1e9,
                       "best_gflop_s": 2 * n**3 / min(seconds) / 1e9}
    return {"per_size": per_size, "peak_gflop_s": max(p["best_gflop_s"] for p in per_size.values())}


def read_bandwidth(nbytes: int, reps: int) -> dict[str, float]:
    """Read bandwidth of `x.sum()` over an fp32 array of `nbytes` (a streaming read, as weights are read)."""
    x = torch.rand(nbytes // FP32)
    seconds = timings(lambda: x.sum(), reps)
    return {"bytes": nbytes, "median_gb_s": nbytes / statistics.median(seconds) / 1e9,
            "best_gb_s": nbytes / min(seconds) / 1e9}


def exp_rate(elements: int, reps: int) -> dict[str, float]:
    x = torch.randn(elements)
    seconds = timings(lambda: torch.exp(x), reps)
    return {"elements": elements, "median_gelem_s": elements / statistics.median(seconds) / 1e9,
            "best_gelem_s": elements / min(seconds) / 1e9}


def measure_roofs(caches: dict[str, int], quick: bool) -> dict[str, Any]:
    """The machine's limits, measured on this thread now. Peaks are the best call (the least disturbed)."""
    native_bf16 = bool(native_bf16_flags(read_cpuinfo()))
    sizes = (512, 1024) if quick else (512, 1024, 2048)
    roofs: dict[str, Any] = {"fp32_gemm": gemm_rate(torch.float32, sizes, 3 if quick else 7)}
    if native_bf16:
        roofs["bf16_gemm"] = gemm_rate(torch.bfloat16, sizes, 3 if quick else 7)
    else:  # a note, not a roof: without native bf16 the matmul is emulated
        roofs["bf16_gemm"] = {**gemm_rate(torch.bfloat16, (512,), 2), "native": False,
                              "note": "no avx512_bf16/amx_bf16: bf16 matmuls are emulated (fp32 is the fast dtype)"}
    l2, l3 = caches.get("L2", 2**20), caches.get("L3", 32 * 2**20)
    levels = {"L2": l2 // 2, "L3": l3 // 2, "DRAM": max(8 * l3, 256 * 2**20)}
    roofs["read_bandwidth"] = {level: read_bandwidth(size, 3 if quick else (41 if level == "L2" else 9))
                               for level, size in levels.items()}
    roofs["level_capacity_bytes"] = {"L2": l2, "L3": l3}
    roofs["exp"] = exp_rate(32 * 4096, 9 if quick else 41)
    return roofs


# --------------------------------------------------------------------------------------------
# The work: analytic FLOPs and bytes (fp32)
# --------------------------------------------------------------------------------------------


@dataclass
class Work:
    """What one operation must do at the least: FLOPs (GEMMs and attention), bytes it must read or write,
    the bytes its repeated runs keep hot (which memory level serves it), and transcendentals (the sampler)."""

    flop: float
    bytes: float
    working_set: float
    transcendentals: float = 0.0
    peak: str = "fp32_gemm"  # the GEMM roof its FLOPs run at (bf16_gemm for a bf16 model)


def layer_macs(text: TextConfig, tokens: int, keys_per_layer: list[int]) -> float:
    """Multiply-adds of the layers for `tokens` new positions; attention counted as QK^T plus AV."""
    h, i, e, k, m = (text.hidden_size, text.intermediate_size, text.num_experts, text.top_k_experts,
                     text.moe_intermediate_size)
    macs = 0.0
    for spec, keys in zip(text.layers, keys_per_layer):
        q, kv = text.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        projections = h * q + h * kv * (1 if spec.shares_kv else 2) + q * h
        macs += tokens * (projections + 3 * h * i + e * h + k * 3 * h * m) + 2 * tokens * q * keys
    return macs


def layer_weight_params(text: TextConfig, used_experts: float) -> float:
    """Weights the layers read (norm vectors left out): attention, dense MLP, router, the experts used."""
    h, i, e, m = text.hidden_size, text.intermediate_size, text.num_experts, text.moe_intermediate_size
    total = 0.0
    for spec in text.layers:
        q, kv = text.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        total += h * q + h * kv * (1 if spec.shares_kv else 2) + q * h + 3 * h * i + e * h + used_experts * 3 * h * m
    return total


def kv_read_params(text: TextConfig, context: int) -> float:
    """Cached keys and values the layers read (both tensors per layer)."""
    window = text.sliding_window - 1
    return sum(2 * (min(context, window) if spec.sliding else context) * spec.num_kv_heads * spec.head_dim
               for spec in text.layers)


def keys_seen(text: TextConfig, context: int, tokens: int) -> list[int]:
    window = text.sliding_window - 1
    return [(min(context, window) if spec.sliding else context) + tokens for spec in text.layers]


def model_bytes(text: TextConfig, dtype: torch.dtype = torch.float32) -> float:
    return ELEMENT_BYTES[dtype] * text.num_parameters()


def ar_work(text: TextConfig, context: int, dtype: torch.dtype = torch.float32,
            weight_bytes: int | None = None) -> Work:
    """One AR step: 1 token through the layers, the LM head on it; reads the routed experts only. Weights and
    cache are read in `dtype` (the weights in `weight_bytes` each where given: half-width copies); the logits are
    written in fp32 (as `model.encode` returns them)."""
    h, v = text.hidden_size, text.vocab_size
    width = weight_bytes or ELEMENT_BYTES[dtype]
    macs = layer_macs(text, 1, keys_seen(text, context, 1)) + h * v
    weights = layer_weight_params(text, text.top_k_experts) + v * h
    io = v  # the logits written
    return Work(flop=2 * macs, bytes=width * weights + ELEMENT_BYTES[dtype] * kv_read_params(text, context) + FP32 * io,
                working_set=width * text.num_parameters(), peak=PEAK[dtype])


def decoder_work(text: TextConfig, canvas: int, context: int, dtype: torch.dtype = torch.float32,
                 weight_bytes: int | None = None) -> Work:
    """One self-conditioned decoder pass: soft embedding (probs @ E) and its MLP, the layers over the canvas,
    the LM head over the canvas. Experts read: those the canvas routes to (uniform routing assumed); E is read
    once (it serves the soft embedding and the LM head). Weights in `weight_bytes` each where given."""
    h, v, i, e, k = (text.hidden_size, text.vocab_size, text.intermediate_size, text.num_experts,
                     text.top_k_experts)
    used = e * (1 - (1 - k / e) ** canvas)
    macs = canvas * (v * h + 3 * h * i) + layer_macs(text, canvas, keys_seen(text, context, canvas)) + canvas * v * h
    width = weight_bytes or ELEMENT_BYTES[dtype]
    weights = layer_weight_params(text, used) + v * h + 3 * h * i
    io = 2 * canvas * v  # the self-conditioning probabilities read, the logits written (fp32)
    return Work(flop=2 * macs, bytes=width * weights + ELEMENT_BYTES[dtype] * kv_read_params(text, context) + FP32 * io,
                working_set=width * text.num_parameters(), peak=PEAK[dtype])


def sampler_work(canvas: int, vocab: int, accepted_only: bool) -> Work:
    """One sampler step over (canvas, vocab) fp32 logits: at the least read the logits and write the scaled
    logits and their softmax (both are kept: the next step is conditioned on them). Transcendentals per
    element: the softmax's exp, the entropy's logsumexp and softmax (as Categorical computes it), and, in
    exact mode, the multinomial's exponential draw (accepted-only draws only at the accepted positions)."""
    elements = canvas * vocab
    return Work(flop=0.0, bytes=FP32 * 3 * elements, working_set=FP32 * 3 * elements,
                transcendentals=(3 if accepted_only else 4) * elements)


def predict(work: Work, roofs: dict[str, Any]) -> dict[str, Any]:
    """Predicted milliseconds: compute, memory (at the level the working set fits in), and their max."""
    capacity = roofs["level_capacity_bytes"]
    level = next((name for name in ("L2", "L3") if work.working_set <= capacity[name]), "DRAM")
    bandwidth = roofs["read_bandwidth"][level]["best_gb_s"] * 1e9
    compute_ms = 1e3 * work.flop / (roofs[work.peak]["peak_gflop_s"] * 1e9)
    compute_ms += 1e3 * work.transcendentals / (roofs["exp"]["best_gelem_s"] * 1e9)
    memory_ms = 1e3 * work.bytes / bandwidth
    return {"compute_ms": compute_ms, "memory_ms": memory_ms, "roofline_ms": max(compute_ms, memory_ms),
            "bound": "compute" if compute_ms >= memory_ms else "memory", "memory_level": level}


# --------------------------------------------------------------------------------------------
# The engine's operations, measured
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    """A canvas row for `denoise_step` (what `printpress.canvas.CanvasRow` asks of a request)."""

    index: int
    generator: torch.Generator
    tracker: StabilityTracker | None
    step: int
    settings: SamplerSettings


@dataclass
class Workload:
    name: str
    run: Callable[[], Any]
    work: Work


def shipped_model() -> DiffusionGemma:
    return printpress.load(SHIPPED).model


def benchmark_model(size: str, stored_as: torch.dtype = torch.float32) -> DiffusionGemma:
    """The benchmark size's random weights (seed 0), each rounded to `stored_as` and kept in float32: what loading a
    checkpoint stored in that dtype gives."""
    torch.manual_seed(0)
    model = DiffusionGemma(TextConfig(**SIZES[size].text)).eval()
    if stored_as != torch.float32:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(stored_as).float())
    allow_half_width(model)  # an inference model, as printpress.load marks the models it loads
    return model


HALF_WIDTH_ROWS = 8  # products of up to this many rows read half-width copies (printpress/kernels/layers.cpp)


def half_width_reads(model: DiffusionGemma) -> bool:
    """Whether the C++ layers read `model`'s weight matrices from half-width copies in products of a few rows: a
    float32 model whose weights are float16s or bfloat16s (the shipped model's are), on a CPU with AVX-512."""
    if model.dtype != torch.float32 or not native_layers() or not torch.ops.printpress_layers.half_width_kernels():
        return False
    weight = model.embed_tokens.weight
    return any(torch.equal(weight.to(dtype).float(), weight) for dtype in (torch.float16, torch.bfloat16))


def twin(model: DiffusionGemma) -> DiffusionGemma:
    """A second model with the same weights (to compile or change without touching the first)."""
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def in_dtype(model: DiffusionGemma, dtype: torch.dtype) -> DiffusionGemma:
    """A copy of `model` with its weights in `dtype`, converted as the loader converts (RoPE tables stay fp32)."""
    return convert(twin(model), dtype)


AR_RUN = 32  # AR steps in a row after the prefix, before the cache is put back


def ar_step_call(model: DiffusionGemma, context: int, batch: int = 1) -> Callable[[], None]:
    """One AR step of `batch` rows, as generation runs them: consecutive steps after a `context`-token prefix each;
    every AR_RUN steps the cache is put back to that prefix (a copy, in the call that finds the run over: that
    call is slower, and the medians do not see it)."""
    gen = torch.Generator().manual_seed(0)
    prefix = model.new_cache(batch, context + AR_RUN)
    model.encode(torch.randint(3, model.config.vocab_size, (batch, context), generator=gen), prefix, logits="none")
    token = torch.randint(3, model.config.vocab_size, (batch, 1), generator=gen)
    cache = copy.deepcopy(prefix)

    def ar_step() -> None:
        nonlocal cache
        if not cache.has_room(1):
            cache = copy.deepcopy(prefix)
        model.encode(token, cache, logits="last")

    return ar_step


def workloads(model: DiffusionGemma, canvases: tuple[int, ...], context: int,
              compiled: DiffusionGemma | None = None, sampler: bool = True) -> list[Workload]:
    """AR step, decoder pass per canvas and (if `sampler`) sampler step per canvas, each after a `context`-token
    prefix; and the AR step of `compiled` (the same weights with `printpress.fast.compile_ar_step`), if given.
    The model's dtype sets the bytes and the GEMM roof of its predictions."""
    text, dtype = model.config, model.dtype
    half = 2 if half_width_reads(model) else None  # bytes a weight element costs in products of a few rows
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(1, context + max(canvases))
    model.encode(torch.randint(3, text.vocab_size, (1, context), generator=gen), cache, logits="none")
    out = [Workload("AR step", ar_step_call(model, context), ar_work(text, context, dtype, half))]
    if compiled is not None:
        out.append(Workload("AR step, compiled (opt-in, not bit-exact)", ar_step_call(compiled, context),
                            ar_work(text, context, dtype)))
    settings = SamplerSettings(max_denoising_steps=32)
    for c in canvases:
        ids = torch.randint(3, text.vocab_size, (1, c), generator=gen)
        logits = model.denoise(ids, cache)
        probs = torch.softmax(logits / 0.8, dim=-1, dtype=torch.float32)  # the previous step's feedback
        out.append(Workload(f"decoder pass, canvas {c}",
                            lambda ids=ids, probs=probs: model.denoise(ids, cache, self_conditioning_probs=probs),
                            decoder_work(text, c, context, dtype, half if c <= HALF_WIDTH_ROWS else None)))
        for accepted_only in (False, True) if sampler else ():
            row = Row(0, torch.Generator().manual_seed(0), None, 16, settings.with_overrides(
                sample_accepted_only=accepted_only))
            label = "sampler step, accepted-only" if accepted_only else "sampler step"
            out.append(Workload(f"{label}, canvas {c}",
                                lambda logits=logits, row=row: canvas_step.denoise_step(logits, [row], text.vocab_size),
                                sampler_work(c, text.vocab_size, accepted_only)))
    return out


NOT_AHEAD = "weights not read ahead"


def without_warming(run: Callable[[], None]) -> Callable[[], None]:
    """`run` with the C++ layers' weight warming off (the process's choice back after it): the other side of an
    interleaved A/B of `printpress.model.choose_warm_weights`."""
    ops = torch.ops.printpress_layers

    def cold() -> None:
        chosen = ops.warm_enabled()
        ops.set_warm(False, False)
        try:
            run()
        finally:
            ops.set_warm(*chosen)

    return cold


def measure(loads: list[Workload], reps: int) -> dict[str, list[float]]:
    """Seconds per call of each workload, interleaved: one call of each in turn, `reps` rounds."""
    for load in loads:
        load.run()  # warm-up
    seconds: dict[str, list[float]] = {load.name: [] for load in loads}
    for _ in range(reps):
        for load in loads:
            start = time.perf_counter()
            load.run()
            seconds[load.name].append(time.perf_counter() - start)
    return seconds


READ = "read, "  # the name of a level's interleaved read (`level_reads`): "read, DRAM"


def level_reads(loads: list[Workload], roofs: dict[str, Any]) -> list[Workload]:
    """For each memory level a workload's roof is read from, that level's read (`x.sum()` over an array of the size
    the roofs measured it with), to time in the same rounds as the work: the read speed each round had."""
    levels = sorted({predict(load.work, roofs)["memory_level"] for load in loads})
    out = []
    for level in levels:
        x = torch.rand(roofs["read_bandwidth"][level]["bytes"] // FP32)
        out.append(Workload(READ + level, lambda x=x: x.sum(), Work(0.0, 0.0, 0.0)))
    return out


def paired_ratio(work: Work, prediction: dict[str, Any], measured: list[float], reads: list[float],
                 read_bytes: int) -> float:
    """The median over rounds of measured / roofline where the memory roof is the read speed of the same round
    (`read_bytes` read in `reads[i]` seconds in round i; the compute roof stays the peak): a neighbour's burst slows
    the work and its level's read alike, so this ratio moves less with the machine's load than the median time over
    the roof at the best read speed does."""
    ratios = []
    for seconds, read in zip(measured, reads, strict=True):
        memory_ms = 1e3 * work.bytes * read / read_bytes
        ratios.append(1e3 * seconds / max(prediction["compute_ms"], memory_ms))
    return statistics.median(ratios)


def bench_model(label: str, model: DiffusionGemma, roofs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The model's workloads in fp32, and with `args.bf16` its AR step and decoder passes again on a bf16 copy
    (rows named "..., bf16"; the sampler works on fp32 logits either way), all interleaved."""
    text = model.config
    print(f"{label}: {text.num_parameters() / 1e6:.2f}M parameters, {model_bytes(text) / 2**20:.1f} MiB fp32",
          flush=True)
    compiled = None
    if args.compiled:
        compiled = twin(model)
        compile_ar_step(compiled)
    with torch.no_grad():
        loads = workloads(model, tuple(args.canvases), args.context, compiled)
        if args.bf16:
            low = in_dtype(model, torch.bfloat16)
            low_compiled = None
            if args.compiled:
                low_compiled = in_dtype(model, torch.bfloat16)
                compile_ar_step(low_compiled)
            for load in workloads(low, tuple(args.canvases), args.context, low_compiled, sampler=False):
                loads.append(Workload(f"{load.name}, bf16", load.run, load.work))
        if args.warm_ab and native_layers():
            loads += [Workload(f"{load.name}, {NOT_AHEAD}", without_warming(load.run), load.work)
                      for load in list(loads) if "sampler" not in load.name and "compiled" not in load.name]
        reads = level_reads(loads, roofs)
        seconds = measure(loads + reads, args.reps)
    rows = []
    for load in loads:
        measured = seconds[load.name]
        prediction = predict(load.work, roofs)
        level = prediction["memory_level"]
        median_ms, best_ms = 1e3 * statistics.median(measured), 1e3 * min(measured)
        paired = paired_ratio(load.work, prediction, measured, seconds[READ + level],
                              roofs["read_bandwidth"][level]["bytes"])
        rows.append({"work": load.name, **asdict(load.work), **prediction, "measured_median_ms": median_ms,
                     "measured_best_ms": best_ms, "ratio_median": median_ms / prediction["roofline_ms"],
                     "ratio_best": best_ms / prediction["roofline_ms"], "ratio_paired_median": paired})
        print(f"  {load.name:40s} roofline {prediction['roofline_ms']:8.3f} ms ({prediction['bound']}, "
              f"{level})  measured {median_ms:8.2f} ms (best {best_ms:7.2f})  "
              f"x{median_ms / prediction['roofline_ms']:.1f} (paired x{paired:.2f})", flush=True)
    read_speeds = {}
    for read in reads:
        level = read.name[len(READ):]
        size = roofs["read_bandwidth"][level]["bytes"]
        read_speeds[level] = {"bytes": size, "median_gb_s": size / statistics.median(seconds[read.name]) / 1e9}
    return {"label": label, "parameters": text.num_parameters(), "fp32_bytes": model_bytes(text),
            "config": {key: getattr(text, key) for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                            "num_hidden_layers", "num_experts", "top_k_experts",
                                                            "moe_intermediate_size", "sliding_window")},
            "rows": rows, "reads_in_the_rounds": read_speeds}


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    roofs = report["roofs"]
    bw = roofs["read_bandwidth"]
    lines = [
        f"Machine: {report['machine']['cpu']}, {report['machine']['torch_threads']} thread; 1-minute load average "
        f"{report['load_average'][0]:.2f} at the start, {report['load_average'][1]:.2f} at the end. fp32 GEMM peak "
        f"{roofs['fp32_gemm']['peak_gflop_s']:.1f} GFLOP/s; read bandwidth L2 {bw['L2']['best_gb_s']:.1f}, L3 "
        f"{bw['L3']['best_gb_s']:.1f}, DRAM {bw['DRAM']['best_gb_s']:.1f} GB/s; exp {roofs['exp']['best_gelem_s']:.2f} "
        f"Gelem/s; bf16 GEMM {roofs['bf16_gemm']['peak_gflop_s']:.2f} GFLOP/s"
        + (" (not native: emulated)" if roofs["bf16_gemm"].get("native") is False else "") + ".",
        "",
        "| model | work | GFLOP | MiB moved | compute ms | memory ms (level) | roofline ms "
        "| measured ms (median / best) | measured / roofline | paired with its level's read (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in report["models"]:
        for row in model["rows"]:
            lines.append(
                f"| {model['label']} | {row['work']} | {row['flop'] / 1e9:.3f} | {row['bytes'] / 2**20:.1f} | "
                f"{row['compute_ms']:.3f} | {row['memory_ms']:.3f} ({row['memory_level']}) | "
                f"{row['roofline_ms']:.3f} | "
                f"{row['measured_median_ms']:.2f} / {row['measured_best_ms']:.2f} | "
                f"{row['ratio_median']:.1f}x / {row['ratio_best']:.1f}x | "
                + (f"{row['ratio_paired_median']:.2f}x |" if "ratio_paired_median" in row else "— |"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/roofline.json")
    parser.add_argument("--models", nargs="+", default=["shipped", "large"],
                        help="'shipped' (models/shakespeare-joint) and/or sizes of bench/engine_speed.py")
    parser.add_argument("--canvases", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=64, help="cached prefix before each operation")
    parser.add_argument("--reps", type=int, default=15, help="interleaved rounds per model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true",
                        help="also time the opt-in compiled AR step (printpress.fast; compiles for a minute or two)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions of the roof measurements (smoke)")
    parser.add_argument("--stored-as", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="round the benchmark sizes' random weights to this dtype (kept in float32), as loading a "
                             "checkpoint stored in it gives: the C++ layers then read half-width copies in products "
                             "of up to 8 rows, and the predictions count 2 bytes a weight there")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the AR step and decoder passes of a bf16 copy (default: where the CPU has "
                             "native bf16 matmuls, amx_bf16 or avx512_bf16)")
    parser.add_argument("--warm-ab", action="store_true",
                        help="also time the AR step and decoder passes with the C++ layers' weight warming off "
                             f"(rows named '..., {NOT_AHEAD}'), interleaved with the process's own choice")
    args = parser.parse_args(argv)
    if args.bf16 is None:
        args.bf16 = bool(native_bf16_flags(read_cpuinfo()))
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    caches = cpu_caches()
    roofs = measure_roofs(caches, args.quick)
    print(f"fp32 GEMM peak {roofs['fp32_gemm']['peak_gflop_s']:.1f} GFLOP/s; read GB/s "
          + ", ".join(f"{k} {v['best_gb_s']:.1f}" for k, v in roofs["read_bandwidth"].items()), flush=True)
    models = []
    for name in args.models:
        model = shipped_model() if name == "shipped" else benchmark_model(name, getattr(torch, args.stored_as))
        label = "shipped (shakespeare-joint)" if name == "shipped" else f"{name} (bench/engine_speed.py)"
        if name != "shipped" and args.stored_as != "float32":
            label += f", stored as {args.stored_as}"
        models.append(bench_model(label, model, roofs, args))
        del model
    report = {
        "command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} python bench/roofline.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                    "caches_bytes": caches, "native_bf16": bool(native_bf16_flags(read_cpuinfo())),
                    "weights_read_ahead": model_module.warm_choice(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "load_average": [load_start, os.getloadavg()[0]],
        "context": args.context,
        "reps": args.reps,
        "roofs": roofs,
        "models": models,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
