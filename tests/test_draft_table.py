"""The draft table: the most frequent next token per context, counted only where the model wrote it; drafts that
follow the longest known context; a file that round-trips and refuses what is not a table."""

from __future__ import annotations

import collections
import gc
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from helpers import file_mode

from printpress.draft_table import (DISCOUNT, FILE, MIN_COUNT, TEXT_AS_LONG, TEXT_LONGER, DraftTable, best_next,
                                    load_beside, next_counts)
from printpress.errors import CheckpointError
from printpress.speculative import ContextLookup


def tally(rows: np.ndarray, first: int, n: int) -> dict[tuple[int, ...], collections.Counter]:
    """next_counts written plainly: count every (context, next) pair whose next token sits at >= first."""
    counts: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows.tolist():
        for j in range(max(first, n), len(row)):
            counts[tuple(row[j - n : j])][row[j]] += 1
    return counts


def counted(rows: np.ndarray, first: int, n: int) -> dict[tuple[int, ...], int]:
    """best_next written plainly: the most counted next token, the smaller id on ties."""
    return {context: min(c, key=lambda t: (-c[t], t)) for context, c in tally(rows, first, n).items()}


@pytest.mark.parametrize("first", [0, 1, 3, 7])
def test_best_next_equals_plain_counting(first):
    rng = np.random.default_rng(first)
    rows = rng.integers(0, 5, size=(40, 12))  # a small vocabulary, so contexts repeat and counts tie
    for n in range(1, 6):
        assert best_next(rows, first, n) == counted(rows, first, n), n
        assert {k: dict(zip(t.tolist(), c.tolist())) for k, (t, c) in next_counts(rows, first, n).items()} == {
            k: dict(c) for k, c in tally(rows, first, n).items()}, n
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


def test_drafts_with_the_text_take_each_token_from_the_longer_context():
    # The table (contexts of 1..2) says 5 -> 6 -> 3 -> 0 and (4, 5) -> 7; the text is what the lookup has seen.
    rows = np.array([[1, 2, 5, 6, 3, 0],
                     [9, 4, 5, 7, 3, 0],
                     [2, 2, 5, 6, 3, 8]])
    table = DraftTable.from_rows(rows, first=2, longest=2)
    # The text had (1, 5) followed by 8: its 2-token context beats the table's (5,) -> 6, and the text goes on
    # from its longer contexts, which the table does not know.
    text = ContextLookup([1, 5, 8, 3, 3, 1, 5])
    assert table.draft(text.tokens, 4, text) == [8, 3, 3, 1] and table.draft(text.tokens, 4) == [6, 3, 0]
    # A tie goes to the text: both know (6, 3), the table with 0 after it, the text with 9.
    text = ContextLookup([6, 3, 9, 1, 6, 3])
    assert table.draft(text.tokens, 4, text) == [9, 1, 6, 3]
    # Where the text's context is shorter, the table's answers: (4, 5) -> 7 beats the text's (5,) -> 8, and at
    # (7, 3) the text knows nothing, the table's (3,) -> 0.
    text = ContextLookup([5, 8, 2, 4, 5])
    assert table.draft(text.tokens, 3, text) == [7, 3, 0] == table.draft(text.tokens, 3)
    # Neither knows anything: no draft; a text alone drafts on where the table knows nothing.
    assert table.draft([42], 3, ContextLookup([42])) == []
    assert table.draft([42, 43, 42], 3, ContextLookup([42, 43, 42])) == [43, 42, 43]
    assert ContextLookup([1, 5, 8, 3, 1, 5]).match([1, 5]) == (2, 8)
    assert ContextLookup([1, 5, 8]).match([9]) == (0, None)


def test_round_trip_and_refusals(tmp_path):
    rows = np.arange(60).reshape(5, 12) % 7
    table = DraftTable.from_rows(rows, first=3, longest=4, made_by={"model": "m", "rows": 5})
    assert table.maps == [counted(rows, 3, n) for n in range(1, 5)]
    path = table.save(tmp_path / FILE)
    assert oct(os.stat(path).st_mode & 0o777) == oct(file_mode())
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


def test_tables_are_built_and_read_with_the_collector_paused_and_left_as_found(tmp_path):
    """A table is hundreds of thousands of tuples made at once; the cyclic collector stays off while they are made
    (with it on, each full collection on the way walked every object of the process: half of reading the shipped
    table), and is on again afterwards exactly where it was on before."""
    rows = np.random.default_rng(0).integers(0, 50, size=(400, 40))
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        table = DraftTable.from_rows(rows, first=5, sampled_rows=rows)  # ~50,000 tuples: dozens of young collections
        assert len(runs) <= 1 and gc.isenabled()  # at most the young collection that follows, once it is on again
        path = table.save(tmp_path / FILE)
        runs.clear()
        back = DraftTable.load(path)
        assert len(runs) <= 1 and gc.isenabled()
    finally:
        gc.callbacks.remove(count)
    assert back.maps == table.maps and len(table.maps[-1]) > 10_000
    gc.disable()
    try:
        DraftTable.load(tmp_path / FILE)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_sampled_rows_give_distributions_drawn_from_the_longest_context():
    rows = np.array([[1, 2, 5, 6, 3],
                     [9, 4, 5, 7, 3],
                     [2, 2, 5, 6, 8]])
    sampled = np.array([[0, 5, 6, 6, 6], [0, 5, 7, 7, 7], [0, 5, 6, 6, 1], [0, 4, 5, 7, 7]])
    table = DraftTable.from_rows(rows, first=2, longest=2, sampled_rows=sampled)
    assert MIN_COUNT == 3
    # After (5,): 6 twice and 7 twice in the sampled rows' written part (positions >= 2); after (6,): 6 three times
    # and 1 once; after (7,): 7 three times; (4,) once, too few. Of the 2-token contexts only (0, 5) was seen 3 times.
    assert {k: (t.tolist(), c.tolist()) for k, (t, c) in table.counts[0].items()} == {
        (5,): ([6, 7], [2, 2]), (6,): ([1, 6], [1, 3]), (7,): ([7], [3])}
    assert {k: (t.tolist(), c.tolist()) for k, (t, c) in table.counts[1].items()} == {(0, 5): ([6, 7], [2, 1])}
    generator = torch.Generator().manual_seed(0)
    draws = [table.sample([5], 3, generator) for _ in range(200)]
    firsts = collections.Counter(tokens[0] for tokens, _ in draws)
    assert set(firsts) == {6, 7} and 70 < firsts[6] < 130  # half and half
    tokens, used = draws[0]
    assert len(tokens) == 3 and used[0][0].tolist() == [6, 7] and used[0][1].tolist() == [0.5, 0.5]
    assert table.sample([3], 3, generator) == ([], [])  # 3 was never followed by anything in the sampled rows
    assert DraftTable.from_rows(rows, first=2).sample([5], 3, generator) == ([], [])  # greedy only


def test_interpolated_drafts_discount_each_context_down_to_the_unigram_and_are_drawn_from_it():
    """A sampling request's drafts come from every known context's counts, interpolated by absolute discounting
    (DISCOUNT 0.75), and from the text's own continuation where its context is as long or longer, worked out by hand
    below; the draws follow that distribution."""
    rows = np.array([[1, 2, 5, 6, 3], [9, 4, 5, 7, 3], [2, 2, 5, 6, 8]])
    sampled = np.array([[0, 5, 6, 6, 6], [0, 5, 7, 7, 7], [0, 5, 6, 6, 1], [0, 4, 5, 7, 7]])
    table = DraftTable.from_rows(rows, first=2, longest=2, sampled_rows=sampled)
    assert DISCOUNT == 0.75
    # (0, 5): 6 twice, 7 once (total 3): 1.25 / 3 and 0.25 / 3 kept, 1.5 / 3 = 0.5 passed down; (5,): 6 and 7 twice
    # each (total 4): 0.5 * 1.25 / 4 each kept, 0.5 * 1.5 / 4 = 0.1875 passed down; the unigram of the 1-token
    # contexts' counts: 1 once, 6 five times, 7 five times (of 11).
    expected = np.zeros(10)
    expected[[1, 6, 7]] = [0.1875 / 11, 1.25 / 3 + 0.15625 + 0.1875 * 5 / 11, 0.25 / 3 + 0.15625 + 0.1875 * 5 / 11]
    q = table.interpolated([0, 5], 10)
    assert q.dtype == np.float32 and np.allclose(q, expected, atol=1e-7) and abs(float(q.sum()) - 1) < 1e-6
    assert np.allclose(table.interpolated([9, 5], 10), table.interpolated([5], 10))  # (9, 5) unknown: from (5,)
    assert table.interpolated([3], 10) is None and DraftTable.from_rows(rows, first=2).interpolated([5], 10) is None
    generator = torch.Generator().manual_seed(0)
    firsts = collections.Counter(table.sample_interpolated([0, 5], 1, generator, 10)[0][0] for _ in range(20000))
    assert set(firsts) == {1, 6, 7} and all(abs(firsts[t] / 20000 - expected[t]) < 0.012 for t in (1, 6, 7)), firsts
    tokens, q = table.sample_interpolated([0, 5], 3, generator, 10)
    assert len(tokens) == 3 and q.shape == (3, 10) and np.array_equal(q[0], table.interpolated([0, 5], 10))
    assert np.array_equal(q[2], table.interpolated([0, 5] + tokens[:2], 10))
    assert table.sample_interpolated([3], 3, generator, 10)[0] == []
    # The text's own continuation: (0, 5) was followed by 2 earlier in the text, a context as long as the longest the
    # counts know, so 2 takes TEXT_AS_LONG of the mass; (9, 0, 5), longer, gives it TEXT_LONGER.
    assert (TEXT_LONGER, TEXT_AS_LONG) == (0.9, 0.3)
    two = np.eye(10)[2]
    as_long = ContextLookup([0, 5, 2, 0, 5])
    assert np.allclose(table.interpolated([0, 5, 2, 0, 5], 10, as_long), 0.7 * expected + 0.3 * two, atol=1e-7)
    longer = ContextLookup([9, 0, 5, 2, 9, 0, 5])
    assert np.allclose(table.interpolated([9, 0, 5, 2, 9, 0, 5], 10, longer), 0.1 * expected + 0.9 * two, atol=1e-7)
    assert np.allclose(table.interpolated([5, 9, 0, 5], 10, ContextLookup([5, 9, 0, 5])), expected)  # (5,): shorter
    drawn = collections.Counter(table.sample_interpolated([9, 0, 5, 2, 9, 0, 5], 1, generator, 10, longer)[0][0]
                                for _ in range(20000))
    assert abs(drawn[2] / 20000 - (0.9 + 0.1 * expected[2])) < 0.01 and set(drawn) == {1, 2, 6, 7}, drawn


def test_distributions_round_trip_and_a_file_that_does_not_add_up_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    rows, sampled = rng.integers(0, 6, size=(30, 10)), rng.integers(0, 6, size=(30, 10))
    table = DraftTable.from_rows(rows, first=2, longest=3, sampled_rows=sampled)
    assert all(table.counts) and all(c.sum() >= MIN_COUNT for level in table.counts for _, c in level.values())
    back = DraftTable.load(table.save(tmp_path / FILE))
    assert back.maps == table.maps and len(back.counts) == 3
    for mine, theirs in zip(back.distributions, table.distributions, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(np.array_equal(mine[k][0], theirs[k][0]) and np.array_equal(mine[k][1], theirs[k][1]) for k in mine)
    for level, counts in zip(table.distributions, table.counts, strict=True):  # each c / c.sum(), the same bits
        assert all(np.array_equal(level[k][1], c / c.sum()) and level[k][1].dtype == np.float64
                   for k, (_, c) in counts.items())
    path = tmp_path / "bad.safetensors"
    tensors = {"contexts_1": np.zeros((1, 1), np.uint16), "next_1": np.zeros(1, np.uint16),
               "sampled_contexts_1": np.zeros((2, 1), np.uint16), "sampled_sizes_1": np.array([1, 2], np.int32),
               "sampled_next_1": np.zeros(2, np.uint16), "sampled_counts_1": np.ones(2, np.int32)}
    save_file(tensors, str(path), metadata={"format": "printpress draft table 1", "longest": "1", "sampled": "True",
                                            "made_by": "{}"})
    with pytest.raises(CheckpointError, match="bad.safetensors: unreadable draft table \\(sampled counts of contexts "
                                              "of 1 tokens do not add up: 2 contexts, 2 sizes summing to 3, 2 tokens"):
        DraftTable.load(path)


def tiny_model():
    from printpress.config import TextConfig
    from printpress.model import DiffusionGemma

    torch.manual_seed(0)
    return DiffusionGemma(TextConfig(
        vocab_size=12, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], num_experts=2, top_k_experts=1, moe_intermediate_size=8,
        max_position_embeddings=256)).eval()


def test_a_diffusion_canvas_can_start_from_the_tables_chain():
    """canvas_start="table": each canvas's first decoder pass sees the chain drawn from the table's counts after
    the text so far (here a table whose every context has one next token, so the chain is known); "noise" (the
    default, the reference's) sees uniform noise; a model without sampled counts is refused."""
    from printpress.engine import Request, StepEvent, run
    from printpress.errors import GenerationError
    from printpress.sampling import SamplerSettings

    model = tiny_model()
    cycle = list(range(12)) * 3  # every token is a known context: t -> t + 1 (mod 12)
    rows = np.array([cycle] * MIN_COUNT)
    model.draft_table = DraftTable.from_rows(rows, first=3, longest=2, sampled_rows=rows)
    seen = []
    denoise = model.denoise
    model.denoise = lambda canvas, *a, **k: seen.append(canvas[0].tolist()) or denoise(canvas, *a, **k)

    def first_canvases(start: str) -> tuple[list[list[int]], list[int]]:
        seen.clear()
        settings = SamplerSettings(max_new_tokens=16, max_denoising_steps=3, eos_token_ids=(), canvas_start=start)
        events = list(run(model, 8, [Request([3, 4, 5], settings, 0)]))
        steps = [e for e in events if isinstance(e, StepEvent)]  # one per decoder pass, in order
        second = next(i for i, e in enumerate(steps) if e.canvas == steps[-1].canvas)
        return [seen[0], seen[second]], events[-1].result.token_ids

    (first, second), tokens = first_canvases("table")
    assert first == [6, 7, 8, 9, 10, 11, 0, 1]
    assert second == model.draft_table.draft([3, 4, 5, *tokens[:8]], 8) != []  # the chain after the committed canvas
    (noise_first, _), _ = first_canvases("noise")
    assert noise_first != first
    model.draft_table = DraftTable.from_rows(rows, first=3, longest=2)  # greedy only
    settings = SamplerSettings(max_new_tokens=8, eos_token_ids=(), canvas_start="table")
    with pytest.raises(GenerationError, match="canvas_start 'table' draws from the model's draft table's sampled "
                                              "counts, and this model has a table without them"):
        list(run(model, 8, [Request([3], settings, 0)]))
    del model.draft_table
    with pytest.raises(GenerationError, match="this model has no draft table: make one with `printpress draft-table"):
        list(run(model, 8, [Request([3], settings, 0)]))
