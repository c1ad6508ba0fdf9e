"""`printpress list` and `printpress pull`: the models at hand, and fetching one from the Hugging Face hub.

    printpress list                          # the shipped models, PRINTPRESS_DEFAULT_MODEL's, the hub cache's
    printpress list --json                   # the same as one JSON document, for scripts
    printpress pull OWNER/NAME               # download a DiffusionGemma into the hub cache, checked
    printpress pull OWNER/NAME --revision R  # a branch, tag or commit

The names are Ollama's (`ollama list`, alias `ls`; `ollama pull`), verbs like the other commands. `list` reads
config files only (no torch, no weights). `pull` fetches config.json first and refuses a model printpress cannot load
before any weights are downloaded, then the files printpress reads (config.json, generation_config.json, the
safetensors weights and index, the tokenizer); an offline machine, an unknown id or a gated model is one line on
stderr and exit status 2. After a pull, `printpress generate -m OWNER/NAME` loads it from the cache, offline too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from printpress.errors import CheckpointError


def register_list(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("list", aliases=["ls"], help="list the models printpress can load without a download",
                              description=(__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the list as JSON (every field, exact sizes)")
    p.set_defaults(func=run_list)


def register_pull(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pull", help="download a DiffusionGemma model from the Hugging Face hub",
                              description=(__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hub_id", metavar="HUB_ID", help="the model's hub id, owner/name")
    p.add_argument("--revision", default=None, help="a branch, tag or commit hash (default: the main branch)")
    p.set_defaults(func=run_pull)


# --------------------------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------------------------

COLUMNS = ("NAME", "SOURCE", "PARAMETERS", "OBJECTIVE", "SIZE", "DEFAULT DECODING", "--model")


def run_list(args: argparse.Namespace) -> int:
    from printpress import catalog, hub

    entries = catalog.list_models()
    if args.json:
        print(json.dumps({"models": [e.to_dict() for e in entries], "hub_cache": str(hub.cache_dir())}, indent=2))
        return 0
    sys.stdout.write(format_table(entries))
    print(f"\n* the default model (no --model). Shipped models load by name, cached hub models by id "
          f"(`printpress generate --model NAME ...`); the hub cache: {catalog.display_path(hub.cache_dir())}")
    return 0


def format_table(entries: list) -> str:
    """The entries as aligned columns under a header; a model that would not load gets a line saying why."""
    from printpress.catalog import decoding_summary

    rows = [COLUMNS]
    notes: dict[int, str] = {}
    for entry in entries:
        source = entry.source
        if entry.revision:
            source += f" ({', '.join(entry.refs) + ' ' if entry.refs else ''}{entry.revision[:8]})"
        rows.append((
            entry.name + (" *" if entry.default else ""),
            source,
            "-" if entry.parameters is None else f"{entry.parameters:,}",
            entry.objective or "-",
            human_size(entry.size_bytes) if entry.path else "-",
            decoding_summary(entry.decoding),
            entry.model,
        ))
        if entry.problem:
            notes[len(rows) - 1] = f"    ! will not load: {entry.problem}"
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if index in notes:
            lines.append(notes[index])
    if len(rows) == 1:
        lines.append("(no models: none shipped in models/ and no DiffusionGemma in the hub cache)")
    return "\n".join(lines) + "\n"


def human_size(size: int) -> str:
    """Bytes in decimal units, as the hub and Ollama show them: 11.4 MB, 50.5 GB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# pull
# --------------------------------------------------------------------------------------------

def run_pull(args: argparse.Namespace) -> int:
    from printpress import catalog, hub
    from printpress.config import ModelConfig
    from printpress.errors import ConfigError

    hub_id, revision = args.hub_id, args.revision
    if Path(hub_id).expanduser().is_dir():  # as --model reads it: a folder, whatever its name looks like
        raise CheckpointError(f"{hub_id}: a local model folder needs no pull (printpress generate -m {hub_id} ...)")
    if catalog.shipped_folder(hub_id) is not None:
        raise CheckpointError(f"{hub_id}: a shipped model needs no pull (printpress generate -m {hub_id} ...)")
    if not hub.is_hub_id(hub_id):
        raise CheckpointError(f"{hub_id}: not a hub id of the form owner/name")
    # The config alone first: a model printpress cannot load is refused before gigabytes of weights are fetched.
    config_folder = hub.download(hub_id, revision, allow_patterns=hub.CONFIG_FILES)
    try:
        ModelConfig.from_file(config_folder / "config.json")
    except ConfigError as exc:  # another architecture, a DiffusionGemma printpress does not support, no config
        raise CheckpointError(f"{hub_id}: not a DiffusionGemma printpress can load: {exc} "
                              "(only its config.json was downloaded)") from None
    folder = hub.download(hub_id, revision)
    tokenizer = check_download(folder)
    entry = catalog.describe(folder, hub_id, "hub cache", hub_id, catalog.folder_size(folder), hub_id=hub_id,
                             revision=folder.name)
    by_id = revision in (None, "main")
    model = hub_id if by_id else catalog.display_path(folder)
    print(f"pulled {hub_id} (revision {revision or 'main'}, commit {folder.name[:12]}): {entry.parameters:,} "
          f"parameters, canvas {entry.canvas_length}, {human_size(entry.size_bytes)}")
    print(f"  in {catalog.display_path(folder)}")
    print(f"  default decoding: {catalog.decoding_summary(entry.decoding)}")
    if tokenizer is None:
        print("  no tokenizer.json: prompts are token ids (--ids)")
    example = "--ids 2,651" if tokenizer is None else '"..."'
    print(f"  use it: printpress generate -m {model} {example}"
          + ("   (offline too: it is in the cache)" if by_id else ""))
    return 0


def check_download(folder: Path):
    """What `printpress.load` checks before it reads weights: the configs, every weight file the index names (as
    `checkpoint.weight_files` finds them) and the tokenizer's special tokens. Returns the tokenizer, or None."""
    from printpress.checkpoint import load_tokenizer, weight_files
    from printpress.config import GenerationConfig, ModelConfig, folder_generation

    config = ModelConfig.from_file(folder / "config.json")
    GenerationConfig.from_dict(folder_generation(folder), config.text)
    weight_files(folder)
    return load_tokenizer(folder)

