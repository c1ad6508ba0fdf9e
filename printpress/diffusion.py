"""Diffusion decoding: the canvas loop, served by continuous batching (`DiffusionBatch`).

Each request keeps its own KV cache, requests join and leave between decoder steps, and each step is one
decoder pass over the canvases of every request still denoising, followed by the canvas step
(printpress/canvas.py) per request. So a finished request stops costing compute at once, and a new request
need not wait for a batch boundary. The server's scheduler drives the same object.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from printpress.cache import StackedCache
from printpress.canvas import StepOutcome, advance, denoise, denoise_step, step_event
from printpress.errors import GenerationError
from printpress.events import CommitEvent, Decode, Event
from printpress.request import Request, RequestState, check_prompts, model_device, new_token_budget
from printpress.sampling import pad_after_eos, uniform_tokens

logger = logging.getLogger(__name__)

OnError = Callable[[int, Exception], None]  # a failed request's handle and exception (DiffusionBatch.step)


def diffusion(
    model: torch.nn.Module,
    canvas_length: int,
    requests: Sequence[Request],
    decode: Decode | None,
    step_events: bool,
) -> Iterator[Event]:
    """Every request of a call decoded together, request i's events carrying i."""
    batch = DiffusionBatch(model, canvas_length, decode)
    for index, request in enumerate(requests):
        batch.add(index, request, step_events)
    while batch:
        yield from batch.step()


class DiffusionBatch:
    """Diffusion requests decoded together: one shared decoder pass per step (continuous batching).

    Requests join (`add`) and leave (`remove`, or when they finish) between steps, and each request
    moves through its canvases on its own clock: a request whose canvas stopped early commits it,
    encodes it into its cache and starts its next canvas at the next step, while the others go on.

    Each request owns a one-row `KVCache` and its own generator. A step stacks the caches of the
    requests it serves (`StackedCache`, rebuilt only when a request joins, commits or leaves; a request
    alone reads its own cache), runs one decoder pass, and samples each row with its own generator
    in the reference's order. So a request's tokens do not depend on who shares its steps.
    """

    def __init__(self, model: torch.nn.Module, canvas_length: int, decode: Decode | None = None) -> None:
        self.model = model
        self.canvas_length = canvas_length
        self.decode = decode
        self.device = model_device(model)
        self.rows: list[RequestState] = []
        self._stacked: StackedCache | None = None
        self._stacked_key: tuple | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def add(self, handle: int, request: Request, step_events: bool = True) -> None:
        """Encode the prompt of a new request and start its first canvas; events carry `handle`."""
        request.settings.validate()
        check_prompts(self.model.config, self.canvas_length, [request])
        table = self.model.draft_table
        if request.settings.canvas_start == "table" and (table is None or table.distributions is None):
            raise GenerationError("canvas_start 'table' draws from the model's draft table's sampled counts, and this "
                                  "model has " + ("no draft table" if table is None else "a table without them")
                                  + ": make one with `printpress draft-table MODEL`")
        settings = request.settings
        room = new_token_budget(settings, self.canvas_length)  # the positions the request's text and canvas take
        # A sliding canvas commits up to max_new_tokens and reads its canvas after them; others commit whole canvases.
        budget = settings.max_new_tokens if settings.sliding else room
        row = RequestState.start(handle, request, self.device, budget, step_events=step_events)
        prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        row.cache = self.model.new_cache(1, prompt.shape[1] + room)
        self.model.encode(prompt, row.cache, logits="none")
        self._start_canvas(row)
        self.rows.append(row)

    def remove(self, handle: int) -> None:
        """Drop a request (cancelled): it costs nothing from the next step on."""
        self.rows = [row for row in self.rows if row.index != handle]

    def _start_canvas(self, row: RequestState) -> None:
        row.start_canvas(self.canvas_length, self.model.config.vocab_size, self.device)
        if row.settings.canvas_start == "table":  # after the uniform draw: the random stream as with noise, then this
            text = list(row.request.prompt_ids) + row.tokens
            tokens, _ = self.model.draft_table.sample(text, self.canvas_length, row.generator)
            if tokens:
                row.canvas[0, : len(tokens)] = torch.tensor(tokens, device=self.device)

    @torch.no_grad()
    def step(self, on_error: OnError | None = None) -> list[Event]:
        """One decoder pass over every request; returns its step, commit and done events.

        Without `on_error` an exception ends the step (a `Pipeline.generate` call fails as a whole). With it, a
        request that fails fails alone, so one caller's bad request cannot end another's (the server's
        scheduler): when the shared pass raises, each request's generator is put back and the requests are
        stepped one by one, as each would be stepped alone; a request whose own step raises is removed and
        handed to `on_error(handle, exception)`, and the others get exactly the events they get alone (but for a
        sliding row whose last commit the failed step had already encoded: it reads that from its cache then, the
        same step up to rounding).
        """
        if on_error is None or len(self.rows) == 1:
            return self._step(list(self.rows), on_error)
        generators = [(row.generator, row.generator.get_state()) for row in self.rows]
        try:
            return self._step(list(self.rows), on_error)
        except Exception:  # noqa: BLE001 - the culprit is found below and its exception handed on
            logger.warning("a shared decoder step of %d requests failed; stepping them one by one", len(self.rows))
            for generator, state in generators:
                generator.set_state(state)
        events: list[Event] = []
        for row in list(self.rows):
            events.extend(self._step([row], on_error))
        return events

    def _step(self, rows: list[RequestState], on_error: OnError | None) -> list[Event]:
        """Step `rows` together. The shared pass moves nothing but the rows' generators (and sliding rows' caches,
        `_shared_pass`) before it can raise, and
        raises unless it served one row and `on_error` is given; after it, each row's own work fails alone."""
        if len(rows) == 1:
            outcome = self._guarded(rows[0], on_error, self._shared_pass, rows)
            if outcome is None:
                return []
        else:
            outcome = self._shared_pass(rows)
        fed_back = outcome.feedback(self.model.dtype)
        events: list[Event] = []
        finished: list[RequestState] = []
        for j, row in enumerate(rows):
            events.extend(self._guarded(row, on_error, self._advance, row, outcome, fed_back, j, finished) or [])
        for row in finished:
            events.extend(self._guarded(row, on_error, self._commit, row) or [])
        return events

    def _shared_pass(self, rows: list[RequestState]) -> StepOutcome:
        """The decoder pass over the rows' canvases and the canvas step; moves nothing but the generators, and the
        caches of sliding rows whose last commit it encodes.

        A sliding row after a commit takes its own pass, which encodes the commit beside its moved canvas
        (`encode_and_denoise`: one pass where a commit's encoder pass and the next step would be two), alone or
        batched alike, so its tokens do not depend on its neighbours; the other rows share one pass."""
        found: dict[int, torch.Tensor] = {}
        for row in rows:
            if row.pending is not None:
                found[id(row)] = self.model.encode_and_denoise(row.pending[None], row.canvas, row.cache,
                                                               row.self_conditioning)
                row.pending = None
        shared = [row for row in rows if id(row) not in found]
        if shared:
            feedback, mask = self._self_conditioning(shared)
            canvases = shared[0].canvas if len(shared) == 1 else torch.cat([row.canvas for row in shared])
            logits = denoise(self.model, canvases, self._cache(shared), feedback, mask)
            found.update((id(row), logits[i : i + 1]) for i, row in enumerate(shared))
        logits = found[id(rows[0])] if len(rows) == 1 else torch.cat([found[id(row)] for row in rows])
        # A compiled decoder's logits are not the exact path's: its steps take their softmax and entropies in one
        # fused call too (`probabilities_and_entropy`).
        return denoise_step(logits, rows, self.model.config.vocab_size, exact=self.model.compiled_decoder is None)

    def _advance(self, row: RequestState, outcome: StepOutcome, fed_back: torch.Tensor, j: int,
                 finished: list[RequestState]) -> list[Event]:
        """Row j's share of the step: its step event, and its next canvas or (stopped) a place in `finished`."""
        row.count_decoder_pass()
        if row.settings.sliding:
            return self._slide(row, outcome, fed_back, j, finished)
        stopped = advance(row, outcome, j)
        events = [step_event(row, row.canvases, outcome, j, stopped)] if row.step_events else []
        if stopped or row.step == 0:
            row.committed_canvas = outcome.argmax[j].clone()
            finished.append(row)
        else:
            row.canvas = outcome.next_canvas[j : j + 1]
            row.self_conditioning = fed_back[j : j + 1]
        return events

    def _slide(self, row: RequestState, outcome: StepOutcome, fed_back: torch.Tensor, j: int,
               finished: list[RequestState]) -> list[Event]:
        """A sliding canvas's share of the step (`sliding`): the canvas's leading run of fixed points (positions the
        step kept whose sample is the token this pass read there, so each was predicted from the others' final
        values) goes to `finished` to be committed, or its first position alone once it has waited `steps` steps;
        the rest of the canvas moves to the front with its self-conditioning, and fresh noise fills the end (no
        signal there)."""
        fixed = outcome.accepted[j] & (outcome.next_canvas[j] == row.canvas[0])
        kept = fixed.long().cumprod(0).sum().item() or int(row.step == 1)
        kept = min(kept, row.budget - len(row.tokens))
        row.step -= 1
        events = [step_event(row, row.canvases, outcome, j, kept > 0)] if row.step_events else []
        canvas, signal = outcome.next_canvas[j : j + 1], fed_back[j : j + 1]
        if kept:
            row.committed_canvas = canvas[0, :kept].clone()
            noise = uniform_tokens(kept, self.model.config.vocab_size, row.generator, self.device)
            canvas = torch.cat([canvas[:, kept:], noise], dim=1)
            signal = torch.cat([signal[:, kept:], signal.new_zeros(1, kept, signal.shape[2])], dim=1)
            row.step = row.settings.max_denoising_steps
            finished.append(row)
        row.canvas, row.self_conditioning = canvas, signal
        return events

    def _commit(self, row: RequestState) -> list[Event]:
        """Commit the row's canvas; then start its next canvas, or it is done and leaves."""
        events = list(_commit_canvas(row, row.canvases, self.decode))
        if not row.finished:
            if row.settings.sliding:  # its canvas has moved on already (`_slide`); its next pass encodes the commit
                row.pending = row.committed_canvas
                return events
            # The next canvas sees the committed one through the cache, as the reference re-encodes it.
            self.model.encode(row.committed_canvas[None], row.cache, logits="none")
            self._start_canvas(row)
        else:
            events.append(row.done("diffusion", self.decode))
            self.rows.remove(row)
        return events

    def _guarded(self, row: RequestState, on_error: OnError | None, work, *args):
        """`work(*args)`; if it raises, with `on_error` the row is removed, the exception handed on and None
        returned (without `on_error` the exception propagates)."""
        try:
            return work(*args)
        except Exception as exc:
            if on_error is None:
                raise
            self._fail(row, exc, on_error)
            return None

    def _fail(self, row: RequestState, exc: Exception, on_error: OnError) -> None:
        self.remove(row.index)
        on_error(row.index, exc)

    def _cache(self, rows: list[RequestState]):
        if len(rows) == 1:
            return rows[0].cache
        key = tuple((id(row), row.cache.length) for row in rows)
        if key != self._stacked_key:
            self._stacked = StackedCache([row.cache for row in rows], self.canvas_length)
            self._stacked_key = key
        return self._stacked

    def _self_conditioning(self, rows: list[RequestState]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The previous step's signal per row; rows at their first step get zeros, masked out."""
        previous = [row.self_conditioning for row in rows]
        if all(p is None for p in previous):
            return None, None
        if len(previous) == 1:  # one row's own signal, not a copy of it
            return previous[0], None
        template = next(p for p in previous if p is not None)
        stacked = torch.cat([template.new_zeros(template.shape) if p is None else p for p in previous])
        if all(p is not None for p in previous):
            return stacked, None
        mask = torch.tensor([p is not None for p in previous], device=self.device)
        return stacked, mask


def _commit_canvas(row: RequestState, canvas_index: int, decode: Decode | None) -> Iterator[CommitEvent]:
    """Commit the row's last argmax canvas, pad after its first EOS (as the reference does)."""
    settings = row.settings
    tokens, _ = pad_after_eos(row.committed_canvas, settings.eos_token_ids, settings.pad_token_id)
    row.committed_canvas = tokens
    new = tokens.tolist()
    row.commit(new)
    row.canvases += 1
    logger.debug("request %d: canvas %d committed after %d decoder passes in all", row.index, canvas_index,
                 row.forward_passes)
    yield CommitEvent(row.index, canvas_index, new, row.text_delta(decode), row.finished)
