"""Inductor options for the compiled AR step: does any of them beat the option set `compile_ar_step` uses?

The compiled AR step (`printpress.fast`) spends most of its time in ~47 one-row GEMMs (docs/benchmarks.md §6). The
usual ways to cut that on a CPU, each as a side against the shipped option set, same model, same cache, rounds
interleaved, one thread:

- `freezing`: the parameters become constants of the graph (inductor can pre-pack weights and fold them);
- `concat-linear`: freezing, plus inductor's pass that fuses linears reading one input (q/k/v, gate/up) into one GEMM;
- `cpp-gemm`: freezing, plus max-autotune with inductor's own C++ GEMM template beside ATen's;
- `gemv`: every one-row linear traced as a multiply-and-sum, so inductor writes it as a vectorised reduction fused
  with its neighbours instead of calling MKL (only here, by swapping `F.linear` while the graph is traced).

Each side also reports its largest logit difference from the exact path at the same step. Timings are medians and
minima over `--rounds` x `--steps` steps after a 64-token prompt.

    OMP_NUM_THREADS=1 .venv/bin/python bench/compile_options.py --out docs/results/compile_options.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import printpress
from printpress.fast import CompiledARStep, ar_step_graph, input_and_code_guards

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_ar import own_copy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {
    "compiled (shipped options)": {},
    "freezing": {"freezing": True},
    "concat-linear": {"freezing": True, "cpp.enable_concat_linear": True},
    "cpp-gemm": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
    "gemv": {},
}


@contextlib.contextmanager
def one_row_linears_as_reductions(enabled: bool):
    """While tracing: a linear over one row is (x * W).sum(-1), which inductor generates itself."""
    linear = F.linear

    def reduction_linear(x, weight, bias=None):
        if x.numel() != x.shape[-1]:
            return linear(x, weight, bias)
        out = (x.unsqueeze(-2) * weight).sum(-1)
        return out if bias is None else out + bias

    if enabled:
        F.linear = reduction_linear
    try:
        yield
    finally:
        F.linear = linear


def step_with(pipe, name: str) -> CompiledARStep:
    step = CompiledARStep(pipe.model)
    graph = own_copy(ar_step_graph)  # a code object per side, so that the sides do not share graphs
    options = {"guard_filter_fn": input_and_code_guards, "cpp_wrapper": True, **OPTIONS[name]}
    step._graph = torch.compile(graph, backend="inductor", fullgraph=True, options=options)
    return step


def run_steps(model, step, prompt: torch.Tensor, count: int) -> tuple[list[float], torch.Tensor]:
    """Times of `count` steps after `prompt` (through `step`, or eagerly when None), and the first step's logits."""
    cache = model.new_cache(1, prompt.shape[1] + count + 1)
    model.encode(prompt, cache, logits="none")
    token, times, first = torch.tensor([[5]]), [], None
    for _ in range(count):
        start = time.perf_counter()
        logits = model.encode(token, cache, logits="last") if step is None else step(token, cache)
        times.append(time.perf_counter() - start)
        if logits is None:
            raise RuntimeError(f"the compiled step failed: {step.failure}")
        first = logits if first is None else first
    return times, first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sides", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prompt = torch.randint(3, 4000, (1, 64), generator=torch.Generator().manual_seed(0))
    pipe = printpress.load(ROOT / "models" / "shakespeare-joint")
    sides: dict[str, CompiledARStep | None] = {"exact": None}
    compile_s = {}
    with torch.no_grad():
        for name in args.sides:
            sides[name] = step_with(pipe, name)
            start = time.perf_counter()
            with one_row_linears_as_reductions(name == "gemv"):  # held on every call: a recompile traces again
                run_steps(pipe.model, sides[name], prompt, 2)
            compile_s[name] = time.perf_counter() - start
        load_start = os.getloadavg()[0]
        times: dict[str, list[float]] = {name: [] for name in sides}
        for round_ in range(args.rounds):
            for name, step in (sides.items() if round_ % 2 == 0 else reversed(sides.items())):
                with one_row_linears_as_reductions(name == "gemv"):
                    times[name] += run_steps(pipe.model, step, prompt, args.steps)[0][1:]
        exact_logits = run_steps(pipe.model, None, prompt, 1)[1]
        report = {"model": "models/shakespeare-joint", "threads": 1, "prompt_tokens": 64, "rounds": args.rounds,
                  "steps_per_round": args.steps, "load_average": [load_start, os.getloadavg()[0]], "sides": {}}
        for name, step in sides.items():
            with one_row_linears_as_reductions(name == "gemv"):
                logits = run_steps(pipe.model, step, prompt, 1)[1]
            report["sides"][name] = {
                "median_ms": 1e3 * statistics.median(times[name]), "best_ms": 1e3 * min(times[name]),
                "compile_s": compile_s.get(name), "options": OPTIONS.get(name),
                "max_abs_logit_diff_vs_exact": float((logits - exact_logits).abs().max())}
    base = report["sides"]["exact"]["median_ms"]
    for name, side in report["sides"].items():
        print(f"{name:28s} median {side['median_ms']:6.3f} ms  best {side['best_ms']:6.3f} ms  "
              f"{base / side['median_ms']:5.2f}x exact  logit diff {side['max_abs_logit_diff_vs_exact']:.1e}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
