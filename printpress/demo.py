"""`make demo`: generate with the shipped default model, both ways, and say what it measured.

The default model (models/shakespeare-joint) was trained with the joint objective, so the same weights
decode by diffusion (a canvas of 32 tokens denoised in parallel, drawn live when stderr is a terminal)
and autoregressively (one token per forward). See its model card for how it was trained and how good
each decoding is.
"""

from __future__ import annotations

import sys

from printpress.cli import main as cli_main
from printpress.pipeline import default_model_path
from printpress.errors import PrintpressError

PROMPT = "ROMEO.\n"  # the corpus writes a speaker as NAME. on a line of its own


def main() -> int:
    try:
        folder = default_model_path()
    except PrintpressError as exc:
        print(f"printpress demo: {exc}", file=sys.stderr)
        return 2
    print(f"printpress demo — model {folder.name}, prompt {PROMPT!r}\n")
    print("== diffusion: 32-token canvases denoised in parallel (the printing press) ==", flush=True)
    code = cli_main(["generate", "--seed", "0", "--max-new-tokens", "96", "--show-steps", "--stats", PROMPT])
    if code:
        return code
    print("\n== autoregressive decoding on the same weights (sampled at the default temperature 0.8, top-k 50) ==",
          flush=True)
    return cli_main(["generate", "--seed", "0", "--max-new-tokens", "96", "--mode", "ar", "--stats", PROMPT])


if __name__ == "__main__":
    sys.exit(main())
