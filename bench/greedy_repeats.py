"""How much a model's greedy continuations loop: what a draft table feeds on.

    python bench/greedy_repeats.py runs/code-round2/model runs/code-round3b/model --heldout-data stdlib

Speculative decoding with table drafts (`draft_source="table"`) proposes the continuation the model wrote last time
after the same few tokens, so it is accepted most where greedy text repeats itself. Per model: greedy AR
continuations (through the engine, as `bench/speculative.py` runs its AR side) of the held-out prompts that
`printpress bench --heldout-prompts N` draws, and their mean share of repeated token 4-grams, the share of their
non-blank lines that are bare `#` runs, and how many stopped before the limit (end of text). Nothing is written.
"""

from __future__ import annotations

import argparse

import printpress
from printpress.eval.bench import heldout_prompts
from printpress.eval.diversity import repeated_share
from printpress.eval.python_syntax import bare_hash_line_share


def greedy_repeats(pipe, prompts: list[str], tokens: int) -> dict[str, float]:
    results = [pipe.generate(prompt, mode="ar", temperature=0.0, max_new_tokens=tokens) for prompt in prompts]
    shares = [repeated_share(r.token_ids, 4) or 0.0 for r in results]  # fewer than 4 tokens repeat nothing
    return {"repeated_4gram_share": sum(shares) / len(shares),
            "bare_hash_line_share": bare_hash_line_share([r.text for r in results]),
            "stopped_early": sum(len(r.token_ids) < tokens for r in results) / len(prompts)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model folders or hub ids")
    parser.add_argument("--heldout-prompts", type=int, default=24)
    parser.add_argument("--heldout-data", default="shakespeare", help="corpus of the prompts (shakespeare, stdlib)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    prompts = heldout_prompts(args.heldout_prompts, [args.heldout_data], 0.05)
    for model in args.models:
        found = greedy_repeats(printpress.load(model), prompts, args.tokens)
        print(f"{model}: repeated 4-grams {found['repeated_4gram_share']:.3f}, bare # lines "
              f"{100 * found['bare_hash_line_share']:.1f}%, stopped early {100 * found['stopped_early']:.0f}%")


if __name__ == "__main__":
    main()
