"""Left-to-right rows (`train.left_to_right`): canvases clean before a random position and noise from it on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from printpress.objectives import DiffusionSettings, left_to_right_noise, row_noise

BLOCK, VOCAB = 8, 1000
WIDE = 1_000_000  # noise drawn from this many ids equals a clean token (< VOCAB) about never


@pytest.fixture
def tokens():
    return torch.randint(0, VOCAB, (64, 32), generator=torch.Generator().manual_seed(0))


def noised_suffix_starts(clean: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """Per canvas (B, L // BLOCK), the first position from which every token differs from the clean one, after
    checking that no token before it does."""
    differs = (noisy != clean).view(clean.shape[0], -1, BLOCK)
    starts = BLOCK - differs.flip(-1).cumprod(-1).sum(-1)  # length of the trailing run of noised tokens
    before = torch.arange(BLOCK) < starts[..., None]
    assert not differs[before].any(), "a token before the noised suffix was noised"
    return starts


def test_each_canvas_is_clean_then_noise_from_a_uniform_position(tokens):
    noisy, t = left_to_right_noise(tokens, BLOCK, WIDE, torch.Generator().manual_seed(1))
    starts = noised_suffix_starts(tokens, noisy)
    assert torch.equal(t, (BLOCK - starts).float() / BLOCK)
    assert set(starts.flatten().tolist()) == set(range(BLOCK))  # every start, the whole canvas noised (0) included


def test_left_to_right_rows_replace_a_share_of_rows_and_leave_the_others_noise_unchanged(tokens):
    plain = DiffusionSettings(block=BLOCK, self_conditioning=0.5, draft_fraction=0.25, sampler_states=0.5)
    mixed = dataclasses.replace(plain, left_to_right=0.5)
    base = row_noise(tokens, 100, 3, 7, plain, WIDE, sampler_states=True)
    noisy, t, use, keep, uniform = row_noise(tokens, 100, 3, 7, mixed, WIDE, sampler_states=True)
    draft = (base[1] == 1).all(dim=1) & ~base[2]  # draft rows: t = 1 everywhere, no self-conditioning
    changed = ~(noisy == base[0]).all(dim=1)
    assert 12 <= int(changed.sum()) <= 36 and not (changed & draft).any()  # about half the 48 non-draft rows
    for before, after in zip(base, (noisy, t, use, keep, uniform)):
        assert torch.equal(before[~changed], after[~changed])  # the other rows are drawn exactly as without
    starts = noised_suffix_starts(tokens[changed], noisy[changed])
    assert torch.equal(t[changed], (BLOCK - starts).float() / BLOCK)
    assert (keep[changed] == 0).all() and torch.equal(use, base[2])  # not sampler states; self-conditioning as drawn
