"""Compiled passes with and without dynamo's entry, against the exact path: the AR step, a speculative verification
block and a self-conditioned decoder pass, timed through the model's own calls (`encode`, `encode_tentatively`,
`denoise`), so each side's time includes what it does around its graph.

Three copies of the model with the same weights, one thread:
- exact: the default eager passes;
- dynamo: `compile_ar_step` / `compile_decoder` with `ahead_of_time=False`, each call through `torch.compile`;
- ahead of time: the default, the same graphs as AOTInductor packages (`printpress.aot`), called from their runner;
- ahead of time with bfloat16 weights: `compile_ar_step(..., weights="bfloat16")` and `compile_decoder(...,
  weights="bfloat16")`: the AR step reads bfloat16 copies of the weights, and on a CPU with AMX a decoder pass's
  products run on bfloat16 tiles (not the float32 model's numbers; blocks of 5-15 tokens as above).

Workloads after a 64-token prompt (an AR step, a verification, a decoder pass, a canvas of 32 committed to the
cache), rolled back after each call so every call sees the same cache (what the
roll-back of an AR step costs is timed too: it is in every side's AR step row); the sides alternate in rounds,
medians of the rounds' medians. Also reported: the compiled sides' largest logit difference from the exact path,
how long building and then loading the packages took, that a package reads the model's live weights (a router's
per-expert scale, which inductor would otherwise write into the package, changed in place) and that the bfloat16
copies follow an in-place change of their weight.

    OMP_NUM_THREADS=1 python bench/aot_graphs.py [--model models/shakespeare-joint] [--out docs/results/aot_graphs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import printpress
from printpress.fast import amx_available, compile_ar_step, compile_decoder

CONTEXT = 64
BF16 = "ahead of time, bfloat16 weights"
SIDES = ("exact", "dynamo", "ahead of time", BF16)


def median_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def alternated_medians(calls: dict, rounds: int) -> dict:
    """side -> workload -> ms: each call warmed up 10 times, then `rounds` rounds in which every workload runs 40
    times on each side in turn; the median of the rounds' medians."""
    for side_calls in calls.values():
        for call in side_calls.values():
            for _ in range(10):
                call()
    names = list(next(iter(calls.values())))
    times = {side: {name: [] for name in names} for side in calls}
    for _ in range(rounds):
        for name in names:
            for side in calls:
                times[side][name].append(median_ms(calls[side][name], 40))
    return {side: {name: statistics.median(t) for name, t in side_times.items()} for side, side_times in times.items()}


def workloads(model) -> dict:
    """name -> (call, logits of one call) on `model`, each after the same 64-token prompt."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, CONTEXT), generator=generator)
    token, block = torch.randint(3, vocab, (1, 1), generator=generator), torch.randint(3, vocab, (1, 8),
                                                                                        generator=generator)
    canvas = torch.randint(3, vocab, (1, 32), generator=generator)
    cache = model.new_cache(1, CONTEXT + 32)
    model.encode(prompt, cache, logits="none")
    probs = torch.softmax(model.denoise(canvas, cache) / 0.8, dim=-1)

    def rolled_back(call, written: int):
        def run():
            snapshot = cache.snapshot(written)
            out = call()
            cache.truncate(CONTEXT, snapshot)
            return out
        return run

    def verification():
        logits, keep = model.encode_tentatively(block, cache)
        keep(4)  # as a verification that accepts half its drafts
        return logits

    def committed():  # a canvas written to the cache: its keys (the last layer's, a full one) stand for its output
        model.encode(canvas, cache, logits="none")
        return cache.layers[-1].keys[:, :, CONTEXT:CONTEXT + canvas.shape[1]].clone()

    def rollback_alone():
        snapshot = cache.snapshot(1)
        cache.advance(1, None)
        cache.truncate(CONTEXT, snapshot)

    return {"the AR step's roll-back alone (in each AR step row)": rollback_alone,
            "AR step": rolled_back(lambda: model.encode(token, cache, logits="last"), 1),
            "verification block (8 tokens)": rolled_back(verification, 4),
            "decoder pass, canvas 32, self-conditioned": lambda: model.denoise(canvas, cache,
                                                                              self_conditioning_probs=probs),
            "a canvas committed (a block of 32 tokens, no logits)": rolled_back(committed, 32)}


def arguments(doc: str, out: str) -> argparse.Namespace:
    """The arguments of this bench and bench/own_operators.py (--model, --rounds, --out); one thread and no
    gradients from then on."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds of 40 calls per side")
    parser.add_argument("--out", default=out)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    return args


def main() -> None:
    args = arguments(__doc__, "docs/results/aot_graphs.json")
    with tempfile.TemporaryDirectory() as folder:
        os.environ["PRINTPRESS_CACHE"] = folder  # packages built here, then loaded by a second copy
        models = {side: printpress.load(args.model).model for side in SIDES}
        compile_ar_step(models["dynamo"], ahead_of_time=False)
        compile_decoder(models["dynamo"], ahead_of_time=False)
        for side, weights in (("ahead of time", "float32"), (BF16, "bfloat16")):
            compile_ar_step(models[side], weights=weights)
            compile_decoder(models[side], weights=weights)
        calls = {side: workloads(model) for side, model in models.items()}
        outputs = {}
        for side, side_calls in calls.items():
            start = time.perf_counter()
            outputs[side] = {name: call() for name, call in side_calls.items() if "alone" not in name}
            # kept for the last side (bfloat16 weights): its first calls build its packages
            build_s = time.perf_counter() - start
        loader = printpress.load(args.model).model
        start = time.perf_counter()
        compile_ar_step(loader)
        compile_decoder(loader)
        for call in workloads(loader).values():
            call()
        load_s = time.perf_counter() - start  # the same calls, the packages now on disk

        expert_scale = models["ahead of time"].layers[0].router.per_expert_scale
        expert_scale.mul_(2.0)  # an in-place change of a small weight must reach the package
        live_weights = not torch.equal(calls["ahead of time"]["AR step"](), outputs["ahead of time"]["AR step"])
        expert_scale.div_(2.0)
        down = models[BF16].layers[0].mlp.down_proj.weight
        kept = down.clone()
        # and an in-place change of a weight must reach its bfloat16 copy (its version counter): one output channel
        # doubled, as the norm after the MLP would undo the whole weight doubled
        down[0].mul_(2.0)
        live_copies = all(not torch.equal(calls[BF16][name](), outputs[BF16][name])
                          for name in ("AR step", "decoder pass, canvas 32, self-conditioned"))
        down.copy_(kept)

        medians = alternated_medians(calls, args.rounds)
    rows = []
    for name in calls["exact"]:
        row = {"workload": name, **{f"{side}_ms": medians[side][name] for side in calls}}
        row["exact / ahead of time"] = row["exact_ms"] / row["ahead of time_ms"]
        row["exact / dynamo"] = row["exact_ms"] / row["dynamo_ms"]
        row["dynamo / ahead of time"] = row["dynamo_ms"] / row["ahead of time_ms"]
        row["exact / bfloat16 weights"] = row["exact_ms"] / row[f"{BF16}_ms"]
        for side in SIDES[1:] if name in outputs["exact"] else ():
            row[f"{side} max abs logit difference"] = (outputs[side][name] - outputs["exact"][name]).abs().max().item()
        rows.append(row)
        print(f"{name}: exact {row['exact_ms']:.3f} ms, dynamo {row['dynamo_ms']:.3f} ms, ahead of time "
              f"{row['ahead of time_ms']:.3f} ms (exact / ahead {row['exact / ahead of time']:.2f}x, dynamo / ahead "
              f"{row['dynamo / ahead of time']:.2f}x); with bfloat16 weights {row[f'{BF16}_ms']:.3f} ms "
              f"({row['exact / bfloat16 weights']:.2f}x)")
    print(f"packages built in {build_s:.0f} s, loaded in {load_s:.2f} s; a package reads the live weights: "
          f"{live_weights}; the bfloat16 copies follow an in-place change: {live_copies}")
    write_results(args, "bench/aot_graphs.py", rows, context=CONTEXT, build_s=build_s, load_s=load_s,
                  live_weights=live_weights, amx=amx_available(), live_bf16_copies=live_copies)


def write_results(args: argparse.Namespace, script: str, rows: list[dict], **meta) -> None:
    """`{"meta", "rows"}` as JSON at args.out: the machine, torch, one thread, `meta`, and the command that made it
    (this bench's or bench/own_operators.py's)."""
    meta = {"model": args.model, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": 1, **meta, "command": f"OMP_NUM_THREADS=1 python {script} " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
