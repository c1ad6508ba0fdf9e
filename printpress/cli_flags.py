"""Command-line flags shared by every command that generates (`generate`, `chat`, `edit`, `eval`): one spelling, one
parser, one way back to `Pipeline.generate` keywords. The sampler flags are derived from `printpress.settings.SETTINGS`
(`--<wire name>`, its help, its type), so a new setting is a new flag with no edit here.

Imports nothing heavy: the CLI builds its parser (and answers --help) without importing torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from printpress.errors import GenerationError
from printpress.runtime_options import (
    CANVAS_HELP,
    COMPILE,
    COMPILE_HELP,
    COMPILE_WEIGHTS,
    COMPILE_WEIGHTS_HELP,
    DTYPE_HELP,
    QUANTIZE,
    QUANTIZE_HELP,
    check_canvas_length,
    check_compile,
    check_compile_weights,
    check_dtype,
    check_quantize,
)
from printpress.settings import SETTINGS, Setting, check_setting, refuse_canvas_steps, token_ids

STDIN = "-"  # a prompt (or text) argument that says "read it from stdin"


def add_sampler_arguments(p: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                          settings: Iterable[Setting] = SETTINGS) -> None:
    """A flag per setting of `settings` (all but those named in `skip`), and the runtime flags (--dtype, --device,
    --quantize, --compile, --canvas-length: `load_options`)."""
    sampler = p.add_argument_group("sampler settings (default: the checkpoint's generation_config.json)")
    for s in settings:
        if s.name in skip:
            continue
        if s.kind is bool:
            # --x / --no-x: a checkpoint may make a flag its default (sliding), so it can be turned off too
            sampler.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=None,
                                 help=s.help)
        else:  # token ids are read as text and parsed with the other values (`sampler_overrides`)
            sampler.add_argument(s.flag, dest=s.name, type=str if s.kind is tuple else s.kind, default=None,
                                 help=s.help, metavar=s.wire.upper())
    add_runtime_arguments(p.add_argument_group("runtime"))


def add_runtime_arguments(runtime) -> None:
    """--dtype, --device, --quantize, --compile and --canvas-length (read back with `load_options`), on a parser or an
    argument group."""
    runtime.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    runtime.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    runtime.add_argument("--quantize", default=None, metavar="|".join(QUANTIZE), help=QUANTIZE_HELP)
    runtime.add_argument("--compile", default=None, metavar="|".join(COMPILE), help=COMPILE_HELP)
    runtime.add_argument("--compile-weights", default="float32", metavar="|".join(COMPILE_WEIGHTS),
                         help=COMPILE_WEIGHTS_HELP)
    runtime.add_argument("--canvas-length", type=int, default=None, metavar="TOKENS", help=CANVAS_HELP)


def load_options(args: argparse.Namespace) -> dict:
    """The runtime flags as `printpress.load` keywords, each checked (`printpress.runtime_options`) so that a bad
    --dtype or --quantize ends in one line before a model is loaded (the device is checked by `load`, first)."""
    check_dtype(args.dtype)
    check_quantize(args.quantize)
    check_compile(args.compile)
    check_compile_weights(args.compile_weights, args.compile)
    check_canvas_length(args.canvas_length)
    return {"dtype": args.dtype, "device": args.device, "quantize": args.quantize, "compile": args.compile,
            "compile_weights": args.compile_weights, "canvas_length": args.canvas_length}


def warm_up(pipe, args: argparse.Namespace) -> None:
    """Before a server's or a chat's first request: on a CPU, load printpress's exact kernels (draws, softmax and
    entropy, layers: each built on a machine's first use in seconds, then cached: `sampling.draw_kernels`,
    `sampling.softmax_kernels`, `model.native_layers`) and make the layers' choice of reading weights ahead
    (`model.settle_warm_weights`, ~60 ms); with --compile, compile what the first requests would
    (`Pipeline.warm_up`), saying so on stderr. The first answers then come at full speed."""
    from printpress.model import native_layers, settle_warm_weights
    from printpress.request import model_device
    from printpress.sampling import draw_kernels, softmax_kernels

    if model_device(pipe.model).type == "cpu":
        draw_kernels()
        softmax_kernels()
        if native_layers():
            settle_warm_weights(pipe.model)
    if args.compile is None:
        return
    import time

    print(f"printpress: compiling the passes (--compile {args.compile}) before the first request; "
          "a minute or two the first time on this machine, less once they are on disk", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    pipe.warm_up()
    print(f"printpress: compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def sampler_overrides(args: argparse.Namespace) -> dict:
    """The sampler settings given on the command line, as `Pipeline.generate` keywords.

    Each value is checked on its own here (`settings.check_setting`: an unknown mode, NaN, inf, 1e-38 or 10^11
    steps end in one line before a model is loaded), and --steps with --mode speculative is refused
    (`settings.refuse_canvas_steps`); the checks between settings run when the checkpoint's defaults are known.
    """
    settings = {s.name: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name, None) is not None}
    if "eos_token_ids" in settings:
        settings["eos_token_ids"] = list(token_ids(settings["eos_token_ids"]))
    for name, value in settings.items():
        check_setting(name, value)
    refuse_canvas_steps(settings.get("mode"), settings.get("max_denoising_steps"))
    return settings


def sampler_flags_given(args: argparse.Namespace) -> list[str]:
    """The sampler and runtime flags of `args` spelled out again (for a reproducing command line)."""
    words: list[str] = []
    for s in SETTINGS:
        value = getattr(args, s.name, None)
        if value is not None:
            if s.kind is bool:
                words += [s.flag if value else "--no-" + s.flag[2:]]
            else:
                words += [s.flag, str(value)]
    if args.dtype != "float32":
        words += ["--dtype", args.dtype]
    if args.device != "cpu":
        words += ["--device", args.device]
    if getattr(args, "compile_weights", "float32") != "float32":
        words += ["--compile-weights", args.compile_weights]
    for flag in ("quantize", "compile", "canvas_length"):
        if getattr(args, flag) is not None:
            words += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return words


def parse_ids(text: str, allow_empty: bool = False) -> list[int]:
    ids = list(token_ids(text))
    if not ids and not allow_empty:
        raise GenerationError("the prompt is empty; give at least one token id")
    return ids


def read_prompts(prompts: list[str]) -> list[str]:
    """The prompt arguments with `-` replaced by stdin's text (all of it, as is; one `-` at most)."""
    if prompts.count(STDIN) > 1:
        raise GenerationError("'-' (read the prompt from stdin) may be given once")
    if STDIN not in prompts:
        return prompts
    text = sys.stdin.read()
    if not text:
        raise GenerationError("'-' reads the prompt from stdin, and stdin was empty")
    return [text if p == STDIN else p for p in prompts]
