"""Would a tree of drafts beat the table's chain? A replay on the greedy continuations of held-out prompts, no timing.

A verification of 8 rows checks the last committed token and a chain of 7 drafts; a round accepts none of its drafts
28% of the time (docs/benchmarks.md §7). Tree verification (SpecInfer, Medusa, REST's tries) spends the same rows on
several candidates: each row attends to its own ancestors only, and the round keeps the longest branch AR agrees with.
Before building that (masks, positions and a cache that keeps one branch), this replays it: at each position the
candidates for the next token are, in order, the chain's own draft (the longer context, the table's or the text's, as
`draft_source="table"` drafts), the other of the two where they differ, with `--rows` the 2nd-4th most frequent
greedy next tokens of the longest context in those rows (the rows `printpress draft-table` counts:
`printpress distill --temperature 0 --seed 3 --rows R --out ROWS.bin`), the tokens of shorter contexts, and the
table's sampled distribution. Each candidate's chance of being AR's next token is estimated by its kind, rank and
context length from other held-out prompts (Laplace's rule); a round's tree grows best-first by the chance of reaching
each node (Sequoia's and EAGLE-2's construction) up to `budget` drafts. Tokens per verification are exact counts, as
in bench/draft_table_acceptance.py (budget 7 with the chain alone is the engine's 4.14 on the shipped model).

    OMP_NUM_THREADS=1 python bench/draft_trees.py --rows runs/distill/g19200.bin --out docs/results/draft_trees.json
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import sys
from pathlib import Path

import numpy as np
import torch

import printpress
from printpress.draft_table import longest_entry, next_counts
from printpress.eval.bench import heldout_prompts
from printpress.speculative import ContextLookup

Feature = tuple  # (rank, kind, context length[, share in fifths])


def alternatives(rows: np.ndarray, longest: int, first: int) -> list[dict[tuple[int, ...], list[tuple[int, int]]]]:
    """Per context length n: each context's four most frequent next tokens in `rows` (whose model-written positions
    start at `first`), with their counts."""
    out = []
    for n in range(1, longest + 1):
        level = {}
        for context, (tokens, counts) in next_counts(rows[:, first - longest:], longest, n).items():
            order = np.lexsort((tokens, -counts))[:4]
            level[context] = [(int(tokens[i]), int(counts[i])) for i in order]
        out.append(level)
    return out


def candidates(table, lookup: ContextLookup, text: list[int], second, limit: int = 4) -> list[tuple[int, Feature]]:
    """The ranked candidates for the token after `text`, each with its feature (see the module's docstring)."""
    out: list[tuple[int, Feature]] = []
    seen: set[int] = set()

    def add(token, feature):
        if token is not None and token not in seen and len(out) < limit:
            seen.add(token)
            out.append((token, (len(out),) + feature))

    n, token = longest_entry(table.maps, text[-table.longest:])
    found, from_text = lookup.match(text)
    pair = [(from_text, ("text", min(found, 6))), (token, ("table", n))]
    for candidate in pair if found and found >= n else pair[::-1]:
        add(*candidate)
    if second is not None:
        for m in range(min(table.longest, len(text)), 0, -1):
            entry = second[m - 1].get(tuple(text[-m:]))
            if entry:
                total = sum(c for _, c in entry)
                for t, c in entry:
                    add(t, ("rows", m, min(4, 5 * c // total)))
                break
    for m in range(min(table.longest, len(text)) - 1, 0, -1):
        add(table.maps[m - 1].get(tuple(text[-m:])), ("shorter", m))
    found = table.distribution(text)
    if found is not None:
        tokens, probs = found
        for i in np.argsort(-probs)[:4]:
            add(int(tokens[i]), ("sampled", min(4, int(probs[i] * 5))))
    return out


def tree(table, lookup, text, second, chance, budget: int, chain: bool) -> set[tuple[int, ...]]:
    """The drafts of one round as the set of their paths, grown best-first (or the chain alone)."""
    def children(path, reach):
        found = candidates(table, lookup, text + list(path), second)
        return [(reach * chance(feature), path + (token,)) for token, feature in (found[:1] if chain else found)]

    heap = [(-reach, path) for reach, path in children((), 1.0)]
    heapq.heapify(heap)
    nodes: set[tuple[int, ...]] = set()
    while heap and len(nodes) < budget:
        reach, path = heapq.heappop(heap)
        nodes.add(path)
        for child in children(path, -reach):
            heapq.heappush(heap, (-child[0], child[1]))
    return nodes


def replay(table, prompt, continuation, second, chance, budget, chain) -> tuple[int, int]:
    """(tokens committed, verifications) of greedy rounds whose drafts are `tree`'s, along AR's `continuation`."""
    text = prompt + continuation
    i = len(prompt)
    lookup = ContextLookup(text[: i + 1])
    tokens = rounds = 0
    while i + 1 < len(text):
        nodes = tree(table, lookup, text[: i + 1], second, chance, budget, chain)
        kept = 0
        while i + 1 + kept < len(text) and tuple(text[i + 1 : i + 2 + kept]) in nodes:
            kept += 1
        step = min(kept + 1, len(text) - 1 - i)
        lookup.extend(text[i + 1 : i + 1 + step])
        i, tokens, rounds = i + step, tokens + step, rounds + 1
    return tokens, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--rows", default=None, help="greedy rows (a distill .bin of 64 + 64 tokens) for the 2nd-4th "
                                                     "most frequent next tokens")
    parser.add_argument("--heldout", type=int, default=24, help="prompts replayed (the yardstick's first ones)")
    parser.add_argument("--calibration", type=int, default=72, help="other held-out prompts the chances come from")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[3, 5, 7, 9, 11])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = printpress.load(args.model)
    table = pipe.model.draft_table
    if table is None:
        parser.error(f"{args.model} has no draft table: make one with `printpress draft-table {args.model}`")
    second = None
    if args.rows:
        rows = np.fromfile(args.rows, dtype=np.uint16).reshape(-1, 2 * args.tokens).astype(np.int64)
        second = alternatives(rows, table.longest, args.tokens)
    prompts = [pipe.encode_text(p) for p in heldout_prompts(args.heldout + args.calibration, ["shakespeare"], 0.05)]
    continuations = [pipe.generate(p, mode="ar", temperature=0, max_new_tokens=args.tokens).token_ids
                     for p in prompts]
    hits, seen = collections.Counter(), collections.Counter()
    for prompt, continuation in zip(prompts[args.heldout:], continuations[args.heldout:]):
        text = prompt + continuation
        lookup = ContextLookup(prompt)
        for j in range(len(prompt), len(text)):
            for token, feature in candidates(table, lookup, text[:j], second):
                seen[feature] += 1
                hits[feature] += token == text[j]
            lookup.extend(text[j : j + 1])

    def chance(feature):
        return (hits[feature] + 1) / (seen[feature] + 2)

    results = {}
    for budget in args.budgets:
        for chain in (True, False):
            counted = [replay(table, p, c, second, chance, budget, chain)
                       for p, c in zip(prompts[: args.heldout], continuations[: args.heldout])]
            tokens, rounds = map(sum, zip(*counted))
            name = f"{'chain' if chain else 'tree'}, {budget} drafts"
            results[name] = tokens / rounds
            print(f"{name:16s} {tokens / rounds:.3f} tokens per verification", flush=True)
    kinds = {" ".join(map(str, f)): {"seen": seen[f], "chance": round(chance(f), 3)}
             for f in sorted(seen, key=lambda f: -seen[f])[:30]}
    out = {"command": "python bench/draft_trees.py " + " ".join(sys.argv[1:]), "model": args.model,
           "tokens_per_verification": results, "most_common_candidates": kinds}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
