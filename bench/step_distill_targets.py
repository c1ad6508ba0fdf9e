"""Why few-step self-distillation narrows the text (docs/benchmarks.md §7, L11): its targets, averaged over the
teacher's draws, against the one-step prediction they replace.

    OMP_NUM_THREADS=1 python bench/step_distill_targets.py --model models/shakespeare-joint \
        --out docs/results/levers/step-distill-targets.json

Held-out windows are noised at level t (each position replaced by a uniform token with probability t). As in
`objectives.two_step_targets`, the model predicts every canvas position once (p1), keeps the lowest-entropy
C - round(tC/2) positions of each canvas with a sample of p1 at `--temperature`, re-noises the rest and predicts
again (p2), self-conditioned on p1 (as the trainer's teacher does) and, for comparison, without it. At the noised
positions that were not kept, where the forward-KL target of L11 is p2, it reports over `--draws` draws:

- H(p1): the entropy of the one-step prediction (what the student predicts before the round);
- H(mean p2): the entropy of the draws' average target, the distribution a student matching the targets by forward
  KL converges to; a model whose conditionals were consistent would give mean p2 = p1;
- mean H(p2), and the KL(mean p2 || p1) (nats).

H(mean p2) below H(p1) is the narrowing a round trains in; the comparison with the second pass without
self-conditioning says how much of it the feedback of p1 causes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

import printpress
from printpress.data import eval_batches, prepare_data
from printpress.objectives import forward_block_diffusion, most_certain_samples


def entropy(log_p: torch.Tensor) -> torch.Tensor:
    return -(log_p.exp() * log_p).sum(-1)


def windows(pipe, sources: list[str], count: int, length: int) -> torch.Tensor:
    """The first `count` validation windows of `length` tokens a training run on `sources` evaluates
    (`data.eval_batches` on the held-out documents, as `printpress bench`'s held-out losses)."""
    with tempfile.TemporaryDirectory() as folder:
        splits = prepare_data(sources, pipe.tokenizer, folder)
        batch = next(eval_batches(splits.val.tokens, length, count, max_batches=1), None)
    if batch is None:
        sys.exit(f"step_distill_targets: the held-out documents hold fewer than {count} windows of {length} tokens")
    return batch


@torch.no_grad()
def target_entropies(model, clean: torch.Tensor, t: float, block: int, vocab: int, draws: int,
                     temperature: float) -> dict:
    """The module docstring's figures for `clean` (B, L) noised at level `t` (global torch RNG)."""
    noised = torch.rand(clean.shape) < t
    noisy = torch.where(noised, torch.randint(0, vocab, clean.shape), clean)
    _, first = forward_block_diffusion(model, clean, noisy, block)
    first = first.float()
    keep = torch.full((clean.shape[0], clean.shape[1] // block), float(block - round(t * block / 2)))
    log_p1 = torch.log_softmax(first, dim=-1)
    sums, entropies = {"self-conditioned": 0, "plain": 0}, {"self-conditioned": 0, "plain": 0}
    for _ in range(draws):
        kept, sampled = most_certain_samples(first, torch.rand(clean.shape), block, keep, temperature)
        second_input = torch.where(kept, sampled, torch.randint(0, vocab, clean.shape))
        for name, feedback in (("self-conditioned", first), ("plain", None)):
            _, second = forward_block_diffusion(model, clean, second_input, block, feedback)
            log_p2 = torch.log_softmax(second.float(), dim=-1)
            sums[name] = sums[name] + log_p2.exp()
            entropies[name] = entropies[name] + entropy(log_p2)
    where = noised & ~kept  # the kept set depends only on p1, so it is the same in every draw
    row = {"t": t, "positions": int(where.sum()), "H_p1": float(entropy(log_p1)[where].mean())}
    for name in sums:
        mean_p2 = sums[name] / draws
        log_mean = torch.log(mean_p2.clamp_min(1e-30))
        row[f"H_mean_p2_{name}"] = float(entropy(log_mean)[where].mean())
        row[f"mean_H_p2_{name}"] = float((entropies[name] / draws)[where].mean())
        row[f"KL_mean_p2_p1_{name}"] = float((mean_p2 * (log_mean - log_p1)).sum(-1)[where].mean())
    return row


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/shakespeare-joint")
    p.add_argument("--data", nargs="+", default=["shakespeare"])
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--noise", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    p.add_argument("--draws", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0, help="the teacher's draws (L11: 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    pipe = printpress.load(args.model)
    model, block = pipe.model, pipe.canvas_length
    vocab = pipe.config.text.vocab_size
    clean = windows(pipe, args.data, args.windows, 4 * block)
    rows = []
    for t in args.noise:
        row = target_entropies(model, clean, t, block, vocab, args.draws, args.temperature)
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "model": args.model,
                                              "temperature": args.temperature, "draws": args.draws,
                                              "windows": args.windows, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
