"""bench/greedy_repeats.py: how much greedy continuations loop, counted on given continuations."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import bench_module

greedy_repeats = bench_module("greedy_repeats").greedy_repeats


class Written:
    """Stands in for a pipeline: the continuation each prompt gets is fixed here, so the counts are exact."""

    def __init__(self, continuations: dict[str, tuple[list[int], str]]):
        self.continuations = continuations
        self.asked: list[dict] = []

    def generate(self, prompt, **settings):
        self.asked.append(settings)
        ids, text = self.continuations[prompt]
        return SimpleNamespace(token_ids=ids, text=text)


def test_loops_filler_and_early_stops_are_counted():
    pipe = Written({
        "a": ([1, 2, 3, 4, 1, 2, 3, 4], "x = 1\n#\n\n###\ny = 2\n"),  # 5 four-grams, the last seen before
        "b": ([5, 6], "z\n"),  # stopped at 2 of 8 tokens, no 4-gram; of the 5 lines written, 2 are bare #
    })
    found = greedy_repeats(pipe, ["a", "b"], tokens=8)
    assert found == {"repeated_4gram_share": (1 / 5 + 0.0) / 2, "bare_hash_line_share": 2 / 5, "stopped_early": 0.5}
    assert pipe.asked == [{"mode": "ar", "temperature": 0.0, "max_new_tokens": 8}] * 2
