"""The `printpress` command line (also `python -m printpress`).

One argparse parser with a subcommand per task. A subcommand is a function that adds its
subparser and sets `func` (a callable taking the parsed args and returning an exit code); to add
one (`train`, `serve`), write `register_<name>(subparsers)` and list it in `COMMANDS`.

Errors a user can cause (`PrintpressError`) end the program with one line on stderr and exit
status 2; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from printpress.cli_flags import add_sampler_arguments, parse_ids, sampler_overrides
from printpress.edit_command import register_edit
from printpress.errors import PrintpressError
from printpress.eval.bench import register as register_bench
from printpress.eval.command import register as register_eval
from printpress.serve.command import register as register_serve

Register = Callable[[argparse._SubParsersAction], None]


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def register_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate a continuation of one or more prompts (diffusion by default, or --mode ar).",
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several prompts run as one batch)")
    p.add_argument("--model", "-m", default=None, help="model folder or hub id (default: the shipped model)")
    p.add_argument("--ids", action="store_true", help="prompts are token ids, e.g. '2,651,1234' or '2 651 1234'")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one)")
    p.add_argument("--json", action="store_true", help="print ids, text and statistics as JSON")
    p.add_argument("--show-steps", action="store_true", help="draw the canvas on stderr as it denoises")
    p.add_argument("--stats", action="store_true", help="print one line of statistics per prompt on stderr")
    add_sampler_arguments(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import printpress

    prompts = [parse_ids(p) for p in args.prompts] if args.ids else list(args.prompts)
    settings = sampler_overrides(args)
    pipe = printpress.load(args.model, dtype=args.dtype, device=args.device)
    view = LiveView(pipe, sys.stderr, len(prompts)) if args.show_steps else None
    try:
        results = pipe.generate(prompts, seed=args.seed, on_event=view.update if view else None, **settings)
    finally:
        if view is not None:
            view.close()
    if args.json:
        payload = [_result_json(r) for r in results]
        print(json.dumps(payload[0] if len(payload) == 1 else payload, indent=2, ensure_ascii=False))
    else:
        for result in results:
            print(result.text if result.text is not None else " ".join(map(str, result.completion_ids)))
    if args.stats:
        for result in results:
            print(_stats_line(result.stats), file=sys.stderr)
    return 0


def _stats_line(stats) -> str:
    rate = stats.new_tokens / stats.wall_time_s if stats.wall_time_s else float("nan")
    line = (f"[{stats.new_tokens} tokens in {stats.wall_time_s:.2f} s = {rate:.0f} tokens/s; "
            f"{stats.tokens_per_forward:.2f} tokens per forward over {stats.forward_passes} forwards")
    if stats.denoising_steps:
        line += f", {stats.canvases} canvases"
    return line + "]"


def _result_json(result) -> dict:
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "completion_ids": result.completion_ids,
        "prompt_ids": result.prompt_ids,
        "mode": result.mode,
        "seed": result.seed,
        "stats": dataclasses.asdict(result.stats),
    }


# --------------------------------------------------------------------------------------------
# --show-steps: the canvas drawn live
# --------------------------------------------------------------------------------------------

BOLD, DIM, GREEN, RESET = "\x1b[1m", "\x1b[2m", "\x1b[32m", "\x1b[0m"


class LiveView:
    """Draws each request's committed text followed by its current canvas.

    On a terminal the lines are redrawn in place (accepted positions bright, re-noised ones dim);
    elsewhere every step is written as one plain line, so logs stay readable.
    """

    def __init__(self, pipe, stream: TextIO, requests: int, min_interval_s: float = 0.03) -> None:
        self.pipe = pipe
        self.stream = stream
        self.tty = stream.isatty() and os.environ.get("TERM") != "dumb"
        self.lines = [""] * requests
        self.committed = [""] * requests
        self.drawn = 0
        self.min_interval_s = min_interval_s
        self.last_draw = 0.0

    def update(self, event) -> None:
        from printpress.engine import CommitEvent, StepEvent

        if isinstance(event, CommitEvent):
            self.committed[event.request] += event.text if self.pipe.tokenizer else _ids_text(event.token_ids)
            self.lines[event.request] = self._plain_prefix(event.request)
            self._draw(force=True)
        elif isinstance(event, StepEvent):
            if self.tty:
                self.lines[event.request] = self._live_line(event)
                self._draw(force=event.stopped)
            else:
                accepted = sum(event.accepted)
                self.stream.write(
                    f"[{event.request}] canvas {event.canvas} step {event.step}/{event.max_steps} "
                    f"accepted {accepted}/{len(event.accepted)}: {self._token_text(event.argmax)}\n"
                )

    def _plain_prefix(self, request: int) -> str:
        return _one_line(self.committed[request])

    def _live_line(self, event) -> str:
        pieces = []
        for token, accepted in zip(event.tokens, event.accepted):
            text = self._token_text([token])
            pieces.append(f"{BOLD}{GREEN}{text}{RESET}" if accepted else f"{DIM}{text}{RESET}")
        header = f"{DIM}[{event.canvas}:{event.step}/{event.max_steps}]{RESET} "
        return header + self._plain_prefix(event.request) + "".join(pieces)

    def _token_text(self, ids: list[int]) -> str:
        if self.pipe.tokenizer is None:
            return _ids_text(ids)
        return _one_line(self.pipe.tokenizer.decode(ids, skip_special_tokens=False))

    def _draw(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self.last_draw < self.min_interval_s:
            return
        self.last_draw = now
        width = shutil.get_terminal_size((100, 20)).columns
        out = [f"\x1b[{self.drawn}F" if self.drawn else "", "\x1b[J"]
        for line in self.lines:
            out.append(_fit(line, width - 1) + "\n")
        self.stream.write("".join(out))
        self.stream.flush()
        self.drawn = len(self.lines)

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")
        self.stream.flush()


def _ids_text(ids: list[int]) -> str:
    return "".join(f"{t} " for t in ids)


def _one_line(text: str) -> str:
    return text.replace("\r", "").replace("\n", "⏎")


def _fit(line: str, width: int) -> str:
    """The tail of a line that fits `width` visible columns (escape sequences take none)."""
    visible, out, i = 0, [], len(line)
    while i > 0 and visible < width:
        j = i - 1
        if line[j] == "m":  # maybe the end of an escape sequence
            start = line.rfind("\x1b[", 0, j)
            if start != -1 and all(c.isdigit() or c == ";" for c in line[start + 2 : j]):
                out.append(line[start:i])
                i = start
                continue
        out.append(line[j])
        visible += 1
        i = j
    return "".join(reversed(out)) + RESET


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def register_train(subparsers: argparse._SubParsersAction) -> None:
    # The training command owns its arguments (printpress/train/command.py); the CLI only mounts it.
    from printpress.train import command

    p = subparsers.add_parser("train", help="train a model from a recipe or a config file",
                              description=(command.__doc__ or "").strip())
    command.add_arguments(p)
    p.set_defaults(func=command.run)


def register_distill(subparsers: argparse._SubParsersAction) -> None:
    from printpress.train import distill

    distill.register(subparsers)


COMMANDS: list[Register] = [register_generate, register_train, register_distill, register_edit, register_eval,
                            register_serve, register_bench]


def build_parser() -> argparse.ArgumentParser:
    from printpress import __version__

    parser = argparse.ArgumentParser(prog="printpress", description="An open engine for text-diffusion LMs.")
    parser.add_argument("--version", action="version", version=f"printpress {__version__}")
    parser.add_argument("--verbose", "-v", action="count", default=0, help="log progress (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except PrintpressError as exc:
        print(f"printpress: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("printpress: interrupted", file=sys.stderr)
        return 130
