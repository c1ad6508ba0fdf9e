"""Sampler states (`train.sampler_states`): canvases holding the model's own samples, as later sampler steps see."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from printpress.objectives import DiffusionSettings, TrainStep, row_noise, sampler_state
from printpress.train.loop import Trainer, TrainingError

from helpers import run_config

BLOCK, VOCAB = 8, 50


def certain_logits(tokens: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """Logits (B, L, V) whose argmax at each position is `tokens`, by `margin` (B, L) nats over every other id."""
    logits = torch.zeros(*tokens.shape, VOCAB)
    return logits.scatter(-1, tokens[..., None], margin[..., None])


def test_the_most_certain_share_of_noised_positions_takes_the_first_pass_samples():
    clean = torch.arange(16).view(1, 16) % VOCAB
    noisy = clean.clone()
    noised = torch.tensor([1, 2, 3, 5, 9, 10, 12, 15])  # four in each canvas of 8
    noisy[0, noised] = 40 + torch.arange(8)
    guess = (clean + 20) % VOCAB  # the first pass's (wrong) best guess everywhere
    margin = torch.full((1, 16), 1.0)
    margin[0, torch.tensor([2, 5, 10, 15])] = 60.0  # certain at two noised positions per canvas
    out = sampler_state(clean, noisy, certain_logits(guess, margin), torch.tensor([0.5]),
                        torch.full((1, 16), 0.5), BLOCK, temperature=1.0)
    changed = torch.nonzero(out[0] != noisy[0]).flatten()
    assert changed.tolist() == [2, 5, 10, 15]  # round(0.5 * 4) = 2 per canvas, the most certain ones
    assert torch.equal(out[0, changed], guess[0, changed])  # sampled at a near one-hot: the guess itself


def test_keep_zero_leaves_the_canvas_and_keep_one_fills_every_noised_position_only():
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(0, VOCAB, (3, 16), generator=gen)
    noisy = torch.where(torch.rand(3, 16, generator=gen) < 0.5, (clean + 1) % VOCAB, clean)
    guess = (clean + 7) % VOCAB
    logits = certain_logits(guess, torch.full((3, 16), 80.0))
    out = sampler_state(clean, noisy, logits, torch.tensor([0.0, 1.0, 1.0]), torch.rand(3, 16, generator=gen),
                        BLOCK, temperature=0.7)
    assert torch.equal(out[0], noisy[0])
    noised = noisy[1:] != clean[1:]
    assert torch.equal(out[1:][noised], guess[1:][noised])
    assert torch.equal(out[1:][~noised], clean[1:][~noised])  # clean positions are never touched


def test_row_noise_draws_states_last_and_only_for_self_conditioned_non_draft_rows():
    tokens = torch.randint(0, 1000, (64, 32), generator=torch.Generator().manual_seed(1))
    plain = DiffusionSettings(block=BLOCK, self_conditioning=0.5, draft_fraction=0.25)
    states = dataclasses.replace(plain, sampler_states=0.5)
    base = row_noise(tokens, 10, 2, 7, plain, 1000)
    noisy, t, use, keep, uniform = row_noise(tokens, 10, 2, 7, states, 1000, sampler_states=True)
    for before, after in zip(base, (noisy, t, use)):
        assert torch.equal(before, after)  # the noise stream is unchanged by the extra draws
    assert keep.shape == (64,) and uniform.shape == (64, 32)
    assert (keep[~use] == 0).all()  # draft rows and rows without self-conditioning stay as drawn
    chosen = keep > 0
    assert 6 <= int(chosen.sum()) <= int(use.sum()) - 4  # about half of the self-conditioned rows
    # Without the flag (held-out evaluation), the setting draws nothing more.
    assert len(row_noise(tokens, 10, 2, 7, states, 1000)) == 3


def test_the_training_step_denoises_the_sampler_state_not_the_drawn_canvas(corpus, tmp_path):
    trainer = Trainer(run_config(corpus, sampler_states=1.0, self_conditioning=1.0), tmp_path)
    module: TrainStep = trainer.step_module
    tokens = trainer.sampler.batch(0)
    noise = row_noise(tokens, 0, 0, 7, module.settings, trainer.config.text.vocab_size, sampler_states=True)
    assert (noise[3] > 0).all()
    with_states = module(tokens, noise)["diffusion"]
    without = module(tokens, noise[:3])["diffusion"]
    keep_none = module(tokens, (*noise[:3], torch.zeros_like(noise[3]), noise[4]))["diffusion"]
    assert float(keep_none) == float(without)  # keep 0 everywhere is exactly the plain objective
    assert float(with_states) != float(without)


def test_a_run_with_sampler_states_trains(corpus, tmp_path):
    trainer = Trainer(run_config(corpus, sampler_states=0.5, steps=2), tmp_path)
    first = trainer.train_step()
    assert first["diffusion"] > 0 and "ar" in first


@pytest.mark.parametrize("change, message", [
    (dict(sampler_states=1.5), r"sampler_states must be in \[0, 1\] \(got 1.5\)"),
    (dict(sampler_states_temperature=0.0), r"sampler_states_temperature must be > 0 \(got 0.0\)"),
    (dict(sampler_states=0.5, self_conditioning=0.0), "sampler_states needs .* self_conditioning > 0"),
    (dict(sampler_states=0.5, objective="ar"), "sampler_states needs a diffusion or joint objective"),
])
def test_bad_sampler_state_settings_are_refused_by_name(corpus, tmp_path, change, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(run_config(corpus, **change), tmp_path)
