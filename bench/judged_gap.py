"""How far each side of a `printpress bench` report is judged behind AR sampling on the same weights, with an interval.

    python bench/judged_gap.py docs/results/levers/shipped-s19200.json [--judge gguf] [--match canvas_start]

Issue 11's quality target is relative: a diffusion side's judged NLL per character within 10% of AR sampling's on
the same weights. One run's 72 samples leave that ratio uncertain by a few percent, which matters once a side sits
near the line. Per side: the gap (the ratio of mean per-sample NLL/char to AR sampling's, minus 1) and its 90%
interval from resampling the samples of both sides (4000 draws, a fixed seed, so the figures repeat exactly). The
bench's own pooled figure (per character over all samples) differs from the per-sample mean by well under 1%.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from printpress.eval.bench_sides import OWN_AR

DRAWS = 4000


def finite(values: list) -> np.ndarray:
    """A side's per-sample figures without the empty samples' (judged nan or None: no text to judge)."""
    array = np.asarray([np.nan if v is None else v for v in values], dtype=float)
    return array[np.isfinite(array)]


def gaps(report: dict, judge: str, match: str = "") -> list[dict]:
    """One entry per side whose label contains `match`, other than AR sampling itself."""
    rows = {row["label"]: row for row in report["rows"]}
    key = f"judge_{judge}_per_sample"
    if OWN_AR not in rows or key not in rows[OWN_AR]:
        raise SystemExit(f"the report has no '{OWN_AR}' side judged by {judge}")
    reference = finite(rows[OWN_AR][key])
    out = []
    for label, row in rows.items():
        if label == OWN_AR or match not in label or key not in row:
            continue
        samples = finite(row[key])
        generator = np.random.default_rng(0)  # per side: a side's interval does not depend on the others
        ratio = (samples[generator.integers(0, len(samples), (DRAWS, len(samples)))].mean(1)
                 / reference[generator.integers(0, len(reference), (DRAWS, len(reference)))].mean(1))
        low, high = np.percentile(ratio - 1, [5, 95])
        out.append({"side": label, "nll_per_char": float(row[f"judge_{judge}_nll_per_char"]),
                    "gap": float(samples.mean() / reference.mean() - 1), "low": float(low), "high": float(high)})
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
        for entry in gaps(report, args.judge, args.match):
            print(f"  {entry['side']}: {entry['nll_per_char']:.3f}, {100 * entry['gap']:.1f}% behind "
                  f"(90%: {100 * entry['low']:.1f} to {100 * entry['high']:.1f})")


if __name__ == "__main__":
    main()
