"""Side by side: the yardstick reports of several runs as one Markdown table, in docs/benchmarks.md §7's format.

    python bench/yardstick_table.py docs/results/levers/yardstick-l10-softar-control.json \
        docs/results/levers/yardstick-l10-softar-w1.json --names control "soft targets"

One row per setting (the union of the runs' sides, in the first run's order), one column per run. A diffusion
cell reads `1.57× (2.20), 1.533 / 1.845, 5.15, yes`: speed as a ratio to the AR twin of the same run, tokens per
forward in brackets where the adaptive stop fired (elsewhere it is the canvas over the steps), judged NLL per
character under the AR twin / SmolLM2, word entropy (nats), and whether its diversity matches AR sampling's on
the same weights (`no (0.3% short)`: only its entropy is under the line, by that much). AR sampling on the same
weights gives the judged figures and entropy; greedy and speculative rows (temperature 0) give the speed, the judged
figures and the share of repeated word 4-grams; the last row holds the held-out AR and diffusion losses. The table's footnote names each run's line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from printpress.eval.bench_sides import AR_TWIN, OWN_AR


def judged(row: dict) -> str:
    smol = row.get("judge_gguf_nll_per_char")
    return f"{row['judge_ar_twin_nll_per_char']:.3f} / " + ("-" if smol is None else f"{smol:.3f}")


def diversity_line(report: dict) -> float:
    """The least word entropy a matched side may have, as the report's own reference recorded it."""
    reference = report["diversity_reference"]
    return reference["unigram_entropy_nats"] * (1 - reference["entropy_tolerance"])


def matched(row: dict, report: dict) -> str:
    if row.get("matched_diversity"):
        return "yes"
    reference, line = report["diversity_reference"], diversity_line(report)
    repeats_ok = row["repeated_4gram_share"] <= reference["repeated_4gram_share"] + reference["repeat_slack"]
    if repeats_ok and row["unigram_entropy_nats"] < line:
        return f"no ({100 * (line - row['unigram_entropy_nats']) / line:.1f}% short)"
    return "no"


def cell(row: dict | None, report: dict) -> str:
    if row is None:
        return "—"
    if row["label"] in (AR_TWIN, OWN_AR):
        return f"{judged(row)}, {row['unigram_entropy_nats']:.2f}"
    twin = next(r for r in report["rows"] if r["label"] == AR_TWIN)["tokens_per_s"]
    speed = f"{row['tokens_per_s'] / twin:.2f}×"
    if row.get("adaptive_stops") or row["kind"] == "speculative":
        speed += f" ({row['tokens_per_forward']:.2f})"
    if row["settings"].get("temperature") == 0:
        return f"{speed}, {judged(row)}, {row['repeated_4gram_share']:.3f}"
    return f"{speed}, {judged(row)}, {row['unigram_entropy_nats']:.2f}, {matched(row, report)}"


def heldout(report: dict) -> str:
    losses = (report.get("heldout") or {}).get("diffusion")
    return "—" if not losses else f"{losses['val_ar']:.3f} / {losses['val_diffusion']:.3f}"


def table(reports: list[dict], names: list[str]) -> str:
    labels: list[str] = []
    for report in reports:
        labels += [row["label"] for row in report["rows"] if row["label"] not in labels]
    lines = ["| setting | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label in labels:
        rows = [next((r for r in report["rows"] if r["label"] == label), None) for report in reports]
        lines.append(f"| {label} | " + " | ".join(cell(row, report) for row, report in zip(rows, reports)) + " |")
    lines.append("| held-out AR / diffusion loss | " + " | ".join(heldout(report) for report in reports) + " |")
    lines_note = ", ".join(f"{name} {diversity_line(report):.2f}" for name, report in zip(names, reports))
    lines.append("")
    lines.append("(× AR, with tokens per forward where the adaptive stop fired; AR twin / SmolLM2 nats/char; word "
                 "entropy; matched to AR sampling's diversity on the same weights. Temperature-0 rows: speed, "
                 f"the judges, repeated 4-grams. The diversity line: {lines_note}.)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="yardstick JSONs (printpress bench --out)")
    parser.add_argument("--names", nargs="+", default=None, help="column titles (default: the file names)")
    args = parser.parse_args(argv)
    names = args.names or [path.stem for path in args.reports]
    if len(names) != len(args.reports):
        parser.error(f"--names gives {len(names)} titles for {len(args.reports)} reports")
    reports = []
    for path in args.reports:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"cannot read {path}: {exc}")
        if "rows" not in reports[-1] or "diversity_reference" not in reports[-1]:
            parser.error(f"{path} is not a printpress bench report (no rows or diversity_reference)")
    print(table(reports, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
