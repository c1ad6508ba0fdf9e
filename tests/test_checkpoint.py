"""Checkpoint folders: round trips with transformers, sharding, dtypes and clear errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DiffusionGemmaForBlockDiffusion

from printpress.checkpoint import load_model, save_model
from printpress.config import ModelConfig, TextConfig
from printpress.errors import CheckpointError, ConfigError
from printpress.model import DiffusionGemma


def logits_of(model, vocab: int, canvas_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, 9), generator=generator)
    canvas = torch.randint(0, vocab, (1, canvas_length), generator=generator)
    with torch.no_grad():
        cache = model.new_cache(1, 32)
        return model.encode(ids, cache), model.denoise(canvas, cache)


def same_state(a: DiffusionGemma, b: DiffusionGemma) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_printpress_transformers_printpress_round_trip(reference_checkpoints, tmp_path):
    original, config, generation, _ = load_model(reference_checkpoints["gqa"])
    save_model(original, config, tmp_path / "ours", generation)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "ours")
    ref.save_pretrained(tmp_path / "theirs")
    back, config_back, generation_back, _ = load_model(tmp_path / "theirs")
    same_state(original, back)
    for x, y in zip(logits_of(original, 128, 8), logits_of(back, 128, 8)):
        assert torch.equal(x, y)
    assert config_back.text.layers == config.text.layers
    assert config_back.canvas_length == config.canvas_length
    assert generation_back.entropy_bound == generation.entropy_bound


def test_transformers_loads_what_printpress_wrote_with_the_same_logits(reference_checkpoints, tmp_path):
    model, config, _, _ = load_model(reference_checkpoints["mha"])
    save_model(model, config, tmp_path / "ours")
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "ours").eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (1, 7), generator=generator)
    canvas = torch.randint(0, 96, (1, 8), generator=generator)
    with torch.no_grad():
        out = ref(input_ids=ids, decoder_input_ids=canvas)
        cache = model.new_cache(1, 32)
        model.encode(ids, cache, logits="none")
        assert (model.denoise(canvas, cache) - out.logits).abs().max() < 1e-5


def test_sharded_save_round_trips_and_index_names_every_tensor(reference_checkpoints, tmp_path):
    model, config, _, _ = load_model(reference_checkpoints["gqa"])
    save_model(model, config, tmp_path / "sharded", max_shard_size=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    back, _, _, _ = load_model(tmp_path / "sharded")
    same_state(model, back)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "sharded")
    assert torch.equal(ref.model.decoder.layers[2].experts.down_proj, model.layers[2].experts.down_proj)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_save_writes_that_dtype(reference_checkpoints, tmp_path, dtype):
    model, config, _, _ = load_model(reference_checkpoints["gqa"], dtype=dtype)
    save_model(model, config, tmp_path / "half")
    tensors = load_file(tmp_path / "half" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {dtype}
    assert json.loads((tmp_path / "half" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    back, _, _, _ = load_model(tmp_path / "half", dtype="checkpoint")
    assert back.embed_tokens.weight.dtype == dtype
    same_state(model, back)


def test_encoder_and_decoder_layer_scalars_are_kept_apart(reference_checkpoints):
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(reference_checkpoints["gqa"])
    model, _, _, _ = load_model(reference_checkpoints["gqa"])
    for i in range(3):
        assert torch.equal(model.layers[i].layer_scalar, ref.model.decoder.layers[i].layer_scalar)
        assert torch.equal(model.layers[i].encoder_layer_scalar, ref.model.encoder.language_model.layers[i].layer_scalar)
    assert not torch.equal(model.layers[0].layer_scalar, model.layers[0].encoder_layer_scalar)


def test_vision_weights_are_skipped_with_one_warning(reference_checkpoints, caplog):
    with caplog.at_level("WARNING"):
        load_model(reference_checkpoints["gqa"])
    warnings = [r.message for r in caplog.records if "vision" in r.message]
    assert len(warnings) == 1 and "text model only" in warnings[0]


def test_save_replaces_an_existing_folder_without_leftovers(reference_checkpoints, tmp_path):
    model, config, _, _ = load_model(reference_checkpoints["gqa"])
    save_model(model, config, tmp_path / "out")
    (tmp_path / "out" / "stale.txt").write_text("old")
    save_model(model, config, tmp_path / "out")
    assert not (tmp_path / "out" / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]



def test_a_saved_folder_has_the_permissions_mkdir_and_open_give(reference_checkpoints, tmp_path):
    # the save is written in a private temporary folder; what lands must be readable as the umask allows
    model, config, _, _ = load_model(reference_checkpoints["gqa"])
    umask = os.umask(0o027)
    try:
        folder = save_model(model, config, tmp_path / "out", max_shard_size="20KB")
    finally:
        os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [folder, *folder.iterdir()]}
    assert len(modes) > 4 and modes.pop("out") == oct(0o750)
    assert set(modes.values()) == {oct(0o640)}, modes

# -- bad input -----------------------------------------------------------------------------------------


def test_missing_shard_is_named(reference_checkpoints, tmp_path):
    model, config, _, _ = load_model(reference_checkpoints["gqa"])
    save_model(model, config, tmp_path / "s", max_shard_size=20_000)
    shard = sorted((tmp_path / "s").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard file\\(s\\) missing: {shard.name}"):
        load_model(tmp_path / "s")


def rewrite_weights(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_wrong_shape_names_file_and_key(reference_checkpoints, tmp_path):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    key = "model.decoder.layers.1.mlp.up_proj.weight"
    rewrite_weights(folder, lambda t: t.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{key}' has shape \(3, 3\), expected \(48, 32\)"):
        load_model(folder)


def test_missing_key_is_named(reference_checkpoints, tmp_path):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    rewrite_weights(folder, lambda t: t.pop("model.decoder.layers.2.router.scale"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.decoder.layers.2.router.scale'"):
        load_model(folder)


def test_unexpected_key_is_named(reference_checkpoints, tmp_path):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    rewrite_weights(folder, lambda t: t.__setitem__("model.decoder.extra_head.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.decoder.extra_head.weight'"):
        load_model(folder)


def test_truncated_weights_file_is_refused(reference_checkpoints, tmp_path):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors file"):
        load_model(folder)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.__setitem__("model_type", "llama"), "model_type 'llama' is not supported"),
        (lambda c: c["text_config"].__setitem__("num_experts", 0), "num_experts must be a positive integer"),
        (lambda c: c["text_config"].__setitem__("layer_types", ["sliding_attention", "full_attention"]),
         "layer_types has 2 entries but num_hidden_layers is 3"),
        (lambda c: c["text_config"].__setitem__("hidden_activation", "relu6"), "hidden_activation 'relu6'"),
        (lambda c: c["text_config"].__setitem__("sliding_window", 1), "sliding_window must be an integer >= 2"),
        (lambda c: c.pop("text_config"), "config.json has no text_config"),
        (lambda c: c.__setitem__("canvas_length", -4), "canvas_length must be a positive integer"),
        (lambda c: c["text_config"].__setitem__("rope_parameters", "x"), "rope_parameters must be an object"),
        (lambda c: c["text_config"].__setitem__("rms_norm_eps", "a"), "rms_norm_eps must be a positive number"),
        (lambda c: c["text_config"].__setitem__("final_logit_softcapping", "a"),
         "final_logit_softcapping must be a positive number or null"),
    ],
)
def test_invalid_config_values_are_refused(reference_checkpoints, tmp_path, change, message):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_model(folder)


def test_malformed_config_json_names_the_file(reference_checkpoints, tmp_path):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_model(folder)


def test_pickle_checkpoints_need_an_explicit_opt_in(reference_checkpoints, tmp_path):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle checkpoints can run code"):
        load_model(folder)
    model, _, _, _ = load_model(folder, allow_pickle=True)
    assert torch.equal(model.embed_tokens.weight, tensors["model.decoder.embed_tokens.weight"])


def test_missing_folder_and_bad_hub_id_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="no such model folder"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="could not fetch from the Hugging Face hub"):
        load_model("printpress-test/definitely-not-a-real-repo")


def test_empty_folder_is_refused(tmp_path):
    config = ModelConfig(TextConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                                    num_experts=2, top_k_experts=1, moe_intermediate_size=8), canvas_length=4)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


def test_generation_config_without_eos_means_no_eos_as_in_the_reference(reference_checkpoints, caplog):
    # transformers writes "eos_token_id" only when set; its generate then never stops at an EOS.
    with caplog.at_level("WARNING"):
        _, _, generation, _ = load_model(reference_checkpoints["gqa"])
    assert generation.eos_token_id == []
    assert any("sets no eos_token_id" in r.message for r in caplog.records)
    assert generation.max_denoising_steps == 48 and generation.entropy_bound == 0.1  # reference defaults


def test_per_layer_keys_are_written_zero_padded_like_transformers(reference_checkpoints, tmp_path):
    folder = reference_checkpoints["twelve_layers"]
    theirs = json.loads((folder / "config.json").read_text())["text_config"]["per_layer_config"]
    model, config, _, _ = load_model(folder)
    assert config.text.layers[5].head_dim == 16 and config.text.layers[4].head_dim == 8
    save_model(model, config, tmp_path / "ours")
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())["text_config"]["per_layer_config"]
    assert ours == theirs and "05" in ours and "11" in ours


# -- checkpoints that must not fool the loader -------------------------------------------------------------


def sharded_copy(reference_checkpoints, tmp_path):
    model, config, _, _ = load_model(reference_checkpoints["gqa"])
    return save_model(model, config, tmp_path / "s", max_shard_size=20_000)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/dev/stdin", "/tmp/x.safetensors", "sub/../../y.safetensors"])
def test_index_shards_outside_the_folder_are_refused(reference_checkpoints, tmp_path, shard):
    folder = sharded_copy(reference_checkpoints, tmp_path)
    (tmp_path / "outside.safetensors").write_bytes((folder / sorted(folder.glob("model-*"))[0].name).read_bytes())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"shard '{shard}' is not a file of the checkpoint folder"):
        load_model(folder)


def test_a_safetensors_index_cannot_route_the_load_through_torch_load(reference_checkpoints, tmp_path):
    folder = sharded_copy(reference_checkpoints, tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    torch.save({first: torch.zeros(1)}, folder / "evil.bin")
    index["weight_map"][first] = "evil.bin"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for allow_pickle in (False, True):
        with pytest.raises(CheckpointError, match="shard 'evil.bin' is not a .safetensors file"):
            load_model(folder, allow_pickle=allow_pickle)


def rewrite_header(path, change) -> None:
    """Edit a safetensors header in place (same data bytes), padding it to keep the JSON valid."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


@pytest.mark.parametrize("change, message", [
    (lambda h, k: h[k].__setitem__("data_offsets", [-8, h[k]["data_offsets"][1] - 8]), "corrupt or truncated"),
    (lambda h, k: h[k].__setitem__("data_offsets", [0, h[k]["data_offsets"][1] - h[k]["data_offsets"][0]]),
     "overlaps or leaves gaps"),
    (lambda h, k: h[k].__setitem__("shape", "12"), "corrupt or truncated"),
    (lambda h, k: h.__setitem__(k, [1, 2]), "corrupt or truncated"),
])
def test_malformed_safetensors_headers_are_refused(reference_checkpoints, tmp_path, change, message):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    path = folder / "model.safetensors"

    def edit(header):
        key = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        change(header, key)

    rewrite_header(path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 100_000, "describes .* parameters but the weight files hold"),
    ("vocab_size", 10**12, "more than this machine's memory"),
])
def test_absurd_sizes_are_refused_before_any_allocation(reference_checkpoints, tmp_path, monkeypatch, field, value,
                                                        message):
    import printpress.checkpoint as checkpoint

    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"][field] = value
    config["text_config"].pop("layer_types", None)
    (folder / "config.json").write_text(json.dumps(config))

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the sizes were checked")

    monkeypatch.setattr(checkpoint, "build_empty", never)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)


@pytest.mark.parametrize("content, message", [
    ({"max_denoising_steps": "a", "eos_token_id": 1}, "max_denoising_steps must be an integer"),
    ({"eos_token_id": "x"}, "eos_token_id must be a token id, a list of them, or null"),
    ({"t_max": [1], "eos_token_id": 1}, "t_max must be a number"),
])
def test_mistyped_generation_config_is_refused_at_load(reference_checkpoints, tmp_path, content, message):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    (folder / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=f"invalid generation_config: {message}"):
        load_model(folder)


def test_printpress_generation_defaults_live_beside_generation_config_and_survive_a_save(reference_checkpoints,
                                                                                          tmp_path):
    """printpress's own sampler defaults (window_lead) go in their own file: transformers refuses any key its
    generation config does not know, so generation_config.json stays the reference's and the folder loads there."""
    import printpress
    from transformers import DiffusionGemmaForBlockDiffusion

    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    pipe = printpress.load(folder)
    assert pipe.default_settings().window_lead == 0.0 and pipe.generation_config.printpress_dict() == {}
    (folder / "printpress_generation.json").write_text(json.dumps({"window_lead": 1.5}))
    windowed = printpress.load(folder)
    assert windowed.default_settings().window_lead == 1.5
    assert windowed.settings(window_lead=0).window_lead == 0  # a request may still turn it off
    assert windowed.settings(mode="speculative", draft_steps=2).window_lead == 0  # drafts open the whole canvas
    saved = windowed.save_pretrained(tmp_path / "copy")
    assert json.loads((saved / "printpress_generation.json").read_text()) == {"window_lead": 1.5}
    assert "window_lead" not in json.loads((saved / "generation_config.json").read_text())
    DiffusionGemmaForBlockDiffusion.from_pretrained(saved)  # the reference still loads the folder
    assert not (pipe.save_pretrained(tmp_path / "plain") / "printpress_generation.json").exists()
    prompt = [2, 5, 7]
    assert (printpress.load(saved).generate(prompt, seed=1, max_new_tokens=8).token_ids
            == pipe.generate(prompt, seed=1, max_new_tokens=8, window_lead=1.5).token_ids)
    (folder / "printpress_generation.json").write_text(json.dumps({"window_lead": 1.5, "max_denoising_steps": 3}))
    with pytest.raises(ConfigError, match="printpress_generation.json: unknown key.s. max_denoising_steps; it holds"):
        load_model(folder)
    (folder / "printpress_generation.json").write_text(json.dumps({"window_lead": "wide"}))
    with pytest.raises(ConfigError, match="invalid generation_config: window_lead must be a number"):
        load_model(folder)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_folder_where_a_file_should_be_is_one_error(reference_checkpoints, tmp_path, name):
    folder = copy_folder(reference_checkpoints["gqa"], tmp_path / "c")
    (folder / name).unlink()
    (folder / name).mkdir()
    with pytest.raises((ConfigError, CheckpointError), match=f"{name}: (cannot read it|not a file)"):
        load_model(folder)


def test_pipeline_save_pretrained_round_trips_what_it_generates(tmp_path):
    import printpress

    pipe = printpress.load()  # the shipped default model: tokenizer and generation defaults included
    folder = pipe.save_pretrained(tmp_path / "copy")
    again = printpress.load(folder)
    assert again.generation_config.to_dict() == pipe.generation_config.to_dict()
    assert again.tokenizer.to_str() == pipe.tokenizer.to_str()
    same_state(pipe.model, again.model)
    for mode in ("diffusion", "ar"):
        first = pipe.generate("ROMEO.\n", max_new_tokens=16, seed=3, mode=mode)
        assert again.generate("ROMEO.\n", max_new_tokens=16, seed=3, mode=mode).token_ids == first.token_ids
    half = pipe.save_pretrained(tmp_path / "half", dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"


def test_loading_leaves_the_compiler_unimported(reference_checkpoints):
    """The model is built on the meta device and then filled; a normal_, an arange or an empty_like there runs
    through torch._refs, which imports torch._dynamo (~1.1 s) or sympy (~0.5 s): each CLI command's load paid it for
    nothing. A fresh interpreter loads a checkpoint and generates without importing either."""
    code = ("import sys, printpress; pipe = printpress.load(sys.argv[1]); pipe.generate([5, 6, 7], max_new_tokens=4); "
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(reference_checkpoints["gqa"])], capture_output=True,
                         text=True, check=True)
    assert out.stdout.split()[-2:] == ["False", "False"], out.stderr[-2000:]
