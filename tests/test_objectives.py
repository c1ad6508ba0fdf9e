"""Training objectives: the one-forward block-diffusion pass equals inference block by block."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from printpress.config import TextConfig
from printpress.model import DiffusionGemma
from printpress.train.objectives import (
    DiffusionSettings,
    TrainStep,
    add_uniform_noise,
    denoising_loss,
    evaluate_losses,
    forward_ar,
    forward_block_diffusion,
)


def tiny_model(sliding_window: int = 3, seed: int = 0) -> DiffusionGemma:
    torch.manual_seed(seed)
    config = TextConfig(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                        num_global_key_value_heads=1, sliding_window=sliding_window,
                        layer_types=["sliding_attention", "full_attention", "full_attention"],
                        num_experts=4, top_k_experts=2, moe_intermediate_size=8, max_position_embeddings=128,
                        initializer_range=0.2)
    model = DiffusionGemma(config)
    with torch.no_grad():  # distinct scalars per mode, so mixing them up fails the test
        for layer in model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
            layer.encoder_layer_scalar.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("sliding_window", [3, 6, 40])
@torch.no_grad()
def test_training_forward_equals_encode_then_denoise_for_every_block(sliding_window):
    model = tiny_model(sliding_window)
    block, blocks = 4, 3
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 50, (2, block * blocks), generator=g)
    noisy = torch.randint(0, 50, (2, block * blocks), generator=g)
    self_cond = torch.randn(2, block * blocks, 50, generator=g)
    use = torch.tensor([True, False])
    ar_logits, diffusion_logits = forward_block_diffusion(model, clean, noisy, block, self_cond, use)

    full = model.new_cache(2, 64)
    assert (ar_logits - model.encode(clean, full)).abs().max() < 1e-4
    for b in range(blocks):
        cache = model.new_cache(2, 64)
        if b:
            model.encode(clean[:, : b * block], cache, logits="none")
        span = slice(b * block, (b + 1) * block)
        with_sc = model.denoise(noisy[:1, span], cache.rows([0]), self_cond[:1, span])
        without_sc = model.denoise(noisy[1:, span], cache.rows([1]))
        assert (diffusion_logits[:1, span] - with_sc).abs().max() < 1e-4
        assert (diffusion_logits[1:, span] - without_sc).abs().max() < 1e-4


@torch.no_grad()
def test_clean_half_never_sees_the_noisy_half():
    model = tiny_model()
    clean = torch.randint(0, 50, (1, 8))
    a, _ = forward_block_diffusion(model, clean, torch.randint(0, 50, (1, 8)), 4)
    b, _ = forward_block_diffusion(model, clean, torch.randint(0, 50, (1, 8)), 4)
    # Equal up to float rounding: the expert GEMMs see batches of different sizes.
    assert (a - b).abs().max() < 1e-5
    assert (a - forward_ar(model, clean)).abs().max() < 1e-4


def test_noise_limits():
    tokens = torch.randint(0, 1000, (4, 4096))
    g = torch.Generator().manual_seed(0)
    unchanged, _ = add_uniform_noise(tokens, 16, 1000, g, t=torch.zeros(4, 256))
    assert torch.equal(unchanged, tokens)
    full, _ = add_uniform_noise(tokens, 16, 1000, g, t=torch.ones(4, 256))
    # At t = 1 every token is a fresh uniform draw: it keeps its value only by chance (1 in 1000).
    assert (full == tokens).float().mean() < 0.003
    assert full.unique().numel() > 990
    half, t = add_uniform_noise(tokens, 16, 1000, g, t=torch.full((4, 256), 0.5))
    assert abs((half != tokens).float().mean().item() - 0.5 * 999 / 1000) < 0.01


def test_noise_level_is_shared_within_a_block():
    g = torch.Generator().manual_seed(3)
    tokens = torch.zeros(2, 64, dtype=torch.long)
    _, t = add_uniform_noise(tokens, 8, 10_000, g, t_low=0.2)
    assert t.shape == (2, 8) and (t >= 0.2).all() and (t <= 1).all()


def test_inverse_t_weighting_is_a_weighted_mean_over_blocks():
    logits = torch.zeros(1, 4, 2)
    logits[0, 2:, 1] = math.log(3)  # block 1 predicts token 1 with p = 3/4
    clean = torch.zeros(1, 4, dtype=torch.long)
    t = torch.tensor([[0.5, 0.25]])
    uniform = denoising_loss(logits, clean, t, DiffusionSettings(block=2))
    inverse = denoising_loss(logits, clean, t, DiffusionSettings(block=2, weighting="inverse_t", t_low=0.1))
    block0, block1 = math.log(2), math.log(4)
    assert uniform.item() == pytest.approx((block0 + block1) / 2)
    normaliser = math.log(10) / 0.9  # E[1/t] for t ~ U(0.1, 1)
    assert inverse.item() == pytest.approx((2 * block0 + 4 * block1) / 2 / normaliser)


def test_joint_loss_is_diffusion_plus_weighted_ar():
    model = tiny_model().train()
    step = TrainStep(model, "joint", DiffusionSettings(block=4, ar_weight=0.5))
    out = step(torch.randint(0, 50, (2, 8)), generator=torch.Generator().manual_seed(0))
    assert out["loss"].item() == pytest.approx(out["diffusion"].item() + 0.5 * out["ar"].item(), rel=1e-6)
    out["loss"].backward()
    assert model.embed_tokens.weight.grad is not None
    assert model.self_conditioning.gate_proj.weight.grad.abs().sum() > 0


def test_ar_objective_is_next_token_cross_entropy():
    model = tiny_model()
    tokens = torch.randint(3, 50, (2, 8))
    out = TrainStep(model, "ar", DiffusionSettings(block=4))(tokens)
    logits = forward_ar(model, tokens)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), tokens[:, 1:].reshape(-1))
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("shaped", [dict(draft_fraction=1.0), dict(left_to_right=1.0)])
def test_held_out_losses_ignore_rows_shaped_for_training_only(shaped):
    # draft rows and left-to-right rows shape training's noise; held-out losses stay comparable across runs
    tokens = torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(0))
    seen = []

    def step(window, noise):  # records the noise evaluation hands to the training step
        seen.append(noise[0])
        return {"diffusion": torch.tensor(0.0)}

    windows = [tokens[:4], tokens[4:8]]
    plain = DiffusionSettings(block=8)
    evaluate_losses(step, windows, "diffusion", plain, 1000)
    evaluate_losses(step, windows, "diffusion", dataclasses.replace(plain, **shaped), 1000)
    assert torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3])
