"""Task definitions (data generators, tokenisation, scoring) shared by training recipes and evaluations."""

from __future__ import annotations

from printpress.errors import ConfigError

FIXED_TOKENIZERS = ("sudoku",)


def fixed_tokenizer(name: str):
    """A task's fixed tokenizer (a `tokenizers.Tokenizer`), used by recipes that set ``data.tokenizer``
    instead of training a BPE on the corpus."""
    if name == "sudoku":
        from printpress.tasks.sudoku import tokenizer

        return tokenizer()
    raise ConfigError(f"unknown fixed tokenizer {name!r}; known: {', '.join(FIXED_TOKENIZERS)}")
