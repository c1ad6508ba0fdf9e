"""`--set section.key=value` overrides of a run config, for a new run (`train/command.py`) and a resumed one
(`train/loop.py`); a module of its own so that neither has to import the other for it."""

from __future__ import annotations

import tomllib
from typing import Any

from printpress.errors import ConfigError


def apply_override(data: dict[str, Any], item: str) -> None:
    """`train.steps=200` style overrides; the value is parsed as TOML (so strings need quotes)."""
    key, sep, value = item.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.steps=200")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    section, _, name = key.partition(".")
    data.setdefault(section, {})[name] = parsed
