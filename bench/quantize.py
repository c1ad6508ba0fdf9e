"""int8 weight-only quantization (printpress.quantize): its speed and its quality cost, against float32.

One process, one thread (by default). Two parts:

1. **Speed.** For the shipped model (models/shakespeare-joint) and the bandwidth-bound benchmark size (the 99.7M
   `large` config of bench/engine_speed.py, random weights): one AR step (1 token, `logits="last"`) and one
   self-conditioned decoder pass over a canvas, each after a 64-token context
   (`printpress.precision.forward_workloads`), for the float32 model and its `int8` and `int8-head` copies. All
   workloads of a model are timed interleaved (one call of each in turn, `--reps` rounds), so the machine's load
   hits them alike; the figures that matter are the ratios float32 / int8 from one run. Also the weight bytes,
   torch's own `_weight_int8pack_mm` against float32 and the kernel on two of the large model's shapes, and with
   `--compiled` the AR step through the opt-in compiled graph (printpress.fast) in float32 and int8-head.
2. **Quality** (the shipped model; `--no-quality` skips it). The training loop's own held-out evaluation
   (`printpress.eval.bench.heldout_losses`: AR NLL and diffusion loss on the Shakespeare validation windows, the
   fixed noise of training) of the model loaded with each `quantize`; and, on the first `--logit-windows` windows,
   the logits against float32's: the AR logits of every position, and the decoder's over the last canvas of each
   window (its tokens half replaced by random ones, the rest of the window as the cached context): mean and max
   absolute difference, and how often the argmax agrees.

    OMP_NUM_THREADS=1 .venv/bin/python bench/quantize.py --compiled --out docs/results/quantize.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/quantize.py --models shipped --reps 3 --no-quality --out /tmp/q.json
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
from pathlib import Path
from typing import Any

import torch

import printpress
from printpress.corpora import cache_dir
from printpress.eval.bench import heldout_cache, heldout_losses
from printpress.eval.report import cpu_name
from printpress.fast import compile_ar_step
from printpress.precision import forward_workloads, native_bf16_flags, read_cpuinfo
from printpress.quantize import load_kernel, quantize_model
from printpress.runtime_options import QUANTIZE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import SHIPPED, benchmark_model  # noqa: E402  (the benchmark models live there)

VARIANTS = ("float32", *QUANTIZE)


def weight_mib(model: torch.nn.Module) -> float:
    """MiB of the weights a forward can read (parameters and buffers; the RoPE tables are a few KiB)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def variants(model: torch.nn.Module, compiled: bool = False) -> dict[str, torch.nn.Module]:
    """The float32 model, its int8 and int8-head copies, and with `compiled` the float32 and int8-head copies with
    the opt-in compiled AR step (printpress.fast; inductor)."""
    out = {"float32": model}
    for mode in QUANTIZE:
        out[mode] = copy.deepcopy(model)
        quantize_model(out[mode], mode)
    if compiled:
        for name in ("float32", "int8-head"):
            out[f"{name}, compiled"] = copy.deepcopy(out[name])
            compile_ar_step(out[f"{name}, compiled"])
    return out


@torch.no_grad()
def speed(label: str, model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    models = variants(model, args.compiled)
    loads = {(name, work): run for name, m in models.items()
             for work, run in forward_workloads(m, args.canvas, prefix=args.context).items()
             if work == "AR step" or not name.endswith("compiled")}  # the compiled graph covers AR steps only
    for run in loads.values():
        run()  # warm-up
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in loads}
    for _ in range(args.reps):
        for key, run in loads.items():
            start = time.perf_counter()
            run()
            seconds[key].append(time.perf_counter() - start)
    works = list(dict.fromkeys(work for _, work in loads))
    rows = []
    for work in works:
        base = statistics.median(seconds[("float32", work)])
        for name in models:
            if (name, work) not in seconds:
                continue
            median = statistics.median(seconds[(name, work)])
            rows.append({"work": work, "variant": name, "median_ms": 1e3 * median,
                         "best_ms": 1e3 * min(seconds[(name, work)]), "speedup_vs_float32": base / median})
            print(f"  {label:12s} {work:26s} {name:9s} {1e3 * median:8.2f} ms  x{base / median:.2f}", flush=True)
    failures = {name: m.compiled_ar_step.failure for name, m in models.items() if m.compiled_ar_step is not None}
    return {"label": label, "parameters": model.config.num_parameters(), "compile_failures": failures,
            "weight_mib": {name: weight_mib(m) for name, m in models.items() if not name.endswith("compiled")},
            "rows": rows}


def torch_int8pack(reps: int) -> list[dict[str, Any]]:
    """torch's own int8 weight-only matmul (`torch._weight_int8pack_mm`, the CPU op gpt-fast-style int8 lowers to)
    against float32 `F.linear` and this project's kernel, on the large model's shapes: why it is not used here."""
    import torch.nn.functional as F

    from printpress.quantize import int8_linear, pack, quantize_rows

    rows = []
    for out_features, in_features in ((768, 768), (32768, 768)):
        weight = torch.randn(out_features, in_features)
        q, scale = quantize_rows(weight)
        packed, padded = pack(q, scale)
        for tokens in (1, 32):
            x = torch.randn(tokens, in_features)
            calls = {"float32": lambda: F.linear(x, weight),
                     "torch._weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, q, scale),
                     "printpress int8 kernel": lambda: int8_linear(x, packed, padded, out_features, kernel=True)}
            seconds = {name: [] for name in calls}
            for _ in range(reps):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    seconds[name].append(time.perf_counter() - start)
            base = statistics.median(seconds["float32"])
            for name, measured in seconds.items():
                median = statistics.median(measured)
                rows.append({"shape": [tokens, in_features, out_features], "op": name, "median_ms": 1e3 * median,
                             "speedup_vs_float32": base / median})
                print(f"  x ({tokens}, {in_features}) @ W ({out_features}, {in_features}): {name:26s} "
                      f"{1e3 * median:8.3f} ms  x{base / median:.2f}", flush=True)
    return rows


@torch.no_grad()
def logit_agreement(models: dict[str, torch.nn.Module], windows: torch.Tensor, canvas: int) -> dict[str, Any]:
    """Each quantized model's logits against float32's on the same inputs: the AR logits of every position of
    `windows` (B, T), and the decoder's over the last `canvas` tokens (half replaced by random ones) after the
    rest of the window."""
    gen = torch.Generator().manual_seed(0)
    context, block = windows[:, :-canvas], windows[:, -canvas:].clone()
    noised = torch.rand(block.shape, generator=gen) < 0.5
    block[noised] = torch.randint(3, models["float32"].config.vocab_size, (int(noised.sum()),), generator=gen)
    logits = {}
    for name, model in models.items():
        cache = model.new_cache(windows.shape[0], windows.shape[1] + canvas)
        ar = model.encode(windows, model.new_cache(windows.shape[0], windows.shape[1]), logits="all")
        model.encode(context, cache, logits="none")
        logits[name] = {"AR": ar, "decoder": model.denoise(block, cache)}
    out = {}
    for name in models:
        if name == "float32":
            continue
        out[name] = {}
        for kind, reference in logits["float32"].items():
            diff = (logits[name][kind] - reference).abs()
            agree = (logits[name][kind].argmax(-1) == reference.argmax(-1)).float().mean()
            out[name][kind] = {"mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max()),
                               "top1_agreement": float(agree), "positions": int(reference.shape[0] * reference.shape[1])}
    return out


def quality(args: argparse.Namespace) -> dict[str, Any]:
    from printpress.train.data import eval_batches, prepare_data

    folder = cache_dir() / "bench-heldout"
    losses = {}
    for name in VARIANTS:
        print(f"held-out losses: {name}", flush=True)
        losses[name] = heldout_losses(str(SHIPPED), "joint", ["shakespeare"], 128, 16, 8, 0.05, folder,
                                      quantize=None if name == "float32" else name)
        print(f"  val_ar {losses[name]['val_ar']:.4f} nats/token, val_diffusion {losses[name]['val_diffusion']:.4f}",
              flush=True)
    pipe = printpress.load(SHIPPED)
    splits = prepare_data(["shakespeare"], pipe.tokenizer, heldout_cache(folder, ["shakespeare"], pipe.tokenizer),
                          val_fraction=0.05)
    windows = next(iter(eval_batches(splits.val.tokens, 128, args.logit_windows, max_batches=1)))
    agreement = logit_agreement(variants(pipe.model), windows, pipe.canvas_length)
    for name, kinds in agreement.items():
        for kind, figures in kinds.items():
            print(f"  {name:9s} {kind:8s} logits: mean |diff| {figures['mean_abs_diff']:.4f}, max "
                  f"{figures['max_abs_diff']:.3f}, top-1 agreement {figures['top1_agreement']:.4f}", flush=True)
    return {"heldout": losses, "logits": agreement, "logit_windows": int(windows.shape[0])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/quantize.json")
    parser.add_argument("--models", nargs="+", default=["shipped", "large"],
                        help="'shipped' (models/shakespeare-joint) and/or sizes of bench/engine_speed.py")
    parser.add_argument("--canvas", type=int, default=32, help="the decoder pass's canvas")
    parser.add_argument("--context", type=int, default=64, help="cached tokens before each operation")
    parser.add_argument("--reps", type=int, default=21, help="interleaved rounds per model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--logit-windows", type=int, default=16, help="held-out windows for the logit comparison")
    parser.add_argument("--no-quality", action="store_true", help="skip the held-out losses and logit comparison")
    parser.add_argument("--compiled", action="store_true",
                        help="also time the AR step compiled (printpress.fast), float32 and int8-head (minutes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    kernel = load_kernel()
    print(f"int8 kernel: {'C++ (printpress/kernels/int8_linear.cpp)' if kernel else 'unavailable: dequantizing'}",
          flush=True)
    ops = torch_int8pack(max(3, args.reps // 3)) if kernel else []
    models = []
    for name in args.models:
        model = printpress.load(SHIPPED).model if name == "shipped" else benchmark_model(name)
        label = "shipped" if name == "shipped" else name
        models.append(speed(label, model, args))
        del model
    report = {
        "command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} python bench/quantize.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                    "native_bf16": list(native_bf16_flags(read_cpuinfo())), "torch": torch.__version__,
                    "python": platform.python_version()},
        "kernel": kernel,
        "context": args.context,
        "canvas": args.canvas,
        "reps": args.reps,
        "speed": models,
        "ops": ops,
    }
    if not args.no_quality:
        report["quality"] = quality(args)
    report["load_average"] = {"start_1_5_15min": list(load_start), "end_1_5_15min": list(os.getloadavg())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}; load average {load_start[0]:.2f} -> {report['load_average']['end_1_5_15min'][0]:.2f}")


if __name__ == "__main__":
    main()
