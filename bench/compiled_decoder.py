"""The opt-in compiled decoder pass against the exact one, on the shipped model: per pass, and end to end.

One process, one thread. Per pass: a decoder pass over a canvas after a 64-token prefix (the first step without
self-conditioning and a self-conditioned one) and a fused pass (a sliding canvas's pass after a commit:
`encode_and_denoise` of a 2-token block beside the self-conditioned canvas), exact and through
`printpress.fast.compile_decoder`, interleaved for `--rounds` rounds, medians; the largest logit difference between
the two. End to end: diffusion decoding of the same prompts and seeds with both, interleaved prompt by prompt, at the
model's default settings, at 4 steps per canvas and sliding (4 steps; its passes after a commit are fused passes):
tokens/s (wall, prefill included, the compiled side warmed up first), tokens per forward, and the judged NLL per
character of the continuations under the AR twin (`--judge`, models/shakespeare-ar), lower is better. The compiled
side samples from logits that differ in the last bits, so its tokens are not the exact path's.

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
SETTINGS = {"default": {}, "4 steps, bound 4": {"max_denoising_steps": 4, "entropy_bound": 4.0},
            "sliding, 4 steps": {"sliding": True, "max_denoising_steps": 4}}
FUSED_BLOCK = 2  # tokens committed before the fused pass timed (a sliding canvas's commits: 1-5)


def time_passes(pipes: dict, canvas_lengths: list[int], rounds: int) -> dict:
    """Median ms per decoder pass of each side ("exact" first), after a 64-token prefix, and per fused pass (a
    sliding canvas's pass after a commit: `FUSED_BLOCK` tokens encoded beside the self-conditioned canvas); each other
    side's largest logit difference from the exact one."""
    model = pipes["exact"].model
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = {}
    for c in canvas_lengths:
        cache = model.new_cache(1, 64 + c + FUSED_BLOCK)
        with torch.no_grad():
            model.encode(torch.randint(3, vocab, (1, 64), generator=generator), cache, logits="none")
        canvas = torch.randint(3, vocab, (1, c), generator=generator)
        probs = torch.softmax(torch.randn(1, c, vocab, generator=generator), dim=-1)
        block = torch.randint(3, vocab, (1, FUSED_BLOCK), generator=generator)
        sides = {name: pipe.model for name, pipe in pipes.items()}
        kinds = ("first", "self-conditioned", "fused")
        times = {f"{name} {kind}": [] for name in sides for kind in kinds}
        logits = {}

        def run(m, kind):
            if kind != "fused":
                return m.denoise(canvas, cache, self_conditioning_probs=probs if kind != "first" else None)
            snapshot = cache.snapshot(FUSED_BLOCK)
            out = m.encode_and_denoise(block, canvas, cache, probs)
            cache.truncate(64, snapshot)  # the block goes again: every round sees the same cache
            return out

        with torch.no_grad():
            for name, m in sides.items():  # warm up (compiles the graphs)
                for kind in kinds:
                    run(m, kind)
            for r in range(rounds):
                for name, m in (list(sides.items()) if r % 2 == 0 else reversed(sides.items())):
                    for kind in kinds:
                        start = time.perf_counter()
                        logits[name, kind] = run(m, kind)
                        times[f"{name} {kind}"].append((time.perf_counter() - start) * 1e3)
        row = {key: statistics.median(values) for key, values in times.items()}
        for name in sides:
            if name != "exact":
                key = "max_abs_logit_diff" + ("" if name == "compiled" else f" ({name})")
                row[key] = max(float((logits["exact", k] - logits[name, k]).abs().max()) for k in kinds)
        out[f"canvas {c}"] = row
        print(f"canvas {c:3d}: " + ", ".join(f"{k} {v:.2f} ms" if k.endswith(kinds) else
                                             f"{k} {v:.1e}" for k, v in row.items()))
    return out


def end_to_end(sides: dict, judge, prompts: list[str], max_new_tokens: int) -> dict:
    report = {}
    for label, settings in SETTINGS.items():
        rows = {name: {"seconds": 0.0, "tokens": 0, "passes": 0, "nll": []} for name in sides}
        for index, prompt in enumerate(prompts):
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
    parser.add_argument("--fused-eager", action="store_true",
                        help="a third side: compiled, but the fused passes (a block encoded beside a canvas) eager")
    parser.add_argument("--judge", default=str(ROOT / "models" / "shakespeare-ar"),
                        help="the AR model that judges the continuations")
    parser.add_argument("--prompts", nargs="+", default=PROMPTS)
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    variants = ({"exact": None, "compiled": True} | ({"compiled, dense experts": False} if args.dense_experts else {})
                | ({"compiled, fused pass eager": True} if args.fused_eager else {}))
    pipes = {name: printpress.load(args.model, dtype=args.dtype) for name in variants}
    judge = printpress.load(args.judge)
    start = time.perf_counter()
    compiled = {name: compile_decoder(pipes[name].model, routed_experts=routed)
                for name, routed in variants.items() if routed is not None}
    if args.fused_eager:
        pipes["compiled, fused pass eager"].model.compiled_fused_pass = None
    # Compile before timing, every variant the runs below meet: the first step and the self-conditioned ones, and a
    # context long enough for the sliding ring to wrap (the cache is then read in another layout).
    for name in compiled:
        for sliding in (False, True):
            pipes[name].generate(args.prompts[0], mode="diffusion", max_new_tokens=args.max_new_tokens + 64,
                                 max_denoising_steps=2, sliding=sliding)
    compile_seconds = time.perf_counter() - start
    load_start = os.getloadavg()[0]
    report = {"command": "OMP_NUM_THREADS=1 python bench/compiled_decoder.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model, "dtype": args.dtype, "threads": 1, "compile_seconds": compile_seconds,
              "passes": time_passes(pipes, args.canvas, args.rounds),
              "diffusion": end_to_end(pipes, judge, args.prompts, args.max_new_tokens),
              "compile_failure": compiled["compiled"].failure, "load_average": [load_start, os.getloadavg()[0]]}
    if args.dense_experts:
        report["compile_failure (dense experts)"] = compiled["compiled, dense experts"].failure
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
