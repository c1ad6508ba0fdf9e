"""Evaluation: tasks run by `printpress eval --task NAME`, the sandbox they run code in, report cards,
the lm-evaluation-harness adapter, and judge likelihoods (judge.py).

A task is a module with `evaluate(pipe, *, limit=None, seed=0, settings=None, progress=True) -> dict`
returning {"metrics": {...}, "samples": [...]} (and optionally "info": {...}). `TASKS` maps task names to
module paths; modules are imported only when their task is asked for, so heavy or optional dependencies
of one task never slow down or break another.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from printpress.errors import PrintpressError

TASKS: dict[str, str] = {
    "humaneval": "printpress.eval.humaneval",
    "sudoku": "printpress.eval.sudoku",
}


def load_task(name: str) -> ModuleType:
    """The module of task `name`, imported now; a clear error for unknown or missing tasks."""
    if name not in TASKS:
        raise PrintpressError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    path = TASKS[name]
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name != path:
            raise  # the task exists but one of its own imports is missing: show that, not a wrong message
        raise PrintpressError(f"task {name!r} is registered but its module {path} is not in this installation "
                              "(not written yet, or an older printpress)") from None
    if not callable(getattr(module, "evaluate", None)):
        raise PrintpressError(f"task module {path} has no evaluate(pipe, ...) function")
    return module
