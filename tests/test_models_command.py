"""`printpress list` (the shipped models and the hub cache's DiffusionGemmas) and `printpress pull` (offline: the
one-line errors, and a model already in the cache).

The hub cache is a temporary folder laid out as huggingface_hub lays it out (`models--owner--name/blobs/<sha256>`,
`snapshots/<commit>/<file>` linking to the blob, `refs/main` holding the commit), filled with a tiny random checkpoint
written by `printpress.checkpoint.save_model`; every subprocess runs with HF_HUB_OFFLINE=1, so nothing reaches the
network.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from printpress import catalog
from printpress.errors import CheckpointError
from printpress.checkpoint import save_model
from printpress.config import GenerationConfig, ModelConfig, TextConfig
from printpress.model import DiffusionGemma

from helpers import word_tokenizer

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHIPPED_PARAMETERS = {"shakespeare-joint": 5_569_176, "shakespeare-ar": 5_569_176,  # from their config.json
                      "stdlib-code": 5_569_176, "stdlib-code-ar": 5_569_176}
TINY_ID, OTHER_ID = "tiny-org/tiny-diffusion", "other-org/a-causal-lm"
COMMIT, OLD_COMMIT = "1" * 40, "2" * 40


def tiny_checkpoint(folder: Path) -> Path:
    torch.manual_seed(0)
    config = ModelConfig(TextConfig(vocab_size=128, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                                    num_experts=2, top_k_experts=1, moe_intermediate_size=8,
                                    layer_types=["full_attention"]), canvas_length=4)
    model = DiffusionGemma(config.text)
    generation = GenerationConfig.from_dict({"max_new_tokens": 8, "max_denoising_steps": 3, "eos_token_id": [1]},
                                            config.text)
    return save_model(model, config, folder, generation, tokenizer=word_tokenizer(128))


def cache_revision(cache: Path, repo_id: str, source: Path, commit: str, ref: str | None = "main",
                   kind: str = "models", skip: tuple[str, ...] = ()) -> Path:
    """`source`'s files as one cached revision of `repo_id`: content-addressed blobs, a snapshot of links to them,
    and `refs/<ref>` holding the commit."""
    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.name in skip:
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A hub cache with the tiny DiffusionGemma at main (and an older revision without its weights), a model of
    another architecture, and a dataset whose config says diffusion_gemma."""
    root = tmp_path_factory.mktemp("hub")
    tiny = tiny_checkpoint(root / "tiny")
    other = root / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    (other / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    cache = root / "cache"
    cache_revision(cache, TINY_ID, tiny, COMMIT)
    cache_revision(cache, TINY_ID, tiny, OLD_COMMIT, ref=None, skip=("model.safetensors",))
    cache_revision(cache, OTHER_ID, other, COMMIT)
    cache_revision(cache, "data-org/not-a-model", tiny, COMMIT, kind="datasets")
    return cache


def printpress_cli(*argv: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """`printpress ARGV` in a subprocess, offline, with `cache` as the hub cache."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PRINTPRESS_DEFAULT_MODEL", "HF_HOME")}
    environ.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                   PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **env)
    return subprocess.run([sys.executable, "-m", "printpress", *argv], capture_output=True, text=True, cwd=REPO,
                          env=environ, timeout=300)


def test_the_shipped_models_are_listed_with_their_parameters(tmp_path):
    done = printpress_cli("list", cache=tmp_path / "no-cache")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "SOURCE", "PARAMETERS"]
    for name, parameters in SHIPPED_PARAMETERS.items():
        row = next(line for line in lines if line.startswith(name + " "))
        assert f"{parameters:,}" in row and row.rstrip().endswith(f" {name}"), row  # --model takes the bare name
        card = json.loads((REPO / "models" / name / "card.json").read_text())
        assert card["parameters"] == parameters and f" {card['objective']} " in row
    assert next(line for line in lines if line.startswith("shakespeare-joint")).startswith("shakespeare-joint *")
    def row(name: str) -> str:
        return next(line for line in lines if line.startswith(name + " "))

    assert "16 steps, entropy 4; AR T 0.8, top-k 50" in row("shakespeare-joint *")  # its generation_config.json
    # stdlib-code's window and sliding defaults come from its printpress_generation.json
    assert "sliding, 4 steps (whole canvases: 32 steps, entropy 1, window 1.5); AR T 0.8, top-k 50" in row("stdlib-code")


def test_json_lists_the_same_models_and_round_trips(hub_cache, monkeypatch):
    done = printpress_cli("list", "--json", cache=hub_cache)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert json.loads(json.dumps(listed)) == listed and listed["hub_cache"] == str(hub_cache)
    monkeypatch.chdir(REPO)  # `model` is a path relative to the working directory, as the subprocess's
    monkeypatch.delenv("PRINTPRESS_DEFAULT_MODEL", raising=False)
    assert listed["models"] == [e.to_dict() for e in catalog.list_models(hub_cache)]
    by_name = {m["name"]: m for m in listed["models"] if m["source"] == "shipped"}
    assert {name: by_name[name]["parameters"] for name in SHIPPED_PARAMETERS} == SHIPPED_PARAMETERS
    assert by_name["shakespeare-joint"]["default"] and not by_name["shakespeare-ar"]["default"]
    assert by_name["shakespeare-ar"]["objective"] == "ar" and by_name["shakespeare-ar"]["canvas_length"] == 32
    assert by_name["shakespeare-joint"]["path"] == str(REPO / "models" / "shakespeare-joint")


def test_cached_diffusion_gemma_models_are_listed_by_hub_id_and_others_are_not(hub_cache):
    entries = catalog.cached_models(hub_cache)
    assert [(e.name, e.revision, e.refs) for e in entries] == [(TINY_ID, COMMIT, ["main"]), (TINY_ID, OLD_COMMIT, [])]
    main, old = entries
    config = ModelConfig.from_file(hub_cache / f"models--{TINY_ID.replace('/', '--')}" / "snapshots" / COMMIT
                                   / "config.json")
    assert main.parameters == config.text.num_parameters() and main.canvas_length == 4
    assert main.model == TINY_ID and main.hub_id == TINY_ID and main.problem is None and main.size_bytes > 0
    assert main.decoding["steps"] == 3 and main.decoding["max_new_tokens"] == 8
    assert old.model.endswith(OLD_COMMIT)  # loaded by its folder: the id would load main
    assert old.problem == (f"no model.safetensors or model.safetensors.index.json in the cache "
                           f"(printpress pull {TINY_ID} --revision {OLD_COMMIT})")

    done = printpress_cli("list", cache=hub_cache)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(TINY_ID)]
    assert len(rows) == 2 and f"hub cache (main {COMMIT[:8]})" in rows[0] and rows[0].rstrip().endswith(TINY_ID)
    assert f"{main.parameters:,}" in rows[0]
    assert "will not load: no model.safetensors" in done.stdout
    assert OTHER_ID not in done.stdout and "not-a-model" not in done.stdout


def test_the_default_model_variable_marks_its_model(hub_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("PRINTPRESS_DEFAULT_MODEL", TINY_ID)
    defaults = [(e.name, e.source) for e in catalog.list_models(hub_cache) if e.default]
    assert defaults == [(TINY_ID, "hub cache")]
    folder = tiny_checkpoint(tmp_path / "mine")
    monkeypatch.setenv("PRINTPRESS_DEFAULT_MODEL", str(folder))
    defaults = [e for e in catalog.list_models(hub_cache) if e.default]
    assert [(e.name, e.source, e.problem) for e in defaults] == [("mine", "PRINTPRESS_DEFAULT_MODEL", None)]
    monkeypatch.setenv("PRINTPRESS_DEFAULT_MODEL", "someone/not-pulled")
    defaults = [e for e in catalog.list_models(hub_cache) if e.default]
    assert [e.problem for e in defaults] == ["not in the hub cache (printpress pull someone/not-pulled)"]


def test_list_imports_no_torch(tmp_path):
    code = ("import sys\nfrom printpress.cli import main\nmain(['list'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=dict(os.environ, HF_HUB_CACHE=str(tmp_path)))
    assert done.returncode == 0 and "shakespeare-joint" in done.stdout, done.stderr


@pytest.mark.parametrize("argv, message", [
    (["pull", "google/diffusiongemma-26B-A4B-it"],
     "google/diffusiongemma-26B-A4B-it: could not fetch from the Hugging Face hub: HF_HUB_OFFLINE is set and the "
     "model is not in the local cache"),
    (["pull", "nobody-at-all/no-such-model", "--revision", "v9"],
     "nobody-at-all/no-such-model: could not fetch from the Hugging Face hub: HF_HUB_OFFLINE is set and the model at "
     "revision 'v9' is not in the local cache"),
    (["pull", "not a/hub id"], "not a/hub id: could not fetch from the Hugging Face hub: not a valid hub id"),
    (["pull", "models/shakespeare-ar"], "models/shakespeare-ar: a local model folder needs no pull (printpress "
                                        "generate -m models/shakespeare-ar ...)"),
    (["pull", "shakespeare-ar"], "shakespeare-ar: a shipped model needs no pull (printpress generate -m "
                                 "shakespeare-ar ...)"),
    (["pull", "a/b/c"], "a/b/c: not a hub id of the form owner/name"),
    (["pull", OTHER_ID], f"{OTHER_ID}: not a DiffusionGemma printpress can load: model_type 'llama' is not supported"),
])
def test_pull_failures_are_one_line_and_exit_2(hub_cache, argv, message):
    done = printpress_cli(*argv, cache=hub_cache)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith(f"printpress: error: {message}") and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.slow  # two subprocesses that import torch
def test_pull_of_a_cached_model_works_offline_and_generate_loads_it_by_id(hub_cache):
    done = printpress_cli("pull", TINY_ID, cache=hub_cache)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    parameters = catalog.cached_models(hub_cache)[0].parameters
    assert lines[0].startswith(f"pulled {TINY_ID} (revision main, commit {COMMIT[:12]}): {parameters:,} parameters")
    assert lines[1].startswith("  in ") and lines[1].endswith(f"--tiny-diffusion/snapshots/{COMMIT}")
    assert lines[-1].startswith(f"  use it: printpress generate -m {TINY_ID} ")
    done = printpress_cli("generate", "-m", TINY_ID, "--seed", "0", "--max-new-tokens", "3", "--json", "w5 w6",
                          cache=hub_cache)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["completion_ids"]) == 3


def test_a_shipped_model_loads_by_its_bare_name_from_any_directory(tmp_path, monkeypatch):
    from printpress.checkpoint import resolve_folder

    monkeypatch.chdir(tmp_path)
    assert resolve_folder("shakespeare-ar") == REPO / "models" / "shakespeare-ar"
    (tmp_path / "shakespeare-ar").mkdir()  # a folder of that name where the user is comes first
    assert resolve_folder("shakespeare-ar") == Path("shakespeare-ar")
    for not_a_name in ("shakespeare", "../models/shakespeare-ar", ".git"):
        with pytest.raises(CheckpointError, match="no such model folder"):
            resolve_folder(not_a_name)
