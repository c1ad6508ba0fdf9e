"""Streamed text: what turning each commit's tokens into a text delta costs per token, decoding the whole completion
at every commit (the way before session 41) against decoding from the last settled point (`RequestState.text_delta`).

The shipped model's tokenizer on the first tokens of README.md, committed one token at a time as AR decoding does;
both ways must give the same text, and the report is microseconds per token for each completion length.

    OMP_NUM_THREADS=1 .venv/bin/python bench/text_deltas.py --out docs/results/text_deltas.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import printpress
from printpress.request import REPLACEMENT, Request, RequestState
from printpress.sampling import SamplerSettings

ROOT = Path(__file__).resolve().parent.parent


def whole_each_time(state: RequestState, decode) -> str:
    """The delta as it was made before: the whole completion decoded at every commit."""
    full = decode(state.completion())
    ready = full if state.finished else full.rstrip(REPLACEMENT)
    delta, state.text = ready[len(state.text):], ready
    return delta


def per_token(ids: list[int], decode, delta) -> tuple[float, str]:
    """Microseconds per token of committing `ids` one at a time and taking `delta` after each; the text."""
    state = RequestState.start(0, Request([2], SamplerSettings(max_new_tokens=len(ids), eos_token_ids=()), seed=0),
                               torch.device("cpu"), budget=len(ids))
    pieces = []
    started = time.perf_counter()
    for token in ids:
        state.commit([token])
        pieces.append(delta(state, decode))
    return (time.perf_counter() - started) / len(ids) * 1e6, "".join(pieces)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--repeat", type=int, default=3, help="runs per length and way (the best is reported)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    pipe = printpress.load(args.model)
    ids = pipe.encode_text((ROOT / "README.md").read_text())
    if len(ids) < max(args.lengths):
        parser.error(f"README.md gives {len(ids)} tokens; the longest length asked is {max(args.lengths)}")
    rows = []
    for n in args.lengths:
        before = min(per_token(ids[:n], pipe.decode, whole_each_time) for _ in range(args.repeat))
        now = min(per_token(ids[:n], pipe.decode, RequestState.text_delta) for _ in range(args.repeat))
        if before[1] != now[1] or now[1] != pipe.decode(ids[:n]):
            raise SystemExit(f"the two ways gave different text at {n} tokens")
        rows.append({"tokens": n, "whole_each_time_us_per_token": round(before[0], 2),
                     "incremental_us_per_token": round(now[0], 2)})
        print(rows[-1])
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
