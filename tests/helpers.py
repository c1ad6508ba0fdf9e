"""Helpers shared by several test modules: tiny reference checkpoints, a word tokenizer, a real server in a thread,
its server-sent events, the training run used by the training tests, and the browser page. Fixtures built from
these live in conftest.py; a test module imports what it calls from here, never from another test module.

Heavy imports (transformers, uvicorn, the server) happen inside the functions that need them, so that importing
this module (conftest does) costs nothing to tests that use none of it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# Tiny random DiffusionGemma checkpoints written by the reference (transformers)
# ------------------------------------------------------------------------------------------------

VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8)

# Tiny text configs that differ in every axis the architecture has: expert count and top-k, head layouts
# (GQA, MHA, K=V heads on full layers), layer patterns and sliding windows.
TINY_CONFIGS: dict[str, dict] = {
    "gqa": dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                num_experts=4, top_k_experts=2, moe_intermediate_size=16, max_position_embeddings=512),
    "mha": dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
                     sliding_window=4, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                    "full_attention"],
                     num_experts=8, top_k_experts=1, moe_intermediate_size=8,
                     max_position_embeddings=512),
    "default_pattern": dict(vocab_size=160, hidden_size=32, intermediate_size=32, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                            sliding_window=5, num_experts=3, top_k_experts=3, moe_intermediate_size=12,
                            max_position_embeddings=512),
    # Twelve layers: transformers writes per-layer overrides under zero-padded keys ("05", "11").
    "twelve_layers": dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=12,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                          num_global_key_value_heads=1, sliding_window=4, num_experts=2, top_k_experts=1,
                          moe_intermediate_size=8, max_position_embeddings=512),
}


def make_reference(name: str | dict, canvas_length: int = 8, seed: int = 0):
    """A randomly initialised reference model (with non-trivial norms and scales, so they are tested), from a
    name of TINY_CONFIGS or a text-config dict."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    text = dict(TINY_CONFIGS[name] if isinstance(name, str) else name)
    config = DiffusionGemmaConfig(text_config=text, vision_config=dict(VISION),
                                  canvas_length=canvas_length)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if param.dim() == 1 or key.endswith(("scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)  # ones would hide a norm or scale applied in the wrong place
        for key, buffer in model.named_buffers():
            if key.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model


# Generation defaults written into each test checkpoint's generation_config.json: small enough to be
# quick, and with explicit EOS/pad ids (transformers saves null for both, and then never stops early).
CHECKPOINT_DEFAULTS = dict(max_new_tokens=16, max_denoising_steps=5, eos_token_id=[1], pad_token_id=0)


def save_checkpoint(ref, folder: Path, tokenizer=None, **generation) -> Path:
    """`ref` saved by save_pretrained with CHECKPOINT_DEFAULTS (overridden by `generation`) as its generation
    config, and `tokenizer` (a tokenizers.Tokenizer) beside it if given."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    values = dict(CHECKPOINT_DEFAULTS, **generation)
    bound = values.pop("entropy_bound", None)
    if bound is not None:
        values["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=bound)
    ref.generation_config = DiffusionGemmaGenerationConfig(**values)
    ref.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def causal_log_probs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's next-token logits at every position of `ids`, from one causal pass over all of
    them (T, V): row t is the distribution of token t + 1. What AR log-probabilities are checked against."""
    with torch.no_grad():
        logits = model.encode(torch.tensor([ids]), model.new_cache(1, len(ids)), logits="all")
    return torch.log_softmax(logits[0].float(), dim=-1)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer: <pad> <eos> <bos> then words w3, w4, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "[UNK]": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    return tok


# ------------------------------------------------------------------------------------------------
# A real server in a thread of the test process
# ------------------------------------------------------------------------------------------------

KEY = "sk-test-0123456789"
MODEL = "shakespeare-joint"
STEPS = 4  # denoising steps per canvas in these tests (the shipped default is 32)
LIMITS = {"max_new_tokens": 96, "max_prompt_tokens": 64, "max_steps": 8}
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Server:
    url: str
    app: object
    scheduler: object  # printpress.serve.scheduler.Scheduler


def free_port() -> int:
    """A loopback port free right now, for a server in another process (which may, rarely, lose it to another process
    before binding it; servers in this process take an already bound socket instead: `running_server`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(pipe, api_key: str | None = KEY, max_rows: int = 4, max_queued: int = 8,
                   timeout_s: float = 60.0, max_body_bytes: int = 64 * 1024, **limits) -> Iterator[Server]:
    """A real uvicorn server on a free loopback port, in a thread of this process.

    The socket is bound here (port 0: the kernel picks a free one) and handed to uvicorn, so no other test process
    (pytest -n) can take the port between choosing and binding it."""
    import uvicorn

    from printpress.serve.app import create_app
    from printpress.serve.scheduler import Limits, Scheduler

    limits = dict(LIMITS, **limits)
    scheduler = Scheduler(pipe, Limits(max_rows=max_rows, max_queued=max_queued,
                                       max_prompt_tokens=limits["max_prompt_tokens"],
                                       max_new_tokens=limits["max_new_tokens"], request_timeout_s=timeout_s))
    app = create_app(pipe, scheduler, model_name=MODEL, api_key=api_key, max_body_bytes=max_body_bytes, **limits)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Server(f"http://127.0.0.1:{port}", app, scheduler)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def sse_events(response) -> list[tuple[str, str]]:
    """(event name, data) for every server-sent event of an httpx response."""
    events, name, data = [], "message", []
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif line == "" and data:
            events.append((name, "\n".join(data)))
            name, data = "message", []
    return events


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def server_load(server) -> tuple[int, int]:
    """(active, queued) requests, from the server's /health."""
    import httpx

    health = httpx.get(server.url + "/health").json()
    return health["active"], health["queued"]


# ------------------------------------------------------------------------------------------------
# The training run of the training tests
# ------------------------------------------------------------------------------------------------

TINY_MODEL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1,
                  sliding_window=16, layer_types=["sliding_attention", "full_attention"], num_experts=2,
                  top_k_experts=1, moe_intermediate_size=16, max_position_embeddings=256, canvas_length=8)

VERSES = [
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "Rough winds do shake the darling buds of May, and summer's lease hath all too short a date.",
    "Sometime too hot the eye of heaven shines, and often is his gold complexion dimm'd.",
    "And every fair from fair sometime declines, by chance or nature's changing course untrimm'd.",
]


def write_corpus(folder: Path) -> Path:
    """Twelve documents, each the four verses rotated and repeated three times."""
    for index in range(12):
        (folder / f"doc{index:02d}.txt").write_text("\n".join(VERSES[index % 4:] + VERSES[: index % 4]) * 3)
    return folder


def run_config(corpus: Path, **train):
    """A short joint-objective run of TINY_MODEL on `corpus`, `train` overriding its training settings."""
    from printpress.train.loop import RunConfig

    settings = dict(objective="joint", steps=6, batch_size=4, seq_len=32, lr=3e-3, min_lr=3e-4, warmup=2,
                    eval_every=3, eval_batches=2, save_every=3, seed=7)
    settings.update(train)
    return RunConfig.from_dict({"model": dict(TINY_MODEL), "train": settings,
                                "data": {"sources": [str(corpus)], "vocab_size": 300, "val_fraction": 0.2}})


def killed_and_resumed(run, out: Path, checkpoint_at: int = 3, killed_at: int = 4) -> None:
    """Train `run` in `out` with a checkpoint at step `checkpoint_at`, "kill" it at step `killed_at` (metrics written
    past the checkpoint), then resume it from the checkpoint to the end."""
    from printpress.train.loop import RunConfig, Trainer

    trainer = Trainer(run, out)
    for _ in range(killed_at):
        metrics = trainer.train_step()
        trainer.log({"step": trainer.step, **metrics})
        if trainer.step == checkpoint_at:
            trainer.save_checkpoint()
    del trainer
    Trainer(RunConfig(), out, resume=True).fit(progress=False)


def losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every record in a run's metrics.jsonl."""
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


# ------------------------------------------------------------------------------------------------
# The web page in headless Chromium
# ------------------------------------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"
# As root on a machine with a closed network: no sandbox, and no background connections that would fail.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

needs_chromium = pytest.mark.skipif(not CHROMIUM.exists() and shutil.which("chromium") is None,
                                    reason="Debian's chromium is not installed (the test setup installs it)")


def open_page(browser, server):
    """The page, with the key and a short generation (ROMEO:, 64 tokens, 8 steps, seed 21) filled in; the list
    collects the page's JavaScript errors."""
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server.url + "/")
    page.fill("input[name=api_key]", KEY)
    page.fill("#prompt", "ROMEO:")
    page.fill("input[name=max_tokens]", "64")
    page.fill("input[name=steps]", "8")
    page.fill("input[name=seed]", "21")
    return page, errors


def script_module(relative: str):
    """A script of the repository (`bench/x.py`, `scripts/y.py`: neither folder is a package) imported as a module."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / relative
    name = f"script_{path.parent.name}_{path.stem}"  # a fresh module each call, as before
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def bench_module(name: str):
    """A script of bench/ imported as a module."""
    return script_module(f"bench/{name}.py")


def file_mode() -> int:
    """The permission bits a plain `open()` gives a new file under this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
