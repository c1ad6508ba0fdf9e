"""AR soft targets (`train.ar_target_weight`): noised canvas positions learn towards the model's own AR distribution;
front distillation (`train.front_distill_weight`): each canvas's noised first position does."""

from __future__ import annotations

import math

import pytest
import torch

from printpress.objectives import DiffusionSettings, ar_target_loss, denoising_loss, front_distill_loss
from printpress.train.loop import Trainer, TrainingError

from helpers import run_config

BLOCK, VOCAB = 4, 5


def cross_entropy(target: list[float], logits: list[float]) -> float:
    """-sum target * log softmax(logits), by hand."""
    norm = math.log(sum(math.exp(v) for v in logits))
    return -sum(p * (v - norm) for p, v in zip(target, logits))


def test_with_the_denoising_loss_it_is_the_cross_entropy_against_the_mixed_target():
    torch.manual_seed(0)
    clean = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    noisy = clean.clone()
    noisy[0, [0, 2, 3, 5]] = torch.tensor([4, 0, 0, 3])  # noised; 1, 4, 6 and 7 show the clean token
    logits = torch.randn(1, 8, VOCAB)
    ar_logits = torch.randn(1, 8, VOCAB)
    t = torch.tensor([[0.5, 1.0]])  # one noise level per canvas of 4
    settings = DiffusionSettings(block=BLOCK, ar_target_weight=0.8, ar_target_power=2.0)

    total = float(denoising_loss(logits, clean, t, settings) + ar_target_loss(logits, ar_logits, clean, noisy, t,
                                                                              settings))
    expected = 0.0
    for i in range(8):
        one_hot = [1.0 if v == int(clean[0, i]) else 0.0 for v in range(VOCAB)]
        # The weight: 0.8 * t^2 where the position is noised and has an AR prediction (not the first token).
        w = 0.8 * float(t[0, i // BLOCK]) ** 2 if (i > 0 and int(noisy[0, i]) != int(clean[0, i])) else 0.0
        teacher = torch.softmax(ar_logits[0, i - 1], dim=-1).tolist() if i > 0 else one_hot
        mixed = [(1 - w) * h + w * s for h, s in zip(one_hot, teacher)]
        expected += cross_entropy(mixed, logits[0, i].tolist()) / 8
    assert total == pytest.approx(expected, rel=1e-5)


def test_it_is_zero_where_nothing_is_noised_and_never_trains_the_ar_side():
    clean = torch.tensor([[0, 1, 2, 3]])
    logits = torch.randn(1, 4, VOCAB, requires_grad=True)
    ar_logits = torch.randn(1, 4, VOCAB, requires_grad=True)
    settings = DiffusionSettings(block=BLOCK, ar_target_weight=1.0)
    t = torch.ones(1, 1)
    assert float(ar_target_loss(logits, ar_logits, clean, clean, t, settings).detach()) == 0.0

    noisy = torch.tensor([[4, 4, 4, 4]])
    ar_target_loss(logits, ar_logits, clean, noisy, t, settings).backward()
    assert ar_logits.grad is None and logits.grad.abs().sum() > 0


def test_front_distillation_is_the_mean_cross_entropy_from_the_ar_side_at_the_noised_fronts():
    torch.manual_seed(2)
    clean = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1], [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]])
    noisy = clean.clone()
    noisy[0, [0, 4, 5]] = 3  # row 0: the sequence's first token (no AR prediction) and the second canvas's front
    noisy[1, [8, 9]] = 0  # row 1: the third canvas's front; row 0's third front and row 1's second show clean
    logits = torch.randn(2, 12, VOCAB, requires_grad=True)
    ar_logits = torch.randn(2, 12, VOCAB, requires_grad=True)
    expected = 0.0
    for row, i in ((0, 4), (1, 8)):
        teacher = torch.softmax(ar_logits[row, i - 1], dim=-1).tolist()
        expected += cross_entropy(teacher, logits[row, i].tolist()) / 2
    loss = front_distill_loss(logits, ar_logits, clean, noisy, BLOCK)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert ar_logits.grad is None
    assert logits.grad[0, 4].abs().sum() > 0 and logits.grad[1, 8].abs().sum() > 0
    elsewhere = torch.ones(2, 12, dtype=torch.bool)
    elsewhere[0, 4] = elsewhere[1, 8] = False
    assert not logits.grad[elsewhere].any()
    assert float(front_distill_loss(logits, ar_logits, clean, clean, BLOCK).detach()) == 0.0  # nothing noised: no front


@pytest.mark.parametrize("term, change", [("ar_target", dict(ar_target_weight=1.0)),
                                          ("front_distill", dict(front_distill_weight=0.5))])
def test_a_joint_run_logs_it_beside_the_other_terms(corpus, tmp_path, term, change):
    trainer = Trainer(run_config(corpus, steps=2, **change), tmp_path)
    first = trainer.train_step()
    weight = change.get("front_distill_weight", 1.0)
    assert first["loss"] == pytest.approx(first["diffusion"] + weight * first[term] + first["ar"], rel=1e-5)
    assert first[term] != 0


@pytest.mark.parametrize("change, message", [
    (dict(ar_target_weight=1.5), r"ar_target_weight must be in \[0, 1\] \(got 1.5\)"),
    (dict(ar_target_weight=0.5, ar_target_power=-1.0), r"ar_target_power must be >= 0 \(got -1.0\)"),
    (dict(ar_target_weight=0.5, objective="diffusion"), "ar_target_weight needs the joint objective"),
    (dict(front_distill_weight=-0.5), r"front_distill_weight must be >= 0 \(got -0.5\)"),
    (dict(front_distill_weight=0.5, objective="diffusion"), "front_distill_weight needs the joint objective"),
])
def test_bad_ar_target_settings_are_refused_by_name(corpus, tmp_path, change, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(run_config(corpus, **change), tmp_path)

