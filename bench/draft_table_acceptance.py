"""How many drafts a draft table would get kept, without timing anything: replays on held-out prompts.

Greedy (`--greedy`): the model's greedy continuation of each held-out prompt is computed once (`mode="ar"`, what
greedy speculative decoding outputs); each speculative round is then replayed from it: a draft of up to `--drafts`
tokens from the context lookup, or from the draft table (each token from the longer context, the table's or the
text's, as `draft_source="table"` drafts; "before the text's turns": the table's chain, the lookup only where the
table has nothing), keeps its prefix that equals the continuation, plus the AR token. The result is
the engine's tokens per verification exactly (no noise is involved), for the table as it is and for tables made
with shorter contexts or from other rows.

Sampled (`--sampled ROWS.bin`): speculative sampling keeps a draft token d drawn from q with probability
min(1, p(d) / q(d)), so one draft token is kept with probability sum_x min(p(x), q(x)). Along AR samples
(temperature 0.8, top-k 50) of the held-out prompts this averages that figure for the table's one-hot draft (q on
the table's token: p(d)) and for a q made of the next-token counts of sampled rows (`printpress distill` at a
temperature), taken as `printpress draft-table` takes them (the longest context seen at least `MIN_COUNT` times).
The engine's q (`DraftTable.interpolated`: every known context's counts, interpolated by absolute
discounting, with a share for the text's own continuation) is counted the same way. Tokens per verification of m drafts are then about 1 + a + ... + a^m for a
mean acceptance a (acceptances taken as independent: a rough figure).

Trees (`--trees`): a verification could check a tree of drafts instead of one chain (SpecInfer, EAGLE-2), each
row attending to its own branch: m draft tokens grown best-first from each node's candidates (the chain's token,
the other tokens the table's shorter contexts name, its sampled counts' likeliest), each candidate's chance of being
AR's token, given its branch was, estimated by its rank and kind on the first half of the prompts; the second half
replays greedy rounds that keep the tree's longest branch AR wrote, against the chain of m drafts on the same
prompts. For the same number of rows per verification, the tokens a tree would commit.

    python bench/draft_table_acceptance.py --greedy --out docs/results/draft_table_acceptance.json
    python bench/draft_table_acceptance.py --sampled runs/distill/l13-t09.bin \
        --out docs/results/draft_table_sampled.json
    python bench/draft_table_acceptance.py --trees --heldout 96 --drafts 3 5 7 9 11 \
        --out docs/results/draft_table_trees.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import printpress
from printpress.draft_table import DraftTable, longest_entry
from printpress.eval.bench import heldout_prompts
from printpress.sampling import next_token_probs
from printpress.speculative import ContextLookup


def replay(prompt: list[int], continuation: list[int], draft, m: int) -> tuple[int, int]:
    """(tokens committed, verifications) of greedy speculative rounds that output `continuation` after `prompt`;
    `draft(text, lookup, m)` gives each round's draft. The first token comes from the prompt pass."""
    text = prompt + continuation
    i = len(prompt)  # text[i] is committed; its verification comes next
    lookup = ContextLookup(text[: i + 1])
    tokens = rounds = 0
    while i + 1 < len(text):
        guess = draft(text[: i + 1], lookup, m)
        kept = 0
        while kept < len(guess) and i + 1 + kept < len(text) and text[i + 1 + kept] == guess[kept]:
            kept += 1
        step = min(kept + 1, len(text) - 1 - i)
        lookup.extend(text[i + 1 : i + 1 + step])
        i, tokens, rounds = i + step, tokens + step, rounds + 1
    return tokens, rounds


def replay_tree(prompt: list[int], continuation: list[int], tree, m: int) -> tuple[int, int]:
    """`replay` for draft trees: `tree(text, m)` gives a round's tree as the token paths of its m nodes (each
    node's path from the root: a branch and all its prefixes); the round commits the longest path that
    `continuation` follows, plus the AR token. A chain of m drafts is the tree of its m prefixes."""
    text = prompt + continuation
    i = len(prompt)
    tokens = rounds = 0
    while i + 1 < len(text):
        kept = max((len(path) for path in tree(text[: i + 1], m) if text[i + 1 : i + 1 + len(path)] == path),
                   default=0)
        step = min(kept + 1, len(text) - 1 - i)
        i, tokens, rounds = i + step, tokens + step, rounds + 1
    return tokens, rounds


def chain_paths(table: DraftTable, text: list[int], m: int) -> list[list[int]]:
    """The engine's chain of up to m table drafts after `text` as a tree: its prefixes."""
    drafts = table.draft(text, m, ContextLookup(text))
    return [drafts[: j + 1] for j in range(len(drafts))]


def candidates(table: DraftTable, text: list[int], lookup: ContextLookup, most: int = 4) -> list[tuple[int, tuple]]:
    """A node's next tokens, best first, each with its kind: the chain's token (with its context's length and
    source), then the other tokens the table's shorter contexts name, then the likeliest of the sampled counts (in
    fifths of their probability)."""
    out: list[tuple[int, tuple]] = []
    seen = set()
    for token, n, source in table.chain(text, 1, lookup):
        out.append((token, ("chain", n, source)))
        seen.add(token)
    tail = text[-table.longest:]
    for n in range(min(len(table.maps), len(tail)), 0, -1):
        token = table.maps[n - 1].get(tuple(tail[-n:]))
        if token is not None and token not in seen:
            out.append((token, ("shorter", n)))
            seen.add(token)
    counts = table.distribution(text)
    if counts is not None:
        for j in np.argsort(-counts[1], kind="stable")[:most]:
            if int(counts[0][j]) not in seen:
                out.append((int(counts[0][j]), ("counted", min(int(counts[1][j] * 5), 4))))
                seen.add(int(counts[0][j]))
    return out[:most]


def trees(pipe, prompts: list[list[int]], args) -> dict:
    """Tokens per verification of best-first draft trees against chains of as many drafts (the module's doc)."""
    table = pipe.model.draft_table
    continuations = [pipe.generate(p, mode="ar", temperature=0, max_new_tokens=args.tokens).token_ids for p in prompts]
    half = len(prompts) // 2
    counted = defaultdict(lambda: [1, 2])  # (rank, kind) -> [kept + 1, seen + 2]: Laplace's rule
    for prompt, continuation in zip(prompts[:half], continuations[:half]):
        text = prompt + continuation
        lookup = ContextLookup(text[: len(prompt)])
        for i in range(len(prompt), len(text) - 1):
            lookup.extend(text[i : i + 1])
            for rank, (token, kind) in enumerate(candidates(table, text[: i + 1], lookup)):
                counted[rank, kind][0] += token == text[i + 1]
                counted[rank, kind][1] += 1
    chance = {key: kept / seen for key, (kept, seen) in counted.items()}

    def tree(text: list[int], m: int) -> list[list[int]]:
        paths: list[list[int]] = []
        frontier: list[tuple[float, int, list[int]]] = []  # (-chance of the path, order, path)
        order = 0
        lookup = ContextLookup(text)  # the committed text's continuations, as the engine's chain reads them

        def grow(path: list[int], p: float) -> None:
            nonlocal order
            for rank, (token, kind) in enumerate(candidates(table, text + path, lookup)):
                heapq.heappush(frontier, (-p * chance.get((rank, kind), 0.0), order, path + [token]))
                order += 1

        grow([], 1.0)
        while frontier and len(paths) < m:
            p, _, path = heapq.heappop(frontier)
            paths.append(path)
            grow(path, -p)
        return paths

    def chain(text: list[int], m: int) -> list[list[int]]:
        return chain_paths(table, text, m)

    out = {}
    for m in args.drafts:
        for name, shape in (("chain", chain), ("tree", tree)):
            tokens, rounds = map(sum, zip(*(replay_tree(p, c, shape, m)
                                            for p, c in zip(prompts[half:], continuations[half:]))))
            out[f"{name}, {m} drafts"] = tokens / rounds
            print(f"{name:5s} {m:2d} drafts: {tokens / rounds:.3f} tokens per verification", flush=True)
    # each candidate kind's [kept + 1, seen + 2] on the first half (Laplace's rule, as the tree used them)
    out["kept_and_seen_plus_prior"] = {f"{rank} {' '.join(map(str, kind))}": [kept, seen] for (rank, kind), (kept, seen)
                                       in sorted(counted.items(), key=lambda item: (item[0][0], str(item[0][1])))}
    return out


def greedy(pipe, prompts: list[list[int]], args) -> dict:
    table = pipe.model.draft_table
    continuations = [pipe.generate(p, mode="ar", temperature=0, max_new_tokens=args.tokens).token_ids for p in prompts]
    sources = {"lookup": lambda text, lookup, m: lookup.draft(m),
               "table": lambda text, lookup, m: table.draft(text, m, lookup),
               "table before the text's turns": lambda text, lookup, m: table.draft(text, m) or lookup.draft(m)}
    if args.rows:  # tables made from the same rows with shorter contexts
        rows = np.fromfile(args.rows, dtype=np.uint16).reshape(-1, args.row_length).astype(np.int64)
        for longest in (1, 2, 3, 4, 5, 6, 8):
            other = DraftTable.from_rows(rows, first=args.row_length // 2, longest=longest)
            sources[f"table, contexts <= {longest}"] = lambda text, lookup, m, t=other: t.draft(text, m, lookup)
        for share in (2, 4):
            part = DraftTable.from_rows(rows[: len(rows) // share], first=args.row_length // 2, longest=5)
            sources[f"table of 1/{share} of the rows"] = lambda text, lookup, m, t=part: t.draft(text, m, lookup)
    out = {}
    for name, draft in sources.items():
        for m in args.drafts:
            tokens, rounds = map(sum, zip(*(replay(p, c, draft, m) for p, c in zip(prompts, continuations))))
            out[f"{name}, {m} drafts"] = tokens / rounds
            print(f"{name:28s} {m:2d} drafts: {tokens / rounds:.2f} tokens per verification", flush=True)
    return out


def sampled(pipe, prompts: list[list[int]], args) -> dict:
    model, table = pipe.model, pipe.model.draft_table
    if args.sampled == "table":  # the counts the model's own table holds
        counted = table
    else:  # counts of these rows as `printpress draft-table` keeps them (only its distributions are read here)
        rows = np.fromfile(args.sampled, dtype=np.uint16).reshape(-1, args.row_length)
        counted = DraftTable.from_rows(rows, args.row_length // 2, table.longest, sampled_rows=rows)
    settings = pipe.settings(mode="ar", temperature=args.temperature, top_k=args.top_k)
    kept: dict[str, list[float]] = {"one-hot (the table)": [], "counts of sampled rows": [],
                                    "counts, the text's token where its context is as long": [],
                                    "interpolated counts (the engine's)": []}
    for prompt in prompts:
        for seed in range(args.seeds):
            new = pipe.generate(prompt, mode="ar", temperature=args.temperature, top_k=args.top_k,
                                max_new_tokens=args.tokens, seed=seed).token_ids
            ids = prompt + new
            with torch.no_grad():
                logits = model.encode(torch.tensor([ids]), model.new_cache(1, len(ids)), logits="all")[0]
            p = next_token_probs(logits, settings)  # p[j]: the distribution of token j + 1
            lookup = ContextLookup(ids[: len(prompt)])
            for j in range(len(prompt), len(ids)):
                guess = table.draft(ids[:j], 1)
                kept["one-hot (the table)"].append(float(p[j - 1, guess[0]]) if guess else 0.0)
                n, q = longest_entry(counted.distributions, ids[max(0, j - counted.longest) : j])
                overlap = 0.0 if q is None else torch.minimum(p[j - 1, q[0]], torch.from_numpy(q[1]).float()).sum()
                kept["counts of sampled rows"].append(float(overlap))
                found, token = lookup.match(ids[:j])
                kept["counts, the text's token where its context is as long"].append(
                    float(p[j - 1, token]) if found and found >= n else float(overlap))
                interpolated = counted.interpolated(ids[:j], p.shape[-1], lookup)
                kept["interpolated counts (the engine's)"].append(
                    0.0 if interpolated is None else float(torch.minimum(p[j - 1], torch.from_numpy(interpolated)).sum()))
                lookup.extend(ids[j : j + 1])
    out = {}
    for name, values in kept.items():
        a = float(np.mean(values))
        out[name] = {"mean_acceptance": a, **{f"tokens_per_verification_{m}_drafts": sum(a**k for k in range(m + 1))
                                              for m in args.drafts}}
        print(f"{name:24s} mean acceptance {a:.3f}; " + ", ".join(
            f"{m} drafts ~{out[name][f'tokens_per_verification_{m}_drafts']:.2f}" for m in args.drafts), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--heldout", type=int, default=48, help="held-out prompts, as `printpress bench` draws them")
    parser.add_argument("--heldout-data", default="shakespeare")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--drafts", type=int, nargs="+", default=[3, 7, 11])
    parser.add_argument("--greedy", action="store_true", help="replay greedy rounds")
    parser.add_argument("--trees", action="store_true", help="replay greedy rounds of draft trees against chains")
    parser.add_argument("--rows", default=None, help="with --greedy: the greedy rows (a distill .bin) to remake "
                                                     "tables from with other context lengths (1-8), and from a half "
                                                     "and a quarter of the rows")
    parser.add_argument("--sampled", default=None, metavar="ROWS.bin",
                        help="sampled rows (a distill .bin), or `table`: the counts in the model's own draft table")
    parser.add_argument("--row-length", type=int, default=128, help="prefix + continuation tokens per row")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = printpress.load(args.model)
    if pipe.model.draft_table is None:
        raise SystemExit(f"{args.model} has no draft table: make one with `printpress draft-table {args.model}`")
    prompts = [pipe.encode_text(p) for p in heldout_prompts(args.heldout, [args.heldout_data], 0.05)]
    results = {}
    if args.greedy:
        results["greedy_tokens_per_verification"] = greedy(pipe, prompts, args)
    if args.sampled:
        results["sampled"] = sampled(pipe, prompts, args)
    if args.trees:
        results["trees"] = trees(pipe, prompts, args)
    command = "python bench/draft_table_acceptance.py " + " ".join(sys.argv[1:])
    out = {"command": command, "model": args.model, "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
