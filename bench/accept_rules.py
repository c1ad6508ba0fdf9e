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
  rest are re-noised. The last step keeps all, and the committed canvas is the last pass's argmax as always.

    OMP_NUM_THREADS=1 .venv/bin/python bench/accept_rules.py --rule stock -- bench --heldout-prompts 24 --seeds 3 \
        --max-new-tokens 64 --steps 8 --entropy-bounds 4 --setting steps=8,entropy_bound=4,temperature=1.05 \
        --setting steps=16,entropy_bound=1,temperature=1.05 --no-heldout \
        --out docs/results/levers/screens/spread-stock.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/accept_rules.py --rule spread --eps 0.3 -- bench ... \
        --out docs/results/levers/screens/spread-eps03.json

Not engine options: the screens (docs/benchmarks.md §7, "Decoding screens") found none better at matched diversity.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import printpress.canvas
import printpress.diffusion
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


def window_accept(lead: float, steps_of_rows: list[tuple[int, int]]):
    """The window rule; `steps_of_rows` holds (steps left, steps in all) of each row the current step decides, in
    the order `denoise_step` asks (filled by `track_steps`)."""

    def accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
        left, total = steps_of_rows.pop(0)
        done = total - left + 1  # this step's number, 1..total
        length = entropy.shape[-1]
        open_until = math.ceil(length * min(1.0, lead * done / total))
        blocked = torch.arange(length, device=entropy.device) >= open_until
        kept = entropy_bound_accept(entropy.masked_fill(blocked, float("inf")), bound)
        return kept & ~blocked

    return accept


def track_steps(steps_of_rows: list[tuple[int, int]]):
    """A wrapper of the diffusion loop's step that notes each row's step before the acceptance rule runs."""
    original = printpress.diffusion.denoise_step

    def step(logits, rows, *args, **kwargs):
        steps_of_rows[:] = [(row.step, row.settings.max_denoising_steps) for row in rows]
        return original(logits, rows, *args, **kwargs)

    return step


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
        steps_of_rows: list[tuple[int, int]] = []
        printpress.diffusion.denoise_step = track_steps(steps_of_rows)
        printpress.canvas.entropy_bound_accept = window_accept(args.lead, steps_of_rows)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return printpress_main(command)


if __name__ == "__main__":
    sys.exit(main())
