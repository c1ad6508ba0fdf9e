"""The draft table: the most frequent next token per context, counted only where the model wrote it; drafts that
follow the longest known context; a file that round-trips and refuses what is not a table."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from printpress.draft_table import FILE, DraftTable, best_next, load_beside
from printpress.errors import CheckpointError


def counted(rows: np.ndarray, first: int, n: int) -> dict[tuple[int, ...], int]:
    """best_next written plainly: count every (context, next) pair whose next token sits at >= first."""
    counts: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows.tolist():
        for j in range(max(first, n), len(row)):
            counts[tuple(row[j - n : j])][row[j]] += 1
    return {context: min(c, key=lambda t: (-c[t], t)) for context, c in counts.items()}


@pytest.mark.parametrize("first", [0, 1, 3, 7])
def test_best_next_equals_plain_counting(first):
    rng = np.random.default_rng(first)
    rows = rng.integers(0, 5, size=(40, 12))  # a small vocabulary, so contexts repeat and counts tie
    for n in range(1, 6):
        assert best_next(rows, first, n) == counted(rows, first, n), n
    assert best_next(rows, 10, 4) == counted(rows, 10, 4) and best_next(rows[:, :4], 0, 4) == {}


def test_drafts_follow_the_longest_context_and_stop_where_none_is_known():
    # Row 1's 9 sits in the prefix (first = 2): context only, never a draft. After (5,) the table says 6 (twice) over
    # 7 (once); after (4, 5) it says 7.
    rows = np.array([[1, 2, 5, 6, 3, 0],
                     [9, 4, 5, 7, 3, 0],
                     [2, 2, 5, 6, 3, 8]])
    table = DraftTable.from_rows(rows, first=2, longest=2)
    assert table.draft([5], 4) == [6, 3, 0]  # 5 -> 6, (5, 6) -> 3, (6, 3) -> 0 (tie with 8: the smaller id), then
    # (3, 0) and (0,) were never followed by anything
    assert table.draft([4, 5], 4) == [7, 3, 0]  # the longer context (4, 5) wins over (5,)
    assert table.draft([1, 5], 2) == [6, 3]  # (1, 5) unknown: (5,) answers
    assert table.draft([8, 9], 3) == [] and table.draft([], 3) == []  # 9 only in a prefix: what follows it is not
    # counted
    assert table.draft([5], 0) == [] and table.draft([5], 1) == [6]


def test_round_trip_and_refusals(tmp_path):
    rows = np.arange(60).reshape(5, 12) % 7
    table = DraftTable.from_rows(rows, first=3, longest=4, made_by={"model": "m", "rows": 5})
    assert table.maps == [counted(rows, 3, n) for n in range(1, 5)]
    path = table.save(tmp_path / FILE)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o666 & ~_umask())
    back = load_beside(tmp_path)
    assert back.maps == table.maps and (back.longest, back.made_by) == (4, table.made_by)
    assert back.draft([1, 2], 5) == table.draft([1, 2], 5) != []
    wide = DraftTable.from_rows(np.array([[70000, 1, 70000, 1]]), first=1, longest=1)  # ids past uint16 kept whole
    assert DraftTable.load(wide.save(tmp_path / "wide.safetensors")).maps == [{(70000,): 1, (1,): 70000}]
    assert load_beside(tmp_path / "nowhere") is None
    save_file({"weight": np.zeros(3, dtype=np.float32)}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(CheckpointError, match="weights.safetensors: not a printpress draft table"):
        DraftTable.load(tmp_path / "weights.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="junk.safetensors: unreadable draft table"):
        DraftTable.load(tmp_path / "junk.safetensors")
    save_file({"contexts_1": np.zeros((3, 1), dtype=np.uint16), "next_1": np.zeros(2, dtype=np.uint16)},
              str(tmp_path / "short.safetensors"), metadata={"format": "printpress draft table 1", "longest": "1",
                                                             "made_by": "{}"})
    with pytest.raises(CheckpointError, match="short.safetensors: unreadable draft table \\(3 contexts of 1 tokens "
                                              "but 2 next tokens\\)"):
        DraftTable.load(tmp_path / "short.safetensors")
    with pytest.raises(CheckpointError, match="first written position must be in 0..11, got 12"):
        DraftTable.from_rows(rows, first=12)
    with pytest.raises(CheckpointError, match="longest context must be at least 1 token, got 0"):
        DraftTable.from_rows(rows, first=0, longest=0)
    with pytest.raises(CheckpointError, match="2-D integer array"):
        DraftTable.from_rows(rows.astype(float), first=0)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
