"""The models printpress can load without a download: the ones shipped in the repository's models/, the folder
PRINTPRESS_DEFAULT_MODEL names, and the DiffusionGemma snapshots in the local Hugging Face cache (`printpress list`).

Reads config files only (no torch, no weights), so listing is as quick as the CLI's help. Each model is described
from its `config.json` (parameters of the text model, canvas length), its `generation_config.json` (the default
decoding), and the `card.json` printpress writes beside the models it trains (the objective). A model that would not
load (a config printpress refuses, weights missing from the cache) is still listed, with the reason as `problem`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from printpress.config import GenerationConfig, ModelConfig, folder_generation, optional_json, read_json
from printpress.errors import PrintpressError
from printpress.hub import is_hub_id

DEFAULT_MODEL = "shakespeare-joint"
DEFAULT_MODEL_ENV = "PRINTPRESS_DEFAULT_MODEL"
SHIPPED_MODELS = Path(__file__).resolve().parents[1] / "models"
MODEL_TYPE = "diffusion_gemma"
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"


def default_model_path() -> Path:
    """The model `printpress.load()` uses when given no path: the one shipped in the repo's models/.

    `PRINTPRESS_DEFAULT_MODEL` may name another folder or hub id.
    """
    override = os.environ.get(DEFAULT_MODEL_ENV)
    if override:
        return Path(override)
    folder = SHIPPED_MODELS / DEFAULT_MODEL
    if not (folder / "config.json").exists():
        raise PrintpressError(f"the default model is not at {folder} (it ships with the source repository); "
                              "pass a model folder or hub id")
    return folder


@dataclass
class ModelEntry:
    """One loadable model. `model` is what `--model` (or `printpress.load`) takes to load it: a folder, or a hub id
    when the cache's `main` points at this revision (loading by id then needs no download)."""

    name: str
    source: str  # "shipped", "PRINTPRESS_DEFAULT_MODEL" or "hub cache"
    model: str
    path: str
    parameters: int | None = None
    objective: str | None = None
    canvas_length: int | None = None
    decoding: dict[str, Any] | None = None
    size_bytes: int = 0
    hub_id: str | None = None
    revision: str | None = None  # the commit hash of a cached snapshot
    refs: list[str] = field(default_factory=list)  # the branches and tags that point at it ("main", ...)
    default: bool = False  # the model printpress loads when given none
    problem: str | None = None  # why it would not load, if it would not

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def describe(folder: Path, name: str, source: str, model: str, size_bytes: int, fix: str = "",
             **fields: Any) -> ModelEntry:
    """A folder's entry, from its config files; a config printpress refuses or missing weights set `problem`
    (`fix`, when given, is added to the latter: what would complete the weights)."""
    entry = ModelEntry(name=name, source=source, model=model, path=str(folder), size_bytes=size_bytes, **fields)
    try:
        config = ModelConfig.from_file(folder / "config.json")
        entry.parameters, entry.canvas_length = config.text.num_parameters(), config.canvas_length
        generation = GenerationConfig.from_dict(folder_generation(folder), config.text)
        entry.decoding = {"max_new_tokens": generation.max_new_tokens, "steps": generation.max_denoising_steps,
                          "entropy_bound": generation.entropy_bound, "t_max": generation.t_max,
                          "t_min": generation.t_min, "window_lead": generation.window_lead,
                          "sliding": generation.sliding, "sliding_steps": generation.sliding_steps,
                          "ar_temperature": generation.temperature, "ar_top_k": generation.top_k}
        objective = optional_json(folder / "card.json").get("objective")
        entry.objective = objective if isinstance(objective, str) else None
        missing = missing_weights(folder)
        entry.problem = missing and missing + fix
    except PrintpressError as exc:
        entry.problem = str(exc)
    return entry


def missing_weights(folder: Path) -> str | None:
    """Why the folder's safetensors weights are incomplete, or None when they are all there (a presence check:
    `checkpoint.weight_files` checks the index thoroughly when the model loads)."""
    if (folder / SAFE_INDEX).is_file():
        weight_map = read_json(folder / SAFE_INDEX).get("weight_map")
        shards = sorted({str(s) for s in weight_map.values()}) if isinstance(weight_map, dict) else []
        missing = [s for s in shards if not (folder / s).is_file()]
        if not shards or missing:
            return f"weight shard(s) missing: {', '.join(missing) or 'the index names none'}"
        return None
    if (folder / SAFE_SINGLE).is_file():
        return None
    return f"no {SAFE_SINGLE} or {SAFE_INDEX}"


def folder_size(folder: Path) -> int:
    """Bytes of the files under `folder` (links followed: a hub snapshot's files are links to the cache's blobs)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def shipped_folder(name: str, root: Path = SHIPPED_MODELS) -> Path | None:
    """The shipped model called `name` (a bare folder name under models/, as `printpress list` shows it), or None."""
    if not name or name != Path(name).name or name.startswith("."):
        return None
    folder = root / name
    return folder if (folder / "config.json").is_file() else None


def shipped_models(root: Path = SHIPPED_MODELS) -> list[ModelEntry]:
    """The model folders of the repository's models/ (those with a config.json), by name."""
    if not root.is_dir():
        return []
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                     and (p / "config.json").is_file())
    return [describe(p, p.name, "shipped", p.name, folder_size(p)) for p in folders]  # loads by name


def cached_models(cache: str | os.PathLike | None = None) -> list[ModelEntry]:
    """The DiffusionGemma revisions of the local Hugging Face cache (`huggingface_hub.scan_cache_dir`; `cache`
    defaults to the one huggingface_hub uses): repositories of models whose snapshot's config.json has model_type
    diffusion_gemma, one entry per cached revision, by hub id, `main` first."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    entries = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            folder = Path(revision.snapshot_path)
            if not _is_diffusion_gemma(folder / "config.json"):
                continue
            refs = sorted(revision.refs)
            model = repo.repo_id if "main" in refs else display_path(folder)
            pull = f" in the cache (printpress pull {repo.repo_id}" + ("" if "main" in refs else
                                                                       f" --revision {revision.commit_hash}") + ")"
            entries.append(describe(folder, repo.repo_id, "hub cache", model, revision.size_on_disk, fix=pull,
                                    hub_id=repo.repo_id, revision=revision.commit_hash, refs=refs))
    return sorted(entries, key=lambda e: (e.name.lower(), "main" not in e.refs, e.revision or ""))


def _is_diffusion_gemma(config: Path) -> bool:
    try:
        return read_json(config).get("model_type") == MODEL_TYPE
    except PrintpressError:
        return False


def list_models(cache: str | os.PathLike | None = None, shipped: Path = SHIPPED_MODELS) -> list[ModelEntry]:
    """Every model printpress can load without a download, the default one marked: the shipped ones, the folder
    PRINTPRESS_DEFAULT_MODEL names (when it is not one of them), then the hub cache's."""
    entries = shipped_models(shipped)
    hub_entries = cached_models(cache)
    override = os.environ.get(DEFAULT_MODEL_ENV)
    if not override:
        for entry in entries:
            entry.default = Path(entry.path) == shipped / DEFAULT_MODEL
        return entries + hub_entries
    folder = Path(override).expanduser()
    if folder.is_dir():
        same = [e for e in entries if Path(e.path).resolve() == folder.resolve()]
        if not same:
            entries.append(describe(folder, folder.name, DEFAULT_MODEL_ENV, display_path(folder),
                                    folder_size(folder)))
            same = entries[-1:]
        same[0].default = True
    elif is_hub_id(override):
        same = [e for e in hub_entries if e.hub_id == override and "main" in e.refs]
        if same:
            same[0].default = True
        else:
            entries.append(ModelEntry(name=override, source=DEFAULT_MODEL_ENV, model=override, path="",
                                      hub_id=override, default=True,
                                      problem=f"not in the hub cache (printpress pull {override})"))
    else:
        entries.append(ModelEntry(name=override, source=DEFAULT_MODEL_ENV, model=override, path=override,
                                  default=True,
                                  problem="no such model folder (and not a hub id of the form owner/name)"))
    return entries + hub_entries


def decoding_summary(decoding: dict[str, Any] | None) -> str:
    """The default decoding in a few words: the diffusion step schedule, then AR sampling."""
    if not decoding:
        return "-"
    diffusion = f"{decoding['steps']} steps, entropy {decoding['entropy_bound']:g}"
    if decoding.get("window_lead"):
        diffusion += f", window {decoding['window_lead']:g}"
    if decoding.get("sliding"):  # the whole-canvas schedule above is what editing and --no-sliding get
        diffusion = f"sliding, {decoding.get('sliding_steps') or decoding['steps']} steps (whole canvases: {diffusion})"
    temperature, top_k = decoding["ar_temperature"], decoding["ar_top_k"]
    ar = "greedy" if temperature == 0 else f"T {temperature:g}" + (f", top-k {top_k}" if top_k else "")
    return f"{diffusion}; AR {ar}"


def display_path(path: str | os.PathLike) -> str:
    """A path as one would type it: relative to the working directory when inside it, `~/...` under home."""
    path = Path(path)
    for base, prefix in ((Path.cwd, None), (Path.home, Path("~"))):
        try:
            relative = path.relative_to(base())
        except (ValueError, OSError, RuntimeError, KeyError):  # outside it, or no working or home directory
            continue
        return str(relative if prefix is None else prefix / relative)
    return str(path)
