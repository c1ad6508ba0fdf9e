"""Engine speed: printpress against the transformers reference, and what one decoder forward costs.

One process, one random checkpoint (built and saved by transformers), the same prompts and seed:

1. `generate` speed. transformers' `DiffusionGemmaForBlockDiffusion.generate` (one prompt at a time,
   `torch.manual_seed(seed)` before each, as tests/test_engine.py obtains parity) against printpress
   (`printpress.load(folder)`, `pipe.generate(ids, seed=seed)` one prompt at a time, then all prompts as
   one batch, then AR mode on the same weights). The one-at-a-time tokens must be identical (the script
   exits with an error otherwise). Each side is warmed up once; the timed repeats are interleaved
   (reference, printpress, batch, AR, reference, ...) so a change in machine load hits every side alike;
   each figure is the median over the repeats.
   tokens/s counts generated tokens that are not pad (the EOS counts, the pad after it does not: the
   reference's `tokens_per_forward` numerator), summed over the prompts, over the wall time of the loop.
2. A profile of one printpress `generate` call: torch.profiler (top ops by self CPU time) and cProfile
   (Python functions by own time), written to `<out>/engine_speed_<size>_profile.txt`.
3. The cost of one decoder forward (`model.denoise`) against canvas length, after encoding a 64-token
   prompt, next to one AR step (`model.encode` of 1 token, logits="last"); the ratio decoder/AR is the
   "break-even tokens per forward": diffusion beats AR decoding on this machine only when a decoder
   forward yields more tokens than that.

Results: `<out>/engine_speed_<size>.json` and `<out>/engine_speed_<size>.png`, and a summary on stdout.

    nice -n 15 env OMP_NUM_THREADS=1 .venv/bin/python bench/engine_speed.py --size tiny --out /tmp/es   # smoke, ~10 s
    .venv/bin/python bench/engine_speed.py --size small --out docs/results/
    .venv/bin/python bench/engine_speed.py --size large --out docs/results/
    .venv/bin/python bench/engine_speed.py --size small large --out docs/results/
    python bench/engine_speed.py --size 1b --device cuda --dtype bfloat16 --out results/   # GPU: scripts/gpu_check.sh
    OMP_NUM_THREADS=1 .venv/bin/python bench/engine_speed.py --model models/shakespeare-joint --threads 1 \
        --out docs/results/engine_speed_shakespeare-joint.json   # a trained checkpoint, its own sampler settings

`--model FOLDER` instead of `--size`: a trained checkpoint (both sides load the folder), decoded with its own
generation config (entropy bound, t_min/t_max, the adaptive stop) on `--heldout-prompts` held-out prompts of
`--heldout-data`; random weights never let the adaptive stop fire, a trained model does.

Sizes: `tiny` (0.19M parameters, smoke test only), `small` (10.9M parameters, 41.5 MiB fp32: a bit
over a 32 MiB L3, but an AR step touches ~26 MiB), `large` (99.7M parameters, 380 MiB fp32: bandwidth-
bound for small canvases, compute-bound from a canvas of a few dozen tokens), `1b` (1.0B parameters: for a GPU).

`--device cuda --dtype bfloat16` runs both sides on a GPU in bf16. Token parity with the reference is demanded
(the script exits otherwise) only on the CPU in float32, where printpress promises it; elsewhere the kernels'
order of summation differs between the two implementations and the report records how many tokens agree and where
the first difference falls. On a GPU, times are taken after `torch.cuda.synchronize()`, so the per-call decoder
figures include the wait for the kernels, and the CPU roofline regimes are not computed.
Notes and findings: docs/benchmarks-engine-notes.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import printpress
from printpress import sampling
from printpress.canvas import probabilities_and_entropy
from printpress.config import SLIDING, TextConfig
from printpress.errors import PrintpressError

# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------

# A vision tower is part of the HF config; keep it minute (printpress skips its weights when loading).
VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8)


@dataclass(frozen=True)
class Size:
    text: dict[str, Any]
    canvas_length: int = 64
    steps: int = 16
    prompt_lengths: tuple[int, ...] = (6, 21, 48)  # token ids, BOS first
    repeats: int = 5
    canvas_sweep: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128, 256)
    forward_reps: int = 7
    sweep_prompt: int = 64


SIZES: dict[str, Size] = {
    # Smoke test: seconds, not a measurement.
    "tiny": Size(
        text=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                  num_global_key_value_heads=1, sliding_window=32, layer_types=[SLIDING, "full_attention"],
                  num_experts=4, top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=512),
        canvas_length=16, steps=4, prompt_lengths=(3, 9), repeats=1, canvas_sweep=(1, 4, 16, 64),
        forward_reps=2, sweep_prompt=16,
    ),
    # 10.9M parameters (41.5 MiB fp32); layers [sliding x5, full].
    "small": Size(
        text=dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                  num_global_key_value_heads=1, sliding_window=128, num_experts=8, top_k_experts=2,
                  moe_intermediate_size=128, max_position_embeddings=1024),
    ),
    # 99.7M parameters (380 MiB fp32, 12x a 32 MiB L3); layers [sliding x5, full] x2.
    "large": Size(
        text=dict(vocab_size=32768, hidden_size=768, intermediate_size=768, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=96, global_head_dim=192,
                  num_global_key_value_heads=2, sliding_window=128, num_experts=16, top_k_experts=2,
                  moe_intermediate_size=64, max_position_embeddings=1024),
        repeats=3,
    ),
    # 1.0B parameters (1.9 GiB in bf16): the size issue 15 asks the GPU comparison at. Layers [sliding x5, full] x2.
    "1b": Size(
        text=dict(vocab_size=32768, hidden_size=2048, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, global_head_dim=512,
                  num_global_key_value_heads=2, sliding_window=512, num_experts=8, top_k_experts=2,
                  moe_intermediate_size=1024, max_position_embeddings=4096),
        canvas_length=256, steps=32, prompt_lengths=(16, 64, 256), repeats=3,
        canvas_sweep=(1, 16, 64, 256, 1024), sweep_prompt=256,
    ),
    # The released model's routing (128 experts, top-8) at ~10M and ~100M parameters: the expert loop's
    # per-expert overhead, not the arithmetic, is what differs between implementations here.
    "small-moe128": Size(
        text=dict(vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                  num_global_key_value_heads=1, sliding_window=128, num_experts=128, top_k_experts=8,
                  moe_intermediate_size=16, max_position_embeddings=1024),
    ),
    "large-moe128": Size(
        text=dict(vocab_size=16384, hidden_size=768, intermediate_size=768, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=96, global_head_dim=192,
                  num_global_key_value_heads=2, sliding_window=128, num_experts=128, top_k_experts=8,
                  moe_intermediate_size=32, max_position_embeddings=1024),
        repeats=3,
    ),
}

EOS_IDS = [1]
PAD_ID = 0
BOS_ID = 2


@dataclass(frozen=True)
class Settings:
    size: str
    canvas_length: int
    max_new_tokens: int
    steps: int
    seed: int
    repeats: int
    prompt_lengths: tuple[int, ...]
    canvas_sweep: tuple[int, ...]
    forward_reps: int
    sweep_prompt: int
    peak: float
    device: str = "cpu"
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = tuple(EOS_IDS)
    pad_token_id: int = PAD_ID


# --------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------


def build_reference(size: Size, settings: Settings):
    """A random transformers model with non-trivial norms/scales (as tests/conftest.py builds them)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    torch.manual_seed(settings.seed)
    config = DiffusionGemmaConfig(text_config=dict(size.text), vision_config=dict(VISION),
                                  canvas_length=settings.canvas_length)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if param.dim() == 1 or key.endswith(("scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)  # ones would make every norm and scale a no-op
        for key, buffer in model.named_buffers():
            if key.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
        if settings.peak != 1.0:  # larger logits: peaked distributions, early stops, EOS
            model.model.decoder.embed_tokens.weight.mul_(settings.peak)
    # EOS and pad written explicitly: transformers saves null for both and then never stops early.
    model.generation_config = DiffusionGemmaGenerationConfig(
        max_new_tokens=settings.max_new_tokens, max_denoising_steps=settings.steps,
        eos_token_id=list(settings.eos_token_ids), pad_token_id=settings.pad_token_id,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
    )
    return model.to(device=settings.device, dtype=getattr(torch, settings.dtype))


def exact(s: Settings) -> bool:
    """Whether printpress promises the reference's tokens here: on the CPU, in float32."""
    return s.device == "cpu" and s.dtype == "float32"


def element_bytes(dtype: str) -> int:
    return torch.finfo(getattr(torch, dtype)).bits // 8


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_prompts(lengths: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, BOS first, ids above the special tokens."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [[BOS_ID] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in lengths]


# --------------------------------------------------------------------------------------------
# Meters: count and time calls of the decoder / encoder on either side
# --------------------------------------------------------------------------------------------


@dataclass
class Meter:
    calls: int = 0
    rows: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.calls, self.rows, self.seconds = 0, 0, 0.0


def metered(fn: Callable, meter: Meter, rows: Callable[[tuple, dict], int]) -> Callable:
    sync = torch.cuda.is_available()  # a GPU call returns before its kernels finish: time them to the end

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if sync:
            torch.cuda.synchronize()
        meter.seconds += time.perf_counter() - start
        meter.calls += 1
        meter.rows += rows(args, kwargs)
        return out

    return wrapper


@dataclass
class Meters:
    decoder: Meter = field(default_factory=Meter)
    encoder: Meter = field(default_factory=Meter)

    def reset(self) -> None:
        self.decoder.reset()
        self.encoder.reset()


def meter_reference(ref) -> Meters:
    """generate() calls `self.forward` for each decoder pass (lm_head included) and `self.model.encoder` to encode."""
    meters = Meters()
    ref.forward = metered(ref.forward, meters.decoder, lambda a, k: int(k["decoder_input_ids"].shape[0]))
    encoder = ref.model.encoder
    encoder.forward = metered(encoder.forward, meters.encoder, lambda a, k: int(k["input_ids"].shape[0]))
    return meters


def meter_printpress(model) -> Meters:
    """The engine calls `model.denoise` per decoder pass (logits included) and `model.encode` per encoder pass."""
    meters = Meters()
    model.denoise = metered(model.denoise, meters.decoder, lambda a, k: int(a[0].shape[0]))
    model.encode = metered(model.encode, meters.encoder, lambda a, k: int(a[0].shape[0]))
    return meters


def unmeter(obj, *names: str) -> None:
    for name in names:
        obj.__dict__.pop(name, None)


# --------------------------------------------------------------------------------------------
# 1. generate: reference vs printpress
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One timed pass over all prompts."""

    seconds: float
    tokens: list[list[int]]  # generated ids per prompt (pad included)
    new_tokens: int  # not pad, summed over prompts
    decoder_calls: int
    decoder_rows: int
    decoder_seconds: float
    encoder_calls: int
    encoder_seconds: float


def count_new(tokens: list[int], pad: int | None) -> int:
    return len(tokens) if pad is None else sum(1 for t in tokens if t != pad)


def finish(start: float, tokens: list[list[int]], meters: Meters, pad: int | None) -> Run:
    seconds = time.perf_counter() - start
    return Run(seconds, tokens, sum(count_new(t, pad) for t in tokens), meters.decoder.calls, meters.decoder.rows,
               meters.decoder.seconds, meters.encoder.calls, meters.encoder.seconds)


@torch.no_grad()
def run_reference(ref, meters: Meters, prompts: list[list[int]], s: Settings) -> Run:
    meters.reset()
    tokens = []
    start = time.perf_counter()
    for prompt in prompts:
        torch.manual_seed(s.seed)
        out = ref.generate(torch.tensor([prompt], device=s.device), max_new_tokens=s.max_new_tokens, max_denoising_steps=s.steps,
                           eos_token_id=list(s.eos_token_ids), pad_token_id=s.pad_token_id)
        tokens.append(out.sequences[0, len(prompt):].tolist())
    return finish(start, tokens, meters, s.pad_token_id)


def run_printpress(pipe, meters: Meters, prompts: list[list[int]], s: Settings) -> Run:
    meters.reset()
    start = time.perf_counter()
    results = [pipe.generate(p, seed=s.seed, max_new_tokens=s.max_new_tokens, max_denoising_steps=s.steps,
                             eos_token_ids=list(s.eos_token_ids)) for p in prompts]
    return finish(start, [r.token_ids for r in results], meters, s.pad_token_id)


def run_printpress_accepted_only(pipe, meters: Meters, prompts: list[list[int]], s: Settings) -> Run:
    """The opt-in sampler that draws only at accepted positions (not token-exact; same distribution)."""
    meters.reset()
    start = time.perf_counter()
    results = [pipe.generate(p, seed=s.seed, max_new_tokens=s.max_new_tokens, max_denoising_steps=s.steps,
                             eos_token_ids=list(s.eos_token_ids), sample_accepted_only=True) for p in prompts]
    return finish(start, [r.token_ids for r in results], meters, s.pad_token_id)


def run_printpress_batch(pipe, meters: Meters, prompts: list[list[int]], s: Settings) -> Run:
    meters.reset()
    start = time.perf_counter()
    results = pipe.generate(prompts, seed=[s.seed] * len(prompts), max_new_tokens=s.max_new_tokens,
                            max_denoising_steps=s.steps, eos_token_ids=list(s.eos_token_ids))
    return finish(start, [r.token_ids for r in results], meters, s.pad_token_id)


def run_printpress_ar(pipe, meters: Meters, prompts: list[list[int]], s: Settings) -> Run:
    """Greedy AR on the same weights and budget; no EOS, so every prompt gets all its tokens."""
    meters.reset()
    start = time.perf_counter()
    results = [pipe.generate(p, mode="ar", temperature=0.0, max_new_tokens=s.max_new_tokens, eos_token_ids=[])
               for p in prompts]
    return finish(start, [r.token_ids for r in results], meters, None)


def summarize(runs: list[Run], what: str) -> dict[str, Any]:
    """Medians over repeats; per-forward figures from the median run's counters."""
    seconds = statistics.median(r.seconds for r in runs)
    decoder_s = statistics.median(r.decoder_seconds for r in runs)
    first = runs[0]
    forwards = first.decoder_calls if what != "ar" else first.encoder_calls  # AR: each encoder pass yields a token
    out = {
        "wall_s": seconds,
        "wall_s_all": [r.seconds for r in runs],
        "new_tokens": first.new_tokens,
        "tokens_per_s": first.new_tokens / seconds,
        "forward_passes": forwards,
        "tokens_per_forward": first.new_tokens / forwards if forwards else None,
        "wall_ms_per_forward": 1e3 * seconds / forwards if forwards else None,
    }
    if what == "ar":
        out["forward_kind"] = "encoder passes, each yielding one token (the prompt prefill included)"
        out["encoder_ms_per_forward"] = 1e3 * (statistics.median(r.encoder_seconds for r in runs)) / first.encoder_calls
        return out
    out.update(
        forward_kind="decoder passes (batched passes count once)",
        decoder_rows=first.decoder_rows,
        decoder_ms_per_forward=1e3 * decoder_s / first.decoder_calls,
        decoder_share_of_wall=decoder_s / seconds,
        encoder_calls=first.encoder_calls,
        encoder_ms_total=1e3 * statistics.median(r.encoder_seconds for r in runs),
        outside_forwards_ms_per_forward=1e3 * (seconds - decoder_s - statistics.median(r.encoder_seconds for r in runs))
        / first.decoder_calls,
    )
    return out


def compare_generate(ref, pipe, prompts: list[list[int]], s: Settings) -> dict[str, Any]:
    ref_meters, pp_meters = meter_reference(ref), meter_printpress(pipe.model)
    try:
        sides = {
            "reference": lambda: run_reference(ref, ref_meters, prompts, s),
            "printpress": lambda: run_printpress(pipe, pp_meters, prompts, s),
            "printpress_batch": lambda: run_printpress_batch(pipe, pp_meters, prompts, s),
            "printpress_ar": lambda: run_printpress_ar(pipe, pp_meters, prompts, s),
            "printpress_accepted_only": lambda: run_printpress_accepted_only(pipe, pp_meters, prompts, s),
        }
        warm = {name: fn() for name, fn in sides.items()}  # warm-up, also the parity check
        if exact(s):
            check_parity(warm["reference"].tokens, warm["printpress"].tokens, prompts)
        runs: dict[str, list[Run]] = {name: [] for name in sides}
        for repeat in range(s.repeats):
            for name, fn in sides.items():
                runs[name].append(fn())
                print(f"  repeat {repeat + 1}/{s.repeats} {name:17s} {runs[name][-1].seconds:8.3f} s", flush=True)
        if exact(s):
            for run in runs["printpress"] + runs["reference"]:
                check_parity(warm["reference"].tokens, run.tokens, prompts)
    finally:
        unmeter(ref, "forward")
        unmeter(ref.model.encoder, "forward")
        unmeter(pipe.model, "denoise", "encode")
    batch_rows_equal = [a == b for a, b in zip(warm["printpress"].tokens, warm["printpress_batch"].tokens)]
    result = {name: summarize(r, "ar" if name == "printpress_ar" else "diffusion") for name, r in runs.items()}
    ref_tps = result["reference"]["tokens_per_s"]
    result["ratios"] = {
        "printpress_over_reference_tokens_per_s": result["printpress"]["tokens_per_s"] / ref_tps,
        "printpress_batch_over_reference_tokens_per_s": result["printpress_batch"]["tokens_per_s"] / ref_tps,
        "printpress_over_reference_decoder_ms": result["printpress"]["decoder_ms_per_forward"]
        / result["reference"]["decoder_ms_per_forward"],
        "printpress_diffusion_over_printpress_ar_tokens_per_s": result["printpress"]["tokens_per_s"]
        / result["printpress_ar"]["tokens_per_s"],
        "printpress_accepted_only_over_reference_tokens_per_s": result["printpress_accepted_only"]["tokens_per_s"]
        / ref_tps,
    }
    result["parity"] = {"one_at_a_time_identical": True if exact(s) else agreement(warm["reference"].tokens,
                                                                                  warm["printpress"].tokens),
                        "batch_rows_equal_one_at_a_time": batch_rows_equal}
    result["reference_info"] = {"attn_implementation": getattr(ref.config, "_attn_implementation", None),
                                "cache": "transformers default for generate (no cache_implementation set)"}
    return result


def check_parity(expected: list[list[int]], got: list[list[int]], prompts: list[list[int]]) -> None:
    for prompt, a, b in zip(prompts, expected, got):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            sys.exit(f"PARITY FAILURE: prompt of {len(prompt)} tokens: printpress differs from the reference "
                     f"at new token {first}:\n  reference  {a}\n  printpress {b}")


def agreement(expected: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Where parity is not promised (a GPU, half precision): how far the two sides' tokens agree."""
    same = sum(x == y for a, b in zip(expected, got) for x, y in zip(a, b))
    total = sum(max(len(a), len(b)) for a, b in zip(expected, got))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if a == b else min(len(a), len(b)))
             for a, b in zip(expected, got)]
    return {"identical": expected == got, "same_position_share": same / total if total else 1.0,
            "first_difference_per_prompt": first}


# --------------------------------------------------------------------------------------------
# 2. Profile of one printpress generate call
# --------------------------------------------------------------------------------------------


def profile_generate(pipe, prompt: list[int], s: Settings, path: Path) -> dict[str, Any]:
    kwargs = dict(seed=s.seed, max_new_tokens=s.max_new_tokens, max_denoising_steps=s.steps,
                  eos_token_ids=list(s.eos_token_ids))
    pipe.generate(prompt, **kwargs)  # warm
    from torch.profiler import ProfilerActivity, profile

    cuda = s.device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        pipe.generate(prompt, **kwargs)
        profiled_s = time.perf_counter() - start
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15)
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    aten_self_ms = sum(e.self_cpu_time_total for e in averages) / 1e3

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    result = pipe.generate(prompt, **kwargs)
    profiler.disable()
    cprofile_s = time.perf_counter() - start
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)

    header = (f"printpress generate, one prompt of {len(prompt)} tokens, {s.max_new_tokens} new tokens, "
              f"canvas {s.canvas_length}, {s.steps} steps, {result.stats.forward_passes} decoder passes, "
              f"threads {torch.get_num_threads()}\n")
    path.write_text(
        header
        + f"\n== torch.profiler: top 15 ops by self CPU time (wall {profiled_s * 1e3:.1f} ms under the profiler; "
        f"sum of self CPU over all ops {aten_self_ms:.1f} ms) ==\n{table}\n"
        + f"\n== cProfile (wall {cprofile_s * 1e3:.1f} ms under cProfile) ==\n{text.getvalue()}"
    )
    return {
        "file": path.name,
        "profiled_wall_ms": profiled_s * 1e3,
        "sum_self_cpu_ms_all_ops": aten_self_ms,
        "top_ops": [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "cpu_total_ms": e.cpu_time_total / 1e3} for e in top],
    }


# --------------------------------------------------------------------------------------------
# 3. Cost of one decoder forward vs canvas length, against one AR step
# --------------------------------------------------------------------------------------------


def median_ms(fn: Callable[[], Any], reps: int, device: str = "cpu") -> float:
    fn()  # warm (allocator, kernels)
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.no_grad()
def forward_costs(model, text: TextConfig, s: Settings, cache_bytes: dict[str, int]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(s.seed)
    prompt = torch.randint(3, text.vocab_size, (1, s.sweep_prompt), generator=gen).to(s.device)
    width = element_bytes(s.dtype)
    regime_of = point_regime if s.device == "cpu" else (lambda *_: "not classified (the roofline here is a CPU's)")

    # AR: consecutive one-token encodes after the prompt, as AR decoding does (context grows by reps + 1).
    ar_cache = model.new_cache(1, s.sweep_prompt + s.forward_reps + 2)
    model.encode(prompt, ar_cache, logits="none")
    token = torch.tensor([[5]], device=s.device)
    ar_ms = median_ms(lambda: model.encode(token, ar_cache, logits="last"), s.forward_reps, s.device)

    cache = model.new_cache(1, s.sweep_prompt)
    model.encode(prompt, cache, logits="none")
    points = []
    for c in s.canvas_sweep:
        canvas = torch.randint(0, text.vocab_size, (1, c), generator=gen).to(s.device)
        first_ms = median_ms(lambda: model.denoise(canvas, cache, None), s.forward_reps, s.device)
        # Steady state: self-conditioning on temperature-scaled logits, as the engine feeds them back.
        conditioning = (model.denoise(canvas, cache, None) / 0.8).to(model.dtype)
        denoise_ms = median_ms(lambda: model.denoise(canvas, cache, conditioning), s.forward_reps, s.device)
        logits = conditioning.float()
        sampler_ms = median_ms(lambda: sampler_step(logits, text.vocab_size, s), s.forward_reps, s.device)
        work = decoder_work(text, c, s.sweep_prompt, bytes_per_weight=width)
        points.append({
            "canvas": c,
            "denoise_ms": denoise_ms,
            "denoise_first_step_ms": first_ms,
            "sampler_ms": sampler_ms,
            "ratio_to_ar_step": denoise_ms / ar_ms,
            "ms_per_canvas_token": denoise_ms / c,
            "est_gflop": work["flop"] / 1e9,
            "est_weight_mb": work["weight_bytes"] / 2**20,
            "est_gflop_per_s": work["flop"] / (denoise_ms * 1e6),
            "est_weight_gb_per_s": work["weight_bytes"] / (denoise_ms * 1e6),
            "regime": regime_of(work["flop"], work["weight_bytes"], cache_bytes, denoise_ms),
        })
        print(f"  canvas {c:4d}: denoise {denoise_ms:8.2f} ms (first step {first_ms:7.2f}), sampler "
              f"{sampler_ms:6.2f} ms, {denoise_ms / ar_ms:6.2f} AR steps", flush=True)
    ar_work = decoder_work(text, 1, s.sweep_prompt, ar=True, bytes_per_weight=width)
    at_canvas = next((p for p in points if p["canvas"] == s.canvas_length), None)
    return {
        "prompt_tokens": s.sweep_prompt,
        "reps": s.forward_reps,
        "ar_step_ms": ar_ms,
        "ar_est_weight_mb": ar_work["weight_bytes"] / 2**20,
        "ar_est_weight_gb_per_s": ar_work["weight_bytes"] / (ar_ms * 1e6),
        "ar_regime": regime_of(ar_work["flop"], ar_work["weight_bytes"], cache_bytes, ar_ms),
        "points": points,
        "break_even_tokens_per_forward": {p["canvas"]: p["ratio_to_ar_step"] for p in points},
        "break_even_at_canvas_length": None if at_canvas is None else at_canvas["ratio_to_ar_step"],
        "cache_bytes": cache_bytes,
    }


def sampler_step(logits: torch.Tensor, vocab: int, s: Settings) -> None:
    """The per-step sampler work, with the pieces the engine uses, for one row."""
    gen = torch.Generator(logits.device).manual_seed(0)
    settings = sampling.SamplerSettings(max_denoising_steps=s.steps)
    processed = logits / sampling.step_temperature(s.steps, settings)
    probs, entropy = probabilities_and_entropy(processed, processed.shape[1])
    sampling.row_argmax(processed)
    sampled = sampling.sample_canvas(probs[0], gen)
    accepted = sampling.entropy_bound_accept(entropy, settings.entropy_bound)[0]
    noise = sampling.uniform_tokens(logits.shape[1], vocab, gen, logits.device)[0]
    torch.where(accepted, sampled, noise)


def decoder_work(text: TextConfig, canvas: int, context: int, ar: bool = False,
                 bytes_per_weight: int = 4) -> dict[str, float]:
    """Estimated FLOPs and weight bytes of one pass over `canvas` new tokens after `context` cached ones.

    Decoder (ar=False): self-conditioning (softmax @ E, an MLP) + layers + LM head. Encoder step (ar=True): layers
    + LM head on the last position. Experts: only the distinct experts the tokens route to are read (uniform routing
    assumed); attention FLOPs included; the KV cache read is not counted in the bytes.
    """
    h, v, i = text.hidden_size, text.vocab_size, text.intermediate_size
    e, k, m = text.num_experts, text.top_k_experts, text.moe_intermediate_size
    expert_params = 3 * h * m
    used_experts = e * (1 - (1 - k / e) ** canvas)
    flop = 2 * canvas * h * v  # LM head (AR: one position, canvas = 1)
    weights = v * h
    if not ar:
        flop += 2 * canvas * (v * h + 3 * h * i)  # soft embedding (probs @ E) + self-conditioning MLP
        weights += 3 * h * i  # E is the LM head's matrix, counted once
    for spec in text.layers:
        q, kv = text.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        attn = h * q + h * kv * (1 if spec.shares_kv else 2) + q * h
        keys = min(context, text.sliding_window - 1) if spec.sliding else context
        keys += canvas if not ar else 1
        flop += 2 * canvas * (attn + 3 * h * i + e * h + k * expert_params) + 4 * canvas * q * keys
        weights += attn + 3 * h * i + e * h + used_experts * expert_params
    return {"flop": flop, "weight_bytes": bytes_per_weight * weights}


# --------------------------------------------------------------------------------------------
# Machine, output
# --------------------------------------------------------------------------------------------


def cpu_caches() -> dict[str, int]:
    """Cache sizes in bytes (L2 per core, L3 shared) from sysfs; empty where unknown."""
    out: dict[str, int] = {}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        out[f"L{level}"] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return out


def machine(s: Settings) -> dict[str, Any]:
    import transformers

    return {
        "device": s.device,
        "gpu": torch.cuda.get_device_name(0) if s.device.startswith("cuda") else None,
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "caches_bytes": cpu_caches(),
        "nice": os.nice(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": s.dtype,
    }


# Rough roofline of this class of CPU (GUIDE section 4, 2 cores, fp32): large GEMMs ~75 GFLOP/s, DRAM ~15 GB/s.
PEAK_FLOP_PER_S = 75e9
DRAM_BYTES_PER_S = 15e9


def regime(param_bytes: int, caches: dict[str, int]) -> str:
    """The model as a whole; `point_regime` says it per measured forward."""
    l3 = caches.get("L3")
    if l3 is None:
        return f"parameters {param_bytes / 2**20:.1f} MiB (cache size unknown)"
    if param_bytes <= l3:
        return (f"parameters {param_bytes / 2**20:.1f} MiB fit in the {l3 / 2**20:.0f} MiB L3: cache-resident "
                "(compute- or overhead-bound)")
    return (f"parameters {param_bytes / 2**20:.1f} MiB = {param_bytes / l3:.1f}x the {l3 / 2**20:.0f} MiB L3: "
            "bandwidth-bound where a pass reads more weights than the L3 holds at low arithmetic intensity (small "
            "canvases), compute-bound for large canvases; see forward_cost.points[].regime")


def point_regime(flop: float, weight_bytes: float, caches: dict[str, int], measured_ms: float) -> str:
    """Estimated regime of one pass from a roofline: arithmetic at ~75 GFLOP/s, weights streamed at DRAM speed
    (~15 GB/s; conservative where they fit the L3, which other processes share); a pass more than 3x slower than
    that roofline is called overhead-bound (Python, dispatch, many small ops)."""
    compute_ms = 1e3 * flop / PEAK_FLOP_PER_S
    memory_ms = 1e3 * weight_bytes / DRAM_BYTES_PER_S
    roof = max(compute_ms, memory_ms)
    fits = " (weights fit in the L3)" if weight_bytes <= caches.get("L3", 0) else ""
    detail = f"{weight_bytes / 2**20:.0f} MiB touched, {flop / weight_bytes:.1f} FLOP/B, roofline {roof:.2f} ms{fits}"
    if measured_ms > 3 * roof:
        return f"overhead-bound ({detail})"
    return f"{'bandwidth' if memory_ms > compute_ms else 'compute'}-bound ({detail})"


def output_paths(out: str, size: str, several: bool) -> tuple[Path, Path, Path]:
    path = Path(out)
    if path.suffix == ".json" and not several:
        json_path = path
    else:
        json_path = path / f"engine_speed_{size}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    stem = json_path.with_suffix("")
    return json_path, stem.with_suffix(".png"), Path(f"{stem}_profile.txt")


def plot(costs: dict[str, Any], generate: dict[str, Any], s: Settings, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = costs["points"]
    c = [p["canvas"] for p in pts]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    left.plot(c, [p["denoise_ms"] for p in pts], "o-", label="decoder forward (self-conditioned step)")
    left.plot(c, [p["denoise_first_step_ms"] for p in pts], "s--", alpha=0.7, label="decoder forward (first step)")
    left.plot(c, [p["sampler_ms"] for p in pts], "^:", alpha=0.7, label="sampler work per step")
    left.axhline(costs["ar_step_ms"], color="red", label=f"AR step (encode 1 token) {costs['ar_step_ms']:.2f} ms")
    left.set(xscale="log", yscale="log", xlabel="canvas length (tokens)", ylabel="ms",
             title=f"one forward after a {costs['prompt_tokens']}-token prompt")
    left.set_xticks(c, [str(x) for x in c])
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    right.plot(c, [p["ratio_to_ar_step"] for p in pts], "o-", label="decoder / AR step = break-even tokens/forward")
    right.plot(c, c, "k:", alpha=0.5, label="canvas length (most tokens a forward can yield)")
    right.axhline(1.0, color="red", alpha=0.5)
    tpf = generate.get("printpress", {}).get("tokens_per_forward")
    if tpf:
        right.plot([s.canvas_length], [tpf], "g*", markersize=14,
                   label=f"achieved tokens/forward {tpf:.2f} (canvas {s.canvas_length}, {s.steps} steps)")
    right.set(xscale="log", yscale="log", xlabel="canvas length (tokens)", ylabel="AR steps",
              title="decoder forward cost in AR steps")
    right.set_xticks(c, [str(x) for x in c])
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(report: dict[str, Any]) -> None:
    g, f, m = report["generate"], report["forward_cost"], report["model"]
    s = report["settings"]
    print(f"\n=== engine_speed --size {report['size']}: {m['parameters'] / 1e6:.2f}M parameters "
          f"({m['parameter_bytes'] / 2**20:.1f} MiB {s['dtype']}), threads {report['machine']['torch_threads']} ===")
    print(f"regime: {m['regime']}")
    print(f"{len(s['prompt_lengths'])} prompts of {s['prompt_lengths']} tokens, canvas {s['canvas_length']}, "
          f"{s['max_new_tokens']} new tokens, {s['steps']} steps, seed {s['seed']}, median of {s['repeats']}; "
          "tokens = generated non-pad tokens")
    print(f"{'':18s} {'wall s':>8s} {'tok/s':>9s} {'forwards':>9s} {'tok/fwd':>8s} {'ms/fwd':>8s} {'wall ms/fwd':>11s}")
    for name in ("reference", "printpress", "printpress_batch", "printpress_ar", "printpress_accepted_only"):
        r = g[name]
        fwd_ms = r.get("decoder_ms_per_forward", r.get("encoder_ms_per_forward"))
        print(f"{name:18s} {r['wall_s']:8.3f} {r['tokens_per_s']:9.1f} {r['forward_passes']:9d} "
              f"{r['tokens_per_forward']:8.2f} {fwd_ms:8.2f} {r['wall_ms_per_forward']:11.2f}")
    ratios = g["ratios"]
    print(f"printpress / reference tokens/s: {ratios['printpress_over_reference_tokens_per_s']:.2f}x one at a time, "
          f"{ratios['printpress_batch_over_reference_tokens_per_s']:.2f}x batched; decoder ms ratio "
          f"{ratios['printpress_over_reference_decoder_ms']:.2f}; diffusion/AR (printpress) "
          f"{ratios['printpress_diffusion_over_printpress_ar_tokens_per_s']:.2f}x")
    parity = g["parity"]["one_at_a_time_identical"]
    parity = "identical" if parity is True else (f"not promised here; {parity['same_position_share']:.1%} of positions "
                                                f"agree, first differences {parity['first_difference_per_prompt']}")
    print(f"parity, one at a time: {parity}; batch rows equal alone: {g['parity']['batch_rows_equal_one_at_a_time']}")
    print(f"decoder forward vs canvas (after {f['prompt_tokens']}-token prompt); AR step {f['ar_step_ms']:.2f} ms "
          f"({f['ar_regime']}):")
    for p in f["points"]:
        print(f"  C={p['canvas']:4d} {p['denoise_ms']:9.2f} ms = {p['ratio_to_ar_step']:6.2f} AR steps  "
              f"(~{p['est_gflop_per_s']:.1f} GFLOP/s, ~{p['est_weight_gb_per_s']:.1f} GB/s weights; {p['regime']})")
    if f["break_even_at_canvas_length"] is not None:
        print(f"break-even tokens/forward at canvas {s['canvas_length']}: {f['break_even_at_canvas_length']:.2f} "
              f"(achieved {g['printpress']['tokens_per_forward']:.2f})")
    print("profile top ops (self CPU ms): " + ", ".join(
        f"{o['op']} {o['self_cpu_ms']:.1f}" for o in report["profile"]["top_ops"][:6]))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def bench_size(name: str, args: argparse.Namespace, several: bool) -> dict[str, Any]:
    """A random checkpoint of size `name`, built by transformers and loaded by both sides."""
    size = SIZES[name]
    canvas = args.canvas_length or size.canvas_length
    s = Settings(
        size=name, canvas_length=canvas, max_new_tokens=args.max_new_tokens or 2 * canvas,
        steps=args.steps or size.steps, seed=args.seed, repeats=args.repeats or size.repeats,
        prompt_lengths=size.prompt_lengths, canvas_sweep=tuple(args.canvas_sweep or size.canvas_sweep),
        forward_reps=args.forward_reps or size.forward_reps, sweep_prompt=size.sweep_prompt, peak=args.peak,
        device=args.device, dtype=args.dtype,
    )
    text = TextConfig(**size.text)
    with tempfile.TemporaryDirectory(prefix="printpress-engine-speed-") as folder:
        start = time.perf_counter()
        ref = build_reference(size, s)
        ref.save_pretrained(folder)
        pipe = printpress.load(folder, device=s.device, dtype=s.dtype)
        print(f"[{name}] checkpoint built and loaded in {time.perf_counter() - start:.1f} s", flush=True)
    prompts = make_prompts(s.prompt_lengths, text.vocab_size, s.seed)
    return bench_pair(name, ref, pipe, prompts, s, text, dict(size.text), args.out, several)


def bench_model(folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """A trained checkpoint (a shipped model's folder, say) with its own generation config, on held-out prompts:
    the sampler settings (entropy bound, t_min/t_max, the adaptive stop) are the checkpoint's on both sides."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from printpress.eval.bench import heldout_prompts

    if args.device != "cpu" or args.dtype != "float32":
        sys.exit("--model runs on the CPU in float32 (where printpress promises the reference's tokens)")
    try:
        pipe = printpress.load(folder, dtype="float32")
    except PrintpressError as error:
        sys.exit(f"engine_speed: {error}")
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, dtype=torch.float32).eval()
    name = Path(folder).name
    texts = heldout_prompts(args.heldout_prompts, [args.heldout_data], 0.05)
    prompts = [pipe.encode_text(text) for text in texts]
    config = pipe.generation_config
    s = Settings(
        size=name, canvas_length=pipe.canvas_length, max_new_tokens=args.max_new_tokens or 2 * pipe.canvas_length,
        steps=args.steps or config.max_denoising_steps, seed=args.seed, repeats=args.repeats or 5,
        prompt_lengths=tuple(len(p) for p in prompts), canvas_sweep=tuple(args.canvas_sweep or (1, 8, 32, 64)),
        forward_reps=args.forward_reps or 20, sweep_prompt=64, peak=1.0,
        eos_token_ids=tuple(config.eos_token_id or ()),
        pad_token_id=config.pad_token_id,
    )
    return bench_pair(name, ref, pipe, prompts, s, pipe.config.text, pipe.config.text.to_dict(), args.out,
                      several=False)


def bench_pair(name: str, ref, pipe, prompts: list[list[int]], s: Settings, text: TextConfig,
               text_config: dict[str, Any], out: str, several: bool) -> dict[str, Any]:
    """The three measurements of the module docstring on one checkpoint loaded by both sides; writes the report."""
    json_path, png_path, profile_path = output_paths(out, name, several)
    load_at_start = os.getloadavg()
    params = text.num_parameters()
    caches = cpu_caches()
    width = element_bytes(s.dtype)
    where = regime(width * params, caches) if s.device == "cpu" else f"on {s.device}"
    loaded = sum(p.numel() for p in pipe.model.parameters())
    print(f"[{name}] {params / 1e6:.2f}M parameters ({width * params / 2**20:.1f} MiB {s.dtype}); {where}", flush=True)
    print(f"[{name}] generate: reference vs printpress", flush=True)
    generate = compare_generate(ref, pipe, prompts, s)
    del ref
    print(f"[{name}] profile", flush=True)
    profile = profile_generate(pipe, prompts[-1], s, profile_path)
    print(f"[{name}] decoder forward cost vs canvas length", flush=True)
    costs = forward_costs(pipe.model, text, s, caches)

    report = {
        "size": name,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": machine(s),
        "model": {
            "text_config": text_config,
            "parameters": params,
            "parameters_loaded_by_printpress": loaded,
            "parameter_bytes": width * params,
            "regime": where,
        },
        "settings": asdict(s),
        "generate": generate,
        "profile": profile,
        "forward_cost": costs,
        "notes": [
            "tokens = generated tokens that are not pad (EOS counts), summed over prompts",
            "decoder_ms_per_forward: time inside the decoder call (reference: model.forward incl. lm_head; "
            "printpress: model.denoise incl. logits); wall_ms_per_forward: whole wall time / decoder passes",
            "printpress_batch: all prompts in one call; forward_passes counts batched passes once, decoder_rows "
            "counts rows",
            "printpress_ar: greedy AR mode, same weights and budget, no EOS; forwards = one-token encoder passes",
            "est_* figures are estimates from the config (uniform expert routing), not measured counters",
        ],
    }
    report["machine"]["load_average_at_start"] = load_at_start
    report["machine"]["load_average_at_end"] = os.getloadavg()
    json_path.write_text(json.dumps(report, indent=2))
    title = (f"printpress {name}: {params / 1e6:.1f}M params ({width * params / 2**20:.0f} MiB {s.dtype}), "
             f"{torch.get_num_threads()} thread(s), torch {torch.__version__}")
    plot(costs, generate, s, title, png_path)
    print_summary(report)
    print(f"wrote {json_path}, {png_path}, {profile_path}")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", nargs="+", choices=sorted(SIZES), default=["small"],
                        help="model size(s); tiny is a smoke test")
    parser.add_argument("--model", help="a trained checkpoint's folder instead of --size (e.g. models/shakespeare-joint): "
                        "its own generation config, held-out prompts")
    parser.add_argument("--heldout-data", default="shakespeare", help="with --model: the corpus of the held-out prompts")
    parser.add_argument("--heldout-prompts", type=int, default=6, help="with --model: how many held-out prompts")
    parser.add_argument("--out", default="bench/results/", help="folder (or a .json path for one size)")
    parser.add_argument("--canvas-length", type=int, help="canvas length (default 64; tiny 16)")
    parser.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default 2 canvases)")
    parser.add_argument("--steps", type=int, help="max denoising steps (default 16; tiny 4)")
    parser.add_argument("--repeats", type=int, help="timed repeats of each generate side; the median is reported")
    parser.add_argument("--forward-reps", type=int, help="timed repeats of each single-forward measurement")
    parser.add_argument("--canvas-sweep", type=int, nargs="+", help="canvas lengths for the decoder cost sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak", type=float, default=1.0,
                        help="multiply the (tied) embedding by this: peaked logits, so many tokens are accepted "
                             "per step and the adaptive stop fires (1 = plain random weights)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: both sides run there")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="both sides' weights and activations (token parity is demanded only for cpu float32)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    if args.model:
        bench_model(args.model, args)
        return
    for name in args.size:
        bench_size(name, args, several=len(args.size) > 1)


if __name__ == "__main__":
    main()
