"""Whose drafts agree with whose greedy text: speculative acceptance with the drafter and the verifier crossed.

Self-speculative decoding (`mode="speculative"`, greedy) commits, per verification, the drafts that equal the AR
model's greedy tokens plus one. When a fine-tune changes that figure, either the drafter got worse or the text it
must guess (its own AR side's greedy continuation) got harder to guess. This script separates the two: for every
pair (drafter D, verifier V) of the given models it replays the greedy speculative rounds of V on held-out prompts
with D's drafts. V's greedy continuation is computed once (`mode="ar"`, the text speculative decoding outputs);
each round, D encodes the prompt and the committed tokens with its own encoder, denoises one canvas whose first
slot holds the last committed token (one decoder pass from uniform noise, as `mode="speculative"` drafts with one
draft step), and the round commits the leading drafts equal to V's tokens, plus V's own. With D = V this is the
speculative run itself: the same noise (each prompt's generator seeded as a request's), the
same drafts up to the last bits of a cache encoded at once instead of block by block.

Reported per pair: tokens committed per verification, and the conditional match rate of draft i given that
drafts 1..i-1 matched (which says where the run is cut). Per verifier: the share of its greedy text's token
4-grams that repeat an earlier one in the same continuation (loops are easy to draft).

    python bench/draft_agreement.py --models models/shakespeare-joint runs/joint-both2/model \
        --heldout 24 --tokens 64 --out docs/results/draft-agreement.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import printpress
from printpress.engine import DoneEvent, Request, run
from printpress.eval.bench import heldout_prompts
from printpress.sampling import uniform_tokens

POSITIONS = 8  # conditional match rates reported for drafts 1..POSITIONS


def greedy_continuation(pipe, prompt: list[int], tokens: int) -> list[int]:
    """`mode="ar"` greedy tokens after `prompt`: what greedy speculative decoding outputs."""
    settings = pipe.settings(mode="ar", max_new_tokens=tokens, temperature=0.0)
    events = run(pipe.model, pipe.canvas_length, [Request(prompt, settings, 0)], None, step_events=False)
    return next(e.result for e in events if isinstance(e, DoneEvent)).token_ids


def repeated_4gram_share(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    seen, repeats = set(), 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams) if grams else 0.0


@torch.no_grad()
def draft(model, context: list[int], last: int, drafts: int, canvas: int, generator: torch.Generator) -> list[int]:
    """D's one-step draft after `context` (encoded by D) with `last` clamped in the canvas's first slot."""
    cache = model.new_cache(1, len(context) + canvas)
    model.encode(torch.tensor([context]), cache, logits="none")
    ids = uniform_tokens(canvas, model.config.vocab_size, generator, torch.device("cpu"))
    ids[0, 0] = last
    logits = model.denoise(ids, cache)
    return torch.argmax(logits[0, 1 : drafts + 1], dim=-1).tolist()


def replay(model, prompt: list[int], target: list[int], drafts: int, canvas: int, generator, counts: dict) -> None:
    """The greedy speculative rounds that output `target` after `prompt`, drafted by `model`; adds to `counts`."""
    pos = 0  # target[pos] is the last committed token; the prefill committed target[0]
    while pos < len(target) - 1:
        m = min(drafts, len(target) - 2 - pos)  # as mode="speculative" leaves the last token to the verifier
        guess = draft(model, prompt + target[:pos], target[pos], m, canvas, generator) if m > 0 else []
        accepted = 0
        while accepted < m and guess[accepted] == target[pos + 1 + accepted]:
            accepted += 1
        for i in range(min(accepted + 1, m, POSITIONS)):  # draft i was tried (every earlier one matched)
            counts["tried"][i] += 1
            counts["matched"][i] += i < accepted
        committed = min(accepted + 1, len(target) - 1 - pos)
        counts["tokens"] += committed
        counts["verifications"] += 1
        pos += committed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True, help="model folders (each drafts and verifies)")
    parser.add_argument("--heldout", type=int, default=24, help="held-out prompts, as `printpress bench` draws them")
    parser.add_argument("--heldout-data", default="shakespeare")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--drafts", type=int, default=31)
    parser.add_argument("--canvas", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipes = {name: printpress.load(name) for name in args.models}
    texts = heldout_prompts(args.heldout, [args.heldout_data], 0.05)
    first = pipes[args.models[0]]
    prompts = [first.encode_text(text) for text in texts]
    targets = {name: [greedy_continuation(pipe, p, args.tokens) for p in prompts] for name, pipe in pipes.items()}
    rows = []
    for verifier in args.models:
        for drafter in args.models:
            counts = dict(tokens=0, verifications=0, tried=[0] * POSITIONS, matched=[0] * POSITIONS)
            for prompt, target in zip(prompts, targets[verifier]):
                generator = torch.Generator().manual_seed(args.seed)  # a request's generator, as the engine seeds it
                replay(pipes[drafter].model, prompt, target, args.drafts, args.canvas, generator, counts)
            row = {
                "drafter": drafter, "verifier": verifier,
                "tokens_per_verification": counts["tokens"] / counts["verifications"],
                "match_rate_by_position": [m / t if t else None for m, t in zip(counts["matched"], counts["tried"])],
                "verifier_repeated_4gram_share": sum(map(repeated_4gram_share, targets[verifier])) / len(prompts),
            }
            rows.append(row)
            rates = " ".join(f"{r:.2f}" for r in row["match_rate_by_position"][:4] if r is not None)
            print(f"verifier {verifier} drafter {drafter}: {row['tokens_per_verification']:.2f} tokens/verification, "
                  f"match rate of drafts 1-4 {rates}; verifier's repeated 4-grams "
                  f"{row['verifier_repeated_4gram_share']:.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python bench/draft_agreement.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
            "prompts": texts, "machine": f"{platform.machine()}, torch {torch.__version__}",
            "decoding": "greedy; one draft step from uniform noise; drafts compared with the verifier's mode='ar' text"}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
