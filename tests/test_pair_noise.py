"""bench/pair_noise.py's left-to-right row: the decoder scored where a sampler committing from the left stands, and
the encoder on the same tokens, each checked against the model's own generation passes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers import bench_module
from test_objectives import tiny_model

pair_noise = bench_module("pair_noise")


@torch.no_grad()
def test_left_to_right_scores_match_encode_and_denoise_on_the_same_states():
    model, block, vocab = tiny_model().eval(), 4, 50
    windows = [torch.randint(0, vocab, (2, 3 * block), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    result = pair_noise.left_to_right_ce(model, windows, block, vocab, torch.Generator().manual_seed(5))

    gen = torch.Generator().manual_seed(5)  # the same noise draws, one per window
    noises = [torch.randint(0, vocab, w.shape, generator=gen) for w in windows]
    k = 2
    decoder, encoder = 0.0, 0.0
    for tokens, noise in zip(windows, noises):
        logits, ar = [], model.encode(tokens, model.new_cache(2, 64))  # ar[:, i] predicts token i + 1
        for b in range(3):
            cache = model.new_cache(2, 64)
            if b:
                model.encode(tokens[:, : b * block], cache, logits="none")
            canvas = tokens[:, b * block : (b + 1) * block].clone()
            canvas[:, k:] = noise[:, b * block + k : (b + 1) * block]  # clean before k, noise from k
            logits.append(model.denoise(canvas, cache)[:, k])
        positions = torch.tensor([b * block + k for b in range(3)])
        decoder += F.cross_entropy(torch.stack(logits, 1).transpose(1, 2), tokens[:, positions]).item() / 2
        encoder += F.cross_entropy(ar[:, positions - 1].transpose(1, 2), tokens[:, positions]).item() / 2
    assert abs(result["by_position"]["decoder"][k] - decoder) < 1e-4
    assert abs(result["by_position"]["encoder"][k] - encoder) < 1e-4
    assert abs(result["decoder"] - sum(result["by_position"]["decoder"]) / block) < 1e-6
    # Self-conditioned on a first pass over the same canvas: a different score, same tokens.
    assert result["by_position"]["decoder_self_conditioned"][k] != result["by_position"]["decoder"][k]
