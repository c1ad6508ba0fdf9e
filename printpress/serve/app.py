"""The HTTP layer: an OpenAI-compatible API and the web page, on FastAPI.

It never touches tensors: it turns JSON into `printpress.request.Request`s (text -> ids with the pipeline's
tokenizer, settings validated by `pipeline.settings`), hands them to the scheduler, and turns the scheduler's
events back into JSON or server-sent events. Batching, slots, queueing and timeouts are the scheduler's.

Layout, so that more endpoints (editing, infill) can be added beside these without rewriting them:
- `ServerState` (on `app.state.printpress`, reached with the `state` dependency) holds the pipeline, the
  scheduler and the settings; `require_key` is the auth dependency every API router takes.
- `submit_jobs` / `job_events` / `sse` are the building blocks a route uses: submit requests, read their
  events (several choices merged), format server-sent events.
- Routers: `api_router()` (/v1/...), `health_router()`, `web_router()` (the page); `create_app` mounts them
  plus any `extra_routers` it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from printpress.errors import PrintpressError
from printpress.events import CommitEvent, DoneEvent, GenerationResult, StepEvent
from printpress.request import Request as EngineRequest
from printpress.sampling import refuse_canvas_steps
from printpress.serve import protocol as p
from printpress.serve.chat import ChatFormatter
from printpress.serve.output import ChoiceText
from printpress.serve.scheduler import QueueFull, RequestFailed, RequestTimeout

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DISCONNECT_POLL_S = 0.25


# ------------------------------------------------------------------------------------------------
# Errors: one JSON shape (OpenAI's) for every failure
# ------------------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return p.ErrorResponse(error=p.ErrorBody(message=self.message, type=self.type, param=self.param,
                                                 code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _from_library(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, RequestTimeout):
        return ApiError(408, str(exc), "timeout_error", code="request_timeout")
    if isinstance(exc, RequestFailed):  # a bug that ended this request alone (the scheduler logged it)
        return ApiError(500, str(exc), "server_error", code="generation_failed")
    if isinstance(exc, PrintpressError):
        return ApiError(400, str(exc))
    logger.exception("internal error")
    return ApiError(500, "internal server error", "server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence for pydantic's error list, naming the field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = _most_telling(errors)
    param, union = _where(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    if kind == "missing" and param is None:
        return "the request body is empty; expected a JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field '{param}' (not supported by this server)", param
    if kind == "missing":
        return f"missing required field '{param}'", param
    if param is None:
        return f"the body must be a JSON object: {first.get('msg')}", None
    if union is not None and kind != "value_error":  # no member of a union (str | list[int] | ...) took the value
        at = union[0]
        members = dict.fromkeys(u[1] for u in (_where(e.get("loc", ()))[1] for e in errors) if u and u[0] == at)
        return f"{at} has the wrong type: expected one of {', '.join(members)}", at
    message = str(first.get("msg", "")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 and union is None else ""
    return f"{param}: {message}{more}", param


def _most_telling(errors: list[dict]) -> dict:
    """A failed check of a value (a lone surrogate, a bad chat name) says more than a union's wrong types."""
    return next((e for e in errors if e.get("type") == "value_error"), errors[0])


def _where(loc) -> tuple[str | None, tuple[str, str] | None]:
    """pydantic's error location as the field path a client wrote ("messages.0.content"), and, when it passes a
    union, the path up to it and the member it names ("str", "list[TextPart]": not fields, so not in the path)."""
    path: list[str] = []
    union = None
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int) or (part.isidentifier() and part.islower() and part not in _TYPE_NAMES):
            path.append(str(part))
        elif union is None:
            union = (".".join(path), part)
    return ".".join(path) or None, union


_TYPE_NAMES = frozenset({"str", "int", "float", "bool"})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind, headers=exc.headers).response()

    @app.exception_handler(PrintpressError)
    async def _library(request: Request, exc: PrintpressError):
        return _from_library(exc).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        return _from_library(exc).response()


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413, before any parsing.

    The body is read here (up to the limit) and replayed to the app, so a client cannot make the app buffer
    more than the limit whatever Content-Length says.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = ApiError(413, f"the request body is larger than {self.max_bytes} bytes", code="body_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_big.response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await too_big.response()(scope, receive, send)
            chunks.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return chunks.pop(0) if chunks else await receive()

        return await self.app(scope, replay, send)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class HostCheck:
    """ASGI middleware for a server without an API key: answer only requests whose `Host` names an allowed host.

    Loopback is reachable only from this machine, but a web page open in its browser can point a name of its own
    at 127.0.0.1 (DNS rebinding) and then read the API's answers as same-origin. Those requests carry the page's
    name in `Host`, so refusing names the server was not told it has stops them (as Jupyter guards its server).
    `"*"` in `allowed` turns the check off.
    """

    def __init__(self, app, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = frozenset(host_name(name) for name in allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        host = host_name(dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1"))
        if host in self.allowed:
            return await self.app(scope, receive, send)
        names = ", ".join(f"[{n}]" if ":" in n else n for n in sorted(self.allowed))
        refused = ApiError(403, f"this server has no API key, so it answers only requests addressed to {names} "
                                "(a guard against DNS rebinding); start it with --allowed-hosts to add a name, or "
                                "with an API key", "permission_error", code="host_not_allowed")
        return await refused.response()(scope, receive, send)


def host_name(host: str) -> str:
    """The host of a `Host` header or a host name, without port, brackets or trailing dot, in lower case."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.split(":", 1)[0]
    return host.rstrip(".")


# ------------------------------------------------------------------------------------------------
# State and dependencies
# ------------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    pipeline: object  # printpress.pipeline.Pipeline
    scheduler: object  # printpress.serve.scheduler.Scheduler
    model_name: str
    max_new_tokens: int  # the longest output a request may ask for
    max_prompt_tokens: int
    max_steps: int = 1024  # the most denoising steps per canvas a request may ask for
    max_prompt_chars: int | None = None  # longer text cannot fit max_prompt_tokens (`prompt_chars_limit`)
    api_key: str | None = None
    chat: ChatFormatter = field(default_factory=ChatFormatter)
    created: int = field(default_factory=lambda: int(time.time()))
    _pieces: dict[int, str] = field(default_factory=dict)

    @property
    def default_max_tokens(self) -> int:
        return min(self.pipeline.generation_config.max_new_tokens, self.max_new_tokens)

    def decode(self, ids: list[int]) -> str:
        if self.pipeline.tokenizer is None:
            return " ".join(map(str, ids))
        return self.pipeline.decode(ids)

    def piece(self, token: int) -> str:
        """One token as text, special tokens included (cached: the step stream asks for the same ids often)."""
        text = self._pieces.get(token)
        if text is None:
            tok = self.pipeline.tokenizer
            text = str(token) if tok is None else tok.decode([token], skip_special_tokens=False)
            if len(self._pieces) < 1_000_000:
                self._pieces[token] = text
        return text


def state(request: Request) -> ServerState:
    return request.app.state.printpress


StateDep = Annotated[ServerState, Depends(state)]


_bearer = HTTPBearer(auto_error=False, description="Required when the server was started with an API key.")


def require_key(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """401 unless the request carries `Authorization: Bearer <key>` (when a key is set). Compared in constant time."""
    key = state(request).api_key
    if key is None:
        return
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), key.encode()):
        raise ApiError(401, "incorrect API key", "authentication_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


# ------------------------------------------------------------------------------------------------
# Generation building blocks
# ------------------------------------------------------------------------------------------------


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

    @property
    def finished(self) -> bool:
        return self.result is not None or self.text.hit_stop

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


def check_model(st: ServerState, name: str | None) -> None:
    if name is not None and name != st.model_name:
        raise ApiError(404, f"the model '{name}' does not exist; this server serves '{st.model_name}'",
                       "not_found_error", param="model", code="model_not_found")


def max_tokens_for(st: ServerState, asked: int | None, param: str) -> int:
    if asked is None:
        return st.default_max_tokens
    if asked > st.max_new_tokens:
        raise ApiError(400, f"{param} is {asked}; this server generates at most {st.max_new_tokens} tokens per request",
                       param=param, code="max_tokens_too_large")
    return asked


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > p.MAX_STOP_SEQUENCES:
        raise ApiError(400, f"stop has {len(stops)} sequences; at most {p.MAX_STOP_SEQUENCES} are allowed",
                       param="stop")
    return stops


def settings_for(st: ServerState, body: p.GenerationFields, max_tokens: int):
    """The request's sampler settings: the checkpoint's defaults with the body's fields applied, validated (the
    engine's rules: `Pipeline.settings`, and `steps` refused in speculative mode, which has `draft_steps`)."""
    for param in ("steps", "draft_steps"):
        asked = getattr(body, param)
        if asked is not None and asked > st.max_steps:
            raise ApiError(400, f"{param} is {asked}; this server runs at most {st.max_steps} denoising steps per "
                                "canvas", param=param)
    try:
        refuse_canvas_steps(body.mode, body.steps)
    except PrintpressError as exc:
        raise ApiError(400, str(exc), param="steps") from None
    return st.pipeline.settings(
        mode=body.mode, max_new_tokens=max_tokens, max_denoising_steps=body.steps, draft_steps=body.draft_steps,
        entropy_bound=body.entropy_bound, t_min=body.t_min, t_max=body.t_max,
        stability_threshold=body.stability_threshold, confidence_threshold=body.confidence_threshold,
        sample_accepted_only=body.sample_accepted_only, temperature=body.temperature, top_k=body.top_k,
    )


def prompt_chars_limit(tokenizer, max_prompt_tokens: int) -> int | None:
    """The longest text that can tokenise to `max_prompt_tokens` tokens or fewer: that many times the longest
    token of the vocabulary, in characters of its stored form (one per byte for byte-level BPE, so never fewer
    than the text it stands for). Text over it is refused before it is tokenised, which for a body of a few
    megabytes takes seconds of a server thread. None without a tokenizer (text is refused anyway)."""
    if tokenizer is None:
        return None
    return max_prompt_tokens * max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)


def check_text_size(st: ServerState, text: str, what: str, param: str) -> None:
    """400 `prompt_too_long` for text too long to fit the prompt limit, before tokenising it."""
    if st.max_prompt_chars is not None and len(text) > st.max_prompt_chars:
        raise ApiError(400, f"{what} has {len(text)} characters; this server accepts at most "
                            f"{st.max_prompt_tokens} tokens, which no text over {st.max_prompt_chars} characters "
                            "fits in", param=param, code="prompt_too_long")


def check_prompt(st: ServerState, ids: list[int]) -> None:
    if len(ids) > st.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {st.max_prompt_tokens}",
                       param="prompt", code="prompt_too_long")


def submit_jobs(st: ServerState, prompts: Sequence[list[int]], body: p.GenerationFields, max_tokens: int,
                stream_steps: bool) -> list[Job]:
    """Submit one request per choice (`n` per prompt, choice i with seed + i, indexed prompt by prompt as OpenAI
    does); all or none (a refusal cancels those already submitted)."""
    if body.stream_steps and not body.stream:
        raise ApiError(400, "stream_steps needs stream=true", param="stream_steps")
    n = body.n or 1
    if len(prompts) * n > p.MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompt(s) x n={n} is {len(prompts) * n} choices; at most "
                            f"{p.MAX_CHOICES} per request", param="n")
    for ids in prompts:
        check_prompt(st, ids)
    settings = settings_for(st, body, max_tokens)
    stops = stop_list(body.stop)
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    jobs: list[Job] = []
    try:
        for prompt_index, ids in enumerate(prompts):
            for choice in range(n):
                choice_seed = (seed + choice) % 2**64
                ticket = st.scheduler.submit(EngineRequest(list(ids), settings, choice_seed), step_events=stream_steps)
                text = ChoiceText(st.decode, max_tokens, settings.eos_token_ids, stops)
                jobs.append(Job(prompt_index * n + choice, ticket, text, list(ids), choice_seed,
                                counts_prompt=choice == 0))
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
        yield sse(_from_library(exc).body())


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
                delta = job.text.add(event.token_ids)
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
            yield sse(on_usage(_sum_usage(jobs)))

    return sse_body(events())


async def collect(request: Request, jobs: list[Job]) -> None:
    """Run every job to its end (non-streamed responses)."""
    try:
        async for job, event in guarded(request, jobs, job_events(jobs)):
            if isinstance(event, CommitEvent):
                job.text.add(event.token_ids)
        for job in jobs:
            job.text.finish()
    except Exception as exc:  # noqa: BLE001 - mapped to the right status (500 only for bugs)
        raise _from_library(exc) from None


def _sum_usage(jobs: Sequence[Job]) -> p.Usage:
    usages = [job.usage() for job in jobs]
    return p.Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                   completion_tokens=sum(u.completion_tokens for u in usages),
                   total_tokens=sum(u.total_tokens for u in usages))


async def prompt_ids_of(st: ServerState, prompt) -> list[list[int]]:
    """The prompt field as token-id lists (text is tokenized off the event loop)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(x, str) for x in prompt):
        for text in prompt:
            check_text_size(st, text, "the prompt", "prompt")
        prompts = [await run_in_threadpool(st.pipeline.encode_text, x) for x in prompt]
    else:
        prompts = [list(x) for x in prompt]
    if len(prompts) > p.MAX_PROMPTS:
        raise ApiError(400, f"prompt holds {len(prompts)} prompts; at most {p.MAX_PROMPTS} per request", param="prompt")
    vocab = st.pipeline.config.text.vocab_size
    for ids in prompts:
        if not ids:
            raise ApiError(400, "a prompt is empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
    return prompts


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


# ------------------------------------------------------------------------------------------------
# Routes
# ------------------------------------------------------------------------------------------------

ERROR_RESPONSES = {status: {"model": p.ErrorResponse, "description": text} for status, text in (
    (400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"), (408, "Timed out"),
    (413, "Body too large"), (429, "Queue full"))}
SSE_RESPONSE = {"text/event-stream": {"schema": {"type": "string"},
                                      "example": 'data: {"object": "text_completion", ...}\n\ndata: [DONE]\n\n'}}


def api_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)

    @router.get("/models", response_model=p.ModelList, summary="The served model")
    def list_models(st: StateDep) -> p.ModelList:
        return p.ModelList(data=[_model_card(st)])

    @router.get("/models/{model_id}", response_model=p.ModelCard, summary="One model")
    def get_model(model_id: str, st: StateDep) -> p.ModelCard:
        check_model(st, model_id)
        return _model_card(st)

    @router.post("/completions", response_model=p.Completion, summary="Complete a prompt (OpenAI legacy completions)",
                 responses={200: {"content": SSE_RESPONSE, "description": "JSON, or SSE chunks when stream=true"}})
    async def completions(body: p.CompletionRequest, request: Request, st: StateDep):
        check_model(st, body.model)
        max_tokens = max_tokens_for(st, body.max_tokens, "max_tokens")
        prompts = await prompt_ids_of(st, body.prompt)
        jobs = submit_jobs(st, prompts, body, max_tokens, body.stream and body.stream_steps)
        rid, created = _new_id("cmpl"), int(time.time())
        echo = [st.decode(job.prompt_ids) if body.echo else "" for job in jobs]
        if body.stream:
            return event_stream(_completion_stream(st, request, jobs, body, rid, created, echo), jobs)
        await collect(request, jobs)
        return p.Completion(
            id=rid, created=created, model=st.model_name,
            choices=[p.CompletionChoice(index=j.index, text=echo[j.index] + j.text.text,
                                        finish_reason=j.text.finish_reason) for j in jobs],
            usage=_sum_usage(jobs), printpress=[j.stats() for j in jobs],
        )

    @router.post("/chat/completions", response_model=p.ChatCompletion, summary="Answer a conversation",
                 responses={200: {"content": SSE_RESPONSE, "description": "JSON, or SSE chunks when stream=true"}})
    async def chat_completions(body: p.ChatCompletionRequest, request: Request, st: StateDep):
        check_model(st, body.model)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        asked, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                        is not None else (body.max_tokens, "max_tokens"))
        max_tokens = max_tokens_for(st, asked, param)
        text = st.chat(body.messages)
        check_text_size(st, text, "the conversation (in the chat template)", "messages")
        ids = await run_in_threadpool(st.pipeline.encode_text, text)
        jobs = submit_jobs(st, [ids], body, max_tokens, body.stream and body.stream_steps)
        rid, created = _new_id("chatcmpl"), int(time.time())
        if body.stream:
            return event_stream(_chat_stream(st, request, jobs, body, rid, created), jobs)
        await collect(request, jobs)
        return p.ChatCompletion(
            id=rid, created=created, model=st.model_name,
            choices=[p.ChatChoice(index=j.index, message=p.ChatMessageOut(content=j.text.text),
                                  finish_reason=j.text.finish_reason) for j in jobs],
            usage=_sum_usage(jobs), printpress=[j.stats() for j in jobs],
        )

    return router


def _model_card(st: ServerState) -> p.ModelCard:
    c = st.pipeline.config.text
    return p.ModelCard(id=st.model_name, created=st.created, canvas_length=st.pipeline.canvas_length,
                       max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size)


def _completion_stream(st, request, jobs, body: p.CompletionRequest, rid, created, echo) -> AsyncIterator[str]:
    def chunk(job: Job, delta: str, finish: str | None):
        stats = [job.stats()] if finish is not None else None
        return p.Completion(id=rid, created=created, model=st.model_name, printpress=stats,
                            choices=[p.CompletionChoice(index=job.index, text=delta, finish_reason=finish)])

    def usage(total: p.Usage):
        return p.Completion(id=rid, created=created, model=st.model_name, choices=[], usage=total)

    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def body_iter():
        for job in jobs:
            if echo[job.index]:
                yield sse(chunk(job, echo[job.index], None))
        async for item in stream_body(st, request, jobs, rid, body.stream_steps, chunk,
                                      usage if include_usage else None):
            yield item

    return body_iter()


def _chat_stream(st, request, jobs, body: p.ChatCompletionRequest, rid, created) -> AsyncIterator[str]:
    def chunk(job: Job, delta: str, finish: str | None, role: str | None = None):
        stats = [job.stats()] if finish is not None else None
        content = delta if (delta or finish is None) else None
        return p.ChatCompletionChunk(
            id=rid, created=created, model=st.model_name, printpress=stats,
            choices=[p.ChatChunkChoice(index=job.index, delta=p.Delta(role=role, content=content),
                                       finish_reason=finish)])

    def usage(total: p.Usage):
        return p.ChatCompletionChunk(id=rid, created=created, model=st.model_name, choices=[], usage=total)

    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def body_iter():
        for job in jobs:
            yield sse(chunk(job, "", None, role="assistant"))
        async for item in stream_body(st, request, jobs, rid, body.stream_steps, chunk,
                                      usage if include_usage else None):
            yield item

    return body_iter()


def health_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_model=p.Health, summary="Liveness: the model is loaded and the scheduler runs")
    def health(st: StateDep) -> p.Health:
        active, queued = st.scheduler.load  # (running, waiting) requests
        return p.Health(model=st.model_name, active=active, queued=queued)

    return router


STATIC_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
                "/app.js": ("app.js", "text/javascript; charset=utf-8"),
                "/style.css": ("style.css", "text/css; charset=utf-8"),
                "/edit.js": ("edit.js", "text/javascript; charset=utf-8")}


def web_router() -> APIRouter:
    """The page: a fixed set of files read from the package once (no route reads a path the client names)."""
    router = APIRouter(include_in_schema=False)
    folder = resources.files("printpress.serve") / "static"
    files = {route: (folder.joinpath(name).read_bytes(), media) for route, (name, media) in STATIC_FILES.items()}

    def serve(route: str):
        content, media = files[route]

        def handler() -> Response:
            return Response(content, media_type=media, headers={"Cache-Control": "no-cache"})

        return handler

    for route in files:
        router.add_api_route(route, serve(route), methods=["GET"])
    return router


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------


def _document_model_name(app: FastAPI, model_name: str) -> None:
    """The OpenAPI document names the one model id the `model` fields accept."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = build()
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                field_schema = document["components"]["schemas"][name]["properties"]["model"]
                field_schema["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


def create_app(pipeline, scheduler, *, model_name: str, max_new_tokens: int, max_prompt_tokens: int,
               max_steps: int = 1024, api_key: str | None = None, chat: ChatFormatter | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, manage_scheduler: bool = True,
               extra_routers: Sequence[APIRouter] = (), allowed_hosts: Iterable[str] = ()) -> FastAPI:
    """The FastAPI app over a pipeline and its scheduler.

    With `manage_scheduler` the app starts the scheduler on startup and closes it on shutdown. `api_key`
    (None: open) is held only here and compared in constant time; it is never logged. Without a key the app
    answers only requests addressed (`Host`) to a loopback name or one of `allowed_hosts` (`HostCheck`).
    """
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_scheduler:
            scheduler.start()
        try:
            yield
        finally:
            if manage_scheduler:
                scheduler.close()

    from printpress import __version__

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN; /openapi.json is served.
    # No trailing-slash redirects: Starlette builds their Location from the request's Host header.
    app = FastAPI(title="printpress", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False, description="An OpenAI-compatible API for text-diffusion models, with a "
                                                      "step stream (see docs/server.md).")
    app.state.printpress = ServerState(pipeline=pipeline, scheduler=scheduler, model_name=model_name,
                                       max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                       max_steps=max_steps, api_key=api_key or None, chat=chat or ChatFormatter(),
                                       max_prompt_chars=prompt_chars_limit(pipeline.tokenizer, max_prompt_tokens))
    _document_model_name(app, model_name)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if not api_key:  # added last, so it runs first: a refused Host costs nothing
        app.add_middleware(HostCheck, allowed=[*LOOPBACK_HOSTS, *allowed_hosts])
    app.include_router(api_router())
    app.include_router(health_router())
    for router in extra_routers:
        app.include_router(router)
    app.include_router(web_router())
    return app
