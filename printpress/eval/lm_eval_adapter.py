"""printpress models in EleutherAI's lm-evaluation-harness (lm-eval 0.4.x), as model type "printpress".

lm-eval 0.4 finds model types only in its own registry, filled from its own package; it has no entry-point
hook for other packages. So the class registers itself when this module is imported, and this module is
also a drop-in for the `lm_eval` command that imports it first:

    python -m printpress.eval.lm_eval_adapter --model printpress --model_args pretrained=models/shakespeare-joint \\
        --tasks NAME [--include_path DIR] [any other lm_eval option]

From Python, `import printpress.eval.lm_eval_adapter` and then `lm_eval.simple_evaluate(model="printpress",
model_args="pretrained=...")`, or pass `PrintpressLM(...)` itself as the model.

What each request type does:

- generate_until: the engine (`Pipeline.stream`, diffusion or AR as `mode` says) continues the context for up
  to `max_gen_toks` tokens; generation stops as soon as every `until` string has appeared (or at EOS) and the
  text is cut before the first one. Diffusion writes whole canvases, so it may write past a stop string.
- loglikelihood / loglikelihood_rolling, `likelihood="ar"`: exact. The encoder (causal, the model's AR head)
  reads context + continuation; the answer is the sum of the continuation tokens' log-softmax, and is_greedy
  says whether each was the argmax.
- `likelihood="diffusion"`: a Monte Carlo estimate, the quantity the diffusion objective trains
  (printpress/objectives.py): the continuation is cut into canvases placed after the context as
  generation places them; each canvas is corrupted with uniform-state noise at a level t ~ U(t_low, 1)
  (stratified over the `mc_samples` draws), denoised in one decoder pass over the clean context in the cache,
  and scored by the log-probability of every clean continuation token (canvas positions past the
  continuation hold pure noise). The estimate is the mean over draws of the summed log-probabilities. It is
  the negative of the held-out "diffusion loss" printpress reports, summed over tokens — a proxy for
  log-likelihood that ranks answers, not a proven bound on it (for uniform-state noise the exact ELBO has
  more terms). is_greedy: each token is the argmax of the draws' mean log-probabilities.
- `likelihood="auto"` (default): "ar" when the checkpoint's card.json says it was trained with an AR term
  (objective "ar" or "joint"), else "diffusion".
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import lm_eval.models  # noqa: F401  (fills the registry with lm-eval's own models before ours joins it)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # pragma: no cover - exercised only without the eval extra
    raise ImportError("the lm-eval adapter needs lm-eval 0.4: pip install 'printpress[eval]'") from exc
from tqdm.auto import tqdm

from printpress.errors import PrintpressError
from printpress.objectives import add_uniform_noise

logger = logging.getLogger(__name__)

LIKELIHOODS = ("auto", "ar", "diffusion")


class PrintpressLM(TemplateLM):
    """A printpress checkpoint as an lm-eval model. See the module docstring for what each request does."""

    def __init__(
        self,
        pretrained: str | None = None,
        pipeline=None,
        dtype: str = "float32",
        device: str | None = "cpu",
        likelihood: str = "auto",
        mc_samples: int = 16,
        t_low: float = 0.0,
        seed: int = 0,
        max_gen_toks: int = 256,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **sampler,
    ) -> None:
        super().__init__()
        from printpress.pipeline import Pipeline, default_model_path

        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm_eval's command line asks for cuda:0 unless told otherwise; its HF models fall back the same way.
            if device is not None:
                logger.warning("device %s is not available; using the CPU (pass --device cpu to silence this)", device)
            device = "cpu"
        if pipeline is None:
            pretrained = str(default_model_path()) if pretrained is None else str(pretrained)
            pipeline = Pipeline.from_pretrained(pretrained, dtype=dtype, device=device)
        if pipeline.tokenizer is None:
            raise PrintpressError("lm-eval works on text: this model has no tokenizer (tokenizer.json)")
        if likelihood not in LIKELIHOODS:
            raise PrintpressError(f"likelihood must be one of {', '.join(LIKELIHOODS)}, got {likelihood!r}")
        if int(mc_samples) < 1:
            raise PrintpressError(f"mc_samples must be at least 1, got {mc_samples}")
        if not 0.0 <= float(t_low) < 1.0:
            raise PrintpressError(f"t_low must be in [0, 1), got {t_low}")
        self.pipe = pipeline
        self.model = pipeline.model
        self.pretrained = pretrained
        self.likelihood = _objective_likelihood(pretrained) if likelihood == "auto" else likelihood
        self.mc_samples = int(mc_samples)
        self.t_low = float(t_low)
        self.seed = int(seed)
        self.max_gen_toks = int(max_gen_toks)
        self.sampler = dict(sampler)
        pipeline.settings(**self.sampler)  # unknown or bad sampler settings fail here, with the engine's message
        logger.info("printpress lm-eval model %s: likelihood=%s", pretrained, self.likelihood)

    # -- what lm-eval asks of a TemplateLM ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.pipe.default_settings().eos_token_ids
        return eos[0] if eos else self.pipe.config.text.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # An empty context is the start of a document: BOS, as Pipeline.encode_text begins every prompt.
        bos = self.pipe.generation_config.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.pipe.config.text.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return str(self.pretrained)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids; with BOS in front unless add_special_tokens is False (as the engine encodes prompts)."""
        self.pipe.tokenizer.encode_special_tokens = False
        ids = list(self.pipe.tokenizer.encode(string, add_special_tokens=False).ids)
        if add_special_tokens is False or (ids[:1] == [self.prefix_token_id]):
            return ids
        return [self.prefix_token_id] + ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.pipe.tokenizer.decode(ids, skip_special_tokens=True)

    def get_model_info(self) -> dict:
        return {"model_name": str(self.pretrained), "likelihood": self.likelihood,
                "mc_samples": self.mc_samples if self.likelihood == "diffusion" else None}

    # -- likelihoods ----------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for key, context, continuation in tqdm(requests, desc="printpress: loglikelihood", disable=disable_tqdm):
            result = self.score(context, continuation)
            out.append(result)
            self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(log-likelihood of `continuation` after `context`, is it the greedy choice) by the chosen method."""
        if not continuation:
            return 0.0, True
        if not context:
            context = [self.prefix_token_id]
        if self.likelihood == "ar":
            return ar_loglikelihood(self.model, context, continuation, self.max_length)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.seed)  # per request, so a request's estimate does not depend on its neighbours
        return diffusion_loglikelihood(self.model, context, continuation, self.pipe.canvas_length,
                                       self.mc_samples, generator, self.t_low, self.max_length)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, in windows of the model's length that each predict new tokens."""
        out = []
        for request in tqdm(requests, desc="printpress: loglikelihood_rolling", disable=disable_tqdm):
            (text,) = request.args
            tokens = self.tok_encode(text, add_special_tokens=False)
            # A diffusion window also needs room for its last canvas's padding and at least one context token.
            span = self.max_length if self.likelihood == "ar" else self.max_length - self.pipe.canvas_length
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=span, context_len=1)]
            total = sum(self.score(context, continuation)[0] for context, continuation in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    # -- generation -----------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in tqdm(requests, desc="printpress: generate_until", disable=disable_tqdm):
            context, gen_kwargs = request.args
            text = self.generate(context, dict(gen_kwargs or {}))
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out

    def generate(self, context: str, gen_kwargs: dict) -> str:
        """The engine's continuation of `context`, cut before the first `until` string."""
        from printpress.events import CommitEvent, DoneEvent
        from printpress.request import new_token_budget

        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        settings = dict(self.sampler)
        settings["max_new_tokens"] = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        mode = self.pipe.settings(**settings).mode
        if mode == "ar" and gen_kwargs.get("do_sample") and gen_kwargs.get("temperature"):
            settings["temperature"] = float(gen_kwargs["temperature"])
        elif mode == "ar" and "temperature" not in self.sampler:
            settings["temperature"] = 0.0  # lm-eval's generate_until is greedy unless the task samples
        ids = self.tok_encode(context)
        budget = new_token_budget(self.pipe.settings(**settings), self.pipe.canvas_length)
        room = self.max_length - budget - 1
        if len(ids) > room:
            ids = ids[-room:]  # keep the end of an over-long context, as lm-eval's HF models do
        text = ""
        for event in self.pipe.stream(ids, seed=self.seed, step_events=False, **settings):
            if isinstance(event, CommitEvent):
                text += event.text
                if until and any(u in text for u in until):
                    break
            elif isinstance(event, DoneEvent):
                break
        cut = min((i for i in (text.find(u) for u in until if u) if i != -1), default=len(text))
        return text[:cut]


if __name__ != "__main__":  # run as a script, the module registers under its real name below instead
    register_model("printpress")(PrintpressLM)


# --------------------------------------------------------------------------------------------
# The two likelihoods, as plain functions of a model (tests compare them with the training path)
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def ar_loglikelihood(model, context: list[int], continuation: list[int], max_length: int) -> tuple[float, bool]:
    """Exact log P(continuation | context) from the encoder's next-token logits, and whether it is greedy."""
    ids = (context + continuation)[-(max_length + 1):]  # over-long contexts lose their beginning
    if len(ids) <= len(continuation):
        raise PrintpressError(f"a continuation of {len(continuation)} tokens does not fit the model's "
                              f"{max_length} positions with any context")
    inputs = torch.tensor([ids[:-1]], device=model.embed_tokens.weight.device)
    cache = model.new_cache(1, inputs.shape[1])
    logits = model.encode(inputs, cache, logits="all")[0, -len(continuation):]
    logp = F.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(continuation, device=logp.device)
    total = logp.gather(-1, target[:, None]).sum().item()
    return total, bool((logp.argmax(-1) == target).all())


def diffusion_draws(
    continuation: list[int], canvas_length: int, samples: int, vocab_size: int, generator: torch.Generator,
    t_low: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, noisy) canvases of the continuation, `samples` rows, padded to whole canvases.

    Noise levels are stratified: row j of canvas b has t = t_low + (1 - t_low)(j + u)/samples, u ~ U(0, 1).
    Positions past the continuation are pure noise in both (nothing is known about what follows).
    """
    device = generator.device
    blocks = math.ceil(len(continuation) / canvas_length)
    width = blocks * canvas_length
    strata = torch.arange(samples, device=device, dtype=torch.float32)[:, None]
    t = t_low + (1 - t_low) * (strata + torch.rand(samples, blocks, generator=generator, device=device)) / samples
    tail = torch.randint(0, vocab_size, (samples, width - len(continuation)), generator=generator, device=device)
    clean = torch.cat([torch.tensor(continuation, device=device).repeat(samples, 1), tail], dim=1)
    noisy, _ = add_uniform_noise(clean, canvas_length, vocab_size, generator, t=t)
    noisy[:, len(continuation):] = clean[:, len(continuation):]
    return clean, noisy


@torch.no_grad()
def diffusion_loglikelihood(
    model, context: list[int], continuation: list[int], canvas_length: int, samples: int,
    generator: torch.Generator, t_low: float = 0.0, max_length: int | None = None,
) -> tuple[float, bool]:
    """Monte Carlo estimate of the continuation's log-likelihood under the denoiser (see the module docstring)."""
    device = model.embed_tokens.weight.device
    clean, noisy = diffusion_draws(continuation, canvas_length, samples, model.config.vocab_size, generator, t_low)
    width = clean.shape[1]
    if max_length is not None:
        room = max_length - width
        if room < 1:
            raise PrintpressError(f"a continuation of {len(continuation)} tokens does not fit the model's "
                                  f"{max_length} positions with any context")
        context = context[-room:]
    cache = model.new_cache(samples, len(context) + width)
    model.encode(torch.tensor([context], device=device).repeat(samples, 1), cache, logits="none")
    total = torch.zeros(samples, device=device)
    mean_logp = []
    n = len(continuation)
    for start in range(0, width, canvas_length):
        scored = min(canvas_length, n - start)
        logits = model.denoise(noisy[:, start : start + canvas_length], cache)[:, :scored]
        logp = F.log_softmax(logits.float(), dim=-1)
        target = clean[:, start : start + scored]
        total += logp.gather(-1, target[..., None])[..., 0].sum(-1)
        mean_logp.append(logp.mean(0))
        if start + canvas_length < width:
            model.encode(clean[:, start : start + canvas_length], cache, logits="none")
    greedy = torch.cat(mean_logp).argmax(-1) == torch.tensor(continuation, device=device)
    return total.mean().item(), bool(greedy.all())


def _objective_likelihood(pretrained: str | None) -> str:
    """"ar" when the checkpoint's card.json records an AR term in training, else "diffusion"."""
    card = Path(str(pretrained)) / "card.json" if pretrained else None
    if card is None or not card.is_file():
        return "diffusion"
    try:
        objective = json.loads(card.read_text()).get("objective")
    except (json.JSONDecodeError, OSError, AttributeError):
        return "diffusion"
    return "ar" if objective in ("ar", "joint") else "diffusion"


def main() -> None:
    """`lm_eval`'s own command line, with the printpress model type registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    import importlib

    # The importable module registers "printpress" (this __main__ copy does not, to avoid a second class).
    importlib.import_module("printpress.eval.lm_eval_adapter").main()
