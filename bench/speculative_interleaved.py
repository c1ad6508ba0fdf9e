"""Table-drafted speculative decoding against greedy AR, interleaved finely enough to see through a shared machine.

bench/speculative.py times one setting after another; on a machine whose speed drifts by a third within minutes (the
AMD EPYC of session 38: greedy AR at 500-740 tokens/s in one run) a setting's ratio then depends on when it ran.
Here every held-out prompt is decoded by greedy AR and by each setting (a draft table and a draft cap) back to back,
the order alternating from prompt to prompt and round to round, and each round gives each setting its ratio to AR
over the round's prompts; the report is the median of the rounds' ratios, with every round's. Greedy speculative
output must equal AR's (the script stops otherwise).

    OMP_NUM_THREADS=1 .venv/bin/python bench/speculative_interleaved.py --rounds 8 \\
        --table old=/tmp/old-table.safetensors --table shipped=models/shakespeare-joint/draft_table.safetensors \\
        --caps 7 9 --out docs/results/speculative-interleaved-session38.json

(`git show a768753:models/shakespeare-joint/draft_table.safetensors > /tmp/old-table.safetensors`: the table shipped
before session 38.) Without `--table`, the model's own table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import printpress
from printpress.draft_table import DraftTable
from printpress.eval.bench import heldout_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import run_ar, run_speculative


def add_arguments(parser: argparse.ArgumentParser, caps: int, rounds: int) -> None:
    """The arguments of an interleaved comparison over held-out prompts (this script's and bench/sampled_drafts.py's)."""
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--caps", type=int, nargs="+", default=[caps], help="draft caps (drafts per verification)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts (as `printpress bench` draws them)")
    parser.add_argument("--heldout-data", default="shakespeare")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)


def start(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """`add_arguments`' checks, then the model (one thread unless --threads says otherwise, no gradients)."""
    if any(cap < 1 for cap in args.caps):
        parser.error(f"--caps: at least one draft per verification, got {args.caps}")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    return printpress.load(args.model)


def prompts_of(pipe, args: argparse.Namespace) -> list[list[int]]:
    """The held-out prompts `printpress bench --heldout-prompts` draws, encoded."""
    return [pipe.encode_text(text) for text in heldout_prompts(args.prompts, [args.heldout_data], 0.05)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="append", default=[], metavar="NAME=PATH",
                        help="a draft table to draft from (repeatable; default: the model's own, as 'model')")
    add_arguments(parser, caps=7, rounds=8)
    args = parser.parse_args(argv)
    pipe = start(parser, args)
    tables = {}
    for item in args.table:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--table: NAME=PATH, got {item!r}")
        tables[name] = DraftTable.load(path)
    if not tables:
        if pipe.model.draft_table is None:
            parser.error(f"{args.model} has no draft table: give one with --table NAME=PATH")
        tables["model"] = pipe.model.draft_table
    prompts = prompts_of(pipe, args)
    settings = [(name, cap) for name in tables for cap in args.caps]
    for prompt in prompts[:4]:  # warm-up: first calls pay one-off costs (the half-width copies among them)
        run_ar(pipe, prompt, 8)
        run_speculative(pipe, prompt, 8, 1, args.caps[0], 32, source="table")

    rounds = []
    for index in range(args.rounds):
        seconds, tokens = {"ar": 0.0}, {"ar": 0}
        for p, prompt in enumerate(prompts):
            written = {}
            for side in ["ar", *settings][:: -1 if (index + p) % 2 else 1]:
                if side == "ar":
                    ids, elapsed = run_ar(pipe, prompt, args.tokens)
                else:
                    pipe.model.draft_table = tables[side[0]]
                    result, elapsed = run_speculative(pipe, prompt, args.tokens, 1, side[1], 32, source="table")
                    ids = result.token_ids
                written[side] = list(ids)
                seconds[side] = seconds.get(side, 0.0) + elapsed
                tokens[side] = tokens.get(side, 0) + len(ids)
            different = [side for side in settings if written[side] != written["ar"]]
            if different:
                raise SystemExit(f"speculative_interleaved: {different} wrote other tokens than greedy AR on prompt {p}")
        ar_rate = tokens["ar"] / seconds["ar"]
        rounds.append({"ar_tokens_per_s": ar_rate,
                       **{f"{name}, cap {cap}": tokens[(name, cap)] / seconds[(name, cap)] / ar_rate
                          for name, cap in settings}})
        print(index, {key: round(value, 3) for key, value in rounds[-1].items()}, flush=True)
    medians = {f"{name}, cap {cap}": statistics.median(r[f"{name}, cap {cap}"] for r in rounds)
               for name, cap in settings}
    print("median of the rounds' ratios to greedy AR:", {key: round(value, 3) for key, value in medians.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "tables": {name: item for name, item in zip(
        tables, args.table or ["the model's own"])}, "caps": args.caps, "prompts": args.prompts,
        "tokens": args.tokens, "threads": args.threads, "median_ratio": medians, "rounds": rounds}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
