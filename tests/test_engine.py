"""The engine reproduces transformers' DiffusionGemma `generate` token for token, batches without
changing any request's tokens, streams its steps, and rejects bad input with one clear error."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

import printpress
from printpress.engine import (
    CommitEvent,
    DiffusionBatch,
    DoneEvent,
    GenerationResult,
    Request,
    StepEvent,
    default_model_path,
    run,
)
from printpress.errors import GenerationError, PrintpressError
from printpress.request import RequestState
from printpress.sampling import SamplerSettings

from helpers import causal_log_probs, make_reference, save_checkpoint


def reference_tokens(ref, prompt: list[int], seed: int, **settings) -> tuple[list[int], float]:
    """New tokens and tokens-per-forward from transformers' generate under torch.manual_seed."""
    kwargs = dict(settings)
    if "entropy_bound" in kwargs:
        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=kwargs.pop("entropy_bound"))
    if "eos_token_ids" in kwargs:
        kwargs["eos_token_id"] = kwargs.pop("eos_token_ids")
    torch.manual_seed(seed)
    out = ref.generate(torch.tensor([prompt]), **kwargs)
    return out.sequences[0, len(prompt):].tolist(), float(out.tokens_per_forward[0])


PROMPTS = [[2, 7, 9, 11], [2, 40], [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]  # the last beats every window

# (name, settings): one canvas, several canvases, several samplers, early stops and EOS.
CASES = [
    ("gqa", dict(max_new_tokens=8)),
    ("gqa", dict(max_new_tokens=20)),
    ("gqa", dict(max_new_tokens=24, max_denoising_steps=3, t_min=0.1, t_max=1.5, entropy_bound=2.0)),
    ("gqa", dict(max_new_tokens=32, max_denoising_steps=4, eos_token_ids=list(range(3, 20)))),
    ("mha", dict(max_new_tokens=12)),
    ("mha", dict(max_new_tokens=12, entropy_bound=50.0, confidence_threshold=10.0, stability_threshold=0)),
    ("default_pattern", dict(max_new_tokens=32, max_denoising_steps=3)),
    ("peaked", dict(max_new_tokens=24, max_denoising_steps=8, t_min=0.05, t_max=0.1, entropy_bound=1.0)),
    ("peaked", dict(max_new_tokens=24, max_denoising_steps=8, t_min=0.02, t_max=0.05, entropy_bound=1.0,
                    confidence_threshold=0.05, stability_threshold=2)),
    ("peaked", dict(max_new_tokens=40, max_denoising_steps=6, t_min=0.02, t_max=0.05, entropy_bound=1.0,
                    confidence_threshold=0.05, eos_token_ids=[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30])),
]


# Cases 1, 8 and 9 repeat what the others check (several canvases; confidence, stability and EOS stops) on
# other weights: they run with the slow tests.
PARITY_CASES = [pytest.param(*case, marks=pytest.mark.slow) if i in (1, 8, 9) else case
                for i, case in enumerate(CASES)]


@pytest.mark.parametrize("name,settings", PARITY_CASES)
def test_tokens_equal_reference_generate(models_, name, settings):
    ref, pipe = models_[name]
    for prompt in PROMPTS:
        for seed in (0, 7):
            expected, tokens_per_forward = reference_tokens(ref, prompt, seed, **settings)
            result = pipe.generate(prompt, seed=seed, **settings)
            assert result.token_ids == expected, (prompt, seed)
            assert result.stats.tokens_per_forward == pytest.approx(tokens_per_forward, rel=1e-6)


def test_checkpoint_generation_config_supplies_the_defaults(models_):
    ref, pipe = models_["gqa"]
    torch.manual_seed(3)
    expected = ref.generate(torch.tensor([PROMPTS[0]])).sequences[0, len(PROMPTS[0]):].tolist()
    result = pipe.generate(PROMPTS[0], seed=3)
    assert result.token_ids == expected
    assert result.stats.canvases == 2  # 16 new tokens in canvases of 8
    assert result.stats.forward_passes == 10  # 5 steps each


@pytest.mark.parametrize("canvas", [4, 12])
def test_a_canvas_length_given_at_load_decodes_as_the_reference_with_that_canvas(tmp_path, canvas):
    """`load(..., canvas_length=N)` is the checkpoint with N in config.json: token-exact to the reference decoding
    with that canvas, and `save_pretrained` writes it."""
    ref = make_reference("gqa", canvas_length=8)
    pipe = printpress.load(save_checkpoint(ref, tmp_path / "model"), canvas_length=canvas)
    assert pipe.canvas_length == canvas
    ref.config.canvas_length = canvas
    for seed in (0, 7):
        expected, tokens_per_forward = reference_tokens(ref, PROMPTS[0], seed, max_new_tokens=20, eos_token_ids=[])
        result = pipe.generate(PROMPTS[0], seed=seed, max_new_tokens=20, eos_token_ids=[])
        assert result.token_ids == expected, seed
        assert result.stats.canvases == math.ceil(20 / canvas)
        assert result.stats.tokens_per_forward == pytest.approx(tokens_per_forward, rel=1e-6)
    assert printpress.load(pipe.save_pretrained(tmp_path / "saved")).canvas_length == canvas


@pytest.mark.parametrize("canvas", [0, -4, 2.5, True])
def test_a_canvas_length_that_is_not_a_positive_int_is_refused_before_loading(tmp_path, canvas):
    with pytest.raises(PrintpressError, match=rf"^canvas_length {canvas!r} is not supported; give a positive number"):
        printpress.load(tmp_path / "never-read", canvas_length=canvas)


def test_ar_samples_at_the_checkpoints_defaults_and_greedy_only_when_asked(models_):
    """Issue 14: AR decoding samples (0.8, top-k 50 when generation_config.json is silent, as the shipped models'
    is), so the seed matters; temperature=0 is greedy. A file with transformers' keys is read as transformers reads
    it, and a save writes them back only when they differ from the default."""
    from printpress.config import GenerationConfig

    _, pipe = models_["gqa"]
    settings = pipe.settings(mode="ar")
    assert (settings.temperature, settings.top_k) == (0.8, 50)
    sampled = [pipe.generate(PROMPTS[0], mode="ar", seed=s, max_new_tokens=9, eos_token_ids=[]).token_ids
               for s in (1, 2)]
    assert sampled[0] != sampled[1]
    assert sampled[0] == pipe.generate(PROMPTS[0], mode="ar", seed=1, max_new_tokens=9, eos_token_ids=[],
                                       temperature=0.8, top_k=50).token_ids
    for data, expected in [({}, (0.8, 50)), ({"do_sample": False}, (0.0, 50)), ({"do_sample": True}, (1.0, 50)),
                           ({"do_sample": True, "temperature": 0.6, "top_k": 0}, (0.6, None)),
                           ({"temperature": 0.7}, (0.0, 50))]:  # transformers: no do_sample, no sampling
        config = GenerationConfig.from_dict(data)
        assert (config.temperature, config.top_k) == expected, data
        assert GenerationConfig.from_dict(config.to_dict()) == config
    assert not {"do_sample", "temperature", "top_k"} & set(GenerationConfig().to_dict())
    with pytest.raises(PrintpressError, match="do_sample must be true or false"):
        GenerationConfig.from_dict({"do_sample": "yes"})


def test_temperature_in_diffusion_mode_multiplies_the_schedule(models_):
    from printpress.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE

    _, pipe = models_["gqa"]
    base = pipe.settings(t_min=0.3, t_max=0.9)
    for temperature, (t_min, t_max) in [(1, (0.3, 0.9)), (0.5, (0.15, 0.45)), (2, (0.6, 1.8)),
                                        (0, (0.0, MIN_TEMPERATURE)), (1e-4, (MIN_TEMPERATURE, MIN_TEMPERATURE))]:
        scaled = pipe.settings(t_min=0.3, t_max=0.9, temperature=temperature)
        assert (scaled.t_min, scaled.t_max) == pytest.approx((t_min, t_max)), temperature
        assert scaled.max_denoising_steps == base.max_denoising_steps and scaled.mode == "diffusion"
    hot = pipe.settings(t_min=0.3, t_max=2.0, temperature=1e4)  # ends clamped into the accepted range
    assert (hot.t_min, hot.t_max) == pytest.approx((3000.0, MAX_TEMPERATURE))
    one = pipe.generate(PROMPTS[0], seed=4, max_new_tokens=8, temperature=1)
    assert one.token_ids == pipe.generate(PROMPTS[0], seed=4, max_new_tokens=8).token_ids  # 1: the checkpoint's
    half = pipe.generate(PROMPTS[0], seed=4, max_new_tokens=8, temperature=0.5)
    defaults = pipe.settings()
    assert half.token_ids == pipe.generate(PROMPTS[0], seed=4, max_new_tokens=8, t_min=defaults.t_min * 0.5,
                                           t_max=defaults.t_max * 0.5).token_ids


def test_early_stop_and_eos_are_exercised(models_):
    """Guard for the parity cases above: they do cover the adaptive stop and EOS padding."""
    _, pipe = models_["peaked"]
    stops = pipe.generate(PROMPTS[:2], seed=[0, 7], **CASES[8][1])
    assert any(r.stats.forward_passes < r.stats.canvases * 8 for r in stops)
    eos = pipe.generate(PROMPTS, seed=0, **CASES[9][1])
    assert any(r.stats.finish_reason == "eos" and r.token_ids[-1] == 0 for r in eos)
    eos_ids = set(CASES[9][1]["eos_token_ids"])
    for r in eos:
        first = next((i for i, t in enumerate(r.token_ids) if t in eos_ids), len(r.token_ids))
        assert r.completion_ids == r.token_ids[: min(first, CASES[9][1]["max_new_tokens"])]


def test_unseeded_runs_repeat_under_torch_manual_seed(models_):
    _, pipe = models_["gqa"]
    torch.manual_seed(11)
    first = pipe.generate(PROMPTS[0]).token_ids
    torch.manual_seed(11)
    assert pipe.generate(PROMPTS[0]).token_ids == first


# -- batching ------------------------------------------------------------------------------------------

BATCH = [[2, 7, 9, 11, 13, 17], [2, 40], [2, 5, 6, 7], [2, 99, 98, 97, 96, 95, 94, 93, 92]]


@pytest.mark.parametrize(
    "name,settings",
    [
        ("gqa", dict(max_new_tokens=24, max_denoising_steps=4, eos_token_ids=list(range(3, 8)))),
        ("peaked", dict(max_new_tokens=32, max_denoising_steps=6, t_min=0.02, t_max=0.05, entropy_bound=1.0,
                        confidence_threshold=0.05, eos_token_ids=list(range(20, 31)))),
        ("gqa", dict(mode="ar", max_new_tokens=10, temperature=0, eos_token_ids=list(range(3, 9)))),
        ("gqa", dict(mode="ar", max_new_tokens=10, temperature=1.0, eos_token_ids=list(range(3, 9)))),
    ],
)
def test_batched_rows_equal_each_prompt_alone(models_, name, settings):
    _, pipe = models_[name]
    seeds = [5, 6, 7, 8]
    batch = pipe.generate(BATCH, seed=seeds, **settings)
    for prompt, seed, row in zip(BATCH, seeds, batch):
        alone = pipe.generate(prompt, seed=seed, **settings)
        assert row.token_ids == alone.token_ids
        assert row.stats.forward_passes == alone.stats.forward_passes
    # The case is only meaningful if rows finish at different times.
    assert len({r.stats.forward_passes for r in batch}) > 1


def test_per_prompt_seeds_and_order_do_not_matter(models_):
    _, pipe = models_["gqa"]
    settings = dict(max_new_tokens=16, max_denoising_steps=3)
    forward = pipe.generate(BATCH, seed=[1, 2, 3, 4], **settings)
    backward = pipe.generate(BATCH[::-1], seed=[4, 3, 2, 1], **settings)
    assert [r.token_ids for r in forward] == [r.token_ids for r in backward[::-1]]
    assert forward[1].token_ids == pipe.generate(BATCH[1], seed=2, **settings).token_ids


def test_finished_rows_stop_costing_compute(models_, monkeypatch):
    """Rows that hit EOS or the adaptive stop leave the batch: decoder rows = sum of each row's passes."""
    _, pipe = models_["peaked"]
    model = pipe.model
    decoded_rows: list[int] = []
    encoded_rows: list[int] = []
    denoise, encode = model.denoise, model.encode

    def counting_denoise(canvas_ids, cache, *args, **kwargs):
        assert cache.batch_size == canvas_ids.shape[0]
        decoded_rows.append(canvas_ids.shape[0])
        return denoise(canvas_ids, cache, *args, **kwargs)

    def counting_encode(input_ids, cache, *args, **kwargs):
        encoded_rows.append(input_ids.shape[0])
        return encode(input_ids, cache, *args, **kwargs)

    monkeypatch.setattr(model, "denoise", counting_denoise)
    monkeypatch.setattr(model, "encode", counting_encode)
    results = pipe.generate(BATCH, seed=5, **CASES[9][1])
    assert sum(decoded_rows) == sum(r.stats.forward_passes for r in results)
    assert min(decoded_rows) < len(BATCH)
    # One prefill per request, then one encode per canvas committed by a request that goes on; each request
    # owns its cache, so each encode is one row.
    assert set(encoded_rows) == {1}
    assert len(encoded_rows) == len(BATCH) + sum(r.stats.canvases - 1 for r in results)


# -- streaming -----------------------------------------------------------------------------------------


def test_step_stream_describes_every_step_and_commit(models_):
    _, pipe = models_["peaked"]
    settings = dict(max_new_tokens=24, max_denoising_steps=6, t_min=0.02, t_max=0.05, entropy_bound=1.0,
                    confidence_threshold=0.05)
    events = list(pipe.stream(BATCH[:3], seed=9, **settings))
    results = {e.request: e.result for e in events if isinstance(e, DoneEvent)}
    assert sorted(results) == [0, 1, 2]
    for request, result in results.items():
        mine = [e for e in events if getattr(e, "request", None) == request]
        assert isinstance(mine[-1], DoneEvent)
        steps = [e for e in mine if isinstance(e, StepEvent)]
        commits = [e for e in mine if isinstance(e, CommitEvent)]
        assert len(steps) == result.stats.forward_passes
        assert sum((c.token_ids for c in commits), []) == result.token_ids
        assert [c.finished for c in commits] == [False] * (len(commits) - 1) + [True]
        assert "".join(c.text for c in commits) == result.text
        for commit in commits:
            canvas_steps = [s for s in steps if s.canvas == commit.canvas]
            assert [s.step for s in canvas_steps] == list(range(1, len(canvas_steps) + 1))
            last = canvas_steps[-1]
            assert last.stopped or last.step == last.max_steps  # the stop may also fire at the last step
            assert not any(s.stopped for s in canvas_steps[:-1])
            # Commit = the last argmax, with pad after the first EOS.
            assert all(t == a or t == 0 for t, a in zip(commit.token_ids, last.argmax))
            for s in canvas_steps:
                assert len(s.tokens) == len(s.accepted) == pipe.canvas_length
                assert s.renoised == [not a for a in s.accepted]
                assert any(s.accepted)  # the lowest-entropy position is always accepted


def test_on_event_callback_sees_the_same_stream(models_):
    _, pipe = models_["gqa"]
    seen: list = []
    result = pipe.generate(PROMPTS[1], seed=2, on_event=seen.append, max_new_tokens=16)
    streamed = list(pipe.stream(PROMPTS[1], seed=2, max_new_tokens=16))
    assert seen[:-1] == streamed[:-1]  # the DoneEvents differ only in their timings
    assert seen[-1].result.token_ids == streamed[-1].result.token_ids == result.token_ids


# -- statistics ----------------------------------------------------------------------------------------


def test_statistics_are_consistent(models_):
    _, pipe = models_["gqa"]
    result = pipe.generate(PROMPTS[0], seed=1, max_new_tokens=20, max_denoising_steps=4)
    stats = result.stats
    assert stats.prompt_tokens == len(PROMPTS[0])
    assert stats.canvases == 3 and len(result.token_ids) == 24  # whole canvases, as the reference
    assert stats.denoising_steps == stats.forward_passes == 12
    assert stats.new_tokens == sum(1 for t in result.token_ids if t != 0)
    assert stats.tokens_per_forward == stats.new_tokens / stats.forward_passes
    assert 0 < stats.time_to_first_commit_s <= stats.wall_time_s
    assert stats.finish_reason in ("eos", "length")


# -- autoregressive mode -------------------------------------------------------------------------------


@torch.no_grad()
def reference_greedy(ref, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding with the reference encoder, re-running the whole sequence for every token."""
    ids = list(prompt)
    canvas = torch.zeros(1, ref.config.canvas_length, dtype=torch.long)
    for _ in range(new_tokens):
        out = ref(input_ids=torch.tensor([ids]), decoder_input_ids=canvas)
        logits = ref.lm_head(out.encoder_last_hidden_state[:, -1]).float()
        cap = ref.config.text_config.final_logit_softcapping
        ids.append(int(torch.argmax(torch.tanh(logits / cap) * cap)))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", ["gqa", "mha", "default_pattern"])
def test_greedy_ar_equals_reference_encoder_argmax(models_, name):
    ref, pipe = models_[name]
    for prompt in PROMPTS[:2]:
        result = pipe.generate(prompt, mode="ar", temperature=0, max_new_tokens=9, eos_token_ids=[])
        assert result.token_ids == reference_greedy(ref, prompt, 9)
        assert result.stats.tokens_per_forward == 1.0 and result.stats.denoising_steps == 0
        assert result.stats.finish_reason == "length"


def test_ar_stops_at_eos_and_sampling_follows_the_seed(models_):
    _, pipe = models_["gqa"]
    greedy = pipe.generate(PROMPTS[0], mode="ar", temperature=0, max_new_tokens=9, eos_token_ids=[])
    eos = greedy.token_ids[3]
    stopped = pipe.generate(PROMPTS[0], mode="ar", temperature=0, max_new_tokens=9, eos_token_ids=[eos])
    first = greedy.token_ids.index(eos)
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    assert stopped.stats.finish_reason == "eos" and stopped.completion_ids == greedy.token_ids[:first]
    sampled = [pipe.generate(PROMPTS[0], mode="ar", temperature=1.0, seed=s, max_new_tokens=9).token_ids
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


# -- text in, text out ---------------------------------------------------------------------------------


def test_text_prompts_are_tokenized_with_bos_and_decoded(models_):
    _, pipe = models_["peaked"]
    settings = dict(max_new_tokens=8, max_denoising_steps=3)
    result = pipe.generate("w7 w9 w11", seed=4, **settings)
    assert isinstance(result, GenerationResult)
    assert result.prompt_ids == [2, 7, 9, 11]
    assert result.token_ids == pipe.generate([2, 7, 9, 11], seed=4, **settings).token_ids
    assert result.text == pipe.decode(result.completion_ids)
    several = pipe.generate(["w7 w9 w11", "w40"], seed=4, **settings)
    assert [r.prompt_ids for r in several] == [[2, 7, 9, 11], [2, 40]]
    # Special-token markup is parsed, and a prompt that starts with BOS gets no second one.
    assert pipe.encode_text("<bos> w7 <eos>") == [2, 7, 1]


def test_requests_with_different_settings_share_a_batch(models_):
    _, pipe = models_["peaked"]
    fast = pipe.settings(max_new_tokens=8, max_denoising_steps=2, entropy_bound=1.0)
    slow = pipe.settings(max_new_tokens=24, max_denoising_steps=6, t_min=0.02, t_max=0.05, entropy_bound=1.0,
                         confidence_threshold=0.05, stability_threshold=2)
    requests = [Request(BATCH[0], slow, 3), Request(BATCH[1], fast, 4), Request(BATCH[2], slow, 5)]
    together = {e.request: e.result for e in run(pipe.model, pipe.canvas_length, requests) if isinstance(e, DoneEvent)}
    for index, request in enumerate(requests):
        alone = pipe.generate(request.prompt_ids, seed=request.seed, **_as_overrides(request.settings))
        assert together[index].token_ids == alone.token_ids


def _as_overrides(settings) -> dict:
    names = ("max_new_tokens", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
             "confidence_threshold")
    return {name: getattr(settings, name) for name in names}


def test_prompt_forms(models_):
    _, pipe = models_["gqa"]
    single = pipe.generate(torch.tensor(PROMPTS[1]), seed=0, max_new_tokens=8)
    assert isinstance(single, GenerationResult)
    assert single.text is None  # no tokenizer
    assert len(pipe.generate(torch.tensor([PROMPTS[1], PROMPTS[1]]), seed=0, max_new_tokens=8)) == 2
    assert len(pipe.generate([PROMPTS[1]], seed=0, max_new_tokens=8)) == 1


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt,settings,message",
    [
        ([], {}, "the prompt is empty"),
        ([[2, 3], []], {}, "the prompt is empty"),
        ([2] * 512, {}, "the prompt has 512 tokens; the model's position limit is 512"),
        ([2] * 500, dict(max_new_tokens=16), "a prompt of 500 tokens plus 16 new tokens exceeds the model's position limit of 512"),
        ([2, 500], {}, "prompt token id 500 is outside the vocabulary (0..127)"),
        ([2, 3], dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        ([2, 3], dict(max_denoising_steps=0), "steps (max_denoising_steps) must be a positive integer"),
        ([2, 3], dict(entropy_bound=0.0), "entropy_bound must be > 0"),
        ([2, 3], dict(t_min=0.9, t_max=0.2), "t_min (0.9) must not exceed t_max (0.2)"),
        ([2, 3], dict(mode="beam"), "unknown mode 'beam'"),
        ([2, 3], dict(top_k=5), "top_k=5 does not apply to mode='diffusion'"),
        ([2, 3], dict(steps=4), "unknown generation setting(s): steps"),
        ("some text", {}, "this model has no tokenizer (tokenizer.json); pass token ids instead of text"),
        ([[2, 3], [2, 4]], dict(seed=[1]), "got 1 seeds for 2 prompts"),
        ([2, 3], dict(seed=-1), "a seed must be an integer in [0, 2**64), got -1"),
    ],
)
def test_bad_input_raises_one_clear_generation_error(models_, prompt, settings, message):
    _, pipe = models_["gqa"]
    settings = dict(settings)
    seed = settings.pop("seed", 0)
    with pytest.raises(GenerationError) as info:
        pipe.generate(prompt, seed=seed, **settings)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(draft_steps=2), "draft_steps=2 does not apply to mode='diffusion' (only mode 'speculative' uses it); "
                              "leave it out"),
        (dict(mode="ar", draft_steps=2), "draft_steps=2 does not apply to mode='ar'"),
        (dict(mode="speculative", draft_steps=2, max_denoising_steps=2), "give draft_steps or max_denoising_steps"),
        (dict(top_k=5), "top_k=5 does not apply to mode='diffusion'"),
        (dict(mode="ar", max_denoising_steps=4), "steps (max_denoising_steps)=4 does not apply to mode='ar' (only modes "
                                                 "'diffusion' and 'speculative' use it)"),
        (dict(mode="ar", entropy_bound=2.0), "entropy_bound=2.0 does not apply to mode='ar'"),
        (dict(mode="ar", t_min=0.1), "t_min=0.1 does not apply to mode='ar'"),
        (dict(mode="ar", t_max=0.9), "t_max=0.9 does not apply to mode='ar'"),
        (dict(mode="ar", stability_threshold=3), "stability_threshold=3 does not apply to mode='ar' (only mode "
                                                 "'diffusion' uses it)"),
        (dict(mode="ar", confidence_threshold=0.5), "confidence_threshold=0.5 does not apply to mode='ar'"),
        (dict(mode="ar", sample_accepted_only=True), "sample_accepted_only=True does not apply to mode='ar'"),
        (dict(mode="speculative", window_lead=1.5), "window_lead=1.5 does not apply to mode='speculative' (only mode "
                                                    "'diffusion' uses it)"),
        (dict(window_lead=-1.0), "window_lead must be >= 0 and finite, got -1.0"),
        (dict(mode="ar", canvas_top_k=50), "canvas_top_k=50 does not apply to mode='ar' (only modes 'diffusion' and "
                                           "'speculative' use it)"),
        (dict(mode="speculative", stability_threshold=3), "stability_threshold=3 does not apply to mode='speculative' "
                                                          "(only mode 'diffusion' uses it)"),
        (dict(mode="speculative", confidence_threshold=0.5), "confidence_threshold=0.5 does not apply to "
                                                             "mode='speculative'"),
    ],
)
def test_a_setting_the_mode_cannot_honour_is_refused(models_, settings, message):
    _, pipe = models_["gqa"]
    with pytest.raises(GenerationError) as info:
        pipe.generate([2, 3], seed=0, max_new_tokens=4, **settings)
    assert str(info.value).startswith(message)


def test_settings_that_ask_for_nothing_more_pass_in_every_mode(models_):
    """A client may send the same settings to every mode: the checkpoint's own values of the diffusion settings
    and the exact sampler ask for nothing a mode does not do anyway."""
    _, pipe = models_["gqa"]
    d = pipe.default_settings()
    echoed = dict(max_denoising_steps=d.max_denoising_steps, entropy_bound=d.entropy_bound, t_min=d.t_min,
                  t_max=d.t_max, stability_threshold=d.stability_threshold,
                  confidence_threshold=d.confidence_threshold, sample_accepted_only=False)
    plain = pipe.generate([2, 3], mode="ar", seed=0, max_new_tokens=6)
    assert pipe.generate([2, 3], mode="ar", seed=0, max_new_tokens=6, **echoed).token_ids == plain.token_ids
    stop = dict(stability_threshold=d.stability_threshold, confidence_threshold=d.confidence_threshold)
    assert pipe.settings(mode="speculative", **stop) == pipe.settings(mode="speculative")


def test_empty_text_prompt_is_rejected(models_):
    _, pipe = models_["peaked"]
    with pytest.raises(GenerationError, match="the prompt is empty"):
        pipe.generate("", seed=0)


def test_default_model_can_be_pointed_elsewhere(monkeypatch, tmp_path):
    monkeypatch.setenv("PRINTPRESS_DEFAULT_MODEL", str(tmp_path / "missing"))
    assert default_model_path() == tmp_path / "missing"
    with pytest.raises(PrintpressError, match="no such model folder"):
        printpress.load()


def test_sample_accepted_only_is_opt_in_repeatable_and_keeps_the_acceptance(models_):
    ref, pipe = models_["peaked"]
    settings = dict(max_new_tokens=24, max_denoising_steps=8, t_min=0.05, t_max=0.1, entropy_bound=1.0)
    exact_events = [e for e in pipe.stream(PROMPTS[0], seed=4, **settings) if isinstance(e, StepEvent)]
    fast = pipe.generate(PROMPTS[0], seed=4, sample_accepted_only=True, **settings)
    again = pipe.generate(PROMPTS[0], seed=4, sample_accepted_only=True, **settings)
    assert fast.token_ids == again.token_ids
    fast_events = [e for e in pipe.stream(PROMPTS[0], seed=4, sample_accepted_only=True, **settings)
                   if isinstance(e, StepEvent)]
    # The same initial canvas and logits, so the first step accepts the same positions; the draws differ after.
    assert fast_events[0].accepted == exact_events[0].accepted
    # Default stays token-exact to the reference.
    expected, _ = reference_tokens(ref, PROMPTS[0], 4, **settings)
    assert pipe.generate(PROMPTS[0], seed=4, **settings).token_ids == expected
    with pytest.raises(GenerationError, match="sample_accepted_only must be true or false"):
        pipe.generate(PROMPTS[0], seed=4, sample_accepted_only="yes", **settings)


def test_window_lead_keeps_only_the_opened_positions_and_is_off_by_default(models_):
    ref, pipe = models_["peaked"]
    settings = dict(max_new_tokens=24, max_denoising_steps=6, t_min=0.05, t_max=0.1, entropy_bound=50.0,
                    confidence_threshold=1e-9)  # a loose bound: without the window most positions would be kept
    # Off (0, the default) is the reference's sampler, token for token; 0 given explicitly is the same request.
    expected, _ = reference_tokens(ref, PROMPTS[0], 4, **settings)
    assert pipe.generate(PROMPTS[0], seed=4, **settings).token_ids == expected
    assert pipe.generate(PROMPTS[0], seed=4, window_lead=0.0, **settings).token_ids == expected
    steps = [e for e in pipe.stream(PROMPTS[0], seed=4, window_lead=1.5, **settings) if isinstance(e, StepEvent)]
    length = pipe.canvas_length
    opened = [math.ceil(length * 1.5 * j / 6) if 1.5 * j < 6 else length for j in range(1, 7)]
    assert opened[:3] == [math.ceil(length / 4), math.ceil(length / 2), math.ceil(3 * length / 4)]
    for event in steps:
        kept = [i for i, a in enumerate(event.accepted) if a]
        assert kept and max(kept) < opened[event.step - 1]  # nothing kept beyond the window
    assert {e.step for e in steps} == set(range(1, 7))
    # Inside the window the loose bound keeps every position it opened: the window is the only limit here.
    first = steps[0]
    assert first.accepted == [i < opened[0] for i in range(length)]
    assert pipe.generate(PROMPTS[0], seed=4, window_lead=1.5, **settings).token_ids != expected


def test_canvas_top_k_of_one_keeps_every_position_at_its_argmax_and_is_off_by_default(models_):
    ref, pipe = models_["peaked"]
    settings = dict(max_new_tokens=24, max_denoising_steps=6, t_min=0.5, t_max=1.0, entropy_bound=0.1)
    expected, _ = reference_tokens(ref, PROMPTS[0], 4, **settings)
    assert pipe.generate(PROMPTS[0], seed=4, canvas_top_k=0, **settings).token_ids == expected  # 0: the reference
    steps = [e for e in pipe.stream(PROMPTS[0], seed=4, canvas_top_k=1, **settings) if isinstance(e, StepEvent)]
    # One token left per position: zero entropy, so even a tight bound keeps every position, at its argmax.
    for event in steps:
        assert all(event.accepted) and event.tokens == event.argmax and max(event.entropy) == 0.0


# -- continuous batching --------------------------------------------------------------------------------


def test_requests_joining_between_steps_get_what_they_get_alone(models_):
    """Requests join a running batch at different steps, with prompts shorter and longer than the sliding
    window (the stacked caches then mix ring rotations), and leave at different times."""
    _, pipe = models_["peaked"]
    settings = pipe.settings(max_new_tokens=24, max_denoising_steps=5, t_min=0.02, t_max=0.05, entropy_bound=1.0,
                             confidence_threshold=0.05, eos_token_ids=[20, 21])
    prompts = [BATCH[0], list(range(2, 40)), BATCH[1], list(range(60, 71))]
    joins = {0: 0, 1: 0, 2: 2, 3: 5}  # request -> the step before which it joins
    batch = DiffusionBatch(pipe.model, pipe.canvas_length)
    results, steps, widths = {}, 0, []
    while len(results) < len(prompts):
        for request, at in joins.items():
            if at == steps:
                batch.add(request, Request(prompts[request], settings, seed=30 + request))
        widths.append(len(batch))
        for event in batch.step():
            if isinstance(event, DoneEvent):
                results[event.request] = event.result
        steps += 1
    assert max(widths) >= 3 and len(set(widths)) > 2  # the batch really grew and shrank
    for request, prompt in enumerate(prompts):
        alone = pipe.generate(prompt, seed=30 + request, **{k: getattr(settings, k) for k in (
            "max_new_tokens", "max_denoising_steps", "t_min", "t_max", "entropy_bound", "confidence_threshold",
            "eos_token_ids")})
        assert results[request].token_ids == alone.token_ids
        assert results[request].stats.forward_passes == alone.stats.forward_passes


def test_a_removed_request_stops_costing_compute(models_):
    _, pipe = models_["gqa"]
    settings = pipe.settings(max_new_tokens=32, max_denoising_steps=4)
    batch = DiffusionBatch(pipe.model, pipe.canvas_length)
    batch.add(0, Request(BATCH[0], settings, seed=1))
    batch.add(1, Request(BATCH[1], settings, seed=2))
    batch.step()
    batch.remove(0)
    assert len(batch) == 1
    events = batch.step()
    assert {e.request for e in events} == {1}


def test_speculative_mode_drafts_with_one_step_unless_told(models_):
    _, pipe = models_["gqa"]
    assert pipe.settings(mode="speculative").max_denoising_steps == 1
    assert pipe.settings(mode="speculative", max_denoising_steps=3).max_denoising_steps == 3
    assert pipe.settings().max_denoising_steps == pipe.generation_config.max_denoising_steps


# ------------------------------------------------------------------------------------------------
# Text deltas when a token holds part of a character
# ------------------------------------------------------------------------------------------------


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level tokenizer without merges: <pad> <eos> <bos> <unk>, then one token per byte: the continuation
    bytes, the lead bytes of two-, three- and four-byte characters, then letters, so that random tokens often
    split a character and often complete one."""
    # The byte-level decoder's printable stand-ins for bytes (GPT-2's table): printable Latin-1 as itself, the
    # other bytes as chr(256), chr(257), ... in byte order.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    stand_in = {b: chr(b) for b in printable}
    stand_in.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in stand_in)})
    order = [*range(0x80, 0xC0), *range(0xC2, 0xF5), *range(0x61, 0x7B)]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({stand_in[b]: 4 + i for i, b in enumerate(order[: vocab_size - 4])})
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    return tok


def test_a_character_split_across_tokens_is_held_back_until_it_is_whole():
    """Token ids are bytes here: "a", the three bytes of "€", then the first byte of "é" and the request ends."""
    settings = SamplerSettings(max_new_tokens=5, eos_token_ids=())
    state = RequestState.start(0, Request([2], settings, seed=0), torch.device("cpu"), budget=5)
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    deltas = []
    for byte in b"a\xe2\x82\xac\xc3":
        state.commit([byte])
        deltas.append(state.text_delta(decode))
    assert deltas == ["a", "", "", "€", "\ufffd"]  # the unfinished "é" is flushed as U+FFFD when the request ends
    assert "".join(deltas) == decode(state.completion())


def test_text_deltas_decode_only_the_newest_tokens_and_keep_the_spaces_of_a_decoder_that_strips_one():
    """Until a request finishes, each `text_delta` decodes the tokens of its last two commits, not the whole completion
    (a long streamed completion costs linear decoding, not quadratic), and a decoder that drops the leading space of
    what it decodes (SentencePiece's, as Gemma's tokenizers have it) loses no space between deltas: they add up to
    the whole completion decoded."""
    def decode(ids):
        text = "".join(f"\u2581w{i}" for i in ids).replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text

    decoded = []
    state = RequestState.start(0, Request([2], SamplerSettings(max_new_tokens=300, eos_token_ids=()), seed=0),
                               torch.device("cpu"), budget=300)
    deltas, t = [], 0
    while not state.finished:
        state.commit([3 + t % 47] * (1 + t % 2))  # commits of one and two tokens
        deltas.append(state.text_delta(lambda ids: decoded.append(len(ids)) or decode(ids)))
        t += 1
    assert "".join(deltas) == decode(state.completion())
    assert deltas[1] == " w4 w4" and max(decoded[:-1]) <= 4 and decoded[-1] == 300


@pytest.fixture(scope="module")
def byte_pipe(tmp_path_factory):
    ref = make_reference("gqa", canvas_length=4)  # short canvases: many commits
    return printpress.load(save_checkpoint(ref, tmp_path_factory.mktemp("bytes") / "gqa", byte_tokenizer(128)))


@pytest.mark.parametrize("mode", ["ar", "diffusion", "speculative"])
def test_streamed_text_adds_up_to_the_final_text_when_tokens_split_characters(byte_pipe, mode):
    splits = 0
    for seed in range(4):
        events = list(byte_pipe.stream([2, 70, 71, 72], mode=mode, seed=seed, max_new_tokens=32, step_events=False))
        commits = [e for e in events if isinstance(e, CommitEvent)]
        (done,) = [e for e in events if isinstance(e, DoneEvent)]
        assert "".join(c.text for c in commits) == done.result.text, (mode, seed)
        # The case this is about happened: some commit ended inside a character that a later one completed.
        ids, full = done.result.completion_ids, done.result.text
        ends = itertools.accumulate(len(c.token_ids) for c in commits)
        splits += any(not full.startswith(byte_pipe.decode(ids[:end])) for end in ends)
    assert splits > 0


# -- log-probabilities (AR mode) ---------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [dict(temperature=0.8, top_k=5), dict(temperature=0)])
def test_ar_logprobs_are_the_models_log_softmax_of_each_token(models_, settings):
    """Per completion token, log_softmax of the raw logits (not the temperature / top-k distribution it was drawn
    from), recomputed in one causal pass over prompt + completion; the k most likely, sorted. Prompts of different
    lengths share a left-padded batch, and asking changes no token."""
    _, pipe = models_["gqa"]
    results = pipe.generate(PROMPTS, mode="ar", seed=3, max_new_tokens=8, eos_token_ids=[], logprobs=4, **settings)
    plain = pipe.generate(PROMPTS, mode="ar", seed=3, max_new_tokens=8, eos_token_ids=[], **settings)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain] and plain[0].logprobs is None
    for result in results:
        rows = causal_log_probs(pipe.model, result.prompt_ids + result.completion_ids)[len(result.prompt_ids) - 1:]
        assert [e.token_id for e in result.logprobs] == result.completion_ids
        for entry, row in zip(result.logprobs, rows, strict=False):
            assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-5)
            values, ids = torch.topk(row, 4)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
            assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
            if settings["temperature"] == 0:
                assert entry.top[0] == (entry.token_id, entry.logprob)


def test_ar_logprobs_cover_the_completion_and_are_opt_in(models_):
    _, pipe = models_["gqa"]
    greedy = pipe.generate(PROMPTS[0], mode="ar", temperature=0, max_new_tokens=9, eos_token_ids=[])
    eos = greedy.token_ids[3]
    stopped = pipe.generate(PROMPTS[0], mode="ar", temperature=0, max_new_tokens=9, eos_token_ids=[eos], logprobs=0)
    assert [e.token_id for e in stopped.logprobs] == stopped.completion_ids  # the EOS has none: it is not text
    assert all(e.top == [] for e in stopped.logprobs)
    events = list(pipe.stream(PROMPTS[0], mode="ar", temperature=0, max_new_tokens=4, logprobs=2))
    commits = [e for e in events if isinstance(e, CommitEvent)]
    assert [e.logprobs[0].token_id for e in commits] == [e.token_ids[0] for e in commits]
    wide = pipe.generate(PROMPTS[0], mode="ar", max_new_tokens=2, seed=0, logprobs=10**6)
    assert len(wide.logprobs[0].top) == pipe.config.text.vocab_size  # capped at the vocabulary


@pytest.mark.parametrize("mode", ["diffusion", "speculative"])
def test_logprobs_outside_ar_mode_are_refused_naming_the_mode(models_, mode):
    _, pipe = models_["gqa"]
    with pytest.raises(GenerationError, match=f"are returned in mode 'ar' only, not in mode='{mode}'"):
        pipe.generate([2, 3], mode=mode, seed=0, max_new_tokens=4, logprobs=1)
    with pytest.raises(GenerationError, match="logprobs must be an integer >= 0"):
        pipe.generate([2, 3], mode="ar", seed=0, max_new_tokens=4, logprobs=-1)
