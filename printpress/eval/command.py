"""Evaluate a model on a task (HumanEval, Sudoku, ...) and write a report card.

    printpress eval --task humaneval --model models/shakespeare-joint --limit 20 --results results/
    printpress eval --task humaneval --mode ar --samples 10 --temperature 0.8 --seed 0

The model is loaded once, the task's `evaluate` generates and scores with progress bars, the metrics are
printed, and a JSON result plus a markdown summary are written under --results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from printpress.cli_flags import add_sampler_arguments, load_options, sampler_flags_given, sampler_overrides
from printpress.errors import GenerationError

# Task options, passed to the task only when given (a task that does not know one says so).
TASK_FLAGS = (
    ("--samples", "samples", int, "completions per problem (pass@k for every k up to it; default 1)"),
    ("--timeout", "timeout_s", float, "seconds each test program may run (default 10)"),
    ("--memory-mb", "memory_mb", int, "address-space limit of each test program (default 1024)"),
    ("--workers", "workers", int, "test programs run at once (default 2)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from printpress.eval import TASKS

    p.add_argument("--task", "-t", required=True, help=f"task to run: {', '.join(sorted(TASKS))}")
    p.add_argument("--model", "-m", default=None, help="model folder or hub id (default: the shipped model)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0; sample j of an item uses seed+j)")
    p.add_argument("--results", default="results", metavar="DIR",
                   help="folder for the JSON result and markdown report (default: ./results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    task = p.add_argument_group("task options")
    for flag, dest, kind, text in TASK_FLAGS:
        task.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    task.add_argument("--unsafe-no-isolation", action="store_true",
                      help="run model-written code even where the sandbox's namespaces cannot be made (only the "
                           "audit-hook tripwire then guards the machine; see docs/eval.md)")
    add_sampler_arguments(p)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Mount `printpress eval` on the CLI."""
    p = subparsers.add_parser("eval", help="evaluate a model on a task and write a report card",
                              description=(__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from printpress.pipeline import Pipeline
    from printpress.eval import load_task
    from printpress.eval.report import write_report

    task = load_task(args.task)
    sampler = sampler_overrides(args)
    options = {dest: getattr(args, dest) for _, dest, _, _ in TASK_FLAGS if getattr(args, dest) is not None}
    if args.unsafe_no_isolation:
        options["unsafe_no_isolation"] = True
    if args.limit is not None and args.limit < 1:
        raise GenerationError(f"--limit must be a positive number of items, got {args.limit}")

    pipe = Pipeline.from_pretrained(args.model, **load_options(args))
    effective = dataclasses.asdict(pipe.settings(**sampler))  # validates the sampler flags before any work
    outcome = task.evaluate(pipe, limit=args.limit, seed=args.seed, settings={**sampler, **options},
                            progress=not args.no_progress)

    metrics = outcome["metrics"]
    payload = {
        "metrics": metrics,
        "settings": {"task": args.task, "limit": args.limit, "seed": args.seed, **options, **effective,
                     **load_options(args)},
        "model": _model_facts(pipe, args.model),
        "info": outcome.get("info", {}),
        "samples": outcome.get("samples", []),
    }
    payload["command"] = reproduce(args)
    json_path, md_path = write_report(args.results, args.task, payload)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        for key, value in metrics.items():
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    print(f"report: {json_path} and {md_path}", file=sys.stderr)
    return 0


def reproduce(args: argparse.Namespace) -> str:
    """The `printpress eval` command that repeats this run: every option that was given, spelled out."""
    words = ["printpress", "eval", "--task", args.task]
    if args.model is not None:
        words += ["--model", args.model]
    if args.limit is not None:
        words += ["--limit", str(args.limit)]
    words += ["--seed", str(args.seed), "--results", args.results]
    for flag, dest, _, _ in TASK_FLAGS:
        if getattr(args, dest) is not None:
            words += [flag, str(getattr(args, dest))]
    if args.unsafe_no_isolation:
        words.append("--unsafe-no-isolation")
    words += sampler_flags_given(args)
    return shlex.join(words)


def _model_facts(pipe, given: str | None) -> dict:
    from printpress.pipeline import default_model_path

    text = pipe.config.text
    return {
        "path": given if given is not None else str(default_model_path()),
        "parameters": sum(p.numel() for p in pipe.model.parameters()),
        "canvas_length": pipe.canvas_length,
        "vocab_size": text.vocab_size,
        "layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
    }
