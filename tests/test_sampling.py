"""The sampler pieces give bit-identical results to the transformers reference sampler classes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationMixin,
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)
from transformers.generation import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from printpress import sampling
from printpress.canvas import denoise_step, probabilities_and_entropy
from printpress.errors import GenerationError
from printpress.sampling import (
    SamplerSettings,
    StabilityTracker,
    canvases_for,
    draw_kernels,
    entropy_bound_accept,
    exponential_like_torch,
    multinomial_one,
    next_token_probs,
    pad_after_eos,
    row_argmax,
    capped_argmax,
    sample_canvas,
    sample_next_token,
    softmax_kernels,
    step_temperature,
    token_entropy,
    top_k_only,
    window_open,
    uniform_tokens,
)

VOCAB, CANVAS = 50, 8


def random_logits(seed: int, batch: int = 1, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, CANVAS, VOCAB, generator=g) * scale


@pytest.mark.parametrize("t_min,t_max,steps", [(0.4, 0.8, 48), (0.1, 1.3, 7), (0.0, 0.9, 3), (0.5, 0.5, 5)])
def test_temperature_schedule_matches_reference_bitwise(t_min, t_max, steps):
    logits = random_logits(0)
    settings = SamplerSettings(t_min=t_min, t_max=t_max, max_denoising_steps=steps)
    reference = LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=steps)
    for step in range(steps, 0, -1):
        expected = reference(None, logits, cur_step=torch.tensor(step, dtype=torch.int32))
        assert torch.equal(logits[0] / step_temperature(step, settings), expected[0])


def test_first_step_uses_t_max_and_last_step_is_above_t_min():
    settings = SamplerSettings(t_min=0.4, t_max=0.8, max_denoising_steps=4)
    assert float(step_temperature(4, settings)) == pytest.approx(0.8)
    assert float(step_temperature(1, settings)) == pytest.approx(0.5)  # the schedule never reaches n = 0


@pytest.mark.parametrize("scale", [0.1, 3.0, 40.0])
def test_entropy_matches_categorical_bitwise(scale):
    logits = random_logits(1, batch=3, scale=scale)
    logits[0, 0, :] = float("-inf")
    logits[0, 0, 3] = 5.0  # a one-hot row: -inf logits must not give NaN
    expected = torch.distributions.Categorical(logits=logits).entropy()
    got = token_entropy(logits)
    assert torch.equal(got, expected)
    assert got[0, 0] == 0


@pytest.mark.parametrize("bound", [0.1, 1.0, 5.0, 1000.0])
@pytest.mark.parametrize("seed", range(4))
def test_acceptance_matches_reference_sampler(bound, seed):
    logits = random_logits(seed, scale=1.0 + seed)
    sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), CANVAS, VOCAB, 10)
    current = torch.full((1, CANVAS), -1)
    denoised = torch.arange(CANVAS)[None]
    accepted_canvas = sampler.accept_canvas(current, denoised, logits, cur_step=3)
    mask = entropy_bound_accept(token_entropy(logits), bound)
    assert torch.equal(mask, sampler.accepted_token_mask)
    assert torch.equal(accepted_canvas, torch.where(mask, denoised, current))
    assert bool(mask.any()), "the lowest-entropy position is always accepted"


def test_acceptance_takes_the_lowest_entropy_positions_within_the_bound():
    entropy = torch.tensor([[0.30, 0.01, 2.0, 0.05, 0.02]])
    # sorted: 0.01, 0.02, 0.05, 0.30, 2.0 -> sums before each: 0, 0.01, 0.03, 0.08, 0.38
    assert entropy_bound_accept(entropy, 0.1).tolist() == [[True, True, False, True, True]]
    assert entropy_bound_accept(entropy, 0.005).tolist() == [[False, True, False, False, False]]


def test_the_window_opens_left_to_right_and_fully_once_lead_times_step_reaches_the_count():
    # 32 positions, 8 steps (`step` counts down: 8 is the first): lead 1 opens 4, 8, ..., 32; lead 1.5 opens 6, 12,
    # 18, 24, 30 (ceil(32 * 1.5 * j / 8)), then all from j = 6, where 1.5 * 6 >= 8.
    assert [window_open(32, 1.0, step, 8) for step in range(8, 0, -1)] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert [window_open(32, 1.5, step, 8) for step in range(8, 0, -1)] == [6, 12, 18, 24, 30, 32, 32, 32]
    assert [window_open(5, 1.0, step, 3) for step in (3, 2, 1)] == [2, 4, 5]  # ceil(5/3), ceil(10/3), all
    assert window_open(32, 0.0, 8, 8) == 32  # off: every position, as the reference
    assert window_open(32, 0.5, 1, 8) == 16  # a lead under 1 never opens fully; the last argmax commits the rest


def test_random_draws_match_the_reference_global_rng_order():
    """init randint, then per step multinomial over the canvas and randint for re-noising."""
    sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=0.1), CANVAS, VOCAB, 10)
    probs = torch.softmax(random_logits(2), dim=-1)
    torch.manual_seed(1234)
    expected = [sampler.initialize_canvas(1, torch.device("cpu"))]
    for _ in range(3):
        expected.append(torch.multinomial(probs.view(-1, VOCAB), num_samples=1).view(1, CANVAS))
        expected.append(sampler.initialize_canvas(1, torch.device("cpu")))

    generator = torch.Generator().manual_seed(1234)
    got = [uniform_tokens(CANVAS, VOCAB, generator, torch.device("cpu"))]
    for _ in range(3):
        got.append(sample_canvas(probs[0], generator)[None])
        got.append(uniform_tokens(CANVAS, VOCAB, generator, torch.device("cpu")))
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


@pytest.mark.parametrize("threshold", [0, 1, 2, 3])
def test_stability_and_confidence_match_reference_stopping(threshold):
    batch = 3
    reference = StableAndConfidentStoppingCriteria(stability_threshold=threshold, confidence_threshold=0.5)
    tracker = StabilityTracker(threshold, batch, CANVAS, torch.device("cpu"))
    g = torch.Generator().manual_seed(threshold)
    argmax = torch.randint(0, VOCAB, (batch, CANVAS), generator=g)
    for step in range(8):
        if step % 3 == 2:  # change one row now and then, so stability has to be re-earned
            argmax = argmax.clone()
            argmax[step % batch, 0] = (argmax[step % batch, 0] + 1) % VOCAB
        logits = random_logits(step, batch=batch, scale=1.0 + 10 * (step % 2))
        expected = reference(argmax, logits)
        stable = tracker.update(argmax)
        confident = token_entropy(logits).mean(dim=-1) < 0.5
        assert torch.equal(stable & confident, expected)


def test_stability_tracker_select_keeps_each_rows_history():
    tracker = StabilityTracker(1, 3, 2, torch.device("cpu"))
    canvases = torch.tensor([[1, 1], [2, 2], [3, 3]])
    assert tracker.update(canvases).tolist() == [False, False, False]
    tracker.select(torch.tensor([2, 0]))
    assert tracker.update(torch.tensor([[3, 3], [9, 9]])).tolist() == [True, False]


def _reference_finalize(canvas: torch.Tensor, eos: list[int], pad: int) -> torch.Tensor:
    """The reference's canvas finalisation for a batch of one, with a 3-token prompt in front."""
    input_ids = torch.cat([torch.tensor([[2, 3, 4]]), canvas[None]], dim=-1)
    criteria = StoppingCriteriaList([MaxLengthCriteria(1000), EosTokenCriteria(eos)])

    class Config:
        pad_token_id = pad
        eos_token_id = eos

    out, _ = DiffusionGemmaGenerationMixin._finalize_canvas(
        input_ids, torch.zeros(1, dtype=torch.bool), Config, criteria, canvas.shape[0], torch.tensor(eos)
    )
    return out[0, 3:]


@pytest.mark.parametrize(
    "canvas", [[5, 6, 1, 7, 1, 8], [1, 5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 1], [5, 6, 7, 8, 9, 10], [5, 50, 6, 1, 50, 7]]
)
def test_pad_after_eos_matches_reference_finalisation(canvas):
    tokens = torch.tensor(canvas)
    got, has_eos = pad_after_eos(tokens, (1, 50), 0)
    assert torch.equal(got, _reference_finalize(tokens, [1, 50], 0))
    assert has_eos == any(t in (1, 50) for t in canvas)


def test_pad_after_eos_without_eos_ids_or_pad():
    tokens = torch.tensor([5, 1, 6])
    assert pad_after_eos(tokens, (), 0) == (tokens, False)
    same, has_eos = pad_after_eos(tokens, (1,), None)
    assert has_eos and torch.equal(same, tokens)


def test_max_new_tokens_rounds_up_to_whole_canvases():
    assert [canvases_for(n, 8) for n in (1, 7, 8, 9, 16, 17)] == [1, 1, 1, 2, 2, 3]


def test_row_argmax_is_torch_argmax_on_ties_nans_slices_and_many_rows():
    nan = float("nan")
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [1.0, nan, 3.0, nan], [0.0, 0.0, 0.0, 5.0]])
    assert row_argmax(ties).tolist() == torch.argmax(ties, dim=-1).tolist() == [1, 0, 1, 3]
    g = torch.Generator().manual_seed(0)
    coarse = torch.randint(0, 4, (6, 40, 4096), generator=g).float()  # many equal maxima per row
    for x in (coarse, coarse[:, :7], coarse.transpose(0, 1), torch.randn(3, 32, 4096, generator=g).bfloat16()):
        assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1))


def test_capped_argmax_is_the_argmax_of_the_softcapped_logits_where_saturation_and_rounding_tie_them():
    """`capped_argmax(raw, cap)` (the greedy argmax without softcapping the whole vocabulary) gives the indices the
    model's softcap and `row_argmax` give: rows whose largest raw logit is not their capped argmax (the tanh's
    rounding ties values near the top: the first of them wins), near-ties at every scale, NaN and infinite rows,
    more candidates than the kernel takes, and a vocabulary that is no multiple of 64 (the plain path)."""
    def capped(x, cap):
        return row_argmax(x.clone().div_(cap).tanh_().mul_(cap))

    saturated = torch.full((2, 4096), -5.0)
    saturated[0, 3], saturated[0, 7] = 300.0, 400.0  # both round to the same capped value: index 3, not 7
    saturated[1, 9], saturated[1, 2000] = 400.0, 1e6
    assert capped(saturated, 30.0).tolist() == [3, 9] != row_argmax(saturated).tolist()
    assert capped_argmax(saturated, 30.0).tolist() == [3, 9]

    g = torch.Generator().manual_seed(0)
    cases = [saturated]
    for scale in (1.0, 30.0, 300.0, 1e5):
        x = torch.randn(8, 4096, generator=g) * scale
        top = x.max(dim=-1, keepdim=True).values
        x[:, 100:160] = top - torch.rand(8, 60, generator=g) * 1e-4 * scale  # a crowd of near-ties below the top
        cases.append(x)
    special = torch.randn(4, 4096, generator=g)
    special[0, 11], special[0, 50] = float("nan"), float("inf")  # the first NaN, as row_argmax takes it
    special[1, 70], special[1, 80] = float("inf"), float("inf")
    special[2] = float("-inf")
    special[3, 1000:1400] = 500.0  # 400 tied candidates: more than the kernel takes
    cases += [special, torch.randn(3, 4000, generator=g) * 100, torch.randn(4096, generator=g)]
    for x in cases:
        for cap in (30.0, 5.0):
            assert torch.equal(capped_argmax(x, cap), capped(x, cap))
    assert torch.equal(capped_argmax(special, None), row_argmax(special))  # no softcap: the plain argmax


def test_next_token_probs_with_a_cut_give_atens_bits():
    """`next_token_probs` with top_k (the C++ cut `printpress_draw::top_k_probs` between ATen's division and softmax)
    gives the bits of ATen's operators composed as `top_k_only` composes them: rows with ties at the k-th value (they
    stay), k of 1 and of V - 1, banned (-inf) and infinite logits, 1-D to 3-D logits; a NaN row the same (ATen's
    path)."""
    def aten(x, temperature, k):
        return torch.softmax(top_k_only(x / temperature, k), dim=-1, dtype=torch.float32)

    g = torch.Generator().manual_seed(3)
    coarse = torch.randint(0, 12, (4, 4096), generator=g).float()  # hundreds of values equal to the k-th
    wide = torch.randn(2, 3, 4096, generator=g) * 20
    odd = torch.randn(5, 1000, generator=g)  # a vocabulary that is no multiple of a vector
    special = torch.randn(3, 4096, generator=g)
    special[0, :4000] = float("-inf")  # fewer finite values than k in no row, but most banned
    special[1, 7], special[2, 9] = float("inf"), float("-inf")
    for x in (coarse, wide, odd, special, torch.randn(4096, generator=g)):
        for temperature, k in ((0.8, 50), (1.0, 1), (1.3, x.shape[-1] - 1), (0.5, 7)):
            got = next_token_probs(x, SamplerSettings(temperature=temperature, top_k=k))
            # bit for bit, a NaN (the row with +inf, in both) where the other has one
            torch.testing.assert_close(got, aten(x, temperature, k), rtol=0, atol=0, equal_nan=True)
    nan = torch.randn(2, 4096, generator=g)
    nan[1, 3] = float("nan")
    got = next_token_probs(nan, SamplerSettings(temperature=0.8, top_k=50))
    torch.testing.assert_close(got, aten(nan, 0.8, 50), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rows", [1, 3])
def test_probabilities_and_entropy_row_by_row_equal_the_whole_batch_bit_for_bit(rows):
    processed = random_logits(7, batch=rows) / 0.7
    for free in (CANVAS, 5):
        probs, entropy = probabilities_and_entropy(processed, free)
        assert torch.equal(probs, torch.softmax(processed, dim=-1, dtype=torch.float32))
        assert torch.equal(entropy, token_entropy(processed[:, :free]))
        assert entropy.shape == (rows, free)


def test_the_one_pass_softmax_and_entropy_give_atens_bits():
    """printpress_softmax (the exact sampler's softmax and entropy a row at a time, `sampling.softmax_kernels`): its
    check against ATen holds with torch's x86 builds, and it gives torch.softmax's and Categorical's entropy's bits
    for vocabularies with tails (no multiple of a vector width), banned tokens (-inf), a near one-hot row, wide logit
    ranges and fewer free positions than rows; a strided or bf16 canvas takes ATen's operators."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert softmax_kernels() and torch.ops.printpress_softmax.form() in (108, 116, 208, 216)
    elif not softmax_kernels():
        pytest.skip("printpress's one-pass softmax does not hold (or cannot be built) on this machine")
    g = torch.Generator().manual_seed(3)
    for rows, vocab in [(32, 4096), (8, 37), (5, 1000), (3, 4099), (1, 8)]:
        for scale in (1.0, 5.0, 30.0):
            x = torch.randn(rows, vocab, generator=g) * scale
            x[:, 2 : 2 + vocab // 5] = float("-inf")
            x[0, vocab - 1] = 80.0
            for free in sorted({rows, max(rows - 2, 1)}):
                probs, entropy = torch.ops.printpress_softmax.sampler_numbers(x, free)
                assert torch.equal(probs, torch.softmax(x, dim=-1, dtype=torch.float32)), (rows, vocab, scale)
                assert torch.equal(entropy, token_entropy(x[:free])), (rows, vocab, scale, free)
    processed = random_logits(4, batch=2)
    for canvas in (processed.transpose(1, 2).contiguous().transpose(1, 2), processed.bfloat16()):
        probs, entropy = probabilities_and_entropy(canvas, CANVAS)
        assert torch.equal(probs, torch.softmax(canvas, dim=-1, dtype=torch.float32))
        assert torch.equal(entropy, token_entropy(canvas))


@pytest.mark.parametrize("rows", [1, 3])
def test_the_fused_probabilities_and_entropy_of_a_compiled_step_are_float32_close_to_the_exact_ones(rows):
    """`exact=False` (a compiled decoder's step): one kernel call, within float32's rounding of the exact path's
    softmax and Categorical entropy, a banned (-inf) token at probability 0; the exact path stays bit for bit."""
    from printpress.fast import rows_linear_ready

    if not rows_linear_ready():
        pytest.skip("no C++ compiler for the kernel on this machine")
    processed = random_logits(9, batch=rows) / 0.7
    processed[:, 2, 5:40] = float("-inf")
    processed[:, 3, 7] = 60.0  # a near one-hot position: entropy ~0
    for free in (CANVAS, 5):
        exact_probs, exact_entropy = probabilities_and_entropy(processed, free)
        probs, entropy = probabilities_and_entropy(processed, free, exact=False)
        assert probs.shape == exact_probs.shape and entropy.shape == exact_entropy.shape == (rows, free)
        assert not torch.equal(entropy, exact_entropy)  # the kernel ran: another summation order
        assert torch.allclose(probs, exact_probs, atol=1e-7, rtol=1e-5)
        assert torch.allclose(entropy, exact_entropy, atol=2e-6, rtol=1e-5)
        assert bool((probs[:, 2, 5:40] == 0).all()) and float(entropy[:, 3].max()) < 1e-3
    with pytest.raises(RuntimeError, match="expects float32 rows"):
        torch.ops.printpress_fast.softmax_entropy(processed[0].double())


def test_greedy_ar_sampling_is_argmax_and_sampled_is_reproducible():
    logits = random_logits(5)[0, 0]
    assert sample_next_token(logits, SamplerSettings(mode="ar"), torch.Generator()) == int(logits.argmax())
    settings = SamplerSettings(mode="ar", temperature=1.0, top_k=3)
    draws = [sample_next_token(logits, settings, torch.Generator().manual_seed(s)) for s in range(40)]
    assert draws == [sample_next_token(logits, settings, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) <= set(torch.topk(logits, 3).indices.tolist())
    assert len(set(draws)) > 1


def test_top_k_only_keeps_each_rows_k_largest_and_their_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.5], [4.0, -1.0, 0.0, 2.0, 1.0]])
    cut = top_k_only(logits, 2)
    inf = float("-inf")
    assert cut.tolist() == [[inf, 3.0, inf, 3.0, inf], [4.0, inf, inf, 2.0, inf]]
    assert top_k_only(logits, 1)[0].tolist() == [inf, 3.0, inf, 3.0, inf]  # a tie with the k-th stays


@dataclass
class Row:
    """A canvas row as `denoise_step` reads it (`printpress.canvas.CanvasRow`)."""

    settings: SamplerSettings
    generator: torch.Generator
    step: int = 4
    index: int = 0
    tracker: StabilityTracker | None = None


def test_canvas_top_k_cuts_each_position_before_the_entropy_the_acceptance_and_the_draw():
    logits = random_logits(11, batch=2, scale=1.0)  # flat enough that the full distributions are wide
    plain = SamplerSettings(max_denoising_steps=4, t_min=1.0, t_max=1.0, entropy_bound=1e3)
    cut = plain.with_overrides(canvas_top_k=3)

    def step(settings_of_row_0):
        rows = [Row(settings_of_row_0, torch.Generator().manual_seed(1)), Row(plain, torch.Generator().manual_seed(2))]
        return denoise_step(logits.clone(), rows, VOCAB)

    full, topped = step(plain), step(cut)
    top3 = torch.topk(logits[0], 3, dim=-1).indices
    # Row 0: every kept token is one of its position's 3 most likely; the entropy is the cut distribution's.
    assert topped.accepted[0].all()  # the loose bound keeps every position, so every token is a draw
    assert all(int(t) in top3[i].tolist() for i, t in enumerate(topped.next_canvas[0]))
    assert torch.equal(topped.entropy[0], token_entropy(top_k_only(logits[0], 3)))
    assert (topped.entropy[0] <= math.log(3) + 1e-5).all() and (full.entropy[0] > math.log(3)).any()
    assert not set(full.next_canvas[0].tolist()) <= set(top3.flatten().tolist())  # uncut draws leave the top 3
    # Row 1 (off, the reference's sampler) is untouched by its neighbour's setting, bit for bit.
    for name in ("processed", "probs", "entropy", "accepted", "next_canvas"):
        assert torch.equal(getattr(topped, name)[1], getattr(full, name)[1]), name


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
        (dict(max_denoising_steps=0), "steps (max_denoising_steps) must be a positive integer"),
        (dict(entropy_bound=0.0), "entropy_bound must be > 0"),
        (dict(entropy_bound=-1.0), "entropy_bound must be > 0"),
        (dict(t_min=0.9, t_max=0.5), "t_min (0.9) must not exceed t_max (0.5)"),
        (dict(t_min=-0.1), "t_min must be >= 0"),
        (dict(t_min=0.0, t_max=0.0), "t_max must be > 0"),
        (dict(stability_threshold=-1), "stability_threshold must be an integer >= 0"),
        (dict(confidence_threshold=0.0), "confidence_threshold must be > 0"),
        (dict(mode="beam"), "unknown mode 'beam'; expected one of diffusion, ar"),
        (dict(mode="ar", temperature=-1.0), "temperature must be >= 0"),
        (dict(mode="ar", top_k=0), "top_k must be a positive integer"),
        (dict(canvas_top_k=-1), "canvas_top_k must be an integer >= 0, got -1"),
        (dict(canvas_top_k=2.5), "canvas_top_k must be an integer >= 0, got 2.5"),
        # Values whose arithmetic is not finite: refused instead of NaN (every request of a shared step failed),
        # silently empty output (t_max=inf), an int32 overflow or a 25 GB stability history.
        (dict(t_min=0.0, t_max=1e-38), "t_max must be > 0 and finite: between 0.0001 and 10000, got 1e-38"),
        (dict(t_max=float("inf")), "t_max must be > 0 and finite: between 0.0001 and 10000, got inf"),
        (dict(t_max=float("nan")), "t_max must be > 0 and finite: between 0.0001 and 10000, got nan"),
        (dict(t_max=1e300), "t_max must be > 0 and finite: between 0.0001 and 10000, got 1e+300"),
        (dict(t_min=1e-38), "t_min must be >= 0 and finite: 0 or between 0.0001 and 10000, got 1e-38"),
        (dict(t_min=float("nan")), "t_min must be >= 0 and finite"),
        (dict(mode="ar", temperature=1e-38), "temperature must be >= 0 and finite: 0 (greedy) or between 0.0001 and "
                                             "10000, got 1e-38"),
        (dict(mode="speculative", temperature=float("inf")), "temperature must be >= 0 and finite"),
        (dict(mode="ar", temperature="0.5"), "temperature must be >= 0 and finite"),
        (dict(max_denoising_steps=10**11), "steps (max_denoising_steps) must be a positive integer no larger than "
                                           "4096, got 100000000000"),
        (dict(stability_threshold=10**8), "stability_threshold must be an integer >= 0 no larger than 4096"),
        (dict(entropy_bound=float("inf")), "entropy_bound must be > 0 and finite, got inf"),
        (dict(confidence_threshold=float("nan")), "confidence_threshold must be > 0 and finite, got nan"),
    ],
)
def test_bad_settings_raise_one_clear_generation_error(overrides, message):
    with pytest.raises(GenerationError) as info:
        SamplerSettings().with_overrides(**overrides).validate()
    assert str(info.value).startswith(message)


def test_overrides_of_none_keep_defaults():
    settings = SamplerSettings(t_min=0.3).with_overrides(t_min=None, t_max=0.9, eos_token_ids=[1, 2])
    assert (settings.t_min, settings.t_max, settings.eos_token_ids) == (0.3, 0.9, (1, 2))


def test_the_edges_of_the_finite_ranges_work():
    """The smallest temperatures and the most steps allowed give finite probabilities (the last step runs at
    MIN_TEMPERATURE / MAX_DENOISING_STEPS), and 0 still means greedy."""
    from printpress.sampling import MAX_DENOISING_STEPS, MIN_TEMPERATURE, check_setting

    settings = SamplerSettings(t_min=0.0, t_max=MIN_TEMPERATURE, max_denoising_steps=MAX_DENOISING_STEPS,
                               stability_threshold=MAX_DENOISING_STEPS).validate()
    logits = torch.randn(4, 32) * 30
    for step in (MAX_DENOISING_STEPS, 1):
        scaled = logits / step_temperature(step, settings)
        assert torch.isfinite(torch.softmax(scaled, dim=-1)).all() and torch.isfinite(token_entropy(scaled)).all()
    SamplerSettings(mode="ar", temperature=0).validate()
    SamplerSettings(mode="ar", temperature=MIN_TEMPERATURE).validate()
    check_setting("eos_token_ids", [1, 2])  # no rule: passes



# -- the one definition of the settings (printpress.settings.SETTINGS) ---------------------------------------


def test_the_settings_record_has_a_field_per_stored_setting_with_its_default():
    import dataclasses

    from printpress.config import GenerationConfig
    from printpress.settings import SETTINGS

    fields = {f.name: f.default for f in dataclasses.fields(SamplerSettings)}
    assert set(fields) == {s.name for s in SETTINGS if s.stored} | {"pad_token_id"}
    reference = GenerationConfig()
    for s in SETTINGS:
        if s.stored and s.checkpoint and s.name not in ("temperature", "top_k", "eos_token_ids"):
            assert fields[s.name] == getattr(reference, s.checkpoint), s.name
    # A bare record decodes greedily; a Pipeline's AR default is the checkpoint's (0.8, top-k 50).
    assert (fields["mode"], fields["temperature"], fields["top_k"], fields["eos_token_ids"]) == ("diffusion", 0.0,
                                                                                                 None, ())
    assert SamplerSettings(eos_token_ids=7).eos_token_ids == (7,) and SamplerSettings(eos_token_ids=None).eos_token_ids == ()


def test_flags_and_http_fields_are_derived_from_the_settings():
    """Every setting is a flag of `printpress generate` and, unless it has its own field there (max_new_tokens is
    `max_tokens`) or none (eos), a field of the completion requests; editing takes the diffusion sampler's, both on
    the command line and over HTTP."""
    import argparse

    from printpress.cli_flags import add_sampler_arguments
    from printpress.serve import protocol
    from printpress.settings import EDITING, SETTINGS

    def flags(**kwargs) -> set[str]:
        parser = argparse.ArgumentParser()
        add_sampler_arguments(parser, **kwargs)
        # how the model loads
        runtime = {"-h", "--help", "--dtype", "--device", "--quantize", "--compile", "--compile-weights",
                   "--canvas-length"}
        return {option for action in parser._actions for option in action.option_strings} - runtime

    off = {"--no-" + s.flag[2:] for s in SETTINGS if s.kind is bool}  # an on/off flag can be turned off too
    assert flags() == {s.flag for s in SETTINGS} | off
    assert off == {"--no-sliding", "--no-sample-accepted-only", "--no-fused-draft"}
    assert flags(settings=EDITING) == {"--steps", "--entropy-bound", "--t-min", "--t-max", "--stability-threshold",
                                       "--confidence-threshold", "--temperature", "--sample-accepted-only",
                                       "--no-sample-accepted-only", "--window-lead", "--canvas-top-k"}
    wire = {s.wire for s in SETTINGS if s.http is not None}
    assert wire == {s.wire for s in SETTINGS} - {"max_new_tokens", "eos"}
    for request in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        assert wire <= set(request.model_fields)
    edit_fields = set(protocol.EditRequest.model_fields)
    assert {s.wire for s in EDITING} <= edit_fields and not (wire - {s.wire for s in EDITING}) & edit_fields
    body = protocol.CompletionRequest(prompt="x", steps=4, mode="ar", top_k=3, sample_accepted_only=False)
    assert body.sampler_overrides() == {"max_denoising_steps": 4, "mode": "ar", "top_k": 3,
                                        "sample_accepted_only": False}


def test_key_value_settings_parse_into_engine_keywords():
    import re

    from printpress.settings import parse_assignments

    assert parse_assignments("mode=speculative, steps=1,temperature=0") == {"mode": "speculative",
                                                                           "max_denoising_steps": 1,
                                                                           "temperature": 0.0}
    assert parse_assignments("sample_accepted_only=yes,eos=1 2,t_max=0.4") == {"sample_accepted_only": True,
                                                                               "eos_token_ids": (1, 2), "t_max": 0.4}
    for text, message in [("beam=3", "expected key=value pairs with keys among mode, max_new_tokens, steps"),
                          ("steps", "expected key=value pairs"), ("steps=many", "steps cannot be 'many'"),
                          ("steps=0", "steps (max_denoising_steps) must be a positive integer"), (",", "at least one")]:
        with pytest.raises(GenerationError, match=re.escape(message)):
            parse_assignments(text)


def test_a_setting_refused_by_mode_names_the_modes_that_read_it():
    """The refusal comes from each setting's `modes`: one message shape for every setting and mode."""
    from printpress.settings import MODES, SETTINGS, refuse_unread

    defaults = SamplerSettings()
    for s in SETTINGS:
        for mode in MODES:
            value = 3  # not a default of any setting that passes at its default
            if mode in s.modes:
                refuse_unread(mode, {s.name: value}, defaults)
                continue
            with pytest.raises(GenerationError) as info:
                refuse_unread(mode, {s.name: value}, defaults)
            readers = " and ".join(repr(m) for m in MODES if m in s.modes)
            assert str(info.value).startswith(f"{s.label}=3 does not apply to mode={mode!r} (only mode")
            assert readers in str(info.value)
        if s.default_passes and s.stored:
            for mode in MODES:
                refuse_unread(mode, {s.name: getattr(defaults, s.name)}, defaults)  # asks for nothing: passes


@pytest.fixture(scope="module")
def draw_kernel():
    if not draw_kernels():
        pytest.skip("no C++ compiler for printpress's draw kernel on this machine")


@pytest.fixture(params=["kernel", "aten"])
def draw_path(request, monkeypatch):
    """Each exact draw both ways: through printpress's draw kernel, and through ATen's operators (what runs where
    the kernel cannot be built)."""
    if request.param == "kernel" and not draw_kernels():
        pytest.skip("no C++ compiler for printpress's draw kernel on this machine")
    if request.param == "aten":
        monkeypatch.setattr(sampling, "draw_kernels", lambda: False)
    return request.param


@pytest.mark.parametrize("shape", [(4096,), (32, 4096), (3, 30001), (2, 3, 50), (1, 7)])
@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_one_draw_per_row_is_torch_multinomials_and_leaves_the_generator_where_it_would(draw_path, shape, seed):
    probs = torch.softmax(3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed)), dim=-1)
    probs[..., :5] = 0  # impossible tokens stay impossible
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for _ in range(3):
        want = torch.multinomial(probs.reshape(-1, shape[-1]), 1, generator=theirs).view(shape[:-1])
        assert torch.equal(multinomial_one(probs, ours), want)
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_exponentials_are_bit_identical_to_tensor_exponential():
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    want = torch.empty(3_000_000).exponential_(generator=theirs)
    uniform = torch.empty(3_000_000, dtype=torch.float64).uniform_(generator=ours)
    assert torch.equal(exponential_like_torch(uniform), want)


def scalar_exponentials(uniform: torch.Tensor) -> torch.Tensor:
    """What `exponential_` makes of each u, one element at a time with libm's scalar log1p."""
    return torch.tensor([-math.log1p(-u) for u in uniform.tolist()], dtype=torch.float64).float()


def near_rounding_boundaries() -> torch.Tensor:
    """14,000 u whose -log1p(-u) lies within a few double ulps of a point halfway between two floats: where a
    vectorised log1p's last bit can decide the float."""
    floats = torch.rand(2000, generator=torch.Generator().manual_seed(0)).double() * 5 + 1e-3
    halfway = (floats.float().double() + torch.nextafter(floats.float(), torch.tensor(10.0)).double()) / 2
    return torch.cat([-torch.expm1(-(halfway + k * 2.0**-52 * halfway)) for k in range(-3, 4)])


def test_exponentials_near_a_float_rounding_boundary_take_the_scalar_log1p():
    uniform = near_rounding_boundaries()
    assert torch.equal(exponential_like_torch(uniform), scalar_exponentials(uniform))


def test_a_uniform_of_zero_makes_a_positive_zero():
    """u = 0 (one draw in 2**53): -log1p(-0) is +0.0, so a positive probability over it is +inf (the token is
    drawn), as torch.multinomial's division makes it; a -0.0 would make it -inf."""
    uniform = torch.tensor([0.5, 0.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1], dtype=torch.float64)
    q = exponential_like_torch(uniform)
    assert torch.equal(q, scalar_exponentials(uniform)) and not torch.signbit(q).any()


def draws_as_torch_makes_them(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """torch.multinomial's one draw per row from given uniforms: argmax(p / q), q from the scalar log1p."""
    return torch.argmax(probs / scalar_exponentials(uniform).view(probs.shape), dim=-1)


def test_the_kernel_draws_from_given_uniforms_what_torch_draws_from_them(draw_kernel):
    """`printpress_draw::multinomial_from_uniforms`, which takes logarithms only where p / u (a bound on p / q)
    could reach the row's largest ratio: the same index as every ratio computed, on rows built to make the bound
    mislead (large u, whose bound is loose), exact ties (the first wins), a uniform of 0 over a positive probability
    (+inf: drawn) and over a zero one (0 / 0 = NaN: drawn, as torch.argmax takes a NaN), weights whose ratios pass
    float's range, and rows of every temper."""
    generator = torch.Generator().manual_seed(11)
    rows = []
    for scale in (0.0, 0.5, 3.0, 12.0):  # flat to peaked
        rows.append(torch.softmax(scale * torch.randn(8, 4096, generator=generator), dim=-1))
    probs = torch.cat(rows)
    uniform = torch.rand(probs.shape, generator=generator, dtype=torch.float64)
    # Row 0: the bound's largest (a large u: a loose bound) is not the draw.
    probs[0], uniform[0] = 1e-6, 0.5
    probs[0, 20], uniform[0, 20] = 0.5, 0.9999  # bound 0.5, ratio 0.054
    probs[0, 10], uniform[0, 10] = 0.01, 0.1  # bound 0.1, ratio 0.095: drawn
    # Row 1: an exact tie, the later element with the larger bound (p and q both doubled); the first wins.
    # Row 2: a zero uniform over p > 0. Row 3: over p = 0, beside it.
    probs[1], uniform[1] = 1.0 / 4096, 0.5
    uniform[1, 100] = 1e-3
    probs[1, 3000], uniform[1, 3000] = 2.0 / 4096, -math.expm1(-2 * float(scalar_exponentials(uniform[1, 100:101])))
    assert scalar_exponentials(uniform[1, 3000:3001]) == 2 * scalar_exponentials(uniform[1, 100:101])
    uniform[2, 7] = 0.0
    probs[3, 5], uniform[3, 5], uniform[3, 9] = 0.0, 0.0, 0.0
    uniform[4, :2000] = 1 - 2.0**-53  # the largest u: q ~ 36.7
    # Row 5: unnormalised weights near float's largest (torch.multinomial takes weights): ratios past its range are
    # +inf, the first of them drawn, though a later one has the larger bound.
    probs[5, 40], uniform[5, 40] = 3.4e38, 0.9  # ratio 1.48e38
    probs[5, 41], uniform[5, 41] = 3.4e38, 0.4  # ratio 6.7e38: inf
    probs[5, 42], uniform[5, 42] = 3.4e38, 1e-3  # inf, bound inf
    uniform = uniform.reshape(-1)
    want = draws_as_torch_makes_them(probs, uniform)
    assert want[:4].tolist() == [10, 100, 7, 5] and want[5] == 41
    assert torch.equal(torch.ops.printpress_draw.multinomial_from_uniforms(probs, uniform), want)
    near = near_rounding_boundaries()[:4096]  # u where the float of -log1p(-u) needs the last bit of the double
    flat = torch.full((1, 4096), 1.0 / 4096)
    assert torch.equal(torch.ops.printpress_draw.multinomial_from_uniforms(flat, near),
                       draws_as_torch_makes_them(flat, near))
    with pytest.raises(RuntimeError, match="expects one float64 uniform per probability"):
        torch.ops.printpress_draw.multinomial_from_uniforms(probs, uniform[1:])


@pytest.mark.parametrize("used", [0, 1, 623, 624, 625, 1247])  # 32-bit words already taken: around twists
def test_the_kernels_uniforms_are_uniform_s_and_leave_the_generator_where_it_would(draw_kernel, used):
    """`printpress_draw::uniform(n, generator)`, the stream the kernel's draws read: the doubles `uniform_` makes,
    from any point of the Mersenne Twister's 624-word blocks, with the generator's state after them the same."""
    for n in [0, 1, 311, 312, 313, 624, 100_001]:
        ours, theirs = torch.Generator().manual_seed(n + used), torch.Generator().manual_seed(n + used)
        for generator in (ours, theirs):
            torch.empty(used).uniform_(generator=generator)  # float32: one word each
        assert torch.equal(torch.ops.printpress_draw.uniform(n, ours),
                           torch.empty(n, dtype=torch.float64).uniform_(generator=theirs))
        assert torch.equal(ours.get_state(), theirs.get_state())
        assert torch.equal(torch.rand(3, generator=ours), torch.rand(3, generator=theirs))


def test_the_argmax_kernel_picks_what_torch_max_picks(draw_kernel):
    """`printpress_draw::row_argmax` (what `sampling.row_argmax` runs on a CPU): the first of equal
    maxima, a NaN as the maximum (the first NaN), -0.0 equal to 0.0, any shape and layout."""
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(9, 100, generator=generator)
    rows[1, [7, 40, 93]] = 50.0  # ties: the first
    rows[2, [3, 64]] = float("nan")  # a NaN wins, the first one
    rows[2, 10] = float("inf")
    rows[3] = float("-inf")  # nothing but -inf: index 0
    rows[4] = 0.0
    rows[4, 0], rows[4, 5] = -0.0, 0.0  # equal: the first
    rows[5, 99] = 80.0  # in the scalar tail
    rows[6, 96:] = float("nan")  # NaNs in the tail only
    cases = [rows, rows[:, ::2], rows.T, rows.reshape(3, 3, 100), rows[0], torch.randn(2, 4096, generator=generator)]
    for x in cases:
        expected = torch.max(x, dim=-1).indices
        assert torch.equal(torch.ops.printpress_draw.row_argmax(x), expected)
        assert torch.equal(row_argmax(x), expected)
    assert torch.ops.printpress_draw.row_argmax(rows)[:7].tolist() == [int(rows[0].argmax()), 7, 3, 0, 0, 99, 96]
    with pytest.raises(RuntimeError, match="expects a float32 tensor whose last dimension is not empty"):
        torch.ops.printpress_draw.row_argmax(rows.double())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_probabilities_torch_would_refuse_get_its_error(draw_path, bad):
    """Refused before anything is drawn (the generator has not moved), with torch.multinomial's own message."""
    probs = torch.full((2, 4096), 1 / 4096)
    probs[1, 3] = bad
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        multinomial_one(probs, generator)
    zero_row = torch.full((2, 4096), 1 / 4096)
    zero_row[1] = 0
    with pytest.raises(RuntimeError, match="invalid multinomial distribution"):
        multinomial_one(zero_row, generator)
    assert torch.equal(generator.get_state(), state)


def test_other_dtypes_are_drawn_by_torch_multinomial_itself():
    probs = torch.softmax(torch.randn(4, 64, dtype=torch.float64), dim=-1)
    ours, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(multinomial_one(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(-1))
