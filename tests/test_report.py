"""Report cards: the JSON holds everything, the markdown the short version, and nothing is overwritten."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import printpress
from printpress import model as model_module
from printpress.errors import PrintpressError
from printpress.eval.report import command_line, machine, write_report

PAYLOAD = {
    "metrics": {"pass@1": 0.125, "tokens_per_s": 1234.5678},
    "settings": {"mode": "diffusion", "steps": 8, "eos": [1, 2]},
    "model": {"path": "models/x", "parameters": 42},
    "samples": [{"task_id": f"T/{i}", "passed": i == 0} for i in range(3)],
    "command": "printpress eval --task demo --limit 3",
    "note": "a | pipe",
}


def test_write_report_writes_the_json_and_markdown_cards(tmp_path):
    json_path, md_path = write_report(tmp_path / "new" / "folder", "demo", PAYLOAD)
    assert json_path.parent == md_path.parent == tmp_path / "new" / "folder"
    assert json_path.name.endswith("-demo.json") and md_path.name == json_path.name[:-5] + ".md"
    card = json.loads(json_path.read_text())
    for key in ("metrics", "settings", "model", "samples", "note"):
        assert card[key] == PAYLOAD[key]
    assert card["command"] == PAYLOAD["command"]
    assert card["name"] == "demo"
    assert card["machine"]["torch"] == torch.__version__
    assert card["machine"]["cores"] == os.cpu_count()
    assert card["machine"]["printpress"] == printpress.__version__
    root = Path(printpress.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode == 0:
        assert card["machine"]["git_commit"] == head.stdout.strip()
        assert isinstance(card["machine"]["git_dirty"], bool)

    md = md_path.read_text()
    assert md.startswith(f"# demo — {card['created']}\n")
    assert "```\nprintpress eval --task demo --limit 3\n```" in md
    assert "| pass@1 | 0.125 |" in md and "| tokens_per_s | 1235 |" in md
    assert "| eos | [1, 2] |" in md
    assert f"**samples**: 3 records in [{json_path.name}]({json_path.name})" in md
    assert "T/0" not in md  # per-item records stay in the JSON
    assert "**note**: a \\| pipe" in md
    assert "| torch | " + torch.__version__ + " |" in md
    assert md.index("## Metrics") < md.index("## Settings") < md.index("## Model") < md.index("## Machine")


def test_two_reports_in_the_same_second_do_not_overwrite_each_other(tmp_path):
    first = write_report(tmp_path, "same", {"metrics": {"x": 1}})
    second = write_report(tmp_path, "same", {"metrics": {"x": 2}})
    assert first[0] != second[0]
    assert json.loads(first[0].read_text())["metrics"] == {"x": 1}
    assert json.loads(second[0].read_text())["metrics"] == {"x": 2}
    assert len(list(tmp_path.iterdir())) == 4


def test_the_command_defaults_to_this_process_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/usr/bin/printpress", "bench", "--prompt", "two words"])
    assert command_line() == "printpress bench --prompt 'two words'"
    json_path, _ = write_report(tmp_path, "bench", {"metrics": {}})
    assert json.loads(json_path.read_text())["command"] == "printpress bench --prompt 'two words'"


def test_bad_names_and_folders_are_clear_errors(tmp_path):
    with pytest.raises(PrintpressError, match="a report name may hold letters"):
        write_report(tmp_path, "../escape", {})
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PrintpressError, match=f"cannot create the results folder {blocker}"):
        write_report(blocker, "x", {})


def test_machine_facts_name_the_cpu_and_memory():
    facts = machine()
    assert facts["cpu"] and isinstance(facts["cpu"], str)
    assert facts["usable_cores"] <= facts["cores"]
    assert facts["memory_gb"] is None or facts["memory_gb"] > 0
    assert facts["torch_threads"] == torch.get_num_threads()
    assert facts["load_average_1m"] >= 0
    assert facts["weights_read_ahead"] == model_module.warm_choice()


def test_machine_facts_say_what_the_exact_layers_chose_for_reading_weights_ahead(monkeypatch):
    monkeypatch.setattr(model_module, "_warm_chosen", False)
    assert machine()["weights_read_ahead"] is None
    if not model_module.native_layers():
        return
    chosen = torch.ops.printpress_layers.warm_enabled()
    monkeypatch.setattr(model_module, "_warm_chosen", True)
    monkeypatch.setattr(model_module, "warm_measurement", (0.002, 0.001, 0.006, 0.007))
    assert machine()["weights_read_ahead"] == {
        "few_rows": chosen[0], "many_rows": chosen[1],
        "cycle_ms_1_row_without_with_32_rows_without_with": [2.0, 1.0, 6.0, 7.0]}
