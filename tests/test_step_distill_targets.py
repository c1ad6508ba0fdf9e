"""bench/step_distill_targets.py: the figures of few-step distillation's targets (docs/benchmarks.md §7, L11)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_reference, save_checkpoint, script_module

targets = script_module("bench/step_distill_targets.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import printpress

    return printpress.load(save_checkpoint(make_reference("gqa"), tmp_path_factory.mktemp("m") / "m")).model


def test_one_draw_makes_the_mean_target_the_target_and_nothing_noised_counts_no_position(model):
    torch.manual_seed(0)
    clean = torch.randint(4, 128, (3, 16))
    row = targets.target_entropies(model, clean, 1.0, 8, 128, draws=1, temperature=1.0)
    # 8 - round(8 / 2) = 4 of each canvas of 8 are kept; all 48 positions are noised (t = 1), so 24 count.
    assert row["positions"] == 24
    for name in ("self-conditioned", "plain"):
        assert row[f"H_mean_p2_{name}"] == pytest.approx(row[f"mean_H_p2_{name}"], abs=1e-4)  # one draw: the same
        assert row[f"KL_mean_p2_p1_{name}"] >= 0
    assert 0 < row["H_p1"] <= math.log(128)
    assert targets.target_entropies(model, clean, 0.0, 8, 128, draws=1, temperature=1.0)["positions"] == 0
