"""bench/sliding_canvas.py: the sliding state is a canvas opening at the target after the encoded text before it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers import bench_module
from test_objectives import tiny_model

sliding = bench_module("sliding_canvas")


@torch.no_grad()
def test_the_sliding_score_is_a_fresh_canvas_after_the_encoded_text_and_the_encoder_scores_the_same_tokens():
    model, block, vocab = tiny_model().eval(), 4, 50
    tokens = torch.randint(0, vocab, (2, 4 * block), generator=torch.Generator().manual_seed(3))
    result = sliding.sliding_and_aligned_ce(model, [tokens], block, vocab, torch.Generator().manual_seed(9))

    gen = torch.Generator().manual_seed(9)  # the same draws: the aligned noise, then one canvas set per k
    torch.randint(0, vocab, tokens.shape, generator=gen)
    plain, encoder = 0.0, 0.0
    ar = model.encode(tokens, model.new_cache(2, 64))
    for k in range(block):
        slid = torch.randint(0, vocab, (2, 3 * block), generator=gen)
        logits, truth = [], []
        for c in (1, 2):  # the target opens canvas c of the window slid k tokens: c canvases of text encoded
            target = k + c * block
            cache = model.new_cache(2, 64)
            model.encode(tokens[:, k:target], cache, logits="none")
            logits.append(model.denoise(slid[:, c * block : (c + 1) * block], cache)[:, 0])
            truth.append(tokens[:, target])
            encoder_logits = ar[:, target - 1]
            encoder += F.cross_entropy(encoder_logits, tokens[:, target]).item() / 2
        plain += F.cross_entropy(torch.stack(logits, 2), torch.stack(truth, 1)).item()
    assert abs(result["sliding"] - plain / block) < 1e-4
    assert abs(result["encoder"] - encoder / block) < 1e-4
    assert result["sliding"] != result["aligned"]  # the same tokens, a different state
