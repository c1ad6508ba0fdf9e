"""`POST /v1/edits`: infill between two texts or rewrite a span of a text in place, over HTTP.

A printpress extension beside the OpenAI routes (docs/server.md, "Edits"). The route validates the body
(pydantic, then the server's limits, then `printpress.editing`'s own checks, all before anything is queued
so that bad input is a 400 and not a broken stream), and hands the edit's event stream to the scheduler
with `submit_stream`: the edit takes a row like a request and is advanced one decoder pass per scheduler
step between the shared steps of the others. The stream always carries step events, whether the client
asked for them or not, because the scheduler advances a stream by one event per step: without them a whole
edit would run inside one step and hold every other request up.

Answers: JSON (`EditResponse`), or with `stream: true` server-sent events: optional `printpress.step`
(the span's positions each step) and `printpress.commit` (the chosen middle), then one data event with the
`EditResponse`, then `data: [DONE]`. A client that goes away cancels the edit, which frees its row.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from printpress import editing
from printpress.errors import PrintpressError
from printpress.events import CommitEvent, DoneEvent
from printpress.serve import protocol as p
from printpress.serve.access import require_key
from printpress.serve.errors import ERROR_RESPONSES, ApiError, from_library
from printpress.serve.jobs import guarded
from printpress.serve.state import ServerState, StateDep, check_model, check_steps, check_text_size, new_id
from printpress.serve.streaming import JobStream, sse, sse_body

SSE_EXAMPLE = {"text/event-stream": {"schema": {"type": "string"},
                                     "example": 'event: printpress.step\ndata: {"object": "printpress.step", ...}\n\n'
                                                'data: {"object": "printpress.edit", ...}\n\ndata: [DONE]\n\n'}}


@dataclass
class EditJob:
    """An edit in the scheduler: what `guarded` and `JobStream` need to cancel it however the response ends."""

    ticket: object  # printpress.serve.scheduler.Ticket
    index: int = 0
    result: editing.EditResult | None = None


def router() -> APIRouter:
    """The edits router; mount it with `create_app(..., extra_routers=[router()])` (the serve command does)."""
    api = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)

    @api.post("/edits", response_model=p.EditResponse, summary="Infill between two texts, or rewrite a span in place",
              description="printpress extension. Give `text` and `span` [start, end) (code points) to regenerate "
                          "that span, or `prefix` and/or `suffix` to generate the text between them. The text "
                          "outside the span is returned unchanged, character for character.",
              responses={200: {"content": SSE_EXAMPLE, "description": "JSON, or server-sent events when stream=true"}})
    async def edits(body: p.EditRequest, request: Request, st: StateDep):
        check_model(st, body.model)
        stream = await run_in_threadpool(build_stream, st, body)
        job = EditJob(st.scheduler.submit_stream(stream))
        rid, created = new_id("edit"), int(time.time())
        if body.stream:
            return JobStream(_edit_events(st, request, job, rid, created, body.stream_steps), [job])
        await _collect(request, job)
        return response_of(st, job.result, rid, created)

    return api


# ------------------------------------------------------------------------------------------------
# Validation: everything a 400 can say is said before the edit is queued
# ------------------------------------------------------------------------------------------------


def build_stream(st: ServerState, body: p.EditRequest):
    """The edit's event stream (not started), after every check; raises ApiError / PrintpressError (400)."""
    if body.stream_steps and not body.stream:
        raise ApiError(400, "stream_steps needs stream=true", param="stream_steps")
    rewriting = body.text is not None or body.span is not None
    if rewriting and (body.prefix is not None or body.suffix is not None):
        raise ApiError(400, "give either text and span (rewrite) or prefix and/or suffix (infill), not both",
                       param="prefix" if body.prefix is not None else "suffix")
    if rewriting and (body.text is None or body.span is None):
        missing = "span" if body.span is None else "text"
        raise ApiError(400, f"a rewrite needs both text and span; '{missing}' is missing", param=missing)
    if not rewriting and body.prefix is None and body.suffix is None:
        raise ApiError(400, "nothing to edit: give text and span (rewrite) or prefix and/or suffix (infill)")
    if isinstance(body.length, list) and len(body.length) > p.MAX_EDIT_LENGTHS:
        raise ApiError(400, f"length lists {len(body.length)} lengths; a search tries at most {p.MAX_EDIT_LENGTHS}",
                       param="length")
    canvas = st.pipeline.canvas_length
    if body.length == []:
        raise ApiError(400, "length is an empty list; give a number of tokens or a list of them", param="length")
    for n in body.length if isinstance(body.length, list) else [] if body.length is None else [body.length]:
        if n < 1:
            raise ApiError(400, f"length must be a positive number of tokens, got {n}", param="length")
        if n > canvas:
            raise ApiError(400, f"length {n} exceeds the canvas of {canvas} tokens; a middle is generated in one "
                                "canvas", param="length")
    check_steps(st, body)
    if rewriting:
        start, end = body.span
        try:
            editing.check_span(body.text, start, end)
        except PrintpressError as exc:
            raise ApiError(400, str(exc), param="span") from None
        prefix, suffix = body.text[:start], body.text[end:]
    else:
        prefix, suffix = body.prefix or "", body.suffix or ""
    if st.pipeline.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer (tokenizer.json), so it cannot edit text")
    param = "text" if rewriting else "prefix"
    check_text_size(st, prefix + suffix, "the text around the span", param)
    context = _count_tokens(st, prefix) + _count_tokens(st, suffix)
    if context > st.max_prompt_tokens:
        raise ApiError(400, f"the text around the span has {context} tokens; this server accepts at most "
                            f"{st.max_prompt_tokens}", param=param, code="prompt_too_long")
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    common = {"length": body.length, "seed": seed, "suffix_window": body.suffix_window, "step_events": True,
              **body.sampler_overrides()}
    if rewriting:
        return editing.rewrite_stream(st.pipeline, body.text, start, end, **common)
    return editing.infill_stream(st.pipeline, prefix, suffix, **common)


def _count_tokens(st: ServerState, text: str) -> int:
    if not text:
        return 0
    st.pipeline.tokenizer.encode_special_tokens = False  # as printpress.editing tokenises
    return len(st.pipeline.tokenizer.encode(text, add_special_tokens=False).ids)


# ------------------------------------------------------------------------------------------------
# Answers
# ------------------------------------------------------------------------------------------------


def response_of(st: ServerState, result: editing.EditResult, rid: str, created: int) -> p.EditResponse:
    raw = editing.result_json(result)
    stats = raw["stats"]
    wall = stats["wall_time_s"]
    stats["tokens_per_second"] = stats["length"] / wall if wall > 0 else 0.0
    return p.EditResponse(id=rid, created=created, model=st.model_name, text=raw["text"], middle=raw["middle"],
                          start=raw["start"], end=raw["end"], middle_ids=raw["middle_ids"], seed=raw["seed"],
                          stats=p.EditStats(**stats), candidates=[p.EditCandidate(**c) for c in raw["candidates"]])


def step_payload(st: ServerState, rid: str, event: editing.SpanStepEvent) -> p.EditStepPayload:
    span = event.span
    argmax, tokens = list(event.argmax[:span]), list(event.tokens[:span])
    return p.EditStepPayload(id=rid, index=0, canvas=event.canvas, step=event.step, max_steps=event.max_steps,
                             accepted=list(event.accepted[:span]), argmax=argmax, tokens=tokens,
                             argmax_text=[st.piece(t) for t in argmax], tokens_text=[st.piece(t) for t in tokens],
                             stopped=event.stopped, span=span, clamped=len(event.tokens) - span)


async def _collect(request: Request, job: EditJob) -> None:
    try:
        async for _, event in guarded(request, [job], _events(job)):
            pass
    except Exception as exc:  # noqa: BLE001 - mapped to the right status (500 only for bugs)
        raise from_library(exc) from None


async def _events(job: EditJob) -> AsyncIterator[tuple[EditJob, object]]:
    async for event in job.ticket.aevents():
        if isinstance(event, DoneEvent):
            job.result = event.result
        yield job, event


def _edit_events(st: ServerState, request: Request, job: EditJob, rid: str, created: int,
                 stream_steps: bool) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        async for _, event in guarded(request, [job], _events(job)):
            if isinstance(event, editing.SpanStepEvent):
                if stream_steps:
                    yield sse(step_payload(st, rid, event), "printpress.step")
            elif isinstance(event, CommitEvent):
                if stream_steps:
                    yield sse(p.CommitPayload(id=rid, index=0, canvas=event.canvas, token_ids=list(event.token_ids),
                                              text=event.text, finished=True), "printpress.commit")
            elif isinstance(event, DoneEvent):
                yield sse(response_of(st, event.result, rid, created))

    return sse_body(events())
