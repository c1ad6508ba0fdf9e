"""dtype="auto" (printpress.precision): the flags read from a cpuinfo text, the decision from measured times, the
measurement itself, and what the loader does with the choice, all without the hardware: the cpuinfo text and the
measured times are given."""

from __future__ import annotations

import logging

import pytest
import torch

import printpress
from printpress import precision
from printpress.cli import main
from printpress.config import TextConfig
from printpress.errors import CheckpointError
from printpress.model import DiffusionGemma

# This project's machine (AMD EPYC, Zen 3): AVX2, no native bf16.
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sse sse2 ht syscall nx fma avx f16c avx2 bmi2 vaes rdpid fsrm
"""
# A Sapphire Rapids server: AMX tiles and AVX-512 bf16 dot products.
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
COOPER_LAKE = "flags\t: fpu avx2 avx512f avx512_bf16\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16\n"
SHORT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"


def never() -> tuple[dict, dict]:
    raise AssertionError("measured where the flags alone decide")


@pytest.mark.parametrize("text, flags", [(EPYC, ()), (SAPPHIRE_RAPIDS, ("amx_bf16", "avx512_bf16")),
                                         (COOPER_LAKE, ("avx512_bf16",)), (ARM, ()), ("", ())])
def test_native_bf16_flags_come_from_the_flags_line(text, flags):
    assert precision.native_bf16_flags(text) == flags


def test_a_flag_named_in_another_line_does_not_count():
    assert precision.native_bf16_flags("model name\t: amx_bf16 lookalike\nflags\t: avx2\n") == ()


def test_decide_takes_bf16_only_when_it_is_clearly_faster():
    fast = precision.decide({"AR step": 8.0, "decoder pass": 16.0}, {"AR step": 3.0, "decoder pass": 6.0})
    assert fast.dtype == torch.bfloat16 and "2.67x faster" in fast.reason and "8.00 ms fp32, 3.00 ms bf16" in fast.reason
    assert fast.timings_ms == {"AR step": (8.0, 3.0), "decoder pass": (16.0, 6.0)}
    slow = precision.decide({"AR step": 8.0}, {"AR step": 560.0})  # emulated bf16: 70x slower
    assert slow.dtype == torch.float32 and "70.00x fp32's time" in slow.reason
    # 5% faster is not worth giving up exactness (BF16_MARGIN = 0.9); 10% is.
    assert precision.decide({"a": 10.0}, {"a": 9.5}).dtype == torch.float32
    assert precision.decide({"a": 10.0}, {"a": 9.0}).dtype == torch.bfloat16


def test_choose_on_a_cpu_without_native_bf16_is_fp32_without_measuring():
    choice = precision.choose(torch.device("cpu"), cpuinfo=EPYC, measure_times=never)
    assert choice.dtype == torch.float32 and "no native bf16" in choice.reason and choice.timings_ms == {}


@pytest.mark.parametrize("bf16_ms, expected", [(4.0, torch.bfloat16), (12.0, torch.float32)])
def test_choose_on_a_cpu_with_native_bf16_follows_the_measurement(bf16_ms, expected):
    choice = precision.choose(torch.device("cpu"), cpuinfo=SAPPHIRE_RAPIDS,
                              measure_times=lambda: ({"AR step": 10.0}, {"AR step": bf16_ms}))
    assert choice.dtype == expected and choice.reason.startswith("amx_bf16, avx512_bf16 present; ")
    assert choice.timings_ms == {"AR step": (10.0, bf16_ms)}


def test_choose_without_a_measurement_keeps_fp32_for_the_int8_kernel():
    choice = precision.choose(torch.device("cpu"), cpuinfo=SAPPHIRE_RAPIDS, measure_times=None)
    assert choice.dtype == torch.float32 and "int8" in choice.reason


@pytest.mark.parametrize("supported, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_choose_on_cuda_asks_torch(monkeypatch, supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    assert precision.choose(torch.device("cuda"), measure_times=never).dtype == expected


def test_choose_on_another_device_is_fp32():
    assert precision.choose(torch.device("mps"), measure_times=never).dtype == torch.float32


def test_measure_times_both_dtypes_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = DiffusionGemma(TextConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"], num_experts=4,
                                      top_k_experts=2, moe_intermediate_size=16)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fp32_ms, bf16_ms = precision.measure(model, canvas_length=8, budget_s=0.05)
    assert set(fp32_ms) == set(bf16_ms) == {"AR step", "decoder pass (canvas 8)"}
    assert all(ms > 0 for ms in [*fp32_ms.values(), *bf16_ms.values()])
    assert model.dtype == torch.float32
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------


def ar_logits(pipe) -> torch.Tensor:
    ids = torch.tensor([pipe.encode_text(SHORT)])
    with torch.no_grad():
        return pipe.model.encode(ids, pipe.model.new_cache(1, ids.shape[1]), logits="all")


def test_auto_without_native_bf16_loads_fp32_and_generates_float32s_tokens(monkeypatch, caplog):
    """This machine's case (no bf16 flags), whatever machine runs the test: the cpuinfo is given."""
    monkeypatch.setattr(precision, "read_cpuinfo", lambda *a: EPYC)
    with caplog.at_level(logging.INFO, logger="printpress"):
        auto = printpress.load(dtype="auto")
    exact = printpress.load(dtype="float32")
    assert auto.model.dtype == torch.float32 and auto.dtype_choice.dtype == torch.float32
    assert "dtype auto -> float32: this CPU has no native bf16 matmul" in caplog.text
    assert exact.dtype_choice is None
    for mode in ("diffusion", "ar"):
        a = auto.generate("ROMEO.\n", mode=mode, max_new_tokens=12, seed=4)
        b = exact.generate("ROMEO.\n", mode=mode, max_new_tokens=12, seed=4)
        assert a.token_ids == b.token_ids


def test_auto_that_measures_bf16_faster_loads_what_bfloat16_loads(monkeypatch):
    """Flags present and a measurement that says bf16: the fp32 model is converted after loading, and computes
    what a model loaded straight into bf16 computes (the RoPE tables stay fp32 in both)."""
    monkeypatch.setattr(precision, "read_cpuinfo", lambda *a: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(precision, "measure", lambda model, canvas: ({"AR step": 10.0}, {"AR step": 2.0}))
    auto = printpress.load(dtype="auto")
    direct = printpress.load(dtype="bfloat16")
    assert auto.model.dtype == torch.bfloat16 and "5.00x faster" in auto.dtype_choice.reason
    assert auto.model.sliding_inv_freq.dtype == torch.float32
    assert torch.equal(ar_logits(auto), ar_logits(direct))


def test_checkpoint_dtype_is_the_saved_one():
    pipe = printpress.load(dtype="checkpoint")  # the shipped model was saved in float16
    assert pipe.model.dtype == torch.float16


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="bogus"), "dtype 'bogus' is not supported; use one of float32, bfloat16, float16, auto, checkpoint"),
    (dict(quantize="int4"), "quantize 'int4' is not supported; use int8 or int8-head"),
])
def test_bad_runtime_values_are_refused_before_anything_is_read(tmp_path, kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        printpress.load(tmp_path / "not-a-model", **kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "bogus"], "dtype 'bogus' is not supported; use one of float32, bfloat16, float16, auto, checkpoint"),
    (["--quantize", "int4"], "quantize 'int4' is not supported; use int8 or int8-head (or leave it out"),
])
@pytest.mark.parametrize("command", [["generate", "x"], ["chat"], ["edit", "--prefix", "a", "--suffix", "b"]])
def test_bad_runtime_flags_are_one_line_before_the_model_loads(capsys, tmp_path, argv, message, command):
    code = main([*command, "-m", str(tmp_path / "not-loaded"), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"printpress: error: {message}")
