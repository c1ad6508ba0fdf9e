"""How far each side of a `printpress bench` report is judged behind AR sampling on the same weights, with an interval.

    python bench/judged_gap.py docs/results/levers/shipped-s19200.json [--judge gguf] [--match canvas_start]

Issue 11's quality target is relative: a diffusion side's judged NLL per character within 10% of AR sampling's on
the same weights. One run's 72 samples leave that ratio uncertain by a few percent, which matters once a side sits
near the line. Per side: the gap and its 90% interval (`printpress.eval.frontier.judged_gap`, which the bench now
also writes into each row as `judge_<judge>_gap` and `judge_<judge>_gap_90`); recomputed here from the per-sample
figures, so reports written before the bench recorded the gap read the same.
"""

from __future__ import annotations

import argparse
import json

from printpress.eval.bench_sides import OWN_AR
from printpress.eval.frontier import judged_gap


def gaps(report: dict, judge: str, match: str = "") -> list[tuple[str, float, float, float, float]]:
    """(side, judged NLL/char, gap, low, high) per side whose label contains `match`, AR sampling itself left out."""
    rows = {row["label"]: row for row in report["rows"]}
    key = f"judge_{judge}_per_sample"
    if OWN_AR not in rows or key not in rows[OWN_AR]:
        raise SystemExit(f"the report has no '{OWN_AR}' side judged by {judge}")
    out = []
    for label, row in rows.items():
        if label != OWN_AR and match in label and key in row:
            found = judged_gap(row[key], rows[OWN_AR][key])
            if found is not None:
                out.append((label, row[f"judge_{judge}_nll_per_char"], *found))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="`printpress bench --out` JSON files")
    parser.add_argument("--judge", default="gguf", help="gguf (SmolLM2, the issue's judge) or ar_twin")
    parser.add_argument("--match", default="", help="only sides whose label contains this")
    args = parser.parse_args()
    for path in args.reports:
        with open(path) as handle:
            report = json.load(handle)
        print(path)
        for label, nll, gap, low, high in gaps(report, args.judge, args.match):
            print(f"  {label}: {nll:.3f}, {100 * gap:.1f}% behind (90%: {100 * low:.1f} to {100 * high:.1f})")


if __name__ == "__main__":
    main()
