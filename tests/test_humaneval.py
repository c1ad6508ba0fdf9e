"""The HumanEval harness: the data, the scoring, the sandboxed checks, and `printpress eval` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from printpress import cli
from printpress.errors import PrintpressError
from printpress.eval import TASKS, humaneval, load_task
from printpress.eval.sandbox import Limits

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "shakespeare-joint"


def _isolated() -> bool:
    from printpress.eval import sandbox

    return hasattr(sandbox, "require_isolation") and bool(sandbox.isolation())


@pytest.fixture(autouse=True)
def _unsafe_where_the_machine_cannot_isolate(monkeypatch):
    """Without namespaces the harness refuses to run completions; its scoring is then tested in the explicit
    unsafe mode, and the tests that need the isolation are skipped."""
    if not _isolated():
        monkeypatch.setenv("PRINTPRESS_UNSAFE_NO_ISOLATION", "1")


@pytest.fixture(scope="module")
def problems():
    return humaneval.load_problems()


def test_the_164_problems_are_read_from_the_installed_package(problems):
    assert len(problems) == 164
    assert [p["task_id"] for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert problems[0]["entry_point"] == "has_close_elements"
    assert set(problems[0]) == {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
    assert [p["task_id"] for p in humaneval.load_problems(limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(PrintpressError, match="--limit must be a positive"):
        humaneval.load_problems(limit=0)


@pytest.mark.slow  # 164 sandboxed programs
def test_every_canonical_solution_passes(problems):
    results = humaneval.check_completions(problems, [[p["canonical_solution"]] for p in problems], workers=2)
    failed = [(p["task_id"], r[0].detail) for p, r in zip(problems, results) if not r[0].passed]
    assert failed == []
    assert humaneval.score(results) == {"pass@1": 1.0}


HARMFUL = {
    "wrong": ("    return not any(abs(a - b) < threshold for a in numbers for b in numbers)\n", "failed"),
    "empty": ("    pass\n", "failed"),
    "syntax": ("    return (\n", "failed"),
    "hang": ("    while True:\n        pass\n", "timeout"),
    "sleep": ("    import time\n    time.sleep(600)\n", "timeout"),
    "segfault": ("    import faulthandler\n    faulthandler._sigsegv()\n", "crashed"),
    "ctypes": ("    import ctypes\n    ctypes.string_at(0)\n", "failed"),
    "os._exit": ("    import os\n    os._exit(0)\n", "failed"),
    "sys.exit": ("    import sys\n    sys.exit(0)\n", "failed"),
    "memory": ("    x = [0] * (10 ** 10)\n    return True\n", "failed"),
    "network": ("    import urllib.request\n    urllib.request.urlopen('http://example.com')\n", "failed"),
}


def test_harmful_completions_each_fail_alone_and_a_good_one_beside_them_passes(problems):
    problem = problems[0]
    completions = [c for c, _ in HARMFUL.values()] + [problem["canonical_solution"]]
    results = humaneval.check_completions([problem], [completions], Limits(timeout_s=1.5, memory_mb=256))[0]
    assert {name: r.status for name, r in zip(HARMFUL, results)} == {name: s for name, (_, s) in HARMFUL.items()}
    assert results[-1].passed
    assert humaneval.score([results]) == {"pass@1": pytest.approx(1 / 12), "pass@10": pytest.approx(10 / 12)}
    # The harness is unharmed: the same problem still checks normally afterwards.
    assert humaneval.check_completions([problem], [[problem["canonical_solution"]]])[0][0].passed


FORGED = {
    # Issue 13: the nonce that marked a finished program sat in a caller's frame; write it, leave before the tests.
    "nonce-from-frame": ("    import os, sys\n    f = sys._getframe()\n    while f is not None:\n"
                         "        if 'nonce' in f.f_locals and 'fd' in f.f_locals:\n"
                         "            os.write(f.f_locals['fd'], f.f_locals['nonce'].encode())\n"
                         "            os._exit(0)\n        f = f.f_back\n    os._exit(0)\n"),
    # A result equal to everything passes any `assert candidate(...) == expected` run in the same process.
    "always-equal": ("    class Anything:\n        def __eq__(self, other):\n            return True\n"
                     "    return Anything()\n"),
}


def test_completions_that_forge_a_pass_fail(problems):
    results = humaneval.check_completions([problems[0]], [list(FORGED.values())], Limits(timeout_s=5))[0]
    assert {name: r.status for name, r in zip(FORGED, results)} == {name: "failed" for name in FORGED}


def test_evaluate_refuses_before_generating_when_the_completions_cannot_be_isolated(monkeypatch):
    from printpress.eval import sandbox

    monkeypatch.setattr(sandbox, "_probe", lambda: ("", "unshare: Operation not permitted"))
    monkeypatch.delenv("PRINTPRESS_UNSAFE_NO_ISOLATION", raising=False)

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the model was used ({name}) before the refusal")

    with pytest.raises(PrintpressError, match="PRINTPRESS_UNSAFE_NO_ISOLATION=1"):
        humaneval.evaluate(Untouchable(), limit=1, progress=False)


def test_the_cli_refuses_without_isolation_and_names_its_opt_out(monkeypatch, tmp_path, capsys):
    from printpress.eval import sandbox

    monkeypatch.setattr(sandbox, "_probe", lambda: ("", "unshare: Operation not permitted"))
    monkeypatch.delenv("PRINTPRESS_UNSAFE_NO_ISOLATION", raising=False)
    args = ["eval", "--task", "humaneval", "--limit", "1", "--results", str(tmp_path), "--no-progress",
            "--max-new-tokens", "8"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "refusing to run untrusted code" in err and "--unsafe-no-isolation" in err and "\n" not in err
    assert cli.main([*args, "--unsafe-no-isolation", "--json"]) == 0
    report = json.loads(next(tmp_path.rglob("*.json")).read_text())
    assert report["settings"]["unsafe_no_isolation"] is True
    assert "--unsafe-no-isolation" in report["command"]


def test_completions_are_cut_at_the_first_stop_sequence():
    body = "    return x + 1\n"
    assert humaneval.truncate(body + "\ndef other():\n    pass\n") == body
    assert humaneval.truncate(body + "\nprint(f(1))\nclass A: pass") == body
    assert humaneval.truncate(body + "\nif __name__ == '__main__':\n    f()") == body
    assert humaneval.truncate(body + "\n# tests\nassert f(1) == 2") == body
    nested = "    def helper(y):\n        return y\n    return helper(x)\n"
    assert humaneval.truncate(nested) == nested  # an indented def is part of the body
    assert humaneval.truncate("") == ""


def test_pass_at_k_is_the_unbiased_estimator():
    assert humaneval.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert humaneval.pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))  # 0.91666...
    assert humaneval.pass_at_k(10, 3, 5) == pytest.approx(11 / 12)
    assert humaneval.pass_at_k(5, 0, 5) == 0.0
    assert humaneval.pass_at_k(5, 1, 5) == 1.0
    assert humaneval.pass_at_k(200, 1, 100) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k <= n"):
        humaneval.pass_at_k(5, 1, 10)


def test_evaluate_generates_cuts_and_scores_with_the_shipped_model():
    pipe = _pipe()
    out = humaneval.evaluate(pipe, limit=2, seed=3, progress=False,
                             settings={"max_new_tokens": 32, "max_denoising_steps": 2, "samples": 2})
    metrics = out["metrics"]
    assert metrics["problems"] == 2 and metrics["samples_per_problem"] == 2
    assert set(metrics) >= {"pass@1", "passed", "tokens_per_s", "tokens_per_forward", "generation_s", "test_s"}
    assert metrics["pass@1"] == metrics["passed"] / 4
    rows = out["samples"]
    assert [(r["task_id"], r["sample"], r["seed"]) for r in rows] == [
        ("HumanEval/0", 0, 3), ("HumanEval/0", 1, 4), ("HumanEval/1", 0, 3), ("HumanEval/1", 1, 4)]
    for row in rows:
        assert row["completion"] == humaneval.truncate(row["raw_completion"])
        assert row["status"] in {"passed", "failed", "timeout", "crashed"}
    # Same seeds, same completions: the run is repeatable.
    again = humaneval.evaluate(pipe, limit=1, seed=3, progress=False,
                               settings={"max_new_tokens": 32, "max_denoising_steps": 2})
    assert again["samples"][0]["raw_completion"] == rows[0]["raw_completion"]
    assert out["info"]["limits"]["timeout_s"] == 10.0
    if _isolated():
        assert out["info"]["isolation"].startswith("kernel") and out["info"]["network_isolation"] == "namespace"


def test_a_bad_sampler_setting_fails_before_any_work():
    with pytest.raises(PrintpressError, match="unknown mode"):
        humaneval.evaluate(_pipe(), limit=1, settings={"mode": "sideways"}, progress=False)
    with pytest.raises(PrintpressError, match="--samples must be at least 1"):
        humaneval.evaluate(_pipe(), limit=1, settings={"samples": -1}, progress=False)


def test_printpress_eval_runs_humaneval_and_writes_a_report_card(tmp_path, capsys):
    code = cli.main(["eval", "--task", "humaneval", "--model", str(SHIPPED), "--limit", "1", "--mode", "ar",
                     "--max-new-tokens", "8", "--results", str(tmp_path), "--no-progress", "--json"])
    assert code == 0
    out = capsys.readouterr()
    metrics = json.loads(out.out)
    assert metrics["problems"] == 1 and metrics["generated_tokens"] <= 8
    (card_path,) = tmp_path.glob("*-humaneval.json")
    card = json.loads(card_path.read_text())
    assert card["metrics"] == metrics
    assert card["settings"]["mode"] == "ar" and card["settings"]["max_new_tokens"] == 8
    assert card["model"]["path"] == str(SHIPPED) and card["model"]["parameters"] > 5_000_000
    assert card["command"] == (f"printpress eval --task humaneval --model {SHIPPED} --limit 1 --seed 0 --results {tmp_path}"
                               " --mode ar --max-new-tokens 8")
    assert card["samples"][0]["task_id"] == "HumanEval/0"
    assert str(card_path) in out.err


def test_printpress_eval_explains_unknown_and_missing_tasks(monkeypatch, capsys):
    assert cli.main(["eval", "--task", "chess"]) == 2
    assert "unknown task 'chess'; known tasks: " in capsys.readouterr().err
    monkeypatch.setitem(TASKS, "ghost", "printpress.eval.ghost_task")
    assert cli.main(["eval", "--task", "ghost"]) == 2
    assert "task 'ghost' is registered but its module printpress.eval.ghost_task is not" in capsys.readouterr().err
    assert load_task("humaneval") is humaneval


def _pipe():
    from printpress.engine import Pipeline

    return Pipeline.from_pretrained(SHIPPED)
