"""Draft rows (`train.draft_fraction`): training canvases shaped like a speculative draft's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from printpress.objectives import DiffusionSettings, draft_noise, row_noise
from printpress.train.loop import Trainer, TrainingError

from helpers import run_config

BLOCK, VOCAB = 8, 1000


@pytest.fixture
def tokens():
    return torch.randint(0, VOCAB, (64, 32), generator=torch.Generator().manual_seed(0))


def test_a_draft_canvas_keeps_its_first_token_and_noises_every_other(tokens):
    noisy = draft_noise(tokens, BLOCK, VOCAB, torch.Generator().manual_seed(1))
    first = torch.arange(32) % BLOCK == 0
    assert torch.equal(noisy[:, first], tokens[:, first])
    # The others are fresh uniform draws: equal to the clean token only by chance (1 in 1000).
    assert (noisy[:, ~first] == tokens[:, ~first]).float().mean() < 0.005
    assert noisy[:, ~first].unique().numel() > 750  # 1,792 uniform draws from 1,000 ids: ~833 distinct


def test_draft_rows_replace_a_share_of_rows_and_leave_the_others_noise_unchanged(tokens):
    plain = DiffusionSettings(block=BLOCK, self_conditioning=0.5)
    drafted = dataclasses.replace(plain, draft_fraction=0.5)
    noisy, t, use = row_noise(tokens, 100, 3, 7, plain, VOCAB)
    d_noisy, d_t, d_use = row_noise(tokens, 100, 3, 7, drafted, VOCAB)
    is_draft = ~(d_noisy == noisy).all(dim=1)
    assert 16 <= int(is_draft.sum()) <= 48  # about half of 64 rows
    # The other rows are exactly what the run without draft rows draws: the stream is unchanged.
    assert torch.equal(d_noisy[~is_draft], noisy[~is_draft])
    assert torch.equal(d_t[~is_draft], t[~is_draft]) and torch.equal(d_use[~is_draft], use[~is_draft])
    # Draft rows: full noise but each canvas's first token, and no self-conditioning (a draft has one step).
    first = torch.arange(32) % BLOCK == 0
    assert torch.equal(d_noisy[is_draft][:, first], tokens[is_draft][:, first])
    assert (d_t[is_draft] == 1).all() and not d_use[is_draft].any()


@pytest.mark.parametrize("change, message", [
    (dict(draft_fraction=1.5), r"draft_fraction must be in \[0, 1\] \(got 1.5\)"),
    (dict(draft_fraction=0.5, objective="ar"), "draft_fraction needs a diffusion or joint objective"),
    (dict(draft_fused_share=-0.1), r"draft_fused_share must be in \[0, 1\] \(got -0.1\)"),
])
def test_bad_draft_settings_are_refused_by_name(corpus, tmp_path, change, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(run_config(corpus, **change), tmp_path)


def test_a_run_with_draft_rows_trains(corpus, tmp_path):
    trainer = Trainer(run_config(corpus, draft_fraction=0.5, steps=2), tmp_path)
    first = trainer.train_step()
    assert first["diffusion"] > 0 and "ar" in first


def test_fused_draft_rows_noise_the_first_token_too_and_leave_the_unfused_ones_alone(tokens):
    unfused = DiffusionSettings(block=BLOCK, draft_fraction=1.0)
    mixed = dataclasses.replace(unfused, draft_fused_share=0.5)
    clean_first, _, _ = row_noise(tokens, 0, 1, 7, unfused, VOCAB)
    noisy, t, use = row_noise(tokens, 0, 1, 7, mixed, VOCAB)
    first = torch.arange(32) % BLOCK == 0
    fused = ~(noisy[:, first] == tokens[:, first]).all(dim=1)
    assert 16 <= int(fused.sum()) <= 48  # about half of 64 rows
    # A fused row's first positions are noise like the rest (equal to the clean token only by chance).
    assert (noisy[fused][:, first] == tokens[fused][:, first]).float().mean() < 0.01
    assert (t == 1).all() and not use.any()
    assert torch.equal(clean_first[:, first], tokens[:, first])


def test_named_draft_rows_are_exactly_those_rows_and_the_others_keep_their_noise(tokens):
    plain = DiffusionSettings(block=BLOCK, self_conditioning=0.5)
    chosen = torch.arange(64) % 3 == 0
    noisy, t, use = row_noise(tokens, 0, 2, 7, plain, VOCAB)
    d_noisy, d_t, d_use = row_noise(tokens, 0, 2, 7, plain, VOCAB, draft_rows=chosen)
    assert torch.equal(d_noisy[~chosen], noisy[~chosen]) and torch.equal(d_use[~chosen], use[~chosen])
    first = torch.arange(32) % BLOCK == 0
    assert torch.equal(d_noisy[chosen][:, first], tokens[chosen][:, first])
    assert (d_noisy[chosen][:, ~first] == tokens[chosen][:, ~first]).float().mean() < 0.01
    assert (d_t[chosen] == 1).all() and not d_use[chosen].any()


@pytest.mark.parametrize("change, message", [
    (dict(draft_teacher_rows=True), "train.draft_teacher_rows needs data.distill"),
    (dict(draft_teacher_rows=True, draft_fraction=0.5), "draft_teacher_rows picks the draft rows itself"),
])
def test_draft_teacher_rows_needs_teacher_rows_and_no_fraction(corpus, tmp_path, change, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(run_config(corpus, **change), tmp_path)
