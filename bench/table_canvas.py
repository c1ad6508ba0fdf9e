"""The control of issue 11's L16 (`canvas_start="table"`): the draft table's chain alone, judged like the bench's sides.

With `canvas_start="table"` each diffusion canvas starts from tokens drawn one after another from the model's draft
table (`DraftTable.sample`) instead of uniform noise, and the denoiser revises them. What the denoiser added is the
difference from the chain itself: for every prompt and seed of a `printpress bench` card, this draws the table's
chain alone (as many tokens as the bench generated, no network pass) and judges it with the AR twin and, where it is
installed, SmolLM2. Where the chain alone is judged as well as the canvases that start from it, the quality is the
table's, not diffusion's.

    OMP_NUM_THREADS=1 printpress bench --heldout-prompts 24 --seeds 3 --max-new-tokens 64 --steps 8 4 \
        --entropy-bounds 2 8 --setting steps=8,entropy_bound=2,canvas_start=table \
        --setting steps=4,entropy_bound=8,canvas_start=table --no-heldout --out docs/results/levers/table-canvas.json
    OMP_NUM_THREADS=1 python bench/table_canvas.py --card docs/results/levers/table-canvas.json \
        --out docs/results/levers/table-canvas-chain.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import printpress
from printpress.eval.frontier import load_gguf_judge
from printpress.eval.judge import nll_per_char


def chain(pipe, prompt: str, seed: int, tokens: int) -> str:
    """The table's chain after `prompt`: `tokens` tokens drawn from its counts, fewer where it knows no context."""
    drawn, _ = pipe.model.draft_table.sample(pipe.encode_text(prompt), tokens, torch.Generator().manual_seed(seed))
    return pipe.decode(drawn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", required=True, help="a `printpress bench --out` JSON: its prompts and seeds")
    parser.add_argument("--model", default="models/shakespeare-joint", help="the model whose table draws the chain")
    parser.add_argument("--ar", default="models/shakespeare-ar", help="the AR twin judge (the bench's default)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = printpress.load(args.model)
    table = pipe.model.draft_table
    if table is None or table.distributions is None:
        raise SystemExit(f"{args.model} has no draft table with sampled counts: `printpress draft-table {args.model}`")
    card = json.loads(Path(args.card).read_text())
    twin, (gguf, _) = printpress.load(args.ar), load_gguf_judge("auto")
    rows = []
    for prompt, seed in sorted({(s["prompt"], s["seed"]) for s in card["samples"]}):
        text = chain(pipe, prompt, seed, card["settings"]["max_new_tokens"])
        rows.append({"prompt": prompt, "seed": seed, "text": text, "ar_twin": nll_per_char(twin, prompt, text),
                     "gguf": None if gguf is None else gguf.nll_per_char(prompt, text)})
    judged = {k: float(np.nanmean([r[k] for r in rows])) for k in ("ar_twin", "gguf") if rows[0][k] is not None}
    command = "python bench/table_canvas.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command, "judged_nll_per_char": judged, "samples": rows},
                                         indent=2) + "\n")
    print(f"the table's chain alone, judged (nats/char): {judged}; wrote {args.out}")


if __name__ == "__main__":
    main()
