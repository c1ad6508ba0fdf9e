"""A draft table: the model's own habits, written down once, as drafts for `mode="speculative"`.

Speculative decoding at temperature 0 outputs exactly what greedy AR decoding would; how fast depends only on
how often the drafts equal the tokens AR is about to choose. The context (`draft_source="lookup"`) guesses
right where the text repeats itself. A model also repeats *itself* across texts: a small model's greedy
continuations fall into the same turns of phrase whatever the prompt. A draft table records them: the model
continues prefixes of its training split greedily (`printpress draft-table`, the rows `printpress distill
--temperature 0` makes), and for every context of 1..`longest` tokens inside those continuations the table keeps
the token the model wrote next most often (ties: the smaller id). `draft_source="table"` then drafts by following
the table from the end of the text, each time from the longest context that has an entry, and falls back to the
context lookup where the table has none. This is retrieval-based drafting (REST, He et al. 2024) with the model's
own output as the datastore instead of a corpus; the output stays AR's whatever the table holds, so a stale table
(a model fine-tuned after it was made) costs speed, never correctness.

The file (`draft_table.safetensors` beside the weights; transformers ignores it) holds the table itself, per
context length n the contexts and the token after each (the shipped model's: 110k contexts, 1.1 MB, read in
about 0.1 s at load), and in its metadata what made it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from printpress.errors import CheckpointError

FILE = "draft_table.safetensors"
FORMAT = "printpress draft table 1"
DEFAULT_LONGEST = 5  # contexts of 1..5 tokens: 3 drafted 3.48, 4 3.71, 5 3.83 tokens per verification (docs)


class DraftTable:
    """`maps[n - 1]`: each context of n tokens to the token the model most often wrote after it; `draft` follows
    them."""

    def __init__(self, maps: list[dict[tuple[int, ...], int]], made_by: dict[str, Any] | None = None) -> None:
        if not maps:
            raise CheckpointError("a draft table needs contexts of at least 1 token")
        self.maps = maps
        self.longest = len(maps)
        self.made_by = dict(made_by or {})

    @classmethod
    def from_rows(cls, rows: np.ndarray, first: int, longest: int = DEFAULT_LONGEST,
                  made_by: dict[str, Any] | None = None) -> DraftTable:
        """The table of `rows` (2-D token ids) whose positions from `first` on are the model's writing (those
        before it are context only)."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer):
            raise CheckpointError(f"a draft table's rows must be a 2-D integer array, got {rows.dtype} of shape "
                                  f"{rows.shape}")
        if not 0 <= first < rows.shape[1]:
            raise CheckpointError(f"a draft table's first written position must be in 0..{rows.shape[1] - 1}, "
                                  f"got {first}")
        if longest < 1:
            raise CheckpointError(f"a draft table's longest context must be at least 1 token, got {longest}")
        return cls([best_next(rows.astype(np.int64), first, n) for n in range(1, longest + 1)], made_by)

    def draft(self, tokens: Sequence[int], m: int) -> list[int]:
        """Up to `m` tokens that the table says follow `tokens`; stops where no context has an entry."""
        text = list(tokens[-self.longest:])
        out: list[int] = []
        while len(out) < m:
            for n in range(min(self.longest, len(text)), 0, -1):
                token = self.maps[n - 1].get(tuple(text[-n:]))
                if token is not None:
                    break
            else:
                break
            out.append(token)
            text.append(token)
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table atomically (a temporary file beside it, renamed into place): per context length n, the
        contexts (k, n) and the tokens after them (k,)."""
        from safetensors.numpy import save_file

        path = Path(path)
        tensors = {}
        for n, table in enumerate(self.maps, start=1):
            contexts = np.array(list(table), dtype=np.int64).reshape(-1, n)
            tokens = np.array(list(table.values()), dtype=np.int64)
            wide = max(int(contexts.max(initial=0)), int(tokens.max(initial=0))) >= 2**16
            tensors[f"contexts_{n}"] = contexts.astype(np.int32 if wide else np.uint16)
            tensors[f"next_{n}"] = tokens.astype(np.int32 if wide else np.uint16)
        metadata = {"format": FORMAT, "longest": str(self.longest), "made_by": json.dumps(self.made_by, sort_keys=True)}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would have made it, not mkstemp's owner-only mode
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> DraftTable:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="np") as reader:
                metadata = reader.metadata() or {}
                if metadata.get("format") != FORMAT:
                    raise CheckpointError(f"{path}: not a printpress draft table (format {metadata.get('format')!r})")
                maps = []
                for n in range(1, int(metadata["longest"]) + 1):
                    contexts = reader.get_tensor(f"contexts_{n}").astype(np.int64).reshape(-1, n).tolist()
                    tokens = reader.get_tensor(f"next_{n}").astype(np.int64).tolist()
                    if len(contexts) != len(tokens):
                        raise ValueError(f"{len(contexts)} contexts of {n} tokens but {len(tokens)} next tokens")
                    maps.append(dict(zip(map(tuple, contexts), tokens)))
            return cls(maps, json.loads(metadata["made_by"]))
        except (SafetensorError, OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable draft table ({exc})") from None


def best_next(rows: np.ndarray, first: int, n: int) -> dict[tuple[int, ...], int]:
    """For every n-token context followed, inside some row, by a token at a position >= `first`: the token that
    follows it most often (ties: the smaller id). Vectorised: the contexts are numbered by `np.unique`, the
    (context, token) pairs counted by sorting."""
    start = max(first - n, 0)  # the window whose last token sits at `first` starts n before it
    if rows.shape[1] - start <= n:
        return {}
    windows = np.lib.stride_tricks.sliding_window_view(rows[:, start:], n + 1, axis=1).reshape(-1, n + 1)
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
    order = np.lexsort((pair_token, -counts, pair_context))  # per context: most counted first, then smaller id
    pair_context, pair_token = pair_context[order], pair_token[order]
    keep = np.ones(len(pair_context), dtype=bool)
    keep[1:] = pair_context[1:] != pair_context[:-1]
    return dict(zip(map(tuple, contexts[pair_context[keep]].tolist()), pair_token[keep].tolist()))


def load_beside(folder: Path) -> DraftTable | None:
    """The draft table in a model folder, or None where it has none."""
    path = folder / FILE
    return DraftTable.load(path) if path.is_file() else None
