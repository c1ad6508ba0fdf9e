"""The scheduler: one worker thread owns the model and batches concurrent requests.

The HTTP layer never touches tensors. It builds a `Request` (prompt ids, settings, seed), hands it to
`Scheduler.submit`, and reads the request's events from the returned `Ticket`, from a thread
(`events()`) or from asyncio (`aevents()`).

Diffusion requests share decoder steps (continuous batching, `printpress.diffusion.DiffusionBatch`):
between two steps the worker admits waiting requests up to `Limits.max_rows`, drops cancelled and
timed-out ones, and then runs one decoder pass over every admitted request. AR and speculative
requests are interleaved with them, one token (or one verified draft) per request per step, each in
its own forward pass, and so are edits (`submit_stream`), one decoder pass per step. Each request draws
from its own generator, so its output is what it gets alone with the same seed.

A request that fails fails alone: when a shared step raises, `DiffusionBatch.step` rewinds the generators
and steps the requests one by one to find the culprit, and a stream that raises ends alone; the failed
request's ticket gets the error (`RequestFailed` for a bug), every other request goes on unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from printpress.diffusion import DiffusionBatch, OnError
from printpress.errors import GenerationError, PrintpressError
from printpress.events import CommitEvent, DoneEvent, Event
from printpress.pipeline import Pipeline, run
from printpress.request import Request, check_logprobs, check_prompts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one server accepts. Beyond `max_rows` requests wait; beyond `max_queued` waiting they are refused."""

    max_rows: int = 16  # requests decoded together
    max_queued: int = 64  # requests waiting for a row
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 1024
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_queued", "max_prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise PrintpressError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise PrintpressError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


class QueueFull(PrintpressError):
    """Too many requests are waiting (the server answers 429)."""


class RequestTimeout(PrintpressError):
    """A request ran past the per-request timeout and was stopped."""


class SchedulerClosed(PrintpressError):
    """The scheduler is shutting down and takes no more requests."""


class RequestFailed(Exception):
    """A request's generation raised: a bug, not the client's fault (the server answers 500). Only this request
    ends; the requests it shared steps with go on (`DiffusionBatch.step`, `_Streams.step`)."""

    @classmethod
    def of(cls, exc: Exception) -> RequestFailed:
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        failed = cls(f"generating this request failed ({type(exc).__name__}: {detail}); other requests were not "
                     "affected")
        failed.__cause__ = exc
        return failed


_END = object()  # after the DoneEvent (or an error), nothing more comes


class Ticket:
    """One submitted request: its events, and a way to cancel it."""

    def __init__(self, ticket_id: int, request: Request | None, step_events: bool, deadline: float) -> None:
        self.id = ticket_id
        self.request = request  # None for work that brings its own stream (`Scheduler.submit_stream`)
        self.stream: Iterator[Event] | None = None
        self.step_events = step_events
        self.deadline = deadline
        self.cancelled = False
        self._lock = threading.Lock()
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_items: asyncio.Queue | None = None
        self._wake: threading.Event | None = None  # set by the scheduler so cancel() wakes its worker

    def cancel(self) -> None:
        """Stop generating for this request; its row is freed before the next step."""
        self.cancelled = True
        if self._wake is not None:
            self._wake.set()

    # -- the worker's side ----------------------------------------------------------------------------------
    def _put(self, item) -> None:
        with self._lock:
            if self._async_items is not None:
                self._loop.call_soon_threadsafe(self._async_items.put_nowait, item)
            else:
                self._items.put(item)

    def _finish(self, error: Exception | None = None) -> None:
        if error is not None:
            self._put(error)
        self._put(_END)

    # -- the reader's side ----------------------------------------------------------------------------------
    def events(self) -> Iterator[Event]:
        """The request's events, blocking; raises RequestTimeout or the error that stopped it."""
        while True:
            item = self._items.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    async def aevents(self) -> AsyncIterator[Event]:
        """The same events for asyncio code; stopping early (a client that left) should call `cancel()`."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._async_items = asyncio.Queue()
            while True:  # whatever arrived before the reader started
                try:
                    self._async_items.put_nowait(self._items.get_nowait())
                except queue.Empty:
                    break
        while True:
            item = await self._async_items.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item


class _Streams:
    """Work without a shared-step batch, each an engine event stream of its own: AR and speculative requests
    (advanced to their next commit at every step) and edits (advanced by one event, one decoder pass)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.streams: dict[int, tuple[Iterator[Event], bool]] = {}

    def __len__(self) -> int:
        return len(self.streams)

    def add(self, handle: int, request: Request, step_events: bool) -> None:
        stream = run(self.pipeline.model, self.pipeline.canvas_length, [request], self.pipeline._decoder(), step_events)
        self.add_stream(handle, stream, per_commit=True)

    def add_stream(self, handle: int, stream: Iterator[Event], per_commit: bool) -> None:
        self.streams[handle] = (_renumbered(stream, handle), per_commit)

    def remove(self, handle: int) -> None:
        self.streams.pop(handle, None)

    def step(self, on_error: OnError) -> list[Event]:
        """Advance every stream; a stream that raises ends alone, its exception handed to `on_error`."""
        events: list[Event] = []
        for handle, (stream, per_commit) in list(self.streams.items()):
            try:
                events.extend(self._advance(handle, stream, per_commit))
            except Exception as exc:  # noqa: BLE001 - handed to on_error: this request fails, the others go on
                del self.streams[handle]
                on_error(handle, exc)
        return events

    def _advance(self, handle: int, stream: Iterator[Event], per_commit: bool) -> list[Event]:
        """One stream's events up to its next commit (or its next event), dropping it when it is done."""
        events: list[Event] = []
        for event in stream:
            events.append(event)
            if isinstance(event, DoneEvent):
                del self.streams[handle]
            if isinstance(event, (CommitEvent, DoneEvent)) or not per_commit:
                return events
        del self.streams[handle]  # ended without a DoneEvent (it should not)
        return events


def _renumbered(stream: Iterator[Event], handle: int) -> Iterator[Event]:
    for event in stream:
        yield dataclasses.replace(event, request=handle)


class Scheduler:
    """Owns the model on one worker thread; see the module docstring."""

    def __init__(self, pipeline: Pipeline, limits: Limits | None = None) -> None:
        self.pipeline = pipeline
        self.limits = limits or Limits()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: deque[Ticket] = deque()
        self._running: dict[int, Ticket] = {}
        self._diffusion = DiffusionBatch(pipeline.model, pipeline.canvas_length, pipeline._decoder())
        self._streams = _Streams(pipeline)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0  # shared steps run so far (for tests and metrics)

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="printpress-scheduler", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop taking requests, end the ones in flight with SchedulerClosed, and stop the worker."""
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._lock:
            return len(self._running), len(self._waiting)

    # -- submitting -------------------------------------------------------------------------------------------
    def submit(self, request: Request, step_events: bool = False) -> Ticket:
        """Queue a request; raises GenerationError for one that cannot run, QueueFull when too many wait."""
        self.check(request)
        return self._enqueue(request, None, step_events)

    def submit_stream(self, stream: Iterator[Event]) -> Ticket:
        """Queue work that brings its own event stream (an edit: `printpress.editing.infill_stream` or
        `rewrite_stream`, already validated). It takes a row like a request and is advanced by one event (one
        decoder pass) per step, between the shared steps of the others."""
        return self._enqueue(None, stream, True)

    def _enqueue(self, request: Request | None, stream: Iterator[Event] | None, step_events: bool) -> Ticket:
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            if len(self._waiting) >= self.limits.max_queued:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting; try again later")
            ticket = Ticket(next(self._ids), request, step_events, time.monotonic() + self.limits.request_timeout_s)
            ticket.stream = stream
            ticket._wake = self._wake
            self._waiting.append(ticket)
        self._wake.set()
        return ticket

    def check(self, request: Request) -> None:
        """The checks `submit` makes, without queueing: settings, prompt and this server's limits."""
        request.settings.validate()
        check_logprobs(request)
        if len(request.prompt_ids) > self.limits.max_prompt_tokens:
            raise GenerationError(f"the prompt has {len(request.prompt_ids)} tokens; this server accepts at most "
                                  f"{self.limits.max_prompt_tokens}")
        if request.settings.max_new_tokens > self.limits.max_new_tokens:
            raise GenerationError(f"max_new_tokens is {request.settings.max_new_tokens}; this server allows at most "
                                  f"{self.limits.max_new_tokens}")
        check_prompts(self.pipeline.model.config, self.pipeline.canvas_length, [request])

    # -- the worker -------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                with self._lock:
                    closed = self._closed
                if closed:
                    self._shut_down()
                    return
                self._admit()
                self._drop_cancelled()
                if not self._running:
                    break
                self._step()

    def _batch_for(self, ticket: Ticket):
        if ticket.request is not None and ticket.request.settings.mode == "diffusion":
            return self._diffusion
        return self._streams

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or len(self._running) >= self.limits.max_rows:
                    return
                ticket = self._waiting.popleft()
            if ticket.cancelled:
                ticket._finish()
                continue
            try:
                if ticket.request is None:
                    self._streams.add_stream(ticket.id, ticket.stream, per_commit=False)
                else:
                    self._batch_for(ticket).add(ticket.id, ticket.request, ticket.step_events)
            except PrintpressError as exc:
                ticket._finish(exc)
                continue
            except Exception as exc:  # a bug: this request fails, the server goes on
                logger.exception("request %d failed to start", ticket.id)
                ticket._finish(RequestFailed.of(exc))
                continue
            with self._lock:
                self._running[ticket.id] = ticket

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        with self._lock:
            waiting = list(self._waiting)
        for ticket in waiting:  # a client that left, or waited too long, gives its queue place back
            if ticket.cancelled or now > ticket.deadline:
                with self._lock:
                    self._waiting.remove(ticket)
                ticket._finish(None if ticket.cancelled else RequestTimeout(
                    f"the request waited past the {self.limits.request_timeout_s:g} s timeout"))
        for ticket in list(self._running.values()):
            if ticket.cancelled or now > ticket.deadline:
                self._batch_for(ticket).remove(ticket.id)
                with self._lock:
                    del self._running[ticket.id]
                error = None if ticket.cancelled else RequestTimeout(
                    f"the request ran past the {self.limits.request_timeout_s:g} s timeout")
                ticket._finish(error)

    def _step(self) -> None:
        events: list[Event] = []
        try:
            for batch in (self._diffusion, self._streams):
                if len(batch):
                    events.extend(batch.step(self._fail))
        except Exception as exc:  # a bug outside any one request: fail the requests in flight, not the server
            logger.exception("a generation step failed")
            for ticket in list(self._running.values()):
                self._batch_for(ticket).remove(ticket.id)
                ticket._finish(exc)
            with self._lock:
                self._running.clear()
            return
        self.steps += 1
        for event in events:
            ticket = self._running.get(event.request)
            if ticket is None:
                continue  # cancelled, or failed during the step
            ticket._put(event)
            if isinstance(event, DoneEvent):
                with self._lock:
                    del self._running[ticket.id]
                ticket._finish()

    def _fail(self, handle: int, exc: Exception) -> None:
        """One request's generation raised (its batch has dropped it): it ends with an error, the others go on.

        A `PrintpressError` is the request's own fault and passes as it is (a 400); anything else is a bug, logged
        with its traceback and passed on as `RequestFailed` (a 500 that says what failed).
        """
        with self._lock:
            ticket = self._running.pop(handle, None)
        if ticket is None:
            return
        if not isinstance(exc, PrintpressError):
            logger.error("request %d failed; the others go on", handle, exc_info=exc)
            exc = RequestFailed.of(exc)
        ticket._finish(exc)

    def _shut_down(self) -> None:
        with self._lock:
            tickets = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
        for ticket in tickets:
            self._batch_for(ticket).remove(ticket.id)
            ticket._finish(SchedulerClosed("the server is shutting down"))
