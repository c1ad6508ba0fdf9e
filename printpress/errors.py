"""Errors a user can cause. The CLI prints them as one line and exits 2; the server answers 4xx."""


class PrintpressError(Exception):
    """Base class for every error caused by user input (bad files, bad settings, bad requests)."""


class CheckpointError(PrintpressError):
    """A checkpoint folder, file or tensor that cannot be loaded as asked."""


class ConfigError(PrintpressError):
    """A configuration value that is missing, unknown or out of range."""


class GenerationError(PrintpressError):
    """Generation settings or prompts that cannot be honoured."""
