"""bench/roofline.py's predictions where the C++ layers read half-width copies of the weights: which models they are
read for, and the bytes an AR step and a pass over a few rows are predicted to move."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_CONFIGS

from printpress.config import TextConfig
from printpress.model import DiffusionGemma, native_layers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import roofline


def test_an_ar_step_and_a_few_rows_pass_are_predicted_with_two_bytes_a_weight_where_copies_are_read():
    text = TextConfig(**TINY_CONFIGS["gqa"])
    weights = roofline.layer_weight_params(text, text.top_k_experts) + text.vocab_size * text.hidden_size
    kv = roofline.kv_read_params(text, 64)
    full, half = roofline.ar_work(text, 64), roofline.ar_work(text, 64, weight_bytes=2)
    assert full.bytes == 4 * weights + 4 * kv + 4 * text.vocab_size
    assert full.bytes - half.bytes == 2 * weights  # only the weights are read narrower: the cache and logits are not
    assert half.working_set == 2 * text.num_parameters() and half.flop == full.flop
    e, k = text.num_experts, text.top_k_experts
    used = e * (1 - (1 - k / e) ** 8)  # the experts a canvas of 8 routes to
    pass_weights = (roofline.layer_weight_params(text, used) + text.vocab_size * text.hidden_size
                    + 3 * text.hidden_size * text.intermediate_size)
    pass_full, pass_half = roofline.decoder_work(text, 8, 64), roofline.decoder_work(text, 8, 64, weight_bytes=2)
    assert pass_full.bytes - pass_half.bytes == pytest.approx(2 * pass_weights)


@pytest.mark.skipif(not native_layers(), reason="no C++ compiler for printpress's layers on this machine")
def test_half_width_reads_are_predicted_for_a_float32_model_whose_weights_fit_half_width():
    torch.manual_seed(0)
    model = DiffusionGemma(TextConfig(**TINY_CONFIGS["gqa"])).eval()
    assert not roofline.half_width_reads(model)  # random float32 weights
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.half().float())
    assert roofline.half_width_reads(model) == torch.ops.printpress_layers.half_width_kernels()
    assert not roofline.half_width_reads(model.to(torch.bfloat16))  # a bf16 model reads its own weights


def test_the_paired_ratio_puts_each_round_against_the_read_speed_of_that_round():
    work = roofline.Work(flop=2e6, bytes=1e6, working_set=1e9)
    prediction = {"compute_ms": 0.02, "memory_ms": 0.1, "roofline_ms": 0.1}
    # rounds: the work at 2x its memory roof, then slowed 3x with the read slowed alike, then memory-fast enough that
    # the compute roof (0.02 ms) is the larger
    read_bytes = 4e6  # read in 0.4 ms at the round's speed: 10 GB/s, so the work's 1 MB takes 0.1 ms
    measured = [0.2e-3, 0.6e-3, 0.05e-3]
    reads = [0.4e-3, 1.2e-3, 0.04e-3]  # the last round's read: 100 GB/s, 0.01 ms for the work's bytes
    assert roofline.paired_ratio(work, prediction, measured, reads, read_bytes) == pytest.approx(2.0)
    assert roofline.paired_ratio(work, prediction, measured[2:], reads[2:], read_bytes) == pytest.approx(2.5)
    with pytest.raises(ValueError):  # a read for every round
        roofline.paired_ratio(work, prediction, measured, reads[:2], read_bytes)
