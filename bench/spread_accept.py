"""Screen of a decoding lever (issue 11): entropy-bound acceptance that keeps no two neighbours in one step.

Tokens sampled side by side in one step are drawn independently, and neighbours are where text depends most
(after the dilated schedules of masked diffusion). This rule walks the positions in order of entropy, as the
entropy bound does, but skips a position next to one already kept in this step unless its entropy is below
`--eps` nats (near-certain tokens are kept together). The bound counts only the kept positions. Nothing else
changes: same model, settings, prompts and seeds.

It runs `printpress bench` with the rule swapped in for every diffusion side (`--stock` runs the same command
with the engine's own rule), so compare two runs of the same arguments:

    OMP_NUM_THREADS=1 .venv/bin/python bench/spread_accept.py --stock -- bench --heldout-prompts 24 --seeds 3 \
        --max-new-tokens 64 --steps 8 --entropy-bounds 4 --setting steps=8,entropy_bound=4,temperature=1.05 \
        --setting steps=16,entropy_bound=1,temperature=1.05 --no-heldout --out docs/results/levers/screens/spread-stock.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/spread_accept.py --eps 0.3 -- bench ... --out .../spread-eps03.json

Not an engine option: the screen (docs/benchmarks.md §7, "Decoding screen: no neighbours in one step") found it
narrower, not better at matched diversity.
"""

from __future__ import annotations

import argparse
import sys

import torch

import printpress.canvas
from printpress.cli import main as printpress_main


def spread_accept(eps: float):
    def accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
        kept_mask = torch.zeros(entropy.shape, dtype=torch.bool)
        for row in range(entropy.shape[0]):
            h = entropy[row].tolist()
            total, kept = 0.0, []
            for n, i in enumerate(sorted(range(len(h)), key=h.__getitem__)):
                if n and total > bound:
                    break
                if h[i] >= eps and any(abs(i - k) == 1 for k in kept):
                    continue
                kept.append(i)
                total += h[i]
            kept_mask[row, kept] = True
        return kept_mask.to(entropy.device)

    return accept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eps", type=float, default=0.3, help="entropy (nats) below which neighbours are kept together")
    p.add_argument("--stock", action="store_true", help="keep the engine's entropy-bound rule (the control)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then printpress arguments (bench ...)")
    args = p.parse_args()
    if not args.stock:
        printpress.canvas.entropy_bound_accept = spread_accept(args.eps)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return printpress_main(command)


if __name__ == "__main__":
    sys.exit(main())
