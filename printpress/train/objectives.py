"""The training objectives, re-exported under the import path training code, tests and scripts use.

They live in `printpress.objectives`, below both training and evaluation: the held-out losses, the lm-eval
adapter and the Sudoku probe measure the same objectives, and evaluation does not import the training package.
"""

from __future__ import annotations

from printpress.objectives import (
    DiffusionSettings,
    Objective,
    TeacherDraws,
    TrainStep,
    Weighting,
    add_uniform_noise,
    ar_target_loss,
    block_diffusion_masks,
    causal_masks,
    certainty_loss,
    denoising_loss,
    evaluate_losses,
    expected_inverse_t,
    forward_ar,
    forward_block_diffusion,
    front_distill_loss,
    hash_seed,
    next_token_loss,
    row_noise,
    sample_inverse_cdf,
    step_distillation_loss,
    two_step_targets,
)

__all__ = [
    "DiffusionSettings", "Objective", "TeacherDraws", "TrainStep", "Weighting", "add_uniform_noise", "ar_target_loss",
    "block_diffusion_masks", "causal_masks", "certainty_loss", "denoising_loss", "evaluate_losses",
    "expected_inverse_t", "forward_ar", "forward_block_diffusion", "front_distill_loss", "hash_seed",
    "next_token_loss", "row_noise", "sample_inverse_cdf", "step_distillation_loss", "two_step_targets",
]
