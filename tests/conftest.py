"""Shared fixtures: tiny random DiffusionGemma checkpoints written by the reference (transformers), the engine's
tiny pipelines, the training tests' corpus and the headless browser. Plain helpers are in helpers.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers import CHROMIUM, CHROMIUM_ARGS, TINY_CONFIGS, make_reference, save_checkpoint, word_tokenizer, write_corpus

# Tiny models run fastest on one thread, and a second OpenMP thread on a busy 2-core machine can make each
# small GEMM wait for a descheduled peer (seen: 300x slower). Tests that need threads set them themselves;
# subprocesses inherit the variable.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def package_cache(tmp_path_factory) -> Path:
    """Where compiled graphs' ahead-of-time packages go during the tests (`printpress.aot.cache_folder`): a folder
    of this session's, not the user's cache; subprocesses inherit it."""
    folder = tmp_path_factory.mktemp("printpress-cache")
    os.environ["PRINTPRESS_CACHE"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def reference_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each tiny config saved by transformers' save_pretrained."""
    root = tmp_path_factory.mktemp("reference")
    folders = {}
    for name in TINY_CONFIGS:
        folder = root / name
        make_reference(name).save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def models_(tmp_path_factory):
    """name -> (reference model, printpress pipeline) on the same weights."""
    import printpress

    root = tmp_path_factory.mktemp("engine")
    out = {}
    for name, canvas in (("gqa", 8), ("mha", 4), ("default_pattern", 16)):
        ref = make_reference(name, canvas_length=canvas)
        out[name] = (ref, printpress.load(save_checkpoint(ref, root / name)))
    # Large output embeddings give peaked distributions: many tokens accepted per step and the
    # adaptive stop fires, which random weights of normal scale almost never do.
    peaked = make_reference("gqa", seed=1)
    with torch.no_grad():
        peaked.model.decoder.embed_tokens.weight.mul_(30)
    out["peaked"] = (peaked, printpress.load(save_checkpoint(peaked, root / "peaked", word_tokenizer(128))))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder of small repetitive documents to train on (helpers.write_corpus)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Debian's Chromium, headless, driven by Playwright (tests that use it are marked `browser`)."""
    from playwright.sync_api import sync_playwright

    executable = str(CHROMIUM if CHROMIUM.exists() else shutil.which("chromium"))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
