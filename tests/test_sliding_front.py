"""bench/sliding_front.py: each sliding pass's input is rebuilt from the events alone, and its counts add up."""

from __future__ import annotations

import pytest

from printpress.engine import CommitEvent, StepEvent

from helpers import bench_module
from test_sliding import PROMPTS, leading_run, stepped

front = bench_module("sliding_front")


def step(n: int, tokens: list[int], accepted: list[bool], max_steps: int = 2) -> StepEvent:
    return StepEvent(request=0, canvas=0, step=n, max_steps=max_steps, tokens=tokens, argmax=tokens,
                     accepted=accepted, stopped=False, entropy=[0.5] * len(tokens))


def commit(ids: list[int]) -> CommitEvent:
    return CommitEvent(request=0, canvas=0, token_ids=ids, text="", finished=False)


def test_runs_break_at_noise_entropy_or_a_collision_and_forced_fronts_are_told_apart():
    events = [
        step(1, [5, 6, 7, 8], [True, True, False, True]),  # a fresh canvas: all noise
        step(2, [5, 6, 9, 8], [True, True, True, True]), commit([5, 6]),  # 5, 6 repeat kept draws; 7 was noise
        step(1, [4, 8, 1, 1], [True, False, True, False]),  # the front held 9 and drew 4: a collision
        step(2, [3, 8, 1, 1], [True, True, False, False]), commit([3]),  # its last step: forced
    ]
    passes = front.front_passes(events)
    assert [(p["run"], p["broke"], p["committed"], p["forced"]) for p in passes] == [
        (0, "noise", 0, False), (2, "noise", 2, False), (0, "collision", 0, False), (0, "collision", 1, True)]
    assert [p["read"] for p in passes] == [[None] * 4, [5, 6, 7, 8], [9, 8, None, None], [4, 8, 1, 1]]
    summary = front.summarize(passes, samples=1)
    assert summary["tokens_per_pass"] == 3 / 4 and summary["commits"] == 2 and summary["forced_commits"] == 1
    assert summary["forced_pass_share"] == 2 / 4  # the forced front waited two passes for one token
    assert summary["tokens_per_pass_without_forced"] == 2 / 2
    assert summary["forced_token_share"] == 1 / 3
    assert summary["front_accepted_share"] == 1.0  # passes 1 and 3; the last steps' fronts are kept anyway
    assert summary["front_collision_share"] == 2 / 3
    assert summary["run_broke_at"] == {"entropy": 0.0, "noise": 0.5, "collision": 0.5, "whole canvas": 0.0}
    assert summary["commit_sizes"] == {1: 1, 2: 1}


@pytest.mark.parametrize("waits", [1, 3])
def test_the_rebuilt_input_is_what_each_pass_of_the_engine_read(models_, waits):
    _, pipe = models_["peaked"]
    settings = dict(max_new_tokens=13, max_denoising_steps=waits, t_min=0.05, t_max=0.5, entropy_bound=1.0)
    kinds = set()
    for prompt in PROMPTS:
        steps, events = stepped(pipe, prompt, 5, **settings)
        passes = front.front_passes(events)
        assert len(passes) == len(steps)
        for (read, new), rebuilt in zip(steps, passes):
            known = [i for i, t in enumerate(rebuilt["read"]) if t is not None]
            assert [rebuilt["read"][i] for i in known] == [read[i] for i in known]
            event = next(e for e in new if isinstance(e, StepEvent))
            fixed = leading_run([a and t == r for a, t, r in zip(event.accepted, event.tokens, read)])
            run = rebuilt["run"]
            # the engine's run, unless fresh noise (no event shows it) was sampled again where the rebuilt one ends
            assert run == fixed or (run < fixed and rebuilt["read"][run] is None)
            if rebuilt["forced"]:
                assert rebuilt["committed"] == 1 and (rebuilt["step"] == waits or fixed)
            kinds.add(rebuilt["broke"])
        assert sum(p["committed"] for p in passes) == 13
    assert {"noise", "entropy"} <= kinds
