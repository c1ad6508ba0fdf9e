"""Speculative sampling with table drafts: the interpolated draft distribution against the longest context's alone.

A sampling request's table drafts are drawn from a distribution q and kept with probability min(1, p/q), so the
closer q is to AR's own distribution p, the more drafts a verification keeps. The engine draws them from
`DraftTable.interpolated` (every context length's counts that know the text's end, interpolated by absolute
discounting, with a share for the text's own earlier continuation); before, it drew them from the longest known
context's counts alone (`DraftTable.sample`, which the diffusion side's table-started canvases still use). Here every held-out prompt is decoded, for each seed, by AR
sampling and by speculative sampling under each rule and draft cap, back to back, the order alternating from prompt
to prompt and round to round (bench/speculative_interleaved.py's way of seeing through a shared machine); each
round gives every setting its speed against AR sampling over the round's prompts and its tokens per verification
(the same in every round: the draws are seeded). The report is the median of the rounds' ratios.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sampled_drafts.py --rounds 5 --caps 3 5 \\
        --out docs/results/sampled_drafts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from printpress.draft_table import DraftTable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import run_ar, run_speculative
from speculative_interleaved import add_arguments, prompts_of, start

RULES = ("interpolated", "longest")


def longest_rule(table: DraftTable):
    """`sample_interpolated`'s signature over the rule before it: each draft drawn from the longest known context's
    counts (`DraftTable.sample`), q that distribution on its tokens and zero elsewhere."""
    def sample(tokens, m, generator, vocab, context=None):  # the text's own continuation did not enter then
        drafted, used = table.sample(tokens, m, generator)
        q = np.zeros((len(drafted), vocab), np.float32)
        for row, (next_tokens, probs) in enumerate(used):
            q[row, next_tokens] = probs
        return drafted, q
    return sample


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, caps=3, rounds=5)
    parser.add_argument("--seeds", type=int, default=2, help="samples per prompt and setting")
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        parser.error(f"--temperature: sampling needs a temperature above 0, got {args.temperature}")
    pipe = start(parser, args)
    table = pipe.model.draft_table
    if table is None or table.counts is None:
        parser.error(f"{args.model} has no draft table with sampled counts: make one with `printpress draft-table`")
    interpolated = table.sample_interpolated
    rules = {"interpolated": interpolated, "longest": longest_rule(table)}
    prompts = prompts_of(pipe, args)
    settings = [(rule, cap) for rule in RULES for cap in args.caps]
    names = {setting: f"{setting[0]}, cap {setting[1]}" for setting in settings}
    for prompt in prompts[:4]:  # warm-up: first calls pay one-off costs
        run_ar(pipe, prompt, 8, temperature=args.temperature)
        run_speculative(pipe, prompt, 8, 1, args.caps[0], 32, source="table", temperature=args.temperature)

    rounds, per_verification = [], {}
    try:
        for index in range(args.rounds):
            seconds, tokens, verifications, verified = {"ar": 0.0}, {"ar": 0}, {}, {}
            for p, prompt in enumerate(prompts):
                for seed in range(args.seeds):
                    for side in ["ar", *settings][:: -1 if (index + p + seed) % 2 else 1]:
                        if side == "ar":
                            ids, elapsed = run_ar(pipe, prompt, args.tokens, temperature=args.temperature, seed=seed)
                            written = len(ids)
                        else:
                            table.sample_interpolated = rules[side[0]]
                            result, elapsed = run_speculative(pipe, prompt, args.tokens, 1, side[1], 32,
                                                              source="table", temperature=args.temperature, seed=seed)
                            written = len(result.token_ids)
                            # every token after the prompt pass's first was committed by a verification
                            verifications[side] = verifications.get(side, 0) + result.stats.verifications
                            verified[side] = verified.get(side, 0) + written - 1
                        seconds[side] = seconds.get(side, 0.0) + elapsed
                        tokens[side] = tokens.get(side, 0) + written
            ar_rate = tokens["ar"] / seconds["ar"]
            rounds.append({"ar_tokens_per_s": ar_rate,
                           **{names[s]: tokens[s] / seconds[s] / ar_rate for s in settings}})
            per_verification = {names[s]: verified[s] / verifications[s] for s in settings}  # alike each round
            print(index, {key: round(value, 3) for key, value in rounds[-1].items()}, flush=True)
    finally:
        table.sample_interpolated = interpolated
    medians = {names[s]: statistics.median(r[names[s]] for r in rounds) for s in settings}
    print("median of the rounds' ratios to AR sampling:", {k: round(v, 3) for k, v in medians.items()})
    print("tokens per verification:", {k: round(v, 3) for k, v in per_verification.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python bench/sampled_drafts.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model, "caps": args.caps, "prompts": args.prompts, "seeds": args.seeds, "tokens": args.tokens,
        "temperature": args.temperature, "threads": args.threads, "median_ratio_to_ar_sampling": medians,
        "tokens_per_verification": per_verification, "rounds": rounds}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
