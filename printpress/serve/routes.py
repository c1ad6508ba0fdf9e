"""The OpenAI routes: `api_router()` (GET /v1/models, POST /v1/completions and /v1/chat/completions, and printpress's
GET /v1/settings) and `health_router()` (GET /health). A route checks the body against the server's limits,
tokenizes off the event loop, submits its choices (`jobs.submit_jobs`) and answers JSON or server-sent events
(`streaming`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from printpress.serve import protocol as p
from printpress.serve.access import require_key
from printpress.serve.errors import ERROR_RESPONSES, ApiError
from printpress.serve.jobs import Job, collect, submit_jobs, sum_usage
from printpress.serve.logprobs import chat_logprobs, completion_logprobs
from printpress.serve.state import ServerState, StateDep, check_model, check_text_size, max_tokens_for, new_id
from printpress.serve.streaming import event_stream, sse, stream_body


SSE_RESPONSE = {"text/event-stream": {"schema": {"type": "string"},
                                      "example": 'data: {"object": "text_completion", ...}\n\ndata: [DONE]\n\n'}}


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


def api_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)

    @router.get("/models", response_model=p.ModelList, summary="The served model")
    def list_models(st: StateDep) -> p.ModelList:
        return p.ModelList(data=[_model_card(st)])

    @router.get("/models/{model_id}", response_model=p.ModelCard, summary="One model")
    def get_model(model_id: str, st: StateDep) -> p.ModelCard:
        check_model(st, model_id)
        return _model_card(st)

    @router.get("/settings", response_model=p.SettingList, summary="The sampler settings a request may give",
                description="printpress extension. Each sampler setting of the completion, chat and edit requests: "
                            "its field, type, the modes that take it, its range and the served model's default. "
                            "The web page draws its settings from the same list.")
    def list_settings(st: StateDep) -> p.SettingList:
        return st.setting_list()

    @router.post("/completions", response_model=p.Completion, summary="Complete a prompt (OpenAI legacy completions)",
                 responses={200: {"content": SSE_RESPONSE, "description": "JSON, or SSE chunks when stream=true"}})
    async def completions(body: p.CompletionRequest, request: Request, st: StateDep):
        check_model(st, body.model)
        max_tokens = max_tokens_for(st, body.max_tokens, "max_tokens")
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs asks for the prompt's log-probabilities too, which printpress does "
                                "not compute; leave out echo or logprobs", param="echo")
        prompts = await prompt_ids_of(st, body.prompt)
        jobs = submit_jobs(st, prompts, body, max_tokens, body.stream and body.stream_steps, body.logprobs)
        rid, created = new_id("cmpl"), int(time.time())
        echo = [st.decode(job.prompt_ids) if body.echo else "" for job in jobs]
        if body.stream:
            return event_stream(_completion_stream(st, request, jobs, body, rid, created, echo), jobs)
        await collect(request, jobs)
        return p.Completion(
            id=rid, created=created, model=st.model_name,
            choices=[p.CompletionChoice(index=j.index, text=echo[j.index] + j.text.text,
                                        finish_reason=j.text.finish_reason, logprobs=_completion_logprobs(st, j, True))
                     for j in jobs],
            usage=sum_usage(jobs), printpress=[j.stats() for j in jobs],
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
        top = _chat_top_logprobs(body)
        ids = await run_in_threadpool(st.pipeline.encode_text, text)
        jobs = submit_jobs(st, [ids], body, max_tokens, body.stream and body.stream_steps, top)
        rid, created = new_id("chatcmpl"), int(time.time())
        if body.stream:
            return event_stream(_chat_stream(st, request, jobs, body, rid, created), jobs)
        await collect(request, jobs)
        return p.ChatCompletion(
            id=rid, created=created, model=st.model_name,
            choices=[p.ChatChoice(index=j.index, message=p.ChatMessageOut(content=j.text.text),
                                  finish_reason=j.text.finish_reason, logprobs=_chat_logprobs(st, j, True))
                     for j in jobs],
            usage=sum_usage(jobs), printpress=[j.stats() for j in jobs],
        )

    return router


def _chat_top_logprobs(body: p.ChatCompletionRequest) -> int | None:
    """Chat's two fields as the engine's one: None (no log-probabilities), or the alternatives to list per token."""
    if body.logprobs:
        return body.top_logprobs or 0
    if body.top_logprobs:
        raise ApiError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true", param="top_logprobs")
    return None


def _completion_logprobs(st: ServerState, job: Job, final: bool) -> p.CompletionLogprobs | None:
    """The job's log-probabilities not given out yet, in the legacy format (None when not asked for)."""
    if job.logprobs is None:
        return None
    return completion_logprobs(job.logprobs.take(job.text, final), st.piece)


def _chat_logprobs(st: ServerState, job: Job, final: bool) -> p.ChatLogprobs | None:
    """The same in chat's format."""
    if job.logprobs is None:
        return None
    return chat_logprobs(job.logprobs.take(job.text, final), st.piece, st.token_bytes)


def _model_card(st: ServerState) -> p.ModelCard:
    c = st.pipeline.config.text
    return p.ModelCard(id=st.model_name, created=st.created, canvas_length=st.pipeline.canvas_length,
                       max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size)


def _completion_stream(st, request, jobs, body: p.CompletionRequest, rid, created, echo) -> AsyncIterator[str]:
    def chunk(job: Job, delta: str, finish: str | None, logprobs: bool = True):
        stats = [job.stats()] if finish is not None else None
        lp = _completion_logprobs(st, job, finish is not None) if logprobs else None
        return p.Completion(id=rid, created=created, model=st.model_name, printpress=stats,
                            choices=[p.CompletionChoice(index=job.index, text=delta, finish_reason=finish,
                                                        logprobs=lp)])

    def usage(total: p.Usage):
        return p.Completion(id=rid, created=created, model=st.model_name, choices=[], usage=total)

    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def body_iter():
        for job in jobs:
            if echo[job.index]:
                yield sse(chunk(job, echo[job.index], None, logprobs=False))
        async for item in stream_body(st, request, jobs, rid, body.stream_steps, chunk,
                                      usage if include_usage else None):
            yield item

    return body_iter()


def _chat_stream(st, request, jobs, body: p.ChatCompletionRequest, rid, created) -> AsyncIterator[str]:
    def chunk(job: Job, delta: str, finish: str | None, role: str | None = None):
        stats = [job.stats()] if finish is not None else None
        content = delta if (delta or finish is None) else None
        lp = None if role is not None else _chat_logprobs(st, job, finish is not None)
        return p.ChatCompletionChunk(
            id=rid, created=created, model=st.model_name, printpress=stats,
            choices=[p.ChatChunkChoice(index=job.index, delta=p.Delta(role=role, content=content),
                                       finish_reason=finish, logprobs=lp)])

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
