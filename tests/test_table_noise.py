"""Table noise (`train.table_noise`): noised canvas positions drawn from a draft table, as `canvas_start="table"`
starts a canvas, instead of uniformly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from printpress.draft_table import MIN_COUNT, DraftTable
from printpress.objectives import DiffusionSettings, row_noise, table_noise
from printpress.train.loop import Trainer, TrainingError

from helpers import run_config

BLOCK = 4


def cycle_table(vocab: int, longest: int = 2) -> DraftTable:
    """A table whose every context of tokens below `vocab` has one next token: t -> t + 1 (mod vocab)."""
    rows = np.array([list(range(vocab)) * 3] * MIN_COUNT)
    return DraftTable.from_rows(rows, first=longest, longest=longest, sampled_rows=rows)


def test_noised_positions_follow_the_table_after_the_clean_text_before_the_canvas():
    table = cycle_table(10)
    clean = torch.tensor([[3, 4, 5, 2, 7, 8, 9, 0]])
    noisy = torch.tensor([[3, 1, 1, 1, 1, 1, 2, 0]])  # noised: 1, 2, 3 (canvas 0), 4, 5, 6 (canvas 1)
    out = table_noise(clean, noisy, table, BLOCK, torch.Generator().manual_seed(0))
    # Canvas 0: 3 -> 4 -> 5 -> 6. Canvas 1 follows the clean text before it (5, 2: the table knows only 2 -> 3),
    # not canvas 0's noise (6 would give 7, 8, 9): the decoder sees the clean text there.
    assert out.tolist() == [[3, 4, 5, 6, 3, 4, 5, 0]]
    clean = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 0]])
    noisy = torch.tensor([[3, 4, 5, 6, 1, 1, 1, 1]])  # a whole canvas noised: the chain after the clean text
    assert table_noise(clean, noisy, table, BLOCK, None).tolist() == [[3, 4, 5, 6, 7, 8, 9, 0]]


def test_a_position_whose_context_the_table_does_not_know_keeps_its_uniform_token():
    table = cycle_table(10, longest=1)
    clean = torch.tensor([[3, 4, 5, 6]])
    noisy = torch.tensor([[3, 40, 41, 6]])  # 40 follows 3 -> 4; 41 follows 4 -> 5, as the chain goes on
    assert table_noise(clean, noisy, table, BLOCK, None).tolist() == [[3, 4, 5, 6]]
    noisy = torch.tensor([[40, 41, 42, 6]])  # position 0: no context; 1 follows 40 (unknown); 2 follows 41
    assert table_noise(clean, noisy, table, BLOCK, None).tolist() == [[40, 41, 42, 6]]


def test_row_noise_redraws_a_share_of_rows_last_and_only_where_noised():
    table = cycle_table(50)
    tokens = torch.randint(0, 50, (64, 16), generator=torch.Generator().manual_seed(1))
    plain = DiffusionSettings(block=BLOCK, draft_fraction=0.25)
    base_noisy, base_t, base_use = row_noise(tokens, 10, 2, 7, plain, 50)
    noisy, t, use = row_noise(tokens, 10, 2, 7, dataclasses.replace(plain, table_noise=0.5), 50, table=table)
    assert torch.equal(t, base_t) and torch.equal(use, base_use)  # the other draws are unchanged
    noised = base_noisy != tokens
    assert torch.equal(noisy[~noised], tokens[~noised])  # clean positions stay clean
    changed = (noisy != base_noisy).any(dim=1)
    assert 20 <= int(changed.sum()) <= 40  # about half the rows (draft rows never)
    for row in torch.nonzero(changed).flatten().tolist():
        expected = table_noise(tokens[row : row + 1], base_noisy[row : row + 1], table, BLOCK, None)
        # the cycle table is deterministic, so the redrawn row is the chain itself
        assert torch.equal(noisy[row : row + 1], expected)
    with pytest.raises(ValueError, match="table_noise draws noise from a draft table, and none was given"):
        row_noise(tokens, 10, 2, 7, dataclasses.replace(plain, table_noise=0.5), 50)


def test_a_run_with_table_noise_trains_and_names_its_table(corpus, tmp_path):
    trainer = Trainer(run_config(corpus, steps=2), tmp_path / "base")
    trainer.fit(progress=False)
    model = tmp_path / "base" / "model"
    vocab = trainer.config.text.vocab_size
    cycle_table(vocab, longest=3).save(model / "draft_table.safetensors")
    run = run_config(corpus, table_noise=1.0, steps=2)
    run.init_from = str(model)
    trainer = Trainer(run, tmp_path / "tuned")
    assert trainer.noise_table is not None and trainer.noise_table.longest == 3
    tokens = trainer.sampler.batch(0)
    noisy, _, _ = row_noise(tokens, 0, 0, 7, trainer.diffusion, vocab, table=trainer.noise_table)
    plain, _, _ = row_noise(tokens, 0, 0, 7, dataclasses.replace(trainer.diffusion, table_noise=0.0), vocab)
    assert not torch.equal(noisy, plain)  # the run's noise is its table's chains
    assert trainer.train_step()["diffusion"] > 0


@pytest.mark.parametrize("change, data, message", [
    (dict(table_noise=1.5), {}, r"table_noise must be in \[0, 1\] \(got 1.5\)"),
    (dict(table_noise=0.5, objective="ar"), {}, "table_noise needs a diffusion or joint objective"),
    (dict(table_noise=0.5), {}, "train.table_noise draws noise from a draft table: set data.draft_table"),
    (dict(table_noise=0.5), {"draft_table": "nowhere/draft_table.safetensors"},
     "train.table_noise needs a draft table with sampled counts, and nowhere/draft_table.safetensors has none"),
])
def test_bad_table_noise_settings_are_refused_by_name(corpus, tmp_path, change, data, message):
    run = run_config(corpus, **change)
    run.data.update(data)
    with pytest.raises(TrainingError, match=message):
        Trainer(run, tmp_path)


def test_a_table_without_sampled_counts_is_refused(corpus, tmp_path):
    rows = np.array([list(range(10)) * 3] * MIN_COUNT)
    DraftTable.from_rows(rows, first=2, longest=2).save(tmp_path / "greedy.safetensors")
    run = run_config(corpus, table_noise=0.5)
    run.data["draft_table"] = str(tmp_path / "greedy.safetensors")
    with pytest.raises(TrainingError, match="has one without them: make one with `printpress draft-table MODEL`"):
        Trainer(run, tmp_path / "run")


def test_a_resumed_run_draws_from_the_same_table(corpus, tmp_path):
    from printpress.train.loop import RunConfig

    table = cycle_table(7, longest=3)
    table.save(tmp_path / "table.safetensors")
    run = run_config(corpus, table_noise=0.5, steps=4)
    run.data["draft_table"] = str(tmp_path / "table.safetensors")
    trainer = Trainer(run, tmp_path / "run")
    trainer.train_step()
    trainer.save_checkpoint()
    resumed = Trainer(RunConfig(), tmp_path / "run", resume=True)
    assert resumed.step == 1 and resumed.settings.table_noise == 0.5
    assert resumed.noise_table.maps == table.maps and resumed.noise_table.longest == 3
