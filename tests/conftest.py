"""Shared fixtures: tiny random DiffusionGemma checkpoints written by the reference (transformers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tiny models run fastest on one thread, and a second OpenMP thread on a busy 2-core machine can make each
# small GEMM wait for a descheduled peer (seen: 300x slower). Tests that need threads set them themselves;
# subprocesses inherit the variable.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8)

# Tiny text configs that differ in every axis the architecture has: expert count and top-k, head layouts
# (GQA, MHA, K=V heads on full layers), layer patterns and sliding windows.
TINY_CONFIGS: dict[str, dict] = {
    "gqa": dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                num_experts=4, top_k_experts=2, moe_intermediate_size=16, max_position_embeddings=512),
    "mha": dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
                     sliding_window=4, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                    "full_attention"],
                     num_experts=8, top_k_experts=1, moe_intermediate_size=8,
                     max_position_embeddings=512),
    "default_pattern": dict(vocab_size=160, hidden_size=32, intermediate_size=32, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                            sliding_window=5, num_experts=3, top_k_experts=3, moe_intermediate_size=12,
                            max_position_embeddings=512),
    # Twelve layers: transformers writes per-layer overrides under zero-padded keys ("05", "11").
    "twelve_layers": dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=12,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                          num_global_key_value_heads=1, sliding_window=4, num_experts=2, top_k_experts=1,
                          moe_intermediate_size=8, max_position_embeddings=512),
}


def make_reference(name: str | dict, canvas_length: int = 8, seed: int = 0):
    """A randomly initialised reference model (with non-trivial norms and scales, so they are tested), from a
    name of TINY_CONFIGS or a text-config dict."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    text = dict(TINY_CONFIGS[name] if isinstance(name, str) else name)
    config = DiffusionGemmaConfig(text_config=text, vision_config=dict(VISION),
                                  canvas_length=canvas_length)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if param.dim() == 1 or key.endswith(("scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)  # ones would hide a norm or scale applied in the wrong place
        for key, buffer in model.named_buffers():
            if key.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def reference_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each tiny config saved by transformers' save_pretrained."""
    root = tmp_path_factory.mktemp("reference")
    folders = {}
    for name in TINY_CONFIGS:
        folder = root / name
        make_reference(name).save_pretrained(folder)
        folders[name] = folder
    return folders
