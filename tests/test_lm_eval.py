"""The lm-evaluation-harness adapter: lm_eval's own command line and simple_evaluate run local tasks through it,
and the numbers it returns are the model's, computed independently here through the training path."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from printpress.config import GenerationConfig, ModelConfig, TextConfig
from printpress.engine import Pipeline
from printpress.errors import PrintpressError
from printpress.eval.lm_eval_adapter import PrintpressLM, diffusion_draws, diffusion_loglikelihood
from printpress.model import DiffusionGemma
from printpress.tokenizer import train_tokenizer
from printpress.train.objectives import forward_ar, forward_block_diffusion

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"
DOCS = [json.loads(line) for line in (TASKS / "tiny.jsonl").read_text().splitlines()]
CANVAS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random checkpoint with a tokenizer, recorded as trained with the joint objective."""
    from printpress.checkpoint import save_model

    tokenizer = train_tokenizer(["the cat sat on the mat, and the dog sat on the log. " * 20], 300)
    text = TextConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                      sliding_window=8, layer_types=["sliding_attention", "full_attention"], num_experts=2,
                      top_k_experts=1, moe_intermediate_size=8, initializer_range=0.3, max_position_embeddings=256)
    torch.manual_seed(0)
    generation = GenerationConfig.from_dict({"max_denoising_steps": 3, "eos_token_id": [1]}, text)
    folder = save_model(DiffusionGemma(text).eval(), ModelConfig(text, canvas_length=CANVAS),
                        tmp_path_factory.mktemp("lm_eval") / "tiny", generation, tokenizer)
    (folder / "card.json").write_text(json.dumps({"objective": "joint"}))
    return folder


def _direct_ar(pipe: Pipeline, context: str, continuation: str) -> float:
    """log P(continuation | BOS context) through the training path (one causal forward, no cache)."""
    tok = pipe.tokenizer
    whole = [2] + tok.encode(context + continuation, add_special_tokens=False).ids
    start = 1 + len(tok.encode(context, add_special_tokens=False).ids) if context else 1
    with torch.no_grad():
        logp = torch.log_softmax(forward_ar(pipe.model, torch.tensor([whole]))[0], dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(start, len(whole)))


def _cut(text: str, stops) -> str:
    return text[: min((i for i in (text.find(s) for s in stops) if i != -1), default=len(text))]


@pytest.mark.slow
def test_lm_eval_command_line_runs_local_tasks_and_returns_the_models_numbers(checkpoint, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "printpress.eval.lm_eval_adapter", "--model", "printpress",
               "--model_args", f"pretrained={checkpoint},max_gen_toks=8", "--device", "cpu",
               "--tasks", "printpress_tiny_choice,printpress_tiny_gen,printpress_tiny_ppl",
               "--include_path", str(TASKS), "--output_path", str(out), "--log_samples"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    samples = {task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
               for task in ("printpress_tiny_choice", "printpress_tiny_gen", "printpress_tiny_ppl")}
    pipe = Pipeline.from_pretrained(checkpoint)

    # loglikelihood (auto -> AR for a joint checkpoint): each choice's score is the exact AR log-likelihood.
    # lm-eval puts its target delimiter (a space) in front of each choice: the logged arguments say exactly.
    correct = 0
    for sample in samples["printpress_tiny_choice"]:
        doc = DOCS[sample["doc_id"]]
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert pairs == [(doc["question"], " " + choice) for choice in doc["choices"]]
        expected = [_direct_ar(pipe, context, continuation) for context, continuation in pairs]
        got = [float(resp[0][0]) for resp in sample["resps"]]
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-5)
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    assert results["printpress_tiny_choice"]["acc,none"] == pytest.approx(correct / len(DOCS))

    # loglikelihood_rolling: the whole document after BOS; word perplexity from those numbers.
    total_ll, total_words = 0.0, 0
    for sample in samples["printpress_tiny_ppl"]:
        doc = DOCS[sample["doc_id"]]
        text = doc["question"] + " " + doc["choices"][doc["answer"]]
        assert float(sample["resps"][0][0]) == pytest.approx(_direct_ar(pipe, "", text), rel=1e-5, abs=1e-5)
        total_ll += _direct_ar(pipe, "", text)
        total_words += len(re.split(r"\s+", text))
    assert results["printpress_tiny_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_words),
                                                                                     rel=1e-5)

    # generate_until: the engine's own continuation (diffusion, the checkpoint's settings), cut at "\n" or ".".
    for sample in samples["printpress_tiny_gen"]:
        doc = DOCS[sample["doc_id"]]
        result = pipe.generate(pipe.encode_text(doc["question"]), seed=0, max_new_tokens=8)
        assert sample["resps"][0][0] == _cut(result.text, ["\n", "."])


def test_the_diffusion_estimate_equals_the_training_objectives_forward(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint)
    model = pipe.model
    context = list(range(10, 10 + CANVAS))  # one whole canvas, so training blocks line up with inference canvases
    continuation = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]  # one canvas and a partial one
    samples = 5

    got, _ = diffusion_loglikelihood(model, context, continuation, CANVAS, samples,
                                     torch.Generator().manual_seed(7), t_low=0.1)
    clean, noisy = diffusion_draws(continuation, CANVAS, samples, model.config.vocab_size,
                                   torch.Generator().manual_seed(7), t_low=0.1)
    prefix = torch.tensor(context).repeat(samples, 1)
    with torch.no_grad():
        _, logits = forward_block_diffusion(model, torch.cat([prefix, clean], 1), torch.cat([prefix, noisy], 1), CANVAS)
    logp = torch.log_softmax(logits[:, CANVAS : CANVAS + len(continuation)], dim=-1)
    per_row = logp.gather(-1, torch.tensor(continuation).repeat(samples, 1)[..., None])[..., 0].sum(-1)
    assert got == pytest.approx(per_row.mean().item(), rel=1e-5)

    # The draws are what the docstring says: stratified noise levels, the tail past the continuation left as noise.
    assert (clean[:, : len(continuation)] == torch.tensor(continuation)).all()
    assert (noisy[:, len(continuation):] == clean[:, len(continuation):]).all()
    assert 0 < (noisy[:, : len(continuation)] != clean[:, : len(continuation)]).sum() < samples * len(continuation)


def test_simple_evaluate_with_the_diffusion_likelihood(checkpoint, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task's data path is relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lm = PrintpressLM(pretrained=str(checkpoint), likelihood="diffusion", mc_samples=3, seed=5)
    out = lm_eval.simple_evaluate(model=lm, tasks=["printpress_tiny_choice"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))
    for sample in out["samples"]["printpress_tiny_choice"]:
        for args, resp in zip(sample["arguments"], sample["resps"]):
            context, continuation = lm._encode_pair(*args)
            expected = diffusion_loglikelihood(lm.model, context, continuation, CANVAS, 3,
                                               torch.Generator().manual_seed(5))
            assert tuple(resp[0]) == pytest.approx(expected)
    assert 0.0 <= out["results"]["printpress_tiny_choice"]["acc,none"] <= 1.0


def test_the_likelihood_follows_the_checkpoints_objective_and_bad_arguments_are_clear(checkpoint, tmp_path):
    assert PrintpressLM(pretrained=str(checkpoint)).likelihood == "ar"  # card.json: joint
    pipe = Pipeline.from_pretrained(checkpoint)
    assert PrintpressLM(pipeline=pipe).likelihood == "diffusion"  # no card to read
    with pytest.raises(PrintpressError, match="likelihood must be one of auto, ar, diffusion"):
        PrintpressLM(pipeline=pipe, likelihood="exact")
    with pytest.raises(PrintpressError, match="unknown generation setting"):
        PrintpressLM(pipeline=pipe, stepz=3)
    with pytest.raises(PrintpressError, match="mc_samples must be at least 1"):
        PrintpressLM(pipeline=pipe, mc_samples=0)


@pytest.mark.parametrize("likelihood", ["ar", "diffusion"])
def test_documents_longer_than_the_model_are_scored_in_windows(checkpoint, likelihood):
    from lm_eval.api.instance import Instance

    lm = PrintpressLM(pretrained=str(checkpoint), likelihood=likelihood, mc_samples=2)
    text = "the cat sat on the mat, and the dog sat on the log. " * 40
    tokens = len(lm.tok_encode(text, add_special_tokens=False))
    assert tokens > 2 * lm.max_length
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert math.isfinite(total) and total < 0
    if likelihood == "ar":
        # Each token predicted once: the windows' scores add up to more than the first window alone.
        first, _ = lm.score([lm.prefix_token_id], lm.tok_encode(text, add_special_tokens=False)[: lm.max_length])
        assert total < first


def test_generate_until_is_greedy_in_ar_mode_unless_the_task_samples(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint)
    lm = PrintpressLM(pipeline=pipe, mode="ar", max_gen_toks=12, seed=3)
    context = "Shall I compare thee"
    greedy = pipe.generate(lm.tok_encode(context), mode="ar", temperature=0.0, max_new_tokens=12, seed=3).text
    assert lm.generate(context, {"until": []}) == greedy  # a task that does not sample: greedy, whatever the seed
    hot = {"until": [], "do_sample": True, "temperature": 5.0}
    sampled = lm.generate(context, dict(hot))
    assert sampled != greedy and lm.generate(context, dict(hot)) == sampled  # the task's temperature, seeded
