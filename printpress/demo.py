"""`make demo`: generate with the shipped default model, both ways, and say what it measured.

The default model (models/shakespeare-joint) was trained with the joint objective, so the same weights
decode by diffusion (a canvas of 32 tokens denoised in parallel, drawn live when stderr is a terminal),
autoregressively (one token per forward) and speculatively (drafts that the AR side verifies: exactly AR's greedy
text; diffusion drafts are not faster on this model, drafts copied from the text itself are, and drafts from the
model's draft table, its own habits, about twice as fast as AR: see docs/benchmarks-speculative.md). See its model
card for how it was trained and how good each decoding is.
"""

from __future__ import annotations

import sys

from printpress.cli import main as cli_main
from printpress.pipeline import default_model_path
from printpress.errors import PrintpressError

PROMPT = "ROMEO.\n"  # the corpus writes a speaker as NAME. on a line of its own
# After diffusion: the same weights decoding autoregressively, then greedy AR beside speculative decoding with each
# draft source, whose output is exactly greedy AR's (the printed statistics say how many passes and seconds it took).
DECODINGS = [
    ("autoregressive decoding on the same weights (sampled at the default temperature 0.8, top-k 50)", ["--mode", "ar"]),
    ("greedy autoregressive decoding (temperature 0)", ["--mode", "ar", "--temperature", "0"]),
    ("speculative decoding: diffusion drafts, AR verifies (greedy: exactly the text above)",
     ["--mode", "speculative", "--draft-source", "diffusion", "--temperature", "0"]),
    ("speculative decoding: drafts copied from the text itself, AR verifies (the same text again, fewer passes)",
     ["--mode", "speculative", "--draft-source", "lookup", "--temperature", "0"]),
    ("speculative decoding: drafts from the model's draft table, what it usually writes next (the default source;"
     " the same text, fewer passes still)", ["--mode", "speculative", "--temperature", "0"]),
]


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
    for header, flags in DECODINGS:
        print(f"\n== {header} ==", flush=True)
        code = cli_main(["generate", "--seed", "0", "--max-new-tokens", "96", *flags, "--stats", PROMPT])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
