"""Judge likelihood: NLL per character of a continuation under a model's AR head."""

from __future__ import annotations

import math

import pytest
import torch

from printpress.config import GenerationConfig, ModelConfig, TextConfig
from printpress.engine import Pipeline
from printpress.eval.judge import nll_per_char
from printpress.model import DiffusionGemma
from printpress.tokenizer import train_tokenizer
from printpress.train.objectives import forward_ar


@pytest.fixture(scope="module")
def judge():
    tokenizer = train_tokenizer(["the cat sat on the mat, and the dog sat on the log. " * 20], 300)
    text = TextConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                      sliding_window=8, layer_types=["sliding_attention", "full_attention"], num_experts=2,
                      top_k_experts=1, moe_intermediate_size=8, initializer_range=0.3)
    torch.manual_seed(0)
    config = ModelConfig(text, canvas_length=8)
    return Pipeline(DiffusionGemma(text).eval(), config, GenerationConfig.from_dict({}, text), tokenizer)


def test_nll_per_char_is_the_continuation_tokens_nll_over_its_length(judge):
    prompt, completion = "the cat", " sat on the log"
    prompt_ids = [2] + judge.tokenizer.encode(prompt, add_special_tokens=False).ids
    ids = prompt_ids + judge.tokenizer.encode(completion, add_special_tokens=False).ids
    with torch.no_grad():
        logp = torch.log_softmax(forward_ar(judge.model, torch.tensor([ids]))[0], dim=-1)  # the training path
    expected = -sum(logp[i - 1, ids[i]].item() for i in range(len(prompt_ids), len(ids))) / len(completion)
    assert nll_per_char(judge, prompt, completion) == pytest.approx(expected, rel=1e-5)


def test_empty_completion_has_no_score(judge):
    assert math.isnan(nll_per_char(judge, "the cat", ""))
