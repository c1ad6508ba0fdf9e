"""A draft table: the model's own habits, written down once, as drafts for `mode="speculative"`.

Speculative decoding at temperature 0 outputs exactly what greedy AR decoding would; how fast depends only on
how often the drafts equal the tokens AR is about to choose. The context (`draft_source="lookup"`) guesses
right where the text repeats itself. A model also repeats *itself* across texts: a small model's greedy
continuations fall into the same turns of phrase whatever the prompt. A draft table records them: the model
continues prefixes of its training split greedily (`printpress draft-table`, the rows `printpress distill
--temperature 0` makes), and for every context of 1..`longest` tokens inside those continuations the table keeps
the token the model wrote next most often (ties: the smaller id). `draft_source="table"` then drafts from the end of
the text, each token from the longest context the table has an entry for, or from the text itself (the context
lookup) where the text's own context is at least as long. This is retrieval-based drafting (REST, He et al. 2024)
with the model's own output as the datastore instead of a corpus; the output stays AR's whatever the table holds,
so a stale table (a model fine-tuned after it was made) costs speed, never correctness.

When sampling, a one-hot draft is kept only with AR's probability of its token, so the table may also hold the
model's *sampled* habits (`distributions`): for contexts seen at least `MIN_COUNT` times in continuations sampled at
AR's default temperature, the counts of each token that followed. A sampled round draws its drafts from them, the
counts of every context length that knows the text's end interpolated (`sample_interpolated`), and speculative
sampling keeps a draft drawn from q with probability min(1, p/q), which on average is sum(min(p, q)): far more than
p(mode) where the model's next token is spread over a few words. (`sample`, the longest context's counts alone, is
what the diffusion side's table-started canvases and the table noise of training draw from.)

The file (`draft_table.safetensors` beside the weights; transformers ignores it) holds the table itself, per
context length n the contexts and the token after each, and the distributions as contexts, their number of
distinct next tokens, the tokens and their counts (the shipped model's: 5.3 MB in all, read in about 0.25 s at load),
and in its metadata what made it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from printpress.errors import CheckpointError
from printpress.files import replaced_atomically

FILE = "draft_table.safetensors"
FORMAT = "printpress draft table 1"
DEFAULT_LONGEST = 5  # contexts of 1..5 tokens: 3 drafted 3.47, 4 3.78, 5 3.91 tokens per verification (docs)
MIN_COUNT = 3  # a sampled context's counts make a draft distribution once it was seen this often
# The absolute discount of `interpolated`: each count of a context gives up this much to the shorter contexts (under
# 1, so less than any count). Sampled drafts from the interpolation were kept 0.573 of the time against 0.527 from the
# longest context's counts alone (24 held-out prompts x 2 AR samples; 0.5: 0.563, 0.9: 0.575, 1.5: 0.566;
# docs/benchmarks-speculative.md)
DISCOUNT = 0.75
# The share of a sampled draft's distribution given to the token that followed the text's end where it occurred
# before (the context lookup's), where that context is longer than the longest the counts know, and where it is as
# long. Kept drafts on the code model 0.442 -> 0.499, on Shakespeare's 0.573 -> 0.570, where the text rarely repeats
# a context as long (24 held-out prompts x 2 AR samples each; 1.0 / 0.5: 0.504 / 0.567, 0.9 / 0 (longer only): 0.484
# / 0.572; docs/benchmarks-speculative.md, "Drafts drawn from every context length").
TEXT_LONGER, TEXT_AS_LONG = 0.9, 0.3

Distribution = tuple[np.ndarray, np.ndarray]  # the next tokens of a context, and their probabilities
# `DraftTable.interpolated` in parts: the unigram's share, per known context its (weight of its counts less the
# discount, next tokens, those counts less the discount, the part's mass), and the text's own next token with its
# share (or None)
Mixture = tuple[float, list[tuple[float, np.ndarray, np.ndarray, float]], tuple[int, float] | None]


class TextMatch(Protocol):
    """What `DraftTable.draft` asks of the text's own continuations (`printpress.speculative.ContextLookup`)."""

    longest: int

    def match(self, text: Sequence[int]) -> tuple[int, int | None]: ...


class DraftTable:
    """`maps[n - 1]`: each context of n tokens to the token the model most often wrote after it (`draft` follows
    them); `counts[n - 1]`, where the table has sampled rows: each context to the tokens that followed it and how
    often, which `sample` draws from."""

    def __init__(self, maps: list[dict[tuple[int, ...], int]], made_by: dict[str, Any] | None = None,
                 counts: list[dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]] | None = None) -> None:
        if not maps:
            raise CheckpointError("a draft table needs contexts of at least 1 token")
        if counts is not None and len(counts) != len(maps):
            raise CheckpointError(f"a draft table's sampled counts cover contexts of 1..{len(counts)} tokens, its "
                                  f"greedy ones 1..{len(maps)}")
        self.maps = maps
        self.longest = len(maps)
        self.made_by = dict(made_by or {})
        self.counts = counts  # per context length: context -> (next tokens, their counts); None: greedy only
        self.distributions: list[dict[tuple[int, ...], Distribution]] | None = None if counts is None else [
            _distributions(table) for table in counts]
        self._unigram = None if counts is None else _unigram(counts[0])
        self._unigram_ends = None if counts is None else np.cumsum(self._unigram)
        # per context length: context -> the sum of its counts and the counts less the discount (float64), kept as
        # drafting meets the context (numpy's operators on a few counts per context and draft were a fifth of a
        # sampled round's drafting)
        self._discounted: list[dict[tuple[int, ...], tuple[int, np.ndarray]]] = [{} for _ in maps]

    @classmethod
    def from_rows(cls, rows: np.ndarray, first: int, longest: int = DEFAULT_LONGEST,
                  made_by: dict[str, Any] | None = None, sampled_rows: np.ndarray | None = None) -> DraftTable:
        """The table of `rows` (2-D token ids) whose positions from `first` on are the model's greedy writing (those
        before it are context only), with distributions from `sampled_rows` (the same layout) when given."""
        if longest < 1:
            raise CheckpointError(f"a draft table's longest context must be at least 1 token, got {longest}")
        rows = _checked_rows(rows, first)
        with collector_paused():
            maps = [best_next(rows, first, n) for n in range(1, longest + 1)]
            counts = None
            if sampled_rows is not None:
                sampled_rows = _checked_rows(sampled_rows, first)
                counts = [{context: pair for context, pair in next_counts(sampled_rows, first, n).items()
                           if pair[1].sum() >= MIN_COUNT} for n in range(1, longest + 1)]
            return cls(maps, made_by, counts)

    def sample(self, tokens: Sequence[int], m: int, generator) -> tuple[list[int], list[Distribution]]:
        """Up to `m` tokens drawn one after another from the distribution of the longest known context (torch
        `generator`), with the distribution each was drawn from; stops where no context has one (none without
        distributions)."""
        text = list(tokens[-self.longest:])
        out: list[int] = []
        used: list[Distribution] = []
        while len(out) < m and (found := self.distribution(text)) is not None:
            token = draw(found, generator)
            out.append(token)
            used.append(found)
            text.append(token)
        return out, used

    def sample_interpolated(self, tokens: Sequence[int], m: int, generator, vocab: int,
                            context: TextMatch | None = None) -> tuple[list[int], np.ndarray]:
        """Up to `m` tokens drawn one after another (torch `generator`: m uniforms, one per token) from
        `interpolated` over a vocabulary of `vocab` tokens, with the distributions they were drawn from (m, vocab)
        float32: a sampling request's speculative drafts. Stops where no context has counts, as `sample` does."""
        import torch

        text = self._tail(tokens, context)
        out: list[int] = []
        mixtures: list[Mixture] = []
        uniforms = torch.rand(m, generator=generator, dtype=torch.float64).tolist() if m > 0 else []
        while len(out) < m and (mixture := self._mixture(text, context)) is not None:
            token = self._draw(mixture, uniforms[len(out)])
            out.append(token)
            mixtures.append(mixture)
            text.append(token)
        return out, self._dense(mixtures, vocab)

    def interpolated(self, tokens: Sequence[int], vocab: int, context: TextMatch | None = None) -> np.ndarray | None:
        """The next token's distribution after `tokens` (vocab,) float32 from the sampled counts of every context
        length that knows the text's end, interpolated by absolute discounting (Ney, Essen and Kneser 1994): the
        longest context's counts, each less `DISCOUNT`, and what they gave up spread as the next shorter known
        context's interpolation says, the shortest's over the counts' unigram (every count after a 1-token
        context). None where no context is known (or the table has no sampled counts).

        The longest context's counts alone (`distribution`) are few (as few as `MIN_COUNT`), so they miss much of
        what the model may write there; the shorter contexts fill that in. With `context` (the text's own
        continuations, `ContextLookup.match`), the token that followed the text's end where it occurred before
        takes `TEXT_LONGER` of the mass where that context is longer than the longest the counts know, and
        `TEXT_AS_LONG` where it is as long; the counts' interpolation the rest."""
        text = self._tail(tokens, context)
        mixture = self._mixture(text, context)
        return None if mixture is None else self._dense([mixture], vocab)[0]

    def _mixture(self, text: list[int], context: TextMatch | None = None) -> Mixture | None:
        """`interpolated` as the unigram's share, per known context (longest first) its part: (weight of its counts
        less the discount, next tokens, those counts less the discount, the part's mass), and the text's own next
        token with its share (None where it has none). Every count is at least 1, above the discount, so a context
        of T next tokens and N counts gives up DISCOUNT * T / N of what reaches it."""
        if self.counts is None:
            return None
        parts = []
        known = 0  # the longest context the counts know
        share = 1.0  # of the mass still to place, longest context first
        for n in range(min(self.longest, len(text)), 0, -1):
            key = tuple(text[-n:])
            entry = self.counts[n - 1].get(key)
            if entry is not None:
                known = known or n
                next_tokens, counts = entry
                known_counts = self._discounted[n - 1].get(key)
                if known_counts is None:
                    known_counts = self._discounted[n - 1][key] = (int(counts.sum()), counts - DISCOUNT)
                total, discounted = known_counts
                given = DISCOUNT * len(counts)
                parts.append((share / total, next_tokens, discounted, share * (total - given) / total))
                share *= given / total
        if not parts:
            return None
        echo = None
        if context is not None:
            found, token = context.match(text)
            if found and found >= known:
                echo = (token, TEXT_LONGER if found > known else TEXT_AS_LONG)
        return share, parts, echo

    def _draw(self, mixture: Mixture, u: float) -> int:
        """The token at `u` (uniform in [0, 1)) of a mixture: the text's token below its share, else the part of the
        rest that `u` falls in, then the token inside that part (the mixture's float64 numbers; `_dense` rounds the
        same ones to float32)."""
        share, parts, echo = mixture
        if echo is not None:
            token, weight = echo
            if u < weight:
                return token
            u = (u - weight) / (1 - weight)
        for weight, next_tokens, discounted, mass in parts:
            if u < mass:
                left = u / weight
                for token, count in zip(next_tokens.tolist(), discounted.tolist()):
                    left -= count
                    if left < 0:
                        return token
                return token  # rounding past the part's last token
            u -= mass
        ends = self._unigram_ends
        return min(int(np.searchsorted(ends, u / share, "right")), len(ends) - 1)

    def _dense(self, mixtures: list[Mixture], vocab: int) -> np.ndarray:
        """The mixtures as rows (len, vocab) of float32 probabilities."""
        unigram = self._unigram[:vocab]
        q = np.zeros((len(mixtures), vocab))
        q[:, : len(unigram)] = np.outer([share for share, _, _ in mixtures], unigram)
        for row, (_, parts, echo) in zip(q, mixtures):
            for weight, next_tokens, discounted, _ in parts:
                row[next_tokens] += weight * discounted
            if echo is not None:
                token, weight = echo
                row *= 1 - weight
                row[token] += weight
        return q.astype(np.float32)

    def distribution(self, tokens: Sequence[int]) -> Distribution | None:
        """What the sampled counts say follows `tokens`: the distribution of the longest context they know; None
        where they know none (or the table has no sampled counts)."""
        return None if self.distributions is None else longest_entry(self.distributions, list(tokens[-self.longest:]))[1]

    def draft(self, tokens: Sequence[int], m: int, context: TextMatch | None = None) -> list[int]:
        """Up to `m` tokens that the table says follow `tokens`; stops where no context has an entry.

        With `context` (the text's own continuations: `ContextLookup.match`), each token comes from whichever of
        the two knows the longer context ending the text so far, a tie going to the text: the table holds what the
        model writes anywhere, the text what it wrote here (an identifier, a line pattern of this file), and the
        longer context is the better guess: 2.95 -> 4.01 tokens per verification on the code model's held-out
        prompts, 3.82 -> 3.95 on Shakespeare's (docs/benchmarks-speculative.md, "Drafts from the longer context")."""
        return [token for token, _, _ in self.chain(tokens, m, context)]

    def chain(self, tokens: Sequence[int], m: int, context: TextMatch | None = None) -> list[tuple[int, int, str]]:
        """`draft`'s tokens, each with the length of the context it came from and whose it was ("table" or
        "text"): what a rule for a draft's length can read (bench/draft_length.py)."""
        text = self._tail(tokens, context)
        out: list[tuple[int, int, str]] = []
        while len(out) < m:
            n, token = longest_entry(self.maps, text)
            source = "table"
            if context is not None:
                found, from_text = context.match(text)
                if found and found >= n:
                    n, token, source = found, from_text, "text"
            if not n:
                break
            out.append((token, n, source))
            text.append(token)
        return out

    def _tail(self, tokens: Sequence[int], context: TextMatch | None) -> list[int]:
        """The end of `tokens` that the table's contexts and the text's own (`context`, where given) can read."""
        return list(tokens[-max(self.longest, context.longest if context is not None else 0):])

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table atomically (a temporary file beside it, renamed into place): per context length n, the
        contexts (k, n) and the tokens after them (k,)."""
        from safetensors.numpy import save_file

        path = Path(path)
        tensors = {}
        for n, table in enumerate(self.maps, start=1):
            tensors[f"contexts_{n}"] = _ids(np.array(list(table), dtype=np.int64).reshape(-1, n))
            tensors[f"next_{n}"] = _ids(np.array(list(table.values()), dtype=np.int64))
        for n, table in enumerate(self.counts or [], start=1):
            pairs = list(table.values())
            tensors[f"sampled_contexts_{n}"] = _ids(np.array(list(table), dtype=np.int64).reshape(-1, n))
            tensors[f"sampled_sizes_{n}"] = np.array([len(t) for t, _ in pairs], dtype=np.int32)
            tensors[f"sampled_next_{n}"] = _ids(np.concatenate([t for t, _ in pairs] or [np.zeros(0, np.int64)]))
            tensors[f"sampled_counts_{n}"] = np.concatenate([c for _, c in pairs] or [np.zeros(0, np.int64)]).astype(
                np.int32)
        metadata = {"format": FORMAT, "longest": str(self.longest), "sampled": str(self.counts is not None),
                    "made_by": json.dumps(self.made_by, sort_keys=True)}
        with replaced_atomically(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> DraftTable:
        from safetensors import SafetensorError, safe_open

        try:
            with collector_paused(), safe_open(str(path), framework="np") as reader:
                metadata = reader.metadata() or {}
                if metadata.get("format") != FORMAT:
                    raise CheckpointError(f"{path}: not a printpress draft table (format {metadata.get('format')!r})")
                maps, counts = [], None if metadata.get("sampled") != "True" else []
                for n in range(1, int(metadata["longest"]) + 1):
                    contexts = reader.get_tensor(f"contexts_{n}").astype(np.int64).reshape(-1, n)
                    tokens = reader.get_tensor(f"next_{n}").astype(np.int64).tolist()
                    if len(contexts) != len(tokens):
                        raise ValueError(f"{len(contexts)} contexts of {n} tokens but {len(tokens)} next tokens")
                    maps.append(dict(zip(_tuples(contexts), tokens)))
                    if counts is not None:
                        counts.append(_read_counts(reader, n))
                return cls(maps, json.loads(metadata["made_by"]), counts)
        except (SafetensorError, OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable draft table ({exc})") from None


def next_counts(rows: np.ndarray, first: int, n: int) -> dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]:
    """For every n-token context followed, inside some row, by a token at a position >= `first`: the tokens that
    follow it (ascending ids) and how often each does. Vectorised: the contexts are numbered by `np.unique`, the
    (context, token) pairs counted by sorting."""
    start = max(first - n, 0)  # the window whose last token sits at `first` starts n before it
    if rows.shape[1] - start <= n:
        return {}
    windows = np.lib.stride_tricks.sliding_window_view(rows[:, start:], n + 1, axis=1).reshape(-1, n + 1)
    if not len(windows):
        return {}
    contexts, context_id = np.unique(windows[:, :n], axis=0, return_inverse=True)
    context_id = context_id.reshape(-1)
    nxt = windows[:, n]
    order = np.lexsort((nxt, context_id))
    context_id, nxt = context_id[order], nxt[order]
    new = np.ones(len(nxt), dtype=bool)
    new[1:] = (context_id[1:] != context_id[:-1]) | (nxt[1:] != nxt[:-1])
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, len(nxt)))
    pair_context, pair_token = context_id[starts], nxt[starts]
    bounds = np.flatnonzero(np.diff(pair_context)) + 1  # where each context's pairs begin (after the first's)
    return {tuple(context): (tokens, c) for context, tokens, c in zip(
        contexts[pair_context[np.append(0, bounds)]].tolist(), np.split(pair_token, bounds), np.split(counts, bounds))}


def best_next(rows: np.ndarray, first: int, n: int) -> dict[tuple[int, ...], int]:
    """For every n-token context of `next_counts`, the token that follows it most often (ties: the smaller id)."""
    return {context: int(tokens[np.argmax(c)]) for context, (tokens, c) in next_counts(rows, first, n).items()}


def draw(distribution: Distribution, generator) -> int:
    """One token drawn from `distribution` with the torch `generator` (as `DraftTable.sample` draws each)."""
    import torch

    next_tokens, probs = distribution
    return int(next_tokens[int(torch.multinomial(torch.from_numpy(probs), 1, generator=generator))])


def longest_entry(levels: list[dict[tuple[int, ...], Any]], text: list[int]) -> tuple[int, Any]:
    """The length of the longest context that ends `text` and that `levels` (by context length) know, and its
    entry; (0, None) if none."""
    for n in range(min(len(levels), len(text)), 0, -1):
        found = levels[n - 1].get(tuple(text[-n:]))
        if found is not None:
            return n, found
    return 0, None


def _checked_rows(rows: np.ndarray, first: int) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer):
        raise CheckpointError(f"a draft table's rows must be a 2-D integer array, got {rows.dtype} of shape "
                              f"{rows.shape}")
    if not 0 <= first < rows.shape[1]:
        raise CheckpointError(f"a draft table's first written position must be in 0..{rows.shape[1] - 1}, "
                              f"got {first}")
    return rows.astype(np.int64)


def _ids(values: np.ndarray) -> np.ndarray:
    """Token ids as stored: uint16 where they fit, else int32."""
    return values.astype(np.uint16 if int(values.max(initial=0)) < 2**16 else np.int32)


def _read_counts(reader, n: int) -> dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]:
    contexts = reader.get_tensor(f"sampled_contexts_{n}").astype(np.int64).reshape(-1, n)
    sizes = reader.get_tensor(f"sampled_sizes_{n}").astype(np.int64)
    tokens = reader.get_tensor(f"sampled_next_{n}").astype(np.int64)
    counts = reader.get_tensor(f"sampled_counts_{n}").astype(np.int64)
    if len(sizes) != len(contexts) or int(sizes.sum()) != len(tokens) or len(tokens) != len(counts):
        raise ValueError(f"sampled counts of contexts of {n} tokens do not add up: {len(contexts)} contexts, "
                         f"{len(sizes)} sizes summing to {int(sizes.sum())}, {len(tokens)} tokens, {len(counts)} "
                         "counts")
    starts, ends = _runs(sizes)  # each context's run of tokens, taken as slices (views: 4x faster than np.split)
    return dict(zip(_tuples(contexts), ((tokens[a:b], counts[a:b]) for a, b in zip(starts.tolist(), ends.tolist()))))


def _distributions(counts: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]) -> dict[tuple[int, ...], Distribution]:
    """Each context's next tokens with their counts over the context's total, `c / c.sum()` for every context (the
    same float64 divisions), computed for all contexts in one pass: a division per context took 0.16 s of a load."""
    if not counts:
        return {}
    sizes = np.array([len(c) for _, c in counts.values()])
    starts, ends = _runs(sizes)
    flat = np.concatenate([c for _, c in counts.values()])
    probs = flat / np.repeat(np.add.reduceat(flat, starts), sizes)
    spans = zip(starts.tolist(), ends.tolist())
    return {context: (tokens, probs[a:b]) for (context, (tokens, _)), (a, b) in zip(counts.items(), spans)}


def _unigram(counts: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """How often each token id followed a 1-token context (every sampled count of the table's shortest contexts),
    over the total: the floor of `DraftTable.interpolated`."""
    if not counts:
        return np.zeros(0)
    tokens = np.concatenate([t for t, _ in counts.values()])
    totals = np.bincount(tokens, weights=np.concatenate([c for _, c in counts.values()]))
    return totals / totals.sum()


def _runs(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of consecutive runs of `sizes` elements starts and ends in their concatenation."""
    ends = np.cumsum(sizes)
    return ends - sizes, ends


def _tuples(rows: np.ndarray) -> Iterator[tuple[int, ...]]:
    """Each row of a 2-D integer array as a tuple of Python ints (from its columns: no list per row on the way)."""
    return zip(*(column.tolist() for column in rows.T))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a table is built. A table is a few hundred thousand tuples made
    at once, and with the collector on, each full collection on the way walks every object the process holds: about
    half of reading the shipped model's table (1.0 -> 0.5 s). Once it runs again, its next young collection stops
    tracking the tuples (tuples of ints cannot be part of a cycle) in one pass. Nothing is left paused if it was
    paused already."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_beside(folder: Path) -> DraftTable | None:
    """The draft table in a model folder, or None where it has none."""
    path = folder / FILE
    return DraftTable.load(path) if path.is_file() else None
