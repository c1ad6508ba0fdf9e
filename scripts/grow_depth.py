"""Grow a checkpoint in depth: every layer followed by a copy of itself that starts out silent.

    python scripts/grow_depth.py --model models/shakespeare-joint --out runs/grown

Layer i of the N-layer model becomes layers 2i and 2i+1 of a 2N-layer model (each layer's attention kind and
per-layer overrides go with it, so the pattern of sliding and full attention is doubled in place). Layer 2i is the
old layer; layer 2i+1 is its copy with the weights of the two norms that close its residual branches
(`post_attention_layernorm`, `post_feedforward_layernorm`) multiplied by `--branch-scale`, and layer scalars of 1
(a layer's output is `(x + branches) * scalar`). At the default 0 the copy adds nothing to the residual stream and
scales nothing: the grown model computes exactly the logits of the original (tested), and training then wakes the
copies up (the closing norms get gradients at once, everything behind them from the next step). This
is the zero-initialised block expansion of LLaMA Pro (Wu et al., 2024) on top of stacking's layer copies (Du et
al., 2024), used as issue 11's "larger model" lever without training a 10M-parameter model from scratch (docs/
benchmarks.md §7, "G1 and G2").

The output is an ordinary Hugging Face folder (config, safetensors, tokenizer, generation config): `printpress
train --set init_from=...` trains it, `printpress.load` and `transformers` load it.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys

import torch

from printpress.checkpoint import build_empty, load_model, save_model
from printpress.config import ModelConfig
from printpress.errors import PrintpressError

LAYER_KEY = re.compile(r"^((?:.*\.)?layers\.)(\d+)(\..+)$")
CLOSING_NORMS = (".post_attention_layernorm.weight", ".post_feedforward_layernorm.weight")
SCALARS = (".layer_scalar", ".encoder_layer_scalar")


def grown_config(config: ModelConfig) -> ModelConfig:
    """`config` with every layer doubled in place (attention kinds and per-layer overrides follow their layer)."""
    text = config.text
    out = copy.deepcopy(config)
    out.text.num_hidden_layers = 2 * text.num_hidden_layers
    out.text.layer_types = [kind for kind in text.layer_types for _ in range(2)]
    out.text.per_layer_config = {2 * i + j: dict(override) for i, override in text.per_layer_config.items()
                                 for j in range(2)}
    return out


def grown_weights(state: dict[str, torch.Tensor], branch_scale: float) -> dict[str, torch.Tensor]:
    """The 2N-layer state dict: layer i's tensors as layer 2i, and again as layer 2i+1 with its closing norms
    scaled by `branch_scale` and its layer scalars 1; every tensor outside the layers unchanged."""
    out = {}
    for key, value in state.items():
        match = LAYER_KEY.match(key)
        if match is None:
            out[key] = value.clone()
            continue
        head, index, tail = match.group(1), int(match.group(2)), match.group(3)
        out[f"{head}{2 * index}{tail}"] = value.clone()
        if tail in SCALARS:
            copied = torch.ones_like(value)
        elif tail in CLOSING_NORMS:
            copied = value * branch_scale
        else:
            copied = value.clone()
        out[f"{head}{2 * index + 1}{tail}"] = copied
    return out


def grow(model_path: str, out: str, branch_scale: float = 0.0) -> ModelConfig:
    """Write the grown model of `model_path` to `out` (float32); returns its config."""
    model, config, generation, tokenizer = load_model(model_path, dtype="float32")
    new_config = grown_config(config)
    grown = build_empty(new_config, torch.float32, "cpu")
    grown.load_state_dict(grown_weights(model.state_dict(), branch_scale), strict=True)
    save_model(grown, new_config, out, generation_config=generation, tokenizer=tokenizer)
    return new_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the checkpoint to grow (a folder or hub id)")
    parser.add_argument("--out", required=True, help="the folder to write the grown model to")
    parser.add_argument("--branch-scale", type=float, default=0.0,
                        help="factor on the copies' closing norms (0: the grown model computes the original's logits)")
    args = parser.parse_args(argv)
    try:
        config = grow(args.model, args.out, args.branch_scale)
    except PrintpressError as error:
        print(f"grow_depth: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {config.text.num_hidden_layers} layers, {config.text.num_parameters() / 1e6:.2f}M "
          "parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
