"""Report cards: one JSON result and one short markdown page per evaluation or benchmark run.

Every run leaves behind what is needed to judge and repeat it (after nanochat's report cards): the
machine (CPU, cores, memory, accelerator, torch and Python versions, printpress version and git commit),
the exact command line, and whatever the caller puts in the payload — by convention `model`,
`settings`, `metrics` (numbers), `info` (other facts) and `samples` (per-item records, kept in the JSON
only). Files are named `<UTC time>-<name>.json|.md` under the folder the user chose, so runs never
overwrite each other.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from printpress.errors import PrintpressError

# Payload keys drawn as tables, in this order; other keys follow; these never go into the markdown.
_SECTIONS = ("metrics", "settings", "model", "info")
_JSON_ONLY = ("samples",)


def machine() -> dict[str, Any]:
    """Facts about this machine and software that bear on speed and reproducibility."""
    import torch

    import printpress
    from printpress.model import warm_choice

    facts: dict[str, Any] = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": _memory_gb(),
        # Shared machines: a busy one slows every figure down, so the card says how busy it was.
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "printpress": printpress.__version__,
        "weights_read_ahead": warm_choice(),  # the exact layers' choice for this process (printpress.model)
    }
    facts.update(git_state())
    return facts


def git_state() -> dict[str, Any]:
    """The commit of the printpress source tree (and whether it had uncommitted changes), if it is a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=False)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {"git_commit": None, "git_dirty": None}
    if commit.returncode != 0:
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, shell-quoted (the script path shortened to its name, e.g. `printpress`)."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


def write_report(results_dir: str | os.PathLike, name: str, payload: dict[str, Any]) -> tuple[Path, Path]:
    """Write `<results_dir>/<time>-<name>.json` and `.md`; returns both paths.

    `payload` is the caller's: `metrics`, `settings`, `model`, `info`, `samples`, `command` (default: this
    process's command line), anything else JSON can hold. The card adds `name`, `created` and `machine`.
    """
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise PrintpressError(f"a report name may hold letters, digits, '.', '_' and '-', got {name!r}")
    folder = Path(results_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PrintpressError(f"cannot create the results folder {folder}: {exc.strerror}") from None
    created = _dt.datetime.now(_dt.UTC)
    card = {"name": name, "created": created.isoformat(timespec="seconds"),
            "command": payload.get("command") or command_line(), "machine": machine()}
    card.update({k: v for k, v in payload.items() if k != "command"})
    stem = f"{created:%Y%m%d-%H%M%S}-{name}"
    json_path, md_path, n = folder / f"{stem}.json", folder / f"{stem}.md", 1
    while json_path.exists() or md_path.exists():  # two runs in the same second
        n += 1
        json_path, md_path = folder / f"{stem}-{n}.json", folder / f"{stem}-{n}.md"
    json_path.write_text(json.dumps(card, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    md_path.write_text(markdown(card, json_path.name), encoding="utf-8")
    return json_path, md_path


def markdown(card: dict[str, Any], json_name: str) -> str:
    """The short human-readable page of a card."""
    lines = [f"# {card['name']} — {card['created']}", "", "```", card["command"], "```", ""]
    keys = [k for k in _SECTIONS if k in card]
    keys += [k for k in card if k not in keys and k not in ("name", "created", "command", "machine")]
    for key in keys + ["machine"]:
        value = card[key]
        if key in _JSON_ONLY or (isinstance(value, list) and len(value) > 20):
            lines += [f"**{key}**: {len(value)} records in [{json_name}]({json_name})", ""]
        elif isinstance(value, dict):
            lines += [f"## {key.capitalize()}", "", "| | |", "|---|---|"]
            lines += [f"| {k} | {_cell(v)} |" for k, v in value.items()]
            lines.append("")
        else:
            lines += [f"**{key}**: {_cell(value)}", ""]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, ensure_ascii=False, default=str)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", "⏎")


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None
