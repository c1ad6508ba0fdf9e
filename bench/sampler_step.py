"""The exact sampler step with torch.multinomial against `printpress.sampling.multinomial_one`: time and tokens.

One draw per canvas position is argmax(probs / q), q ~ Exp(1); torch.multinomial makes the q one element at a time
(`Tensor.exponential_`), `multinomial_one` makes the same q from one vectorised uniform draw in ATen's operators, or
with printpress's draw kernel a row at a time (printpress/kernels/draw.cpp; docs/generation.md): three sides, the
speedups against torch.multinomial.
Per canvas length, on the shipped model's logits after a 64-token prefix, one thread, the two sides interleaved:
the bare draw over (canvas, vocabulary) probabilities and the whole exact sampler step
(`printpress.canvas.denoise_step`: temperature, entropy, acceptance, draw, re-noising), each side with a generator
seeded alike, so the tokens of every call are compared too.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sampler_step.py --out docs/results/sampler_step.json

`--batch 1 2 6 16`: instead, the exact sampler step over a batch of canvas-32 rows (the engine's continuous batch),
as printpress runs it against its earlier form, which took the softmax, the entropy and the argmax over the whole
batch at once (`whole_batch` below); every output of every call (argmax, next canvas, entropy, probabilities) is
compared bit for bit.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sampler_step.py --batch 1 2 6 16 --out docs/results/sampler_batch.json

`--fused`: instead, the step as the exact path takes it against a compiled decoder's (`denoise_step(...,
exact=False)`: each position's softmax and entropy in one call of printpress's kernel), per canvas length.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sampler_step.py --fused --out docs/results/sampler_fused.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import printpress
from printpress import canvas as canvas_step
from printpress import sampling
from printpress.sampling import SamplerSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import Row  # noqa: E402  (a canvas row for denoise_step)

ROOT = Path(__file__).resolve().parent.parent


def torch_multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def whole_batch():
    """The sampler's batch-wide pieces as they were before they went row by row (the same numbers, slower)."""

    def whole(processed: torch.Tensor, free: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.softmax(processed, dim=-1, dtype=torch.float32), sampling.token_entropy(processed[:, :free])

    return (lambda x: torch.argmax(x, dim=-1)), whole


def batch_steps(model, batches: list[int], reps: int) -> dict:
    """The exact sampler step over b rows of canvas 32, printpress's against `whole_batch`, interleaved."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    sides = {"whole batch (before)": whole_batch(),
             "row by row (printpress)": (sampling.row_argmax, canvas_step.probabilities_and_entropy)}
    current = sides["row by row (printpress)"]
    out = {}
    for b in batches:
        cache = model.new_cache(b, 128)
        model.encode(torch.randint(3, vocab, (b, 64), generator=gen), cache, logits="none")
        logits = model.denoise(torch.randint(3, vocab, (b, 32), generator=gen), cache)
        times = {name: [] for name in sides}
        outputs = {name: [] for name in sides}
        generators = {name: [torch.Generator().manual_seed(j) for j in range(b)] for name in sides}
        for rep in range(reps + 1):
            for name in (list(sides) if rep % 2 == 0 else list(reversed(sides))):
                canvas_step.row_argmax, canvas_step.probabilities_and_entropy = sides[name]
                rows = [Row(j, generators[name][j], None, 1 + rep % 16, SamplerSettings(max_denoising_steps=16))
                        for j in range(b)]
                try:
                    start = time.perf_counter()
                    outcome = canvas_step.denoise_step(logits, rows, vocab)
                    times[name].append(time.perf_counter() - start)
                finally:
                    canvas_step.row_argmax, canvas_step.probabilities_and_entropy = current
                outputs[name].append((outcome.argmax, outcome.next_canvas, outcome.entropy, outcome.probs))
        before, after = (1e3 * statistics.median(t[1:]) for t in times.values())
        identical = sum(all(torch.equal(x, y) for x, y in zip(a, c)) for a, c in zip(*outputs.values()))
        out[str(b)] = {"before_ms": before, "after_ms": after, "speedup": before / after,
                       "identical_calls": f"{identical} of {reps + 1}"}
        print(f"rows {b:3d}: exact sampler step, whole batch {before:6.2f} ms, row by row {after:6.2f} ms, "
              f"{before / after:4.2f}x, identical {identical} of {reps + 1}")
    return out


def fused_steps(model, canvases: list[int], reps: int) -> dict:
    """The sampler step of one canvas as the exact path takes it against a compiled decoder's (`exact=False`: the
    softmax and entropies in one kernel call), interleaved, each side with a generator seeded alike."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(1, 64 + max(canvases))
    model.encode(torch.randint(3, vocab, (1, 64), generator=gen), cache, logits="none")
    out = {}
    for c in canvases:
        logits = model.denoise(torch.randint(3, vocab, (1, c), generator=gen), cache)
        times, canvases_drawn = {True: [], False: []}, {True: [], False: []}
        generators = {exact: torch.Generator().manual_seed(0) for exact in times}
        for rep in range(reps + 1):
            for exact in ((True, False) if rep % 2 == 0 else (False, True)):
                row = Row(0, generators[exact], None, 1 + rep % 16, SamplerSettings(max_denoising_steps=16))
                start = time.perf_counter()
                outcome = canvas_step.denoise_step(logits, [row], vocab, exact=exact)
                times[exact].append(time.perf_counter() - start)
                canvases_drawn[exact].append(outcome.next_canvas)
        exact_ms, fused_ms = (1e3 * statistics.median(times[e][1:]) for e in (True, False))
        same = sum(torch.equal(a, b) for a, b in zip(canvases_drawn[True], canvases_drawn[False]))
        out[str(c)] = {"exact_ms": exact_ms, "fused_ms": fused_ms, "speedup": exact_ms / fused_ms,
                       "same_next_canvas": f"{same} of {reps + 1}"}
        print(f"canvas {c:3d}: sampler step, exact {exact_ms:6.3f} ms, fused (compiled decoder) {fused_ms:6.3f} ms, "
              f"{exact_ms / fused_ms:4.2f}x; the same next canvas in {same} of {reps + 1} calls")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canvases", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--batch", type=int, nargs="+", help="rows: time the batched exact step instead (see above)")
    parser.add_argument("--fused", action="store_true",
                        help="time the exact step against a compiled decoder's fused one instead (see above)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = printpress.load(ROOT / "models" / "shakespeare-joint").model
    if args.fused:
        from printpress.fast import rows_linear_ready

        rows_linear_ready()  # loads the kernel, as compiling a pass does
        with torch.no_grad():
            report = {"model": "models/shakespeare-joint", "threads": 1, "reps": args.reps,
                      "load_average_start": os.getloadavg()[0],
                      "canvases": fused_steps(model, args.canvases, args.reps),
                      "load_average_end": os.getloadavg()[0]}
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return
    if args.batch:
        with torch.no_grad():
            report = {"model": "models/shakespeare-joint", "threads": 1, "reps": args.reps, "canvas": 32,
                      "load_average_start": os.getloadavg()[0], "rows": batch_steps(model, args.batch, args.reps),
                      "load_average_end": os.getloadavg()[0]}
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(1, 64 + max(args.canvases))
    settings = SamplerSettings(max_denoising_steps=32)
    kernels = sampling.draw_kernels()
    # Each side: the draw, and whether printpress's draw kernel may run (also the step's argmax).
    sides = {"torch.multinomial": (torch_multinomial, False), "multinomial_one, ATen": (sampling.multinomial_one, False),
             "multinomial_one, kernel": (sampling.multinomial_one, True)}
    if not kernels:
        del sides["multinomial_one, kernel"]
    report = {"model": "models/shakespeare-joint", "threads": 1, "reps": args.reps, "vocab": vocab,
              "load_average_start": os.getloadavg()[0], "canvases": {}}
    draw, with_kernels = sampling.multinomial_one, sampling.draw_kernels
    with torch.no_grad():
        model.encode(torch.randint(3, vocab, (1, 64), generator=gen), cache, logits="none")
        for c in args.canvases:
            logits = model.denoise(torch.randint(3, vocab, (1, c), generator=gen), cache)
            probs = torch.softmax(logits[0] / 0.8, dim=-1, dtype=torch.float32)
            times = {f"{kind}, {name}": [] for kind in ("draw", "sampler step") for name in sides}
            tokens = {name: [] for name in times}
            generators = {name: torch.Generator().manual_seed(0) for name in times}
            for rep in range(args.reps + 1):
                for name, (side_draw, side_kernels) in (sides.items() if rep % 2 == 0 else reversed(sides.items())):
                    sampling.multinomial_one = side_draw  # what sample_canvas calls
                    sampling.draw_kernels = with_kernels if side_kernels else (lambda: False)
                    try:
                        key = f"draw, {name}"
                        start = time.perf_counter()
                        out = side_draw(probs, generators[key])
                        times[key].append(time.perf_counter() - start)
                        tokens[key].append(out)
                        key = f"sampler step, {name}"
                        row = Row(0, generators[key], None, 1 + rep % 32, settings)
                        start = time.perf_counter()
                        outcome = canvas_step.denoise_step(logits, [row], vocab)
                        times[key].append(time.perf_counter() - start)
                        tokens[key].append(outcome.next_canvas)
                    finally:
                        sampling.multinomial_one, sampling.draw_kernels = draw, with_kernels
            result = {key: {"median_ms": 1e3 * statistics.median(t[1:]), "best_ms": 1e3 * min(t[1:])}
                      for key, t in times.items()}
            first = list(sides)[0]
            for kind in ("draw", "sampler step"):
                line = f"canvas {c:3d} {kind:13s}"
                base = result[f"{kind}, {first}"]["median_ms"]
                for name in sides:
                    ms = result[f"{kind}, {name}"]["median_ms"]
                    same = sum(torch.equal(x, y) for x, y in zip(tokens[f"{kind}, {first}"], tokens[f"{kind}, {name}"]))
                    result[f"{kind}, {name}"].update(speedup=base / ms, identical_calls=f"{same} of {args.reps + 1}")
                    line += f"  {name} {ms:6.3f} ms ({base / ms:4.2f}x, identical {same})"
                print(line)
            report["canvases"][str(c)] = result
    report["load_average_end"] = os.getloadavg()[0]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
