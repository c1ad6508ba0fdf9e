"""How long should a greedy table draft be? The cost of a verification by its length, and a replay of greedy
speculative rounds that prices each way of choosing the draft's length with it.

1. Cost: a block of T tokens (the last committed token and T - 1 drafts) through `encode_tentatively` after a
   60-token prompt, T = 1 (an AR step) .. 12, medians of rounds in turn; compiled ahead of time by default
   (`--exact`: the exact passes).
   Compiled, the graph's own time (a timer around the packages' runner); exact, the whole call's.
2. Time outside the graphs (compiled only): AR greedy and table speculation (7 drafts) decoded through the engine
   on the held-out prompts with that timer: per AR step and per verification, what the engine spends beside the
   graph (the cache writes, the acceptance, the drafting, the events), and the two sides' measured ratio, which
   the replay's fixed 7 should reproduce. Exact passes are priced by their whole calls, with nothing beside.
3. Replay: the AR side's greedy continuation of each held-out prompt is what speculative decoding outputs, so each
   round can be replayed without the model (as `bench/draft_table_acceptance.py` does): the table drafts up to 15
   tokens, a rule keeps the first L, and the round commits the kept prefix that equals the continuation plus AR's
   token, at the price cost(L + 1) + the time outside. Rules: fixed lengths, and the length that maximises the
   expected tokens per millisecond of the round, each drafted token's chance of being kept estimated from other
   held-out prompts (`--calibration` of them, after the first `--heldout`) by the context it was drafted from (its
   length, the table's or the text's, and the table's sampled probability of the token, in fifths).

    OMP_NUM_THREADS=1 python bench/draft_length.py [--model models/shakespeare-joint] [--heldout 24] \
        [--calibration 48] [--exact] [--out docs/results/draft-length.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import printpress
from printpress import aot
from printpress.eval.bench import heldout_prompts
from printpress.fast import compile_ar_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import run_ar, run_speculative  # noqa: E402 - the speculative bench's engine calls

LONGEST_DRAFT = 15
BLOCKS = range(1, 13)


class GraphTimer:
    """While active: the seconds spent inside the compiled graphs' runner (their ahead-of-time packages), and the
    number of calls."""

    def __enter__(self) -> GraphTimer:
        self.seconds, self.calls, self._run = 0.0, 0, aot._Runner.__call__
        timer = self

        def timed(runner, tensors):
            start = time.perf_counter()
            out = timer._run(runner, tensors)
            timer.seconds += time.perf_counter() - start
            timer.calls += 1
            return out

        aot._Runner.__call__ = timed
        return self

    def __exit__(self, *exc) -> None:
        aot._Runner.__call__ = self._run


def block_costs(model, graph_only: bool, rounds: int = 5, calls: int = 40) -> dict[int, float]:
    """Median ms of a verification of T tokens (T = 1: an AR step), each call's cache write rolled back untimed:
    the graph's time alone with `graph_only` (the engine's time beside it is measured on its own), else the call's."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    cache = model.new_cache(1, 100)
    model.encode(torch.randint(3, vocab, (1, 60), generator=generator), cache, logits="none")
    blocks = {t: torch.randint(3, vocab, (1, t), generator=generator) for t in BLOCKS}

    def timed(t: int) -> float:
        snapshot = cache.snapshot(1)
        with GraphTimer() as graph:
            start = time.perf_counter()
            if t == 1:
                model.encode(blocks[1], cache, logits="last")
            else:
                _, keep = model.encode_tentatively(blocks[t], cache)
                keep(1)
            elapsed = time.perf_counter() - start
        cache.truncate(60, snapshot)
        return graph.seconds if graph_only else elapsed

    for t in BLOCKS:  # first calls build or load the graphs
        for _ in range(3):
            timed(t)
    medians = {t: [] for t in BLOCKS}
    for _ in range(rounds):
        for t in BLOCKS:
            medians[t].append(statistics.median(timed(t) for _ in range(calls)))
    return {t: 1e3 * statistics.median(m) for t, m in medians.items()}


def outside_the_graphs(pipe, prompts: list[list[int]], tokens: int) -> dict:
    """The engine's time beside the compiled graphs, per AR step and per verification, and the measured ratio."""
    for prompt in prompts[:4]:  # warm-up
        run_ar(pipe, prompt, 8)
        run_speculative(pipe, prompt, 8, 1, 7, 32, source="table")
    sides = {}
    for side in ("AR", "speculative"):
        wall = produced = 0
        with GraphTimer() as graph:
            for prompt in prompts:
                if side == "AR":
                    ids, seconds = run_ar(pipe, prompt, tokens)
                    produced += len(ids)
                else:
                    result, seconds = run_speculative(pipe, prompt, tokens, 1, 7, 32, source="table")
                    produced += len(result.token_ids)
                wall += seconds
        sides[side] = {"tokens_per_s": produced / wall, "graph_calls": graph.calls,
                       "outside_ms_per_call": 1e3 * (wall - graph.seconds) / graph.calls}
    sides["measured_ratio"] = sides["speculative"]["tokens_per_s"] / sides["AR"]["tokens_per_s"]
    return sides


def drafted(table, text: list[int], lookup) -> list[tuple[int, int, str, float]]:
    """The table's draft after `text` (`DraftTable.chain`: each token from the longer context, the table's or the
    text's), up to LONGEST_DRAFT tokens, each with its context's length, source and the sampled probability of the
    token (-1 where the counts know no context)."""
    out = []
    for token, n, source in table.chain(text, LONGEST_DRAFT, lookup):
        probability = -1.0
        distribution = table.distribution(text + [t for t, *_ in out])
        if distribution is not None:
            next_tokens, probabilities = distribution
            hit = np.nonzero(next_tokens == token)[0]
            probability = float(probabilities[hit[0]]) if len(hit) else 0.0
        out.append((token, n, source, probability))
    return out


def bucket(n: int, source: str, probability: float) -> str:
    return f"{min(n, 5)} {source} {-1 if probability < 0 else min(int(probability * 5), 4)}"


def replay(table, pairs, choose, cost, outside: float, seen: list | None = None) -> tuple[int, int, float]:
    """(tokens committed, verifications, ms) of greedy rounds along each prompt's continuation (its first token
    comes from the prompt's pass), drafting `choose(draft)` tokens a round; `seen` collects (bucket, kept) for every
    drafted token up to the first miss."""
    from printpress.speculative import ContextLookup

    tokens = rounds = 0
    spent = 0.0
    for prompt, continuation in pairs:
        text = prompt + continuation
        i = len(prompt)
        lookup = ContextLookup(text[: i + 1])
        while i + 1 < len(text):
            full = drafted(table, text[: i + 1], lookup)
            guess = full[: choose(full)]
            kept = 0
            while kept < len(guess) and i + 1 + kept < len(text) and text[i + 1 + kept] == guess[kept][0]:
                kept += 1
            if seen is not None:
                for j, (token, n, source, probability) in enumerate(full):
                    if i + 1 + j >= len(text):
                        break
                    seen.append((bucket(n, source, probability), text[i + 1 + j] == token))
                    if text[i + 1 + j] != token:
                        break
            step = min(kept + 1, len(text) - 1 - i)
            lookup.extend(text[i + 1 : i + 1 + step])
            i, tokens, rounds = i + step, tokens + step, rounds + 1
            spent += cost(len(guess) + 1) + outside
    return tokens, rounds, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--heldout", type=int, default=24, help="held-out prompts the rules are priced on")
    parser.add_argument("--calibration", type=int, default=48, help="other held-out prompts the chances come from")
    parser.add_argument("--heldout-data", default="shakespeare")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--exact", action="store_true", help="price the exact passes instead of the compiled ones")
    parser.add_argument("--out", default="docs/results/draft-length.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    pipe = printpress.load(args.model, compile=None if args.exact else "ar")
    table = pipe.model.draft_table
    if table is None:
        sys.exit(f"{args.model} has no draft table (printpress draft-table {args.model})")
    texts = heldout_prompts(args.heldout + args.calibration, [args.heldout_data], 0.05)
    prompts = [pipe.encode_text(t) for t in texts]
    costs = block_costs(pipe.model, graph_only=not args.exact)
    print("verification cost (the graph alone where compiled), ms by block length:",
          {t: round(c, 3) for t, c in costs.items()}, flush=True)
    engine = outside_the_graphs(pipe, prompts[: args.heldout], args.tokens) if not args.exact else None
    if engine:
        print(json.dumps(engine), flush=True)
    outside = engine["speculative"]["outside_ms_per_call"] if engine else 0.0
    ar_ms = costs[1] + (engine["AR"]["outside_ms_per_call"] if engine else 0.0)

    def cost(t: int) -> float:
        return costs[t] if t in costs else costs[max(BLOCKS)] + (costs[12] - costs[8]) / 4 * (t - max(BLOCKS))

    def continued(chosen):
        return [(p, list(pipe.generate(p, mode="ar", temperature=0, max_new_tokens=args.tokens).token_ids))
                for p in chosen]

    evaluation, calibration = continued(prompts[: args.heldout]), continued(prompts[args.heldout :])
    seen: list = []
    replay(table, calibration, lambda full: 7, cost, outside, seen)
    counts = collections.defaultdict(lambda: [0, 0])
    for key, kept in seen:
        counts[key][0] += kept
        counts[key][1] += 1
    chance = {key: (k + 1) / (n + 2) for key, (k, n) in counts.items()}  # Laplace's rule

    def sized(cap: int):
        def choose(full) -> int:
            best, best_length, expected, survive = 1.0 / (cost(1) + outside), 0, 1.0, 1.0
            for length, (_, n, source, probability) in enumerate(full[:cap], 1):
                survive *= chance.get(bucket(n, source, probability), 0.3)
                expected += survive
                rate = expected / (cost(length + 1) + outside)
                if rate > best:
                    best, best_length = rate, length
            return best_length
        return choose

    rules = {f"fixed {m}": (lambda full, m=m: m) for m in (3, 5, 7, 9, 11, 15)}
    rules.update({f"chosen per round, cap {cap}": sized(cap) for cap in (7, 11, 15)})
    rows = []
    for name, rule in rules.items():
        tokens, rounds, spent = replay(table, evaluation, rule, cost, outside)
        per_verification, per_ms = tokens / rounds, tokens / spent
        rows.append({"rule": name, "tokens_per_verification": per_verification,
                     "predicted_x_ar_greedy": per_ms * ar_ms})
        print(f"{name:28s} {per_verification:.2f} tokens per verification, predicted {per_ms * ar_ms:.2f}x AR greedy",
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python bench/draft_length.py " + " ".join(sys.argv[1:]), "model": args.model,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}",
            "passes": "exact" if args.exact else "compiled ahead of time"}
    out.write_text(json.dumps({"meta": meta, "block_costs_ms": costs, "engine": engine, "chances": counts,
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
