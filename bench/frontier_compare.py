"""Overlay the speed/quality points of several `printpress bench --yardstick` runs: the frontier before and after.

    python bench/frontier_compare.py docs/results/yardstick-baseline.json docs/results/levers/*.json \
        --out docs/results/levers/frontier.png

Each run is one colour; x is tokens/s as a ratio to the AR twin measured in the same run (absolute speeds move
with the machine's load, ratios do not), y the judged NLL per character (lower is better) under each judge.
Filled markers are diffusion settings of matched diversity (the yardstick's test), hollow ones are not; the
dashed line is the AR twin's quality, the dotted one AR sampling on each run's own weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

JUDGES = (("judge_gguf_nll_per_char", "SmolLM2-135M judge"), ("judge_ar_twin_nll_per_char", "AR twin judge"))


def points(report: dict, key: str) -> list[tuple[float, float, bool]]:
    """(speed ratio to the AR twin, judged NLL, matched diversity) of each diffusion side."""
    rows = {r["label"]: r for r in report["rows"]}
    twin = rows["AR twin"]["tokens_per_s"]
    return [(r["tokens_per_s"] / twin, r[key], bool(r.get("matched_diversity")))
            for r in report["rows"] if r["kind"] == "diffusion" and r.get(key) is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="yardstick JSON files (the first is drawn as the baseline)")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [(Path(p).stem, json.loads(Path(p).read_text())) for p in args.reports]
    fig, axes = plt.subplots(1, len(JUDGES), figsize=(6 * len(JUDGES), 4.5))
    for ax, (key, title) in zip(axes, JUDGES):
        for index, (name, report) in enumerate(reports):
            colour = f"C{index}"
            pts = points(report, key)
            for x, y, matched in pts:
                ax.scatter(x, y, color=colour, facecolors=colour if matched else "none", s=36)
            ax.plot(*zip(*sorted((x, y) for x, y, _ in pts)), color=colour, alpha=0.3)
            rows = {r["label"]: r for r in report["rows"]}
            own_ar = rows.get("diffusion model, AR decoding", {}).get(key)
            if own_ar is not None:
                ax.axhline(own_ar, color=colour, linestyle=":", linewidth=1)
            ax.scatter([], [], color=colour, label=name)
        twin = {r["label"]: r for r in reports[0][1]["rows"]}["AR twin"][key]
        ax.axhline(twin, color="black", linestyle="--", linewidth=1, label="AR twin")
        ax.axvline(1.0, color="grey", linewidth=0.5)
        ax.set_xlabel("tokens/s ÷ AR twin's (same run)")
        ax.set_ylabel("judged NLL per character (lower is better)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("Diffusion settings per run (filled: matched diversity)")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
