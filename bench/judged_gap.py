"""How far each side of a `printpress bench` report is judged behind AR sampling on the same weights, with an interval;
or, with --against, how each side of one run is judged against the same side of another run.

    python bench/judged_gap.py docs/results/levers/shipped-s19200.json [--judge gguf] [--match canvas_start]
    python bench/judged_gap.py docs/results/code/round4-light.json --against docs/results/code/round3b-light.json
    python bench/judged_gap.py docs/results/code/sliding.json --versus "diffusion, 8 steps, bound 4"
    python bench/judged_gap.py docs/results/code/validity-sliding-smollm2.json --versus "diffusion, 32 steps, bound 1" \
        --prompts-of docs/results/code/sliding-steps.json     (or --other-prompts-than: the rest of its prompts)

Issue 11's quality target is relative: a diffusion side's judged NLL per character within 10% of AR sampling's on
the same weights. One run's 72 samples leave that ratio uncertain by a few percent, which matters once a side sits
near the line. Per side: the gap and its 90% interval (`printpress.eval.frontier.judged_gap`: prompts resampled,
both sides paired by prompt; the bench also writes it into each row as `judge_<judge>_gap` and `judge_<judge>_gap_90`),
recomputed here from the per-sample figures, so reports written before the bench paired the sides read the same way.

With --against, the pairing is across runs: two runs of the light bench draw the same prompts and seeds, so a model
and its successor are compared sample for sample (a negative figure: the first run's side is judged better). That
is the test for "did this round improve the side", which two runs' standard errors alone leave open. --versus pairs
every side with one named side instead (a sampler against the default, in one run or across two).
"""

from __future__ import annotations

import argparse
import json

from printpress.eval.bench_sides import OWN_AR
from printpress.eval.frontier import judged_gap, summarize_judge


def side_samples(report: dict, label: str) -> list[tuple[str, int]]:
    """(prompt, seed) of each of a side's samples, in the order of its per-sample figures."""
    return [(s["prompt"], s["seed"]) for s in report["samples"] if s["side"] == label]


def gaps(report: dict, judge: str, match: str = "", against: dict | None = None,
         versus: str | None = None) -> list[tuple[str, float, float, float, float]]:
    """(side, judged NLL/char, gap, low, high) per side whose label contains `match`: against AR sampling in the same
    report (that side itself left out), or against the same side of `against`; with `versus`, against the side of
    that label (in `against` if given, else in the same report)."""
    rows = {row["label"]: row for row in report["rows"]}
    key = f"judge_{judge}_per_sample"
    if versus is not None:
        source = report if against is None else against
        found = [row for row in source["rows"] if row["label"] == versus]
        if not found:
            raise SystemExit(f"no side labelled {versus!r} to judge against")
        references = {label: (source, found[0]) for label in rows if source is not report or label != versus}
    elif against is None:
        if OWN_AR not in rows or key not in rows[OWN_AR]:
            raise SystemExit(f"the report has no '{OWN_AR}' side judged by {judge}")
        references = {label: (report, rows[OWN_AR]) for label in rows if label != OWN_AR}
    else:
        other = {row["label"]: row for row in against["rows"]}
        references = {label: (against, other[label]) for label in rows if label in other}
    out = []
    for label, row in rows.items():
        if label not in references or match not in label or key not in row:
            continue
        source, reference = references[label]
        if key not in reference:
            continue
        mine, theirs = side_samples(report, label), side_samples(source, reference["label"])
        if mine != theirs:
            raise SystemExit(f"'{label}': the two sides were not drawn on the same prompts and seeds")
        found = judged_gap(row[key], reference[key], [prompt for prompt, _ in mine])
        if found is not None:
            out.append((label, row[f"judge_{judge}_nll_per_char"], *found))
    return out


def restricted(report: dict, prompts: set[str], inside: bool) -> dict:
    """`report` cut to the samples whose prompt is (`inside`) or is not among `prompts`, each row's per-sample figures
    with them (so a run's sides can be judged on a subset of its prompts, e.g. those another run also drew)."""
    rows = []
    for row in report["rows"]:
        side = [s["prompt"] for s in report["samples"] if s["side"] == row["label"]]
        keep = [(prompt in prompts) == inside for prompt in side]
        cut = dict(row)
        for key in [key for key in row if key.startswith("judge_") and key.endswith("_per_sample")]:
            judge = key[len("judge_") : -len("_per_sample")]  # its mean and stderr over what is left
            values = [v for v, k in zip(row[key], keep) if k]
            cut.update(summarize_judge(judge, values, [p for p, k in zip(side, keep) if k]))
        rows.append(cut)
    samples = [s for s in report["samples"] if (s["prompt"] in prompts) == inside]
    return {**report, "rows": rows, "samples": samples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="`printpress bench --out` JSON files")
    parser.add_argument("--judge", default="gguf", help="gguf (SmolLM2, the issue's judge) or ar_twin")
    parser.add_argument("--match", default="", help="only sides whose label contains this")
    parser.add_argument("--against", default=None,
                        help="a second run on the same prompts and seeds: each side judged against its namesake there")
    parser.add_argument("--versus", default=None, metavar="LABEL",
                        help="judge each side against the side of this label instead (in the --against run if given)")
    parser.add_argument("--prompts-of", default=None, metavar="REPORT",
                        help="only the samples whose prompt that report also drew")
    parser.add_argument("--other-prompts-than", default=None, metavar="REPORT",
                        help="only the samples whose prompt that report did not draw")
    args = parser.parse_args(argv)
    subsets = []
    for path, inside in ((args.prompts_of, True), (args.other_prompts_than, False)):
        if path:
            with open(path) as handle:
                subsets.append(({s["prompt"] for s in json.load(handle)["samples"]}, inside))
    against = None
    if args.against:
        with open(args.against) as handle:
            against = json.load(handle)
    for path in args.reports:
        with open(path) as handle:
            report = json.load(handle)
        for prompts, inside in subsets:
            report = restricted(report, prompts, inside)
        print(path if against is None else f"{path} against {args.against}")
        for label, nll, gap, low, high in gaps(report, args.judge, args.match, against, args.versus):
            where = f"against {args.versus!r}" if args.versus else "behind" if against is None else \
                "against the other run"
            print(f"  {label}: {nll:.3f}, {100 * gap:+.1f}% {where} (90%: {100 * low:+.1f} to {100 * high:+.1f})")


if __name__ == "__main__":
    main()
