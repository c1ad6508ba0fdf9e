"""Rolling rows (`train.rolling`): canvases noised more towards their end, the sliding sampler's canvas; and the
checks the row shapes share (left-to-right rows' own draws: tests/test_left_to_right.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from printpress.objectives import DiffusionSettings, rolling_noise, row_noise
from printpress.train.loop import Trainer, TrainingError

from helpers import run_config

BLOCK, VOCAB = 8, 1000
WIDE = 1_000_000  # noise drawn from this many ids equals a clean token (< VOCAB) about never


def test_each_position_is_noised_at_its_level_on_the_ramp():
    tokens = torch.randint(0, VOCAB, (2000, 4 * BLOCK), generator=torch.Generator().manual_seed(0))
    noisy, t = rolling_noise(tokens, BLOCK, WIDE, torch.Generator().manual_seed(1))
    noised = (noisy != tokens).view(2000, 4, BLOCK).float()
    assert noised[..., -1].all()  # the last position of every canvas is noise
    # t0 ~ U(0, 1): position i is noised with probability E[t0 + (1 - t0)(i + 1) / B] = (1 + (i + 1) / B) / 2
    expected = (1 + (torch.arange(BLOCK) + 1) / BLOCK) / 2
    assert torch.allclose(noised.mean((0, 1)), expected, atol=0.02)
    # t is each canvas's mean level: t0 + (1 - t0)(B + 1) / (2B), so t0 can be recovered, and it lies in [0, 1)
    t0 = (t - (BLOCK + 1) / (2 * BLOCK)) / (1 - (BLOCK + 1) / (2 * BLOCK))
    assert (t0 >= 0).all() and (t0 < 1).all() and abs(float(t0.mean()) - 0.5) < 0.02
    # the noised share of each canvas follows its level: on average B * t positions
    assert abs(float(noised.sum(-1).mean() - (BLOCK * t).mean())) < 0.05


def test_rolling_rows_replace_a_share_of_the_other_rows_and_leave_those_rows_noise_unchanged():
    tokens = torch.randint(0, VOCAB, (64, 32), generator=torch.Generator().manual_seed(0))
    plain = DiffusionSettings(block=BLOCK, self_conditioning=0.5, draft_fraction=0.25, sampler_states=0.5,
                              left_to_right=0.25)
    mixed = dataclasses.replace(plain, rolling=0.5)
    base = row_noise(tokens, 100, 3, 7, plain, WIDE, sampler_states=True)
    noisy, t, use, keep, uniform = row_noise(tokens, 100, 3, 7, mixed, WIDE, sampler_states=True)
    draft = (base[1] == 1).all(dim=1) & ~base[2]  # draft rows: t = 1 everywhere, no self-conditioning
    changed = ~(noisy == base[0]).all(dim=1)
    assert 8 <= int(changed.sum()) <= 30 and not (changed & draft).any()
    for before, after in zip(base, (noisy, t, use, keep, uniform)):
        assert torch.equal(before[~changed], after[~changed])  # the other rows are drawn exactly as without
    assert torch.equal(use, base[2]) and torch.equal(keep, base[3])  # still sampler-state rows, as drawn
    last = (noisy[changed] != tokens[changed]).view(-1, 4, BLOCK)[..., -1]
    assert last.all()  # a rolling canvas ends in noise
    assert (t[changed] > (BLOCK + 1) / (2 * BLOCK) - 1e-6).all()  # the mean level of a ramp that ends at 1


@pytest.mark.parametrize("change, message", [
    (dict(left_to_right=1.5), r"left_to_right must be in \[0, 1\] \(got 1.5\)"),
    (dict(left_to_right=0.5, objective="ar"), "left_to_right needs a diffusion or joint objective"),
    (dict(rolling=-0.1), r"rolling must be in \[0, 1\] \(got -0.1\)"),
    (dict(rolling=0.5, objective="ar"), "rolling needs a diffusion or joint objective"),
])
def test_bad_row_shape_shares_are_refused_by_name(corpus, tmp_path, change, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(run_config(corpus, **change), tmp_path)


@pytest.mark.parametrize("shape", ["left_to_right", "rolling"])
def test_a_run_with_shaped_rows_trains(corpus, tmp_path, shape):
    trainer = Trainer(run_config(corpus, sampler_states=0.5, steps=2, **{shape: 0.5}), tmp_path)
    first = trainer.train_step()
    assert first["diffusion"] > 0 and "ar" in first
