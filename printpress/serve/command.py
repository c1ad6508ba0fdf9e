"""`printpress serve`: an OpenAI-compatible HTTP API and the web page, on uvicorn.

Binds to 127.0.0.1 by default. With --api-key KEY (or the PRINTPRESS_API_KEY environment variable, which
keeps the key out of the process list) every /v1 route needs `Authorization: Bearer KEY`. The key is never
printed or logged. Without a key the server answers only requests addressed (Host header) to localhost,
127.0.0.1, [::1], the --host it binds, or a name given with --allowed-hosts: a guard against DNS rebinding.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import socket

from printpress.cli_flags import add_runtime_arguments, load_options, warm_up
from printpress.errors import PrintpressError

API_KEY_ENV = "PRINTPRESS_API_KEY"
logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="model folder or hub id (default: the shipped model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set {API_KEY_ENV})")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    p.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="without an API key, host names (comma separated) requests may be addressed to besides "
                        "localhost, 127.0.0.1, [::1] and --host; '*' allows any")
    limits = p.add_argument_group("limits (beyond them: 429 or 400 with a JSON error)")
    limits.add_argument("--max-rows", type=int, default=16, help="requests generated at once (default 16)")
    limits.add_argument("--max-queued", type=int, default=64, help="requests waiting for a row (default 64)")
    limits.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt (default: the model's position limit minus one canvas)")
    limits.add_argument("--max-new-tokens", type=int, default=1024, help="most tokens one request may ask for")
    limits.add_argument("--max-steps", type=int, default=1024, help="most denoising steps per canvas (default 1024)")
    limits.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take in all (default 300)")
    limits.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    runtime = p.add_argument_group("runtime")
    add_runtime_arguments(runtime)
    # No "trace": at that level uvicorn logs whole ASGI scopes, headers (and so the API key) included.
    runtime.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                         help="uvicorn's log level (default info)")


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise PrintpressError(f"{name} must be positive, got {value}")


def run(args: argparse.Namespace) -> int:
    for name in ("max_rows", "max_new_tokens", "max_steps", "timeout", "max_body_bytes", "max_prompt_tokens"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.max_queued < 0:
        raise PrintpressError(f"--max-queued must be >= 0, got {args.max_queued}")
    if not 0 <= args.port < 65536:
        raise PrintpressError(f"--port must be in 0..65535, got {args.port}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None

    import uvicorn

    import printpress
    from printpress.pipeline import check_device, model_folder
    from printpress.serve.app import create_app
    from printpress.serve.chat import chat_formatter
    from printpress.serve.edits import router as edits_router
    from printpress.serve.scheduler import Limits, Scheduler

    options = load_options(args)  # a bad --dtype or --quantize is one line before anything is loaded
    check_device(args.device)
    sock = bind_socket(args.host, args.port)  # a port that is taken is one line, before the model loads
    try:
        pipeline = printpress.load(args.model, **options)
        warm_up(pipeline, args)  # with --compile; connections wait in the socket's backlog meanwhile
        folder = model_folder(args.model)
        config = pipeline.config.text
        max_prompt = args.max_prompt_tokens or max(1, config.max_position_embeddings - pipeline.canvas_length)
        limits = Limits(max_rows=args.max_rows, max_queued=args.max_queued, max_prompt_tokens=max_prompt,
                        max_new_tokens=args.max_new_tokens, request_timeout_s=args.timeout)
        scheduler = Scheduler(pipeline, limits)
        name = args.served_model_name or (folder.name if folder else str(args.model))
        app = create_app(pipeline, scheduler, model_name=name, max_new_tokens=args.max_new_tokens,
                         max_prompt_tokens=max_prompt, max_steps=args.max_steps, api_key=api_key,
                         chat=chat_formatter(folder), max_body_bytes=args.max_body_bytes,
                         extra_routers=[edits_router()], allowed_hosts=_allowed_hosts(args))
        if not _is_loopback(args.host) and api_key is None:
            logger.warning("serving on %s without an API key: anyone who can reach it can use it, addressing it by "
                           "a name given with --allowed-hosts", args.host)
        # The socket is bound and listening: connections wait in its backlog until uvicorn accepts them.
        port = sock.getsockname()[1]
        print(f"printpress: serving {name} on http://{_url_host(args.host)}:{port} "
              f"({'API key required' if api_key else 'no API key'}); the page is at /, the API under /v1",
              flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one), or one PrintpressError saying why not."""
    where = f"{_url_host(host)}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PrintpressError(f"cannot serve on {where}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: no wait after a restart
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = ("; another process is using it: stop it, or pick another --port (0 picks a free one)"
                if exc.errno == errno.EADDRINUSE else "")
        raise PrintpressError(f"cannot serve on {where}: {exc.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _allowed_hosts(args: argparse.Namespace) -> list[str]:
    """The names a key-less server answers besides loopback's: the address it binds and --allowed-hosts."""
    return [args.host, *(name.strip() for name in args.allowed_hosts.split(",") if name.strip())]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def register(subparsers: argparse._SubParsersAction) -> None:
    """Mount `serve` in the printpress CLI (printpress/cli.py lists this in COMMANDS)."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API and the web page",
                              description=(__doc__ or "").strip())
    add_arguments(p)
    p.set_defaults(func=run)
