"""Why the diffusion side writes worse text: the decoder's held-out loss by noise level and canvas position.

    OMP_NUM_THREADS=1 .venv/bin/python bench/pair_noise.py --out docs/results/pair_noise.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/pair_noise.py --model models/stdlib-code --data stdlib \
        --out docs/results/code/pair_noise-round6.json

On the validation windows a training run evaluates (`printpress.data.eval_batches` over the 5% of the `--data`
corpus held out, cut as `Trainer` cuts them), the joint model's decoder predicts every canvas position from the clean
context before the canvas and a canvas corrupted with uniform noise at a fixed level t (no self-conditioning: the first
denoising step). Per t it reports the cross-entropy at corrupted and at kept positions, the argmax accuracy at
corrupted positions, and at t = 1 (the first step of generation: a canvas of pure noise) the loss at each of the 32
canvas positions, next to the encoder's AR NLL per token and a unigram model's cross-entropy on the same windows.
The forward is the training objective's own (`forward_block_diffusion`); the noise is `add_uniform_noise` with t
given. Then the left-to-right row (`left_to_right_ce`): each canvas clean before position k and noise from k on, the
state of a sampler that commits from the left, scored at k against the encoder on the same token, plain and
self-conditioned. Writes the JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


@torch.no_grad()
def main() -> None:
    from printpress.checkpoint import load_model
    from printpress.corpora import cache_dir
    from printpress.data import eval_batches, prepare_data
    from printpress.eval.bench import heldout_cache
    from printpress.objectives import add_uniform_noise, forward_block_diffusion

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--data", default="shakespeare", help="the corpus whose held-out windows are scored")
    parser.add_argument("--batches", type=int, default=4, help="validation batches of 16 x 128 tokens")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "pair_noise.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    started, load = time.perf_counter(), os.getloadavg()

    # The windows a training run on --data (val_fraction 0.05, seq_len 128, batch size 16) evaluates; the token
    # files are cached where `printpress bench` keeps its held-out data for this corpus and tokenizer.
    model, config, _, tokenizer = load_model(args.model)
    splits = prepare_data([args.data], tokenizer, heldout_cache(cache_dir() / "bench-heldout", [args.data], tokenizer),
                          val_fraction=0.05)
    windows = list(eval_batches(splits.val.tokens, 128, 16, max_batches=args.batches))
    model, block, vocab = model.eval(), config.canvas_length, config.text.vocab_size
    gen = torch.Generator().manual_seed(0)

    levels, ar_nll, per_position = [], [], None
    for t in LEVELS:
        sums = {"corrupted_ce": 0.0, "kept_ce": 0.0, "corrupted_correct": 0.0, "corrupted": 0, "kept": 0}
        position_ce = torch.zeros(block)
        for tokens in windows:
            level = torch.full((tokens.shape[0], tokens.shape[1] // block), t)
            noisy, _ = add_uniform_noise(tokens, block, vocab, gen, t=level)
            ar_logits, logits = forward_block_diffusion(model, tokens, noisy, block)
            ce = F.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1), reduction="none").view(tokens.shape)
            corrupted = noisy != tokens
            sums["corrupted_ce"] += ce[corrupted].sum().item()
            sums["kept_ce"] += ce[~corrupted].sum().item()
            sums["corrupted_correct"] += (logits.argmax(-1) == tokens)[corrupted].sum().item()
            sums["corrupted"] += int(corrupted.sum())
            sums["kept"] += int((~corrupted).sum())
            position_ce += ce.view(tokens.shape[0], -1, block).mean(dim=(0, 1)) / len(windows)
            if t == LEVELS[0]:
                ar = F.cross_entropy(ar_logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
                ar_nll.append(ar.item())
        row = {"t": t, "corrupted_fraction": sums["corrupted"] / (sums["corrupted"] + sums["kept"]),
               "corrupted_ce": sums["corrupted_ce"] / max(1, sums["corrupted"]),
               "kept_ce": sums["kept_ce"] / sums["kept"] if sums["kept"] else None,
               "corrupted_argmax_accuracy": sums["corrupted_correct"] / max(1, sums["corrupted"]),
               "ce_by_position": position_ce.tolist()}
        levels.append(row)
        kept = "-" if row["kept_ce"] is None else f"{row['kept_ce']:.3f}"
        print(f"t={t:4.2f}: corrupted CE {row['corrupted_ce']:.3f} "
              f"(argmax right {row['corrupted_argmax_accuracy']:.3f}),"
              f" kept CE {kept}", flush=True)
        if t == 1.0:
            per_position = row["ce_by_position"]
    left_to_right = left_to_right_ce(model, windows, block, vocab, gen)
    print(f"left to right: decoder CE at the first noised position {left_to_right['decoder']:.3f} "
          f"(self-conditioned {left_to_right['decoder_self_conditioned']:.3f}), encoder AR NLL there "
          f"{left_to_right['encoder']:.3f}", flush=True)
    # Reference level: a unigram model (train-split token counts, add-one) on the same windows.
    counts = torch.bincount(torch.as_tensor(splits.train.tokens[:].astype("int64")), minlength=vocab) + 1.0
    log_unigram = torch.log(counts / counts.sum())
    unigram = -torch.cat([log_unigram[w.reshape(-1)] for w in windows]).mean().item()
    result = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "model": args.model,
        "windows": sum(w.shape[0] for w in windows),
        "tokens": sum(w.numel() for w in windows),
        "canvas_length": block,
        "ar_nll_per_token": sum(ar_nll) / len(ar_nll),
        "unigram_ce_per_token": unigram,
        "levels": levels,
        "ce_by_position_at_t1": per_position,
        "left_to_right": left_to_right,
        "load_average_start": load,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"AR NLL per token {result['ar_nll_per_token']:.3f}, unigram {unigram:.3f}; wrote {out}")


def left_to_right_ce(model, windows: list, block: int, vocab: int, gen: torch.Generator) -> dict:
    """The decoder as a left-to-right writer: every canvas clean before position k and uniform noise from k on (the
    state a sampler that commits one token per step from the left is in), scored at position k only, against the
    encoder's AR NLL of the same token. Plain (a first step) and self-conditioned on a first pass over the same
    canvas (a later step's input). Per k and averaged over k."""
    from printpress.objectives import forward_block_diffusion

    sums = {name: torch.zeros(block) for name in ("decoder", "decoder_self_conditioned", "encoder")}
    for tokens in windows:
        at = torch.arange(tokens.shape[1]) % block  # each token's position in its canvas
        noise = torch.randint(0, vocab, tokens.shape, generator=gen)
        for k in range(block):
            noisy = torch.where(at >= k, noise, tokens)
            ar_logits, first = forward_block_diffusion(model, tokens, noisy, block)
            _, second = forward_block_diffusion(model, tokens, noisy, block, self_conditioning_logits=first)
            scored = (at == k).nonzero().squeeze(1)
            scored = scored[scored > 0]  # a window's first token has nothing before it to be predicted from
            target = tokens[:, scored]
            for name, logits in (("decoder", first), ("decoder_self_conditioned", second), ("encoder", ar_logits)):
                shift = 1 if name == "encoder" else 0  # the encoder's logits at i predict token i + 1
                score = F.cross_entropy(logits[:, scored - shift].transpose(1, 2), target)
                sums[name][k] += score.item() / len(windows)
    return {**{name: value.mean().item() for name, value in sums.items()},
            "by_position": {name: value.tolist() for name, value in sums.items()}}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ts = [r["t"] for r in result["levels"]]
    left.plot(ts, [r["corrupted_ce"] for r in result["levels"]], "o-", label="decoder CE at corrupted positions")
    left.plot([r["t"] for r in result["levels"] if r["kept_ce"] is not None],
              [r["kept_ce"] for r in result["levels"] if r["kept_ce"] is not None], "s--",
              label="decoder CE at kept positions")
    left.axhline(result["ar_nll_per_token"], color="tab:red", ls=":",
                 label=f"encoder AR NLL ({result['ar_nll_per_token']:.2f})")
    left.axhline(result["unigram_ce_per_token"], color="gray", ls="--", label="unigram model")
    left.set(xlabel="noise level t (fraction of the canvas replaced by uniform tokens)", ylabel="nats per token",
             title="held-out loss by noise level (no self-conditioning)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    pos = list(range(result["canvas_length"]))
    for r in result["levels"]:
        if r["t"] in (0.5, 1.0):
            right.plot(pos, r["ce_by_position"], "o-", ms=3, label=f"decoder CE, all positions, t = {r['t']}")
    right.axhline(result["ar_nll_per_token"], color="tab:red", ls=":", label="encoder AR NLL")
    right.axhline(result["unigram_ce_per_token"], color="gray", ls="--", label="unigram model")
    right.set(xlabel="position in the canvas (0 = right after the context)", ylabel="nats per token",
              title="decoder loss by canvas position")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(f"{Path(result['model']).name}: {result['windows']} held-out windows of 128 tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
