"""The Hugging Face hub, as printpress uses it: which files of a model repository it fetches, and what each of
huggingface_hub's exceptions means to a user, in one line.

Imports nothing heavy at module level (huggingface_hub is imported when a download starts), so the CLI that builds
on it answers `--help` without it; `printpress.checkpoint` (loading by hub id) and `printpress pull` both download
through `download`.
"""

from __future__ import annotations

from pathlib import Path

from printpress.errors import CheckpointError

# The files printpress reads from a model repository: config.json, generation_config.json, the safetensors
# weights and their index, the tokenizer and its config, and a chat template kept beside them.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
CONFIG_FILES = ["config.json"]


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a hub model id, `owner/name` (not a path: nothing before the owner)."""
    return not text.startswith((".", "/", "~")) and text.count("/") == 1 and all(text.split("/"))


def download(hub_id: str, revision: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """The local snapshot folder of `hub_id` at `revision` (the default branch when None), downloaded through
    `huggingface_hub.snapshot_download` with `allow_patterns` (default: the files printpress reads), or taken
    from the local cache when it is offline and the snapshot is there. Every failure is a `CheckpointError` of
    one line that says what happened and what to do."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, revision=revision,
                                      allow_patterns=HUB_FILES if allow_patterns is None else allow_patterns))
    except Exception as exc:  # noqa: BLE001 - mapped below; anything unknown keeps its traceback
        reason = failure_reason(exc, hub_id, revision)
        if reason is None:
            raise
        raise CheckpointError(f"{hub_id}: could not fetch from the Hugging Face hub: {reason}") from None


def failure_reason(exc: Exception, hub_id: str, revision: str | None) -> str | None:
    """One line for a huggingface_hub (or I/O) failure, None for an exception that is a bug rather than a
    circumstance. The checks go from the most specific class to the least (GatedRepoError is a
    RepositoryNotFoundError, which is an HfHubHTTPError, which is an OSError)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f" at revision {revision!r}" if revision else ""
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        if constants.HF_HUB_OFFLINE:
            return (f"HF_HUB_OFFLINE is set and the model{where} is not in the local cache "
                    f"({constants.HF_HUB_CACHE}); unset HF_HUB_OFFLINE to download it")
        return (f"the hub could not be reached and the model{where} is not in the local cache "
                f"({constants.HF_HUB_CACHE}); check the network connection or set HF_ENDPOINT")
    if isinstance(exc, GatedRepoError):
        return (f"the model is gated: accept its conditions at https://huggingface.co/{hub_id} and log in "
                "(`hf auth login`, or HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        return "no such model on the hub (or it is private: log in with `hf auth login`, or set HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return f"the model has no revision {revision!r} (a branch, tag or commit hash)"
    if isinstance(exc, HFValidationError):
        return f"not a valid hub id or revision ({_first_line(exc)})"
    if isinstance(exc, HfHubHTTPError):
        return f"the hub answered with an error ({_first_line(exc)})"
    if isinstance(exc, OSError):
        return f"cannot write the download ({exc.strerror or _first_line(exc)})"
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def cache_dir() -> Path:
    """The hub cache huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)

