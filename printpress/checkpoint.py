"""Hugging Face checkpoint folders and hub ids <-> `DiffusionGemma`.

The key map is the whole story: the text weights live under `model.decoder.` (the encoder's copies are
tied to them and not stored), and each mode has its own `layer_scalar` buffer. Vision weights are skipped.
Loading streams tensor by tensor into a model allocated once, directly in the target dtype and device.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from printpress import catalog, hub
from printpress.config import (
    PRINTPRESS_GENERATION_FILE,
    GenerationConfig,
    ModelConfig,
    folder_generation,
    read_json,
)
from printpress.errors import CheckpointError
from printpress.files import give_default_modes
from printpress.draft_table import load_beside
from printpress.model import DiffusionGemma
from printpress.runtime_options import AUTO, CHECKPOINT, check_canvas_length, check_dtype, check_quantize
from printpress.runtime_options import DTYPES as DTYPE_NAMES

logger = logging.getLogger(__name__)

DECODER = "model.decoder."
ENCODER_LAYERS = "model.encoder.language_model.layers."
ENCODER_TEXT = "model.encoder.language_model."
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig | None = None) -> torch.dtype:
    """A torch dtype from a name of `runtime_options.DTYPES`; "checkpoint" takes the checkpoint's own dtype. ("auto"
    is measured on the loaded model: `load_model`.)"""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise CheckpointError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype is None:
        return torch.float32
    check_dtype(dtype)
    if dtype == CHECKPOINT:
        saved = (config.extra.get("dtype") or config.extra.get("torch_dtype")) if config else None
        return DTYPES.get(saved, torch.float32)
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} cannot be resolved before the model is loaded")
    return DTYPES[dtype]


def checkpoint_key(name: str) -> str:
    """The checkpoint key of a printpress state-dict entry."""
    if name.endswith(".encoder_layer_scalar"):
        return ENCODER_LAYERS + name[len("layers.") : -len("encoder_layer_scalar")] + "layer_scalar"
    return DECODER + name


def module_key(key: str) -> str | None:
    """The printpress state-dict name of a checkpoint key, or None for keys we skip on purpose."""
    if key.startswith(VISION_PREFIXES):
        return None
    if key.startswith(ENCODER_LAYERS) and key.endswith(".layer_scalar"):
        return "layers." + key[len(ENCODER_LAYERS) : -len("layer_scalar")] + "encoder_layer_scalar"
    if key.startswith(DECODER):
        return key[len(DECODER) :]
    if key.startswith(ENCODER_TEXT) or key == "lm_head.weight":
        return None  # tied copies of decoder weights, written by some exporters
    return "?" + key


def resolve_folder(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder, a shipped model's name (`printpress list`), or a hub id downloaded (config, weights,
    tokenizer) through huggingface_hub. A folder of that name in the working directory comes first."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path}: expected a model folder, got a file")
    text = str(path_or_id)
    shipped = catalog.shipped_folder(text)  # a shipped model by name: `--model shakespeare-ar` from anywhere
    if shipped is not None:
        return shipped
    if not hub.is_hub_id(text):
        raise CheckpointError(f"{text}: no such model folder (and not a hub id of the form owner/name)")
    return hub.download(text, revision)  # config, weights, tokenizer; a failure is one line (printpress/hub.py)


def weight_files(folder: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files of a folder, checking that every shard the index names exists inside it."""
    if (folder / SAFE_INDEX).exists():
        return _index_shards(folder, folder / SAFE_INDEX, ".safetensors")
    if (folder / SAFE_SINGLE).exists():
        if not (folder / SAFE_SINGLE).is_file():
            raise CheckpointError(f"{folder / SAFE_SINGLE}: not a file")
        return [folder / SAFE_SINGLE]
    pickles = [folder / n for n in PICKLE_NAMES if (folder / n).exists()]
    if pickles:
        if not allow_pickle:
            raise CheckpointError(
                f"{pickles[0]}: pickle checkpoints can run code when loaded; convert to safetensors, "
                "or pass allow_pickle=True to load it with torch.load(weights_only=True)"
            )
        if pickles[0].name.endswith(".index.json"):
            return _index_shards(folder, pickles[0], ".bin")
        return pickles[:1]
    raise CheckpointError(f"{folder}: no model.safetensors, {SAFE_INDEX} or other weight file")


def _index_shards(folder: Path, index_path: Path, suffix: str) -> list[Path]:
    """The shards an index names: plain files of the folder (never `../`, absolute paths or devices) with `suffix`,
    so a safetensors index can never route a load through torch.load."""
    index = read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: no weight_map")
    shards = sorted({str(s) for s in weight_map.values()})
    root = folder.resolve()
    for shard in shards:
        path = (folder / shard).resolve()
        if not path.is_relative_to(root) or path.parent != root:
            raise CheckpointError(f"{index_path}: shard {shard!r} is not a file of the checkpoint folder")
        if not shard.endswith(suffix):
            raise CheckpointError(f"{index_path}: shard {shard!r} is not a {suffix} file")
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise CheckpointError(f"{index_path}: shard file(s) missing: {', '.join(missing)}")
    return [folder / s for s in shards]


def available_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 62


def check_sizes(config: ModelConfig, files: list[Path], dtype: torch.dtype, folder: Path) -> None:
    """Refuse, before anything is allocated, a config the machine cannot hold or far larger than its weights."""
    params = config.text.num_parameters()
    need, have = params * dtype.itemsize, available_memory_bytes()
    if need > 0.8 * have:
        raise CheckpointError(f"{folder / 'config.json'} describes {params:,} parameters ({need / 2**30:.1f} GiB in "
                              f"{str(dtype).removeprefix('torch.')}), more than this machine's memory "
                              f"({have / 2**30:.1f} GiB)")
    if not all(f.suffix == ".safetensors" for f in files):
        return  # pickle shards have no header to read without loading them
    held = 0
    for path in files:
        with open_tensors(path) as reader:
            held += sum(math.prod(reader.shape(k)) for k in reader.keys() if module_key(k) is not None)
    # Only gross mismatches here (an absurd config beside small weights): a missing or misshapen tensor is named
    # key by key by load_weights, which is more useful and costs only the allocation of a plausible model.
    if params > 2 * held:
        raise CheckpointError(f"{folder / 'config.json'} describes {params:,} parameters but the weight files hold "
                              f"{held:,}: the config and the weights do not belong together")


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


class SafetensorsReader:
    """Reads one tensor at a time from a .safetensors file straight into its destination.

    `safetensors.safe_open` memory-maps the whole file, and every page it touches counts as resident
    memory until the file is closed, so loading a single-file checkpoint that way peaks at about twice its
    size. Plain reads of one tensor at a time keep the peak at the model plus one tensor (and nothing extra
    when the dtype already matches: the bytes land in the parameter itself). The format is a little-endian
    u64 header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the raw data.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = open(path, "rb")  # noqa: SIM115 - closed by close()
        try:
            self._read_header(path.stat().st_size)
        except BaseException:
            self.handle.close()
            raise

    def _read_header(self, size: int) -> None:
        path = self.path
        prefix = self.handle.read(8)
        header_length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < header_length <= size - 8:
            raise CheckpointError(f"{path}: cannot read safetensors file (bad header length)")
        try:
            header = json.loads(self.handle.read(header_length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors file (bad header: {exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: cannot read safetensors file (the header is not an object)")
        header.pop("__metadata__", None)
        self.data_start = 8 + header_length
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            self.entries[key] = self._entry(key, info, size)
        self._check_layout(size)

    def _entry(self, key: str, info: Any, size: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, begin, end) of one header entry, refusing anything the format does not allow."""
        bad = CheckpointError(f"{self.path}: cannot read safetensors file (tensor {key!r} is corrupt or truncated)")
        if not isinstance(info, dict):
            raise bad
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if dtype is None or not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2:
            raise bad
        begin, end = offsets
        if min(shape, default=0) < 0 or not 0 <= begin <= end or self.data_start + end > size \
                or end - begin != math.prod(shape) * dtype.itemsize:
            raise bad
        return dtype, tuple(shape), begin, end

    def _check_layout(self, size: int) -> None:
        """Tensors must tile the data section exactly, as the safetensors library requires: no overlap, no gap."""
        position = 0
        for _, _, begin, end in sorted(self.entries.values(), key=lambda e: (e[2], e[3])):
            if begin != position:
                raise CheckpointError(f"{self.path}: cannot read safetensors file (tensor data overlaps or leaves gaps)")
            position = end
        if self.data_start + position != size:
            raise CheckpointError(f"{self.path}: cannot read safetensors file (the data section has "
                                  f"{size - self.data_start} bytes, the header describes {position})")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def read_into(self, key: str, target: torch.Tensor) -> None:
        dtype, shape, begin, end = self.entries[key]
        direct = target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous()
        buffer = target if direct else torch.empty(shape, dtype=dtype)
        self.handle.seek(self.data_start + begin)
        view = memoryview(buffer.detach().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < end - begin:
            count = self.handle.readinto(view[done:])
            if not count:
                raise CheckpointError(f"{self.path}: tensor {key!r} is truncated")
            done += count
        if not direct:
            with torch.no_grad():
                target.copy_(buffer)

    def close(self) -> None:
        self.handle.close()


class PickleReader:
    """The opt-in path for .bin/.pt files: torch.load(weights_only=True), memory-mapped."""

    def __init__(self, path: Path) -> None:
        try:
            self.state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot load with torch.load(weights_only=True) ({exc})") from None

    def keys(self) -> list[str]:
        return list(self.state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def read_into(self, key: str, target: torch.Tensor) -> None:
        with torch.no_grad():
            target.copy_(self.state[key])

    def close(self) -> None:
        self.state = {}


@contextmanager
def open_tensors(path: Path) -> Iterator[SafetensorsReader | PickleReader]:
    reader = SafetensorsReader(path) if path.suffix == ".safetensors" else PickleReader(path)
    try:
        yield reader
    finally:
        reader.close()


def build_empty(config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> DiffusionGemma:
    """A model whose parameters are allocated once, uninitialised, in `dtype` on `device`: built on the meta device,
    then each tensor replaced by an empty one of its shape (what `Module.to_empty` does, but from the shape alone:
    `empty_like` of a meta tensor runs through torch._refs, which imports sympy, ~0.5 s of every load)."""
    with torch.device("meta"):
        model = DiffusionGemma(config.text)
    model.to(dtype=dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    return convert(model, dtype)


def convert(model: DiffusionGemma, dtype: torch.dtype) -> DiffusionGemma:
    """The model's weights in `dtype`, in place. The RoPE frequencies are non-persistent buffers computed in
    float32 whatever the weights' dtype (as the reference's): they are rebuilt, not converted."""
    model.to(dtype=dtype)
    device = model.embed_tokens.weight.device
    for name, value in DiffusionGemma.rope_buffers(model.config).items():
        setattr(model, name, value.to(device))
    return model


def load_model(
    path_or_id: str | os.PathLike,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    revision: str | None = None,
    quantize: str | None = None,
    canvas_length: int | None = None,
):
    """Load (model, config, generation_config, tokenizer or None) from a folder or hub id.

    `dtype="auto"` picks the dtype by measurement (`printpress.precision`; the choice and its reason are logged at
    INFO and kept as `model.dtype_choice`); `quantize="int8"` / `"int8-head"` makes the weights int8 after loading
    (`printpress.quantize`; not exact); `canvas_length` replaces the config's diffusion canvas (None: keep it)."""
    check_dtype(dtype)
    check_quantize(quantize)
    check_canvas_length(canvas_length)
    folder = resolve_folder(path_or_id, revision)
    config = ModelConfig.from_file(folder / "config.json")
    if canvas_length is not None:
        config.canvas_length = canvas_length
    generation = GenerationConfig.from_checkpoint(folder_generation(folder), config.text)
    choice = None
    if dtype == AUTO:
        from printpress import precision

        device = torch.device(device)
        # A CPU with native bf16 is measured on the loaded fp32 model; any other device is decided before loading.
        if device.type != "cpu" or not precision.native_bf16_flags(precision.read_cpuinfo()):
            choice = precision.choose(device)
        target = torch.float32 if choice is None else choice.dtype
    else:
        target = resolve_dtype(dtype, config)
    files = weight_files(folder, allow_pickle)
    check_sizes(config, files, target, folder)
    model = build_empty(config, target, device)
    load_weights(model, files)
    model.eval()
    if dtype == AUTO:
        if choice is None:
            measure = None if quantize else (lambda: precision.measure(model, config.canvas_length))
            choice = precision.choose(device, measure_times=measure)
            convert(model, choice.dtype)
        logger.info(choice.describe())
        model.dtype_choice = choice
    if quantize:
        from printpress.quantize import quantize_model

        quantize_model(model, quantize)
    model.draft_table = load_beside(folder)  # mode speculative's draft_source "table" (None: the folder has none)
    return model, config, generation, load_tokenizer(folder)


def load_weights(model: DiffusionGemma, files: list[Path]) -> None:
    """Copy every tensor into place, refusing missing, unexpected and misshapen keys."""
    params = dict(model.named_parameters())
    params.update((n, b) for n, b in model.named_buffers() if not n.endswith("_inv_freq"))
    loaded: set[str] = set()
    skipped_vision = 0
    for path in files:
        with open_tensors(path) as reader:
            for key in reader.keys():
                name = module_key(key)
                if name is None:
                    skipped_vision += key.startswith(VISION_PREFIXES)
                    continue
                target = params.get(name)
                if target is None:
                    raise CheckpointError(f"{path.name}: unexpected tensor {key!r} (not part of a DiffusionGemma text model)")
                shape = tuple(reader.shape(key))
                if shape != tuple(target.shape):
                    raise CheckpointError(f"{path.name}: tensor {key!r} has shape {shape}, expected {tuple(target.shape)}")
                reader.read_into(key, target)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        where = files[0].name if len(files) == 1 else f"{files[0].parent.name}/ shards"
        raise CheckpointError(f"{where}: missing tensor {checkpoint_key(missing[0])!r}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if skipped_vision:
        logger.warning("skipped %d vision-tower tensors: printpress runs the text model only", skipped_vision)


def load_tokenizer(folder: Path):
    """The folder's tokenizer.json (special ids checked), or None when it has none."""
    if not (folder / "tokenizer.json").exists():
        return None
    from printpress.tokenizer import load_tokenizer as load_checked

    return load_checked(folder)


def state_dict_for_save(model: DiffusionGemma) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in model.state_dict().items():
        state[checkpoint_key(name)] = tensor.detach().cpu().contiguous()  # a model trained on a GPU saves too
    return state


def save_model(
    model: DiffusionGemma,
    config: ModelConfig,
    folder: str | os.PathLike,
    generation_config: GenerationConfig | None = None,
    tokenizer=None,
    max_shard_size: int | str = "2GB",
    dtype: torch.dtype | None = None,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write an HF folder (config, generation config, safetensors, tokenizer) atomically.

    Everything is written into a temporary sibling folder first and then renamed into place, so a killed
    save never leaves a partial checkpoint behind. `extra_files(tmp_folder)` may add files (training state)
    that must appear atomically with the weights.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    if any(getattr(module, "quantized", None) for module in model.modules()):
        raise CheckpointError("this model's weights are quantized (int8) and would not load back as a checkpoint; "
                              "save the model loaded without quantize")
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    recover_folder(folder)  # a save killed mid-swap left the last complete copy aside: put it back first
    _remove_abandoned_saves(folder)
    state = state_dict_for_save(model)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    saved_dtype = next(iter(state.values())).dtype
    config_dict = config.to_dict()
    config_dict["dtype"] = str(saved_dtype).removeprefix("torch.")
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
        for filename, keys in split.filename_to_tensors.items():
            save_file({k: state[k] for k in keys}, str(tmp / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
        generation = generation_config or GenerationConfig.from_dict({}, config.text)
        (tmp / "generation_config.json").write_text(json.dumps(generation.to_dict(), indent=2) + "\n")
        if generation.printpress_dict():  # printpress's own defaults, which transformers would refuse in that file
            (tmp / PRINTPRESS_GENERATION_FILE).write_text(json.dumps(generation.printpress_dict(), indent=2) + "\n")
        if tokenizer is not None:
            from printpress.tokenizer import save_tokenizer

            save_tokenizer(tokenizer, tmp)
        if extra_files is not None:
            extra_files(tmp)
        give_default_modes(tmp)
        _replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _old_copy(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.old")


def _replace_folder(new: Path, folder: Path) -> None:
    """Move `new` to `folder`; an existing folder is swapped out and removed only after the move.

    A kill between the two renames leaves only `.<name>.old`, the previous complete copy; `recover_folder`
    (called by the next save and by `--resume`) renames it back, so some complete copy is always found."""
    if folder.exists():
        old = _old_copy(folder)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(new, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, folder)


def recover_folder(folder: str | os.PathLike) -> bool:
    """Put back the previous copy of `folder` if a save was killed between its two renames; True if it did."""
    folder = Path(folder)
    old = _old_copy(folder)
    if folder.exists() or not old.is_dir():
        return False
    os.replace(old, folder)
    logger.warning("recovered %s from an interrupted save (the previous complete copy)", folder)
    return True


def _remove_abandoned_saves(folder: Path) -> None:
    """Delete temporary copies that killed saves of `folder` left behind (a whole checkpoint each)."""
    for leftover in folder.parent.glob(f".{folder.name}.*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
