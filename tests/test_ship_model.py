"""scripts/ship_model.py --refresh: a shipped folder's card measured again at its generation defaults."""

from __future__ import annotations

import json

import printpress
from helpers import make_reference, save_checkpoint, script_module, word_tokenizer

ship_model = script_module("scripts/ship_model.py")

OLD_CARD = """---
tags: [diffusion-gemma]
---

# tiny

| | |
|---|---|
| held-out loss (nats/token, step 8) | ar 9.000 |
| default generation | 5 denoising steps, entropy bound 0.1, t 0.8→0.4, 16 new tokens |
| tokens per forward (default settings, 4 prompts) | 9.99 |

Reproduce the samples: `python scripts/ship_model.py` (see its docstring).

## Diffusion decoding (the default settings below, seeds 0-3)

```text
an old sample
```
"""


def test_refresh_measures_the_samples_again_at_the_folders_defaults_and_keeps_the_rest(tmp_path):
    folder = save_checkpoint(make_reference("gqa"), tmp_path / "tiny", tokenizer=word_tokenizer(128))
    (folder / "printpress_generation.json").write_text('{"window_lead": 1.5}')  # a default changed after shipping
    (folder / "README.md").write_text(OLD_CARD)
    old = {"objective": "joint", "steps": 8, "samples": {"Diffusion decoding": [{"prompt": "w5 w6"}, {"prompt": "w7"}]}}
    (folder / "card.json").write_text(json.dumps(old))

    ship_model.refresh(folder, None)

    card, readme = json.loads((folder / "card.json").read_text()), (folder / "README.md").read_text()
    pipe = printpress.load(folder)
    assert pipe.default_settings().window_lead == 1.5
    diffusion = card["samples"]["Diffusion decoding (the default settings below, seeds 0-3)"]
    # The card's own prompts, each with seed i, at the folder's defaults (the window included).
    assert [(r["prompt"], r["text"]) for r in diffusion] == [
        (p, pipe.generate(p, seed=i).text) for i, p in enumerate(["w5 w6", "w7"])]
    assert [r["prompt"] for r in card["samples"]["Autoregressive decoding on the same weights (temperature 0.8, "
                                                 "top-k 50, seeds 0-3)"]] == ["w5 w6", "w7"]
    assert card["steps"] == 8 and card["diffusion_judge_nll_per_char"] is None  # kept; no judge given
    assert "| default generation | 5 denoising steps, entropy bound 0.1, t 0.8→0.4, window lead 1.5, 16 new tokens |" in readme
    assert f"| tokens per forward (default settings, 4 prompts) | {card['diffusion_tokens_per_forward']:.2f} |" in readme
    assert "| held-out loss (nats/token, step 8) | ar 9.000 |" in readme and "an old sample" not in readme
    assert readme.count("## Diffusion decoding") == 1 and "## Autoregressive decoding" in readme
