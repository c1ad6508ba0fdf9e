"""`--set section.key=value` overrides of a run config, for a new run (`train/command.py`) and a resumed one
(`train/loop.py`); a module of its own so that neither has to import the other for it."""

from __future__ import annotations

import tomllib
from typing import Any

from printpress.errors import ConfigError


# The run config's keys outside any section that `--set` may change: a recipe's starting checkpoint, so that a
# fine-tune recipe runs from another base without a copy of the recipe (`--set init_from=runs/joint-long/model`).
TOP_LEVEL = ("init_from",)


def apply_override(data: dict[str, Any], item: str) -> None:
    """`train.steps=200` style overrides; the value is parsed as TOML, else taken as a plain string (a path)."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or ("." not in key and key not in TOP_LEVEL):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.steps=200, or init_from=PATH")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    if key in TOP_LEVEL:
        data[key] = parsed
        return
    section, _, name = key.partition(".")
    data.setdefault(section, {})[name] = parsed
