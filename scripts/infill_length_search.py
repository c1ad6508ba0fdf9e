"""How an infill length search should choose its length: criteria compared on held-out spans (issue 14).

    OMP_NUM_THREADS=1 python scripts/infill_length_search.py --spans 80 --out docs/results/infill-length-search.json

Spans are bench/infill.py's (lines and 2-3 word runs from the shipped models' held-out works, 400 characters of
prefix, 200 of suffix), drawn with seed 7. Each is infilled once with the default search (4, 8, 12, 16, 24 tokens;
candidate i with seed 1000 + span + i), and every criterion picks among the same five candidates, from the NLLs
the search computes under the joint model's causal head (`Candidate.middle_nll`, `suffix_nll`):

- per-char join: (middle NLL + suffix NLL) / characters of both (the criterion before issue 14);
- suffix NLL: the NLL of the scored suffix tokens after prefix + middle, the same text for every candidate (now);
- joint NLL: middle NLL + suffix NLL (the likelihood of the whole join);
- per-token join: (middle NLL + suffix NLL) / tokens of both.

Judged by the AR twin (models/shakespeare-ar): NLL per character of the next 100 suffix characters after prefix +
chosen middle ("join", as in docs/benchmarks-infill.md; lower is better), NLL per character of the middle, the
chosen length against the true span's token count, and paired differences against the per-char criterion.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import time
from pathlib import Path

import torch

import printpress
from printpress import editing
from printpress.eval.judge import nll_per_char

ROOT = Path(__file__).resolve().parents[1]
CRITERIA = {
    "per-char join (before)": lambda c: (c["middle_nll"] + c["suffix_nll"]) / (c["middle_chars"] + c["suffix_chars"]),
    "suffix NLL (now)": lambda c: c["suffix_nll"],
    "joint NLL": lambda c: c["middle_nll"] + c["suffix_nll"],
    "per-token join": lambda c: (c["middle_nll"] + c["suffix_nll"]) / (c["length"] + c["suffix_tokens"]),
}
BEFORE = "per-char join (before)"


def bench_spans(count: int) -> list[dict]:
    spec = importlib.util.spec_from_file_location("infill_bench", ROOT / "bench" / "infill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_spans(count, seed=7)


def measure(spans: list[dict]) -> list[dict]:
    pipe, judge = printpress.load(), printpress.load(ROOT / "models" / "shakespeare-ar")
    rows, started = [], time.perf_counter()
    for i, span in enumerate(spans):
        prefix, suffix = span["prefix"], span["suffix"]
        result = editing.infill(pipe, prefix, suffix, seed=1000 + i)
        scored = pipe.decode(editing._tokenize(pipe, suffix)[: pipe.canvas_length])
        candidates = []
        for c in result.candidates:
            candidates.append({
                "length": c.length, "middle": c.middle, "middle_nll": c.middle_nll, "suffix_nll": c.suffix_nll,
                "suffix_tokens": c.suffix_tokens, "middle_chars": len(pipe.decode(c.middle_ids)),
                "suffix_chars": len(scored),
                "judge_middle": nll_per_char(judge, prefix, c.middle) if c.middle else float("nan"),
                "judge_join": nll_per_char(judge, prefix + c.middle, suffix[:100]),
            })
        rows.append({"kind": span["kind"], "true_length": len(editing._tokenize(pipe, span["middle"])),
                     "original_join": nll_per_char(judge, prefix + span["middle"], suffix[:100]),
                     "candidates": candidates})
        print(f"{i + 1}/{len(spans)} spans, {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def summarise(rows: list[dict]) -> dict:
    def pick(row, criterion):
        return min(row["candidates"], key=CRITERIA[criterion])

    out = {}
    for name in CRITERIA:
        chosen = [pick(r, name) for r in rows]
        diffs = [pick(r, name)["judge_join"] - pick(r, BEFORE)["judge_join"] for r in rows]
        lengths = [c["length"] for c in chosen]
        out[name] = {
            "mean_length": statistics.mean(lengths),
            "lengths": {str(n): lengths.count(n) for n in sorted(set(lengths))},
            "mean_abs_log2_length_ratio": statistics.mean(abs(math.log2(c["length"] / max(r["true_length"], 1)))
                                                          for c, r in zip(chosen, rows)),
            "judge_join": statistics.mean(c["judge_join"] for c in chosen),
            "judge_middle": statistics.mean(c["judge_middle"] for c in chosen
                                            if not math.isnan(c["judge_middle"])),
            "join_vs_before": statistics.mean(diffs),
            "join_vs_before_stderr": statistics.stdev(diffs) / math.sqrt(len(diffs)),
        }
    return {"spans": len(rows), "true_length": statistics.mean(r["true_length"] for r in rows),
            "original_join": statistics.mean(r["original_join"] for r in rows), "criteria": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=80)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "infill-length-search.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(bench_spans(args.spans))
    summary = summarise(rows)
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1, ensure_ascii=False))
    for name, figures in summary["criteria"].items():
        print(f"{name:24s} mean length {figures['mean_length']:4.1f}  |log2 L/true| "
              f"{figures['mean_abs_log2_length_ratio']:.2f}  judge join {figures['judge_join']:.4f} "
              f"({figures['join_vs_before']:+.4f} ± {figures['join_vs_before_stderr']:.4f})  judge middle "
              f"{figures['judge_middle']:.3f}")


if __name__ == "__main__":
    main()
