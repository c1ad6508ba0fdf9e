"""Per-forward overhead, before and after: the engine's model code at a git revision against the working tree.

`printpress/model.py` and `printpress/cache.py` as of `--rev` (default HEAD) are imported as a separate package
(`pp_rev`) beside the working tree's, both models get the same weights, and one process times both on the same
work, interleaved (each round runs every workload on both sides, the side order alternating), so machine load
hits both alike:

- one AR step: `encode` of 1 token after a 64-token prefix (`logits="last"`), rolled back after each call;
- one decoder pass per canvas length: the first step (no self-conditioning) and a later, self-conditioned one
  (`self_conditioning_probs`, as the engine passes them).

It also checks that both sides return bit-identical logits for every workload (the speedups here must not
change a single bit), and prints and writes the medians and their ratio (before / after: > 1 is faster).
`--compiled` adds a third side for the AR step: the working tree with the opt-in compiled step
(`printpress.fast.compile_ar_step`, not bit-exact: its largest logit difference is reported instead).

    OMP_NUM_THREADS=1 .venv/bin/python bench/forward_overhead.py --models shipped large --compiled \
        --out docs/results/forward_overhead.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/forward_overhead.py --models shipped --reps 5   # quick look
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import printpress
from printpress.config import TextConfig
from printpress.fast import compile_ar_step
from printpress.model import DiffusionGemma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_speed import SIZES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def model_at_revision(rev: str) -> ModuleType:
    """printpress/model.py (with its cache.py) as of `rev`, importable next to the working tree's."""
    package = Path(tempfile.mkdtemp()) / "pp_rev"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("model", "cache"):
        source = subprocess.run(["git", "show", f"{rev}:printpress/{name}.py"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout
        (package / f"{name}.py").write_text(source.replace("from printpress.cache", "from pp_rev.cache"))
    sys.path.insert(0, str(package.parent))
    return importlib.import_module("pp_rev.model")


def build(name: str) -> DiffusionGemma:
    if name == "shipped":
        return printpress.load(ROOT / "models" / "shakespeare-joint").model
    torch.manual_seed(0)
    return DiffusionGemma(TextConfig(**SIZES[name].text)).eval()


def workloads(model, canvases: list[int], context: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Name -> a call returning logits; the same seeds on both sides, so the inputs are equal."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, context + max(canvases) + 1)
    model.encode(torch.randint(3, vocab, (1, context), generator=gen), cache, logits="none")
    token = torch.randint(3, vocab, (1, 1), generator=gen)

    def ar_step() -> torch.Tensor:
        snapshot = cache.snapshot(1)
        logits = model.encode(token, cache, logits="last")
        cache.truncate(context, snapshot)
        return logits

    out: dict[str, Callable[[], torch.Tensor]] = {"AR step": ar_step}
    for c in canvases:
        ids = torch.randint(3, vocab, (1, c), generator=gen)
        probs = torch.softmax(torch.randn(1, c, vocab, generator=gen), dim=-1)
        out[f"decoder canvas {c}, first step"] = lambda ids=ids: model.denoise(ids, cache)
        out[f"decoder canvas {c}, self-conditioned"] = (
            lambda ids=ids, probs=probs: model.denoise(ids, cache, self_conditioning_probs=probs))
    return out


def compare(name: str, before_cls: type, args: argparse.Namespace) -> dict[str, Any]:
    after = build(name)
    before = before_cls(after.config).eval()
    before.load_state_dict(after.state_dict())
    sides = {"before": before, "after": after}
    if args.compiled:
        sides["compiled"] = build(name)
        compile_ar_step(sides["compiled"])
    with torch.no_grad():
        loads = {side: workloads(model, args.canvases, args.context) for side, model in sides.items()}
        if args.compiled:  # the compiled side runs the AR step only (compiled on this first call)
            loads["compiled"] = {"AR step": loads["compiled"]["AR step"]}
        names = list(loads["after"])
        reference = {work: loads["before"][work]() for work in names}
        equal = {work: torch.equal(reference[work], loads["after"][work]()) for work in names}
        compiled_diff = None
        if args.compiled:
            compiled_diff = (loads["compiled"]["AR step"]() - reference["AR step"]).abs().max().item()
        seconds = {side: {work: [] for work in loads[side]} for side in sides}
        for round_index in range(args.reps):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for work in names:
                for side in order:
                    if work not in loads[side]:
                        continue
                    start = time.perf_counter()
                    loads[side][work]()
                    seconds[side][work].append(time.perf_counter() - start)
    rows = []
    for work in names:
        b, a = (1e3 * statistics.median(seconds[side][work]) for side in ("before", "after"))
        row = {"work": work, "before_ms": b, "after_ms": a, "speedup": b / a, "bit_equal": equal[work]}
        line = (f"  {name:8s} {work:36s} before {b:8.2f} ms  after {a:8.2f} ms  x{b / a:5.2f}  "
                f"{'bit-equal' if equal[work] else 'DIFFERENT'}")
        if work in seconds.get("compiled", {}):
            c = 1e3 * statistics.median(seconds["compiled"][work])
            row.update(compiled_ms=c, compiled_speedup=b / c, compiled_max_abs_diff=compiled_diff)
            line += f"  compiled {c:8.2f} ms  x{b / c:5.2f} (max |diff| {compiled_diff:.1e})"
        rows.append(row)
        print(line, flush=True)
    return {"model": name, "parameters": after.config.num_parameters(), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="HEAD", help="git revision of the 'before' side")
    parser.add_argument("--models", nargs="+", default=["shipped"], help="'shipped' and/or engine_speed sizes")
    parser.add_argument("--canvases", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="add the compiled AR step as a third side")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    before_cls = model_at_revision(args.rev).DiffusionGemma
    load_start = os.getloadavg()[0]
    report = {"command": "python bench/forward_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rev": args.rev, "threads": args.threads, "reps": args.reps, "context": args.context,
              "models": [compare(name, before_cls, args) for name in args.models]}
    report["load_average"] = [load_start, os.getloadavg()[0]]
    print(f"1-minute load average {report['load_average'][0]:.2f} -> {report['load_average'][1]:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
