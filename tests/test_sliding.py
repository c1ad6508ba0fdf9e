"""`sliding`: a canvas that slides along the text. Each step commits the canvas's leading run of kept positions to
the cache, moves the rest of the canvas to the front with its self-conditioning and fills the end with noise."""

from __future__ import annotations

import pytest
import torch

from printpress.canvas import StepOutcome
from printpress.checkpoint import load_model
from printpress.engine import CommitEvent, DiffusionBatch, DoneEvent, Request, StepEvent
from printpress.errors import GenerationError

from helpers import make_reference, save_checkpoint

PROMPTS = [[2, 7, 9, 11, 13, 17], [2, 40], [2, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87]]


def leading_run(flags: list[bool]) -> int:
    run = 0
    while run < len(flags) and flags[run]:
        run += 1
    return run


def stepped(pipe, prompt: list[int], seed: int, **settings) -> tuple[list[tuple[list[int], list]], list]:
    """Run one sliding request step by step: (the canvas each step read, that step's events) per step, and the
    events in order."""
    batch = DiffusionBatch(pipe.model, pipe.canvas_length)
    batch.add(0, Request(prompt, pipe.settings(sliding=True, **settings), seed=seed))
    steps, events = [], []
    while batch:
        read = batch.rows[0].canvas[0].tolist()
        new = batch.step()
        steps.append((read, new))
        events.extend(new)
    return steps, events


@pytest.mark.parametrize("waits", [1, 3])
def test_each_step_commits_its_leading_fixed_points_and_the_front_waits_at_most_steps(models_, waits):
    _, pipe = models_["peaked"]
    settings = dict(max_new_tokens=13, max_denoising_steps=waits, t_min=0.05, t_max=0.5, entropy_bound=1.0)
    forced = 0
    for prompt in PROMPTS:
        steps, events = stepped(pipe, prompt, 5, **settings)
        result = events[-1].result
        commits = [e for e in events if isinstance(e, CommitEvent)]
        assert len(result.token_ids) == 13  # exactly the budget, not whole canvases
        assert sum((c.token_ids for c in commits), []) == result.token_ids
        waited = 0
        for read, new in steps:
            step = next(e for e in new if isinstance(e, StepEvent))
            commit = next((e for e in new if isinstance(e, CommitEvent)), None)
            fixed = leading_run([a and t == r for a, t, r in zip(step.accepted, step.tokens, read)])
            waited += 1
            assert step.stopped == (commit is not None)
            if fixed:  # the run of kept positions that repeat what the step read, cut only by the budget
                assert commit.token_ids == step.tokens[: len(commit.token_ids)]
                assert len(commit.token_ids) == fixed or commit.finished
            elif waited == waits:  # the front has waited its steps: kept and committed alone
                assert step.accepted[0] and commit.token_ids == step.tokens[:1]
                forced += 1
            else:
                assert commit is None
            waited = 0 if commit else waited
        assert result.stats.denoising_steps == len(steps)
        assert result.stats.forward_passes == len(steps)  # each commit is encoded within the next step's pass
        assert result.stats.canvases == len(commits)
    assert forced  # the rule that guarantees progress was exercised


@torch.no_grad()
def test_the_cache_holds_the_text_before_the_last_commit_and_the_canvas_moves_with_its_self_conditioning(models_):
    _, pipe = models_["peaked"]
    model, length = pipe.model, pipe.canvas_length
    settings = pipe.settings(max_new_tokens=20, max_denoising_steps=2, t_min=0.05, t_max=0.5, entropy_bound=1.0,
                             sliding=True)
    batch = DiffusionBatch(model, length)
    batch.add(0, Request(PROMPTS[0], settings, seed=8))
    slides = 0
    while batch:
        row = batch.rows[0]
        events = batch.step()
        if any(isinstance(e, DoneEvent) for e in events):
            break
        step = next(e for e in events if isinstance(e, StepEvent))
        commit = next((e for e in events if isinstance(e, CommitEvent)), None)
        kept = 0 if commit is None else len(commit.token_ids)
        if not kept:
            assert row.canvas[0].tolist() == step.tokens
            continue
        slides += 1
        assert row.canvas[0, : length - kept].tolist() == step.tokens[kept:]
        assert not row.self_conditioning[0, length - kept :].any()  # fresh noise: no signal
        assert row.self_conditioning[0, : length - kept].sum(-1).allclose(torch.ones(length - kept))
        # The commit waits for the next step's pass; the text before it is in the cache as a fresh encoding gives it.
        assert row.pending.tolist() == commit.token_ids
        assert row.cache.length == len(PROMPTS[0]) + len(row.tokens) - kept
        fresh = model.new_cache(1, row.cache.length + length)
        model.encode(torch.tensor([PROMPTS[0] + row.tokens[: len(row.tokens) - kept]]), fresh, logits="none")
        canvas = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(model.denoise(canvas, row.cache), model.denoise(canvas, fresh), rtol=1e-5, atol=1e-4)
    assert slides >= 2


@torch.no_grad()
def test_a_commit_encoded_beside_the_next_canvas_is_encode_then_denoise(models_):
    """The sliding step after a commit is one pass (`encode_and_denoise`): the cache as `encode` writes it, and the
    canvas's logits as `denoise` gives them after it, self-conditioned or not, up to rounding."""
    _, pipe = models_["gqa"]
    model, length, vocab = pipe.model, pipe.canvas_length, pipe.config.text.vocab_size
    gen = torch.Generator().manual_seed(4)
    for prompt, block in ((PROMPTS[0], 3), (PROMPTS[2], 1), (PROMPTS[1], 20)):  # the last crosses the sliding window
        tokens = torch.randint(0, vocab, (1, block), generator=gen)
        canvas = torch.randint(0, vocab, (1, length), generator=gen)
        probs = torch.softmax(torch.randn(1, length, vocab, generator=gen), -1)
        for signal in (None, probs):
            fused, apart = model.new_cache(1, 64), model.new_cache(1, 64)
            for cache in (fused, apart):
                model.encode(torch.tensor([prompt]), cache, logits="none")
            logits = model.encode_and_denoise(tokens, canvas, fused, signal)
            model.encode(tokens, apart, logits="none")
            torch.testing.assert_close(logits, model.denoise(canvas, apart, self_conditioning_probs=signal),
                                       rtol=1e-4, atol=1e-4)
            assert fused.length == apart.length == len(prompt) + block
            after = torch.randint(0, vocab, (1, length), generator=gen)  # what each cache now gives a decoder pass
            torch.testing.assert_close(model.denoise(after, fused), model.denoise(after, apart), rtol=1e-4, atol=1e-4)


def test_sliding_rows_batched_get_what_each_gets_alone(models_):
    _, pipe = models_["peaked"]
    settings = dict(max_new_tokens=11, max_denoising_steps=2, t_min=0.05, t_max=0.5, entropy_bound=1.0,
                    sliding=True, eos_token_ids=[20, 21])
    seeds = [4, 5, 6]
    batch = pipe.generate(PROMPTS, seed=seeds, **settings)
    for prompt, seed, row in zip(PROMPTS, seeds, batch):
        alone = pipe.generate(prompt, seed=seed, **settings)
        assert row.token_ids == alone.token_ids
        assert row.stats.forward_passes == alone.stats.forward_passes
    assert len({r.stats.forward_passes for r in batch}) > 1  # rows that slide and finish at different times


@pytest.mark.parametrize("settings,message", [
    (dict(sliding=True, canvas_start="table"), "sliding appends noise where the canvas moves on; it starts from "
                                               "noise, not canvas_start='table'"),
    (dict(mode="ar", sliding=True), "sliding=True does not apply to mode='ar' (only mode 'diffusion' uses it)"),
    (dict(sliding="yes"), "sliding must be true or false, got 'yes'"),
])
def test_sliding_settings_that_cannot_work_are_refused(models_, settings, message):
    _, pipe = models_["gqa"]
    with pytest.raises(GenerationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipe.generate(PROMPTS[0], seed=1, max_new_tokens=8, **settings)


@torch.no_grad()
def test_in_half_precision_the_fed_back_probabilities_are_what_the_decoder_makes_of_the_scaled_logits(tmp_path):
    """The sampler feeds self-conditioning back as probabilities in every dtype (so a sliding canvas's fresh
    positions can get none); in bfloat16 they are the decoder's own softmax of the logits cast to bfloat16, so the
    exact sampler's passes do not change by a bit."""
    model, config, _, _ = load_model(save_checkpoint(make_reference("gqa"), tmp_path / "gqa"), dtype="bfloat16")
    vocab, length = config.text.vocab_size, config.canvas_length
    cache = model.new_cache(1, 32)
    model.encode(torch.tensor([PROMPTS[0]]), cache, logits="none")
    canvas = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(2))
    processed = model.denoise(canvas, cache) / 0.7
    outcome = StepOutcome(processed, torch.softmax(processed, -1), *([None] * 5))
    fed_back = outcome.feedback(model.dtype)
    assert fed_back.dtype == torch.float32
    assert torch.equal(model.denoise(canvas, cache, self_conditioning_probs=fed_back),
                       model.denoise(canvas, cache, processed.to(torch.bfloat16)))


def test_the_bench_counts_a_sliding_steps_fused_pass_as_one_pass(models_):
    """`printpress bench` counts passes at the model (`MeteredModel`): the prompt's encoder pass, then one pass per
    step, the steps after a commit included (they encode it beside the canvas)."""
    from printpress.eval.bench_sides import MeteredModel
    from printpress.pipeline import Pipeline

    _, pipe = models_["peaked"]
    metered = MeteredModel(pipe.model)
    on_meter = Pipeline(metered, pipe.config, pipe.generation_config, pipe.tokenizer)
    settings = dict(max_new_tokens=13, max_denoising_steps=2, t_min=0.05, t_max=0.5, entropy_bound=1.0, sliding=True)
    result = on_meter.generate(PROMPTS[0], seed=5, **settings)
    assert result.token_ids == pipe.generate(PROMPTS[0], seed=5, **settings).token_ids
    assert result.stats.canvases > 2  # commits that the next step's pass encoded
    assert metered.trace.encoder_calls == 1
    assert metered.trace.decoder_calls == result.stats.forward_passes == result.stats.denoising_steps


def test_a_checkpoint_can_make_sliding_its_default_for_diffusion_only(models_, tmp_path):
    """`"sliding": true` in printpress_generation.json: diffusion slides unless a request turns it off, its front
    waiting the checkpoint's `sliding_steps`; speculative drafts, editing and a request that turns sliding off get
    whole canvases of the checkpoint's steps; a save keeps both defaults."""
    import json

    import printpress
    from printpress.errors import ConfigError
    from printpress.eval.bench_sides import default_sides

    _, pipe = models_["peaked"]
    steps = pipe.default_settings().max_denoising_steps
    folder = pipe.save_pretrained(tmp_path / "plain")
    (folder / "printpress_generation.json").write_text(json.dumps({"sliding": True, "sliding_steps": 2}))
    sliding = printpress.load(folder)
    assert sliding.default_settings().sliding and sliding.default_settings().max_denoising_steps == 2 != steps
    settings = dict(max_new_tokens=9, t_min=0.05, t_max=0.5, entropy_bound=1.0)
    for prompt in PROMPTS:
        assert (sliding.generate(prompt, seed=2, **settings).token_ids
                == pipe.generate(prompt, seed=2, sliding=True, max_denoising_steps=2, **settings).token_ids)
        assert (sliding.generate(prompt, seed=2, max_denoising_steps=3, **settings).token_ids  # given steps win
                == pipe.generate(prompt, seed=2, sliding=True, max_denoising_steps=3, **settings).token_ids)
        assert (sliding.generate(prompt, seed=2, sliding=False, **settings).token_ids
                == pipe.generate(prompt, seed=2, **settings).token_ids)
    assert sliding.settings(sliding=False).max_denoising_steps == steps
    assert not sliding.settings(mode="speculative", draft_steps=2).sliding
    assert not sliding.settings(mode="ar").sliding
    drafted = dict(mode="speculative", draft_source="diffusion", max_new_tokens=9, temperature=0)
    assert (sliding.generate(PROMPTS[0], seed=3, **drafted).stats.forward_passes
            == pipe.generate(PROMPTS[0], seed=3, **drafted).stats.forward_passes)
    edit = dict(length=4, seed=3)
    assert sliding.infill([7, 9], [11, 13], **edit).middle_ids == pipe.infill([7, 9], [11, 13], **edit).middle_ids
    assert (sliding.infill([7, 9], [11, 13], sliding=False, **edit).middle_ids  # saying so is no error
            == pipe.infill([7, 9], [11, 13], **edit).middle_ids)
    with pytest.raises(GenerationError, match="editing denoises its canvas in place .*; sliding does not apply"):
        sliding.infill([7, 9], [11, 13], sliding=True, **edit)
    with pytest.raises(GenerationError, match="it starts from noise, not canvas_start='table': leave canvas_start out "
                                              "or sliding off"):
        sliding.generate(PROMPTS[0], seed=1, canvas_start="table", **settings)
    for side in default_sides([4], [1.0], [{"entropy_bound": 2.0}, {"sliding": True}]):  # a bench side names its sampler
        if side.kind == "diffusion":
            assert side.overrides["sliding"] is side.label.endswith("sliding True")
    saved = sliding.save_pretrained(tmp_path / "copy")
    assert json.loads((saved / "printpress_generation.json").read_text()) == {"sliding": True, "sliding_steps": 2}
    (folder / "printpress_generation.json").write_text(json.dumps({"sliding_steps": 2}))  # for an asked-for slide only
    waits = printpress.load(folder)
    assert waits.settings().max_denoising_steps == steps and waits.settings(sliding=True).max_denoising_steps == 2
    for content, message in (({"sliding": "yes"}, "sliding must be true or false"),
                             ({"sliding_steps": -1}, "sliding_steps must be an integer >= 0")):
        (folder / "printpress_generation.json").write_text(json.dumps(content))
        with pytest.raises(ConfigError, match=f"invalid generation_config: {message}"):
            load_model(folder)
