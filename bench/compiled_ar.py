"""The opt-in compiled AR step end to end: tokens/s and quality against the exact path, on the shipped model.

One process, one thread, the same prompts and seeds for every side, interleaved prompt by prompt: exact AR decoding
(the default), the same weights with `printpress.fast.compile_ar_step`, and (`--plain`) the same step graph compiled
with torch.compile's default options and no compiled prompt block, as `compile_ar_step` did before it kept only
the guards on its inputs and called its kernels from C++; (`--bf16-weights`) the compiled step reading bfloat16
copies of the weights (`compile_ar_step(..., weights="bfloat16")`). Greedy (temperature 0): how many tokens
are identical; sampled (temperature 0.8, top-k 50, seeds 0..): the judged NLL per character of each continuation
under the AR twin (models/shakespeare-ar), lower is better. Tokens/s: generated tokens over wall time, prefill
included; the compiled side is warmed up (compiled) before timing. `--heldout-windows N`: each side's teacher-forced
NLL of N held-out Shakespeare windows (bench's held-out prompts), every token through an AR step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/compiled_ar.py --out docs/results/compiled_ar.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/compiled_ar.py --bf16-weights --heldout-windows 64 \
        --out docs/results/compiled_ar-bf16-weights.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
from pathlib import Path

import torch

import printpress
from printpress.eval.bench import heldout_prompts
from printpress.eval.judge import nll_per_char
from printpress.fast import ar_step_graph, compile_ar_step

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["ROMEO:\n", "JULIET:\nO ", "KING HENRY.\n", "To be, or not to be", "First Citizen:\n",
           "HAMLET.\nWhat ", "LADY MACBETH.\n", "Enter the King"]


def own_copy(function):
    """The function with a code object of its own: dynamo keeps its compiled entries per code object, so a second
    `torch.compile` of the same function with other options would share (and reuse) the first one's graphs."""
    return types.FunctionType(function.__code__.replace(co_name=function.__name__ + "_copy"), function.__globals__)


def decode(pipe, prompt: str, **settings) -> tuple[object, float]:
    start = time.perf_counter()
    result = pipe.generate(prompt, mode="ar", **settings)
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--plain", action="store_true", help="add the side compiled with torch.compile's defaults")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="add the compiled side whose AR step reads bfloat16 copies of the weights")
    parser.add_argument("--heldout-windows", type=int, default=0,
                        help="also score N held-out Shakespeare windows token by token through each side's AR steps "
                             "(teacher-forced NLL per token and per character)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    exact = printpress.load(ROOT / "models" / "shakespeare-joint")
    fast = printpress.load(ROOT / "models" / "shakespeare-joint")
    judge = printpress.load(ROOT / "models" / "shakespeare-ar")
    step = compile_ar_step(fast.model)
    sides = {"exact": exact, "compiled": fast}
    if args.plain:
        plain = printpress.load(ROOT / "models" / "shakespeare-joint")
        compile_ar_step(plain.model)._graph = torch.compile(own_copy(ar_step_graph), fullgraph=True)
        plain.model.compiled_encoder = None
        sides["compiled, default options"] = plain
    if args.bf16_weights:
        low = printpress.load(ROOT / "models" / "shakespeare-joint")
        compile_ar_step(low.model, weights="bfloat16")
        sides["compiled, bfloat16 weights"] = low
    for pipe in list(sides.values())[1:]:
        for prompt in PROMPTS:  # compile before timing: every prompt at the timed length (the prompt blocks meet a
            pipe.generate(prompt, mode="ar", temperature=0, max_new_tokens=args.max_new_tokens)  # few graph variants)
    load_start = os.getloadavg()[0]
    rows = {name: {"seconds": [], "tokens": 0, "greedy": [], "nll": []} for name in sides}
    for index, prompt in enumerate(PROMPTS):
        for name, pipe in (sides.items() if index % 2 == 0 else reversed(sides.items())):
            greedy, seconds = decode(pipe, prompt, temperature=0, max_new_tokens=args.max_new_tokens)
            sampled, more = decode(pipe, prompt, temperature=0.8, top_k=50, seed=index,
                                   max_new_tokens=args.max_new_tokens)
            rows[name]["seconds"].append(seconds + more)
            rows[name]["tokens"] += len(greedy.token_ids) + len(sampled.token_ids)
            rows[name]["greedy"].append(greedy.token_ids)
            rows[name]["nll"].append(nll_per_char(judge, prompt, sampled.text))
    same = sum(a == b for x, y in zip(rows["exact"]["greedy"], rows["compiled"]["greedy"]) for a, b in zip(x, y))
    total = sum(len(x) for x in rows["exact"]["greedy"])
    first_divergence = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                        for x, y in zip(rows["exact"]["greedy"], rows["compiled"]["greedy"])]
    report = {"max_new_tokens": args.max_new_tokens, "prompts": PROMPTS, "compile_failure": step.failure,
              "load_average": [load_start, os.getloadavg()[0]],
              "greedy_identical_tokens": same, "greedy_tokens": total, "greedy_first_divergence": first_divergence}
    for name, row in rows.items():
        report[name] = {"tokens_per_s": row["tokens"] / sum(row["seconds"]),
                        "judged_nll_per_char_sampled": statistics.mean(row["nll"])}
        print(f"{name:26s} {report[name]['tokens_per_s']:7.1f} tokens/s  sampled NLL/char under the AR twin "
              f"{report[name]['judged_nll_per_char_sampled']:.3f}")
    print(f"greedy: {same}/{total} tokens identical; first divergence per prompt {first_divergence}")
    for name in list(sides)[2:]:
        report[name]["greedy_identical_tokens"] = sum(
            a == b for x, y in zip(rows["exact"]["greedy"], rows[name]["greedy"]) for a, b in zip(x, y))
    if args.heldout_windows:
        windows = heldout_prompts(args.heldout_windows, ["shakespeare"], 0.05)
        for name, pipe in sides.items():
            report[name]["heldout"] = teacher_forced(pipe, windows)
            print(f"{name}: held-out NLL {report[name]['heldout']['nll_per_token']:.4f} nats/token, "
                  f"{report[name]['heldout']['nll_per_char']:.4f} nats/char ({args.heldout_windows} windows)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def teacher_forced(pipe, windows: list[str]) -> dict:
    """NLL of each window's tokens after <bos>, every token through one AR step (`encode` of one token), summed."""
    model, total, tokens, chars = pipe.model, 0.0, 0, 0
    with torch.no_grad():
        for text in windows:
            ids = torch.tensor([pipe.encode_text(text)])
            cache = model.new_cache(1, ids.shape[1])
            for i in range(ids.shape[1] - 1):
                logits = model.encode(ids[:, i:i + 1], cache, logits="last")
                total -= torch.log_softmax(logits[0, -1].double(), dim=-1)[ids[0, i + 1]].item()
            tokens, chars = tokens + ids.shape[1] - 1, chars + len(text)
    return {"nll_per_token": total / tokens, "nll_per_char": total / chars, "tokens": tokens}


if __name__ == "__main__":
    main()
