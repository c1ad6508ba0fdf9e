"""Configs that read and write the Hugging Face `diffusion_gemma` schema.

`config.json` holds a top-level `DiffusionGemmaConfig` with a nested `text_config`; printpress keeps the
parsed text config as a dataclass and the rest of the file verbatim, so a folder written by printpress
loads in transformers and a real checkpoint's vision settings survive a load/save round trip.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from printpress.errors import ConfigError

logger = logging.getLogger(__name__)

SLIDING = "sliding_attention"
FULL = "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu", "silu")

# A vision config small enough that transformers builds (and randomly initialises) its vision tower in
# milliseconds when it loads a text-only folder written by printpress.
STUB_VISION_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


@dataclass(frozen=True)
class LayerSpec:
    """The resolved shape of one layer's attention."""

    sliding: bool
    head_dim: int
    num_kv_heads: int

    @property
    def shares_kv(self) -> bool:
        # The reference gives full-attention layers no v_proj: values are the (un-roped) keys.
        return not self.sliding


@dataclass
class TextConfig:
    """The `text_config` of a DiffusionGemma checkpoint (field names follow the HF schema)."""

    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, dict[str, Any]] | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    sliding_window: int = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    use_bidirectional_attention: str | None = None
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    # Per-layer overrides by layer index. transformers writes the keys as zero-padded strings
    # ({"05": {...}, "11": {...}}) and reads them back with int(); so do we.
    per_layer_config: dict[int, dict[str, int]] | None = None
    # Keys of the text_config we do not interpret but keep for a faithful round trip.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            # Released layout: five sliding layers, then one full layer.
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if self.layer_types and self.layer_types[-1] != FULL:
            logger.warning("the last layer must use full attention (got %s); using full attention", self.layer_types[-1])
            self.layer_types[-1] = FULL
        if self.rope_parameters is None:
            self.rope_parameters = {
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
            }
        if self.per_layer_config is None:
            override: dict[str, int] = {"head_dim": self.global_head_dim}
            if self.num_global_key_value_heads is not None and self.extra.get("attention_k_eq_v", True):
                override["num_key_value_heads"] = self.num_global_key_value_heads
            self.per_layer_config = {i: dict(override) for i, t in enumerate(self.layer_types) if t == FULL}
        else:
            parsed = {}
            for key, value in self.per_layer_config.items():
                try:
                    parsed[int(key)] = dict(value)
                except (TypeError, ValueError):
                    raise ConfigError(f"invalid text_config: per_layer_config has a key {key!r} that is not a layer index") from None
            self.per_layer_config = parsed
        self.validate()

    # -- derived values -------------------------------------------------------------------------------
    @property
    def layers(self) -> list[LayerSpec]:
        specs = []
        for i, kind in enumerate(self.layer_types):
            override = self.per_layer_config.get(i, {})
            specs.append(
                LayerSpec(
                    sliding=kind == SLIDING,
                    head_dim=int(override.get("head_dim", self.head_dim)),
                    num_kv_heads=int(override.get("num_key_value_heads", self.num_key_value_heads)),
                )
            )
        return specs

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        if eos is None:
            return []
        return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    def num_parameters(self) -> int:
        """Parameters of the text model (embedding counted once: the LM head is tied)."""
        h, i = self.hidden_size, self.intermediate_size
        total = self.vocab_size * h + h + h + 3 * h * i  # embed, final norm, self-conditioning
        for spec in self.layers:
            q = self.num_attention_heads * spec.head_dim
            kv = spec.num_kv_heads * spec.head_dim
            total += h * q + h * kv * (1 if spec.shares_kv else 2) + q * h + 2 * spec.head_dim
            total += 3 * h * i + 7 * h  # dense MLP, seven norms
            e, m = self.num_experts, self.moe_intermediate_size
            total += e * h + h + e + e * (2 * m * h + h * m)  # router, experts
        return total

    # -- validation -----------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(f"invalid text_config: {message}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer (got {value!r})")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        need(not unknown, f"unknown layer type(s) {unknown}; expected {SLIDING!r} or {FULL!r}")
        need(isinstance(self.sliding_window, int) and self.sliding_window >= 2,
             f"sliding_window must be an integer >= 2 (got {self.sliding_window!r})")
        need(self.hidden_activation in ACTIVATIONS,
             f"hidden_activation {self.hidden_activation!r} is not supported; expected one of {list(ACTIVATIONS)}")
        for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0,
                 f"{name} must be a positive integer: every DiffusionGemma layer has a mixture of experts (got {value!r})")
        need(self.top_k_experts <= self.num_experts,
             f"top_k_experts ({self.top_k_experts}) exceeds num_experts ({self.num_experts})")
        # The reference ties every encoder weight to the decoder except biases, which it leaves as separate
        # parameters; released checkpoints have none, so printpress refuses them rather than half-supporting.
        need(not self.attention_bias, "attention_bias=true is not supported (the reference unties its encoder biases)")
        need(self.tie_word_embeddings, "tie_word_embeddings=false (untied encoder/decoder weights) is not supported")
        need(self.use_bidirectional_attention in (None, "vision"),
             f"use_bidirectional_attention={self.use_bidirectional_attention!r} is not supported (text encoder must be causal)")
        need(_number(self.rms_norm_eps) and self.rms_norm_eps > 0,
             f"rms_norm_eps must be a positive number (got {self.rms_norm_eps!r})")
        need(self.final_logit_softcapping is None or (_number(self.final_logit_softcapping)
                                                      and self.final_logit_softcapping > 0),
             f"final_logit_softcapping must be a positive number or null (got {self.final_logit_softcapping!r})")
        need(isinstance(self.rope_parameters, dict), f"rope_parameters must be an object (got {self.rope_parameters!r})")
        for kind in set(self.layer_types):
            rope = self.rope_parameters.get(kind)
            need(isinstance(rope, dict), f"rope_parameters has no entry for {kind!r}")
            need(_number(rope.get("rope_theta", 10_000.0)) and rope.get("rope_theta", 10_000.0) > 0,
                 f"rope_theta for {kind!r} must be a positive number (got {rope.get('rope_theta')!r})")
            need(rope.get("rope_type", "default") in ("default", "proportional"),
                 f"rope_type {rope.get('rope_type')!r} for {kind!r} is not supported")
        for index, spec in enumerate(self.layers):
            need(spec.head_dim > 0 and spec.head_dim % 2 == 0, f"layer {index}: head_dim must be even (got {spec.head_dim})")
            need(spec.num_kv_heads > 0 and self.num_attention_heads % spec.num_kv_heads == 0,
                 f"layer {index}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                 f"num_key_value_heads ({spec.num_kv_heads})")
        for key, override in self.per_layer_config.items():
            need(0 <= key < self.num_hidden_layers, f"per_layer_config has unknown layer {key!r}")
            extra = sorted(set(override) - {"head_dim", "num_key_value_heads"})
            need(not extra, f"per_layer_config[{key}] overrides {extra}, which printpress does not support")

    # -- HF schema ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TextConfig:
        data = dict(data)
        model_type = data.pop("model_type", "diffusion_gemma_text")
        if model_type != "diffusion_gemma_text":
            raise ConfigError(f"text_config has model_type {model_type!r}; expected 'diffusion_gemma_text'")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known}
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a value of the wrong type deep inside __post_init__
            raise ConfigError(f"invalid text_config: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        # transformers folds these two into per_layer_config and does not accept them back alongside it.
        out.pop("global_head_dim")
        out.pop("num_global_key_value_heads")
        digits = len(str(max(self.per_layer_config, default=0)))
        out["per_layer_config"] = {str(k).zfill(digits): v for k, v in sorted(self.per_layer_config.items())}
        out.update(copy.deepcopy(self.extra))
        out["model_type"] = "diffusion_gemma_text"
        return out


@dataclass
class ModelConfig:
    """A whole `config.json`: the text config, the canvas length and every other top-level key."""

    text: TextConfig
    canvas_length: int = 256
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        model_type = data.pop("model_type", None)
        if model_type != "diffusion_gemma":
            raise ConfigError(f"model_type {model_type!r} is not supported; printpress reads 'diffusion_gemma' checkpoints")
        text = data.pop("text_config", None)
        if not isinstance(text, dict):
            raise ConfigError("config.json has no text_config object")
        canvas_length = data.pop("canvas_length", 256)
        if not isinstance(canvas_length, int) or canvas_length <= 0:
            raise ConfigError(f"canvas_length must be a positive integer (got {canvas_length!r})")
        return cls(text=TextConfig.from_dict(text), canvas_length=canvas_length, extra=data)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "model_type": "diffusion_gemma",
            "canvas_length": self.canvas_length,
            "tie_word_embeddings": True,
            "vision_config": copy.deepcopy(STUB_VISION_CONFIG),
        }
        out.update(copy.deepcopy(self.extra))
        out["text_config"] = self.text.to_dict()
        return out

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(read_json(path))


# AR sampling when generation_config.json says nothing about it (printpress's default, not transformers': a small
# diffusion LM's causal head loops when greedy). A file that sets any of do_sample / temperature / top_k is read as
# transformers reads it (do_sample false, its default, means greedy).
AR_TEMPERATURE, AR_TOP_K = 0.8, 50
_AR_KEYS = ("do_sample", "temperature", "top_k")
# printpress's own generation defaults (GenerationConfig.printpress_dict), beside generation_config.json: transformers'
# DiffusionGemmaGenerationConfig raises on any key it does not know, so they cannot go in that file.
PRINTPRESS_GENERATION_FILE = "printpress_generation.json"
PRINTPRESS_GENERATION_KEYS = ("window_lead", "sliding", "sliding_steps")


@dataclass
class GenerationConfig:
    """`generation_config.json`; unset fields take the reference's defaults (and printpress's AR sampling)."""

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    # printpress's own sampler defaults, which the reference's generation config refuses as unknown keys: stored in
    # PRINTPRESS_GENERATION_FILE beside generation_config.json (`printpress_dict`), read back merged into it.
    window_lead: float = 0.0  # the left-to-right window (0: off, as the reference; printpress.settings)
    sliding: bool = False  # the sliding canvas (off, as the reference; printpress.settings)
    # The sliding front's wait, max_denoising_steps while the canvas slides and a request names no steps (0: the same
    # as a whole canvas's); a sliding canvas does best with far fewer than a whole one (docs/benchmarks.md §8).
    sliding_steps: int = 0
    eos_token_id: list[int] | None = None
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    # The causal head's sampling (mode="ar" and the speculative mode's verifier): 0 = greedy.
    temperature: float = AR_TEMPERATURE
    top_k: int | None = AR_TOP_K

    @classmethod
    def from_dict(cls, data: dict[str, Any], text: TextConfig | None = None) -> GenerationConfig:
        """Settings for a new checkpoint: unset special tokens come from the model config."""
        return cls._parse(data, text)

    @classmethod
    def from_checkpoint(cls, data: dict[str, Any], text: TextConfig) -> GenerationConfig:
        """Settings read from a checkpoint's generation_config.json, as the reference reads them: an unset
        eos_token_id means no EOS at all (transformers does not fall back to the model config)."""
        if data.get("eos_token_id") is None:
            logger.warning("generation_config.json sets no eos_token_id: generation will not stop at an EOS token "
                           "(as in transformers); pass eos_token_ids to generate() to change that")
            generation = cls._parse(data, text)
            generation.eos_token_id = []
            return generation
        return cls._parse(data, text)

    @classmethod
    def _parse(cls, data: dict[str, Any], text: TextConfig | None) -> GenerationConfig:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if data.get(f.name) is not None and f.name not in _AR_KEYS:
                values[f.name] = data[f.name]
        if any(data.get(key) is not None for key in _AR_KEYS):
            values.update(_ar_sampling(data))
        sampler = data.get("sampler_config")
        if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
            values["entropy_bound"] = sampler["entropy_bound"]
        if text is not None:
            values.setdefault("eos_token_id", text.eos_token_ids)
            values.setdefault("pad_token_id", text.pad_token_id)
            values.setdefault("bos_token_id", text.bos_token_id)
        eos = values.get("eos_token_id")
        if isinstance(eos, int):
            values["eos_token_id"] = [eos]
        generation = cls(**values)
        generation.validate()
        return generation

    def validate(self) -> None:
        """Types only (ranges are the sampler's to check): a wrong type here would fail much later, mid-generation."""
        def need(ok: bool, name: str, kind: str) -> None:
            if not ok:
                raise ConfigError(f"invalid generation_config: {name} must be {kind} (got {getattr(self, name)!r})")

        for name in ("max_new_tokens", "max_denoising_steps", "stability_threshold"):
            need(_integer(getattr(self, name)), name, "an integer")
        for name in ("entropy_bound", "t_min", "t_max", "confidence_threshold", "window_lead", "temperature"):
            need(_number(getattr(self, name)), name, "a number")
        need(isinstance(self.sliding, bool), "sliding", "true or false")
        need(_integer(self.sliding_steps) and self.sliding_steps >= 0, "sliding_steps", "an integer >= 0")
        need(self.top_k is None or _integer(self.top_k), "top_k", "an integer or null")
        for name in ("pad_token_id", "bos_token_id"):
            need(getattr(self, name) is None or _integer(getattr(self, name)), name, "a token id or null")
        need(self.eos_token_id is None or (isinstance(self.eos_token_id, list) and all(map(_integer, self.eos_token_id))),
             "eos_token_id", "a token id, a list of them, or null")

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "max_denoising_steps": self.max_denoising_steps,
            "sampler_config": {"entropy_bound": float(self.entropy_bound), "_cls_name": "EntropyBoundSamplerConfig"},
            "t_min": float(self.t_min),
            "t_max": float(self.t_max),
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": float(self.confidence_threshold),
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            **self._ar_sampling_dict(),
        }

    def printpress_dict(self) -> dict[str, Any]:
        """The defaults of printpress's own settings that are set (`PRINTPRESS_GENERATION_FILE`); {} when none is."""
        values = {key: getattr(self, key) for key in PRINTPRESS_GENERATION_KEYS if getattr(self, key)}
        return {key: float(value) if key == "window_lead" else value for key, value in values.items()}

    def _ar_sampling_dict(self) -> dict[str, Any]:
        """AR sampling in transformers' keys, written only when it is not printpress's default (so a default
        config's file is unchanged and a greedy or otherwise tuned one survives a save/load round trip)."""
        if (self.temperature, self.top_k) == (AR_TEMPERATURE, AR_TOP_K):
            return {}
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": float(self.temperature), "top_k": self.top_k or 0}


def _ar_sampling(data: dict[str, Any]) -> dict[str, Any]:
    """temperature / top_k from transformers' keys: greedy unless do_sample; temperature 1 and top-k 50 when unset
    (transformers' defaults); top_k 0 means no top-k cut."""
    do_sample = data.get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise ConfigError(f"invalid generation_config: do_sample must be true or false (got {do_sample!r})")
    top_k = data.get("top_k", 50)
    return {"temperature": data.get("temperature", 1.0) if do_sample else 0.0, "top_k": top_k or None}


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def folder_generation(folder: Path) -> dict[str, Any]:
    """A checkpoint folder's generation defaults as one dict: its generation_config.json ({} without one) with its
    PRINTPRESS_GENERATION_FILE over it. A key of the latter that is not one of printpress's own generation defaults
    is refused, so that file cannot quietly override generation_config.json."""
    own = optional_json(folder / PRINTPRESS_GENERATION_FILE)
    unknown = sorted(set(own) - set(PRINTPRESS_GENERATION_KEYS))
    if unknown:
        raise ConfigError(f"{folder / PRINTPRESS_GENERATION_FILE}: unknown key(s) {', '.join(unknown)}; it holds "
                          f"printpress's own generation defaults ({', '.join(PRINTPRESS_GENERATION_KEYS)}), the rest "
                          "go in generation_config.json")
    return {**optional_json(folder / "generation_config.json"), **own}


def optional_json(path: Path) -> dict[str, Any]:
    """`read_json(path)`, or {} where there is no such file."""
    return read_json(path) if path.exists() else {}


def read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:  # a folder where the file should be, no permission, ...
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data
