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
import sys
from collections.abc import Callable, Sequence

from printpress.cli_flags import add_sampler_arguments, parse_ids, sampler_overrides
from printpress.edit_command import register_edit
from printpress.errors import PrintpressError
from printpress.eval.bench import register as register_bench
from printpress.eval.command import register as register_eval
from printpress.live_view import LiveView
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
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        refuse_broken_text(argv)
        args = build_parser().parse_args(argv)
        level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        return int(args.func(args) or 0)
    except PrintpressError as exc:
        print(f"printpress: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("printpress: interrupted", file=sys.stderr)
        return 130


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
