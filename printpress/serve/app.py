"""The HTTP layer: an OpenAI-compatible API and the web page, on FastAPI. `create_app` wires the parts:

- `state.py`: `ServerState` (on `app.state.printpress`, reached with the `state` dependency) holds the pipeline,
  the scheduler and the limits, with the checks of a request against them;
- `access.py`: the API key (`require_key`, which every API router takes), the Host allow-list, the body limit;
- `errors.py`: one JSON error shape for every failure;
- `jobs.py` and `streaming.py`: the building blocks a route uses: submit requests, read their events (several
  choices merged), format server-sent events;
- routers: `routes.api_router()` (/v1/...), `routes.health_router()`, `web_router()` (the page, below, with the
  sampler settings written in), and any `extra_routers` (the serve command mounts `edits.router()`).

It never touches tensors: it turns JSON into `printpress.request.Request`s (text -> ids with the pipeline's
tokenizer, settings validated by `pipeline.settings`), hands them to the scheduler, and turns the scheduler's
events back into JSON or server-sent events. Batching, slots, queueing and timeouts are the scheduler's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response

from printpress.serve import protocol as p
from printpress.serve.access import DEFAULT_MAX_BODY_BYTES, LOOPBACK_HOSTS, BodyLimit, HostCheck
from printpress.serve.chat import ChatFormatter
from printpress.serve.errors import install_error_handlers
from printpress.serve.routes import api_router, health_router
from printpress.serve.state import ServerState, prompt_chars_limit


STATIC_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
                "/app.js": ("app.js", "text/javascript; charset=utf-8"),
                "/style.css": ("style.css", "text/css; charset=utf-8"),
                "/edit.js": ("edit.js", "text/javascript; charset=utf-8")}


# Where index.html carries the sampler settings; the server writes them in when it starts (`web_router`).
SETTINGS_SLOT = b'<script id="sampler-settings" type="application/json">null</script>'


def web_router(settings: p.SettingList) -> APIRouter:
    """The page: a fixed set of files read from the package once (no route reads a path the client names).

    index.html gets `settings` (the document GET /v1/settings answers) written in, and app.js draws the sampler
    fields from them, so a new setting reaches the page with no edit to it. They are in the page rather than
    fetched because the page must draw its form before anyone types the API key that /v1 routes need."""
    router = APIRouter(include_in_schema=False)
    folder = resources.files("printpress.serve") / "static"
    files = {route: (folder.joinpath(name).read_bytes(), media) for route, (name, media) in STATIC_FILES.items()}
    page, media = files["/"]
    if page.count(SETTINGS_SLOT) != 1:
        raise RuntimeError("index.html must hold the sampler settings' slot once: " + SETTINGS_SLOT.decode())
    filled = SETTINGS_SLOT.replace(b"null", _script_json(settings.model_dump(mode="json")))
    files["/"] = (page.replace(SETTINGS_SLOT, filled), media)

    def serve(route: str):
        content, media = files[route]

        def handler() -> Response:
            return Response(content, media_type=media, headers={"Cache-Control": "no-cache"})

        return handler

    for route in files:
        router.add_api_route(route, serve(route), methods=["GET"])
    return router


def _script_json(value) -> bytes:
    """JSON that can sit inside a <script> element: `<`, `>` and `&` (only ever inside its strings) as \\u escapes,
    so no text in it can close the element."""
    text = json.dumps(value, ensure_ascii=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


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
    app.include_router(web_router(app.state.printpress.setting_list()))
    return app
