"""Peak resident memory while loading a checkpoint, against the checkpoint's size.

Writes a random DiffusionGemma checkpoint of a few GB (fp32), then loads it in fresh subprocesses, each
reporting its own peak RSS (ru_maxrss), for:
  - printpress.load_model (streams tensor by tensor into a model allocated once in the target dtype), and
  - the naive path, safetensors.torch.load_file() then load_state_dict() into a constructed model,
in fp32 and bf16. Results go to a JSON file; the regime is "CPU, page cache warm".

    python bench/load_memory.py --out docs/results/load_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from printpress.checkpoint import load_model, save_model
from printpress.config import ModelConfig, TextConfig
from printpress.model import DiffusionGemma


def big_config(layers: int) -> ModelConfig:
    text = TextConfig(vocab_size=32_768, hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, global_head_dim=256,
                      num_global_key_value_heads=2, sliding_window=512, num_experts=32, top_k_experts=4,
                      moe_intermediate_size=512, max_position_embeddings=4096)
    return ModelConfig(text, canvas_length=64)


def reset_peak_rss() -> None:
    # A forked child inherits its parent's high-water mark; clear it so only this process's loading counts.
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, folder: str, dtype: str) -> None:
    reset_peak_rss()
    base = peak_rss_mb()
    start = time.perf_counter()
    if mode == "printpress":
        model, *_ = load_model(folder, dtype=dtype)
    else:
        from safetensors.torch import load_file

        from printpress.checkpoint import module_key

        config = ModelConfig.from_file(Path(folder) / "config.json")
        model = DiffusionGemma(config.text).to(getattr(torch, dtype))
        state = {module_key(k): v for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}
        model.load_state_dict({k: v for k, v in state.items() if k}, strict=False)
        del state
    seconds = time.perf_counter() - start
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"mode": mode, "dtype": dtype, "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": base,
                      "model_mb": params / 2**20, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--folder", default="/tmp/printpress-bench-big")
    parser.add_argument("--out", default="docs/results/load_memory.json")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "FOLDER", "DTYPE"))
    parser.add_argument("--write", metavar="FOLDER")
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    folder = Path(args.folder)
    config = big_config(args.layers)
    if args.write:
        with torch.device("meta"):
            model = DiffusionGemma(config.text)
        model = model.to_empty(device="cpu")
        for p in model.parameters():
            p.data.normal_(0, 0.02)
        save_model(model, config, args.write, max_shard_size="100GB")
        return
    if not (folder / "model.safetensors").exists():
        # Written by a child process, so this parent stays small while the loaders run.
        subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--write", str(folder)], check=True)
    size_mb = (folder / "model.safetensors").stat().st_size / 2**20
    rows = []
    for dtype in ("float32", "bfloat16"):
        for mode in ("printpress", "naive"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, str(folder), dtype],
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["checkpoint_mb"] = size_mb
            row["peak_over_checkpoint"] = row["peak_rss_mb"] / size_mb
            rows.append(row)
            print(json.dumps(row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"checkpoint_mb": size_mb, "params": config.text.num_parameters(),
                                          "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
