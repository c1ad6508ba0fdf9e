"""The Python syntax shares of every side of `printpress bench` reports, recomputed from their stored samples.

    python bench/python_shares.py docs/results/code/validity-shipped.json docs/results/code/validity-round2.json

Prints, per report and side, the three shares of `printpress.eval.python_syntax.python_validity` (valid so far,
compiles, valid with at least two lines of code) and the share of the side's non-blank generated lines that are
bare `#` runs, so reports written before a share existed (`python_code_share` came after the code model's second
round was measured) are read the same way as new ones. Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from printpress.eval.python_syntax import python_validity

BARE_HASHES = re.compile(r"\s*#+\s*")


def side_shares(samples: list[dict]) -> dict[str, float]:
    shares = python_validity([s["prompt"] for s in samples], [s["text"] for s in samples])
    lines = [line for s in samples for line in s["text"].splitlines() if line.strip()]
    shares["bare_hash_line_share"] = sum(bool(BARE_HASHES.fullmatch(line)) for line in lines) / max(1, len(lines))
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="printpress bench JSONs that hold their samples")
    args = parser.parse_args()
    for path in args.reports:
        report = json.loads(path.read_text())
        sides: dict[str, list[dict]] = {}
        for sample in report["samples"]:
            sides.setdefault(sample["side"], []).append(sample)
        print(f"{path}")
        print(f"  {'side':48} {'n':>4} {'valid':>6} {'compiles':>8} {'w/ code':>7} {'# lines':>7}")
        for side, samples in sides.items():
            s = side_shares(samples)
            print(f"  {side[:48]:48} {len(samples):4d} {s['python_prefix_share']:6.3f} {s['python_parses_share']:8.3f} "
                  f"{s['python_code_share']:7.3f} {s['bare_hash_line_share']:7.3f}")


if __name__ == "__main__":
    main()
