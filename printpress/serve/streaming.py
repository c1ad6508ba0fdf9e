"""Server-sent events: `sse` formats one, `sse_body` wraps a body's events (then `[DONE]`, or one error event
once the status line has gone out), `JobStream` is the response that cancels its jobs however it ends, and
`stream_body` is the completion routes' loop (step and commit events when asked, text chunks, usage).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from printpress.events import CommitEvent, DoneEvent, StepEvent
from printpress.serve import protocol as p
from printpress.serve.errors import from_library
from printpress.serve.jobs import Job, cancel_all, guarded, job_events, sum_usage
from printpress.serve.state import ServerState


def step_payload(st: ServerState, rid: str, job: Job, event: StepEvent) -> p.StepPayload:
    return p.StepPayload(id=rid, index=job.index, canvas=event.canvas, step=event.step, max_steps=event.max_steps,
                         accepted=list(event.accepted), argmax=list(event.argmax), tokens=list(event.tokens),
                         argmax_text=[st.piece(t) for t in event.argmax],
                         tokens_text=[st.piece(t) for t in event.tokens], stopped=event.stopped)


def sse(payload: p.BaseModel | dict | str, event: str | None = None) -> str:
    """One server-sent event."""
    if isinstance(payload, p.BaseModel):
        data = payload.model_dump_json()
    elif isinstance(payload, dict):
        data = json.dumps(payload, ensure_ascii=False)
    else:
        data = payload
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class JobStream(StreamingResponse):
    """An SSE response that cancels its jobs however it ends, even if its body was never iterated (a client
    gone before the first byte never enters the body's own cleanup)."""

    def __init__(self, body_iter: AsyncIterator[str], jobs: Sequence[Job]) -> None:
        super().__init__(body_iter, media_type="text/event-stream", headers=SSE_HEADERS)
        self.jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cancel_all(job for job in self.jobs if job.result is None)


def event_stream(body_iter: AsyncIterator[str], jobs: Sequence[Job]) -> StreamingResponse:
    return JobStream(body_iter, jobs)


async def sse_body(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An SSE body: the given events, then [DONE]. An error after the stream started (the status line has gone
    out) becomes one OpenAI error event; a client that left (CancelledError, not an Exception) propagates."""
    try:
        async with contextlib.aclosing(events):
            async for chunk in events:
                yield chunk
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - library errors map to 4xx bodies, bugs to a 500 body
        yield sse(from_library(exc).body())


def stream_body(st: ServerState, request: Request, jobs: list[Job], rid: str, stream_steps: bool,
                on_text: Callable[[Job, str, str | None], object | None],
                on_usage: Callable[[p.Usage], object] | None) -> AsyncIterator[str]:
    """The shared SSE loop: step/commit events (opt-in), text chunks built by `on_text(job, delta, finish)`,
    a usage chunk, then [DONE]."""

    async def events() -> AsyncIterator[str]:
        async for job, event in guarded(request, jobs, job_events(jobs)):
            if isinstance(event, StepEvent):
                if stream_steps:
                    yield sse(step_payload(st, rid, job, event), "printpress.step")
            elif isinstance(event, CommitEvent):
                delta = job.add(event)
                if stream_steps:
                    yield sse(p.CommitPayload(id=rid, index=job.index, canvas=event.canvas, token_ids=event.token_ids,
                                              text=delta, finished=event.finished or job.text.done), "printpress.commit")
                if job.text.hit_stop:
                    delta += job.text.finish()
                    yield sse(on_text(job, delta, job.text.finish_reason))
                elif delta:
                    yield sse(on_text(job, delta, None))
            elif isinstance(event, DoneEvent):
                yield sse(on_text(job, job.text.finish(), job.text.finish_reason))
        if on_usage is not None:
            yield sse(on_usage(sum_usage(jobs)))

    return sse_body(events())
