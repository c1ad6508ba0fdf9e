"""What self-speculative decoding delivers when the drafts are good: a toy joint model on a learnable task.

The shipped model's diffusion half drafts poorly (docs/benchmarks-speculative.md). To see what the loop itself
can do on this CPU, this script trains a tiny DiffusionGemma with the joint objective (printpress's own
`TrainStep`) on arithmetic progressions (step 1-3) modulo the vocabulary — two tokens fix the rest, so both
halves can learn the task in minutes — then decodes held-out prompts greedily with `mode="ar"` and with
`speculative`, checks the tokens are identical, and reports tokens/s of both (measured back to back),
tokens per verification and tokens per forward.

    python bench/speculative_toy.py [--steps 600] [--threads 1] [--out docs/results/speculative-toy.json] [--fused]

`--fused` adds fused draft+verify settings (`fused_draft`, each outcome's canvas `fused canvas` long) beside
unfused ones of the same draft lengths.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from printpress.config import TextConfig
from printpress.engine import DoneEvent, Request, run
from printpress.model import DiffusionGemma
from printpress.sampling import SamplerSettings
from printpress.speculative import speculative
from printpress.train.objectives import DiffusionSettings, TrainStep

VOCAB, CANVAS, LENGTH = 64, 16, 64
FIRST = 3  # ids 0-2 are pad, eos, bos


def progressions(count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Rows x_i = FIRST + (a + i * s) mod (VOCAB - FIRST), with random a and s in 1..3 per row."""
    span = VOCAB - FIRST
    start = torch.randint(0, span, (count, 1), generator=generator)
    step = torch.randint(1, 4, (count, 1), generator=generator)
    return FIRST + (start + step * torch.arange(length)) % span


def train(steps: int, seed: int) -> DiffusionGemma:
    torch.manual_seed(seed)
    config = TextConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=24, global_head_dim=24,
                        sliding_window=32, num_experts=2, top_k_experts=1, moe_intermediate_size=96,
                        max_position_embeddings=512,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    model = DiffusionGemma(config)
    step = TrainStep(model, "joint", DiffusionSettings(block=CANVAS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        losses = step(progressions(32, LENGTH, g), generator=g)
        optimizer.zero_grad()
        losses["loss"].backward()
        optimizer.step()
        if i % 100 == 0 or i == steps - 1:
            print(f"step {i}: diffusion {float(losses['diffusion']):.3f}, ar {float(losses['ar']):.3f}", flush=True)
    return model.eval()


def decode(model, prompt: list[int], settings: SamplerSettings, speculative_mode: bool, drafts: int | None,
           fused: int | None = None):
    start = time.perf_counter()
    if speculative_mode:
        events = speculative(model, [Request(prompt, settings, 0)], None, canvas_length=CANVAS, draft_length=drafts,
                             step_events=False, fused_canvas=fused)
    else:
        events = run(model, CANVAS, [Request(prompt, settings.with_overrides(mode="ar"), 0)], None, step_events=False)
    result = next(e.result for e in events if isinstance(e, DoneEvent))
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", default="docs/results/speculative-toy.json")
    parser.add_argument("--fused", action="store_true", help="sweep fused draft+verify settings beside unfused ones")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = train(args.steps, seed=0)
    prompts = progressions(8, 4, torch.Generator().manual_seed(123)).tolist()  # held-out seed
    rows = []
    with torch.no_grad():
        sweep = [(1, 15, None), (1, 7, None), (2, 15, None)]
        if args.fused:
            sweep = [(1, drafts, fused) for drafts in (3, 7, 15) for fused in (None, drafts + 1)]
        for steps, drafts, fused in sweep:
            settings = SamplerSettings(max_new_tokens=args.tokens, max_denoising_steps=steps, mode="speculative",
                                       fused_draft=fused is not None)
            ar_time = spec_time = 0.0
            tokens = verifications = forwards = correct = 0
            for prompt in prompts:
                ar, seconds = decode(model, prompt, settings, False, None)
                ar_time += seconds
                spec, seconds = decode(model, prompt, settings, True, drafts, fused)
                spec_time += seconds
                if spec.token_ids != ar.token_ids:
                    raise SystemExit(f"speculative output differs from AR for prompt {prompt}")
                truth = progressions_continuation(prompt, args.tokens)
                correct += sum(int(a == b) for a, b in zip(ar.token_ids, truth))
                tokens += spec.stats.new_tokens
                verifications += spec.stats.verifications
                forwards += spec.stats.forward_passes
            row = {"draft_steps": steps, "draft_length": drafts, "canvas": CANVAS, "fused_canvas": fused,
                   "identical": True,
                   "ar_tokens_per_s": tokens / ar_time, "speculative_tokens_per_s": tokens / spec_time,
                   "ratio": ar_time / spec_time, "tokens_per_verification": (tokens - len(prompts)) / verifications,
                   "tokens_per_forward": tokens / forwards, "ar_accuracy_on_the_task": correct / tokens}
            rows.append(row)
            print(json.dumps(row), flush=True)
    command = (f"python bench/speculative_toy.py --steps {args.steps} --threads {args.threads} --tokens {args.tokens} "
               f"--out {args.out}" + (" --fused" if args.fused else ""))
    Path(args.out).write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")


def progressions_continuation(prompt: list[int], count: int) -> list[int]:
    span = VOCAB - FIRST
    a, s = prompt[0] - FIRST, (prompt[1] - prompt[0]) % span
    return [FIRST + (a + s * i) % span for i in range(len(prompt), len(prompt) + count)]


if __name__ == "__main__":
    main()
