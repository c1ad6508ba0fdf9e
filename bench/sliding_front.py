"""What bounds the sliding canvas's speed? Every pass of a sliding canvas, read back from its step events
(docs/benchmarks.md §8, "What bounds the sliding canvas").

A sliding canvas commits, after each decoder pass, the leading run of fixed points (positions the pass accepted
under the entropy bound whose sample equals the token the pass read there), or its front alone once the front has
waited its last step (`sliding_steps`). A run breaks at the first position where

- **entropy**: the pass did not accept the position (its entropy is over what the bound lets through), or
- **noise**: it accepted a position whose input was noise (the pass before re-noised it, or it is fresh) and
  sampled another token there: nothing had been drawn there yet to repeat, or
- **collision**: it accepted a position holding a kept draw of the pass before and sampled another token there.

Per setting this counts passes, commits (runs against forced fronts), where each leading run broke, and the share
of fronts accepted, and splits the passes into those a forced front waited through (each wait buys one token) and
the rest (what tokens per pass would be if every front came through as a fixed point as soon as the others do).
The input of each pass is rebuilt from the pass before (its tokens moved left by what was committed, fresh noise
after them); nothing in the engine is changed or patched.

    OMP_NUM_THREADS=1 python bench/sliding_front.py --model models/stdlib-code --data stdlib \\
        --setting steps=1 --setting steps=2 --setting steps=4 --setting steps=8 --setting steps=32 \\
        --out docs/results/code/sliding-front.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BREAKS = ("entropy", "noise", "collision", "whole canvas")


def front_passes(events) -> list[dict]:
    """One record per decoder pass of one sliding request, from its `StepEvent`s and `CommitEvent`s in order:
    the pass's input rebuilt (`read`: None where it was fresh noise, which no event shows, so a fresh-noise token the
    pass happens to sample again ends the run here and not in the engine: about one draw in the vocabulary's size),
    its leading fixed-point run, what broke the run, and how many tokens it committed (forced: the front alone,
    after its last step, with no run)."""
    from printpress.events import CommitEvent, StepEvent

    passes: list[dict] = []
    read, drawn = None, None  # what the next pass reads (None: fresh noise, not in any event) and its kept draws
    for event in events:
        if isinstance(event, StepEvent):
            width = len(event.tokens)
            if read is None:
                read, drawn = [None] * width, [False] * width  # a new canvas: all fresh noise
            run, broke = 0, "whole canvas"
            for i in range(width):  # the engine's rule: accepted, and the sample repeats what the pass read
                if event.accepted[i] and event.tokens[i] == read[i]:
                    run += 1
                    continue
                broke = "entropy" if not event.accepted[i] else "collision" if drawn[i] else "noise"
                break
            passes.append({"step": event.step, "max_steps": event.max_steps, "run": run, "broke": broke,
                           "front_accepted": event.accepted[0], "front_entropy": event.entropy[0],
                           "front_drawn": drawn[0], "accepted": sum(event.accepted), "committed": 0,
                           "forced": False, "read": read})
            read, drawn = list(event.tokens), list(event.accepted)  # re-noised positions hold the noise drawn
        elif isinstance(event, CommitEvent) and passes:
            k, last = len(event.token_ids), passes[-1]
            last["committed"] += k
            last["forced"] = last["run"] == 0
            read, drawn = read[k:] + [None] * k, drawn[k:] + [False] * k
    return passes


def summarize(passes: list[dict], samples: int) -> dict:
    """The counts of one setting's passes (all its requests together)."""
    count = len(passes)
    committed = sum(p["committed"] for p in passes)
    commits = [p for p in passes if p["committed"]]
    forced = [p for p in commits if p["forced"]]
    forced_tokens = sum(p["committed"] for p in forced)
    accepted_draws = [p for p in passes if p["front_accepted"] and p["front_drawn"]]
    broke = Counter(p["broke"] for p in passes)
    waiting = [p for p in passes if p["step"] < p["max_steps"]]
    return {
        "samples": samples,
        "passes": count,
        "tokens": committed,
        "tokens_per_pass": committed / count,
        "commits": len(commits),
        "forced_commits": len(forced),
        "tokens_per_commit": committed / max(len(commits), 1),
        "forced_token_share": forced_tokens / max(committed, 1),
        "passes_per_commit": count / max(len(commits), 1),
        # a commit's `step` is how many passes its front waited: a forced front's wait is spent on one token
        "forced_pass_share": sum(p["step"] for p in forced) / count,
        "tokens_per_pass_without_forced": (committed - forced_tokens) / max(sum(p["step"] for p in commits
                                                                                 if not p["forced"]), 1),
        # at its last step the front is kept whatever its entropy: the bound's verdict is read before it
        "front_accepted_share": (statistics.fmean(p["front_accepted"] for p in waiting) if waiting else None),
        "front_entropy_mean": statistics.fmean(p["front_entropy"] for p in passes),
        "front_collision_share": (sum(p["run"] == 0 for p in accepted_draws) / len(accepted_draws)
                                  if accepted_draws else None),
        "accepted_per_pass": statistics.fmean(p["accepted"] for p in passes),
        "run_broke_at": {name: broke[name] / count for name in BREAKS},
        "commit_sizes": dict(sorted(Counter(p["committed"] for p in commits).items())),
    }


def measure(pipe, prompts: list[str], seeds: int, max_new_tokens: int, overrides: dict) -> dict:
    """Every prompt with seeds 0..seeds-1, one request at a time, on a sliding canvas with `overrides`."""
    passes = []
    for prompt in prompts:
        for seed in range(seeds):
            events = pipe.stream(prompt, seed=seed, sliding=True, max_new_tokens=max_new_tokens, **overrides)
            passes += front_passes(events)
    return summarize(passes, len(prompts) * seeds)


def main() -> None:
    import torch

    from printpress.errors import PrintpressError
    from printpress.eval.bench import heldout_prompts
    from printpress.eval.bench_sides import parse_setting
    from printpress.pipeline import Pipeline

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--data", default="shakespeare", help="the corpus whose held-out documents give the prompts")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts (as printpress bench draws them)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--canvas-length", type=int, default=None)
    parser.add_argument("--setting", action="append", default=[],
                        help="generate() overrides of one row, as printpress bench takes them (steps=4,...); "
                             "repeatable; default: the checkpoint's sliding defaults")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        settings = [parse_setting(text) for text in args.setting] or [{}]
        prompts = heldout_prompts(args.prompts, [args.data], 0.05)
        pipe = Pipeline.from_pretrained(args.model, canvas_length=args.canvas_length)
        rows = [{"setting": text, **measure(pipe, prompts, args.seeds, args.max_new_tokens, overrides)}
                for text, overrides in zip(args.setting or ["(checkpoint defaults)"], settings)]
    except PrintpressError as exc:
        sys.exit(f"sliding_front.py: {exc}")
    for row in rows:
        broke = ", ".join(f"{name} {share:.2f}" for name, share in row["run_broke_at"].items())
        print(f"{row['setting']}: {row['tokens_per_pass']:.2f} tokens per pass "
              f"({row['tokens_per_pass_without_forced']:.2f} without forced fronts, which took {row['forced_pass_share']:.2f} of the passes for "
              f"{row['forced_token_share']:.2f} of the tokens); fronts accepted before their last step: "
              f"{'-' if row['front_accepted_share'] is None else format(row['front_accepted_share'], '.2f')}; "
              f"runs broke at: {broke}")
    report = {"command": "python " + " ".join(sys.argv), "model": args.model, "data": args.data,
              "prompts": args.prompts, "seeds": args.seeds, "max_new_tokens": args.max_new_tokens,
              "canvas_length": pipe.canvas_length, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
