"""printpress: a fast open engine for text-diffusion language models (DiffusionGemma)."""

import os

# OpenMP threads that sleep between parallel regions instead of spinning. With spinning (the default), a
# thread whose core another process holds makes every small matrix product wait for it: on 2 cores with one
# busy, the shipped model decoded 60x slower with 2 threads than with 1; passive waiting removes that and
# keeps the second thread's gain. It only takes effect if printpress is imported before torch (the CLI and the
# server are); a value the user set is kept. docs/generation.md, "Threads".
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from printpress.errors import CheckpointError, ConfigError, GenerationError, PrintpressError

__version__ = "0.1.0"

__all__ = ["load", "PrintpressError", "CheckpointError", "ConfigError", "GenerationError", "__version__"]


def load(path_or_id: str | None = None, **kwargs):
    """Load a model folder or hub id into a generation pipeline (see `printpress.engine.Pipeline`)."""
    from printpress.engine import Pipeline

    return Pipeline.from_pretrained(path_or_id, **kwargs)
