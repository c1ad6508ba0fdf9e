"""bench/engine_speed.py --model: a trained checkpoint's own generation config against the reference, on held-out
prompts, with the reference's tokens demanded (the script exits on any difference)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import bench_module, make_reference, save_checkpoint, word_tokenizer

engine_speed = bench_module("engine_speed")


def test_a_checkpoint_folder_is_benched_with_its_own_settings_and_the_references_tokens(tmp_path):
    ref = make_reference("gqa", seed=1, canvas_length=8)
    with torch.no_grad():  # peaked logits: tokens accepted early, so the adaptive stop and t_min/t_max matter
        ref.model.decoder.embed_tokens.weight.mul_(30)
    folder = save_checkpoint(ref, tmp_path / "trained", word_tokenizer(128), max_denoising_steps=5, t_min=0.4,
                             t_max=0.8, entropy_bound=2.0)
    out = tmp_path / "speed.json"
    report = engine_speed.bench_model(str(folder), engine_speed.build_parser().parse_args([
        "--model", str(folder), "--heldout-prompts", "2", "--max-new-tokens", "16", "--repeats", "1",
        "--forward-reps", "2", "--canvas-sweep", "1", "8", "--out", str(out)]))

    assert report["settings"]["steps"] == 5 and report["settings"]["canvas_length"] == 8
    assert len(report["settings"]["prompt_lengths"]) == 2
    generate = report["generate"]
    assert generate["parity"]["one_at_a_time_identical"] is True
    assert generate["reference"]["new_tokens"] == generate["printpress"]["new_tokens"] > 0
    assert json.loads(out.read_text())["size"] == "trained"
    assert [p["canvas"] for p in report["forward_cost"]["points"]] == [1, 8]


def test_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^engine_speed: .*nowhere: no such model folder"):
        engine_speed.main(["--model", str(tmp_path / "nowhere")])
