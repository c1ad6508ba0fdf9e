"""Byte-level BPE tokenizers (the `tokenizers` library): training, saving, loading, encode/decode.

The special tokens sit where the DiffusionGemma config expects them: ``<pad>`` = 0,
``<eos>`` = 1, ``<bos>`` = 2. Byte-level BPE with no normaliser is lossless, so
``decode(encode(text)) == text`` for any string (whitespace, ``\\r\\n``, any Unicode).

The helpers here work on any `tokenizers.Tokenizer` (ours or a released Gemma tokenizer.json):
they never rely on the post-processor to add bos, and by default they treat the text
"<eos>" inside a document as plain text, so data can never smuggle in control tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from printpress.corpora import DataError, Document
from printpress.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
PAD_TOKEN, EOS_TOKEN, BOS_TOKEN = "<pad>", "<eos>", "<bos>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN)  # order = ids 0, 1, 2
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Special tokens + the 256 byte symbols: below this a byte-level BPE cannot encode every string.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

TextSource = str | os.PathLike | Document


def train_tokenizer(
    texts_or_files: Iterable[TextSource],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE on texts. `str` items are texts; `Path`-like items are UTF-8 files
    to read; `Document` items use their text. The result may have fewer than `vocab_size`
    entries when the corpus is too small to yield that many merges."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size must be at least {MIN_VOCAB_SIZE} (3 special tokens + 256 bytes), got {vocab_size}"
        )
    tok = _empty_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # Seed all 256 bytes so text never seen in training still encodes (and round-trips).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    counter = _CountingTexts(texts_or_files)
    tok.train_from_iterator(counter, trainer=trainer)
    if counter.chars == 0:
        raise DataError("cannot train a tokenizer on an empty corpus")
    check_special_tokens(tok)
    logger.info(
        "trained byte-level BPE: %d tokens from %d texts, %d chars", tok.get_vocab_size(), counter.n, counter.chars
    )
    return tok


def _empty_byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # No normalizer: NFC/lowercasing/stripping would make decode(encode(x)) != x.
    # No prefix space: it would add a character that decoding cannot tell from real text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Like Gemma's tokenizer.json: a plain `tok.encode(text)` starts with <bos>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    return tok


class _CountingTexts:
    """Yield texts from mixed sources, counting them (an empty corpus must be an error)."""

    def __init__(self, items: Iterable[TextSource]) -> None:
        self.items, self.n, self.chars = items, 0, 0

    def __iter__(self) -> Iterator[str]:
        for item in self.items:
            text = _as_text(item)
            self.n += 1
            self.chars += len(text)
            yield text


def _as_text(item: TextSource) -> str:
    if isinstance(item, Document):
        return item.text
    if isinstance(item, str):
        return item
    path = Path(item)
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise DataError(f"tokenizer training file {path} does not exist") from None
    except UnicodeDecodeError as err:
        raise DataError(f"tokenizer training file {path} is not UTF-8 (byte {err.start})") from None


def check_special_tokens(tok: Tokenizer) -> None:
    """Fail unless <pad>, <eos>, <bos> have ids 0, 1, 2 (the ids the model config and sampler use)."""
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(token)
        if got != expected_id:
            raise CheckpointError(f"tokenizer maps {token} to id {got}, expected {expected_id}")


def save_tokenizer(tok: Tokenizer, folder: str | os.PathLike, *, hf_config: bool = True) -> Path:
    """Write ``tokenizer.json`` into a model folder (created if needed); return its path.

    With `hf_config`, also write a small ``tokenizer_config.json`` so `transformers` can load the
    folder with `AutoTokenizer` (tests compare against the reference implementation)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TOKENIZER_FILE
    tok.save(str(path))
    if hf_config:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,  # keep decoding lossless there too
            "model_max_length": 1_000_000_000,
        }
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json`` from a model folder (or the file itself) and check the special ids."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"no tokenizer at {file}")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust side raises a bare Exception for any parse problem
        raise CheckpointError(f"cannot read tokenizer {file}: {err}") from None
    check_special_tokens(tok)
    return tok


def tokenizer_sha256(tok: Tokenizer) -> str:
    """A fingerprint of the tokenizer's full definition (vocab, merges, pre-tokenizer, ...)."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def encode(tok: Tokenizer, text: str, *, bos: bool = True, eos: bool = False, parse_special: bool = False) -> list[int]:
    """Token ids of `text`, optionally wrapped in <bos> ... <eos>.

    With `parse_special` false (the default) a literal "<eos>" in the text is encoded as plain
    text, never as the control token."""
    return encode_batch(tok, [text], bos=bos, eos=eos, parse_special=parse_special)[0]


def encode_batch(
    tok: Tokenizer, texts: Sequence[str], *, bos: bool = True, eos: bool = False, parse_special: bool = False
) -> list[list[int]]:
    """`encode` for many texts at once (the Rust side uses several threads)."""
    tok.encode_special_tokens = not parse_special  # not saved in tokenizer.json: set on every call
    # encode_batch_fast skips offset bookkeeping; older `tokenizers` (<0.21) lack it.
    batch_fn = getattr(tok, "encode_batch_fast", tok.encode_batch)
    encodings = batch_fn(list(texts), add_special_tokens=False)
    head = [BOS_ID] if bos else []
    tail = [EOS_ID] if eos else []
    return [head + e.ids + tail for e in encodings]


def decode(tok: Tokenizer, ids: Iterable[int], *, skip_special: bool = True) -> str:
    """Text of token ids; <pad>/<eos>/<bos> (and other special tokens) dropped unless `skip_special` is false."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for, also when they are not whole UTF-8 characters (which `decode` would turn
    into U+FFFD): OpenAI's `bytes` of a token, whose concatenation over a text's tokens is the text's UTF-8.

    A byte-level BPE (ours, GPT-2's) stores each byte as one printable character (`_BYTE_OF_SYMBOL`); a
    SentencePiece-style vocabulary with byte fallback (Gemma's) writes a lone byte as `<0xNN>`; an added (special)
    token stands for its own text; anything else is its decoded text.
    """
    piece = tok.id_to_token(int(token_id))
    if piece is None:
        return b""
    added = tok.get_added_tokens_decoder().get(int(token_id))
    if added is not None:
        return added.content.encode("utf-8")
    if isinstance(tok.decoder, decoders.ByteLevel) and all(ch in _BYTE_OF_SYMBOL for ch in piece):
        return bytes(_BYTE_OF_SYMBOL[ch] for ch in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return tok.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")


def _byte_level_symbols() -> dict[str, int]:
    """Byte-level BPE's table, symbol -> byte: printable Latin-1 bytes are their own character; the other 68 (controls,
    space, NBSP, soft hyphen) are U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


_BYTE_OF_SYMBOL = _byte_level_symbols()
