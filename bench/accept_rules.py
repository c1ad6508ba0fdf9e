"""Screens of decoding levers (issue 11): other rules for which positions a diffusion step keeps.

`printpress bench` runs with the engine's entropy-bound rule swapped for another in every diffusion side; nothing
else changes (model, settings, prompts, seeds), so compare two runs of the same arguments (`--rule stock` is the
engine's own rule). The rules:

- `spread`: tokens kept in one step are sampled independently, and neighbours are where text depends most (after
  the dilated schedules of masked diffusion). Walk the positions in order of entropy, as the entropy bound does,
  but skip a position next to one already kept in this step unless its entropy is below `--eps` nats
  (near-certain tokens are kept together); the bound counts only the kept positions.
- `window`: left to right in coarse strides (after semi-autoregressive decoding of masked models): at step j of N
  only the first ceil(C * min(1, lead * j / N)) of the canvas's C positions may be kept, under the same bound; the
  rest are re-noised. The last step keeps all, and the committed canvas is the last pass's argmax as always. This
  one is now the engine's opt-in setting `window_lead` (`--setting steps=32,entropy_bound=1,window_lead=1.5` gives
  the same tokens); `--rule window --lead L` sets it on every diffusion side that does not set it itself, so the
  screens' commands still run as written.

    OMP_NUM_THREADS=1 .venv/bin/python bench/accept_rules.py --rule stock -- bench --heldout-prompts 24 --seeds 3 \
        --max-new-tokens 64 --steps 8 --entropy-bounds 4 --setting steps=8,entropy_bound=4,temperature=1.05 \
        --setting steps=16,entropy_bound=1,temperature=1.05 --no-heldout \
        --out docs/results/levers/screens/spread-stock.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/accept_rules.py --rule spread --eps 0.3 -- bench ... \
        --out docs/results/levers/screens/spread-eps03.json

The spread rule is not an engine option: the screens (docs/benchmarks.md §7, "Decoding screens") found it no better
at matched diversity. The window helped the code model at its 32-step default, and became `window_lead`.
"""

from __future__ import annotations

import argparse
import sys

import torch

import printpress.canvas
from printpress.cli import main as printpress_main
from printpress.sampling import entropy_bound_accept


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


def window_everywhere(lead: float):
    """The engine's window (`printpress.sampling.window_open`) with `lead` for every row that has none of its own."""
    original = printpress.canvas.window_open

    def opened(free: int, row_lead: float, step: int, steps: int) -> int:
        return original(free, row_lead or lead, step, steps)

    return opened


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rule", choices=("stock", "spread", "window"), required=True)
    p.add_argument("--eps", type=float, default=0.3,
                   help="spread: entropy (nats) below which neighbours are kept together")
    p.add_argument("--lead", type=float, default=1.0, help="window: how fast the window opens (1: the whole canvas "
                                                          "at the last step)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then printpress arguments (bench ...)")
    args = p.parse_args()
    if args.rule == "spread":
        printpress.canvas.entropy_bound_accept = spread_accept(args.eps)
    elif args.rule == "window":
        printpress.canvas.window_open = window_everywhere(args.lead)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return printpress_main(command)


if __name__ == "__main__":
    sys.exit(main())
