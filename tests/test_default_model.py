"""The models shipped in models/: they load, generate both ways, and stay small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import printpress
from printpress.engine import default_model_path

MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.fixture(scope="module")
def pipe():
    return printpress.load()


def test_default_is_the_shipped_joint_model(pipe):
    assert default_model_path() == MODELS / "shakespeare-joint"
    assert pipe.tokenizer is not None and pipe.canvas_length == 32


@pytest.mark.parametrize("name", ["shakespeare-joint", "shakespeare-ar", "stdlib-code", "stdlib-code-ar"])
def test_shipped_folders_are_small_and_carry_a_model_card(name):
    folder = MODELS / name
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 25 * 2**20
    card = (folder / "README.md").read_text()
    assert f"printpress train --recipe {name}" in card and "held-out loss" in card


def test_default_model_generates_text_both_ways_and_repeatably(pipe):
    first = pipe.generate("ROMEO:\n", seed=3, max_new_tokens=32)
    again = pipe.generate("ROMEO:\n", seed=3, max_new_tokens=32)
    assert first.token_ids == again.token_ids and first.text
    assert first.stats.canvases == 1 and first.stats.forward_passes >= 1
    ar = pipe.generate("ROMEO:\n", mode="ar", temperature=0, max_new_tokens=24)
    assert ar.stats.tokens_per_forward == 1.0 and ar.text.strip()


@pytest.mark.parametrize(("name", "prompt"), [("shakespeare-joint", "To be, or not to be"),
                                            ("stdlib-code", "def parse(text):\n    return")])
def test_shipped_model_loads_in_transformers_with_the_same_logits(name, prompt):
    from transformers import DiffusionGemmaForBlockDiffusion

    pipe = printpress.load(MODELS / name)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(MODELS / name, dtype=torch.float32).eval()
    ids = torch.tensor([pipe.tokenizer.encode(prompt, add_special_tokens=False).ids])
    canvas = torch.randint(0, pipe.config.text.vocab_size, (1, pipe.canvas_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ref(input_ids=ids, decoder_input_ids=canvas)
        cache = pipe.model.new_cache(1, 64)
        pipe.model.encode(ids, cache, logits="none")
        assert (pipe.model.denoise(canvas, cache) - out.logits).abs().max() < 1e-4
