"""`sliding`: a canvas that slides along the text. Each step commits the canvas's leading run of kept positions to
the cache, moves the rest of the canvas to the front with its self-conditioning and fills the end with noise."""

from __future__ import annotations

import pytest
import torch

from printpress.engine import CommitEvent, DiffusionBatch, DoneEvent, Request, StepEvent
from printpress.errors import GenerationError

PROMPTS = [[2, 7, 9, 11, 13, 17], [2, 40], [2, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87]]


def leading_run(accepted: list[bool]) -> int:
    run = 0
    while run < len(accepted) and accepted[run]:
        run += 1
    return run


def test_a_sliding_canvas_that_keeps_every_position_is_whole_canvases_drawn_cold(models_):
    """Keeping everything, a sliding canvas commits all of it each step and refills it with noise: one step per
    canvas, the same draws in the same order as whole canvases of one step, and (all but greedy) its samples
    are the argmaxes those commit."""
    _, pipe = models_["gqa"]
    settings = dict(max_new_tokens=3 * pipe.canvas_length, max_denoising_steps=1, entropy_bound=1e6, t_min=1e-4,
                    t_max=1e-4)
    for prompt in PROMPTS:
        whole = pipe.generate(prompt, seed=3, **settings)
        slid = pipe.generate(prompt, seed=3, sliding=True, **settings)
        assert slid.token_ids == whole.token_ids
        assert slid.stats.canvases == whole.stats.canvases == 3
        # Three decoder passes and the encoder passes of the first two commits (the last one ends the request).
        assert slid.stats.denoising_steps == 3 and slid.stats.forward_passes == 5


@pytest.mark.parametrize("steps", [1, 3])
def test_each_step_commits_its_leading_kept_run_and_the_front_waits_at_most_steps(models_, steps):
    _, pipe = models_["peaked"]
    settings = dict(max_new_tokens=13, max_denoising_steps=steps, t_min=0.05, t_max=0.5, entropy_bound=1.0)
    for prompt in PROMPTS:
        events = list(pipe.stream(prompt, seed=5, sliding=True, **settings))
        result = events[-1].result
        step_events = [e for e in events if isinstance(e, StepEvent)]
        commits = [e for e in events if isinstance(e, CommitEvent)]
        assert len(result.token_ids) == 13  # exactly the budget, not whole canvases
        assert sum((c.token_ids for c in commits), []) == result.token_ids
        waited, committed = 0, iter(commits)
        for event in step_events:
            run = leading_run(event.accepted)
            waited += 1
            assert event.stopped == (run > 0)
            assert waited <= steps and (run > 0 or waited < steps)  # the front is kept at the latest at `steps`
            if run:
                commit = next(committed)
                assert commit.token_ids == event.tokens[: len(commit.token_ids)]
                assert len(commit.token_ids) == run or commit.finished  # cut only by the budget
                waited = 0
        assert next(committed, None) is None
        assert result.stats.denoising_steps == len(step_events)
        assert result.stats.forward_passes == len(step_events) + len(commits) - 1
        assert result.stats.canvases == len(commits)


@torch.no_grad()
def test_the_cache_holds_the_committed_text_and_the_canvas_moves_with_its_self_conditioning(models_):
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
        kept = leading_run(step.accepted)
        if not kept:
            assert row.canvas[0].tolist() == step.tokens
            continue
        slides += 1
        assert row.canvas[0, : length - kept].tolist() == step.tokens[kept:]
        assert not row.self_conditioning[0, length - kept :].any()  # fresh noise: no signal
        assert row.self_conditioning[0, : length - kept].sum(-1).allclose(torch.ones(length - kept))
        # The decoder reads the committed text from the cache exactly as a fresh encoding of it gives it.
        assert row.cache.length == len(PROMPTS[0]) + len(row.tokens)
        fresh = model.new_cache(1, row.cache.length + length)
        model.encode(torch.tensor([PROMPTS[0] + row.tokens]), fresh, logits="none")
        canvas = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(model.denoise(canvas, row.cache), model.denoise(canvas, fresh))
    assert slides >= 2


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
