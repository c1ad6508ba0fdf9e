"""bench/accept_rules.py: the acceptance rules its decoding screens swap in (docs/benchmarks.md §7)."""

from __future__ import annotations

import torch

from helpers import bench_module

accept_rules = bench_module("accept_rules")


def test_spread_skips_a_neighbour_of_a_kept_position_unless_it_is_near_certain():
    entropy = torch.tensor([[0.1, 0.2, 1.0, 0.5, 0.6, 3.0, 0.05, 2.0]])
    # Entropy order 6, 0, 1, 3, 4, 2, 7, 5. Kept: 6, then 0 and 1 (neighbours, but both under 0.3 nats), then 3;
    # 4, 2, 7 and 5 each sit next to a kept position. The stock rule keeps 0, 1, 2, 3, 4 and 6.
    kept = accept_rules.spread_accept(0.3)(entropy, 2.0)
    assert kept[0].nonzero().flatten().tolist() == [0, 1, 3, 6]
    stock = accept_rules.entropy_bound_accept(entropy, 2.0)
    assert stock[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 6]


def test_the_window_rule_is_the_engines_window_lead_for_rows_without_their_own():
    opened = accept_rules.window_everywhere(1.5)
    assert [opened(32, 0.0, step, 8) for step in range(8, 0, -1)] == [6, 12, 18, 24, 30, 32, 32, 32]
    assert opened(32, 1.0, 8, 8) == 4  # a row's own window_lead wins
