"""Infilling and span rewriting: the suffix stays clamped in the canvas, the text outside the span is kept
byte for byte, seeds repeat, the length search scores what it says, and bad input is one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_reference, save_checkpoint, word_tokenizer

import printpress
from printpress import editing
from printpress.cli import main
from printpress.engine import CommitEvent, DoneEvent, StepEvent
from printpress.errors import GenerationError

REPO = Path(__file__).resolve().parents[1]
CANVAS = 8
TEXT = "w5 w6 w7  w8\nw9 w10 w11 w12 w13"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("editing")
    text = save_checkpoint(make_reference("gqa", canvas_length=CANVAS), root / "text", word_tokenizer(128))
    ids = save_checkpoint(make_reference("gqa", canvas_length=CANVAS, seed=1), root / "ids")
    return {"text": str(text), "ids": str(ids)}


@pytest.fixture(scope="module")
def pipe(folders):
    return printpress.load(folders["text"])


def events_of(pipe, *args, **kwargs) -> list:
    return list(editing.infill_stream(pipe, *args, **kwargs))


# -- the canvas ---------------------------------------------------------------------------------------------


def test_clamped_suffix_positions_never_change_across_steps(pipe):
    suffix_ids = [20, 21, 22, 23, 24, 25, 26]
    events = events_of(pipe, "w7 w9", " ".join(f"w{t}" for t in suffix_ids), length=3, seed=4)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert isinstance(steps[0], editing.SpanStepEvent)
    assert len(steps) == pipe.default_settings().max_denoising_steps == 5
    for event in steps:
        assert event.span == 3 and len(event.tokens) == CANVAS
        assert event.tokens[3:] == suffix_ids[: CANVAS - 3]  # what fills the trained canvas, never re-noised
        assert event.argmax[3:] == suffix_ids[: CANVAS - 3]
        assert event.accepted[3:] == [True] * (CANVAS - 3)
    # the free positions do move: uniform noise at first, re-noised where not accepted
    assert len({tuple(e.tokens[:3]) for e in steps}) > 1
    commit, done = events[-2], events[-1]
    assert isinstance(commit, CommitEvent) and isinstance(done, DoneEvent)
    assert commit.token_ids == done.result.middle_ids == steps[-1].argmax[:3]
    assert done.result.stats.clamped_tokens == CANVAS - 3 and done.result.stats.suffix_tokens == 7


def test_suffix_window_sets_how_much_of_the_suffix_the_decoder_sees(pipe):
    suffix = "w20 w21 w22 w23 w24 w25 w26"
    none = [e for e in events_of(pipe, "w7", suffix, length=2, seed=0, suffix_window=0) if isinstance(e, StepEvent)]
    wide = [e for e in events_of(pipe, "w7", suffix, length=2, seed=0, suffix_window=20) if isinstance(e, StepEvent)]
    assert {len(e.tokens) for e in none} == {2}
    assert {len(e.tokens) for e in wide} == {2 + 7}  # a canvas longer than trained, the whole suffix in it
    assert all(e.tokens[2:] == list(range(20, 27)) for e in wide)


def test_sample_accepted_only_keeps_the_clamp_too(pipe):
    events = events_of(pipe, "w7", "w30 w31", length=4, seed=1, sample_accepted_only=True)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert steps and all(e.tokens[4:] == [30, 31] for e in steps)


def test_the_window_opens_over_the_free_positions_only(pipe):
    # 6 free positions, 5 steps, lead 1: a step j may keep only the first ceil(6 j / 5) of them (2, 3, 4, 5, 6); the
    # clamped suffix is kept throughout, and a loose bound keeps every position the window opened.
    events = events_of(pipe, "w7", "w30 w31", length=6, seed=3, window_lead=1.0, entropy_bound=1e3)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [e.accepted for e in steps] == [[i < opened for i in range(6)] + [True, True] for opened in (2, 3, 4, 5, 6)]
    plain = [e for e in events_of(pipe, "w7", "w30 w31", length=6, seed=3, entropy_bound=1e3) if isinstance(e, StepEvent)]
    assert plain[0].accepted == [True] * CANVAS


def test_special_tokens_are_never_chosen_for_the_middle(pipe):
    # Declaring almost the whole vocabulary end-of-sequence leaves only [UNK] (3) and w120..w127 choosable.
    result = editing.infill(pipe, "w7", "w9", length=CANVAS - 1, seed=2, eos_token_ids=list(range(1, 120)))
    assert result.middle_ids and all(t == 3 or t >= 120 for t in result.middle_ids)


# -- rewrite --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("start,end", [(6, 14), (0, 2), (25, len(TEXT)), (3, 5)])
def test_rewrite_keeps_the_text_outside_the_span_exactly(pipe, start, end):
    result = editing.rewrite(pipe, TEXT, start, end, seed=3)
    assert result.text[: result.start] == TEXT[:start] and result.start == start
    assert result.text[result.end:] == TEXT[end:]
    assert result.text[result.start : result.end] == result.middle == pipe.decode(result.middle_ids)
    # the default length is the old span's token count
    assert len(result.middle_ids) == len(pipe.tokenizer.encode(TEXT[start:end], add_special_tokens=False).ids)


def test_rewrite_conditions_on_the_text_around_the_span(pipe):
    events = list(editing.rewrite_stream(pipe, TEXT, 6, 12, seed=0))  # "w7  w8" -> 2 new tokens
    step = next(e for e in events if isinstance(e, StepEvent))
    assert step.span == 2 and step.tokens[2:] == [9, 10, 11, 12, 13]  # the whole suffix fits


def test_insertion_at_an_empty_span_needs_a_length(pipe):
    result = editing.rewrite(pipe, TEXT, 3, 3, length=2, seed=0)
    assert len(result.middle_ids) == 2 and result.text == TEXT[:3] + result.middle + TEXT[3:]
    with pytest.raises(GenerationError, match=r"the span is empty \(start == end\); give a length"):
        editing.rewrite(pipe, TEXT, 3, 3)


# -- seeds and the length search ------------------------------------------------------------------------------


def test_a_seed_repeats_the_events_and_another_changes_them(pipe):
    first = events_of(pipe, "w7 w9", "w11 w12", length=5, seed=11)
    again = events_of(pipe, "w7 w9", "w11 w12", length=5, seed=11)
    other = events_of(pipe, "w7 w9", "w11 w12", length=5, seed=12)
    steps = [[e.tokens for e in run if isinstance(e, StepEvent)] for run in (first, again, other)]
    assert steps[0] == steps[1] and steps[0] != steps[2]
    assert first[-1].result.middle_ids == again[-1].result.middle_ids
    torch.manual_seed(5)
    unseeded = editing.infill(pipe, "w7", "w8", length=3)
    torch.manual_seed(5)
    assert editing.infill(pipe, "w7", "w8", length=3).middle_ids == unseeded.middle_ids


def test_length_search_keeps_the_candidate_after_which_the_suffix_is_most_probable(pipe):
    prefix, suffix = "w7 w9 w4", "w11 w12 w13 w14 w15 w16 w17 w18 w19 w20"
    result = editing.infill(pipe, prefix, suffix, length=[1, 3, 6], seed=20)
    assert [c.length for c in result.candidates] == [1, 3, 6]
    best = min(result.candidates, key=lambda c: c.suffix_nll)
    assert all(c.score == c.suffix_nll and c.suffix_tokens == CANVAS for c in result.candidates)
    assert result.middle_ids == best.middle_ids and result.stats.length == best.length
    assert result.seed == 20 and result.stats.candidates == 3  # the seed as given, whichever candidate won
    # candidate i is exactly what a fixed-length infill with seed + i produces
    for i, candidate in enumerate(result.candidates):
        assert candidate.seed == 20 + i
        alone = editing.infill(pipe, prefix, suffix, length=candidate.length, seed=20 + i)
        assert alone.middle_ids == candidate.middle_ids and alone.candidates == []
    # the NLLs are the causal head's: of the middle after <bos> prefix, and of the first canvas_length suffix
    # tokens after it (the same tokens for every candidate, so the scores compare like with like)
    candidate = result.candidates[1]
    prefix_ids = pipe.tokenizer.encode(prefix, add_special_tokens=False).ids
    scored = pipe.tokenizer.encode(suffix, add_special_tokens=False).ids[:CANVAS]
    ids = [2] + prefix_ids + candidate.middle_ids + scored
    with torch.no_grad():
        logits = pipe.model.encode(torch.tensor([ids]), pipe.model.new_cache(1, len(ids)))[0]
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    start, middle_end = 1 + len(prefix_ids), 1 + len(prefix_ids) + candidate.length
    assert candidate.middle_nll == pytest.approx(-sum(float(logp[p - 1, ids[p]]) for p in range(start, middle_end)),
                                                 abs=1e-3)
    assert candidate.suffix_nll == pytest.approx(-sum(float(logp[p - 1, ids[p]]) for p in range(middle_end, len(ids))),
                                                 abs=1e-3)


def test_without_a_suffix_the_search_scores_the_middle_per_token(pipe):
    result = editing.infill(pipe, "w7 w9 w4", "", length=[2, 5], seed=3)
    assert all(c.suffix_tokens == 0 and c.suffix_nll == 0 for c in result.candidates)
    assert [c.score for c in result.candidates] == [c.middle_nll / c.length for c in result.candidates]
    assert result.middle_ids == min(result.candidates, key=lambda c: c.middle_nll / c.length).middle_ids


@pytest.mark.slow  # three length searches and a rewrite on the shipped model
def test_blanks_at_the_joins_are_not_doubled():
    """A prefix ending with a blank ("what ") is given to the model without it, so the middle's first word brings its
    own (" light", as the BPE writes words) and the join has one blank, not two; a blank before a suffix that starts
    with one is dropped. The text outside the middle is never changed."""
    shipped = printpress.load()
    prefix, suffix = "ROMEO.\nBut soft, what ", " breaks?\n"
    for seed in range(3):
        result = editing.infill(shipped, prefix, suffix, length=[2, 4, 6], seed=seed)
        assert result.text == prefix + result.middle + suffix and result.text[result.start:result.end] == result.middle
        assert not result.middle.startswith((" ", "\t")) and not result.middle.endswith((" ", "\t"))
        assert result.stats.prefix_tokens == len(shipped.encode_text(prefix.rstrip(" ")))
        assert all(not c.middle.startswith(" ") for c in result.candidates)
    text = "ROMEO.\nBut soft, what light through yonder window breaks?\n"
    rewritten = editing.rewrite(shipped, text, 22, 49, seed=0)  # "light through yonder window"
    assert rewritten.text.startswith("ROMEO.\nBut soft, what ") and rewritten.text.endswith(" breaks?\n")
    assert "  " not in rewritten.text[18:rewritten.end + 2]
    # the span's length is counted as the model writes it, with the blank before it
    assert rewritten.stats.length == len(shipped.tokenizer.encode(" light through yonder window",
                                                                  add_special_tokens=False).ids)


def test_default_lengths_are_fractions_of_the_canvas():
    assert editing.default_lengths(32) == [4, 8, 12, 16, 24]
    assert editing.default_lengths(8) == [1, 2, 3, 4, 6]


def test_token_ids_work_without_a_tokenizer(folders):
    pipe = printpress.load(folders["ids"])
    result = editing.infill(pipe, [5, 6, 7], [9, 10], length=3, seed=0)
    assert len(result.middle_ids) == 3 and result.text is None and result.middle is None
    with pytest.raises(GenerationError, match="this model has no tokenizer"):
        editing.infill(pipe, "w5", "w6", length=2)


# -- errors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"prefix": "", "suffix": ""}, "nothing to condition on: the prefix and the suffix are both empty"),
        ({"length": 0}, "length must be a positive integer, got 0"),
        ({"length": -2}, "length must be a positive integer, got -2"),
        ({"length": "3"}, "length must be a positive integer or a list of them, got '3'"),
        ({"length": CANVAS + 1}, f"length {CANVAS + 1} exceeds the canvas of {CANVAS} tokens"),
        ({"length": [2, 0]}, "length must be a positive integer, got 0"),
        ({"suffix_window": -1}, "suffix_window must be an integer >= 0, got -1"),
        ({"mode": "ar"}, "editing uses the diffusion sampler; mode='ar' is not supported"),
        ({"max_denoising_steps": 0}, "steps (max_denoising_steps) must be a positive integer"),
        ({"beam": 3}, "unknown generation setting(s): beam"),
        ({"max_new_tokens": 4}, "editing generates `length` tokens; max_new_tokens does not apply"),
        ({"top_k": 5}, "top_k=5 does not apply to mode='diffusion'"),
        ({"prefix": [5, 999]}, "token id 999 is outside the vocabulary (0..127)"),
        ({"seed": -1}, "a seed must be an integer in [0, 2**64), got -1"),
        ({"prefix": "w5 " * 510}, "the model's position limit is 512; shorten the prefix"),
    ],
)
def test_bad_infill_input_is_one_clear_error(pipe, kwargs, message):
    args = {"prefix": "w5", "suffix": "w6", "length": 2}
    args.update(kwargs)
    with pytest.raises(GenerationError) as caught:
        editing.infill(pipe, args.pop("prefix"), args.pop("suffix"), **args)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "start,end,message",
    [
        (5, 2, "the span start 5 is after its end 2"),
        (-1, 2, "the span start -1 is negative"),
        (0, len(TEXT) + 1, f"the span end {len(TEXT) + 1} is beyond the text's {len(TEXT)} characters"),
        (0, len(TEXT), f"but a span is rewritten in one canvas of {CANVAS}"),
        ("0", 2, "a span is two integer character offsets"),
    ],
)
def test_bad_span_is_one_clear_error(pipe, start, end, message):
    with pytest.raises(GenerationError) as caught:
        editing.rewrite(pipe, TEXT, start, end)
    assert message in str(caught.value)


# -- the command line -----------------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["edit", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_infill_prints_what_the_library_returns(folders, capsys):
    code, out, _ = run_cli(capsys, "-m", folders["text"], "--prefix", "w7 w9", "--suffix", "w11", "--length", "3",
                           "--seed", "6")
    expected = editing.infill(printpress.load(folders["text"]), "w7 w9", "w11", length=3, seed=6)
    assert code == 0 and out == expected.text + "\n"


def test_cli_rewrite_json_has_the_span_and_candidates(folders, capsys):
    code, out, _ = run_cli(capsys, "-m", folders["text"], "--text", TEXT, "--span", "6:14", "--length", "1,3",
                           "--seed", "2", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["text"][: data["start"]] == TEXT[:6] and data["text"][data["end"]:] == TEXT[14:]
    assert [c["length"] for c in data["candidates"]] == [1, 3]
    assert data["stats"]["length"] in (1, 3) and "score" in data["candidates"][0]
    # the seed as given (it reported the winning candidate's, seed + its index: --seed 0 printed 4)
    assert data["seed"] == 2 and [c["seed"] for c in data["candidates"]] == [2, 3]


def test_cli_temperature_scales_the_edit_schedule(folders, capsys):
    code, out, _ = run_cli(capsys, "-m", folders["text"], "--prefix", "w7 w9", "--suffix", "w11", "--length", "3",
                           "--seed", "6", "--temperature", "0.5")
    expected = editing.infill(printpress.load(folders["text"]), "w7 w9", "w11", length=3, seed=6, temperature=0.5)
    assert code == 0 and out == expected.text + "\n"


def test_cli_show_steps_draws_one_line_per_step(folders, capsys):
    code, _out, err = run_cli(capsys, "-m", folders["text"], "--prefix", "w7", "--suffix", "w11 w12", "--length", "2",
                             "--steps", "3", "--seed", "0", "--show-steps")
    lines = [line for line in err.splitlines() if line.startswith("[0] canvas 0")]
    assert code == 0 and len(lines) == 3
    assert lines[0].startswith("[0] canvas 0 step 1/3 accepted ") and lines[0].endswith("w11 w12")


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "give --prefix and/or --suffix to infill, or --text with --span START:END to rewrite"),
        (["--prefix", "w5", "--text", "w5 w6"], "give either --prefix/--suffix (infill) or --text with --span"),
        (["--text", "w5 w6"], "give --prefix and/or --suffix to infill, or --text with --span"),
        (["--text", "w5 w6", "--span", "3-4"], "--span must be START:END with integer character offsets, got '3-4'"),
        (["--text", "w5 w6", "--span", "4:1"], "the span start 4 is after its end 1"),
        (["--text", "w5 w6", "--span", "0:99"], "the span end 99 is beyond the text's 5 characters"),
        (["--prefix", "", "--suffix", ""], "nothing to condition on"),
        (["--prefix", "w5", "--length", "0"], "length must be a positive integer, got 0"),
        (["--prefix", "w5", "--length", "x"], "--length must be an integer or comma separated integers, got 'x'"),
        (["--prefix", "w5", "--length", "99"], f"length 99 exceeds the canvas of {CANVAS} tokens"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(folders, capsys, argv, message):
    code, out, err = run_cli(capsys, "-m", folders["text"], *argv)
    lines = [line for line in err.splitlines() if not line.startswith("WARNING")]
    assert code == 2 and out == ""
    assert lines == [f"printpress: error: {message}"] or (len(lines) == 1 and lines[0].startswith(
        f"printpress: error: {message}"))


# -- the shipped model ----------------------------------------------------------------------------------------


def test_shipped_model_rewrites_a_span_in_place():
    pipe = printpress.load(REPO / "models" / "shakespeare-joint")
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
    start = text.index(" window")
    end = start + len(" window")
    result = editing.rewrite(pipe, text, start, end, seed=0, max_denoising_steps=8)
    assert result.text[:start] == text[:start] and result.text[result.end:] == text[end:]
    assert len(result.middle_ids) == len(pipe.tokenizer.encode(" window", add_special_tokens=False).ids)
    suffix_tokens = len(pipe.tokenizer.encode(text[end:], add_special_tokens=False).ids)
    assert result.stats.clamped_tokens == min(suffix_tokens, pipe.canvas_length - len(result.middle_ids))
    again = editing.rewrite(pipe, text, start, end, seed=0, max_denoising_steps=8)
    assert again.text == result.text


def test_streams_check_their_input_before_the_first_event(pipe):
    # An HTTP endpoint can answer 400 before it starts streaming: nothing has to be iterated to get the error.
    with pytest.raises(GenerationError, match="nothing to condition on"):
        editing.infill_stream(pipe, "", "")
    with pytest.raises(GenerationError, match="the span start 4 is after its end 1"):
        editing.rewrite_stream(pipe, TEXT, 4, 1)


def test_pipeline_methods_delegate_to_the_editing_module(pipe):
    assert pipe.infill("w7", "w9 w10", length=2, seed=3).middle_ids == editing.infill(pipe, "w7", "w9 w10", length=2,
                                                                                       seed=3).middle_ids
    assert pipe.rewrite(TEXT, 6, 12, seed=3).text == editing.rewrite(pipe, TEXT, 6, 12, seed=3).text


@pytest.mark.parametrize("feedback", ["predicted", "exact"])
def test_suffix_feedback_sets_the_self_conditioning_signal_at_clamped_positions(pipe, monkeypatch, feedback):
    seen = []
    denoise = pipe.model.denoise

    def recording(canvas_ids, cache, *args, **kwargs):
        seen.append(kwargs.get("self_conditioning_probs"))
        return denoise(canvas_ids, cache, *args, **kwargs)

    monkeypatch.setattr(pipe.model, "denoise", recording)
    editing.infill(pipe, "w7", "w20 w21 w22", length=3, seed=0, suffix_feedback=feedback, max_denoising_steps=3)
    assert seen[0] is None and len(seen) == 3
    clamped = seen[1][0, 3:]
    exact = torch.nn.functional.one_hot(torch.tensor([20, 21, 22]), 128).float()
    assert torch.equal(clamped, exact) == (feedback == "exact")
    assert not torch.equal(seen[1][0, :3].max(dim=-1).values, torch.ones(3))  # free positions keep the model's own
    with pytest.raises(GenerationError, match="suffix_feedback must be one of predicted, exact, got 'x'"):
        editing.infill(pipe, "w7", "w20", length=1, suffix_feedback="x")
