"""`make demo`: generate with the shipped default model.

Until a default model ships in models/, the demo builds a tiny random DiffusionGemma, writes it as a
Hugging Face folder, loads it back and runs the encoder and one denoising step end to end. It says so:
a random model prints noise.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from printpress.checkpoint import load_model, save_model
from printpress.config import ModelConfig, TextConfig
from printpress.model import DiffusionGemma

PROMPT_IDS = [2, 17, 42, 7, 99]


def tiny_random_config() -> ModelConfig:
    text = TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                      num_global_key_value_heads=1, sliding_window=16,
                      layer_types=["sliding_attention", "full_attention"],
                      num_experts=4, top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=1024)
    return ModelConfig(text, canvas_length=16)


def random_model_round_trip() -> None:
    print("printpress demo: no default model is shipped yet, so this builds a tiny RANDOM model (it prints noise),")
    print("saves it as a Hugging Face folder, loads it back and runs the encoder and one denoising step.")
    config = tiny_random_config()
    torch.manual_seed(0)
    model = DiffusionGemma(config.text)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(model, config, Path(tmp) / "tiny-random")
        print(f"wrote {sorted(p.name for p in folder.iterdir())}")
        loaded, config, generation, _ = load_model(folder)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        cache = loaded.new_cache(1, 64)
        next_token = loaded.encode(ids, cache, logits="last").argmax(-1)
        canvas = torch.randint(0, config.text.vocab_size, (1, config.canvas_length))
        denoised = loaded.denoise(canvas, cache).argmax(-1)
    print(f"prompt ids          {PROMPT_IDS}")
    print(f"encoder next token  {next_token.tolist()[0]}")
    print(f"noisy canvas        {canvas.tolist()[0]}")
    print(f"one denoising step  {denoised.tolist()[0]}")
    print(f"parameters: {config.text.num_parameters():,}; default generation settings: {generation}")


def main() -> int:
    random_model_round_trip()
    return 0


if __name__ == "__main__":
    sys.exit(main())
