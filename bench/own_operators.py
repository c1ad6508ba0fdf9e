"""printpress's own attention and capped logits inside the compiled graphs, against ATen's, in one process: the same
compiled passes (dynamo's path) with the operators and without them, alternating, beside the exact path.

`printpress_fast::small_attention` and `rows_linear_capped` (printpress/kernels/rows_linear.cpp) replace ATen's
attention and inductor's softcap in every compiled graph where the kernel has its AVX-512 code. Timed apart, each
side's run also carries whatever else changed between two trees, and this machine's own drift (the exact pass
measured 8.3-9.6 ms across one session's runs); here both forms run in one process, rounds alternating. The
"without" side is the same model compiled the same way, its graphs told the operators are not wanted (its
`_set_routing` patched: a measurement hook, not an option of printpress); the GELU of the routed experts runs on the
kernel in both. Workloads as bench/aot_graphs.py's (rolled back after each call), plus AR steps after 1000 tokens in
caches of 1100 and 4096 slots, where ATen's attention reads every slot under its mask and the kernel skips those
no query sees.

    OMP_NUM_THREADS=1 python bench/own_operators.py [--model models/shakespeare-joint]
        [--out docs/results/own_operators.json]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

import printpress
from printpress import fast
from printpress.fast import compile_ar_step, compile_decoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
# bench/aot_graphs.py, beside this one
from aot_graphs import alternated_medians, arguments, workloads, write_results  # noqa: E402

SIDES = ("exact", "without", "with")
LONG = ((1000, 1100), (1000, 4096))  # (tokens before the step, cache slots)


def long_ar_step(model, context: int, slots: int):
    """An AR step after `context` tokens in a cache of `slots`, rolled back after each call."""
    generator = torch.Generator().manual_seed(context)
    prompt = torch.randint(3, model.config.vocab_size, (1, context), generator=generator)
    token = torch.randint(3, model.config.vocab_size, (1, 1), generator=generator)
    cache = model.new_cache(1, slots)
    model.encode(prompt, cache, logits="none")

    def step():
        snapshot = cache.snapshot(1)
        out = model.encode(token, cache, logits="last")
        cache.truncate(context, snapshot)
        return out

    return step


def main() -> None:
    args = arguments(__doc__, "docs/results/own_operators.json")
    if not fast.own_operators_available():
        raise SystemExit("the kernel's AVX-512 code is not available here: its operators are not used, "
                         "nothing to compare")
    with tempfile.TemporaryDirectory() as folder:
        os.environ["PRINTPRESS_CACHE"] = folder
        models = {side: printpress.load(args.model).model for side in SIDES}
        for side in ("without", "with"):
            compile_ar_step(models[side], ahead_of_time=False)
            compile_decoder(models[side], ahead_of_time=False)
        without = models["without"]
        for graph in (without.compiled_ar_step, without.compiled_encoder, without.compiled_decoder):
            def routing(original=graph._set_routing):
                original()
                fast._own_operators = False  # dynamo guards on it: these graphs are traced without the operators
            graph._set_routing = routing
        calls = {side: workloads(model) for side, model in models.items()}
        for side, model in models.items():
            calls[side].pop("the AR step's roll-back alone (in each AR step row)")
            for context, slots in LONG:
                calls[side][f"AR step after {context} tokens, {slots} slots"] = long_ar_step(model, context, slots)
        outputs = {side: {name: call() for name, call in side_calls.items()} for side, side_calls in calls.items()}
        medians = alternated_medians(calls, args.rounds)
    rows = []
    for name in calls["exact"]:
        ms = {side: medians[side][name] for side in SIDES}
        row = {"workload": name, **{f"{side}_ms": ms[side] for side in SIDES},
               "without / with": ms["without"] / ms["with"], "exact / with": ms["exact"] / ms["with"],
               "exact / without": ms["exact"] / ms["without"],
               "with: max abs logit difference": (outputs["with"][name] - outputs["exact"][name]).abs().max().item()}
        rows.append(row)
        print(f"{name}: exact {ms['exact']:.3f} ms, compiled without the operators {ms['without']:.3f} ms, with them "
              f"{ms['with']:.3f} ms ({row['without / with']:.3f}x; {row['exact / with']:.2f}x the exact path)")
    write_results(args, "bench/own_operators.py", rows)


if __name__ == "__main__":
    main()
