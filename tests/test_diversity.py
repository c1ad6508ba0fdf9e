"""The diversity figures of `printpress bench`, on hand-made strings with numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from printpress.eval.diversity import (
    distinct_n,
    diversity,
    mean_repeated_ngram_share,
    ngrams,
    repeated_ngram_share,
    unigram_entropy,
    words,
)


def test_words_are_lowercased_letter_runs_with_inner_apostrophes():
    assert words("Don't stop, O'er-the TOP_1\n\nthe 'tis") == ["don't", "stop", "o'er", "the", "top", "1", "the", "tis"]
    assert words(" \n,.;") == []


def test_ngrams():
    assert ngrams(["a", "b", "c"], 2) == [("a", "b"), ("b", "c")]
    assert ngrams(["a", "b"], 3) == []
    with pytest.raises(ValueError):
        ngrams(["a"], 0)


def test_unigram_entropy_is_in_nats_and_pooled_over_texts():
    # a: 2, b: 1, c: 1 -> -(1/2 ln 1/2 + 2 * 1/4 ln 1/4) = 1.5 ln 2
    assert unigram_entropy(["a b", "A, c."]) == pytest.approx(1.5 * math.log(2))
    assert unigram_entropy(["the the the"]) == 0.0
    assert unigram_entropy(["", "..."]) is None


def test_distinct_2_pools_bigrams_but_never_across_two_texts():
    # "a b a b": ab, ba, ab; "a b": ab -> 2 unique of 4 (a bigram "b a" across the texts would make it 5)
    assert distinct_n(["a b a b", "a b"]) == 0.5
    assert distinct_n(["a b c"], 3) == 1.0
    assert distinct_n(["a", "b"]) is None


def test_repeated_4gram_share_counts_4grams_seen_earlier_in_the_same_text():
    # 12 words, 9 four-grams; the first four are new, the next five repeat one of them.
    assert repeated_ngram_share("a b c d a b c d a b c d") == pytest.approx(5 / 9)
    assert repeated_ngram_share("a b c d e") == 0.0
    assert repeated_ngram_share("a b c") is None
    # Within a text only: the same phrase in two texts is no repetition.
    assert mean_repeated_ngram_share(["a b c d", "a b c d"]) == 0.0
    # Averaged over the texts that have a 4-gram ("too short" has none).
    assert mean_repeated_ngram_share(["a b c d a b c d a b c d", "a b c d e", "too short"]) == pytest.approx(5 / 18)
    assert mean_repeated_ngram_share(["x"]) is None


def test_diversity_names_the_three_figures():
    assert diversity(["a b c d a b c d a b c d"]) == {
        "unigram_entropy_nats": pytest.approx(math.log(4)),
        "distinct_2": pytest.approx(4 / 11),
        "repeated_4gram_share": pytest.approx(5 / 9),
    }
