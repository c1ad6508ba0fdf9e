"""The opt-in compiled decoder pass against the exact one, on the shipped model: per pass, and end to end.

One process, one thread. Per pass: a decoder pass over a canvas after a 64-token prefix (the first step without
self-conditioning and a self-conditioned one), exact (`model.denoise`) and through `printpress.fast.compile_decoder`,
interleaved for `--rounds` rounds, medians; the largest logit difference between the two. End to end: diffusion
decoding of the same prompts and seeds with both, interleaved prompt by prompt, at the model's default settings and
at 4 steps per canvas: tokens/s (wall, prefill included, the compiled side warmed up first), tokens per forward,
and the judged NLL per character of the continuations under the AR twin (models/shakespeare-ar), lower is better.
The compiled side samples from logits that differ in the last bits, so its tokens are not the exact path's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/compiled_decoder.py --out docs/results/compiled_decoder.json
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
from printpress.eval.judge import nll_per_char
from printpress.fast import compile_decoder

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["ROMEO:\n", "JULIET:\nO ", "KING HENRY.\n", "To be, or not to be", "First Citizen:\n",
           "HAMLET.\nWhat ", "LADY MACBETH.\n", "Enter the King"]
SETTINGS = {"default": {}, "4 steps, bound 4": {"max_denoising_steps": 4, "entropy_bound": 4.0}}


def time_passes(pipes: dict, canvas_lengths: list[int], rounds: int) -> dict:
    """Median ms per decoder pass of each side ("exact" first), after a 64-token prefix; each other side's largest
    logit difference from the exact one."""
    model = pipes["exact"].model
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = {}
    for c in canvas_lengths:
        cache = model.new_cache(1, 64 + c)
        with torch.no_grad():
            model.encode(torch.randint(3, vocab, (1, 64), generator=generator), cache, logits="none")
        canvas = torch.randint(3, vocab, (1, c), generator=generator)
        probs = torch.softmax(torch.randn(1, c, vocab, generator=generator), dim=-1)
        sides = {name: pipe.model for name, pipe in pipes.items()}
        times = {f"{name} {kind}": [] for name in sides for kind in ("first", "self-conditioned")}
        logits = {}
        with torch.no_grad():
            for name, m in sides.items():  # warm up (compiles the graph)
                m.denoise(canvas, cache)
                m.denoise(canvas, cache, self_conditioning_probs=probs)
            for r in range(rounds):
                for name, m in (list(sides.items()) if r % 2 == 0 else reversed(sides.items())):
                    for kind, extra in (("first", {}), ("self-conditioned", {"self_conditioning_probs": probs})):
                        start = time.perf_counter()
                        logits[name, kind] = m.denoise(canvas, cache, **extra)
                        times[f"{name} {kind}"].append((time.perf_counter() - start) * 1e3)
        row = {key: statistics.median(values) for key, values in times.items()}
        for name in sides:
            if name != "exact":
                key = "max_abs_logit_diff" + ("" if name == "compiled" else f" ({name})")
                row[key] = max(float((logits["exact", k] - logits[name, k]).abs().max())
                               for k in ("first", "self-conditioned"))
        out[f"canvas {c}"] = row
        print(f"canvas {c:3d}: " + ", ".join(f"{k} {v:.2f} ms" if k.endswith(("first", "conditioned")) else
                                             f"{k} {v:.1e}" for k, v in row.items()))
    return out


def end_to_end(sides: dict, judge, max_new_tokens: int) -> dict:
    report = {}
    for label, settings in SETTINGS.items():
        rows = {name: {"seconds": 0.0, "tokens": 0, "passes": 0, "nll": []} for name in sides}
        for index, prompt in enumerate(PROMPTS):
            for name, pipe in (list(sides.items()) if index % 2 == 0 else reversed(sides.items())):
                start = time.perf_counter()
                result = pipe.generate(prompt, mode="diffusion", seed=index, max_new_tokens=max_new_tokens, **settings)
                rows[name]["seconds"] += time.perf_counter() - start
                rows[name]["tokens"] += len(result.token_ids)
                rows[name]["passes"] += result.stats.forward_passes
                rows[name]["nll"].append(nll_per_char(judge, prompt, result.text))
        report[label] = {name: {"tokens_per_s": row["tokens"] / row["seconds"],
                                "tokens_per_forward": row["tokens"] / row["passes"],
                                "judged_nll_per_char": statistics.mean(row["nll"])} for name, row in rows.items()}
        speeds = {name: report[label][name]["tokens_per_s"] for name in sides}
        report[label]["speedup"] = speeds["compiled"] / speeds["exact"]
        print(f"{label}: " + "; ".join(f"{name} {r['tokens_per_s']:.1f} tok/s ({speeds[name] / speeds['exact']:.2f}x "
                                      f"exact), NLL/char {r['judged_nll_per_char']:.3f}"
                                      for name, r in report[label].items() if name != "speedup"))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--canvas", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="every side in this dtype (the judge stays float32)")
    parser.add_argument("--dense-experts", action="store_true",
                        help="a third side: compiled with every expert on every token (routed_experts=False)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    variants = {"exact": None, "compiled": True} | ({"compiled, dense experts": False} if args.dense_experts else {})
    pipes = {name: printpress.load(args.model, dtype=args.dtype) for name in variants}
    judge = printpress.load(ROOT / "models" / "shakespeare-ar")
    start = time.perf_counter()
    compiled = {name: compile_decoder(pipes[name].model, routed_experts=routed)
                for name, routed in variants.items() if routed is not None}
    # Compile before timing, every variant the runs below meet: the first step and the self-conditioned ones, and a
    # context long enough for the sliding ring to wrap (the cache is then read in another layout).
    for name in compiled:
        pipes[name].generate(PROMPTS[3], mode="diffusion", max_new_tokens=args.max_new_tokens + 64,
                             max_denoising_steps=2)
    compile_seconds = time.perf_counter() - start
    load_start = os.getloadavg()[0]
    report = {"command": "OMP_NUM_THREADS=1 python bench/compiled_decoder.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model, "dtype": args.dtype, "threads": 1, "compile_seconds": compile_seconds,
              "passes": time_passes(pipes, args.canvas, args.rounds),
              "diffusion": end_to_end(pipes, judge, args.max_new_tokens),
              "compile_failure": compiled["compiled"].failure, "load_average": [load_start, os.getloadavg()[0]]}
    if args.dense_experts:
        report["compile_failure (dense experts)"] = compiled["compiled, dense experts"].failure
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
