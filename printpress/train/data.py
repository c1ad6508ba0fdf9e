"""Training batches: a resumable sampler of random windows over a token file.

The token files themselves, the train/validation split and the fixed validation windows live in
`printpress.data`, below both training and evaluation; they are re-exported here under the import path training
code, tests and scripts use.

Batches are random windows of ``seq_len`` tokens (they may straddle document boundaries; the
eos/bos pair between them is part of what the model learns). Batch ``k`` depends only on
``(seed, k)``, so a run resumed at step ``k`` draws exactly the batches an unbroken run would.
With data parallelism every rank draws the same global batch and keeps a contiguous slice of
rows: rank ``r`` of ``w`` takes rows ``[r*B/w, (r+1)*B/w)``, so concatenating the ranks' batches
in rank order gives the single-process batch of global size ``B``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from printpress.data import (
    DataError,
    DataSplits,
    TokenFile,
    TokenFileMeta,
    eval_batches,
    open_token_file,
    prepare_data,
    prepare_tokens,
    rows_per_rank,
    token_dtype,
    windows_at,
    write_token_documents,
    write_token_file,
)
from printpress.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "TokenFileMeta",
    "TokenFile",
    "DataSplits",
    "BatchSampler",
    "MixedBatchSampler",
    "token_dtype",
    "write_token_file",
    "write_token_documents",
    "open_token_file",
    "prepare_tokens",
    "prepare_data",
    "eval_batches",
]


def _step_seed(seed: int, step: int) -> int:
    """An independent 63-bit seed per (seed, step): batch k can be drawn without drawing 0..k-1."""
    data = f"printpress.batch:{seed}:{step}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


@dataclass
class BatchSampler:
    """Random training windows; `step` is the index of the next batch (save it with `state_dict`).

    `batch_size` is the global batch size; this rank gets rows ``[rank*B/w, (rank+1)*B/w)``."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    step: int = 0
    # Windows start only at multiples of seq_len: for data whose documents are exactly seq_len tokens
    # (task data such as Sudoku), so every window is one whole example and canvases line up with it.
    aligned: bool = False

    def __post_init__(self) -> None:
        self.local_batch_size = rows_per_rank(self.batch_size, self.rank, self.world_size)
        if self.seq_len < 1:
            raise ConfigError(f"seq_len must be positive, got {self.seq_len}")
        if len(self.tokens) < self.seq_len:
            raise DataError(
                f"the data holds {len(self.tokens)} tokens, fewer than one window of seq_len {self.seq_len}"
            )

    def global_starts(self, step: int) -> np.ndarray:
        """Start offsets of all `batch_size` windows of batch `step` (identical on every rank)."""
        gen = torch.Generator().manual_seed(_step_seed(self.seed, step))
        if self.aligned:
            windows = len(self.tokens) // self.seq_len
            return torch.randint(0, windows, (self.batch_size,), generator=gen).numpy() * self.seq_len
        high = len(self.tokens) - self.seq_len + 1
        return torch.randint(0, high, (self.batch_size,), generator=gen).numpy()

    def batch(self, step: int) -> torch.Tensor:
        """This rank's rows of batch `step`: int64 ``(batch_size // world_size, seq_len)``."""
        lo = self.rank * self.local_batch_size
        starts = self.global_starts(step)[lo : lo + self.local_batch_size]
        return windows_at(self.tokens, starts, self.seq_len)

    def next_batch(self) -> torch.Tensor:
        out = self.batch(self.step)
        self.step += 1
        return out

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def roles(self, first_row: int, count: int) -> tuple[None, None]:
        """Every row is a real window: no rows to keep from the AR loss, none to train as drafts (see
        `MixedBatchSampler.roles`)."""
        return None, None

    def state_dict(self) -> dict[str, int]:
        """The data position; rank and world size are left out so a run may resume on another layout."""
        return {
            "seed": self.seed,
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict[str, int], *, strict: bool = True) -> None:
        """Restore the position. With `strict`, refuse a state whose batch size, window length or
        data size differ from this sampler's, because the batches would then silently differ."""
        expected = {"batch_size": self.batch_size, "seq_len": self.seq_len, "num_tokens": len(self.tokens)}
        mismatched = [f"{k} {state[k]} != {v}" for k, v in expected.items() if k in state and state[k] != v]
        if mismatched:
            if strict:
                raise DataError(f"cannot resume data position: {', '.join(mismatched)}")
            logger.warning(
                "resuming data position with %s: batches differ from the original run", ", ".join(mismatched)
            )
        self.seed = int(state["seed"])
        self.step = int(state["step"])


@dataclass
class MixedBatchSampler:
    """Batches of real windows with a fixed share of rows from a second token file (a teacher's continuations),
    and optionally a third (`draft`: continuations the trainer shows only as a speculative draft sees them).

    Global rows ``[0, R)`` are real windows, then ``extra_rows`` whole rows of the second file, then ``draft_rows``
    of the third (aligned, exactly ``seq_len`` tokens each). The layout is fixed, so `is_real(row)` and
    `is_draft(row)` need no state, and like `BatchSampler` batch k depends only on (seed, k), and rank r of w keeps
    rows ``[r*B/w, (r+1)*B/w)``.
    """

    real: np.ndarray
    extra: np.ndarray
    seq_len: int
    batch_size: int
    extra_rows: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    step: int = 0
    draft: np.ndarray | None = None
    draft_rows: int = 0

    def __post_init__(self) -> None:
        self.local_batch_size = rows_per_rank(self.batch_size, self.rank, self.world_size)
        if (self.draft is None) != (self.draft_rows == 0):
            raise ConfigError("the mixed batch takes draft rows exactly when it is given a draft token file")
        self.real_rows = self.batch_size - self.extra_rows - self.draft_rows
        if self.extra_rows <= 0 or self.draft_rows < 0 or self.real_rows <= 0:
            raise ConfigError(f"the mixed batch needs at least one real row and one teacher row in a batch of "
                              f"{self.batch_size}, got {self.extra_rows} teacher and {self.draft_rows} draft rows")
        for name, tokens in (("second", self.extra), ("draft", self.draft)):
            if tokens is not None and len(tokens) % self.seq_len:
                raise DataError(f"the {name} token file holds {len(tokens)} tokens, "
                                f"not whole rows of seq_len {self.seq_len}")
        self._parts = [BatchSampler(self.real, self.seq_len, self.real_rows, seed=self.seed),
                       BatchSampler(self.extra, self.seq_len, self.extra_rows, seed=self.seed + 1, aligned=True)]
        if self.draft is not None:
            self._parts.append(BatchSampler(self.draft, self.seq_len, self.draft_rows, seed=self.seed + 2, aligned=True))

    def is_real(self, row: int) -> bool:
        """Whether global row `row` of every batch is a real window."""
        return row < self.real_rows

    def is_draft(self, row: int) -> bool:
        """Whether global row `row` of every batch comes from the draft file."""
        return row >= self.batch_size - self.draft_rows

    def roles(self, first_row: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For global rows ``[first_row, first_row + count)``: which are real windows (the AR loss sees only those)
        and, with a draft file, which are its rows (trained only as drafts); (count,) bool each."""
        rows = range(first_row, first_row + count)
        real = torch.tensor([self.is_real(row) for row in rows])
        return real, torch.tensor([self.is_draft(row) for row in rows]) if self.draft is not None else None

    def batch(self, step: int) -> torch.Tensor:
        """This rank's rows of batch `step`: int64 ``(batch_size // world_size, seq_len)``."""
        rows = torch.cat([part.batch(step) for part in self._parts])
        lo = self.rank * self.local_batch_size
        return rows[lo : lo + self.local_batch_size]

    def _sizes(self) -> dict[str, int]:
        sizes = {"batch_size": self.batch_size, "seq_len": self.seq_len, "num_tokens": len(self.real),
                 "extra_tokens": len(self.extra), "extra_rows": self.extra_rows}
        if self.draft is not None:  # absent otherwise, so states saved before draft files existed still match
            sizes |= {"draft_tokens": len(self.draft), "draft_rows": self.draft_rows}
        return sizes

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "step": self.step, **self._sizes()}

    def load_state_dict(self, state: dict[str, int], *, strict: bool = True) -> None:
        sizes = self._sizes()
        mismatched = [f"{k} {state.get(k)} != {v}" for k, v in sizes.items() if state.get(k) != v]
        mismatched += [f"{k} {state[k]} != none" for k in ("draft_tokens", "draft_rows") if k in state and k not in sizes]
        if mismatched and strict:
            raise DataError(f"cannot resume data position: {', '.join(mismatched)}")
        self.seed = int(state["seed"])
        self.step = int(state["step"])
