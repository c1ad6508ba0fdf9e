"""`printpress edit`: fill in the middle between two texts, or rewrite a character span of a text in place.

    printpress edit --prefix $'ROMEO.\\nBut soft, what light' --suffix $' breaks?\\n' [--length 6]
    printpress edit --text $'ROMEO.\\nBut soft, what light through yonder window breaks?' --span 22:49

Prints the whole edited text (prefix + new middle + suffix) on stdout; --json adds the span, ids, the
candidates of a length search and statistics. `--show-steps` draws the span denoising on stderr, the
suffix tokens clamped in the canvas behind it. Without --length, infilling searches a few lengths and
rewriting keeps the span's token count (printpress/editing.py has the design).
"""

from __future__ import annotations

import argparse
import json
import sys

from printpress.cli_flags import add_sampler_arguments, load_options, sampler_overrides
from printpress.errors import GenerationError
from printpress.settings import EDITING


def register_edit(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("edit", help="infill between a prefix and a suffix, or rewrite a span of a text",
                              description=(__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="model folder or hub id (default: the shipped model)")
    given = p.add_argument_group("what to edit (either --prefix/--suffix or --text/--span)")
    given.add_argument("--prefix", default=None, help="text before the middle")
    given.add_argument("--suffix", default=None, help="text after the middle")
    given.add_argument("--text", default=None, help="a text to rewrite a span of")
    given.add_argument("--span", default=None, metavar="START:END", help="characters [START, END) of --text to rewrite")
    p.add_argument("--length", default=None,
                   help="tokens of the new middle, or comma separated lengths to search "
                        "(default: infill searches a few, rewrite keeps the span's count)")
    p.add_argument("--suffix-window", type=int, default=None,
                   help="suffix tokens clamped into the canvas (default: what fills the canvas)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--show-steps", action="store_true", help="draw the span on stderr as it denoises")
    p.add_argument("--stats", action="store_true", help="print one line of statistics on stderr")
    # The settings of the diffusion sampler: the length decides the new tokens (--temperature scales the schedule).
    add_sampler_arguments(p, settings=EDITING)


def run(args: argparse.Namespace) -> int:
    import printpress
    from printpress import editing
    from printpress.live_view import LiveView

    infilling = args.prefix is not None or args.suffix is not None
    if infilling and (args.text is not None or args.span is not None):
        raise GenerationError("give either --prefix/--suffix (infill) or --text with --span (rewrite), not both")
    if not infilling and (args.text is None or args.span is None):
        raise GenerationError("give --prefix and/or --suffix to infill, or --text with --span START:END to rewrite")
    length = parse_length(args.length)
    span = None if infilling else parse_span(args.span)
    if span is not None:
        editing.check_span(args.text, *span)  # before the model loads: the text is on the command line
    settings = sampler_overrides(args)
    pipe = printpress.load(args.model, **load_options(args))
    prefix = (args.prefix or "") if infilling else args.text[: max(span[0], 0)]
    view = LiveView(pipe, sys.stderr, 1) if args.show_steps else None
    if view is not None:
        view.committed[0] = prefix  # the canvas is drawn after the untouched text before the span
    common = {"length": length, "seed": args.seed, "suffix_window": args.suffix_window,
              "on_event": view.update if view else None, **settings}
    try:
        if infilling:
            result = editing.infill(pipe, args.prefix or "", args.suffix or "", **common)
        else:
            result = editing.rewrite(pipe, args.text, span[0], span[1], **common)
    finally:
        if view is not None:
            view.close()
    if args.json:
        print(json.dumps(editing.result_json(result), indent=2, ensure_ascii=False))
    else:
        print(result.text)
    if args.stats:
        s = result.stats
        print(f"[{s.length} tokens in {s.wall_time_s:.2f} s; {s.forward_passes} decoder passes over {s.candidates} "
              f"candidate length(s); {s.clamped_tokens} of {s.suffix_tokens} suffix tokens clamped in the canvas]",
              file=sys.stderr)
    return 0


def parse_span(text: str) -> tuple[int, int]:
    """'START:END' -> (start, end); range checks against the text are the library's (editing.check_span)."""
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        return int(parts[0]), int(parts[1])
    except ValueError:
        raise GenerationError(f"--span must be START:END with integer character offsets, got {text!r}") from None


def parse_length(text: str | None) -> int | list[int] | None:
    if text is None:
        return None
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        raise GenerationError(f"--length must be an integer or comma separated integers, got {text!r}") from None
    return values[0] if len(values) == 1 else values
