"""The scheduler: concurrent requests share decoder steps and each gets what it gets alone."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from printpress.engine import CommitEvent, DoneEvent, Request
from printpress.errors import GenerationError
from printpress.sampling import SamplerSettings
from printpress.serve.scheduler import Limits, QueueFull, RequestFailed, RequestTimeout, Scheduler

PROMPTS = [[2, 7, 9, 11, 13, 17], [2, 40], list(range(2, 30)), [2, 5, 6, 7]]
SETTINGS = dict(max_new_tokens=24, max_denoising_steps=5, t_min=0.02, t_max=0.05, entropy_bound=1.0,
                confidence_threshold=0.05, eos_token_ids=[20, 21])


def _result(ticket):
    done = [e for e in ticket.events() if isinstance(e, DoneEvent)]
    return done[-1].result


def test_concurrent_requests_share_steps_and_match_each_alone(models_):
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


def test_ar_requests_are_interleaved_and_exact(models_):
    _, pipe = models_["gqa"]
    settings = pipe.settings(mode="ar", max_new_tokens=6, temperature=1.0)
    with Scheduler(pipe) as scheduler:
        tickets = [scheduler.submit(Request(p, settings, 3)) for p in PROMPTS[:2]]
        results = [_result(t) for t in tickets]
    for prompt, result in zip(PROMPTS[:2], results):
        assert result.token_ids == pipe.generate(prompt, seed=3, mode="ar", max_new_tokens=6,
                                                 temperature=1.0).token_ids


def test_events_reach_asyncio_readers(models_):
    _, pipe = models_["gqa"]
    settings = pipe.settings(max_new_tokens=16, max_denoising_steps=3)

    async def read(scheduler):
        ticket = scheduler.submit(Request(PROMPTS[0], settings, 1), step_events=True)
        return [e async for e in ticket.aevents()]

    with Scheduler(pipe) as scheduler:
        events = asyncio.run(read(scheduler))
    assert isinstance(events[-1], DoneEvent)
    assert sum((e.token_ids for e in events if isinstance(e, CommitEvent)), []) == events[-1].result.token_ids


def test_a_cancelled_request_frees_its_row_and_the_queue_is_bounded(models_):
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


def test_limits_and_timeouts_are_clear_errors(models_):
    _, pipe = models_["gqa"]
    scheduler = Scheduler(pipe, Limits(max_prompt_tokens=4, max_new_tokens=16, request_timeout_s=0.05)).start()
    try:
        with pytest.raises(GenerationError, match="at most 4"):
            scheduler.submit(Request(PROMPTS[0], pipe.settings(max_new_tokens=8), 1))
        with pytest.raises(GenerationError, match="at most 16"):
            scheduler.submit(Request(PROMPTS[1], pipe.settings(max_new_tokens=17), 1))
        slow = pipe.settings(max_new_tokens=16, max_denoising_steps=4096, stability_threshold=4096)
        ticket = scheduler.submit(Request(PROMPTS[1], slow, 1))
        with pytest.raises(RequestTimeout, match="timeout"):
            list(ticket.events())
    finally:
        scheduler.close()
    assert not any(t.name == "printpress-scheduler" for t in threading.enumerate())



def test_edits_bring_their_own_stream_and_share_the_worker(models_):
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


def test_a_request_that_fails_fails_alone(models_, monkeypatch):
    """Poison requests (a temperature that overflows the sampler to NaN, which validation now refuses: let
    through here) share steps with diffusion, AR and edit requests. Before, the shared step raised and every
    request in flight failed; now only the poison fails, and every other request gets its answer alone."""
    from printpress.editing import infill_stream

    _, pipe = models_["peaked"]
    ar = dict(mode="ar", max_new_tokens=6, temperature=1.0)
    edit = dict(length=3, seed=4, max_denoising_steps=3)
    alone = [pipe.generate(p, seed=40 + i, **SETTINGS).token_ids for i, p in enumerate(PROMPTS)]
    alone_ar = pipe.generate(PROMPTS[1], seed=3, **ar).token_ids
    alone_edit = list(infill_stream(pipe, [2, 7, 9], [11, 13], **edit))[-1].result.middle_ids
    good, good_ar = pipe.settings(**SETTINGS), pipe.settings(**ar)
    monkeypatch.setattr(SamplerSettings, "validate", lambda self: self)
    poisons = [dataclasses.replace(good, t_min=0.0, t_max=1e-38), dataclasses.replace(good_ar, temperature=1e-38)]

    scheduler = Scheduler(pipe, Limits(max_rows=8))  # everything is queued before the worker starts: one batch
    tickets = [scheduler.submit(Request(p, good, 40 + i)) for i, p in enumerate(PROMPTS[:2])]
    poisoned = [scheduler.submit(Request(PROMPTS[0], poison, 1)) for poison in poisons]
    tickets += [scheduler.submit(Request(p, good, 42 + i)) for i, p in enumerate(PROMPTS[2:])]
    ar_ticket = scheduler.submit(Request(PROMPTS[1], good_ar, 3))
    edit_ticket = scheduler.submit_stream(infill_stream(pipe, [2, 7, 9], [11, 13], **edit))
    with scheduler:
        for ticket in poisoned:
            with pytest.raises(RequestFailed, match=r"generating this request failed \(RuntimeError: probability "
                                                    r"tensor contains .*\); other requests were not affected"):
                list(ticket.events())
        assert [_result(t).token_ids for t in tickets] == alone
        assert _result(ar_ticket).token_ids == alone_ar
        assert _result(edit_ticket).middle_ids == alone_edit
        assert scheduler.load == (0, 0)

