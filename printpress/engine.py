"""The generation engine's public names, in one place: `from printpress.engine import Pipeline, Request, run, ...`.

The engine itself lives in layers, each importing only the ones below it (tests/test_imports.py keeps it so):

    events.py          the event stream and the results (a leaf)
    request.py         `Request` and `RequestState`, the one per-request state of every loop
    canvas.py          the canvas step: temperature, acceptance, sampling and re-noising, the adaptive stop
    diffusion.py       the canvas loop with continuous batching (`DiffusionBatch`)
    autoregressive.py  the encoder as a causal LM
    speculative.py     diffusion drafts verified causally
    editing.py         infilling and span rewriting
    pipeline.py        `Pipeline` (the Python API) and `run` (a batch to the loop of its mode)

This module only re-exports them, so it sits above all of them and nothing in the package imports it.
"""

from __future__ import annotations

from printpress.diffusion import DiffusionBatch
from printpress.events import (
    CommitEvent,
    Decode,
    DoneEvent,
    Event,
    GenerationResult,
    GenerationStats,
    StepEvent,
    TokenLogprob,
)
from printpress.pipeline import (
    DEFAULT_MODEL,
    SETTING_NAMES,
    SPECULATIVE_DRAFT_STEPS,
    Pipeline,
    Prompt,
    default_model_path,
    run,
)
from printpress.request import Request, check_logprobs, check_prompts, new_token_budget

__all__ = [
    "DEFAULT_MODEL", "SETTING_NAMES", "SPECULATIVE_DRAFT_STEPS", "CommitEvent", "Decode", "DiffusionBatch",
    "DoneEvent", "Event", "GenerationResult", "GenerationStats", "Pipeline", "Prompt", "Request", "StepEvent",
    "TokenLogprob", "check_logprobs", "check_prompts", "default_model_path", "new_token_budget", "run",
]
