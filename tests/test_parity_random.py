"""Randomized parity: configurations drawn from a seeded generator, checked bit for bit against transformers.

The fixed tiny configs of conftest cover each axis once; this draws combinations — windows shorter than the
prompt and than the canvas, canvases longer than the window, GQA ratios, K=V full layers, layer patterns,
expert counts and top-k, vocabulary sizes — and prompts long enough to wrap the sliding ring several times.
A handful run in every `make test`; `-m slow` runs a larger sweep.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import printpress

from helpers import make_reference

pytestmark = pytest.mark.parity


def draw_config(seed: int) -> tuple[dict, int]:
    """(text config, canvas length) for `seed`."""
    rng = random.Random(seed)
    layers = rng.randint(1, 4)
    heads = rng.choice([1, 2, 4])
    experts = rng.randint(1, 6)
    text = dict(
        vocab_size=rng.randint(24, 200), hidden_size=rng.choice([16, 32]), intermediate_size=4 * rng.randint(2, 12),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]),
        num_global_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]),
        head_dim=rng.choice([8, 16]), global_head_dim=rng.choice([8, 16, 32]),
        sliding_window=rng.randint(2, 10),
        # The reference makes the last layer full attention, whatever the config says.
        layer_types=[rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers - 1)] + ["full_attention"],
        # Multiples of 4 floats: the reference's grouped expert matmul needs 16-byte strides.
        num_experts=experts, top_k_experts=rng.randint(1, experts), moe_intermediate_size=4 * rng.randint(1, 4),
        max_position_embeddings=512,
    )
    return text, rng.randint(2, 12)


def check_config(seed: int, tmp_path: Path) -> None:
    text, canvas = draw_config(seed)
    ref = make_reference(text, canvas_length=canvas, seed=seed)
    ref.save_pretrained(tmp_path / "ref")
    pipe = printpress.load(tmp_path / "ref")
    ours = pipe.model
    rng = torch.Generator().manual_seed(seed)
    window = text["sliding_window"]
    for length in sorted({1, window - 1 or 1, window, window + 1, 3 * window + canvas + 1}):
        ids = torch.randint(0, text["vocab_size"], (1, length), generator=rng)
        canvas_ids = torch.randint(0, text["vocab_size"], (1, canvas), generator=rng)
        with torch.no_grad():
            expected = ref(input_ids=ids, decoder_input_ids=canvas_ids).logits
            cache = ours.new_cache(1, length + canvas)
            ours.encode(ids, cache, logits="none")
            got = ours.denoise(canvas_ids, cache)
        assert torch.equal(got, expected), (seed, text, canvas, length, float((got - expected).abs().max()))
    # Tokens: three canvases after a prompt longer than the window, so commits wrap the ring.
    prompt = torch.randint(0, text["vocab_size"], (1, window + 3), generator=rng)
    settings = dict(max_new_tokens=3 * canvas, max_denoising_steps=3)
    torch.manual_seed(seed)
    reference = ref.generate(prompt, **settings).sequences[0, prompt.shape[1]:].tolist()
    result = pipe.generate(prompt[0].tolist(), seed=seed, **settings)
    assert result.token_ids == reference, (seed, text, canvas)


@pytest.mark.parametrize("seed", range(6))
def test_drawn_configs_match_the_reference_bit_for_bit(seed, tmp_path):
    check_config(seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6, 60))
def test_drawn_configs_match_the_reference_bit_for_bit_sweep(seed, tmp_path):
    check_config(seed, tmp_path)
