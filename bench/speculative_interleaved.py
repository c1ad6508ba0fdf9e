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

With `--switch NAME` (one of the C++ layers' runtime switches, as bench/checkouts_ab.py --switch takes them), every
round runs twice, with the switch off and on (the order alternating from round to round), and the report has each
state's rounds and medians and the median of the rounds' ratio of the two states' ratios to AR: what a change to the
layers does to speculation against AR, without the differences between processes of a two-checkout comparison.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speculative_interleaved.py --rounds 6 --switch attention_in_loops \
        --out docs/results/speculative-session49-attention-switch.json
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
from checkouts_ab import SWITCHES
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
    parser.add_argument("--switch", choices=SWITCHES, default=None,
                        help="run every round with this switch of the C++ layers off and on")
    add_arguments(parser, caps=7, rounds=8)
    args = parser.parse_args(argv)
    pipe = start(parser, args)
    set_switch = None
    if args.switch:
        set_switch = getattr(torch.ops.printpress_layers, f"set_{args.switch}", None)
        if set_switch is None:
            parser.error(f"--switch {args.switch}: the C++ layers are not loaded on this machine")
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

    def one_round(index: int) -> dict:
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
                raise SystemExit(f"speculative_interleaved: {different} wrote other tokens than greedy AR on prompt "
                                 f"{p}")
        ar_rate = tokens["ar"] / seconds["ar"]
        rates = {f"{name}, cap {cap}": tokens[(name, cap)] / seconds[(name, cap)] for name, cap in settings}
        return {"ar_tokens_per_s": ar_rate, **{key: rate / ar_rate for key, rate in rates.items()}}

    def medians_of(rounds: list[dict]) -> dict:
        return {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "ar_tokens_per_s"}

    report = {"model": args.model, "tables": {name: item for name, item in zip(tables, args.table or
                                                                                ["the model's own"])},
              "caps": args.caps, "prompts": args.prompts, "tokens": args.tokens, "threads": args.threads}
    if set_switch is None:
        rounds = []
        for index in range(args.rounds):
            rounds.append(one_round(index))
            print(index, {key: round(value, 3) for key, value in rounds[-1].items()}, flush=True)
        report.update(median_ratio=medians_of(rounds), rounds=rounds)
        print("median of the rounds' ratios to greedy AR:", {k: round(v, 3) for k, v in report["median_ratio"].items()})
    else:
        states: dict[str, list[dict]] = {"off": [], "on": []}
        for index in range(args.rounds):
            for state in ["off", "on"][:: -1 if index % 2 else 1]:
                set_switch(state == "on")
                states[state].append(one_round(index))
                print(index, args.switch, state, {key: round(value, 3) for key, value in states[state][-1].items()},
                      flush=True)
        set_switch(True)
        change = {key: statistics.median(on[key] / off[key] for off, on in zip(states["off"], states["on"]))
                  for key in states["on"][0]}
        report.update(switch=args.switch, rounds=states, median_ratio={state: medians_of(rounds)
                                                                       for state, rounds in states.items()},
                      median_ar_tokens_per_s={state: statistics.median(r["ar_tokens_per_s"] for r in rounds)
                                              for state, rounds in states.items()},
                      on_over_off=change)
        print("median of the rounds' ratios to greedy AR:", report["median_ratio"])
        print(f"{args.switch} on / off, medians of the rounds:", {key: round(v, 3) for key, v in change.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
