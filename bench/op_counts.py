"""The operators a pass calls, by name: how many per pass and their self time, next to the pass's own wall time.

Where an exact pass's time goes once its products run near the machine's limit (docs/benchmarks.md §6, "The layers
of a pass in one call, less Python around it"): the products are a few C++ kernels, everything else is many small
ATen operators (views, allocations, copies), each paying dispatch and bookkeeping. This runs one kind of pass over and over under
`torch.profiler` and divides its counts by the passes, then times the same passes without the profiler:

- `ar`: one AR step, `encode` of 1 token after a 64-token prefix (`logits="last"`), the cache made again every 32
  steps as bench/roofline.py does;
- `canvas:C`: a self-conditioned decoder pass over a canvas of C tokens after the same prefix.

Models: `shipped` (models/shakespeare-joint) or a benchmark size of bench/engine_speed.py with random weights
(`--stored-as float16` rounds them as a checkpoint stored so gives them, which the half-width kernels read). The
profiler's own cost per operator (about a microsecond) inflates the self times; the counts are exact.

    OMP_NUM_THREADS=1 .venv/bin/python bench/op_counts.py --models shipped large --stored-as float16 \
        --work ar canvas:32 --out docs/results/op_counts.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import benchmark_model, shipped_model  # noqa: E402  (the same models the roofline times)

from engine_speed import SIZES, median_ms  # noqa: E402  (the benchmarks' own timer)

PREFIX = 64  # tokens in the cache before each pass
REFILL = 32  # AR steps between fresh caches


def workload(model, work: str) -> Callable[[], None]:
    """One pass of `work` on `model`, as a function that runs it (its cache kept between calls)."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab, (1, PREFIX), generator=generator)

    def fresh_cache(room: int):
        cache = model.new_cache(1, PREFIX + room)
        model.encode(prefix, cache, logits="none")
        return cache

    if work == "ar":
        token = torch.randint(3, vocab, (1, 1), generator=generator)
        state = {"cache": fresh_cache(REFILL)}

        def step() -> None:
            if state["cache"].length >= PREFIX + REFILL:
                state["cache"] = fresh_cache(REFILL)
            model.encode(token, state["cache"], logits="last")

        return step
    length = int(work.split(":", 1)[1])
    cache = fresh_cache(length)
    canvas = torch.randint(3, vocab, (1, length), generator=generator)
    probs = torch.softmax(torch.randn(1, length, vocab, generator=generator), -1)
    return lambda: model.denoise(canvas, cache, self_conditioning_probs=probs)


def count_ops(run: Callable[[], None], passes: int) -> dict:
    """The operators `passes` calls of `run` dispatch, per pass: calls and self time in microseconds."""
    for _ in range(3):
        run()  # warm: plans, copies and checks made once
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(passes):
            run()
    ops = {event.key: {"calls": event.count / passes, "self_us": event.self_cpu_time_total / passes}
           for event in prof.key_averages()}
    return dict(sorted(ops.items(), key=lambda item: -item[1]["self_us"]))


def work_name(text: str) -> str:
    if text != "ar" and not (text.startswith("canvas:") and text[7:].isdigit() and int(text[7:]) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'ar' nor 'canvas:C' with C a positive length")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["shipped"], choices=["shipped", *SIZES])
    parser.add_argument("--stored-as", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="the benchmark sizes' weights rounded to this dtype (the shipped model's are float16s)")
    parser.add_argument("--work", nargs="+", type=work_name, default=["ar", "canvas:32"])
    parser.add_argument("--passes", type=int, default=100, help="passes profiled, and as many timed")
    parser.add_argument("--top", type=int, default=15, help="operators printed per pass kind (all are written)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.passes < 1:
        parser.error(f"--passes {args.passes}: at least one pass")
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    report = {"threads": 1, "prefix": PREFIX, "passes": args.passes, "stored_as": args.stored_as, "results": []}
    layers_ops = torch.ops.printpress_layers
    for name in args.models:
        model = shipped_model() if name == "shipped" else benchmark_model(name, getattr(torch, args.stored_as))
        for work in args.work:
            run = workload(model, work)
            ops = count_ops(run, args.passes)
            wall = median_ms(run, args.passes)  # without the profiler
            aten = {op: v for op, v in ops.items() if op.startswith("aten::")}
            # whether the C++ layers' attention runs in their own loops (then no ATen attention is counted)
            loops = hasattr(layers_ops, "attention_form") and layers_ops.attention_form() != 0
            entry = {"model": name, "work": work, "wall_ms": wall, "ops": ops, "attention_in_loops": loops,
                     "aten_calls": sum(v["calls"] for v in aten.values()),
                     "aten_self_ms": sum(v["self_us"] for v in aten.values()) / 1e3}
            report["results"].append(entry)
            print(f"\n{name}, {work}: {wall:.2f} ms a pass (median, no profiler); {entry['aten_calls']:.0f} ATen "
                  f"calls a pass, {entry['aten_self_ms']:.2f} ms of their self time under the profiler")
            print("| operator | calls a pass | self us a pass |\n|---|---|---|")
            for op, v in list(ops.items())[: args.top]:
                print(f"| {op} | {v['calls']:.1f} | {v['self_us']:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
