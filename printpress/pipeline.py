"""`Pipeline`: a loaded model with its tokenizer and generation defaults, the Python API; and `run`, which sends
a batch of requests to the loop of their mode.

This module sits above the decoding loops (printpress/diffusion.py, autoregressive.py, speculative.py,
editing.py), which know nothing of it: it turns prompts (text or ids) and keyword settings into validated
`Request`s, picks the loop, and collects the loop's events into results.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Union

import torch

from printpress import editing
from printpress.autoregressive import autoregressive
from printpress.catalog import DEFAULT_MODEL, default_model_path  # noqa: F401 - re-exported (printpress.engine)
from printpress.diffusion import diffusion
from printpress.errors import GenerationError, PrintpressError
from printpress.events import Decode, DoneEvent, EditResult, Event, GenerationResult
from printpress.model import allow_half_width
from printpress.request import Request, check_logprobs, check_prompts, model_device
from printpress.runtime_options import (check_canvas_length, check_compile, check_compile_weights, check_dtype,
                                       check_quantize)
from printpress.settings import (
    BY_NAME,
    SETTINGS,
    SPECULATIVE_DRAFT_STEPS,
    SamplerSettings,
    check_setting,
    refuse_unread,
)
from printpress.speculative import speculative


def run(
    model: torch.nn.Module,
    canvas_length: int,
    requests: Sequence[Request],
    decode: Decode | None = None,
    step_events: bool = True,
) -> Iterator[Event]:
    """Generate for a batch of requests, yielding events as they happen.

    All requests must share a mode. `decode` turns token ids into text (for CommitEvent.text and
    results). With `step_events=False` no StepEvent is built (saves a little work per step).
    """
    if not requests:
        return
    modes = {r.settings.mode for r in requests}
    if len(modes) != 1:
        raise GenerationError(f"one batch must use one mode, got {sorted(modes)}")
    for request in requests:
        request.settings.validate()
        check_logprobs(request)
    check_prompts(model.config, canvas_length, requests)
    mode = requests[0].settings.mode
    if mode == "ar":
        yield from autoregressive(model, requests, decode)
    elif mode == "speculative":
        yield from speculative(model, requests, decode, canvas_length=canvas_length, step_events=step_events)
    else:
        yield from diffusion(model, canvas_length, requests, decode, step_events)


Prompt = Union[str, Sequence[str], Sequence[int], Sequence[Sequence[int]], torch.Tensor]


def model_folder(model: str | os.PathLike | None) -> Path | None:
    """The local folder `printpress.load(model)` reads: the default model's for None, the path when it is a
    folder, None for a hub id (its files live in the hub cache)."""
    if model is None:
        return default_model_path()
    path = Path(model)
    return path if path.is_dir() else None


def check_device(device: str | torch.device) -> torch.device:
    """The device, or a PrintpressError saying why this machine cannot use it, before any weights are read (torch
    would fail later with a traceback, e.g. "Torch not compiled with CUDA enabled" for cuda on a CPU build)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PrintpressError(f"unknown device {str(device)!r}: {exc}") from None
    count = _device_count(resolved.type)
    if count == 0:
        raise PrintpressError(f"device {str(device)!r} is not available: this torch ({torch.__version__}) has no "
                              f"{resolved.type} support or sees no {resolved.type} device; use cpu")
    if count is not None and resolved.index is not None and resolved.index >= count:
        raise PrintpressError(f"device {str(device)!r} does not exist: torch sees {count} {resolved.type} device(s), "
                              f"numbered from 0")
    return resolved


def _device_count(kind: str) -> int | None:
    """How many devices of a kind torch can use here; None for a kind it has no count for (torch says more)."""
    if kind == "cpu":
        return None
    if kind == "mps":
        return int(torch.backends.mps.is_available())
    backend = getattr(torch, kind, None)  # torch.cuda, torch.xpu, ...
    if backend is None or not hasattr(backend, "is_available") or not hasattr(backend, "device_count"):
        return None
    return backend.device_count() if backend.is_available() else 0


class Pipeline:
    """A loaded model with its tokenizer and generation defaults.

    >>> pipe = printpress.load("path/to/model")
    >>> pipe.generate("Once upon a time", max_new_tokens=64, seed=0).text
    """

    def __init__(self, model: torch.nn.Module, config, generation_config, tokenizer=None) -> None:
        self.model = model
        self.config = config
        self.generation_config = generation_config
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path | None = None,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        quantize: str | None = None,
        compile: str | None = None,
        compile_weights: str = "float32",
        canvas_length: int | None = None,
    ) -> Pipeline:
        """`dtype`: float32 (the default; exact), bfloat16, float16, "auto" (measured: `printpress.precision`) or
        "checkpoint" (as saved). `quantize`: None (exact weights) or "int8" / "int8-head" (`printpress.quantize`;
        not exact). `compile`: None (the exact eager passes), "ar", "decoder" or "all" (`printpress.fast`: those
        passes as torch.compile graphs; not exact); `compile_weights` "bfloat16" has the compiled AR steps read
        bfloat16 copies of the weights (`printpress.fast.compile_ar_step`: faster, the weights rounded) and, on a
        CPU with AMX, a canvas's products run on bfloat16 tiles (`printpress.fast.compile_decoder`).
        `canvas_length`: the diffusion canvas to decode with instead of the checkpoint's (exact: the reference decodes the same with that value in config.json; `save_pretrained`
        writes it). Bad values are refused before anything is read."""
        from printpress.checkpoint import load_model

        check_dtype(dtype)
        check_quantize(quantize)
        check_compile(compile)
        check_compile_weights(compile_weights, compile)
        check_canvas_length(canvas_length)
        device = check_device(device)
        if path_or_id is None:
            path_or_id = default_model_path()
        model, config, generation_config, tokenizer = load_model(str(path_or_id), dtype=dtype, device=device,
                                                                 quantize=quantize, canvas_length=canvas_length)
        model.eval()
        allow_half_width(model)  # an inference model: its products may read half-width copies (the same bits)
        if compile is not None:
            from printpress.fast import compile_ar_step, compile_decoder

            if compile in ("ar", "all"):
                compile_ar_step(model, weights=compile_weights)
            if compile in ("decoder", "all"):
                compile_decoder(model, weights=compile_weights)
        return cls(model, config, generation_config, tokenizer)

    def save_pretrained(self, folder: str | Path, dtype: str | torch.dtype | None = None,
                        max_shard_size: int | str = "2GB") -> Path:
        """Write the model, its config, generation defaults and tokenizer as a Hugging Face folder that
        `from_pretrained` (and transformers' `DiffusionGemmaForBlockDiffusion`) loads back, with the model's draft
        table where it has one.

        The write is atomic (a temporary sibling folder renamed into place), so a killed save leaves the previous
        copy or nothing. `dtype` converts the weights on the way out (default: as loaded).
        """
        from printpress.checkpoint import save_model
        from printpress.draft_table import FILE

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        table = self.model.draft_table
        return save_model(self.model, self.config, folder, self.generation_config, self.tokenizer,
                          max_shard_size=max_shard_size, dtype=dtype,
                          extra_files=None if table is None else lambda tmp: table.save(tmp / FILE))

    @property
    def dtype_choice(self):
        """What `dtype="auto"` chose and why (`printpress.precision.DtypeChoice`); None for any other dtype."""
        return getattr(self.model, "dtype_choice", None)

    @property
    def canvas_length(self) -> int:
        return self.config.canvas_length

    def default_settings(self) -> SamplerSettings:
        """The checkpoint's generation defaults as sampler settings (each setting's `checkpoint` field, from
        generation_config.json and printpress_generation.json); a sliding default comes with its `sliding_steps`."""
        g = self.generation_config
        settings = SamplerSettings(pad_token_id=g.pad_token_id,
                                   **{s.name: getattr(g, s.checkpoint) for s in SETTINGS if s.checkpoint})
        return settings.with_overrides(max_denoising_steps=self._canvas_steps(settings.sliding))

    def _canvas_steps(self, sliding: bool) -> int:
        """The checkpoint's steps for a diffusion canvas: its `sliding_steps` while the canvas slides (when set),
        else its max_denoising_steps."""
        g = self.generation_config
        return g.sliding_steps if sliding and g.sliding_steps else g.max_denoising_steps

    def settings(self, **overrides) -> SamplerSettings:
        """Checkpoint defaults with the given overrides (any `SamplerSettings` field but the pad id, and
        `draft_steps`; None keeps the default), validated. A setting the mode does not use is refused
        (`settings.refuse_unread`).

        Two settings read differently by mode: `draft_steps` (speculative only) is the drafts' denoising steps,
        stored in `max_denoising_steps` (which the draft loop reads; default `SPECULATIVE_DRAFT_STEPS`, not the
        checkpoint's canvas steps; given, it makes draft_source "auto" mean diffusion drafts); `temperature` in
        diffusion mode multiplies the t_max -> t_min schedule (`SamplerSettings.scale_schedule`), in AR and
        speculative mode it is the causal head's temperature. In diffusion mode, steps left out are the
        checkpoint's for the sampler asked for: its `sliding_steps` (printpress_generation.json) for a sliding
        canvas where it sets them, else its max_denoising_steps.
        """
        unknown = sorted(set(overrides) - {s.name for s in SETTINGS})
        if unknown:
            raise GenerationError(f"unknown generation setting(s): {', '.join(unknown)}")
        defaults = self.default_settings()
        mode = overrides.get("mode") or defaults.mode
        overrides = dict(overrides)
        draft_steps = overrides.pop("draft_steps", None)
        refuse_unread(mode, {"draft_steps": draft_steps}, defaults)  # before the checks of the settings it replaces
        # Draft steps shape diffusion drafts only: asking for them makes draft_source "auto" mean diffusion.
        wants_diffusion_drafts = draft_steps is not None or overrides.get("max_denoising_steps") is not None
        if mode == "speculative":
            if draft_steps is not None and overrides.get("max_denoising_steps") is not None:
                raise GenerationError("give draft_steps or max_denoising_steps (the same setting in mode "
                                      "'speculative'), not both")
            if draft_steps is not None:
                check_setting("draft_steps", draft_steps)
            if overrides.get("max_denoising_steps") is None:
                overrides["max_denoising_steps"] = SPECULATIVE_DRAFT_STEPS if draft_steps is None else draft_steps
        if mode == "diffusion" and overrides.get("max_denoising_steps") is None:
            # The checkpoint's steps for the sampler asked for: a sliding front waits its own (`sliding_steps`).
            sliding = overrides.get("sliding")
            overrides["max_denoising_steps"] = self._canvas_steps(defaults.sliding if sliding is None else sliding)
        settings = defaults.with_overrides(**overrides).validate()
        refuse_unread(settings.mode, overrides, defaults)  # an option the mode cannot honour is an error
        if settings.mode == "diffusion" and overrides.get("temperature") is not None:
            settings = settings.scale_schedule(settings.temperature)
        if settings.mode == "speculative" and settings.draft_source == "auto" and wants_diffusion_drafts:
            settings = settings.with_overrides(draft_source="diffusion")
        for name in DIFFUSION_DEFAULTS:
            if getattr(settings, name) and settings.mode not in BY_NAME[name].modes:
                # A checkpoint's window or sliding canvas is a diffusion default: speculative drafts share the canvas
                # step, open whole and do not slide.
                settings = settings.with_overrides(**{name: BY_NAME[name].default})
        return settings

    # -- text <-> ids ---------------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Token ids of a text prompt, after the checkpoint's BOS token.

        BOS is added here rather than by the tokenizer's post-processor, which not every
        tokenizer.json has; special-token text in the prompt (chat markup) is parsed as such.
        """
        if self.tokenizer is None:
            raise GenerationError("this model has no tokenizer (tokenizer.json); pass token ids instead of text")
        if not text:
            raise GenerationError("the prompt is empty; give at least one character")
        # A flag of the shared Tokenizer object that other code may have flipped: set it every time.
        self.tokenizer.encode_special_tokens = False
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        bos = self.generation_config.bos_token_id
        return ids if bos is None or ids[:1] == [bos] else [bos] + ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise GenerationError("this model has no tokenizer (tokenizer.json); cannot turn ids into text")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decoder(self) -> Decode | None:
        return None if self.tokenizer is None else self.decode

    def prompt_ids(self, prompt: Prompt) -> tuple[list[list[int]], bool]:
        """Normalise a prompt argument to a list of token-id lists; the flag says "a single prompt"."""
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() not in (1, 2):
                raise GenerationError(f"a tensor prompt must be 1-D or 2-D, got shape {tuple(prompt.shape)}")
            single = prompt.dim() == 1
            rows = [prompt.tolist()] if single else prompt.tolist()
            return rows, single
        if isinstance(prompt, str):
            return [self.encode_text(prompt)], True
        if not isinstance(prompt, Sequence) or len(prompt) == 0:
            raise GenerationError("the prompt is empty; give text, token ids, or a non-empty list of them")
        if all(isinstance(p, str) for p in prompt):
            return [self.encode_text(p) for p in prompt], False
        if all(_is_token(p) for p in prompt):
            return [[int(p) for p in prompt]], True
        if all(isinstance(p, Sequence) and not isinstance(p, str) and all(_is_token(t) for t in p) for p in prompt):
            return [[int(t) for t in p] for p in prompt], False
        raise GenerationError("a prompt must be text, a list of token ids, or a list of either")

    # -- generation -----------------------------------------------------------------------------------------
    def warm_up(self) -> bool:
        """Compile now what a compiled model's first requests would compile (`load(compile=...)`: a few seconds to
        a minute on a CPU), so that they run at the compiled passes' speed: requests of one and of two prompts, by
        diffusion with the checkpoint's sampler (past a commit: a sliding canvas reaches its fused pass) and by AR
        decoding, with short prompts and with prompts past the sliding window (the ring is read in place until it
        wraps, reordered after), short AR requests, and speculative verifications (blocks of 2 tokens and of more).
        Requests of other shapes may still compile a variant of their own. The outputs are thrown away; seeds are fixed, so nothing else's random stream moves. Returns
        whether there was anything to compile (False for the exact passes)."""
        model = self.model
        if all(getattr(model, name) is None for name in ("compiled_ar_step", "compiled_encoder", "compiled_decoder")):
            return False
        text = self.config.text
        window = min(text.sliding_window or 0, text.max_position_embeddings - self.canvas_length - 8)
        short = max(3, min(5, window // 2 - 1))

        def prompts(first: int) -> list[list[int]]:  # two lengths (a batch of them is padded); ids: no tokenizer
            return [[(7 * i + 3) % text.vocab_size for i in range(n)] for n in (first, first + 2)]

        requests = [(pair[:rows], mode, self.canvas_length + 2) for pair in (prompts(short), prompts(window + 2))
                    for rows in (1, 2) for mode in ("diffusion", "ar")]
        for batch, mode, new_tokens in requests + [(prompts(short)[:1], "ar", 3)]:
            self.generate(batch, seed=0, mode=mode, max_new_tokens=new_tokens, eos_token_ids=[])
        if model.compiled_encoder is not None:  # speculative verifications: blocks of 2 tokens, and of more
            first = torch.tensor(prompts(short)[:1], device=model_device(model))
            with torch.no_grad():
                cache = model.new_cache(1, 3 * first.shape[1])
                model.encode(first, cache, logits="last")
                for n in (2, first.shape[1]):
                    _, keep = model.encode_tentatively(first[:, :n], cache)
                    keep(1)
        return True

    def stream(
        self,
        prompt: Prompt,
        *,
        seed: int | Sequence[int] | None = None,
        step_events: bool = True,
        logprobs: int | None = None,
        **overrides,
    ) -> Iterator[Event]:
        """Events for each denoising step, each commit and each finished request (see `run`); with `logprobs`
        (AR mode), each `CommitEvent` carries its tokens' `TokenLogprob`s (see `generate`)."""
        requests, _ = self._requests(prompt, seed, overrides, logprobs)
        return run(self.model, self.canvas_length, requests, self._decoder(), step_events=step_events)

    def generate(
        self,
        prompt: Prompt,
        *,
        seed: int | Sequence[int] | None = None,
        on_event: Callable[[Event], None] | None = None,
        logprobs: int | None = None,
        **overrides,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (returns a result) or a list of prompts (returns a list).

        `seed` seeds each request's own generator (one seed for all, or one per prompt); without a
        seed one is drawn from torch's global generator, so `torch.manual_seed` still makes runs
        repeatable. Other keyword arguments override the checkpoint defaults: mode ("diffusion",
        "ar" or "speculative"), max_new_tokens, max_denoising_steps, entropy_bound, t_min, t_max,
        stability_threshold, confidence_threshold, eos_token_ids, sample_accepted_only, temperature,
        top_k and draft_steps; one the mode does not use is refused (`settings`).

        `logprobs=k` (mode "ar" only; refused in the others) fills `result.logprobs`: per completion token, a
        `TokenLogprob` with its log-probability and the k most likely tokens of its position (0: none), all from
        log_softmax of the model's raw logits, before temperature and top-k (docs/generation.md, "Log-probabilities").
        """
        requests, single = self._requests(prompt, seed, overrides, logprobs)
        results: list[GenerationResult | None] = [None] * len(requests)
        events = run(self.model, self.canvas_length, requests, self._decoder(), step_events=on_event is not None)
        for event in events:
            if on_event is not None:
                on_event(event)
            if isinstance(event, DoneEvent):
                results[event.request] = event.result
        return results[0] if single else list(results)

    def infill(self, prefix, suffix, **kwargs) -> EditResult:
        """Generate the text between `prefix` and `suffix` (printpress.editing.infill)."""
        return editing.infill(self, prefix, suffix, **kwargs)

    def rewrite(self, text: str, start: int, end: int, **kwargs) -> EditResult:
        """Regenerate the characters text[start:end] in place (printpress.editing.rewrite)."""
        return editing.rewrite(self, text, start, end, **kwargs)

    def _requests(self, prompt: Prompt, seed, overrides: dict,
                  logprobs: int | None = None) -> tuple[list[Request], bool]:
        settings = self.settings(**overrides)
        prompts, single = self.prompt_ids(prompt)
        seeds = _seeds(seed, len(prompts))
        requests = [Request(ids, settings, s, logprobs) for ids, s in zip(prompts, seeds)]
        check_logprobs(requests[0])  # before any work (run checks again)
        return requests, single


# What a caller may set per request and find in the settings: every stored setting (the pad id is the checkpoint's).
SETTING_NAMES = {s.name for s in SETTINGS if s.stored}
# Checkpoint defaults of diffusion mode that the canvas step it shares with speculative drafts reads
# (`canvas.denoise_step`): outside diffusion mode they go back to their off value.
DIFFUSION_DEFAULTS = ("window_lead", "sliding")


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seeds(seed: int | Sequence[int] | None, count: int) -> list[int]:
    if seed is None:
        # Drawn from the global generator so that torch.manual_seed makes unseeded calls repeatable.
        return [int(torch.randint(0, 2**62, (1,)))] * count
    seeds = [seed] * count if _is_token(seed) else list(seed)
    if len(seeds) != count:
        raise GenerationError(f"got {len(seeds)} seeds for {count} prompts")
    for s in seeds:
        if not _is_token(s) or not 0 <= s < 2**64:
            raise GenerationError(f"a seed must be an integer in [0, 2**64), got {s!r}")
    return seeds
