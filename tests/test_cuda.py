"""The engine on a CUDA GPU (issue 15). Skipped where torch sees no CUDA device (a CPU build, or none attached).

`scripts/gpu_check.sh` runs this module on a GPU machine, with the engine benchmark. What it holds printpress to:

- float32 on the GPU: the decoder's and the encoder's logits equal the reference's on the same GPU to float32
  rounding (both run cuBLAS; printpress's row-major layers and shared norms may pick other reduction shapes, so
  bit-equality is not asserted), and seeded diffusion tokens equal the reference's `generate` under the same
  seed, as they do on the CPU (the same draws from the device's generator, in the same order);
- speculative decoding at temperature 0 gives AR's greedy tokens exactly, on the GPU as everywhere;
- bfloat16 on the GPU generates in every mode, and its logits stay near float32's;
- training with `train.device = "cuda"` sees the CPU run's batches and noise, so its losses equal the CPU's to
  float32 rounding, and the checkpoint it saves loads on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

import printpress

from printpress.checkpoint import load_model
from printpress.train.loop import Trainer

from helpers import make_reference, run_config, save_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[2, 7, 9, 11], [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]  # the second beats every window


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    """name -> (reference on the GPU, printpress pipeline on the GPU), float32, the same weights."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's default too; TF32 would not be float32
    root = tmp_path_factory.mktemp("cuda")
    out = {}
    for name, canvas in (("gqa", 8), ("mha", 4), ("default_pattern", 16)):
        ref = make_reference(name, canvas_length=canvas)
        folder = save_checkpoint(ref, root / name)
        out[name] = (ref.to("cuda"), printpress.load(folder, device="cuda"))
    return out


@pytest.mark.parametrize("name", ["gqa", "mha", "default_pattern"])
def test_logits_on_the_gpu_match_the_reference_on_the_gpu(gpu_models, name):
    ref, pipe = gpu_models[name]
    model, vocab, canvas_length = pipe.model, ref.config.text_config.vocab_size, ref.config.canvas_length
    gen = torch.Generator().manual_seed(0)
    for length in (1, 5, 19):
        ids = torch.randint(3, vocab, (1, length), generator=gen).cuda()
        canvas = torch.randint(0, vocab, (1, canvas_length), generator=gen).cuda()
        with torch.no_grad():
            expected = ref(input_ids=ids, decoder_input_ids=canvas)
            cache = model.new_cache(1, length + canvas_length)
            encoded = model.encode(ids, cache, logits="all")
            got = model.denoise(canvas, cache)
            reference_encoder = ref.lm_head(expected.encoder_last_hidden_state).float()
            cap = ref.config.text_config.final_logit_softcapping
            if cap is not None:
                reference_encoder = torch.tanh(reference_encoder / cap) * cap
        assert got.device.type == "cuda"
        torch.testing.assert_close(got, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(encoded.float(), reference_encoder, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,settings", [
    ("gqa", dict(max_new_tokens=16)),
    ("mha", dict(max_new_tokens=12, entropy_bound=2.0, max_denoising_steps=3)),
    ("default_pattern", dict(max_new_tokens=32, max_denoising_steps=3)),
])
def test_seeded_diffusion_tokens_on_the_gpu_equal_the_references(gpu_models, name, settings):
    ref, pipe = gpu_models[name]
    kwargs = dict(settings)
    if "entropy_bound" in kwargs:
        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=kwargs.pop("entropy_bound"))
    for prompt in PROMPTS:
        for seed in (0, 7):
            torch.manual_seed(seed)
            expected = ref.generate(torch.tensor([prompt], device="cuda"), **kwargs)
            result = pipe.generate(prompt, seed=seed, **settings)
            assert result.token_ids == expected.sequences[0, len(prompt):].tolist(), (prompt, seed)


@pytest.mark.parametrize("name", ["gqa", "default_pattern"])
def test_greedy_speculative_on_the_gpu_is_ar_token_for_token(gpu_models, name):
    _, pipe = gpu_models[name]
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, mode="ar", temperature=0, max_new_tokens=24, eos_token_ids=[])
        for fused in (False, True):
            spec = pipe.generate(prompt, mode="speculative", temperature=0, max_new_tokens=24, eos_token_ids=[],
                                 fused_draft=fused)
            assert spec.token_ids == ar.token_ids, (prompt, fused)


def test_bfloat16_on_the_gpu_generates_in_every_mode_near_float32(gpu_models, tmp_path):
    ref, fp32 = gpu_models["gqa"]
    folder = save_checkpoint(ref.to("cpu"), tmp_path / "gqa")
    ref.to("cuda")
    bf16 = printpress.load(folder, device="cuda", dtype="bfloat16")
    assert bf16.model.dtype == torch.bfloat16
    vocab = ref.config.text_config.vocab_size
    for mode in ("diffusion", "ar", "speculative"):
        extra = {} if mode == "diffusion" else dict(temperature=0)
        result = bf16.generate(PROMPTS[1], mode=mode, max_new_tokens=16, seed=0, **extra)
        assert len(result.token_ids) >= 1 and all(0 <= t < vocab for t in result.token_ids), mode
    ids = torch.tensor([PROMPTS[1]], device="cuda")
    with torch.no_grad():
        logits = {}
        for key, pipe in (("fp32", fp32), ("bf16", bf16)):
            cache = pipe.model.new_cache(1, ids.shape[1])
            logits[key] = pipe.model.encode(ids, cache, logits="all").float()
    assert (logits["bf16"] - logits["fp32"]).abs().mean() < 0.05


def test_training_on_the_gpu_repeats_the_cpu_runs_losses(corpus, tmp_path):
    runs = {}
    for folder, device in (("on-cpu", "cpu"), ("on-gpu", "cuda")):
        Trainer(run_config(corpus, device=device), tmp_path / folder).fit(progress=False)
        runs[folder] = [json.loads(line) for line in (tmp_path / folder / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["on-gpu"]) == len(runs["on-cpu"]) == 6
    for cpu, gpu in zip(runs["on-cpu"], runs["on-gpu"]):
        for key in ("loss", "ar", "diffusion", "val_ar", "val_diffusion"):
            if key in cpu:
                assert gpu[key] == pytest.approx(cpu[key], rel=1e-4), (cpu["step"], key)
    model, _, _, _ = load_model(tmp_path / "on-gpu" / "model")
    assert next(model.parameters()).device.type == "cpu"
    Trainer(run_config(corpus, device="cuda", precision="bfloat16", steps=2, eval_every=2, save_every=2),
            tmp_path / "bf16").fit(progress=False)
    assert (tmp_path / "bf16" / "model" / "model.safetensors").exists()
