"""A research screen: diffusion canvases that start from the draft table's sampled chain instead of uniform noise.

Each new canvas of `mode="diffusion"` normally starts as uniform noise. Here its positions are first filled with
tokens drawn one after another from the model's draft table (`DraftTable.sample`: what the model wrote after the
longest known context in its sampled continuations of training text), so the first decoder pass sees a plausible
block, the adaptive stop can fire after a few passes, and the text is the denoiser's revision of that chain. The
engine is unchanged; this script swaps `RequestState.start_canvas` for the run and then calls `printpress bench`
with the arguments given, so the sides, prompts, judges and report are the bench's own.

The control that decides what the denoiser added: `--chain-out FILE` also writes the table's chain *alone* (64
tokens per prompt and seed, drawn the same way, no network pass) for the same prompts and seeds, judged by both of
the bench's judges. Where the chain alone is judged as well as the canvases that start from it, the quality is the
table's, not diffusion's.

    OMP_NUM_THREADS=1 python bench/table_canvas.py --chain-out docs/results/levers/table-canvas-chain.json -- \
        --heldout-prompts 24 --seeds 3 --max-new-tokens 64 --steps 8 4 --entropy-bounds 2 8 --no-heldout \
        --out docs/results/levers/table-canvas.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import printpress
import printpress.request as request_module
from printpress.cli import main as cli_main


def patch_canvases(table) -> None:
    start = request_module.RequestState.start_canvas

    def start_from_table(self, length: int, vocab_size: int, device: torch.device) -> None:
        start(self, length, vocab_size, device)  # the uniform draw first: the request's random stream as before
        if self.settings.mode == "diffusion":
            tokens, _ = table.sample(list(self.request.prompt_ids) + list(self.tokens), length, self.generator)
            if tokens:
                self.canvas[0, : len(tokens)] = torch.tensor(tokens, device=device)

    request_module.RequestState.start_canvas = start_from_table


def chain_alone(pipe, card: dict, tokens: int) -> dict:
    """The table's chain for each prompt and seed of the bench's card, judged by the AR twin and SmolLM2."""
    from printpress.eval.frontier import load_gguf_judge
    from printpress.eval.judge import nll_per_char

    twin = printpress.load("models/shakespeare-ar")
    gguf, _ = load_gguf_judge("auto")
    table = pipe.model.draft_table
    plan = sorted({(s["prompt"], s["seed"]) for s in card["samples"]})
    rows = []
    for prompt, seed in plan:
        generator = torch.Generator().manual_seed(seed)
        ids, out = pipe.encode_text(prompt), []
        while len(out) < tokens:
            drawn, _ = table.sample(ids + out, tokens - len(out), generator)
            if not drawn:
                break
            out += drawn
        text = pipe.decode(out)
        rows.append({"prompt": prompt, "seed": seed, "text": text, "twin": nll_per_char(twin, prompt, text),
                     "gguf": None if gguf is None else gguf.nll_per_char(prompt, text)})
    summary = {k: float(np.nanmean([r[k] for r in rows])) for k in ("twin", "gguf") if rows[0][k] is not None}
    return {"judged_nll_per_char": summary, "samples": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint", help="the diffusion model, with its table")
    parser.add_argument("--chain-out", default=None, help="also judge the table's chain alone; write it here")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `printpress bench` arguments")
    args = parser.parse_args()
    bench_args = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    pipe = printpress.load(args.model)
    if pipe.model.draft_table is None or pipe.model.draft_table.distributions is None:
        raise SystemExit(f"{args.model} has no draft table with sampled counts: `printpress draft-table {args.model}`")
    patch_canvases(pipe.model.draft_table)
    code = cli_main(["bench", "--diffusion", args.model, *bench_args])
    if code or args.chain_out is None:
        sys.exit(code)
    out = bench_args[bench_args.index("--out") + 1]
    card = json.loads(Path(out).read_text())
    tokens = card["settings"].get("max_new_tokens", 64)
    result = chain_alone(pipe, card, tokens)
    Path(args.chain_out).write_text(json.dumps({"command": "python bench/table_canvas.py " + " ".join(sys.argv[1:]),
                                                **result}, indent=2) + "\n")
    print(f"the table's chain alone, judged (nats/char): {result['judged_nll_per_char']}; wrote {args.chain_out}")


if __name__ == "__main__":
    main()
