"""`printpress train`: run a recipe or a config file, optionally resuming or under torchrun."""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import resources
from pathlib import Path

from printpress.errors import PrintpressError
from printpress.train.loop import RunConfig, Trainer, TrainingError
from printpress.train.overrides import apply_override


def recipe_names() -> list[str]:
    folder = resources.files("printpress") / "recipes"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def read_run_config(recipe: str | None, config: str | None, overrides: list[str]) -> RunConfig:
    if recipe and config:
        raise TrainingError("give --recipe or --config, not both")
    if recipe:
        if recipe not in recipe_names():
            raise TrainingError(f"unknown recipe {recipe!r}; available: {', '.join(recipe_names())}")
        text = (resources.files("printpress") / "recipes" / f"{recipe}.toml").read_text()
        source = f"recipe {recipe}"
    elif config:
        path = Path(config)
        if not path.is_file():
            raise TrainingError(f"{path}: no such config file")
        text, source = path.read_text(), str(path)
    else:
        raise TrainingError("give --recipe NAME or --config FILE")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TrainingError(f"{source}: not valid TOML ({exc})") from None
    for item in overrides:
        apply_override(data, item)
    return RunConfig.from_dict(data)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="a recipe shipped with printpress: " + ", ".join(recipe_names()))
    parser.add_argument("--config", help="a TOML run config (same layout as the recipes)")
    parser.add_argument("--out", required=True, help="run folder: data cache, checkpoint/, model/, metrics.jsonl")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a fresh run in an --out that already holds one (its checkpoint, model and metrics "
                             "are replaced)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set train.steps=200 (repeatable), or the checkpoint a "
                             "fine-tune starts from, --set init_from=PATH; with --resume it changes the saved run, "
                             "e.g. to extend or shorten it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.recipe or args.config:
            raise TrainingError("--resume continues the run saved in --out; drop --recipe/--config")
        run_config = RunConfig()  # the checkpoint carries the run's own config; --set still applies
    else:
        run_config = read_run_config(args.recipe, args.config, args.set)
    if args.resume and args.overwrite:
        raise TrainingError("--resume continues the run in --out and --overwrite starts it over: give one")
    trainer = Trainer(run_config, args.out, resume=args.resume, overrides=args.set if args.resume else (),
                      overwrite=args.overwrite, announce=lambda line: print(f"printpress train: {line}", file=sys.stderr))
    try:
        final = trainer.fit(progress=not args.no_progress)
    except BaseException:
        shutdown_distributed(wait=False)  # never wait on ranks that may be stuck elsewhere
        raise
    shutdown_distributed(wait=True)
    if trainer.env.main:
        print(f"{trainer.summary()}; model saved to {final}")
    return 0


def shutdown_distributed(wait: bool) -> None:
    """Leave the process group cleanly: gloo's threads abort the process if it is torn down at exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="printpress train", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except PrintpressError as exc:
        print(f"printpress train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
