"""`printpress bench` end to end on a tiny random checkpoint, and the headline arithmetic on made-up rows."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch

from printpress import cli
from printpress.config import GenerationConfig, ModelConfig, TextConfig
from printpress.corpora import Document, load_corpus, split_documents
from printpress.engine import Pipeline
from printpress.eval.bench import (
    YARDSTICK_SETTINGS,
    apply_preset,
    choose_prompts,
    draw_prompts,
    heldout_cache,
    heldout_prompts,
    register,
)
from printpress.eval.bench_sides import (
    AR_TWIN,
    OWN_AR,
    SETTING_KEYS,
    TABLE_CHAIN,
    BenchError,
    Sample,
    Trace,
    describe,
    parse_setting,
    seed_plan,
)
from printpress.eval.frontier import frontier, headline, judge_samples, matched_diversity, speed_at
from printpress.eval.judge import nll_per_char
from printpress.model import DiffusionGemma
from printpress.tokenizer import train_tokenizer

TEXT = "the cat sat on the mat, and the dog sat on the log. "
GREEDY, SPECULATIVE = "ar, temperature 0", "speculative, 1 steps, temperature 0, draft_source diffusion"
LOOKUP = "speculative, temperature 0, draft_source lookup"
TABLE = "speculative, temperature 0, draft_source table"
STOP = "diffusion, 24 steps, bound 12, confidence 2"


def _corpus(folder: Path) -> Path:
    """Eight documents of distinct lines, so a held-out window cannot occur in a training document by chance."""
    folder.mkdir()
    for i in range(8):
        lines = [f"doc {i} line {j}: the {('cat', 'dog')[j % 2]} sat on the {('mat', 'log')[(i + j) % 2]}.\n"
                 for j in range(40)]
        (folder / f"doc{i}.txt").write_text("".join(lines))
    return folder


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
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--prompts-file", str(prompts),
                             "--max-new-tokens", "16", "--seed", "3", "--seeds", "2", "--steps", "4", "2",
                             "--entropy-bounds", "0.1", "8", "--setting", "steps=4,t_max=0.4,t_min=0.1",
                             "--setting", "mode=ar,temperature=0",
                             "--setting", "mode=speculative,steps=1,draft_source=diffusion,temperature=0",
                             "--heldout-data", str(corpus),
                             "--heldout-seq-len", "16", "--heldout-batch-size", "2", "--heldout-batches", "1",
                             "--forward-reps", "2", "--gguf-judge", "off", "--results", str(root / "results"),
                             "--out", str(root / "pair.json"), "--no-progress", "--python"])
    finally:
        mp.undo()
    assert code == 0
    assert torch.get_num_threads() == threads  # --threads 1 does not leak into the caller
    card = json.loads((root / "pair.json").read_text())
    card["_root"], card["_stdout"], card["_stderr"] = root, stdout.getvalue(), stderr.getvalue()
    return card


def test_every_side_ran_every_prompt_and_seed_and_the_figures_add_up(report):
    rows = {r["label"]: r for r in report["rows"]}
    assert list(rows) == [AR_TWIN, OWN_AR, "diffusion, 4 steps, bound 0.1",
                          "diffusion, 4 steps, bound 8", "diffusion, 2 steps, bound 0.1", "diffusion, 2 steps, bound 8",
                          "diffusion, 4 steps, t 0.4->0.1", GREEDY, SPECULATIVE]
    for row in rows.values():
        # --seeds 2: two prompts, each decoded twice, and every figure pooled over the four samples.
        assert row["prompts"] == 2 and row["samples"] == 4
        assert row["new_tokens"] == 4 * 16
        assert len(row["judge_ar_twin_per_sample"]) == 4
        assert row["tokens_per_s"] == pytest.approx(row["new_tokens"] / row["seconds"])
        assert row["tokens_per_cpu_s"] == pytest.approx(row["new_tokens"] / row["cpu_seconds"])
        assert 0 < row["cpu_seconds"] <= row["seconds"] * 1.05  # one thread: CPU time cannot exceed wall time
        assert row["tokens_per_forward"] == pytest.approx(row["new_tokens"] / row["forward_passes"])
        assert row["all_passes"] == row["decoder_calls"] + row["encoder_calls"]
        assert row["tokens_per_forward_all_passes"] == pytest.approx(row["new_tokens"] / row["all_passes"])
        assert row["speed_ratio_vs_ar_twin"] == pytest.approx(row["tokens_per_s"] / rows[AR_TWIN]["tokens_per_s"])
        assert row["cpu_speed_ratio_vs_ar_twin"] == pytest.approx(
            row["tokens_per_cpu_s"] / rows[AR_TWIN]["tokens_per_cpu_s"])
        assert 0 <= row["repeated_4gram_share"] <= 1 and 0 < row["distinct_2"] <= 1
        assert row["unigram_entropy_nats"] >= 0
    for label in (AR_TWIN, OWN_AR, GREEDY):
        # AR: one token per forward, exactly, and every forward is an encoder pass (prefill included).
        assert rows[label]["tokens_per_forward"] == rows[label]["tokens_per_forward_all_passes"] == 1.0
        assert rows[label]["encoder_calls"] == rows[label]["forward_passes"] and rows[label]["decoder_calls"] == 0
    for steps, bound in ((4, 0.1), (4, 8), (2, 0.1), (2, 8)):
        row = rows[f"diffusion, {steps} steps, bound {bound:g}"]
        # No EOS and no confident stop from random weights: every canvas runs all its steps.
        assert row["canvases"] == 4 * 2 and row["adaptive_stops"] == 0
        assert row["decoder_calls"] == row["forward_passes"] == row["canvases"] * steps
        # The engine's count leaves out the encoder: the prefill and the pass that caches the first canvas.
        assert row["encoder_calls"] == 4 * 2
        assert row["tokens_per_forward"] == pytest.approx(8 / steps)
        assert row["tokens_per_forward_all_passes"] == pytest.approx(16 / (2 * steps + 2))
        assert row["steps_per_canvas"] == steps
        assert 1 <= row["accepted_per_step"] <= 8 and 1 <= row["final_step_accepted"] <= 8
        assert row["final_step_entropy_mean"] > 0.005  # random weights: far from the adaptive stop's bar
    # A looser bound accepts more tokens per step.
    assert rows["diffusion, 4 steps, bound 8"]["accepted_per_step"] > rows["diffusion, 4 steps, bound 0.1"][
        "accepted_per_step"]
    # Speculative decoding counts its prompt pass, drafts and verifications, as the engine does; at temperature 0
    # it writes greedy AR's text, and the bench checks that sample by sample.
    spec = rows[SPECULATIVE]
    assert spec["forward_passes"] == spec["all_passes"] == 4 + spec["decoder_calls"] + spec["verifications"]
    assert spec["same_text_as_ar_greedy"] == 1.0
    assert spec["speed_ratio_vs_ar_greedy"] == pytest.approx(spec["tokens_per_s"] / rows[GREEDY]["tokens_per_s"])


def test_matched_diversity_is_judged_against_ar_sampling_on_the_same_weights(report):
    rows = {r["label"]: r for r in report["rows"]}
    reference = report["diversity_reference"]
    assert reference["reference"] == OWN_AR
    assert reference["repeated_4gram_share"] == rows[OWN_AR]["repeated_4gram_share"]
    for row in rows.values():
        if row["kind"] == "ar":
            assert "matched_diversity" not in row
            continue
        expected = (row["repeated_4gram_share"] <= reference["repeated_4gram_share"] + 0.05
                    and row["unigram_entropy_nats"] >= 0.95 * reference["unigram_entropy_nats"])
        assert row["matched_diversity"] is expected
    head = report["headline"]["ar_twin/wall/matched-diversity"]
    matched = {r["label"] for r in report["rows"] if r.get("matched_diversity")}
    assert set(head["frontier"]) <= matched
    assert report["judges"]["ar_twin"]["model"] == report["model"]["ar"]
    assert len(report["judges"]["ar_twin"]["weights_sha256"]) == 16


def test_matched_diversity_thresholds():
    reference = {"repeated_4gram_share": 0.10, "unigram_entropy_nats": 5.0}

    def row(repeats: float, entropy: float) -> dict:
        return {"repeated_4gram_share": repeats, "unigram_entropy_nats": entropy}

    assert matched_diversity(row(0.15, 4.75), reference) is True  # at both limits
    assert matched_diversity(row(0.16, 5.0), reference) is False  # more repetitive
    assert matched_diversity(row(0.0, 4.7), reference) is False  # narrower vocabulary
    assert matched_diversity(row(0.0, 6.3), reference) is True  # broader is no gaming of the judge
    assert matched_diversity({"repeated_4gram_share": None, "unigram_entropy_nats": 5.0}, reference) is None


def test_judged_nll_is_the_judges_and_the_same_weights_agree(report, tiny):
    rows = {r["label"]: r for r in report["rows"]}
    judge = Pipeline.from_pretrained(str(tiny))
    texts = [s for s in report["samples"] if s["side"] == "diffusion, 2 steps, bound 8"]
    expected = [nll_per_char(judge, s["prompt"], s["text"]) for s in texts]
    # "\n" in the file is a newline; --seed 3 --seeds 2: prompt i of round r gets seed 3 + 2r + i.
    assert [(s["prompt"], s["seed"]) for s in texts] == [("the cat", 3), ("the dog sat\n", 4), ("the cat", 5),
                                                         ("the dog sat\n", 6)]
    again = judge.generate("the cat", seed=5, max_new_tokens=16, max_denoising_steps=2, entropy_bound=8.0)
    assert again.text == texts[2]["text"]  # the bench's sample is the engine's output for that seed and setting
    assert texts[0]["text"] != texts[2]["text"]  # another seed, another sample
    row = rows["diffusion, 2 steps, bound 8"]
    assert row["judge_ar_twin_per_sample"] == pytest.approx(expected)
    assert row["judge_ar_twin_nll_per_char"] == pytest.approx(sum(expected) / 4)
    # The standard error is over prompts: each prompt's two seeds are averaged first.
    per_prompt = [(expected[0] + expected[2]) / 2, (expected[1] + expected[3]) / 2]
    assert row["judge_ar_twin_stderr"] == pytest.approx(abs(per_prompt[0] - per_prompt[1]) / 2)
    joined = "".join(s["text"] for s in texts)
    assert row["whitespace_share"] == sum(c.isspace() for c in joined) / len(joined)
    # Twin and diffusion model are one checkpoint here: AR decoding gives the same text, hence the same score.
    twin, joint = rows[AR_TWIN], rows[OWN_AR]
    assert twin["judge_ar_twin_per_sample"] == joint["judge_ar_twin_per_sample"]


def test_seed_plan_gives_every_sample_its_own_seed():
    assert seed_plan(["a", "b"], 3, 10) == [("a", 10), ("b", 11), ("a", 12), ("b", 13), ("a", 14), ("b", 15)]
    assert seed_plan(["a", "b"]) == [("a", 0), ("b", 1)]  # one seed: prompt i with seed i, as before --seeds
    with pytest.raises(BenchError, match="--seeds"):
        seed_plan(["a"], 0)


def test_heldout_prompts_are_deterministic_and_never_training_text(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    train, val = split_documents(load_corpus([str(corpus)]), 0.05)
    prompts = heldout_prompts(6, [str(corpus)], 0.05)
    assert prompts == heldout_prompts(6, [str(corpus)], 0.05)
    assert len(set(prompts)) == 6
    for prompt in prompts:
        assert 80 <= len(prompt) <= 160 and prompt.endswith("\n")
        assert any(("\n" + prompt) in ("\n" + d.text) for d in val)  # whole lines of a held-out document
        assert not any(prompt in d.text for d in train)


def test_heldout_skip_draws_the_prompts_after_the_first_k(tmp_path, capsys):
    corpus = _corpus(tmp_path / "corpus")
    first_six = heldout_prompts(6, [str(corpus)], 0.05)
    prompts, source = choose_prompts(_parse("--heldout-prompts", "4", "--heldout-skip", "2", "--heldout-data",
                                            str(corpus)))
    assert prompts == first_six[2:]  # disjoint from the first two, which a run without the skip decodes
    assert "the 2 drawn first skipped" in source
    assert choose_prompts(_parse("--heldout-prompts", "2", "--heldout-data", str(corpus)))[0] == first_six[:2]
    for argv, words in [(["--heldout-skip", "3"], "got 3 without --heldout-prompts"),
                        (["--heldout-prompts", "2", "--heldout-skip", "-1"], "--heldout-skip must be a number")]:
        assert cli.main(["bench", *argv, "--no-heldout"]) == 2
        assert words in capsys.readouterr().err


def test_draw_prompts_skips_windows_found_in_training_text_and_says_when_it_runs_out():
    val = [Document("val", "".join(f"val line {j:02d}\n" for j in range(10)) + "train line 00\n")]
    train = [Document("train", "some text\ntrain line 00\n")]
    prompts = draw_prompts(val, 10, train, chars=14)
    assert sorted(prompts) == [f"val line {j:02d}\n" for j in range(10)]  # one line each: two would not fit
    assert draw_prompts(val, 10, train, chars=14, seed=1) != prompts  # the seed decides the order
    assert "train line 00\n" in draw_prompts(val, 11, [], chars=14)
    with pytest.raises(BenchError, match="only 10 usable"):
        draw_prompts(val, 11, train, chars=14)


def _parse(*argv: str):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return apply_preset(parser.parse_args(["bench", *argv]))


def test_the_yardstick_preset_parses_and_explicit_options_win():
    args = _parse("--yardstick")
    assert (args.heldout_prompts, args.seeds, args.max_new_tokens) == (24, 3, 64)
    assert (args.steps, args.entropy_bounds, args.setting) == ([32, 16, 8], [0.1, 1.0, 4.0], YARDSTICK_SETTINGS)
    assert [describe(parse_setting(s)) for s in args.setting] == [GREEDY, SPECULATIVE, LOOKUP, TABLE, STOP]
    args = _parse("--yardstick", "--steps", "4", "--seeds", "1", "--setting", "steps=2")
    assert (args.steps, args.seeds, args.max_new_tokens) == ([4], 1, 64)
    assert args.setting == [*YARDSTICK_SETTINGS, "steps=2"]
    # A setting the preset already measures (here spelled differently) is taken once, not refused as a repeat.
    again = _parse("--yardstick", "--setting", "confidence_threshold=2,steps=24,entropy_bound=12", "--setting", "steps=2")
    assert again.setting == [*YARDSTICK_SETTINGS, "steps=2"]
    assert _parse("--yardstick", "--prompts-file", "p.txt").heldout_prompts is None
    plain = _parse()
    assert (plain.heldout_prompts, plain.seeds, plain.max_new_tokens, plain.steps, plain.setting) == (
        None, 1, 96, [64, 32, 16, 8, 4], [])


@pytest.mark.slow  # a whole benchmark run through the command line
def test_the_yardstick_runs_end_to_end_on_held_out_prompts(tiny, tmp_path, capsys):
    """... with the diffusion side decoding canvases of 4 (`--canvas-length`; the checkpoint's are 8), and without
    the draft-table side, since this model has no table."""
    corpus = _corpus(tmp_path / "corpus")
    out = tmp_path / "yardstick.json"
    code = cli.main(["bench", "--yardstick", "--diffusion", str(tiny), "--ar", str(tiny), "--heldout-prompts", "2",
                     "--seeds", "2", "--steps", "2", "--entropy-bounds", "8", "--max-new-tokens", "16",
                     "--heldout-data", str(corpus), "--no-heldout", "--forward-reps", "1", "--gguf-judge", "off",
                     "--results", str(tmp_path / "results"), "--out", str(out), "--no-progress",
                     "--canvas-length", "4"])
    assert code == 0
    assert f"{tiny} has no draft table: the yardstick's '{TABLE}' side is left out" in capsys.readouterr().err
    card = json.loads(out.read_text())
    assert [r["label"] for r in card["rows"]] == [AR_TWIN, OWN_AR, "diffusion, 2 steps, bound 8", GREEDY, SPECULATIVE,
                                                   LOOKUP, STOP]
    assert card["settings"]["canvas_length"] == card["forward_cost"]["canvas_length"] == 4
    assert card["settings"]["yardstick"] is True and card["settings"]["samples_per_side"] == 4
    prompts = heldout_prompts(2, [str(corpus)], 0.05)
    assert sorted({s["prompt"] for s in card["samples"]}) == sorted(prompts)
    assert "held-out documents" in card["settings"]["prompt_source"]


def test_heldout_losses_come_from_the_training_loop(report):
    held = report["heldout"]
    assert set(held["diffusion"]) >= {"val_ar", "val_diffusion", "val_ar_nats_per_char", "chars_per_token"}
    assert "val_diffusion" not in held["ar"]
    # The AR NLL does not depend on which objective the validation runs under: same weights, same value.
    assert held["diffusion"]["val_ar"] == pytest.approx(held["ar"]["val_ar"], rel=1e-6)
    assert held["ar"]["val_ar_nats_per_char"] == pytest.approx(held["ar"]["val_ar"] / held["ar"]["chars_per_token"])
    assert math.isfinite(held["diffusion"]["val_diffusion"]) and held["diffusion"]["windows"] == 2


def test_heldout_token_files_are_cached_per_corpus_and_tokenizer(tmp_path):
    """Two run folders are both called `model`: the cache is named by what its tokens depend on instead, so two
    benchmarks at once of models with other tokenizers never write one file (and models that share one share it)."""
    from helpers import word_tokenizer

    small, large = word_tokenizer(40), word_tokenizer(41)
    assert heldout_cache(tmp_path, ["stdlib"], small) == heldout_cache(tmp_path, ["stdlib"], word_tokenizer(40))
    assert heldout_cache(tmp_path, ["stdlib"], small) != heldout_cache(tmp_path, ["stdlib"], large)
    assert heldout_cache(tmp_path, ["stdlib"], small) != heldout_cache(tmp_path, ["shakespeare"], small)
    assert heldout_cache(tmp_path, ["stdlib"], small).is_relative_to(tmp_path)
    folder = heldout_cache(tmp_path, ["/srv/corpora/my code"], small)  # a corpus folder's path: one folder level
    assert folder.parent.parent == tmp_path and folder.parent.name.startswith("my code-")


def test_heldout_losses_equal_the_training_loops_validation(report, tiny, tmp_path):
    """One evaluation function serves both: a Trainer started from the same checkpoint on the same data logs the
    bench's figures exactly (same windows, same fixed noise)."""
    from printpress.train.loop import RunConfig, Trainer

    run = RunConfig.from_dict({
        "init_from": str(tiny), "data": {"sources": [str(report["_root"] / "corpus")], "val_fraction": 0.05},
        "train": {"objective": "joint", "seq_len": 16, "batch_size": 2, "eval_batches": 1, "seed": 0},
    })
    losses = Trainer(run, tmp_path / "run").evaluate()
    held = report["heldout"]["diffusion"]
    assert losses == {"val_ar": held["val_ar"], "val_diffusion": held["val_diffusion"]}


def test_the_terminal_shows_a_legend_one_headline_and_warns_of_too_few_samples(report):
    out = report["_stdout"]
    header = out.splitlines()[0].split()
    assert header[:4] == ["side", "nll/char", "smollm", "tok/s"]
    legend = " ".join(line.strip() for line in out.splitlines() if line.startswith(("legend:", "  ")))
    for column in ("nll/char:", "xAR cpu:", "fwd all:", "div=:", "py:", "parse:", "TTFC s:", "st/can:", "H acc:",
                   "stops:"):
        assert column in legend
    assert out.count("headline") == 1 and "the AR twin" in out.splitlines()[-1]
    # Two prompts x two seeds: one line on stderr, with the number and what to pass instead.
    warning = [line for line in report["_stderr"].splitlines() if "warning" in line]
    assert len(warning) == 1
    assert "only 4 sample(s) per side (2 prompt(s) x 2 seed(s))" in warning[0] and "--seeds 4" in warning[0]


def test_python_shares_are_those_of_each_sides_samples(report):
    from printpress.eval.python_syntax import python_validity

    assert report["settings"]["python_syntax"] is True
    for row in report["rows"]:
        samples = [s for s in report["samples"] if s["side"] == row["label"]]
        shares = python_validity([s["prompt"] for s in samples], [s["text"] for s in samples])
        assert {k: row[k] for k in shares} == shares


def test_card_plot_and_headline(report):
    root = report["_root"]
    assert (root / "pair.png").stat().st_size > 10_000
    cards = sorted((root / "results").glob("*-bench.*"))
    assert [p.suffix for p in cards] == [".json", ".md", ".png"]
    page = cards[1].read_text()
    assert "| AR twin |" in page and "## Sides" in page
    # No second judge asked for.
    assert set(report["headline"]) == {"ar_twin/wall", "ar_twin/cpu", "ar_twin/wall/matched-diversity"}
    for name in ("ar_twin/wall", "ar_twin/cpu"):
        head = report["headline"][name]
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
    assert cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--canvas-length", "0"]) == 2
    assert capsys.readouterr().err == "printpress: error: --canvas-length must be a positive number of tokens, got 0\n"
    assert cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--compile", "fast"]) == 2
    assert capsys.readouterr().err == ("printpress: error: --compile 'fast' is not supported; use ar, decoder, all (or "
                                       "leave it out for the exact eager passes)\n")
    assert cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--compile-weights", "bfloat16"]) == 2
    assert capsys.readouterr().err == ("printpress: error: --compile-weights bfloat16 applies to compiled passes: give "
                                       "compile ar, decoder or all too\n")
    assert cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err.startswith("printpress: error: --dtype 'fp8' is not supported; use one of ")


def test_bench_decodes_in_another_dtype_and_judges_in_float32(tiny, tmp_path):
    out = tmp_path / "bf16.json"
    assert cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--steps", "2", "--entropy-bounds", "8",
                     "--max-new-tokens", "8", "--limit", "2", "--no-heldout", "--forward-reps", "1", "--gguf-judge",
                     "off", "--no-progress", "--results", str(tmp_path / "results"), "--dtype", "bfloat16",
                     "--out", str(out)]) == 0
    card = json.loads(out.read_text())
    assert card["settings"]["dtype"] == {"asked": "bfloat16", "diffusion": "bfloat16", "ar": "bfloat16"}
    # Decoded in bf16, judged by the float32 model: every sample's score is the exact judge's.
    judge = Pipeline.from_pretrained(str(tiny))
    bf16 = Pipeline.from_pretrained(str(tiny), dtype="bfloat16")
    for row in card["rows"]:
        texts = [s for s in card["samples"] if s["side"] == row["label"]]
        assert len(texts) == 2
        assert row["judge_ar_twin_per_sample"] == pytest.approx(
            [nll_per_char(judge, s["prompt"], s["text"]) for s in texts], rel=1e-6)
        assert row["judge_ar_twin_per_sample"] != pytest.approx(
            [nll_per_char(bf16, s["prompt"], s["text"]) for s in texts], rel=1e-6)


@pytest.mark.slow  # compiles the AR step and the prompt blocks with inductor
def test_bench_decodes_with_compiled_passes_and_judges_exactly(tiny, tmp_path):
    out = tmp_path / "compiled.json"
    assert cli.main(["bench", "--diffusion", str(tiny), "--ar", str(tiny), "--steps", "2", "--entropy-bounds", "8",
                     "--max-new-tokens", "8", "--no-heldout", "--forward-reps", "1", "--gguf-judge", "off",
                     "--no-progress", "--results", str(tmp_path / "results"), "--compile", "ar",
                     "--out", str(out)]) == 0
    card = json.loads(out.read_text())
    assert card["settings"]["compile"] == "ar"
    compiled = {"compiled_ar_step": "ok", "compiled_encoder": "ok"}  # both models decoded through their graphs
    assert card["settings"]["compiled_passes"] == {"diffusion": compiled, "ar": compiled}
    # Decoded through compiled graphs, judged by the exact model: every sample's score is the judge's.
    judge = Pipeline.from_pretrained(str(tiny))
    assert [row["label"] for row in card["rows"]] == [AR_TWIN, OWN_AR, "diffusion, 2 steps, bound 8"]
    for row in card["rows"]:
        texts = [s for s in card["samples"] if s["side"] == row["label"]]
        assert row["samples"] == len(texts) == 8 and row["new_tokens"] == 8 * 8  # the eight default prompts
        assert row["judge_ar_twin_per_sample"] == pytest.approx(
            [nll_per_char(judge, s["prompt"], s["text"]) for s in texts], rel=1e-6)


def test_setting_keys_are_the_sampler_settings_wire_names():
    """One definition (printpress.settings): every setting people write, but the budget the bench sets itself; a
    bad value is the settings' own message, as a BenchError."""
    from printpress.settings import BY_WIRE

    assert set(SETTING_KEYS) == set(BY_WIRE) - {"max_new_tokens"}
    assert parse_setting("mode=speculative,draft_steps=2,top_k=5") == {"mode": "speculative", "draft_steps": 2,
                                                                       "top_k": 5, "temperature": 0.8}
    for text, words in [("steps=0", "--setting 'steps=0': steps (max_denoising_steps) must be a positive integer"),
                        ("max_new_tokens=5", "expected key=value pairs with keys among mode, steps,"),
                        ("", "--setting '': give at least one key=value pair")]:
        with pytest.raises(BenchError, match=re.escape(words)):
            parse_setting(text)


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


def test_a_table_started_side_brings_the_tables_chain_alone_as_its_control(tiny, tmp_path):
    """A run with a `canvas_start=table` side also draws the draft table's chain alone for every prompt and seed
    (no network pass), judged and measured like the other sides but kept out of the diffusion frontier."""
    import shutil

    import numpy as np

    from printpress.draft_table import MIN_COUNT, DraftTable

    model = tmp_path / "with-table"
    shutil.copytree(tiny, model)
    pipe = Pipeline.from_pretrained(str(tiny))
    rows = np.array([pipe.encode_text(TEXT * 3)[:40]] * MIN_COUNT)
    DraftTable.from_rows(rows, first=2, longest=2, sampled_rows=rows).save(model / "draft_table.safetensors")
    out, prompts = tmp_path / "chain.json", tmp_path / "prompts.txt"
    prompts.write_text("the cat\nthe dog sat\n")
    code = cli.main(["bench", "--diffusion", str(model), "--ar", str(tiny), "--prompts-file", str(prompts),
                     "--max-new-tokens", "16", "--seeds", "2", "--steps", "2", "--entropy-bounds", "8",
                     "--setting", "steps=2,entropy_bound=8,canvas_start=table", "--no-heldout", "--forward-reps", "1",
                     "--gguf-judge", "off", "--results", str(tmp_path / "results"), "--out", str(out), "--no-progress"])
    assert code == 0
    card = json.loads(out.read_text())
    assert [r["label"] for r in card["rows"]][-2:] == ["diffusion, 2 steps, bound 8, canvas_start table", TABLE_CHAIN]
    chain = card["rows"][-1]
    assert chain["kind"] == "chain" and chain["forward_passes"] == 0 and chain["all_passes"] == 0
    table = Pipeline.from_pretrained(str(model)).model.draft_table
    samples = [s for s in card["samples"] if s["side"] == TABLE_CHAIN]
    assert len(samples) == 4
    for sample in samples:  # exactly the table's chain after the prompt, drawn with the sample's seed
        drawn, _ = table.sample(pipe.encode_text(sample["prompt"]), 16, torch.Generator().manual_seed(sample["seed"]))
        assert drawn and sample["text"] == pipe.decode(drawn)
        assert math.isclose(chain["judge_ar_twin_per_sample"][samples.index(sample)],
                            nll_per_char(pipe, sample["prompt"], sample["text"]), rel_tol=1e-9)
    assert TABLE_CHAIN not in card["headline"]["ar_twin/wall"]["frontier"]
    assert "matched_diversity" in chain


def test_judged_gap_pairs_the_sides_by_prompt():
    from printpress.eval.frontier import judged_gap

    # Prompts of very different difficulty, the side 10% behind AR on every one: pairing leaves no doubt.
    ar = [0.5, 0.6, 1.5, 1.4, 3.0, 3.2]
    side = [1.1 * x for x in ar]
    prompts = ["easy", "easy", "mid", "mid", "hard", "hard"]
    gap, low, high = judged_gap(side, ar, prompts)
    assert math.isclose(gap, 0.1) and math.isclose(low, 0.1) and math.isclose(high, 0.1)
    # A side that is better on the easy prompt and worse on the hard one is uncertain either way.
    _, low, high = judged_gap([0.4, 0.5, 1.5, 1.4, 3.6, 3.8], ar, prompts)
    assert low < 0 < high
    # An empty sample is left out of its own side's mean only.
    assert judged_gap([float("nan"), 1.1, 2.2, 2.2], [1.0, 1.0, 2.0, 2.0], ["a", "a", "b", "b"])[0] == \
        pytest.approx((1.1 + 4.4) / 3 / 1.5 - 1)
    with pytest.raises(ValueError, match="as many samples on both sides, not 2 and 3"):
        judged_gap([1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="1 prompts for 2 samples"):
        judged_gap([1.0, 1.0], [1.0, 1.0], ["a"])


def test_judged_gap_is_the_ratio_of_mean_judgements_with_a_repeatable_interval(report):
    from printpress.eval.frontier import judged_gap

    assert judged_gap([2.0, 2.0, float("nan")], [1.0, 1.0, None]) == (1.0, 1.0, 1.0)  # empty samples left out
    assert judged_gap([float("nan")], [1.0]) is None
    reference = next(r for r in report["rows"] if r["label"] == OWN_AR)
    assert "judge_ar_twin_gap" not in reference
    sides = [r for r in report["rows"] if r["label"] != OWN_AR]
    prompts = [s["prompt"] for s in report["samples"] if s["side"] == OWN_AR]
    assert len(set(prompts)) < len(prompts)  # several seeds per prompt: the interval resamples prompts
    for row in sides:
        values, ar = row["judge_ar_twin_per_sample"], reference["judge_ar_twin_per_sample"]
        gap, (low, high) = row["judge_ar_twin_gap"], row["judge_ar_twin_gap_90"]
        assert math.isclose(gap, sum(values) / len(values) / (sum(ar) / len(ar)) - 1, rel_tol=1e-12)
        assert low <= gap <= high and (low, high) == judged_gap(values, ar, prompts)[1:]
    assert "gap" not in report["_stdout"].splitlines()[0].split()  # SmolLM2's column only where it judged
