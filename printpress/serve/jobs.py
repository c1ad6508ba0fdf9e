"""Jobs: a request's choices in the scheduler. `submit_jobs` queues one engine request per choice (all or none),
`job_events` merges their events as they come, `guarded` cancels them when the client goes away or the iteration
stops early, and `collect` runs them to their end for a JSON answer. `guarded` and `cancel_all` take any job with a
`ticket` and a `result` (the edits route's too).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

from fastapi import Request

from printpress.errors import PrintpressError
from printpress.events import CommitEvent, DoneEvent, GenerationResult
from printpress.request import Request as EngineRequest
from printpress.request import check_logprobs
from printpress.serve import protocol as p
from printpress.serve.errors import ApiError, from_library
from printpress.serve.logprobs import ChoiceLogprobs
from printpress.serve.output import ChoiceText
from printpress.serve.state import ServerState, check_prompt, check_steps
from printpress.settings import refuse_canvas_steps

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


@dataclass
class Job:
    """One choice: a scheduler ticket and the text it has produced so far."""

    index: int
    ticket: object  # printpress.serve.scheduler.Ticket
    text: ChoiceText
    prompt_ids: list[int]
    seed: int
    counts_prompt: bool = True  # the first choice of its prompt: usage counts a prompt once, however many choices
    started: float = field(default_factory=time.perf_counter)
    result: GenerationResult | None = None
    logprobs: ChoiceLogprobs | None = None  # when the request asked for log-probabilities (mode ar)

    @property
    def finished(self) -> bool:
        return self.result is not None or self.text.hit_stop

    def add(self, commit: CommitEvent) -> str:
        """Take a commit's tokens (and their log-probabilities); return the text that can be sent now."""
        if self.logprobs is not None:
            self.logprobs.add(commit.logprobs)
        return self.text.add(commit.token_ids)

    def usage(self) -> p.Usage:
        prompt, completion = len(self.prompt_ids) if self.counts_prompt else 0, self.text.completion_tokens
        return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def stats(self) -> p.Stats | None:
        """printpress's figures; None when a stop sequence ended the choice before the engine did."""
        if self.result is None:
            return None
        s = self.result.stats
        return p.Stats(mode=self.result.mode, seed=self.seed, canvases=s.canvases, denoising_steps=s.denoising_steps,
                       forward_passes=s.forward_passes, tokens_per_forward=s.tokens_per_forward,
                       wall_time_s=s.wall_time_s,
                       tokens_per_second=s.new_tokens / s.wall_time_s if s.wall_time_s > 0 else 0.0,
                       finish_reason=s.finish_reason)


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > p.MAX_STOP_SEQUENCES:
        raise ApiError(400, f"stop has {len(stops)} sequences; at most {p.MAX_STOP_SEQUENCES} are allowed",
                       param="stop")
    return stops


def settings_for(st: ServerState, body: p.GenerationFields, max_tokens: int):
    """The request's sampler settings: the checkpoint's defaults with the body's applied, validated (the engine's
    rules: `Pipeline.settings`, and `steps` refused in speculative mode, which has `draft_steps`)."""
    check_steps(st, body)
    try:
        refuse_canvas_steps(body.mode, body.steps)
    except PrintpressError as exc:
        raise ApiError(400, str(exc), param="steps") from None
    return st.pipeline.settings(max_new_tokens=max_tokens, **body.sampler_overrides())


def submit_jobs(st: ServerState, prompts: Sequence[list[int]], body: p.GenerationFields, max_tokens: int,
                stream_steps: bool, logprobs: int | None = None) -> list[Job]:
    """Submit one request per choice (`n` per prompt, choice i with seed + i, indexed prompt by prompt as OpenAI
    does); all or none (a refusal cancels those already submitted). `logprobs`: the most likely tokens to list per
    position, when the body asked for log-probabilities (refused, naming the mode, outside mode ar)."""
    if body.stream_steps and not body.stream:
        raise ApiError(400, "stream_steps needs stream=true", param="stream_steps")
    n = body.n or 1
    if len(prompts) * n > p.MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompt(s) x n={n} is {len(prompts) * n} choices; at most "
                            f"{p.MAX_CHOICES} per request", param="n")
    for ids in prompts:
        check_prompt(st, ids)
    settings = settings_for(st, body, max_tokens)
    try:
        check_logprobs(EngineRequest([], settings, 0, logprobs))
    except PrintpressError as exc:
        raise ApiError(400, str(exc), param="logprobs") from None
    stops = stop_list(body.stop)
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    jobs: list[Job] = []
    try:
        for prompt_index, ids in enumerate(prompts):
            for choice in range(n):
                choice_seed = (seed + choice) % 2**64
                ticket = st.scheduler.submit(EngineRequest(list(ids), settings, choice_seed, logprobs),
                                             step_events=stream_steps)
                text = ChoiceText(st.decode, max_tokens, settings.eos_token_ids, stops)
                jobs.append(Job(prompt_index * n + choice, ticket, text, list(ids), choice_seed,
                                counts_prompt=choice == 0,
                                logprobs=None if logprobs is None else ChoiceLogprobs(st.decode)))
    except BaseException:
        cancel_all(jobs)
        raise
    return jobs


def cancel_all(jobs: Iterable[Job]) -> None:
    for job in jobs:
        job.ticket.cancel()


async def job_events(jobs: Sequence[Job]) -> AsyncIterator[tuple[Job, object]]:
    """Every job's events as they come, merged; ends when every job is finished.

    A DoneEvent's result is recorded on its job before the event is handed out. A job whose text reached a
    stop sequence (the consumer fed it the commit) is cancelled at once, freeing its slot, and yields
    nothing more. Errors (timeouts) propagate; `guarded` cancels the jobs when iteration stops early.
    """
    if len(jobs) == 1:
        job = jobs[0]
        async for event in job.ticket.aevents():
            if isinstance(event, DoneEvent):
                job.result = event.result
            yield job, event
            if job.finished:
                _stop_early(job)
                return
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for event in job.ticket.aevents():
                await queue.put((job, event, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((job, None, exc))
        await queue.put((job, None, None))

    tasks = {job.index: asyncio.create_task(pump(job)) for job in jobs}
    try:
        while tasks:
            job, event, error = await queue.get()
            if job.index not in tasks:
                continue  # a job already ended by a stop sequence
            if error is not None:
                raise error
            if event is None:
                del tasks[job.index]
                continue
            if isinstance(event, DoneEvent):
                job.result = event.result
            yield job, event
            if job.finished:
                _stop_early(job)
                tasks.pop(job.index).cancel()
    finally:
        for task in tasks.values():
            task.cancel()


def _stop_early(job: Job) -> None:
    if job.result is None:  # ended by a stop sequence: free the slot now
        job.ticket.cancel()


async def guarded(request: Request, jobs: Sequence[Job], events: AsyncIterator) -> AsyncIterator:
    """Iterate `events`, cancelling every job when the client goes away or the iteration stops early."""
    watcher = asyncio.create_task(_watch_disconnect(request, jobs))
    try:
        async for item in events:
            yield item
    finally:
        watcher.cancel()
        cancel_all(j for j in jobs if j.result is None)


async def _watch_disconnect(request: Request, jobs: Sequence[Job]) -> None:
    while True:
        if await request.is_disconnected():
            logger.info("client went away: cancelling %d request(s)", len(jobs))
            cancel_all(jobs)
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def collect(request: Request, jobs: list[Job]) -> None:
    """Run every job to its end (non-streamed responses)."""
    try:
        async for job, event in guarded(request, jobs, job_events(jobs)):
            if isinstance(event, CommitEvent):
                job.add(event)
        for job in jobs:
            job.text.finish()
    except Exception as exc:  # noqa: BLE001 - mapped to the right status (500 only for bugs)
        raise from_library(exc) from None


def sum_usage(jobs: Sequence[Job]) -> p.Usage:
    usages = [job.usage() for job in jobs]
    return p.Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                   completion_tokens=sum(u.completion_tokens for u in usages),
                   total_tokens=sum(u.total_tokens for u in usages))
