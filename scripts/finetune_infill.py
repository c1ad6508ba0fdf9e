"""Fine-tune the shipped joint model with an infilling noise pattern, or with the standard one as a control.

    OMP_NUM_THREADS=1 python scripts/finetune_infill.py --pattern infill --steps 200 --out RUN/infill
    OMP_NUM_THREADS=1 python scripts/finetune_infill.py --pattern standard --steps 200 --out RUN/standard

An experiment for docs/decisions/0005-infilling.md, not a shipping recipe. Inference clamps the suffix into
the end of the canvas: positions [0, L) noisy, [L, C) clean, a contiguous pattern the block-diffusion
objective never draws (it noises each position independently). With `--pattern infill`, a fraction of the
canvases of each batch are noised that way (L uniform in 1..C-1, the free part noised at the block's rate
t), the rest as usual; the loss, the AR term and self-conditioning are the joint objective's unchanged
(printpress.train.objectives.TrainStep, given the noise). `--pattern standard` trains the same steps on the
same batches with the usual noise, so extra training and the pattern can be told apart. Constant learning
rate after a short warmup (the end of the original schedule, 2e-4); fresh AdamW.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from printpress.checkpoint import load_model, save_model
from printpress.train.data import BatchSampler, open_token_file
from printpress.train.objectives import DiffusionSettings, TrainStep, add_uniform_noise

ROOT = Path(__file__).resolve().parents[1]


def infill_noise(tokens: torch.Tensor, block: int, vocab: int, fraction: float, generator: torch.Generator):
    """Standard block noise, then for a `fraction` of the blocks everything from a random cut on is left clean."""
    noisy, t = add_uniform_noise(tokens, block, vocab, generator)
    batch, length = tokens.shape
    blocks = length // block
    chosen = torch.rand(batch, blocks, generator=generator) < fraction
    cut = torch.randint(1, block, (batch, blocks), generator=generator)
    position = torch.arange(block).repeat(blocks)[None]  # position inside its block
    clean = chosen.repeat_interleave(block, dim=1) & (position >= cut.repeat_interleave(block, dim=1))
    return torch.where(clean, tokens, noisy), t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--data", default="/work/runs/joint/data/train.bin")
    parser.add_argument("--pattern", choices=("infill", "standard"), required=True)
    parser.add_argument("--fraction", type=float, default=0.5, help="share of canvases with a clean tail (infill)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, config, generation, tokenizer = load_model(args.init, dtype=torch.float32)
    model.train()
    block, vocab = config.canvas_length, config.text.vocab_size
    step_module = TrainStep(model, "joint", DiffusionSettings(block=block, self_conditioning=0.5))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    sampler = BatchSampler(open_token_file(args.data).tokens, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "metrics.jsonl").open("w")
    started = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20)
        tokens = sampler.batch(step)
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # seeded per step
        if args.pattern == "infill":
            noisy, t = infill_noise(tokens, block, vocab, args.fraction, generator)
        else:
            noisy, t = add_uniform_noise(tokens, block, vocab, generator)
        use = torch.rand(tokens.shape[0], generator=generator) < 0.5
        optimizer.zero_grad(set_to_none=True)
        losses = step_module(tokens, (noisy, t, use))
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        record = {"step": step + 1, **{k: float(v.detach()) for k, v in losses.items()},
                  "seconds": time.perf_counter() - started}
        log.write(json.dumps(record) + "\n")
        log.flush()
        if (step + 1) % 10 == 0:
            print(record, flush=True)
    model.eval()
    save_model(model, config, out / "model", generation, tokenizer)
    (out / "run.json").write_text(json.dumps(vars(args), indent=2) + "\n")


if __name__ == "__main__":
    main()
