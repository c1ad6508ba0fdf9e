"""What-if: speculative sampling with a lossy ("typical") acceptance rule instead of the exact one.

Medusa's typical acceptance (Cai et al. 2024) keeps a draft token x when the AR model's probability of it is above
min(eps, delta * exp(-H(p))), H the entropy of the AR distribution p; at the first token below, it draws from p. The
output no longer follows AR's distribution, so the engine does not ship it; this script measures how many drafts
such a rule would keep, per verification and per forward pass (every pass counted), for drafts from the diffusion
decoder (after 1..8 denoising steps) and from the draft table, on held-out prompts at AR's sampling settings.
It swaps `printpress.speculative.sampled_accept` for the lossy rule in this process only.

    OMP_NUM_THREADS=1 python bench/lossy_acceptance.py [--eps 0.09 --delta 0.3] [--prompts 12] [--seeds 2]
"""

from __future__ import annotations

import argparse
import json

import torch

import printpress
import printpress.speculative as speculative_mode
from printpress.engine import DoneEvent, Request
from printpress.eval.bench import heldout_prompts
from printpress.sampling import multinomial_one

# (name, draft steps, drafts per round, fused canvas or None, draft source)
SETTINGS = [("diffusion, 1 step, 31 drafts", 1, 31, None, "diffusion"),
            ("diffusion, 1 step, 7 drafts", 1, 7, None, "diffusion"),
            ("diffusion, 2 steps, 31 drafts", 2, 31, None, "diffusion"),
            ("diffusion, 4 steps, 31 drafts", 4, 31, None, "diffusion"),
            ("diffusion, 8 steps, 31 drafts", 8, 31, None, "diffusion"),
            ("diffusion, fused, 3 drafts", 1, 3, 4, "diffusion"),
            ("table, 7 drafts", 1, 7, None, "table"),
            ("table, 15 drafts", 1, 15, None, "table")]


def lossy_accept(eps: float, delta: float):
    def accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator) -> list[int]:
        tokens = draft.tolist()
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        floor = torch.clamp(delta * torch.exp(-entropy), max=eps)
        for i, token in enumerate(tokens):
            if float(p[i, token]) <= float(floor[i]):
                return tokens[:i] + [int(multinomial_one(p[i], generator))]
        return tokens + [int(multinomial_one(p[len(tokens)], generator))]
    return accept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--eps", type=float, default=0.09)
    parser.add_argument("--delta", type=float, default=0.3)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    speculative_mode.sampled_accept = lossy_accept(args.eps, args.delta)
    pipe = printpress.load(args.model)
    prompts = [pipe.tokenizer.encode(text).ids for text in heldout_prompts(args.prompts, ["shakespeare"], 0.05)]
    rows = []
    for name, steps, drafts, fused, source in SETTINGS:
        tokens = passes = verifications = 0
        for ids in prompts:
            for seed in range(args.seeds):
                settings = pipe.settings(mode="speculative", max_new_tokens=args.tokens, draft_steps=steps,
                                         temperature=0.8, top_k=50, fused_draft=fused is not None, draft_source=source)
                events = speculative_mode.speculative(pipe.model, [Request(ids, settings, seed)], None, canvas_length=32,
                                                      draft_length=drafts, step_events=False, fused_canvas=fused)
                stats = next(e.result for e in events if isinstance(e, DoneEvent)).stats
                tokens += stats.new_tokens
                passes += stats.forward_passes
                verifications += stats.verifications
        rows.append({"setting": name, "tokens_per_verification": tokens / verifications,
                     "tokens_per_forward": tokens / passes})
        print(f"{name:32s} tokens per verification {tokens / verifications:5.2f}   per forward {tokens / passes:5.2f}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
