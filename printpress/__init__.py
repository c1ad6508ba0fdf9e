"""printpress: a fast open engine for text-diffusion language models (DiffusionGemma)."""

from printpress.errors import CheckpointError, ConfigError, GenerationError, PrintpressError

__version__ = "0.1.0"

__all__ = ["load", "PrintpressError", "CheckpointError", "ConfigError", "GenerationError", "__version__"]


def load(path_or_id: str | None = None, **kwargs):
    """Load a model folder or hub id into a generation pipeline (see `printpress.pipeline.Pipeline`)."""
    from printpress.pipeline import Pipeline

    return Pipeline.from_pretrained(path_or_id, **kwargs)
