"""Would a sliding canvas write better? The same held-out target tokens, after the same text, scored in two decoder
states (docs/benchmarks.md §8, "A sliding canvas"):

- **aligned** (today's sampler, committing from the left): the canvas where training puts it, clean inside it before
  the target and uniform noise from the target on, so the decoder must tell the clean tokens from the noise itself;
- **sliding**: the text before the target encoded as context (the encoder's cache, which the decoder trusts) and the
  canvas starting at the target, all noise, as if each step moved what it committed into the cache;

each plain (a first step) and self-conditioned on a first pass over the same canvas, beside the encoder's AR NLL of
the same tokens. Targets: canvas positions k = 0..31 of the second and third canvas of each 128-token validation
window. The sliding state is the window slid k tokens left (one training-shaped pass), so it sees the 32 or 64 tokens
before the target and the aligned state k more: the comparison, if anything, favours today's sampler.

    OMP_NUM_THREADS=1 python bench/sliding_canvas.py --model models/stdlib-code --data stdlib \\
        --out docs/results/code/sliding_canvas.json
    OMP_NUM_THREADS=1 python bench/sliding_canvas.py --out docs/results/levers/sliding_canvas.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def sliding_and_aligned_ce(model, windows: list, block: int, vocab: int, gen: torch.Generator) -> dict[str, float]:
    """Mean CE (nats/token) of the decoder in both states and of the encoder, over the same targets."""
    from printpress.objectives import forward_block_diffusion

    sums = dict.fromkeys(("aligned", "aligned_self_conditioned", "sliding", "sliding_self_conditioned", "encoder"), 0.0)
    count = 0
    for tokens in windows:
        at = torch.arange(tokens.shape[1]) % block
        noise = torch.randint(0, vocab, tokens.shape, generator=gen)
        starts = torch.tensor([block, 2 * block])  # canvas starts in the sliding window: 1 and 2 canvases of context
        for k in range(block):
            targets = starts + k
            aligned = torch.where(at >= k, noise, tokens)
            ar, first = forward_block_diffusion(model, tokens, aligned, block)
            _, second = forward_block_diffusion(model, tokens, aligned, block, self_conditioning_logits=first)
            shifted = tokens[:, k : k + 3 * block]  # the window slid so that each target opens a canvas
            slid = torch.randint(0, vocab, shifted.shape, generator=gen)
            _, s_first = forward_block_diffusion(model, shifted, slid, block)
            _, s_second = forward_block_diffusion(model, shifted, slid, block, self_conditioning_logits=s_first)
            truth = tokens[:, targets]
            scored = (("aligned", first, targets), ("aligned_self_conditioned", second, targets),
                      ("sliding", s_first, starts), ("sliding_self_conditioned", s_second, starts),
                      ("encoder", ar, targets - 1))
            for name, logits, at_positions in scored:
                sums[name] += F.cross_entropy(logits[:, at_positions].transpose(1, 2), truth).item()
            count += 1
    return {name: total / count for name, total in sums.items()}


def main() -> None:
    from printpress.checkpoint import load_model
    from printpress.corpora import cache_dir
    from printpress.data import eval_batches, prepare_data
    from printpress.eval.bench import heldout_cache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--data", default="shakespeare", help="the corpus whose held-out windows are scored")
    parser.add_argument("--batches", type=int, default=4, help="validation batches of 16 x 128 tokens")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, config, _, tokenizer = load_model(args.model)
    if 128 < 4 * config.canvas_length:
        sys.exit(f"sliding_canvas.py: canvas {config.canvas_length} is too long for 128-token windows")
    splits = prepare_data([args.data], tokenizer, heldout_cache(cache_dir() / "bench-heldout", [args.data], tokenizer),
                          val_fraction=0.05)
    windows = list(eval_batches(splits.val.tokens, 128, 16, max_batches=args.batches))
    result = sliding_and_aligned_ce(model.eval(), windows, config.canvas_length, config.text.vocab_size,
                                    torch.Generator().manual_seed(0))
    print(" ".join(f"{name} {value:.3f}" for name, value in result.items()))
    Path(args.out).write_text(json.dumps({"command": " ".join([Path(sys.executable).name] + sys.argv),
                                          "model": args.model, "data": args.data, "windows": 16 * len(windows),
                                          "nats_per_token": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
