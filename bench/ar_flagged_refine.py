"""What-if: the AR side flags the tokens of a diffusion canvas it finds implausible, and they are rewritten.

A canvas is denoised as usual (diffusion mode, 32 tokens); one causal pass over prompt + canvas gives the AR
side's probability (temperature 0.8, top-k 50) of every canvas token; the tokens at or under `tau` are then either
redrawn from the AR distribution ("redraw": all at once, each after the canvas as it was) or re-noised and
rewritten by one more decoder pass with the rest of the canvas clamped ("refine": argmax, or a draw at a
temperature), `rounds` times; then the next canvas. Every pass is counted: the decoder's steps, the encoder pass
that caches the canvas (whose logits are the check, so a check costs no pass of its own), and per round that
rewrote something, the decoder pass (refine) and the encoder pass that caches the rewritten canvas again. Judged by the AR twin and SmolLM2 on
held-out prompts beside AR sampling on the same weights, with the yardstick's diversity figures. Scratch-scale
(one process, no interleaving for speed): this measures quality and passes, not tokens/s.

    OMP_NUM_THREADS=1 python bench/ar_flagged_refine.py [--prompts 8] [--seeds 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

import printpress
from printpress.canvas import denoise
from printpress.eval import diversity
from printpress.eval.bench import heldout_prompts
from printpress.eval.frontier import load_gguf_judge
from printpress.eval.judge import nll_per_char
from printpress.sampling import multinomial_one, next_token_probs

CANVAS = 32
# name: (diffusion steps, entropy bound, tau, rounds, rewrite: "redraw" or a decoder temperature, 0 = argmax[,
# the diffusion temperature, which scales its schedule: the colder plain sides give the frontier at lower diversity])
VARIANTS = {
    "diffusion 8 steps, bound 2, temperature 0.9": (8, 2.0, 0.0, 0, None, 0.9),
    "diffusion 8 steps, bound 2, temperature 0.8": (8, 2.0, 0.0, 0, None, 0.8),
    "diffusion 8 steps, bound 2, temperature 0.7": (8, 2.0, 0.0, 0, None, 0.7),
    "diffusion 8 steps, bound 2": (8, 2.0, 0.0, 0, None),
    "+ redraw from AR, tau 0.01": (8, 2.0, 0.01, 1, "redraw"),
    "+ redraw from AR, tau 0.01, 2 rounds": (8, 2.0, 0.01, 2, "redraw"),
    "+ refine (argmax), tau 0.01": (8, 2.0, 0.01, 1, 0.0),
    "+ refine (argmax), tau 0.01, 2 rounds": (8, 2.0, 0.01, 2, 0.0),
    "+ refine (T 0.8), tau 0.01": (8, 2.0, 0.01, 1, 0.8),
    "+ refine (T 1), tau 0.01": (8, 2.0, 0.01, 1, 1.0),
    "diffusion 4 steps, bound 8": (4, 8.0, 0.0, 0, None),
    "4 steps + refine (T 0.8), tau 0.01, 2 rounds": (4, 8.0, 0.01, 2, 0.8),
    "2 steps, bound 16 + refine (T 0.8), tau 0.01, 2 rounds": (2, 16.0, 0.01, 2, 0.8),
}


class Refiner:
    def __init__(self, pipe) -> None:
        self.pipe, self.model = pipe, pipe.model
        self.ar = pipe.settings(mode="ar", temperature=0.8, top_k=50)

    @torch.no_grad()
    def flagged(self, ids: list[int], start: int, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The AR distributions over the canvas ids[start:] (one causal pass) and the mask of tokens at or under tau."""
        logits = self.model.encode(torch.tensor([ids]), self.model.new_cache(1, len(ids)), logits="all")[0]
        p = next_token_probs(logits[start - 1 : len(ids) - 1], self.ar)
        tokens = torch.tensor(ids[start:])
        return p, p[torch.arange(len(tokens)), tokens] <= tau

    @torch.no_grad()
    def rewrite(self, ids: list[int], start: int, p: torch.Tensor, bad: torch.Tensor, how,
                gen: torch.Generator) -> int:
        """Rewrite the flagged canvas tokens in place; returns the passes it took (0 for a redraw)."""
        where = bad.nonzero().flatten().tolist()
        if how == "redraw":
            for i in where:
                ids[start + i] = int(multinomial_one(p[i], gen))
            return 0
        cache = self.model.new_cache(1, len(ids))
        self.model.encode(torch.tensor([ids[:start]]), cache, logits="last")  # the prefix, cached before in the engine
        canvas = torch.tensor(ids[start:])
        canvas[bad] = torch.randint(0, self.model.config.vocab_size, (len(where),), generator=gen)
        logits = denoise(self.model, canvas[None], cache, None)[0]
        for i in where:
            ids[start + i] = int(torch.argmax(logits[i])) if how == 0 else int(
                multinomial_one(torch.softmax(logits[i] / how, -1), gen))
        return 1

    def generate(self, prompt_ids: list[int], variant, seed: int, tokens: int) -> tuple[list[int], int, int]:
        steps, bound, tau, rounds, how = variant[:5]
        cold = {"temperature": variant[5]} if len(variant) > 5 else {}
        ids, passes, rewritten = list(prompt_ids), 0, 0
        gen = torch.Generator().manual_seed(1000 + seed)
        for c in range(tokens // CANVAS):
            result = self.pipe.generate(ids, seed=seed * 7 + c, mode="diffusion", max_denoising_steps=steps,
                                        entropy_bound=bound, max_new_tokens=CANVAS, **cold)
            start = len(ids)
            ids += list(result.token_ids)
            passes += result.stats.forward_passes + 1  # its decoder passes + the encoder pass that caches it
            for _ in range(rounds):
                p, bad = self.flagged(ids, start, tau)  # the caching pass's own logits: no pass of its own
                if not bad.any():
                    break
                passes += self.rewrite(ids, start, p, bad, how, gen) + 1  # + caching the rewritten canvas again
                rewritten += int(bad.sum())
        return ids[len(prompt_ids):], passes, rewritten


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--twin", default="models/shakespeare-ar")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--only", help="the variants whose name holds this text (AR sampling always runs)")
    parser.add_argument("--out")
    args = parser.parse_args()
    pipe, twin = printpress.load(args.model), printpress.load(args.twin)
    gguf, _ = load_gguf_judge("on")
    refiner = Refiner(pipe)
    texts = heldout_prompts(args.prompts, ["shakespeare"], 0.05)
    samples: dict[str, list[tuple[str, str, int, int]]] = {}
    for s in range(args.seeds):
        for k, text in enumerate(texts):
            seed = s * args.prompts + k
            ar = pipe.generate(text, seed=seed, mode="ar", temperature=0.8, top_k=50, max_new_tokens=args.tokens)
            samples.setdefault("AR sampling (0.8, top-k 50)", []).append((text, ar.text, ar.stats.forward_passes, 0))
            prompt_ids = pipe.prompt_ids(text)[0][0]
            for name, variant in VARIANTS.items():
                if args.only and args.only not in name:
                    continue
                out, passes, rewritten = refiner.generate(prompt_ids, variant, seed, args.tokens)
                samples.setdefault(name, []).append((text, pipe.tokenizer.decode(out), passes, rewritten))
    rows = []
    for name, got in samples.items():
        new = args.tokens * len(got)
        row = {"side": name, "tokens_per_forward_all_passes": new / sum(g[2] for g in got),
               "rewritten_share": sum(g[3] for g in got) / new,
               "ar_twin": sum(nll_per_char(twin, t, c) for t, c, _, _ in got) / len(got),
               "smollm2": sum(gguf.nll_per_char(t, c) for t, c, _, _ in got) / len(got),
               **diversity.diversity([c for _, c, _, _ in got])}
        rows.append(row)
        print(f"{name:55s} tok/fwd {row['tokens_per_forward_all_passes']:.2f}  rewritten {row['rewritten_share']:.2f}  "
              f"twin {row['ar_twin']:.3f}  SmolLM2 {row['smollm2']:.3f}  entropy {row['unigram_entropy_nats']:.2f}  "
              f"rep4 {row['repeated_4gram_share']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
