"""Speed and quality of the shipped pair, side by side: diffusion settings against AR decoding.

    python bench/quality_sweep.py --out docs/results/quality_sweep.json

For each decoding setting, the same prompts and seeds: tokens/s, tokens per forward, and the quality
of the continuations, judged as NLL per character under the AR twin (models/shakespeare-ar). Settings:
AR on the joint model and on the twin (temperature 0.8, top-k 50), and the joint model's diffusion
sampler over a grid of denoising steps and entropy bounds. Writes JSON and a PNG frontier plot
(judged NLL against tokens per forward, the AR points marked). One thread, whatever else the machine
is doing is stated in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import printpress
from printpress.eval.judge import nll_per_char

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO:\n", "To be, or not to be", "KING HENRY:\nMy lords,", "Enter HAMLET and HORATIO.\n\nHAMLET:",
           "JULIET:\nO", "FIRST CITIZEN:\nWe are", "DUKE:\nWhat news", "Exeunt.\n\nSCENE II."]


def run_setting(pipe, judge, label: str, max_new_tokens: int, **settings) -> dict:
    nll, tpf, tokens, seconds = [], [], 0, 0.0
    for seed, prompt in enumerate(PROMPTS):
        start = time.perf_counter()
        result = pipe.generate(prompt, seed=seed, max_new_tokens=max_new_tokens, **settings)
        seconds += time.perf_counter() - start
        tokens += result.stats.new_tokens
        tpf.append(result.stats.tokens_per_forward)
        if result.text:
            nll.append(nll_per_char(judge, prompt, result.text))
    row = {"label": label, **{k: v for k, v in settings.items()}, "judge_nll_per_char": statistics.mean(nll),
           "tokens_per_forward": statistics.mean(tpf), "tokens_per_s": tokens / seconds, "new_tokens": tokens}
    print(f"{label:38s} nll/char {row['judge_nll_per_char']:.3f}  tokens/forward {row['tokens_per_forward']:.2f}"
          f"  tokens/s {row['tokens_per_s']:.0f}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--joint", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--ar", default=str(ROOT / "models" / "shakespeare-ar"))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "quality_sweep.json"))
    parser.add_argument("--note", default="", help="what else ran on the machine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    joint, twin = printpress.load(args.joint), printpress.load(args.ar)
    rows = [run_setting(twin, twin, "AR twin (T 0.8, top-k 50)", args.max_new_tokens, mode="ar", temperature=0.8, top_k=50),
            run_setting(joint, twin, "joint model, AR (T 0.8, top-k 50)", args.max_new_tokens, mode="ar", temperature=0.8,
                        top_k=50),
            run_setting(joint, twin, "joint model, AR greedy", args.max_new_tokens, mode="ar", temperature=0.0)]
    for steps in (32, 16, 8, 4):
        for bound in (0.1, 1.0, 4.0):
            rows.append(run_setting(joint, twin, f"diffusion, {steps} steps, bound {bound}", args.max_new_tokens,
                                    max_denoising_steps=steps, entropy_bound=bound))
    for t_max, t_min in ((0.4, 0.1), (1.0, 0.6)):
        rows.append(run_setting(joint, twin, f"diffusion, 32 steps, t {t_max}->{t_min}", args.max_new_tokens,
                                max_denoising_steps=32, t_max=t_max, t_min=t_min))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": 1, "prompts": PROMPTS, "max_new_tokens": args.max_new_tokens, "judge": Path(args.ar).name,
            "note": args.note}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        is_ar = row.get("mode") == "ar"
        ax.scatter(row["tokens_per_forward"], row["judge_nll_per_char"], marker="s" if is_ar else "o",
                   color="tab:red" if is_ar else "tab:blue")
        ax.annotate(row["label"].replace("diffusion, ", ""), (row["tokens_per_forward"], row["judge_nll_per_char"]),
                    fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward (log2)")
    ax.set_ylabel("judged NLL per character (AR twin; lower is better)")
    ax.set_title("Shipped pair: diffusion settings (blue) vs AR decoding (red)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
