"""The Python syntax shares of every side of `printpress bench` reports, recomputed from their stored samples.

    python bench/python_shares.py docs/results/code/validity-shipped.json docs/results/code/validity-round2.json
    python bench/python_shares.py docs/results/code/hash-lines-screen.json --judge models/stdlib-code-ar

Prints, per report and side, the three shares of `printpress.eval.python_syntax.python_validity` (valid so far,
compiles, valid with at least two lines of code) and the share of the side's non-blank generated lines that are
bare `#` runs, so reports written before a share existed (`python_code_share` came after the code model's second
round was measured) are read the same way as new ones. With `--judge MODEL`, also that model's mean NLL per
character of the samples as written and with their bare `#` lines removed (over the samples with at least 10
characters left), which says how much of a side's judged quality is filler. Nothing is written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from printpress.eval.python_syntax import bare_hash_line_share, bare_hashes, python_validity

MIN_CHARS_LEFT = 10  # a sample judged with and without its filler keeps at least this much text


def side_shares(samples: list[dict]) -> dict[str, float]:
    shares = python_validity([s["prompt"] for s in samples], [s["text"] for s in samples])
    shares["bare_hash_line_share"] = bare_hash_line_share([s["text"] for s in samples])
    return shares


def without_bare_hashes(text: str) -> str:
    return "\n".join(line for line in text.split("\n") if not bare_hashes(line))


def judged_with_and_without_filler(judge, samples: list[dict]) -> tuple[int, float, float]:
    """(samples counted, mean NLL/char as written, mean NLL/char with the bare `#` lines removed)."""
    from printpress.eval.judge import nll_per_char

    kept = [s for s in samples if len(without_bare_hashes(s["text"]).strip()) >= MIN_CHARS_LEFT]
    as_written = [nll_per_char(judge, s["prompt"], s["text"]) for s in kept]
    stripped = [nll_per_char(judge, s["prompt"], without_bare_hashes(s["text"])) for s in kept]
    return len(kept), sum(as_written) / len(kept), sum(stripped) / len(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="printpress bench JSONs that hold their samples")
    parser.add_argument("--judge", help="a model folder whose AR head judges the samples with and without filler")
    args = parser.parse_args()
    import printpress

    judge = printpress.load(args.judge) if args.judge else None
    for path in args.reports:
        report = json.loads(path.read_text())
        sides: dict[str, list[dict]] = {}
        for sample in report["samples"]:
            sides.setdefault(sample["side"], []).append(sample)
        print(f"{path}")
        judged = f" {'judged n':>8} {'NLL':>6} {'no #':>6}" if judge else ""
        print(f"  {'side':48} {'n':>4} {'valid':>6} {'compiles':>8} {'w/ code':>7} {'# lines':>7}{judged}")
        for side, samples in sides.items():
            s = side_shares(samples)
            line = (f"  {side[:48]:48} {len(samples):4d} {s['python_prefix_share']:6.3f} {s['python_parses_share']:8.3f} "
                    f"{s['python_code_share']:7.3f} {s['bare_hash_line_share']:7.3f}")
            if judge:
                n, as_written, stripped = judged_with_and_without_filler(judge, samples)
                line += f" {n:8d} {as_written:6.3f} {stripped:6.3f}"
            print(line)


if __name__ == "__main__":
    main()
