import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from printpress.corpora import DataError, Document
from printpress.errors import CheckpointError, ConfigError
from printpress.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    decode,
    encode,
    encode_batch,
    load_tokenizer,
    save_tokenizer,
    token_bytes,
    tokenizer_sha256,
    train_tokenizer,
)

TRAINING_TEXTS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n    return a + b\n\n\nclass Box:\n    pass\n",
    "Ünïcödé: naïve café — 日本語のテキスト, emoji 🎉🚀, math ∑∫√.\n",
    "The quick brown fox jumps over the lazy dog. " * 5,
]

ROUND_TRIP_CASES = {
    "ascii": "Hello, world! The quick brown fox.",
    "unicode": "naïve café — 日本語 🎉 Ω≈ç√ e\u0301 (combining) \u200b zero-width",
    "whitespace": "  leading\ttabs\t\tand  double  spaces \n\n\n trailing   \r\n\r\nCRLF\rCR \u00a0nbsp",
    "code": "def f(x):\n\tif x:\n        return {'a': [1, 2]}  # comment\n    else:\n\t\treturn None\n",
    "unseen_bytes": "\x00\x01\x7f control ¤ ₿ 𝔘𝔫𝔦 \U0010ffff",
    "special_lookalikes": "text <eos> <bos> <pad> more </s>",
    "empty": "",
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(TRAINING_TEXTS, vocab_size=320, min_frequency=1)


def test_special_tokens_have_ids_0_1_2(tok):
    assert (tok.token_to_id("<pad>"), tok.token_to_id("<eos>"), tok.token_to_id("<bos>")) == (0, 1, 2)
    assert (PAD_ID, EOS_ID, BOS_ID) == (0, 1, 2)


@pytest.mark.parametrize("text", ROUND_TRIP_CASES.values(), ids=ROUND_TRIP_CASES.keys())
def test_decode_inverts_encode_exactly(tok, text):
    assert decode(tok, encode(tok, text)) == text
    assert decode(tok, encode(tok, text, bos=False)) == text


def test_bos_and_eos_are_added_only_when_asked(tok):
    plain = encode(tok, "hello", bos=False)
    assert encode(tok, "hello") == [BOS_ID] + plain
    assert encode(tok, "hello", bos=True, eos=True) == [BOS_ID] + plain + [EOS_ID]
    assert BOS_ID not in plain and EOS_ID not in plain


def test_special_token_text_inside_data_is_plain_text(tok):
    ids = encode(tok, "a <eos> b", bos=False)
    assert EOS_ID not in ids
    assert EOS_ID in encode(tok, "a <eos> b", bos=False, parse_special=True)


def test_decode_keeps_special_tokens_when_asked(tok):
    ids = encode(tok, "hi", eos=True)
    assert decode(tok, ids, skip_special=False) == "<bos>hi<eos>"


def test_encode_batch_matches_encode(tok):
    texts = list(ROUND_TRIP_CASES.values())
    assert encode_batch(tok, texts, eos=True) == [encode(tok, t, eos=True) for t in texts]


def test_vocab_size_is_an_upper_bound(tok):
    assert 259 <= tok.get_vocab_size() <= 320


def test_saved_tokenizer_loads_with_plain_tokenizers(tok, tmp_path):
    path = save_tokenizer(tok, tmp_path / "model")
    assert path == tmp_path / "model" / "tokenizer.json"
    plain = Tokenizer.from_file(str(path))
    text = ROUND_TRIP_CASES["code"]
    # The saved post-processor adds <bos> like Gemma's tokenizer does.
    assert plain.encode(text).ids == encode(tok, text)
    assert plain.decode(plain.encode(text).ids) == text
    assert tokenizer_sha256(load_tokenizer(tmp_path / "model")) == tokenizer_sha256(tok)
    config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<bos>", "<eos>", "<pad>")


def test_trains_from_files_and_documents(tmp_path):
    file = tmp_path / "a.txt"
    file.write_text(TRAINING_TEXTS[0], encoding="utf-8")
    tok = train_tokenizer([file, Document("b", TRAINING_TEXTS[1]), TRAINING_TEXTS[2]], vocab_size=300)
    assert decode(tok, encode(tok, TRAINING_TEXTS[1])) == TRAINING_TEXTS[1]


def test_training_is_deterministic():
    a = train_tokenizer(TRAINING_TEXTS, vocab_size=300, min_frequency=1)
    b = train_tokenizer(TRAINING_TEXTS, vocab_size=300, min_frequency=1)
    assert tokenizer_sha256(a) == tokenizer_sha256(b)


def test_too_small_vocab_is_a_config_error():
    with pytest.raises(ConfigError, match="at least 259"):
        train_tokenizer(TRAINING_TEXTS, vocab_size=100)


def test_empty_training_corpus_is_an_error():
    with pytest.raises(DataError, match="empty corpus"):
        train_tokenizer([], vocab_size=300)
    with pytest.raises(DataError, match="empty corpus"):
        train_tokenizer(["", ""], vocab_size=300)


def test_missing_or_binary_training_file_is_named(tmp_path):
    with pytest.raises(DataError, match="nope.txt does not exist"):
        train_tokenizer([tmp_path / "nope.txt"], vocab_size=300)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00\x80")
    with pytest.raises(DataError, match="blob.bin is not UTF-8"):
        train_tokenizer([binary], vocab_size=300)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_rejects_misplaced_special_tokens(tmp_path):
    wrong = Tokenizer(models.BPE())
    wrong.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=270, special_tokens=["<bos>", "<eos>", "<pad>"], show_progress=False)
    wrong.train_from_iterator(TRAINING_TEXTS, trainer=trainer)
    wrong.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="maps <pad> to id 2, expected 0"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", ROUND_TRIP_CASES.values(), ids=ROUND_TRIP_CASES.keys())
def test_token_bytes_concatenate_to_the_texts_utf8(tok, text):
    """OpenAI's `bytes` of a token: its own bytes, also for a token holding part of a character (whose decoded text
    is U+FFFD), so a text's tokens' bytes concatenate to the text's UTF-8."""
    ids = encode(tok, text, bos=False)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode("utf-8")
    assert token_bytes(tok, EOS_ID) == b"<eos>"  # a special token stands for its own text


def test_token_bytes_of_a_byte_fallback_vocabulary():
    """Gemma's tokenizer.json writes a lone byte as `<0xNN>` (SentencePiece byte fallback) and a space as "▁"."""
    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x82>": 2, "<0xAC>": 3, "▁cost": 4, "s": 5}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert [token_bytes(tok, i) for i in (4, 5, 1, 2, 3)] == [b" cost", b"s", b"\xe2", b"\x82", b"\xac"]
