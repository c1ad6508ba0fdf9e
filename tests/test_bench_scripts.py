"""Every benchmark script answers `--help` with its usage and does nothing else: no run, no file written.

(bench/gguf_judge.py once ignored its arguments, so `--help` ran the whole measurement and overwrote its result.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))

# One interpreter for all of them (torch imported once): each script runs as __main__ with `--help` and must leave
# through argparse's exit 0 after printing its usage.
RUNNER = """
import contextlib, io, runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    else:
        code = "returned without exiting"
    print(path, code, "usage:" in out.getvalue())
"""


def test_every_bench_script_answers_help_and_writes_nothing(tmp_path):
    assert len(SCRIPTS) > 20
    watched = [p for folder in (ROOT / "docs" / "results", ROOT / "results") if folder.exists()
               for p in folder.rglob("*") if p.is_file()]
    before = {p: p.stat().st_mtime_ns for p in watched}
    done = subprocess.run([sys.executable, "-c", RUNNER, *map(str, SCRIPTS)], cwd=tmp_path, capture_output=True,
                          check=False, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert [line.rsplit(" ", 2) for line in lines] == [[str(p), "0", "True"] for p in SCRIPTS]
    assert {p: p.stat().st_mtime_ns for p in watched} == before
    assert not any(tmp_path.iterdir())  # nothing written where it ran either


def test_checkouts_ab_times_two_checkouts_and_says_whether_they_compute_the_same_bits(tmp_path):
    """bench/checkouts_ab.py with this checkout on both sides: two workers, alternating rounds, the same logits (the
    verifications' too); a folder that is not a checkout, and a verification of one token, are refused by name."""
    script = str(ROOT / "bench" / "checkouts_ab.py")
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, script, "--before", str(ROOT), "--after", str(ROOT), "--rounds", "2",
                           "--steps", "2", "--canvases", "4", "--passes", "1", "--verify", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["same_bits"] and "logits identical" in done.stdout
    assert set(report["work"]) == {"AR step", "decoder pass, canvas 4", "verification of 4 tokens (2 kept)"}
    for work in report["work"].values():
        assert len(work["before_ms"]) == len(work["after_ms"]) == 2 and work["ratio_median"] > 0
        for side in ("before", "after"):  # a round's quietest call is one of its calls: no longer than their mean
            assert all(0 < least <= mean for least, mean in zip(work[f"{side}_quietest_ms"], work[f"{side}_ms"]))
        assert work["quietest_ratio_median"] > 0
    refused = subprocess.run([sys.executable, script, "--before", str(tmp_path)], capture_output=True, text=True,
                             timeout=120, check=False)
    assert refused.returncode == 2 and f"{tmp_path} is not a printpress checkout" in refused.stderr
    refused = subprocess.run([sys.executable, script, "--before", str(ROOT), "--verify", "1"], capture_output=True,
                             text=True, timeout=120, check=False)
    assert refused.returncode == 2 and "--verify: a block of at least 2 tokens" in refused.stderr


def test_load_time_loads_in_fresh_interpreters_and_compares_checkouts(tmp_path):
    """bench/load_time.py with this checkout on both sides: one timed run each, their kernels cached apart, and no
    torch._dynamo imported by a load; a folder that is not a checkout, and no runs, are refused by name."""
    script = str(ROOT / "bench" / "load_time.py")
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, script, "--before", str(ROOT), "--runs", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    for side in ("before", "now"):
        assert len(report[side]["runs"]) == 1 and report[side]["load_s"] > 0
        assert report[side]["dynamo_imported"] is False
    assert report["load_ratio_before_over_now"] > 0 and "load before / now" in done.stdout
    for args, message in ((["--before", str(tmp_path)], f"{tmp_path} is not a printpress checkout"),
                          (["--runs", "0"], "--runs must be at least 1, got 0")):
        refused = subprocess.run([sys.executable, script, *args, "--out", str(out)], capture_output=True, text=True,
                                 timeout=120, check=False)
        assert refused.returncode == 2 and message in refused.stderr


def test_checkouts_ab_takes_a_benchmark_size_as_the_model(tmp_path):
    """`--model tiny`: bench/engine_speed.py's tiny size with random weights, written once for both sides (here in
    float16, `--stored-as`); a name that is neither a folder nor a size is refused by name."""
    script = str(ROOT / "bench" / "checkouts_ab.py")
    out = tmp_path / "ab.json"
    common = [sys.executable, script, "--before", str(ROOT), "--rounds", "1", "--steps", "2", "--canvases", "4",
              "--passes", "1"]
    done = subprocess.run([*common, "--model", "tiny", "--stored-as", "float16", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and report["stored_as"] == "float16" and report["same_bits"]
    refused = subprocess.run([*common, "--model", "huge"], capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode != 0 and "--model 'huge' is neither a model folder nor a benchmark size" in refused.stderr


def test_checkouts_ab_alternates_a_switch_of_the_layers_in_one_process(tmp_path):
    """`--switch experts_in_buffers`: one worker of this checkout, the switch off (before) and on (after) in alternate
    rounds, the same logits both ways, a verification of 8 tokens among the works;
    --before and --switch together are refused by name."""
    script = str(ROOT / "bench" / "checkouts_ab.py")
    out = tmp_path / "switch.json"
    common = [sys.executable, script, "--model", "tiny", "--rounds", "2", "--steps", "2", "--canvases", "8",
              "--passes", "1", "--verify", "8"]
    done = subprocess.run([*common, "--switch", "experts_in_buffers", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["switch"] == "experts_in_buffers" and report["same_bits"]
    assert "logits identical with experts_in_buffers off and on" in done.stdout
    assert report["checkouts"]["before"] == report["checkouts"]["after"] == str(ROOT)
    assert set(report["work"]) == {"AR step", "decoder pass, canvas 8", "verification of 8 tokens (4 kept)"}
    assert all(len(work["before_ms"]) == len(work["after_ms"]) == 2 for work in report["work"].values())
    refused = subprocess.run([*common, "--switch", "rows_kernel", "--before", str(ROOT)], capture_output=True,
                             text=True, timeout=120, check=False)
    assert refused.returncode == 2 and "give --before" in refused.stderr and "not both" in refused.stderr


def test_sampled_drafts_compares_the_two_draft_rules_against_ar_sampling(tmp_path):
    """bench/sampled_drafts.py: each rule (the interpolated q, the longest context's) at each cap has its ratio to AR
    sampling in each round, their median and its tokens per verification; a temperature of 0 is refused."""
    script = str(ROOT / "bench" / "sampled_drafts.py")
    out = tmp_path / "sampled.json"
    done = subprocess.run([sys.executable, script, "--rounds", "2", "--prompts", "2", "--seeds", "1", "--tokens", "8",
                           "--caps", "2", "3", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    settings = {"interpolated, cap 2", "interpolated, cap 3", "longest, cap 2", "longest, cap 3"}
    assert set(report["median_ratio_to_ar_sampling"]) == settings and len(report["rounds"]) == 2
    assert all(set(r) == settings | {"ar_tokens_per_s"} and all(v > 0 for v in r.values()) for r in report["rounds"])
    assert set(report["tokens_per_verification"]) == settings
    assert all(1 <= v <= 4 for v in report["tokens_per_verification"].values())
    refused = subprocess.run([sys.executable, script, "--temperature", "0", "--out", str(out)], capture_output=True,
                             text=True, timeout=120, cwd=ROOT, check=False)
    assert refused.returncode == 2 and "--temperature: sampling needs a temperature above 0, got 0.0" in refused.stderr


def test_text_deltas_times_both_ways_on_the_same_text_and_refuses_a_length_past_its_text(tmp_path):
    """bench/text_deltas.py: microseconds per token for each length, both ways (the script stops if their texts
    differ); a length past what README.md gives is refused with the count."""
    script = str(ROOT / "bench" / "text_deltas.py")
    out = tmp_path / "deltas.json"
    done = subprocess.run([sys.executable, script, "--lengths", "16", "64", "--repeat", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [16, 64]
    assert all(r["whole_each_time_us_per_token"] > 0 and r["incremental_us_per_token"] > 0 for r in rows)
    refused = subprocess.run([sys.executable, script, "--lengths", "10000000"], capture_output=True, text=True,
                             timeout=300, cwd=ROOT, check=False)
    assert refused.returncode == 2 and "the longest length asked is 10000000" in refused.stderr


def test_speculative_interleaved_compares_tables_and_caps_round_by_round(tmp_path):
    """bench/speculative_interleaved.py: every setting (a table, a cap) has its ratio to greedy AR in each round and
    their median (greedy speculative output equal to AR's, or the script stops); a malformed --table is refused."""
    script = str(ROOT / "bench" / "speculative_interleaved.py")
    table = str(ROOT / "models" / "shakespeare-joint" / "draft_table.safetensors")
    out = tmp_path / "interleaved.json"
    done = subprocess.run([sys.executable, script, "--rounds", "2", "--prompts", "2", "--tokens", "8", "--caps", "2",
                           "3", "--table", f"a={table}", "--table", f"b={table}", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    settings = {"a, cap 2", "a, cap 3", "b, cap 2", "b, cap 3"}
    assert set(report["median_ratio"]) == settings and len(report["rounds"]) == 2
    assert all(set(r) == settings | {"ar_tokens_per_s"} and all(v > 0 for v in r.values()) for r in report["rounds"])
    refused = subprocess.run([sys.executable, script, "--table", "nameless", "--out", str(out)], capture_output=True,
                             text=True, timeout=120, cwd=ROOT, check=False)
    assert refused.returncode == 2 and "--table: NAME=PATH, got 'nameless'" in refused.stderr


def test_speculative_interleaved_runs_each_round_with_a_switch_off_and_on(tmp_path):
    """bench/speculative_interleaved.py --switch: each round twice, the layers' switch off and on, each state's ratios
    to greedy AR and the median of on / off; the switch is left on; an unknown switch is refused by argparse."""
    script = str(ROOT / "bench" / "speculative_interleaved.py")
    out = tmp_path / "switch.json"
    done = subprocess.run([sys.executable, script, "--rounds", "2", "--prompts", "2", "--tokens", "8", "--switch",
                           "attention_in_loops", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["switch"] == "attention_in_loops" and set(report["rounds"]) == {"off", "on"}
    assert all(len(rounds) == 2 and all(set(r) == {"ar_tokens_per_s", "model, cap 7"} for r in rounds)
               for rounds in report["rounds"].values())
    assert set(report["on_over_off"]) == {"ar_tokens_per_s", "model, cap 7"}
    assert all(value > 0 for value in report["on_over_off"].values())
    refused = subprocess.run([sys.executable, script, "--switch", "nothing", "--out", str(out)], capture_output=True,
                             text=True, timeout=120, cwd=ROOT, check=False)
    assert refused.returncode == 2 and "--switch: invalid choice: 'nothing'" in refused.stderr


def test_op_counts_counts_each_pass_kinds_operators_per_pass(tmp_path):
    """bench/op_counts.py on the tiny size (two layers): an AR step and a canvas pass each call the C++ layers once
    (`layers`) and, where the layers' attention does not run in their own loops, ATen's attention once per layer
    inside; the AR step the head once, each count per pass; a pass kind that is neither `ar` nor `canvas:C` is refused
    by name."""
    script = str(ROOT / "bench" / "op_counts.py")
    out = tmp_path / "ops.json"
    common = [sys.executable, script, "--models", "tiny", "--passes", "2"]
    done = subprocess.run([*common, "--work", "ar", "canvas:4", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    ar, canvas = json.loads(out.read_text())["results"]
    assert (ar["work"], canvas["work"]) == ("ar", "canvas:4")
    for side in (ar, canvas):
        assert side["ops"]["printpress_layers::layers"]["calls"] == 1
        attention = side["ops"].get("aten::scaled_dot_product_attention", {"calls": 0})["calls"]
        assert attention == (0 if side["attention_in_loops"] else 2)
    assert ar["ops"]["printpress_layers::head"]["calls"] == 1
    assert ar["aten_calls"] > 0 and ar["wall_ms"] > 0
    refused = subprocess.run([*common, "--work", "canvas:0", "--out", str(out)], capture_output=True, text=True,
                             timeout=120, check=False)
    assert refused.returncode != 0 and "'canvas:0' is neither 'ar' nor 'canvas:C'" in refused.stderr
