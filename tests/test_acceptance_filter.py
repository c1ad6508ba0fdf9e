"""bench/acceptance_filter.py: does a learned acceptance filter know more than the entropy bound (docs/benchmarks.md
§7, L6)?"""

from __future__ import annotations

import pytest
import torch

from helpers import bench_module, make_reference, save_checkpoint

af = bench_module("acceptance_filter")


def test_auc_counts_pairs_and_ties_half():
    label = torch.tensor([1, 1, 0, 0])
    assert af.auc(torch.tensor([4.0, 3.0, 2.0, 1.0]), label) == 1.0
    assert af.auc(torch.tensor([1.0, 2.0, 3.0, 4.0]), label) == 0.0
    assert af.auc(torch.tensor([2.0, 1.0, 2.0, 0.0]), label) == 0.625  # pairs: (2>0, 2=2 half, 1<2, 1>0) / 4
    assert af.auc(torch.ones(4), label) == 0.5
    with pytest.raises(ValueError, match="both labels"):
        af.auc(torch.ones(3), torch.tensor([1, 1, 1]))


def test_every_step_and_position_is_a_row_labelled_by_the_committed_argmax(tmp_path):
    import printpress

    # No EOS (a checkpoint without one never stops early), so every sample makes both canvases.
    pipe = printpress.load(save_checkpoint(make_reference("gqa", canvas_length=8), tmp_path / "m", eos_token_id=None))
    canvases = af.collect(pipe, [[2, 7, 9], [2, 40]], seeds=2, max_new_tokens=16, steps=3, bound=2.0)
    assert len(canvases) == 4 and all(len(sample) == 2 for sample in canvases)  # 16 tokens: two canvases of 8
    events = canvases[0][0]
    features, labels = af.canvas_rows(events)
    assert features.shape == (3 * 8, len(af.FEATURES)) and labels.shape == (3 * 8,)
    assert labels[-8:].all()  # the last step's argmax is what the canvas commits
    assert labels[:8].tolist() == [a == f for a, f in zip(events[0].argmax, events[-1].argmax, strict=True)]
    assert features[:8, 1].sum() == 0  # nothing is stable at a canvas's first step
    assert features[8:16, 1].tolist() == [float(a == b) for a, b in zip(events[1].argmax, events[0].argmax,
                                                                         strict=True)]
    assert features[:, 0].tolist() == [h for e in events for h in torch.tensor(e.entropy, dtype=torch.float64).tolist()]
    result = af.analyse(canvases)
    assert result["positions"] == {"train": 2 * 2 * 24, "test": 2 * 2 * 24}
    assert [s["step_fraction"] for s in result["per_step"]] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert result["per_step"][-1]["final"] == 1.0 and 0 <= result["auc"]["learned"] <= 1
