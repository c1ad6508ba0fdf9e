"""Few-step self-distillation (issue 11, lever L4): the teacher's two sampler steps, the reverse-KL loss, and a
run that resumes exactly in the middle of a round (the round's teacher travels in the checkpoint)."""

from __future__ import annotations

import copy

import pytest
import torch

from printpress.model import DiffusionGemma
from printpress.train.loop import Trainer, TrainingError
from printpress.train.objectives import (
    DiffusionSettings,
    TeacherDraws,
    forward_block_diffusion,
    sample_inverse_cdf,
    step_distillation_loss,
    two_step_targets,
)
from helpers import killed_and_resumed, losses, run_config

BLOCK = 8


def tiny_model() -> DiffusionGemma:
    from printpress.config import TextConfig

    torch.manual_seed(0)
    return DiffusionGemma(TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, global_head_dim=16, num_global_key_value_heads=1, sliding_window=8, num_experts=2,
        top_k_experts=1, moe_intermediate_size=16, max_position_embeddings=128)).eval()


@pytest.fixture()
def batch():
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(0, 64, (2, 4 * BLOCK), generator=g)
    noisy = torch.randint(0, 64, clean.shape, generator=g)  # every position noised (t = 1)
    draws = (torch.rand(clean.shape, generator=g), torch.randint(0, 64, clean.shape, generator=g))
    return clean, noisy, draws


def test_inverse_cdf_sampling_picks_the_token_whose_mass_holds_the_draw():
    probs = torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.0, 1.0], [0.5, 0.0, 0.5]])
    assert sample_inverse_cdf(probs, torch.tensor([0.2, 0.0, 0.49])).tolist() == [0, 2, 0]
    assert sample_inverse_cdf(probs, torch.tensor([0.3, 0.99, 0.51])).tolist() == [1, 2, 2]
    assert sample_inverse_cdf(probs, torch.tensor([0.999999, 0.5, 0.999999])).tolist() == [1, 2, 2]


def test_at_full_noise_the_teacher_keeps_half_of_each_canvas_from_its_first_step(batch):
    model = tiny_model()
    clean, noisy, (uniform, renoise) = batch
    settings = DiffusionSettings(block=BLOCK)
    target = two_step_targets(clean, noisy, torch.ones(2, 4), TeacherDraws(model, uniform, renoise), settings)
    with torch.no_grad():
        _, first = forward_block_diffusion(model, clean, noisy, BLOCK)
    from_first = (target == torch.log_softmax(first.float(), dim=-1)).all(dim=-1)
    assert from_first.view(2, 4, BLOCK).sum(dim=-1).tolist() == [[BLOCK // 2] * 4] * 2


def test_a_teacher_that_keeps_everything_is_the_student_itself_so_the_loss_is_zero(batch):
    model = tiny_model()
    clean, noisy, (uniform, renoise) = batch
    settings = DiffusionSettings(block=BLOCK, self_conditioning=0.0, step_distill_weight=1.0)
    draws = TeacherDraws(copy.deepcopy(model), uniform, renoise)
    with torch.no_grad():
        _, student = forward_block_diffusion(model, clean, noisy, BLOCK)
        # t = 0 keeps every position at step one: the target is the first pass, which the student computes too.
        assert float(step_distillation_loss(student, clean, noisy, torch.zeros(2, 4), draws, settings)) == 0.0
        # At t = 1 half of each canvas is re-predicted after the teacher's own samples: a real signal.
        assert float(step_distillation_loss(student, clean, noisy, torch.ones(2, 4), draws, settings)) > 1e-4


def test_forward_kl_is_the_teachers_expectation_and_also_zero_for_a_teacher_that_keeps_everything(batch):
    model = tiny_model()
    clean, noisy, (uniform, renoise) = batch
    draws = TeacherDraws(copy.deepcopy(model), uniform, renoise)
    reverse = DiffusionSettings(block=BLOCK, self_conditioning=0.0, step_distill_weight=1.0)
    forward = DiffusionSettings(block=BLOCK, self_conditioning=0.0, step_distill_weight=1.0,
                                step_distill_divergence="forward")
    with torch.no_grad():
        _, student = forward_block_diffusion(model, clean, noisy, BLOCK)
        assert float(step_distillation_loss(student, clean, noisy, torch.zeros(2, 4), draws, forward)) == 0.0
        target = two_step_targets(clean, noisy, torch.ones(2, 4), draws, forward)
        log_q = torch.log_softmax(student, dim=-1)
        noised = noisy != clean  # the loss averages over these (a random token can equal the clean one)
        expected = (target.exp() * (target - log_q)).sum(-1)[noised].mean()
        got = step_distillation_loss(student, clean, noisy, torch.ones(2, 4), draws, forward)
        assert float(got) == pytest.approx(float(expected), rel=1e-5)
        assert float(got) != pytest.approx(float(step_distillation_loss(student, clean, noisy, torch.ones(2, 4),
                                                                           draws, reverse)), rel=1e-3)


def test_the_loss_trains_the_student_not_the_teacher(batch):
    student, teacher = tiny_model(), tiny_model()
    clean, noisy, (uniform, renoise) = batch
    settings = DiffusionSettings(block=BLOCK, self_conditioning=0.0, step_distill_weight=1.0)
    _, logits = forward_block_diffusion(student, clean, noisy, BLOCK)
    step_distillation_loss(logits, clean, noisy, torch.ones(2, 4), TeacherDraws(teacher, uniform, renoise),
                           settings).backward()
    assert student.embed_tokens.weight.grad is not None and student.embed_tokens.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.slow  # trains a run whole, then killed and resumed
def test_a_run_killed_mid_round_resumes_with_that_rounds_teacher(corpus, tmp_path):
    settings = dict(steps=6, step_distill_weight=1.0, step_distill_refresh=2, save_every=3)
    whole = tmp_path / "whole"
    Trainer(run_config(corpus, **settings), whole).fit(progress=False)
    records = losses(whole)
    assert len(records) == 6

    broken = tmp_path / "broken"
    killed_and_resumed(run_config(corpus, **settings), broken)  # checkpoint at step 3: mid-round (rounds of 2)
    assert losses(broken) == records  # exact: step 4 re-runs against the teacher of step 2, not of step 3


@pytest.mark.parametrize("change, message", [
    (dict(step_distill_weight=-1.0), "step_distill_weight must be >= 0"),
    (dict(step_distill_weight=1.0, objective="ar"), "step_distill_weight needs a diffusion or joint objective"),
    (dict(step_distill_refresh=0), "step_distill_refresh must be positive"),
    (dict(step_distill_temperature=0.0), "step_distill_temperature must be > 0"),
    (dict(step_distill_divergence="js"), "step_distill_divergence 'js' is not reverse or forward"),
])
def test_bad_step_distillation_settings_are_refused_by_name(corpus, tmp_path, change, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(run_config(corpus, **change), tmp_path)
