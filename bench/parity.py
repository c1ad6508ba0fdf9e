"""Parity figures: max |printpress - transformers| of encoder and decoder logits on the test configs.

    python bench/parity.py            # prints a markdown table (fp32, CPU)

Uses the same tiny random checkpoints as tests/conftest.py (three architectures), a short and a long
prompt (longer than every sliding window), a left-padded batch, and decoder passes with and without
self-conditioning.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.cache_utils import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import TINY_CONFIGS, make_reference  # noqa: E402

from printpress.checkpoint import load_model  # noqa: E402


def encoder_logits(ref, hidden):
    cap = ref.config.text_config.final_logit_softcapping
    return torch.tanh(ref.lm_head(hidden).float() / cap) * cap


@torch.no_grad()
def measure(name: str, folder: Path, length: int, padded: bool) -> dict[str, float]:
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(folder).eval()
    model, config, _, _ = load_model(folder)
    vocab, c = config.text.vocab_size, config.canvas_length
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, vocab, (3, length), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    if padded:
        for row, keep in enumerate([length, length // 2, 2]):
            mask[row, : length - keep] = False
        ids = ids.masked_fill(~mask, 0)
    canvas = torch.randint(0, vocab, (3, c), generator=g)
    sc = torch.randn(3, c, vocab, generator=g) * 3
    kwargs = dict(attention_mask=mask, decoder_attention_mask=F.pad(mask, (0, c), value=True)) if padded else {}
    cache_ref = DynamicCache(config=ref.config.text_config)
    out = ref(input_ids=ids, past_key_values=cache_ref, decoder_input_ids=canvas, **kwargs)
    dm = {"decoder_attention_mask": kwargs["decoder_attention_mask"]} if padded else {}
    out_sc = ref(past_key_values=cache_ref, decoder_input_ids=canvas, self_conditioning_logits=sc, **dm)
    cache = model.new_cache(3, 128)
    enc = model.encode(ids, cache, attention_mask=mask if padded else None)
    return {
        "encoder": (enc - encoder_logits(ref, out.encoder_last_hidden_state)).abs()[mask].max().item(),
        "decoder": (model.denoise(canvas, cache) - out.logits).abs().max().item(),
        "decoder+sc": (model.denoise(canvas, cache, sc) - out_sc.logits).abs().max().item(),
    }


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # no options: --help only
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in TINY_CONFIGS:
            folder = Path(tmp) / name
            make_reference(name).save_pretrained(folder)
            for length, padded in ((3, False), (13, False), (12, True)):
                rows.append((name, length, padded, measure(name, folder, length, padded)))
    print("| config | prompt | left-padded batch | encoder | decoder | decoder + self-cond |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for name, length, padded, r in rows:
        worst = max(worst, *r.values())
        print(f"| {name} | {length} | {'yes' if padded else 'no'} | {r['encoder']:.1e} | {r['decoder']:.1e} | {r['decoder+sc']:.1e} |")
    print(f"\nworst max-abs difference: {worst:.2e} (tolerance in tests: 1e-4)")


if __name__ == "__main__":
    main()
