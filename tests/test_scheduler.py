"""The scheduler: concurrent requests share decoder steps and each gets what it gets alone."""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_engine import models_  # noqa: F401  (the tiny checkpoints fixture)

from printpress.engine import CommitEvent, DoneEvent, Request
from printpress.errors import GenerationError
from printpress.serve.scheduler import Limits, QueueFull, RequestTimeout, Scheduler

PROMPTS = [[2, 7, 9, 11, 13, 17], [2, 40], list(range(2, 30)), [2, 5, 6, 7]]
SETTINGS = dict(max_new_tokens=24, max_denoising_steps=5, t_min=0.02, t_max=0.05, entropy_bound=1.0,
                confidence_threshold=0.05, eos_token_ids=[20, 21])


def _result(ticket):
    done = [e for e in ticket.events() if isinstance(e, DoneEvent)]
    return done[-1].result


def test_concurrent_requests_share_steps_and_match_each_alone(models_):  # noqa: F811
    _, pipe = models_["peaked"]
    settings = pipe.settings(**SETTINGS)
    alone = [pipe.generate(p, seed=40 + i, **SETTINGS) for i, p in enumerate(PROMPTS)]
    with Scheduler(pipe, Limits(max_rows=4)) as scheduler:
        tickets = [scheduler.submit(Request(p, settings, 40 + i)) for i, p in enumerate(PROMPTS)]
        results = [_result(t) for t in tickets]
        # Requests were batched: fewer shared steps than decoder passes in all.
        assert scheduler.steps < sum(r.stats.forward_passes for r in results)
    for mine, reference in zip(results, alone):
        assert mine.token_ids == reference.token_ids


def test_ar_requests_are_interleaved_and_exact(models_):  # noqa: F811
    _, pipe = models_["gqa"]
    settings = pipe.settings(mode="ar", max_new_tokens=6, temperature=1.0)
    with Scheduler(pipe) as scheduler:
        tickets = [scheduler.submit(Request(p, settings, 3)) for p in PROMPTS[:2]]
        results = [_result(t) for t in tickets]
    for prompt, result in zip(PROMPTS[:2], results):
        assert result.token_ids == pipe.generate(prompt, seed=3, mode="ar", max_new_tokens=6,
                                                 temperature=1.0).token_ids


def test_events_reach_asyncio_readers(models_):  # noqa: F811
    _, pipe = models_["gqa"]
    settings = pipe.settings(max_new_tokens=16, max_denoising_steps=3)

    async def read(scheduler):
        ticket = scheduler.submit(Request(PROMPTS[0], settings, 1), step_events=True)
        return [e async for e in ticket.aevents()]

    with Scheduler(pipe) as scheduler:
        events = asyncio.run(read(scheduler))
    assert isinstance(events[-1], DoneEvent)
    assert sum((e.token_ids for e in events if isinstance(e, CommitEvent)), []) == events[-1].result.token_ids


def test_a_cancelled_request_frees_its_row_and_the_queue_is_bounded(models_):  # noqa: F811
    _, pipe = models_["gqa"]
    long = pipe.settings(max_new_tokens=400, max_denoising_steps=50, stability_threshold=100)
    scheduler = Scheduler(pipe, Limits(max_rows=1, max_queued=1)).start()
    try:
        first = scheduler.submit(Request(PROMPTS[0], long, 1), step_events=True)
        events = first.events()
        next(events)  # it runs
        second = scheduler.submit(Request(PROMPTS[1], pipe.settings(max_new_tokens=8, max_denoising_steps=2), 2))
        with pytest.raises(QueueFull, match="already waiting"):
            scheduler.submit(Request(PROMPTS[1], long, 3))
        second.cancel()  # a waiting request that is cancelled gives its queue place back (before the next step)
        assert list(second.events()) == []
        third = scheduler.submit(Request(PROMPTS[1], pipe.settings(max_new_tokens=8, max_denoising_steps=2), 2))
        first.cancel()
        assert _result(third).stats.new_tokens > 0  # the freed row served the waiting request
        assert scheduler.load == (0, 0)
    finally:
        scheduler.close()


def test_limits_and_timeouts_are_clear_errors(models_):  # noqa: F811
    _, pipe = models_["gqa"]
    scheduler = Scheduler(pipe, Limits(max_prompt_tokens=4, max_new_tokens=16, request_timeout_s=0.05)).start()
    try:
        with pytest.raises(GenerationError, match="at most 4"):
            scheduler.submit(Request(PROMPTS[0], pipe.settings(max_new_tokens=8), 1))
        with pytest.raises(GenerationError, match="at most 16"):
            scheduler.submit(Request(PROMPTS[1], pipe.settings(max_new_tokens=17), 1))
        slow = pipe.settings(max_new_tokens=16, max_denoising_steps=10_000, stability_threshold=10_000)
        ticket = scheduler.submit(Request(PROMPTS[1], slow, 1))
        with pytest.raises(RequestTimeout, match="timeout"):
            list(ticket.events())
    finally:
        scheduler.close()
    assert not any(t.name == "printpress-scheduler" for t in threading.enumerate())



def test_edits_bring_their_own_stream_and_share_the_worker(models_):  # noqa: F811
    from printpress.editing import infill_stream

    _, pipe = models_["gqa"]
    edit = dict(length=3, seed=4, max_denoising_steps=3)
    alone = [e for e in infill_stream(pipe, [2, 7, 9], [11, 13], **edit)]
    with Scheduler(pipe) as scheduler:
        diffusion = scheduler.submit(Request(PROMPTS[0], pipe.settings(max_new_tokens=16, max_denoising_steps=3), 1))
        ticket = scheduler.submit_stream(infill_stream(pipe, [2, 7, 9], [11, 13], **edit))
        events = list(ticket.events())
        assert isinstance(_result(diffusion).token_ids, list)
    assert {e.request for e in events} == {ticket.id}
    assert events[-1].result.middle_ids == alone[-1].result.middle_ids
    assert len(events) == len(alone)
