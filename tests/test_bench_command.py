"""`printpress bench` end to end on a tiny random checkpoint, and the headline arithmetic on made-up rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from printpress import cli
from printpress.config import GenerationConfig, ModelConfig, TextConfig
from printpress.engine import Pipeline
from printpress.eval.bench import (
    Sample,
    Trace,
    describe,
    frontier,
    headline,
    judge_samples,
    parse_setting,
    speed_at,
)
from printpress.eval.judge import nll_per_char
from printpress.model import DiffusionGemma
from printpress.tokenizer import train_tokenizer

TEXT = "the cat sat on the mat, and the dog sat on the log. "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from printpress.checkpoint import save_model

    tokenizer = train_tokenizer([TEXT * 20], 300)
    text = TextConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                      sliding_window=8, layer_types=["sliding_attention", "full_attention"], num_experts=2,
                      top_k_experts=1, moe_intermediate_size=8, initializer_range=0.3, max_position_embeddings=256)
    torch.manual_seed(0)
    generation = GenerationConfig.from_dict({"max_denoising_steps": 4, "eos_token_id": []}, text)
    return save_model(DiffusionGemma(text).eval(), ModelConfig(text, canvas_length=8),
                      tmp_path_factory.mktemp("bench") / "tiny", generation, tokenizer)


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory) -> dict:
    """One bench run; the same checkpoint serves as the diffusion model and as its AR twin."""
    root = tmp_path_factory.mktemp("bench-run")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(TEXT * (15 + i))
    prompts = root / "prompts.txt"
    prompts.write_text("the cat\nthe dog sat\\n\n")
    threads = torch.get_num_threads()
    mp = pytest.MonkeyPatch()
    mp.setenv("PRINTPRESS_CACHE", str(root / "cache"))
    try:
        code = cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--prompts-file", str(prompts),
                         "--max-new-tokens", "16", "--seed", "3", "--steps", "4", "2", "--entropy-bounds", "0.1", "8",
                         "--setting", "steps=4,t_max=0.4,t_min=0.1", "--heldout-data", str(corpus),
                         "--heldout-seq-len", "16", "--heldout-batch-size", "2", "--heldout-batches", "1",
                         "--forward-reps", "2", "--gguf-judge", "off", "--results", str(root / "results"),
                         "--out", str(root / "pair.json"), "--no-progress"])
    finally:
        mp.undo()
    assert code == 0
    assert torch.get_num_threads() == threads  # --threads 1 does not leak into the caller
    card = json.loads((root / "pair.json").read_text())
    card["_root"] = root
    return card


def test_every_side_ran_every_prompt_and_the_figures_add_up(report):
    rows = {r["label"]: r for r in report["rows"]}
    assert list(rows) == ["AR twin", "diffusion model, AR decoding", "diffusion, 4 steps, bound 0.1",
                          "diffusion, 4 steps, bound 8", "diffusion, 2 steps, bound 0.1", "diffusion, 2 steps, bound 8",
                          "diffusion, 4 steps, t 0.4->0.1"]
    for row in rows.values():
        assert row["prompts"] == 2
        assert row["tokens_per_s"] == pytest.approx(row["new_tokens"] / row["seconds"])
        assert row["tokens_per_cpu_s"] == pytest.approx(row["new_tokens"] / row["cpu_seconds"])
        assert 0 < row["cpu_seconds"] <= row["seconds"] * 1.05  # one thread: CPU time cannot exceed wall time
        assert row["tokens_per_forward"] == pytest.approx(row["new_tokens"] / row["forward_passes"])
        assert row["speed_ratio_vs_ar_twin"] == pytest.approx(row["tokens_per_s"] / rows["AR twin"]["tokens_per_s"])
        assert row["cpu_speed_ratio_vs_ar_twin"] == pytest.approx(
            row["tokens_per_cpu_s"] / rows["AR twin"]["tokens_per_cpu_s"])
    for label in ("AR twin", "diffusion model, AR decoding"):
        # AR: one token per forward, exactly, and every forward is an encoder pass (prefill included).
        assert rows[label]["tokens_per_forward"] == 1.0
        assert rows[label]["new_tokens"] == 2 * 16
        assert rows[label]["encoder_calls"] == rows[label]["forward_passes"] and rows[label]["decoder_calls"] == 0
    for steps, bound in ((4, 0.1), (4, 8), (2, 0.1), (2, 8)):
        row = rows[f"diffusion, {steps} steps, bound {bound:g}"]
        # No EOS and no confident stop from random weights: every canvas runs all its steps.
        assert row["canvases"] == 2 * 2 and row["adaptive_stops"] == 0
        assert row["decoder_calls"] == row["forward_passes"] == row["canvases"] * steps
        assert row["steps_per_canvas"] == steps
        assert row["tokens_per_forward"] == pytest.approx(8 / steps)
        assert 1 <= row["accepted_per_step"] <= 8 and 1 <= row["final_step_accepted"] <= 8
        assert row["final_step_entropy_mean"] > 0.005  # random weights: far from the adaptive stop's bar
    # A looser bound accepts more tokens per step.
    assert rows["diffusion, 4 steps, bound 8"]["accepted_per_step"] > rows["diffusion, 4 steps, bound 0.1"][
        "accepted_per_step"]


def test_judged_nll_is_the_judges_and_the_same_weights_agree(report, tiny):
    rows = {r["label"]: r for r in report["rows"]}
    judge = Pipeline.from_pretrained(str(tiny))
    texts = [s for s in report["samples"] if s["side"] == "diffusion, 2 steps, bound 8"]
    expected = [nll_per_char(judge, s["prompt"], s["text"]) for s in texts]
    assert [s["prompt"] for s in texts] == ["the cat", "the dog sat\n"]  # "\n" in the file is a newline
    assert [s["seed"] for s in texts] == [3, 4]  # --seed 3: prompt i gets seed 3 + i
    again = judge.generate("the cat", seed=3, max_new_tokens=16, max_denoising_steps=2, entropy_bound=8.0)
    assert again.text == texts[0]["text"]  # the bench's sample is the engine's output for that seed and setting
    assert rows["diffusion, 2 steps, bound 8"]["judge_ar_twin_per_prompt"] == pytest.approx(expected)
    assert rows["diffusion, 2 steps, bound 8"]["judge_ar_twin_nll_per_char"] == pytest.approx(sum(expected) / 2)
    joined = "".join(s["text"] for s in texts)
    assert rows["diffusion, 2 steps, bound 8"]["whitespace_share"] == sum(c.isspace() for c in joined) / len(joined)
    # Twin and diffusion model are one checkpoint here: AR decoding gives the same text, hence the same score.
    twin, joint = rows["AR twin"], rows["diffusion model, AR decoding"]
    assert twin["judge_ar_twin_per_prompt"] == joint["judge_ar_twin_per_prompt"]


def test_heldout_losses_come_from_the_training_loop(report):
    held = report["heldout"]
    assert set(held["diffusion"]) >= {"val_ar", "val_diffusion", "val_ar_nats_per_char", "chars_per_token"}
    assert "val_diffusion" not in held["ar"]
    # The AR NLL does not depend on which objective the validation runs under: same weights, same value.
    assert held["diffusion"]["val_ar"] == pytest.approx(held["ar"]["val_ar"], rel=1e-6)
    assert held["ar"]["val_ar_nats_per_char"] == pytest.approx(held["ar"]["val_ar"] / held["ar"]["chars_per_token"])
    assert math.isfinite(held["diffusion"]["val_diffusion"]) and held["diffusion"]["windows"] == 2


def test_card_plot_and_headline(report):
    root = report["_root"]
    assert (root / "pair.png").stat().st_size > 10_000
    cards = sorted((root / "results").glob("*-bench.*"))
    assert [p.suffix for p in cards] == [".json", ".md", ".png"]
    page = cards[1].read_text()
    assert "| AR twin |" in page and "## Sides" in page
    assert set(report["headline"]) == {"ar_twin/wall", "ar_twin/cpu"}  # no second judge asked for
    for name, head in report["headline"].items():
        speed = "tokens_per_s" if name.endswith("wall") else "tokens_per_cpu_s"
        assert head["speed"] == speed and head["ar_twin_speed"] == report["rows"][0][speed]
        assert head["ar_twin_nll_per_char"] == report["rows"][0]["judge_ar_twin_nll_per_char"]
        assert set(head["frontier"]) <= {r["label"] for r in report["rows"] if r["kind"] == "diffusion"}
        best = head["best_diffusion"]
        assert best["nll_per_char"] == min(r["judge_ar_twin_nll_per_char"] for r in report["rows"]
                                           if r["kind"] == "diffusion")
        assert head["quality_gap_nats_per_char"] == pytest.approx(best["nll_per_char"] - head["ar_twin_nll_per_char"])
    assert report["forward_cost"]["canvas_length"] == 8 and report["forward_cost"]["decoder_forward_ms"] > 0
    assert len(report["info"]["load_average_start"]) == 3


def _row(label, nll, speed, kind="diffusion"):
    return {"label": label, "kind": kind, "judge_ar_twin_nll_per_char": nll, "tokens_per_s": speed,
            "tokens_per_forward": 1.0}


def test_headline_reports_the_ratio_at_matched_quality_when_it_exists():
    rows = [_row("AR twin", 1.0, 100.0, "ar"), _row("slow good", 0.9, 50.0), _row("fast bad", 1.3, 400.0),
            _row("dominated", 1.4, 300.0)]
    assert [r["label"] for r in frontier(rows, "judge_ar_twin_nll_per_char")] == ["fast bad", "slow good"]
    head = headline(rows)
    # log-linear between (0.9, 50) and (1.3, 400) at 1.0: 50 * 8 ** 0.25
    assert head["matched_quality_reached"] is True
    assert head["ratio_at_matched_quality"] == pytest.approx(50 * 8**0.25 / 100)


def test_headline_without_matched_quality_reports_best_ratio_gap_and_levels():
    rows = [_row("AR twin", 1.0, 100.0, "ar"), _row("a", 1.9, 80.0), _row("b", 2.2, 160.0), _row("c", 2.9, 600.0)]
    head = headline(rows)
    assert head["matched_quality_reached"] is False and head["ratio_at_matched_quality"] is None
    assert head["best_diffusion"]["label"] == "a" and head["best_diffusion"]["ratio_vs_ar_twin"] == 0.8
    assert head["quality_gap_nats_per_char"] == pytest.approx(0.9)
    levels = {round(x["nll_per_char"], 2): x["speed"] for x in head["speed_at_quality"]}
    assert sorted(levels) == [1.0, 1.9, 2.0, 2.25, 2.5, 2.75]
    assert levels[1.0] is None and levels[1.9] == pytest.approx(80.0)
    assert levels[2.0] == pytest.approx(80 * 2 ** (1 / 3))
    assert levels[2.5] == pytest.approx(160 * (600 / 160) ** (0.3 / 0.7))
    assert speed_at(frontier(rows, "judge_ar_twin_nll_per_char"), "judge_ar_twin_nll_per_char", 5.0) == 600.0


def test_settings_parse_and_bad_ones_are_one_line_errors(capsys, tiny):
    assert parse_setting("steps=8,entropy_bound=4,sample_accepted_only=true") == {
        "max_denoising_steps": 8, "entropy_bound": 4.0, "sample_accepted_only": True}
    assert describe(parse_setting("steps=16,entropy_bound=1,t_max=0.4,t_min=0.1,sample_accepted_only=1")) == \
        "diffusion, 16 steps, bound 1, t 0.4->0.1, accepted-only"
    assert describe(parse_setting("mode=speculative,steps=1,confidence_threshold=0.5")) == \
        "speculative, 1 steps, confidence 0.5"
    assert parse_setting("mode=speculative,steps=1") == {"temperature": 0.8, "top_k": 50, "mode": "speculative",
                                                         "max_denoising_steps": 1}
    assert cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--setting", "stepz=3"]) == 2
    assert "expected key=value pairs with keys among" in capsys.readouterr().err
    assert cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--setting", "t_min=0.9,t_max=0.5",
                     "--no-heldout"]) == 2
    assert "t_min (0.9) must not exceed t_max (0.5)" in capsys.readouterr().err


class _LengthJudge:
    """A stand-in second judge: scores a completion by its length, so the column's wiring can be checked."""

    def nll_per_char(self, prompt: str, completion: str) -> float:
        return float(len(prompt) + len(completion))


def test_a_second_judge_scores_every_sample_in_its_own_column(tiny):
    twin = Pipeline.from_pretrained(str(tiny))
    samples = {"x": [Sample("x", "the cat", 0, " sat on", 3, 3, 0.1, 0.1, None, Trace(), {}),
                     Sample("x", "the dog", 1, "", 0, 1, 0.1, 0.1, None, Trace(), {})]}
    scores = judge_samples(samples, twin, _LengthJudge(), progress=False)["x"]
    assert scores["gguf"] == [14.0, 7.0]
    assert scores["ar_twin"][0] == pytest.approx(nll_per_char(twin, "the cat", " sat on"))
    assert math.isnan(scores["ar_twin"][1])
