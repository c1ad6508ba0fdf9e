"""How varied a set of generated texts is: unigram entropy, distinct-2, and the share of repeated word 4-grams.

A judge's NLL rewards typical text, and the cheapest way to look typical is to repeat oneself: a lower
temperature, or a distilled model that collapsed onto a few phrases, scores better without writing better.
These three figures let `printpress bench` compare quality only between sides of matched diversity
(issue 11). All are computed on *word tokens*, so they do not depend on any model's tokenizer:

- `words`: maximal runs of letters, digits and apostrophes inside a word (`don't`, `o'er`), lower-cased, so
  "The" and "the" are one word; punctuation and whitespace separate words and are not words themselves.
- `unigram_entropy`: Shannon entropy **in nats** of the word distribution pooled over all the texts. It grows
  with the amount of text, so compare it only between sides that generated the same number of tokens.
- `distinct_n`: unique word n-grams over all word n-grams, pooled over the texts (an n-gram never spans
  two texts); distinct-2 by default.
- `repeated_ngram_share`: within one text, the fraction of its word n-grams (4-grams by default) that already
  occurred earlier in that same text: 0 for text that never repeats a phrase, near 1 for a loop.
  `mean_repeated_ngram_share` averages it over the texts that have at least one n-gram.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def words(text: str) -> list[str]:
    """The word tokens of `text`, lower-cased (see the module docstring for what counts as a word)."""
    return _WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """Consecutive n-grams of `tokens` (none when there are fewer than n tokens)."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def unigram_entropy(texts: Iterable[str]) -> float | None:
    """Entropy in nats of the word distribution pooled over `texts`; None when they hold no word."""
    counts = Counter(w for text in texts for w in words(text))
    total = sum(counts.values())
    if not total:
        return None
    return sum(c / total * math.log(total / c) for c in counts.values())


def distinct_n(texts: Iterable[str], n: int = 2) -> float | None:
    """Unique word n-grams / all word n-grams, pooled over `texts`; None when no text has an n-gram."""
    grams = [g for text in texts for g in ngrams(words(text), n)]
    return len(set(grams)) / len(grams) if grams else None


def repeated_ngram_share(text: str, n: int = 4) -> float | None:
    """Fraction of the word n-grams of `text` already seen earlier in `text`; None when it has no n-gram."""
    return repeated_share(words(text), n)


def repeated_share(tokens: Sequence, n: int = 4) -> float | None:
    """Fraction of the n-grams of `tokens` (words, or a tokenizer's ids) already seen earlier in the same
    sequence; None when it has no n-gram."""
    grams = ngrams(tokens, n)
    if not grams:
        return None
    seen: set[tuple] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams)


def mean_repeated_ngram_share(texts: Iterable[str], n: int = 4) -> float | None:
    """`repeated_ngram_share` averaged over the texts that have at least one n-gram (None if none has)."""
    shares = [s for s in (repeated_ngram_share(t, n) for t in texts) if s is not None]
    return statistics.fmean(shares) if shares else None


def diversity(texts: Sequence[str]) -> dict[str, float | None]:
    """The three figures `printpress bench` reports per side, under the names its JSON uses."""
    return {
        "unigram_entropy_nats": unigram_entropy(texts),
        "distinct_2": distinct_n(texts, 2),
        "repeated_4gram_share": mean_repeated_ngram_share(texts, 4),
    }
