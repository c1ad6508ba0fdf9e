"""bench/judged_gap.py: a side judged against AR sampling in its run, or against the same side of another run."""

from __future__ import annotations

import json
import math

import pytest

from helpers import bench_module

judged_gap_script = bench_module("judged_gap")

PLAN = [("p", 0), ("q", 1), ("p", 2), ("q", 3)]  # two prompts, two seeds each


def run(ar: list[float], fast: list[float], plan=PLAN) -> dict:
    def row(label, values):
        return {"label": label, "judge_gguf_nll_per_char": sum(values) / len(values),
                "judge_gguf_per_sample": values}

    rows = [row("diffusion model, AR decoding", ar), row("diffusion, 8 steps", fast)]
    samples = [{"side": r["label"], "prompt": p, "seed": s, "text": "x"} for r in rows for p, s in plan]
    return {"rows": rows, "samples": samples}


def test_a_side_against_ar_sampling_and_against_its_namesake_in_another_run(tmp_path, capsys):
    before = run([1.0, 2.0, 1.0, 2.0], [1.2, 2.4, 1.2, 2.4])
    after = run([1.0, 2.0, 1.0, 2.0], [1.1, 2.2, 1.1, 2.2])
    (label, nll, gap, low, high), = judged_gap_script.gaps(after, "gguf")
    assert label == "diffusion, 8 steps" and math.isclose(nll, 1.65) and math.isclose(gap, 0.1)
    assert math.isclose(low, 0.1) and math.isclose(high, 0.1)  # 10% behind on both prompts: no doubt
    found = {g[0]: g[2:] for g in judged_gap_script.gaps(after, "gguf", against=before)}
    assert math.isclose(found["diffusion, 8 steps"][0], 3.3 / 3.6 - 1)
    assert found["diffusion model, AR decoding"] == (0.0, 0.0, 0.0)
    paths = []
    for name, report in (("before", before), ("after", after)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    judged_gap_script.main([str(paths[1]), "--against", str(paths[0]), "--match", "steps"])
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{paths[1]} against {paths[0]}",
                   "  diffusion, 8 steps: 1.650, -8.3% against the other run (90%: -8.3 to -8.3)"]


def test_runs_on_other_prompts_or_seeds_are_refused():
    before = run([1.0] * 4, [1.0] * 4)
    after = run([1.0] * 4, [1.0] * 4, plan=[("p", 0), ("q", 1), ("p", 2), ("q", 4)])
    with pytest.raises(SystemExit, match="'diffusion, 8 steps': the two sides were not drawn on the same prompts and"):
        judged_gap_script.gaps(after, "gguf", match="steps", against=before)


def test_each_side_against_a_named_side_in_the_same_run_or_another(tmp_path, capsys):
    before = run([1.0, 2.0, 1.0, 2.0], [1.2, 2.4, 1.2, 2.4])
    after = run([1.0, 2.0, 1.0, 2.0], [1.1, 2.2, 1.1, 2.2])
    found = judged_gap_script.gaps(after, "gguf", versus="diffusion, 8 steps")
    assert [(g[0], round(g[2], 6)) for g in found] == [("diffusion model, AR decoding", round(3 / 3.3 - 1, 6))]
    across = {g[0]: g[2] for g in judged_gap_script.gaps(after, "gguf", against=before, versus="diffusion, 8 steps")}
    assert math.isclose(across["diffusion, 8 steps"], 3.3 / 3.6 - 1)
    assert math.isclose(across["diffusion model, AR decoding"], 3.0 / 3.6 - 1)
    path = tmp_path / "after.json"
    path.write_text(json.dumps(after))
    with pytest.raises(SystemExit, match="no side labelled 'greedy' to judge against"):
        judged_gap_script.main([str(path), "--versus", "greedy"])


def test_a_report_judged_again_pairs_its_sides_by_the_added_scores():
    """bench/rejudge.py: each side's samples scored in the report's order, the rows given the bench's figures."""
    rejudge = bench_module("rejudge")

    class Lengths:  # a judge whose NLL per character is the text's length, so every figure can be checked by hand
        def nll_per_char_batch(self, pairs):
            return [float(len(text)) for _, text in pairs]

    report = run([0.0] * 4, [0.0] * 4)
    for sample in report["samples"]:
        own_ar = sample["side"] == "diffusion model, AR decoding"
        sample["text"] = "ab" if own_ar else "abc" * (1 + sample["seed"] % 2)  # prompt q's seeds write twice as much
    for row in report["rows"]:
        del row["judge_gguf_nll_per_char"], row["judge_gguf_per_sample"]
    report["judges"] = {"ar_twin": {}}
    judged = rejudge.rejudge(report, Lengths(), "lengths")
    fast = judged["rows"][1]
    assert fast["judge_gguf_per_sample"] == [3.0, 6.0, 3.0, 6.0] and fast["judge_gguf_nll_per_char"] == 4.5
    assert math.isclose(fast["judge_gguf_stderr"], 1.5)  # over prompts: p's mean 3, q's 6
    assert judged["judges"]["gguf"]["model"] == "lengths, added by bench/rejudge.py"
    (label, nll, gap, low, high), = judged_gap_script.gaps(judged, "gguf")
    assert label == "diffusion, 8 steps" and math.isclose(gap, 4.5 / 2 - 1)


def test_sides_can_be_judged_on_the_prompts_another_run_drew_or_on_the_others(tmp_path, capsys):
    report = run([1.0, 2.0, 1.0, 2.0], [1.1, 2.0, 1.1, 2.0])  # 10% behind on prompt p, level on q
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"samples": [{"prompt": "p", "seed": 9}]}))
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    for flag, line in (("--prompts-of", "1.100, +10.0% behind"), ("--other-prompts-than", "2.000, +0.0% behind")):
        judged_gap_script.main([str(path), flag, str(other)])
        assert capsys.readouterr().out.splitlines()[1].startswith(f"  diffusion, 8 steps: {line}")
