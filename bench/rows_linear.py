"""Few-row linears: printpress's kernel (printpress/kernels/rows_linear.cpp) against MKL's GEMM, alone and inside
the opt-in compiled passes (printpress.fast), one thread.

1. Ops: y = x @ w^T for the weight shapes of the shipped model and of the 99.7M `large` config, 1-16 rows of x;
   "hot" repeats one weight (cache-resident), "cold" cycles through 256 MiB of copies (every weight from DRAM, as
   in a bandwidth-bound AR step). Medians; the largest difference from F.linear relative to the output's scale.
2. AR steps after a 64-token prefix, the sides interleaved round by round: the exact eager step, the compiled step
   with MKL's GEMMs (what `compile_ar_step` did before the kernel) and with the kernel (what it does now), for the
   shipped model and `large` (with its bandwidth roofline: the bytes an AR step must read, bench/roofline.py's
   count, over the DRAM read bandwidth measured in this run). Each compiled side also reports its largest logit
   difference from the exact step.
3. Compiled AR steps of the shipped model at batch 1, 2, 4 and 8 in turn on one model per side, as a server meets
   them: from the second size on, one graph serves any batch, its rows known only at run time (the kernel hands
   more than 4 rows to MKL's GEMM).

    OMP_NUM_THREADS=1 .venv/bin/python bench/rows_linear.py --out docs/results/rows_linear.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from printpress.eval.report import cpu_name
from printpress.fast import CompiledARStep, ar_step_graph, rows_linear_max_rows, rows_linear_ready

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_ar import own_copy  # noqa: E402
from roofline import (  # noqa: E402
    ar_step_call,
    ar_work,
    benchmark_model,
    read_bandwidth,
    shipped_model,
    timings,
    twin,
)

COLD_BYTES = 256 * 2**20


def median_us(fn: Callable[[], object], reps: int, per_call: int = 1) -> float:
    """Microseconds per call of the median of `reps` timed calls of `fn`, which makes `per_call` calls."""
    return 1e6 * statistics.median(timings(fn, reps)) / per_call


def weight_shapes(model) -> list[tuple[int, int]]:
    """The distinct (out, in) shapes of the model's linear layers and its tied LM head."""
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    shapes.add(tuple(model.embed_tokens.weight.shape))
    return sorted(shapes)


def ops(shapes: list[tuple[int, int]], rows: list[int], reps: int) -> list[dict]:
    def kernel(x, w):  # the kernel itself at every row count (the pass hands it at most rows_linear_max_rows())
        return torch.ops.printpress_fast.rows_linear(x, w, 1 << 30)

    out = []
    for n, k in shapes:
        copies = [torch.randn(n, k) for _ in range(max(1, min(400, COLD_BYTES // (4 * n * k))))]
        for m in rows:
            x = torch.randn(m, k)
            mkl_hot = median_us(lambda: F.linear(x, copies[0]), reps)
            ours_hot = median_us(lambda: kernel(x, copies[0]), reps)
            mkl_cold = median_us(lambda: [F.linear(x, w) for w in copies], max(3, reps // 6), len(copies))
            ours_cold = median_us(lambda: [kernel(x, w) for w in copies], max(3, reps // 6), len(copies))
            expected = F.linear(x, copies[0])
            error = float((kernel(x, copies[0]) - expected).abs().max() / expected.abs().max())
            row = {"out": n, "in": k, "rows": m, "mkl_hot_us": mkl_hot, "kernel_hot_us": ours_hot,
                   "mkl_cold_us": mkl_cold, "kernel_cold_us": ours_cold,
                   "cold_gb_s_kernel": 4 * n * k / ours_cold / 1e3, "cold_gb_s_mkl": 4 * n * k / mkl_cold / 1e3,
                   "max_relative_difference": error}
            out.append(row)
            print(f"  {n}x{k}, {m} rows: hot {mkl_hot:.1f} -> {ours_hot:.1f} us ({mkl_hot / ours_hot:.2f}x), "
                  f"cold {mkl_cold:.1f} -> {ours_cold:.1f} us ({mkl_cold / ours_cold:.2f}x, "
                  f"{row['cold_gb_s_mkl']:.1f} -> {row['cold_gb_s_kernel']:.1f} GB/s)", flush=True)
    return out


class MKLStep(CompiledARStep):
    """The compiled AR step without the kernel, compiled from its own copy of the graph function (dynamo keeps its
    graphs per code object, so the two sides would otherwise share one)."""

    graph = staticmethod(own_copy(ar_step_graph))

    def __init__(self, model) -> None:
        super().__init__(model, "inductor", rows_kernel=False)


def interleaved(sides: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, list[float]]:
    for fn in sides.values():  # compile and warm up
        for _ in range(3):
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for index in range(rounds):
        for name, fn in (sides.items() if index % 2 == 0 else reversed(sides.items())):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            seconds[name].append((time.perf_counter() - start) / calls)
    return seconds


def ar_steps(label: str, model, rounds: int, dram_gb_s: float | None) -> dict:
    mkl, ours = twin(model), twin(model)
    mkl.compiled_ar_step = MKLStep(mkl)
    ours.compiled_ar_step = CompiledARStep(ours)
    sides = {"exact": ar_step_call(model, 64), "compiled, MKL": ar_step_call(mkl, 64),
             "compiled, kernel": ar_step_call(ours, 64)}
    seconds = interleaved(sides, rounds, 10)
    logits = {}
    for name, m in (("exact", model), ("compiled, MKL", mkl), ("compiled, kernel", ours)):
        cache = m.new_cache(1, 80)
        generator = torch.Generator().manual_seed(0)
        m.encode(torch.randint(3, m.config.vocab_size, (1, 64), generator=generator), cache, logits="none")
        logits[name] = m.encode(torch.randint(3, m.config.vocab_size, (1, 1), generator=generator), cache,
                                logits="last")
    work = ar_work(model.config, 64)
    report = {"model": label, "work": "AR step", "bytes": work.bytes,
              "roofline_ms": None if dram_gb_s is None else work.bytes / dram_gb_s / 1e6,
              "failures": [mkl.compiled_ar_step.failure, ours.compiled_ar_step.failure]}
    for name, values in seconds.items():
        report[name] = {"median_ms": 1e3 * statistics.median(values), "best_ms": 1e3 * min(values),
                        "max_logit_difference": float((logits[name] - logits["exact"]).abs().max())}
    describe(report)
    return report


def batched_steps(label: str, model, batches: list[int], rounds: int) -> list[dict]:
    """Compiled AR steps of growing batches on one model per side, as a server meets them: the first batch size
    compiles a graph for it, the second one graph for any batch (its rows known only at run time)."""
    mkl, ours = twin(model), twin(model)
    mkl.compiled_ar_step = MKLStep(mkl)
    ours.compiled_ar_step = CompiledARStep(ours)
    out = []
    for batch in batches:
        seconds = interleaved({"compiled, MKL": ar_step_call(mkl, 64, batch),
                               "compiled, kernel": ar_step_call(ours, 64, batch)}, rounds, 10)
        row = {"model": label, "work": f"AR step, batch {batch}",
               "failures": [mkl.compiled_ar_step.failure, ours.compiled_ar_step.failure]}
        for name, values in seconds.items():
            row[name] = {"median_ms": 1e3 * statistics.median(values), "best_ms": 1e3 * min(values)}
        mkl_ms, ours_ms = row["compiled, MKL"]["median_ms"], row["compiled, kernel"]["median_ms"]
        print(f"{label}, AR step, batch {batch}: compiled with MKL {mkl_ms:.2f} ms, with the kernel {ours_ms:.2f} ms "
              f"({mkl_ms / ours_ms:.2f}x)", flush=True)
        out.append(row)
    return out


def describe(report: dict) -> None:
    exact, mkl, ours = (report[name]["median_ms"] for name in ("exact", "compiled, MKL", "compiled, kernel"))
    roof = f", roofline {report['roofline_ms']:.2f} ms" if report.get("roofline_ms") else ""
    print(f"{report['model']}, {report['work']}: exact {exact:.2f} ms, compiled with MKL {mkl:.2f} ms, with the "
          f"kernel {ours:.2f} ms ({mkl / ours:.2f}x){roof}; max logit difference "
          f"{report['compiled, kernel']['max_logit_difference']:.1e}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/rows_linear.json")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per pass")
    parser.add_argument("--reps", type=int, default=31, help="calls per op measurement (hot)")
    parser.add_argument("--skip-ops", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    if not rows_linear_ready():
        sys.exit("bench/rows_linear.py: the kernel could not be built on this machine (see the warning above)")
    load_start = os.getloadavg()[0]
    shipped, large = shipped_model(), benchmark_model("large")
    report: dict = {"max_rows": rows_linear_max_rows(),
                    "command": "OMP_NUM_THREADS=1 python bench/rows_linear.py " + " ".join(sys.argv[1:]),
                    "cpu": cpu_name(), "torch": torch.__version__}
    if not args.skip_ops:
        print("ops:", flush=True)
        report["ops"] = ops(sorted(set(weight_shapes(shipped) + weight_shapes(large))), [1, 2, 4, 8, 16], args.reps)
    dram = read_bandwidth(COLD_BYTES, 9)["best_gb_s"]
    report["dram_read_gb_s"] = dram
    report["passes"] = [ar_steps("shipped", shipped, args.rounds, None), ar_steps("large", large, args.rounds, dram)]
    report["batched"] = batched_steps("shipped", shipped, [1, 2, 4, 8], args.rounds)
    report["load_average"] = [load_start, os.getloadavg()[0]]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
