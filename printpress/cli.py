"""The `printpress` command line (also `python -m printpress`).

One argparse parser with a subcommand per task. A subcommand is a function that adds its
subparser and sets `func` (a callable taking the parsed args and returning an exit code); to add
one (`train`, `serve`), write `register_<name>(subparsers)` and list it in `COMMANDS` (or in `LAZY_COMMANDS`
when its module imports torch at module level: building the parser, and so `--help`, never imports torch).

Errors a user can cause (`PrintpressError`) end the program with one line on stderr and exit
status 2; a reader that closes the output early (`| head`) ends it quietly with status 141, as SIGPIPE would;
everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from printpress.chat_command import register_chat
from printpress.cli_flags import add_sampler_arguments, load_options, parse_ids, read_prompts, sampler_overrides
from printpress.edit_command import register_edit
from printpress.errors import PrintpressError
from printpress.events import CommitEvent, DoneEvent, SpeculativeStats
from printpress.eval.bench import register as register_bench
from printpress.eval.command import register as register_eval
from printpress.models_command import register_list, register_pull
from printpress.serve.command import register as register_serve

Register = Callable[[argparse._SubParsersAction], None]


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def register_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate a continuation of one or more prompts (diffusion by default, or --mode ar). The text "
                    "is written to stdout as it is committed (canvas by canvas, or token by token in AR).",
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT",
                   help="prompt text, or - to read it from stdin (several prompts run as one batch)")
    p.add_argument("--model", "-m", default=None, help="model folder or hub id (default: the shipped model)")
    p.add_argument("--ids", action="store_true", help="prompts are token ids, e.g. '2,651,1234' or '2 651 1234'")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one)")
    p.add_argument("--json", action="store_true", help="print ids, text and statistics as JSON (at the end)")
    p.add_argument("--show-steps", action="store_true", help="draw the canvas on stderr as it denoises")
    p.add_argument("--stats", action="store_true", help="print one line of statistics per prompt on stderr")
    add_sampler_arguments(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import printpress
    from printpress.live_view import LiveView

    prompts = read_prompts(args.prompts)
    prompts = [parse_ids(p) for p in prompts] if args.ids else prompts
    settings = sampler_overrides(args)
    pipe = printpress.load(args.model, **load_options(args))
    view = LiveView(pipe, sys.stderr, len(prompts)) if args.show_steps else None
    # The live view owns the terminal while it draws, so the text is then printed when each prompt is done.
    printer = None if args.json else TextPrinter(sys.stdout, len(prompts), stream=view is None,
                                                 ids=pipe.tokenizer is None)
    listeners = [part.update for part in (printer, view) if part is not None]
    try:
        results = pipe.generate(prompts, seed=args.seed, on_event=_fan_out(listeners), **settings)
    finally:
        if view is not None:
            view.close()
    if args.json:
        payload = [_result_json(r) for r in results]
        print(json.dumps(payload[0] if len(payload) == 1 else payload, indent=2, ensure_ascii=False))
    sys.stdout.flush()  # the text is out before the statistics, whichever way the two streams are buffered
    if not args.json:
        _say_when_nothing_was_written(results)
    if args.stats:
        for result in results:
            print(_stats_line(result, compiled=args.compile is not None), file=sys.stderr)
    return 0


def _say_when_nothing_was_written(results: list) -> None:
    """A sampled text can end at once (the model's end-of-text first) or hold only blank lines: say so on stderr, with
    the seed that does it, rather than leave an empty terminal to look like a failure."""
    for number, result in enumerate(results, 1):
        if result.text is not None and not result.text.strip():
            which = f"prompt {number}: " if len(results) > 1 else ""
            print(f"printpress: {which}the model wrote nothing this time (--seed {result.seed} does it again)",
                  file=sys.stderr)


def _fan_out(listeners: list[Callable]) -> Callable | None:
    if not listeners:
        return None
    return listeners[0] if len(listeners) == 1 else lambda event: [listen(event) for listen in listeners]


class TextPrinter:
    """Writes each prompt's text to `out` as it is committed, in prompt order.

    The first unfinished prompt streams live; a later prompt's text is held until the prompts before it are
    finished, then written at once, and it goes on live. With several prompts each output starts with a header
    line, `==> prompt N <==`, after a blank line (as `head` and `tail` separate files). Without `stream` (or for
    a model without a tokenizer, whose output is ids) the text is written when its prompt is done.
    """

    def __init__(self, out: TextIO, prompts: int, stream: bool = True, ids: bool = False) -> None:
        self.out, self.prompts, self.stream, self.ids = out, prompts, stream, ids
        self.held = [""] * prompts
        self.done = [False] * prompts
        self.current = 0
        self._header()

    def update(self, event) -> None:
        if isinstance(event, CommitEvent) and self.stream and not self.ids:
            self.add(event.request, event.text)
        elif isinstance(event, DoneEvent):
            result = event.result
            if not self.stream or self.ids:
                self.add(event.request, result.text if not self.ids else " ".join(map(str, result.completion_ids)))
            self.finish(event.request)

    def add(self, prompt: int, text: str) -> None:
        if prompt == self.current:
            self._write(text)
        else:
            self.held[prompt] += text

    def finish(self, prompt: int) -> None:
        self.done[prompt] = True
        while self.current < self.prompts and self.done[self.current]:
            self._write("\n")
            self.current += 1
            if self.current < self.prompts:
                self._header()
                self._write(self.held[self.current])
                self.held[self.current] = ""

    def _header(self) -> None:
        if self.prompts > 1:
            blank = "\n" if self.current else ""
            self._write(f"{blank}==> prompt {self.current + 1} <==\n")

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def _stats_line(result, compiled: bool = False) -> str:
    """One line: the tokens printed, and what the engine generated (whole canvases in diffusion) and how fast. With
    `compiled` (--compile), it says that the time includes compiling: a process's first requests compile the graphs
    (seconds to a minute), so one `generate` does not show the compiled passes' speed."""
    stats = result.stats
    rate = stats.new_tokens / stats.wall_time_s if stats.wall_time_s else float("nan")
    printed = len(result.completion_ids)
    made = f" of {stats.new_tokens} generated" if stats.new_tokens != printed else ""
    line = (f"[{printed} tokens{made} in {stats.wall_time_s:.2f} s = {rate:.0f} tokens/s; "
            f"{stats.tokens_per_forward:.2f} tokens per forward over {stats.forward_passes} forwards")
    if isinstance(stats, SpeculativeStats):  # its rounds, not canvases
        line += (f", {stats.verifications} verifications of {stats.accepted_per_verification:.2f} tokens "
                 f"({stats.accepted_drafts} of {stats.drafted_tokens} {stats.draft_source} drafts kept)")
    elif stats.denoising_steps:
        line += f", {stats.canvases} canvases"
    if compiled:
        line += "; the time includes compiling the passes (--compile), once per process"
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


def register_draft_table(subparsers: argparse._SubParsersAction) -> None:
    from printpress.train import distill

    distill.register_draft_table(subparsers)


COMMANDS: list[Register] = [register_generate, register_chat, register_edit, register_eval, register_serve,
                            register_bench, register_list, register_pull]
# Subcommands whose modules import torch when imported: (name, one-line help, register). The parser lists them with
# their help, and registers one for real only when the command line names it (or when it is built for every one).
LAZY_COMMANDS: list[tuple[str, str, Register]] = [
    ("train", "train a model from a recipe or a config file", register_train),
    ("distill", "make distillation data: a teacher continues training prefixes", register_distill),
    ("draft-table", "write a model's draft table for speculative decoding", register_draft_table),
]


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given the command line, it registers a lazy subcommand only if that is the one named."""
    from printpress import __version__

    parser = argparse.ArgumentParser(prog="printpress", description="An open engine for text-diffusion LMs.")
    parser.add_argument("--version", action="version", version=f"printpress {__version__}")
    parser.add_argument("--verbose", "-v", action="count", default=0, help="log progress (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subparsers)
    named = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name, text, register in LAZY_COMMANDS:
        if named is None or named == name:
            register(subparsers)
        else:
            subparsers.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        refuse_broken_text(argv)
        args = build_parser(argv).parse_args(argv)
        level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        return int(args.func(args) or 0)
    except PrintpressError as exc:
        print(f"printpress: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("printpress: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whoever read the output has gone (`printpress generate ... | head -3`): stop quietly, with the status of a
        # program ended by SIGPIPE, and point stdout at /dev/null so that Python's flush at exit finds no pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE (13)


def refuse_broken_text(argv: Sequence[str]) -> None:
    """Raise PrintpressError for an argument that is not valid UTF-8 (Python hands its bytes on as lone surrogates,
    which the tokenizer, a file name check or printing would later fail on with a traceback)."""
    for position, arg in enumerate(argv, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as exc:
            shown = ascii(arg[max(0, exc.start - 20): exc.start + 20])
            raise PrintpressError(f"argument {position} is not valid UTF-8 text (at character {exc.start}: "
                                  f"{shown}); printpress reads its arguments as UTF-8") from None
