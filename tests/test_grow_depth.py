"""scripts/grow_depth.py: a model grown in depth computes the original's logits, and stays a reference checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

import printpress
from helpers import make_reference, save_checkpoint, script_module, word_tokenizer

grow_depth = script_module("scripts/grow_depth.py")


def logits(folder, ids, canvas):
    model = printpress.load(folder).model
    cache = model.new_cache(ids.shape[0], ids.shape[1] + canvas.shape[1])
    with torch.no_grad():
        return model.encode(ids, cache), model.denoise(canvas, cache)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # default_pattern: sliding and full layers with per-layer overrides; random norms and layer scalars (not 1).
    return save_checkpoint(make_reference("default_pattern"), tmp_path_factory.mktemp("grow") / "tiny",
                           tokenizer=word_tokenizer(160))


def test_silent_copies_give_the_originals_logits_exactly(tiny, tmp_path):
    assert grow_depth.main(["--model", str(tiny), "--out", str(tmp_path / "grown")]) == 0
    original = json.loads((tiny / "config.json").read_text())["text_config"]
    grown = json.loads((tmp_path / "grown" / "config.json").read_text())["text_config"]
    assert grown["num_hidden_layers"] == 2 * original["num_hidden_layers"] == 12
    assert grown["layer_types"] == [kind for kind in original["layer_types"] for _ in range(2)]
    assert sorted(map(int, grown["per_layer_config"])) == sorted(
        2 * int(i) + j for i in original["per_layer_config"] for j in range(2))
    torch.manual_seed(0)
    ids, canvas = torch.randint(3, 160, (2, 11)), torch.randint(3, 160, (2, 8))
    (ar, dec), (ar_grown, dec_grown) = logits(tiny, ids, canvas), logits(tmp_path / "grown", ids, canvas)
    assert torch.equal(ar, ar_grown) and torch.equal(dec, dec_grown)


def test_a_nonzero_branch_scale_changes_the_logits_and_the_reference_loads_the_grown_model(tiny, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    grow_depth.grow(str(tiny), str(tmp_path / "grown"), branch_scale=0.5)
    torch.manual_seed(0)
    ids, canvas = torch.randint(3, 160, (1, 9)), torch.randint(3, 160, (1, 8))
    assert not torch.allclose(logits(tiny, ids, canvas)[0], logits(tmp_path / "grown", ids, canvas)[0])
    reference, info = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "grown", output_loading_info=True)
    # printpress saves the text model only: the reference initialises its vision tower, and nothing else is missing.
    assert not [key for key in info["missing_keys"] if "vision" not in key] and not info["unexpected_keys"]
    assert reference.config.text_config.num_hidden_layers == 12


def test_a_missing_model_is_one_line(tmp_path, capsys):
    assert grow_depth.main(["--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grow_depth: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
