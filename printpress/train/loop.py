"""The training loop: AdamW, warmup + cosine, clipping, accumulation, validation, resumable checkpoints.

Determinism is by construction rather than by saved generator state: batch k is a function of (seed, k)
(`BatchSampler`), and the noise of global row r at step k is drawn from a generator seeded with
(seed, k, r). A resumed run therefore replays exactly the batches and noise the uninterrupted run would
have seen, and N data-parallel ranks together see the same global batch and noise as one process.

Distributed training is applied from outside the model: the loss is computed by a `TrainStep` module,
which DDP (or FSDP2) wraps when the loop runs under torchrun.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from printpress.checkpoint import available_memory_bytes, load_model, recover_folder, save_model
from printpress.config import GenerationConfig, ModelConfig, TextConfig
from printpress.draft_table import DraftTable, load_beside
from printpress.errors import CheckpointError, PrintpressError
from printpress.model import DiffusionGemma
from printpress.objectives import DiffusionSettings, TeacherDraws, TrainStep, evaluate_losses, row_noise

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"


class TrainingError(PrintpressError):
    """A training run that cannot start or continue (bad settings, NaN loss, no room)."""


@dataclass
class TrainSettings:
    objective: str = "joint"  # diffusion | ar | joint
    steps: int = 1000
    batch_size: int = 16  # global, in sequences
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 100
    t_low: float = 0.0
    self_conditioning: float = 0.5
    weighting: str = "uniform"
    ar_weight: float = 1.0
    certainty_weight: float = 0.0  # certainty forcing (objectives.certainty_loss); 0 = off
    certainty_temperature: float = 0.5
    # Few-step self-distillation (objectives.step_distillation_loss); 0 = off. The teacher is a frozen copy of the
    # model, set to the model's weights every `step_distill_refresh` steps (one SDTT round).
    step_distill_weight: float = 0.0
    step_distill_temperature: float = 0.6
    step_distill_refresh: int = 100
    step_distill_divergence: str = "reverse"  # reverse: KL(student || teacher), SDTT's; forward: KL(teacher || student)
    draft_fraction: float = 0.0  # share of rows noised as a speculative draft (objectives.row_noise); 0 = off
    draft_fused_share: float = 0.0  # of those, the share shaped as a fused draft (first canvas position noised too)
    # Draft rows are exactly the teacher rows (data.distill), which are then seen only in the draft shape: greedy
    # continuations can teach the drafts without narrowing diffusion sampling, which learns from the real rows.
    draft_teacher_rows: bool = False
    # Sampler states (objectives.sampler_state): the share of self-conditioned rows trained on a later sampler
    # step's state, some noised positions holding the first pass's own samples at this temperature; 0 = off.
    sampler_states: float = 0.0
    sampler_states_temperature: float = 0.4
    # AR soft targets (objectives.ar_target_loss): noised canvas positions learn towards the model's own AR
    # distribution, with weight ar_target_weight * t ** ar_target_power; 0 = off. Needs the joint objective.
    ar_target_weight: float = 0.0
    ar_target_power: float = 1.0
    # Front distillation (objectives.front_distill_loss): each canvas's noised first position learns towards the
    # model's own AR distribution, a term of this weight; 0 = off. Needs the joint objective.
    front_distill_weight: float = 0.0
    # Table noise (objectives.table_noise): the share of rows whose noise is drawn from a draft table (data.draft_table,
    # else init_from's) instead of uniformly, as `canvas_start="table"` starts a canvas; 0 = off.
    table_noise: float = 0.0
    # Left-to-right rows (objectives.left_to_right_noise): the share of rows whose canvases are clean before a random
    # position and noise from it on, the states a sampler committing from the left visits; 0 = off.
    left_to_right: float = 0.0
    # Rolling rows (objectives.rolling_noise): the share of rows whose canvases are noised more towards their end, the
    # shape of the sliding sampler's canvas; 0 = off.
    rolling: float = 0.0
    fsdp: bool = False
    # Where the steps run: cpu, or cuda (one process on one GPU). The data, the noise and every random draw stay on
    # the CPU (the same draws on any device) and only the batch moves; checkpoints are saved from the CPU.
    device: str = "cpu"
    precision: str = "float32"  # float32, or bfloat16: autocast (bf16 matmuls; fp32 weights, gradients, optimizer)

    def validate(self, canvas_length: int) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise TrainingError(f"invalid training setting: {message}")

        need(self.objective in ("diffusion", "ar", "joint"), f"objective {self.objective!r} is not one of diffusion, ar, joint")
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "eval_batches", "save_every"):
            need(int(getattr(self, name)) > 0, f"{name} must be positive (got {getattr(self, name)})")
        need(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"need 0 <= min_lr <= lr and lr > 0 (got {self.min_lr}, {self.lr})")
        need(self.warmup >= 0, "warmup must be >= 0")
        need(self.seq_len % canvas_length == 0,
             f"seq_len ({self.seq_len}) must be a multiple of the canvas length ({canvas_length})")
        need(self.batch_size % self.grad_accum == 0,
             f"batch_size ({self.batch_size}) must be divisible by grad_accum ({self.grad_accum})")
        need(self.weighting in ("uniform", "inverse_t"), f"weighting {self.weighting!r} is not uniform or inverse_t")
        need(0 <= self.t_low < 1, f"t_low must be in [0, 1) (got {self.t_low})")
        need(self.weighting != "inverse_t" or self.t_low > 0, "inverse_t weighting needs t_low > 0")
        need(self.certainty_weight >= 0, f"certainty_weight must be >= 0 (got {self.certainty_weight})")
        need(self.certainty_temperature > 0, f"certainty_temperature must be > 0 (got {self.certainty_temperature})")
        need(self.certainty_weight == 0 or self.objective != "ar", "certainty_weight needs a diffusion or joint objective")
        need(self.step_distill_weight >= 0, f"step_distill_weight must be >= 0 (got {self.step_distill_weight})")
        need(self.step_distill_temperature > 0,
             f"step_distill_temperature must be > 0 (got {self.step_distill_temperature})")
        need(self.step_distill_divergence in ("reverse", "forward"),
             f"step_distill_divergence {self.step_distill_divergence!r} is not reverse or forward")
        need(0 <= self.draft_fraction <= 1, f"draft_fraction must be in [0, 1] (got {self.draft_fraction})")
        need(self.draft_fraction == 0 or self.objective != "ar", "draft_fraction needs a diffusion or joint objective")
        need(0 <= self.draft_fused_share <= 1, f"draft_fused_share must be in [0, 1] (got {self.draft_fused_share})")
        need(not (self.draft_teacher_rows and self.draft_fraction > 0),
             "draft_teacher_rows picks the draft rows itself (the teacher rows); leave draft_fraction at 0")
        need(not self.draft_teacher_rows or self.objective != "ar", "draft_teacher_rows needs a diffusion or joint objective")
        need(0 <= self.sampler_states <= 1, f"sampler_states must be in [0, 1] (got {self.sampler_states})")
        need(self.sampler_states_temperature > 0,
             f"sampler_states_temperature must be > 0 (got {self.sampler_states_temperature})")
        need(self.sampler_states == 0 or (self.objective != "ar" and self.self_conditioning > 0),
             "sampler_states needs a diffusion or joint objective with self_conditioning > 0 (the states come "
             "from the self-conditioning pass)")
        need(0 <= self.ar_target_weight <= 1, f"ar_target_weight must be in [0, 1] (got {self.ar_target_weight})")
        need(self.ar_target_power >= 0, f"ar_target_power must be >= 0 (got {self.ar_target_power})")
        need(self.ar_target_weight == 0 or self.objective == "joint",
             "ar_target_weight needs the joint objective (the AR distribution comes from its clean half)")
        need(self.front_distill_weight >= 0, f"front_distill_weight must be >= 0 (got {self.front_distill_weight})")
        need(self.front_distill_weight == 0 or self.objective == "joint",
             "front_distill_weight needs the joint objective (the AR distribution comes from its clean half)")
        for name in ("table_noise", "left_to_right", "rolling"):  # shares of rows noised in a shape of their own
            share = getattr(self, name)
            need(0 <= share <= 1, f"{name} must be in [0, 1] (got {share})")
            need(share == 0 or self.objective != "ar", f"{name} needs a diffusion or joint objective")
        need(self.device == "cpu" or self.device.split(":")[0] == "cuda",
             f"device {self.device!r} is not cpu or cuda (cuda:N for another GPU)")
        need(self.precision in ("float32", "bfloat16"), f"precision {self.precision!r} is not float32 or bfloat16")
        need(int(self.step_distill_refresh) > 0, f"step_distill_refresh must be positive (got {self.step_distill_refresh})")
        if self.step_distill_weight > 0:
            need(self.objective != "ar", "step_distill_weight needs a diffusion or joint objective")
            need(not self.fsdp, "step_distill_weight does not run under fsdp (the teacher is a full copy per rank)")


@dataclass
class RunConfig:
    """Everything a run needs: the model (new or `init_from`), the data and the training settings."""

    model: dict[str, Any] = field(default_factory=dict)  # TextConfig fields plus canvas_length
    data: dict[str, Any] = field(default_factory=dict)  # sources, vocab_size, val_fraction, text_field
    train: TrainSettings = field(default_factory=TrainSettings)
    generation: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        unknown = sorted(set(data) - {"model", "data", "train", "generation", "init_from", "name", "description"})
        if unknown:
            raise TrainingError(f"unknown section(s) in the run config: {unknown}")
        train = dict(data.get("train", {}))
        known = {f.name for f in dataclasses.fields(TrainSettings)}
        bad = sorted(set(train) - known)
        if bad:
            raise TrainingError(f"unknown training setting(s): {bad}")
        train = {name: _typed_setting(name, value) for name, value in train.items()}
        return cls(model=dict(data.get("model", {})), data=dict(data.get("data", {})), train=TrainSettings(**train),
                   generation=dict(data.get("generation", {})), init_from=data.get("init_from"))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["train"]["betas"] = list(self.train.betas)
        return out


def _typed_setting(name: str, value: Any) -> Any:
    """`value` as the type of TrainSettings' default for `name`, or a TrainingError naming both."""
    default = next(f.default for f in dataclasses.fields(TrainSettings) if f.name == name)
    if isinstance(default, bool):
        ok, value = isinstance(value, bool), value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif isinstance(default, tuple):
        ok = isinstance(value, (list, tuple)) and len(value) == len(default) and \
            all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        value = tuple(float(v) for v in value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise TrainingError(f"training setting {name} must be {_kind(default)}, got {value!r}")
    return value


def _kind(default: Any) -> str:
    if isinstance(default, tuple):
        return f"a list of {len(default)} numbers"
    return {bool: "true or false", int: "an integer", float: "a finite number"}.get(type(default), "a string")


# -- distributed helpers ---------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """Join the process group when launched by torchrun (RANK/WORLD_SIZE set); one process otherwise."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Dist()
    if not dist.is_initialized():
        # gloo: data-parallel runs train on CPU processes (a GPU run is one process: `training_device`), and NCCL,
        # which a CUDA build would pick on a GPU machine, reduces only GPU tensors.
        dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size())


def wrap_distributed(step: TrainStep, settings: TrainSettings, env: Dist) -> torch.nn.Module:
    if env.world == 1:
        return step
    if settings.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in step.model.layers:
            fully_shard(layer)
        return fully_shard(step)
    from torch.nn.parallel import DistributedDataParallel

    # Experts no token of this rank's batch chose get no gradient here: tell DDP, or its buckets go out of step.
    return DistributedDataParallel(step, find_unused_parameters=True)


# -- schedule, memory --------------------------------------------------------------------------------------


def learning_rate(step: int, settings: TrainSettings) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at the last step."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    span = max(1, settings.steps - settings.warmup)
    progress = min(1.0, (step - settings.warmup) / span)
    return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1 + math.cos(math.pi * progress))


def estimate_memory_bytes(text: TextConfig, settings: TrainSettings, world: int) -> int:
    """A rough upper estimate: fp32 weights, grads and two Adam moments, plus activations of one micro-batch."""
    params = text.num_parameters()
    micro = settings.batch_size // world // settings.grad_accum
    tokens = micro * settings.seq_len * (1 if settings.objective == "ar" else 2)
    per_token = text.num_hidden_layers * (14 * text.hidden_size + 4 * text.intermediate_size
                                          + 4 * text.top_k_experts * text.moe_intermediate_size) + 3 * text.vocab_size
    attention = text.num_hidden_layers * text.num_attention_heads * micro * (tokens // max(micro, 1)) ** 2
    return 16 * params + 4 * (tokens * per_token + attention)


def check_memory(text: TextConfig, settings: TrainSettings, world: int, device: torch.device | None = None) -> None:
    on_gpu = device is not None and device.type == "cuda"
    need = estimate_memory_bytes(text, settings, world)
    have = torch.cuda.mem_get_info(device)[0] if on_gpu else available_memory_bytes()
    if need > 0.8 * have:
        where = f"{device} has {have / 2**30:.1f} GiB free" if on_gpu else f"the machine has {have / 2**30:.1f} GiB"
        raise TrainingError(f"this run needs about {need / 2**30:.1f} GiB but {where}; "
                            "reduce batch_size, seq_len or the model size, or raise grad_accum")


def training_device(settings: TrainSettings, world: int) -> torch.device:
    """`train.device` as a torch device, or a TrainingError saying why it cannot train there."""
    try:
        device = torch.device(settings.device)
    except RuntimeError:
        raise TrainingError(f"train.device {settings.device!r} is not a device name (cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainingError(f"train.device {settings.device}: this torch ({torch.__version__}) sees no CUDA "
                                "device; train on cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise TrainingError(f"train.device {settings.device}: torch sees {torch.cuda.device_count()} GPU(s), "
                                "numbered from 0")
        if world > 1:
            raise TrainingError("train.device cuda trains as one process on one GPU; data parallelism across GPUs "
                                "is not built yet: run it without torchrun")
    return device


# -- the run ---------------------------------------------------------------------------------------------


def objective_settings(settings: TrainSettings) -> dict[str, Any]:
    """The `DiffusionSettings` fields (all but `block`, the canvas length) taken from the training settings."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(DiffusionSettings) if f.name != "block"}


class Trainer:
    def __init__(self, run: RunConfig, out: str | Path, resume: bool = False, overrides=(),
                 overwrite: bool = False, announce: Callable[[str], None] | None = None) -> None:
        """`overwrite` allows a fresh run in a folder that holds an earlier run (its checkpoint, model and
        metrics are replaced); without it, and without `resume`, such a folder is refused. `announce` receives a
        line per preparation stage (the CLI prints them, so a minute of tokenizing is not silence)."""
        self.run = run
        self.out = Path(out)
        self.overrides = list(overrides)
        self.env = init_distributed()
        self.announce = announce if announce is not None and self.env.main else (lambda line: None)
        self.settings = run.train
        self.metrics_path = self.out / METRICS_FILE
        self.checkpoint_dir = self.out / "checkpoint"
        self._check_out_folder(resume, overwrite)
        self._prepare(resume)

    def _check_out_folder(self, resume: bool, overwrite: bool) -> None:
        """Refuse an --out that cannot hold a run, or that holds one this call would silently clobber."""
        if self.out.exists() and not self.out.is_dir():
            raise TrainingError(f"--out {self.out} is a file, not a run folder")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainingError(f"cannot create the run folder {self.out}: {exc.strerror or exc}") from None
        if not os.access(self.out, os.W_OK | os.X_OK):
            raise TrainingError(f"the run folder {self.out} is not writable")
        if resume:
            recover_folder(self.checkpoint_dir)
            return
        earlier = [name for name in (METRICS_FILE, "checkpoint", "model") if (self.out / name).exists()]
        if earlier and not overwrite:
            raise TrainingError(f"{self.out} already holds a run ({', '.join(earlier)}): continue it with --resume, "
                                "or start over with --overwrite")
        if earlier and self.env.main:  # all of it: a later --resume must never find the old run's checkpoint
            self.metrics_path.unlink(missing_ok=True)
            for name in ("checkpoint", "model"):
                shutil.rmtree(self.out / name, ignore_errors=True)

    # -- setup ---------------------------------------------------------------------------------------------
    def _prepare(self, resume: bool) -> None:
        from printpress.data import eval_batches, prepare_data  # heavy: import late

        settings = self.settings
        torch.manual_seed(settings.seed)
        state = None
        if resume:
            if not (self.checkpoint_dir / STATE_FILE).exists():
                raise TrainingError(f"--resume: no checkpoint to resume in {self.checkpoint_dir}")
            self.announce(f"resuming from {self.checkpoint_dir}")
            model, config, generation, tokenizer = load_model(self.checkpoint_dir)
            state = torch.load(self.checkpoint_dir / STATE_FILE, map_location="cpu", weights_only=True)
            saved = state["run"]
            shape = [item for item in self.overrides if item.partition("=")[0].strip().startswith(("model.", "init_from"))]
            if shape:
                raise TrainingError(f"--resume cannot change the model ({', '.join(shape)}): the checkpoint's "
                                    "weights have their shape; start a new run (init_from) instead")
            if self.overrides:
                from printpress.train.overrides import apply_override

                for item in self.overrides:
                    apply_override(saved, item)
                logger.warning("resuming with changed settings: %s", ", ".join(self.overrides))
            self.run = RunConfig.from_dict(saved)
            settings = self.settings = self.run.train
        elif self.run.init_from:
            self.announce(f"loading {self.run.init_from} (init_from)")
            model, config, generation, tokenizer = load_model(self.run.init_from)
            self._check_model_section(config)
        else:
            model, config, generation, tokenizer = None, None, None, None
        if tokenizer is None:
            self.announce("training a tokenizer on the corpus")
            tokenizer = self._main_first(self._train_tokenizer)
        self.tokenizer = tokenizer
        if model is None:
            config = self._new_model_config(tokenizer.get_vocab_size())
        settings.validate(config.canvas_length)
        self.noise_table = self._noise_table() if settings.table_noise > 0 else None  # before any long preparation
        self.device = training_device(settings, self.env.world)
        check_memory(config.text, settings, self.env.world, self.device)  # before allocating anything large
        if model is None:
            model = DiffusionGemma(config.text)
        model.to(self.device)
        self.config, self.model = config, model
        self.generation = generation or GenerationConfig.from_dict(self.run.generation, config.text)
        data = self.run.data
        sources = ", ".join(map(str, data.get("sources", ["shakespeare"])))
        self.announce(f"preparing the data ({sources}) in {self.out / 'data'}")
        splits = self._main_first(lambda: prepare_data(
            data.get("sources", ["shakespeare"]), tokenizer, self.out / "data",
            val_fraction=data.get("val_fraction", 0.05), text_field=data.get("text_field", "text")))
        self.train_tokens, self.val_tokens = splits.train, splits.val
        for name, tokens in (("train", splits.train), ("validation", splits.val)):
            if len(tokens.tokens) <= settings.seq_len:
                raise TrainingError(f"the {name} split has {len(tokens.tokens)} tokens, fewer than seq_len={settings.seq_len}")
        self.sampler = self._batch_sampler(splits.train.tokens, tokenizer)
        # The global batch, sharded by eval_batches itself: every world size evaluates the same windows.
        self.eval_windows = list(eval_batches(splits.val.tokens, settings.seq_len, settings.batch_size,
                                              max_batches=settings.eval_batches, rank=self.env.rank,
                                              world_size=self.env.world))
        # Every objective setting but the canvas length is a training setting of the same name.
        self.diffusion = DiffusionSettings(block=config.canvas_length, **objective_settings(settings))
        self.teacher = None
        if settings.step_distill_weight > 0:  # a frozen copy, outside the optimizer and the DDP wrapper
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
            if state is not None and "teacher" in state:
                self.teacher.load_state_dict(state["teacher"])
        self.step_module = TrainStep(model, settings.objective, self.diffusion)
        self.wrapped = wrap_distributed(self.step_module, settings, self.env)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr, betas=settings.betas, foreach=True,
        )
        self.step = 0
        self.last_record: dict[str, Any] | None = None  # the last step's metrics, and the last held-out losses
        self.last_eval: dict[str, Any] | None = None
        self.elapsed = 0.0  # seconds spent in training steps, summed across resumes
        self.last_good: int | None = None
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = state["step"]
            self.elapsed = float(state.get("train_seconds", 0.0))
            self.sampler.load_state_dict(state["sampler"])
            self.last_good = self.step
            self._truncate_metrics(self.step)

    def _batch_sampler(self, train_tokens, tokenizer):
        """Real windows, or with `data.distill` (a `printpress distill` token file) a fixed share of teacher rows,
        and with `data.distill_draft` a second teacher file whose rows are trained only as speculative drafts."""
        from printpress.train.data import BatchSampler, MixedBatchSampler

        settings, data = self.settings, self.run.data
        if settings.draft_teacher_rows and not data.get("distill"):
            raise TrainingError("train.draft_teacher_rows needs data.distill: the teacher rows are the draft rows")
        if data.get("distill_draft") and not data.get("distill"):
            raise TrainingError("data.distill_draft needs data.distill (the teacher rows trained as ordinary canvases)")
        if data.get("distill_draft") and settings.draft_teacher_rows:
            raise TrainingError("data.distill_draft names the draft rows itself; leave train.draft_teacher_rows off")
        if not data.get("distill"):
            return BatchSampler(train_tokens, settings.seq_len, settings.batch_size, seed=settings.seed,
                                rank=self.env.rank, world_size=self.env.world,
                                aligned=bool(data.get("aligned_windows", False)))
        rows = self._teacher_rows("distill_fraction", 0.5)
        draft_rows = self._teacher_rows("distill_draft_fraction", 0.25) if data.get("distill_draft") else 0
        if rows + draft_rows >= settings.batch_size:
            raise TrainingError(f"{rows} teacher and {draft_rows} draft rows leave no real row in a batch of "
                                f"{settings.batch_size}: lower data.distill_fraction or data.distill_draft_fraction")
        return MixedBatchSampler(train_tokens, self._teacher_tokens("distill", tokenizer), settings.seq_len,
                                 settings.batch_size, rows, seed=settings.seed, rank=self.env.rank,
                                 world_size=self.env.world, draft_rows=draft_rows,
                                 draft=self._teacher_tokens("distill_draft", tokenizer) if draft_rows else None)

    def _noise_table(self) -> DraftTable:
        """The draft table `train.table_noise` draws from: `data.draft_table` (a model folder or a table file), else
        the one beside `init_from`'s weights. Named in the run's config, so a resumed run draws from the same."""
        source = self.run.data.get("draft_table") or self.run.init_from
        if not source:
            raise TrainingError("train.table_noise draws noise from a draft table: set data.draft_table (a model "
                                "folder or a draft_table.safetensors) or init_from a model that has one")
        path = Path(source)
        try:
            table = load_beside(path) if path.is_dir() else DraftTable.load(path) if path.is_file() else None
        except CheckpointError as error:
            raise TrainingError(f"train.table_noise: {error}") from None
        if table is None or table.distributions is None:
            raise TrainingError(f"train.table_noise needs a draft table with sampled counts, and {source} has "
                                + ("none" if table is None else "one without them")
                                + ": make one with `printpress draft-table MODEL`")
        return table

    def _teacher_rows(self, key: str, default: float) -> int:
        """Rows per batch that `data.<key>` (a share of the batch) asks for: at least one."""
        fraction, batch = float(self.run.data.get(key, default)), self.settings.batch_size
        rows = round(batch * fraction)
        if not 0 < rows < batch:
            raise TrainingError(f"data.{key} {fraction} gives {rows} of {batch} rows per batch; "
                                "it must leave at least one teacher row and one real row")
        return rows

    def _teacher_tokens(self, key: str, tokenizer):
        """The token file `data.<key>` names, checked to hold whole rows of train.seq_len tokens."""
        from printpress.data import open_token_file

        path, seq_len = self.run.data[key], self.settings.seq_len
        teacher = open_token_file(path, tokenizer=tokenizer)
        lengths = {count for _, _, count in teacher.meta.documents}
        if lengths != {seq_len}:
            raise TrainingError(f"{path} holds rows of {sorted(lengths)} tokens; train.seq_len is "
                                f"{seq_len}: distil with --prefix-tokens + --new-tokens = seq_len")
        return teacher.tokens

    def _main_first(self, build):
        """Rank 0 builds shared files (tokenizer, token files) while the others wait, then they reuse them."""
        if self.env.world == 1:
            return build()
        if self.env.main:
            result = build()
            dist.barrier()
            return result
        dist.barrier()
        return build()

    def _train_tokenizer(self):
        from printpress.corpora import load_corpus, split_documents
        from printpress.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

        saved = self.out / "data" / "tokenizer.json"
        if saved.exists():
            return load_tokenizer(saved)
        data = self.run.data
        if data.get("tokenizer"):  # a task's fixed vocabulary (e.g. "sudoku"), not a BPE trained on the corpus
            from printpress.tasks import fixed_tokenizer

            tokenizer = fixed_tokenizer(data["tokenizer"])
            save_tokenizer(tokenizer, saved.parent, hf_config=False)
            return tokenizer
        docs = load_corpus(data.get("sources", ["shakespeare"]), text_field=data.get("text_field", "text"))
        train, _ = split_documents(docs, data.get("val_fraction", 0.05))
        tokenizer = train_tokenizer(train, data.get("vocab_size", 4096))
        save_tokenizer(tokenizer, saved.parent, hf_config=False)
        return tokenizer

    def _check_model_section(self, config: ModelConfig) -> None:
        """A fine-tune keeps its checkpoint's architecture; a `[model]` section beside `init_from` (a from-scratch
        recipe run with `--set init_from=...`) must describe that architecture, not silently another one."""
        if not self.run.model:
            return
        built = self._new_model_config(config.text.vocab_size)
        want, have = built.text.to_dict(), config.text.to_dict()
        differ = [f"{name}={want.get(name)!r} (checkpoint: {have.get(name)!r})"
                  for name in sorted(set(want) | set(have)) if want.get(name) != have.get(name)]
        if built.canvas_length != config.canvas_length:
            differ.append(f"canvas_length={built.canvas_length} (checkpoint: {config.canvas_length})")
        if differ:
            raise TrainingError(f"init_from {self.run.init_from} is not the [model] of the run config: "
                                f"{', '.join(differ)}; a fine-tune keeps its checkpoint's architecture, so drop or "
                                "fix those [model] values")

    def _new_model_config(self, vocab_size: int) -> ModelConfig:
        model = dict(self.run.model)
        canvas = model.pop("canvas_length", 32)
        model["vocab_size"] = vocab_size
        return ModelConfig(TextConfig(**model), canvas_length=canvas)

    # -- steps ---------------------------------------------------------------------------------------------
    def compute_loss(self, tokens: torch.Tensor, step: int, first_row: int) -> dict[str, torch.Tensor]:
        noise, teacher = None, None
        # The AR loss stays on real text (ar_rows), never on a teacher's continuations; data.distill_draft's rows
        # are trained only as drafts, and with train.draft_teacher_rows all of data.distill's rows are.
        ar_rows, draft_rows = self.sampler.roles(first_row, tokens.shape[0])
        if draft_rows is None and self.settings.draft_teacher_rows:
            draft_rows = ~ar_rows
        if self.settings.objective != "ar":
            noise = row_noise(tokens, first_row, step, self.settings.seed, self.diffusion, self.config.text.vocab_size,
                              teacher_draws=self.teacher is not None, draft_rows=draft_rows,
                              sampler_states=self.diffusion.sampler_states > 0, table=self.noise_table)
            if self.teacher is not None:  # its two draws follow the first three; any sampler states come last
                teacher = TeacherDraws(self.teacher, *self._moved(noise[3:5]))
                noise = noise[:3] + noise[5:]
        return self._forward(tokens, noise, ar_rows, teacher)

    def _forward(self, tokens: torch.Tensor, noise=None, ar_rows: torch.Tensor | None = None,
                 teacher: TeacherDraws | None = None) -> dict[str, torch.Tensor]:
        """The (wrapped) training module on the training device, under autocast with `precision` bfloat16.
        Everything is drawn on the CPU first, so a run draws the same batches and noise on any device."""
        tokens, ar_rows = self._moved((tokens, ar_rows))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.settings.precision == "bfloat16"):
            return self.wrapped(tokens, self._moved(noise), None, ar_rows, teacher)

    def _moved(self, tensors):
        """A tuple of tensors (or Nones) on the training device; None stays None."""
        if tensors is None or self.device.type == "cpu":
            return tensors
        return tuple(None if t is None else t.to(self.device, non_blocking=True) for t in tensors)

    def train_step(self) -> dict[str, float]:
        settings, env = self.settings, self.env
        self.model.train()
        if self.teacher is not None and self.step % settings.step_distill_refresh == 0:  # a new round
            self.teacher.load_state_dict(self.model.state_dict())
        lr = learning_rate(self.step, settings)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.sampler.batch(self.step)  # (B / world, L): this rank's rows of the global batch
        local = batch.shape[0]
        micro = local // settings.grad_accum
        totals: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for index in range(settings.grad_accum):
            rows = batch[index * micro : (index + 1) * micro]
            first_row = env.rank * local + index * micro
            out = self.compute_loss(rows, self.step, first_row)
            (out["loss"] / settings.grad_accum).backward()
            for key, value in out.items():
                totals[key] = totals.get(key, 0.0) + float(value.detach()) / settings.grad_accum
        totals = self._all_reduce_mean(totals)
        if not math.isfinite(totals["loss"]):
            where = f"the last good checkpoint (step {self.last_good}) is in {self.checkpoint_dir}" \
                if self.last_good is not None else "no checkpoint was written yet"
            raise TrainingError(f"the loss became {totals['loss']} at step {self.step}; stopped; {where}. "
                                "Lower the learning rate or check the data.")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), settings.clip)
        self.optimizer.step()
        self.step += 1
        self.sampler.step = self.step
        totals.update(lr=lr, grad_norm=float(norm))
        return totals

    def _all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        if self.env.world == 1:
            return values
        keys = sorted(values)
        tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(tensor)
        return {k: float(v) / self.env.world for k, v in zip(keys, tensor)}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out losses with fixed noise (`evaluate_losses`): the diffusion loss (ELBO-style bound) and the AR
        NLL per token, averaged over the ranks."""
        self.model.eval()
        # Through the (possibly DDP/FSDP-wrapped) training module, so sharded weights are gathered.
        losses = evaluate_losses(self._forward, self.eval_windows, self.settings.objective, self.diffusion,
                                 self.config.text.vocab_size, self.settings.seed, self.env.rank)
        return self._all_reduce_mean(losses)

    # -- persistence ---------------------------------------------------------------------------------------
    def save_checkpoint(self, folder: Path | None = None, with_state: bool = True) -> None:
        folder = folder or self.checkpoint_dir
        model_state = self.model
        if self.settings.fsdp and self.env.world > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if not self.env.main:
                return
            model_state = DiffusionGemma(self.config.text)
            model_state.load_state_dict(full)
        if not self.env.main:
            return
        extra = None
        if with_state:
            state = {"run": self.run.to_dict(), "step": self.step, "optimizer": self.optimizer.state_dict(),
                     "sampler": self.sampler.state_dict(), "torch_rng": torch.get_rng_state(),
                     "train_seconds": self.elapsed}
            if self.teacher is not None:  # mid-round, a resume needs the round's teacher, not the current weights
                state["teacher"] = self.teacher.state_dict()
            extra = lambda tmp: torch.save(state, tmp / STATE_FILE)  # noqa: E731
        save_model(model_state, self.config, folder, self.generation, self.tokenizer, extra_files=extra)
        self.last_good = self.step

    def log(self, record: dict[str, Any]) -> None:
        if not self.env.main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _truncate_metrics(self, step: int) -> None:
        """Drop records a killed run wrote after its last checkpoint, so the resumed log has no duplicates."""
        if not self.env.main or not self.metrics_path.exists():
            return
        kept = [line for line, record in zip(*_read_records(self.metrics_path)) if record.get("step", 0) <= step]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))

    # -- main loop -----------------------------------------------------------------------------------------
    def summary(self) -> str:
        """One line on how the run ended: steps, time, the last step's losses and the last held-out losses."""
        parts = [f"trained {self.step} steps ({self.elapsed / 60:.1f} min of training)"]
        if self.last_record:
            terms = ("loss", "ar", "diffusion", "certainty", "ar_target", "front_distill", "step_distill")
            keys = [k for k in terms if k in self.last_record]
            parts.append("last step " + ", ".join(f"{k} {self.last_record[k]:.3f}" for k in keys))
        if self.last_eval:
            parts.append(f"held-out at step {self.last_eval['step']} "
                         + ", ".join(f"{k} {v:.3f}" for k, v in self.last_eval.items() if k != "step"))
        return "; ".join(parts)

    def fit(self, progress: bool = True) -> Path:
        from tqdm import tqdm

        settings = self.settings
        self.out.mkdir(parents=True, exist_ok=True)
        if self.env.main:
            (self.out / "run.json").write_text(json.dumps(self.run.to_dict(), indent=2) + "\n")
        bar = tqdm(total=settings.steps, initial=self.step, disable=not (progress and self.env.main),
                   dynamic_ncols=True, desc="train")
        tokens_per_step = settings.batch_size * settings.seq_len
        while self.step < settings.steps:
            started = time.perf_counter()
            metrics = self.train_step()
            elapsed = time.perf_counter() - started
            self.elapsed += elapsed
            record = {"step": self.step, **metrics, "tokens_per_s": tokens_per_step / elapsed,
                      "train_seconds": self.elapsed}
            if self.step % settings.eval_every == 0 or self.step == settings.steps:
                bar.set_description_str("train (evaluating)")
                held_out = self.evaluate()
                bar.set_description_str("train")
                record.update(held_out)
                self.last_eval = {"step": self.step, **held_out}
            self.log(record)
            self.last_record = record
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                            **{k: f"{v:.3f}" for k, v in (self.last_eval or {}).items() if k != "step"})
            bar.update(1)
            if self.step % settings.save_every == 0 or self.step == settings.steps:
                self.save_checkpoint()
                if self.env.main:
                    plot_metrics(self.metrics_path, self.out / "curves.png")
        bar.close()
        final = self.out / "model"
        self.save_checkpoint(final, with_state=False)
        return final


def _read_records(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The lines of metrics.jsonl and their records, skipping what a killed write left unparsable."""
    lines, records = [], []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            logger.warning("skipping an unreadable line of %s (a write cut short?)", path)
            continue
        if isinstance(record, dict):
            lines.append(line)
            records.append(record)
    return lines, records


def plot_metrics(metrics_path: Path, png: Path) -> None:
    """Training and validation curves from metrics.jsonl (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _read_records(metrics_path)[1]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("ar", "-"), ("diffusion", "-"), ("val_ar", "o-"), ("val_diffusion", "o-")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), style, label=key, markersize=3, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)
