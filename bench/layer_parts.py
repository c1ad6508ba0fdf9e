"""Where a layer's time goes after attention, by rows: the C++ layer's `after_attention` against its products alone.

A verification of speculative drafts runs every layer over a few rows (8 for 7 drafts), an AR step over one. This
times, on the shipped model's six layers one after another (so each weight comes from where a real pass finds it),
`printpress_layers.after_attention` over R rows, then the same layer's products alone with the shapes it runs them
at (the output projection, the dense MLP's three, the router's, and the two products of each expert the R * top_k
(row, expert) pairs reach, over its share of them), and one gate product (192 x 384) alone, in a loop over the layers'
gate and up weights, in GFLOP/s. Medians over `--reps`; one thread.

    OMP_NUM_THREADS=1 .venv/bin/python bench/layer_parts.py --out docs/results/layer_parts.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import printpress

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_speed import median_ms  # the benchmarks' own timer


def median_us(fn, reps: int) -> float:
    """engine_speed's median of `reps` timed calls after a warm-up, in microseconds."""
    return 1e3 * median_ms(fn, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = printpress.load(args.model).model
    plans = [layer._plan() for layer in model.layers]
    if any(plan is None for plan in plans):
        parser.error("the C++ layers do not run this model here (not built, or the model is not one they take)")
    ops = torch.ops.printpress_layers
    config = model.config
    hidden, experts, top_k = config.hidden_size, config.num_experts, config.top_k_experts
    gates = [plan.after_encoder[i] for plan in plans for i in (3, 4)]  # the dense MLP's gate and up weights
    gate = gates[0]
    results = {}
    for rows in args.rows:
        x, attended = torch.randn(rows, hidden), torch.randn(rows, hidden)
        middle = torch.randn(rows, config.intermediate_size)
        pairs = rows * top_k  # (row, expert) pairs, spread over as many experts as they can reach
        used = min(experts, pairs)
        routed = torch.randn(pairs // used, hidden)  # the rows each of those experts gets, on average

        def layers(x=x, attended=attended):
            for plan in plans:
                ops.after_attention(x, attended, plan.after_encoder, plan.top_k, plan.root_size, plan.eps, plan.act)

        def products(x=x, attended=attended, middle=middle, routed=routed, used=used):
            for plan in plans:
                w = plan.after_encoder  # o_proj, ..., gate, up, down, ..., router proj, ..., experts' gate_up, down
                ops.product(attended, w[0])
                ops.product(x, w[3])
                ops.product(x, w[4])
                ops.product(middle, w[5])
                ops.product(x, w[8])
                for expert in range(used):
                    ops.product(routed, w[11][expert])
                    ops.product(routed, w[12][expert])

        gate_us = median_us(lambda x=x: [ops.product(x, weight) for weight in gates], args.reps) / len(gates)
        layer_us = median_us(layers, args.reps) / len(plans)
        product_us = median_us(products, args.reps) / len(plans)
        results[str(rows)] = {
            "after_attention_us_per_layer": layer_us, "its_products_us_per_layer": product_us,
            "the_rest_us_per_layer": layer_us - product_us, "gate_product_us": gate_us,
            "gate_product_gflop_per_s": 2 * rows * gate.shape[0] * gate.shape[1] / gate_us / 1e3}
        r = results[str(rows)]
        print(f"{rows} rows: after_attention {layer_us:.0f} us a layer, its products alone {product_us:.0f} us, the "
              f"rest {layer_us - product_us:.0f} us; a {gate.shape[0]} x {gate.shape[1]} product "
              f"{gate_us:.1f} us ({r['gate_product_gflop_per_s']:.0f} GFLOP/s)", flush=True)
    out = {"command": "python bench/layer_parts.py " + " ".join(sys.argv[1:]), "model": args.model,
           "threads": torch.get_num_threads(), "rows": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
