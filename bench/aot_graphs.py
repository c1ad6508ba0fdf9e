"""The per-call cost of torch.compile's entry, measured: a compiled pass called through dynamo (what printpress's
compiled paths do) against the same graph compiled ahead of time with AOTInductor (`torch.export` +
`torch._inductor.aoti_compile_and_package`) and called through its runner. Both run the same inductor kernels (the
outputs are compared); the difference is dynamo's guards and frame handling and the wrapper's Python entry.

The package is built without the weights (`aot_inductor.package_constants_in_so` off) and reads the live model's
parameters (`load_constants(..., user_managed=True)`), as a dynamo graph does: one package could serve any model of
the same shapes, and an in-place change of a weight reaches it (checked here: `live_weights`).

Workloads on the given model after a 60-token prompt: the AR step (1 token) and a speculative verification block
(8 tokens, logits for every row). One thread; the two calls of a workload alternate in rounds, medians reported.

    OMP_NUM_THREADS=1 python bench/aot_graphs.py [--model models/shakespeare-joint] [--out docs/results/aot_graphs.json]

A measurement, not a feature: printpress's compiled paths still call through dynamo (docs/benchmarks.md §6).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import printpress
from printpress import fast


class _Graph(torch.nn.Module):
    """A graph function of printpress.fast with the model bound, as `torch.export` wants a module."""

    def __init__(self, graph, model, *constants) -> None:
        super().__init__()
        self.graph, self.model, self.constants = graph, model, constants

    def forward(self, *tensors):
        return self.graph(self.model, *tensors, *self.constants)


def median_ms(call, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds of 40 calls per side")
    parser.add_argument("--out", default="docs/results/aot_graphs.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    pipe = printpress.load(args.model, compile="ar")
    model = pipe.model
    if not fast.rows_linear_ready():
        raise SystemExit("printpress's kernels did not build here (no compiler?): nothing to compare")
    fast._routed_experts = True  # as CompiledGraph._run sets it: a block's experts through the routed kernel
    cache = model.new_cache(1, 124)
    model.encode(torch.randint(5, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0)), cache,
                 logits="last")
    length, window = torch.export.Dim("length", min=2, max=4096), torch.export.Dim("window", min=2, max=4096)
    per_layer = [{2: window if spec.sliding else length} for spec in model.specs]
    cache_dims = ({}, {}, {1: length}, {0: window}, per_layer, per_layer)  # _cache_inputs' tensors
    block = torch.export.Dim("block", min=3, max=64)
    workloads = {
        "AR step": (fast.ar_step_graph, model.compiled_ar_step, torch.ones(1, 1, dtype=torch.long), (), {}),
        "verification block (8 tokens)": (fast.encoder_block_graph, model.compiled_encoder,
                                           torch.ones(1, 8, dtype=torch.long), (False,), {1: block}),
    }
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, (graph, compiled, ids, constants, ids_dims) in workloads.items():
            inputs = (ids, *fast._cache_inputs(cache))
            start = time.perf_counter()
            exported = torch.export.export(_Graph(graph, model, *constants), inputs,
                                           dynamic_shapes=((ids_dims, *cache_dims),), strict=False)
            package = torch._inductor.aoti_compile_and_package(
                exported, package_path=str(Path(folder) / f"{len(rows)}.pt2"),
                inductor_configs={"post_grad_custom_post_pass": fast.FewRowLinears(),
                                  "aot_inductor.package_constants_in_so": False})
            runner = torch._inductor.aoti_load_package(package)
            live = {**dict(_Graph(graph, model).named_parameters()), **dict(_Graph(graph, model).named_buffers())}
            runner.load_constants({name: live[name] for name in runner.get_constant_fqns()}, check_full_update=True,
                                  user_managed=True)  # the live model's tensors, not copies
            compile_s = time.perf_counter() - start
            ahead, through_dynamo = runner(*inputs), compiled._run(*inputs, *constants)
            difference = max((a - b).abs().max().item() for a, b in zip(torch.utils._pytree.tree_leaves(ahead),
                                                                      torch.utils._pytree.tree_leaves(through_dynamo)))
            model.norm.weight.mul_(2.0)  # an in-place change of a weight must reach the package
            live_weights = not torch.equal(runner(*inputs)[0], ahead[0])
            model.norm.weight.div_(2.0)
            for _ in range(20):
                runner(*inputs), compiled._run(*inputs, *constants)
            times = {"dynamo": [], "aoti": []}
            for _ in range(args.rounds):
                times["dynamo"].append(median_ms(lambda: compiled._run(*inputs, *constants), 40))
                times["aoti"].append(median_ms(lambda: runner(*inputs), 40))
            row = {"workload": name, "dynamo_ms": statistics.median(times["dynamo"]),
                   "aoti_ms": statistics.median(times["aoti"]), "max_abs_difference": difference,
                   "live_weights": live_weights, "aoti_compile_s": compile_s}
            row["saved_ms"] = row["dynamo_ms"] - row["aoti_ms"]
            rows.append(row)
            print(f"{name}: through dynamo {row['dynamo_ms']:.3f} ms, AOTInductor {row['aoti_ms']:.3f} ms "
                  f"(saves {row['saved_ms']:.3f} ms; outputs differ by {difference:.1e}; reads the live weights: "
                  f"{live_weights}; compiled in {compile_s:.0f} s)")
    meta = {"model": args.model, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": 1, "command": "OMP_NUM_THREADS=1 python bench/aot_graphs.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
