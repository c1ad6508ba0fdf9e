"""Token files and held-out windows: the data preparation training and evaluation share.

A corpus becomes token files once per (corpus, tokenizer), split by document into ``train`` and ``val``
(`prepare_data`); `eval_batches` cuts the fixed validation windows from the ``val`` file. Training draws its
batches from the ``train`` file (`printpress.train.data`), and evaluation (`printpress bench`'s held-out losses)
cuts the same validation windows a training run evaluates, without importing the training package.

Token file layout (``<name>.bin`` + ``<name>.json`` beside it):

- ``.bin``: the token ids of every document, concatenated, little-endian ``uint16`` when the
  vocabulary fits (<= 65536 entries) else ``uint32``. Each document is written as
  ``<bos> text <eos>``: bos marks "a document starts here" as in Gemma pretraining, and eos
  teaches the model to end a text (the sampler stops a canvas on it).
- ``.json``: the metadata that makes a stale or damaged ``.bin`` detectable — dtype, token count,
  vocab size, sha256 of the tokenizer, of the corpus (names + texts) and of the ``.bin`` bytes,
  and the document list as ``[name, first token, token count]``.

The ``.bin`` is written under a temporary name and renamed, and the old ``.json`` is removed
before, so an interrupted build leaves no sidecar and is simply rebuilt next time.

Windows of ``seq_len`` tokens may straddle document boundaries (the eos/bos pair between two documents is part
of what the model learns). With data parallelism a global batch of ``B`` rows is split into contiguous slices:
rank ``r`` of ``w`` keeps rows ``[r*B/w, (r+1)*B/w)`` (`rows_per_rank`), so concatenating the ranks' batches in
rank order gives the single-process batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from printpress.corpora import DataError, Document, corpus_sha256, load_corpus, split_documents
from printpress.errors import ConfigError
from printpress.files import replaced_atomically
from printpress.tokenizer import encode_batch, tokenizer_sha256

logger = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "TokenFileMeta",
    "TokenFile",
    "DataSplits",
    "token_dtype",
    "write_token_file",
    "write_token_documents",
    "open_token_file",
    "prepare_tokens",
    "prepare_data",
    "windows_at",
    "rows_per_rank",
    "eval_batches",
]

FORMAT = "printpress.tokens"
FORMAT_VERSION = 1
LAYOUT = "bos text eos"
_ENCODE_CHUNK = 64  # documents per encode_batch call: bounded memory, still parallel


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids ``0 .. vocab_size-1`` (explicitly little-endian)."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class TokenFileMeta:
    """The sidecar JSON of a token file."""

    dtype: str
    num_tokens: int
    vocab_size: int
    tokenizer_sha256: str
    corpus: str
    corpus_sha256: str
    bin_sha256: str
    documents: list[list[Any]] = field(default_factory=list)  # [name, first token, token count]
    layout: str = LAYOUT
    format: str = FORMAT
    version: int = FORMAT_VERSION

    @classmethod
    def read(cls, path: Path) -> TokenFileMeta:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"token file metadata {path} is unreadable ({err}): delete it to rebuild") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != FORMAT_VERSION:
            raise DataError(f"{path} is not printpress token metadata (format {FORMAT} v{FORMAT_VERSION})")
        try:
            return cls(**raw)
        except TypeError as err:
            raise DataError(f"token file metadata {path} is malformed ({err}): delete it to rebuild") from None

    def write(self, path: Path) -> None:
        with replaced_atomically(path) as tmp:
            tmp.write_text(json.dumps(asdict(self)) + "\n", encoding="utf-8")


@dataclass
class TokenFile:
    """An open token file: `tokens` is a read-only memmap over the ``.bin``."""

    path: Path
    meta: TokenFileMeta
    tokens: np.ndarray

    def __len__(self) -> int:
        return self.meta.num_tokens

    @property
    def num_documents(self) -> int:
        return len(self.meta.documents)


@dataclass
class DataSplits:
    train: TokenFile
    val: TokenFile


def meta_path(path: Path) -> Path:
    """Sidecar path of a token file: ``train.bin`` -> ``train.json``."""
    return path.with_suffix(".json")


def write_token_file(
    docs: Sequence[Document], tok: Tokenizer, path: str | os.PathLike, *, corpus: str = ""
) -> TokenFile:
    """Tokenise `docs` (each as ``<bos> text <eos>``) into `path` and its sidecar; return it opened."""
    if not docs:
        raise DataError(f"no documents to write to {path}")

    def tokenised() -> Iterator[tuple[str, Sequence[int]]]:
        for start in range(0, len(docs), _ENCODE_CHUNK):
            chunk = docs[start : start + _ENCODE_CHUNK]
            yield from zip((d.name for d in chunk), encode_batch(tok, [d.text for d in chunk], bos=True, eos=True))

    written = write_token_documents(tokenised(), tok, path, corpus=corpus, corpus_digest=corpus_sha256(docs))
    logger.info("wrote %s: %d documents, %d tokens (%s)", path, written.num_documents, len(written), written.meta.dtype)
    return written


def write_token_documents(
    documents: Iterable[tuple[str, Sequence[int]]], tok: Tokenizer, path: str | os.PathLike, *, corpus: str,
    corpus_digest: str, layout: str = LAYOUT,
) -> TokenFile:
    """Write already tokenised (name, ids) documents to `path` and its sidecar; return it opened.

    The ``.bin`` is written under a temporary name and renamed, and the old sidecar removed first, so an
    interrupted write never leaves metadata describing other bytes."""
    path = Path(path)
    dtype = token_dtype(tok.get_vocab_size(with_added_tokens=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    meta_path(path).unlink(missing_ok=True)  # old metadata must never describe new bytes
    digest, index, n = hashlib.sha256(), [], 0
    with replaced_atomically(path) as tmp, open(tmp, "wb") as fh:
        for name, ids in documents:
            data = np.asarray(ids, dtype=dtype).tobytes()
            fh.write(data)
            digest.update(data)
            index.append([name, n, len(ids)])
            n += len(ids)
    meta = TokenFileMeta(
        dtype=dtype.name,
        num_tokens=n,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        tokenizer_sha256=tokenizer_sha256(tok),
        corpus=corpus,
        corpus_sha256=corpus_digest,
        bin_sha256=digest.hexdigest(),
        documents=index,
        layout=layout,
    )
    meta.write(meta_path(path))
    return _memmap(path, meta)


def open_token_file(
    path: str | os.PathLike, *, tokenizer: Tokenizer | str | None = None, verify: bool = True
) -> TokenFile:
    """Open a token file, refusing it (DataError) when it is damaged or, if `tokenizer` (or its
    sha256) is given, when it was built with another tokenizer. `verify` re-hashes the ``.bin``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {path} does not exist")
    sidecar = meta_path(path)
    if not sidecar.is_file():
        raise DataError(f"token file {path} has no metadata {sidecar.name}: it is incomplete; rebuild it")
    meta = TokenFileMeta.read(sidecar)
    _check_intact(path, meta, verify=verify)
    if tokenizer is not None:
        want = tokenizer if isinstance(tokenizer, str) else tokenizer_sha256(tokenizer)
        if meta.tokenizer_sha256 != want:
            raise DataError(
                f"token file {path} is stale: it was built with tokenizer {meta.tokenizer_sha256[:12]}, "
                f"not {want[:12]}; rebuild it (prepare_tokens does so)"
            )
    return _memmap(path, meta)


def _check_intact(path: Path, meta: TokenFileMeta, *, verify: bool) -> None:
    itemsize = np.dtype(meta.dtype).itemsize
    expected = meta.num_tokens * itemsize
    size = path.stat().st_size
    if size != expected:
        raise DataError(
            f"token file {path} is corrupt: {size} bytes, but its metadata says {meta.num_tokens} "
            f"{meta.dtype} tokens ({expected} bytes); delete it to rebuild"
        )
    if verify and _file_sha256(path) != meta.bin_sha256:
        raise DataError(
            f"token file {path} is corrupt: its contents do not match the sha256 in its metadata; delete it to rebuild"
        )


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _memmap(path: Path, meta: TokenFileMeta) -> TokenFile:
    dtype = np.dtype(meta.dtype).newbyteorder("<")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(meta.num_tokens,))
    return TokenFile(path=path, meta=meta, tokens=tokens)


def prepare_tokens(
    docs: Sequence[Document], tok: Tokenizer, path: str | os.PathLike, *, corpus: str = "", rebuild: bool = False
) -> TokenFile:
    """Reuse the token file at `path` when it matches `docs` and `tok`, else (re)build it.

    A *stale* file (other tokenizer, changed corpus) is rebuilt with a warning; a *damaged* one
    (size or sha256 not matching its metadata) raises DataError, since that points at a disk or
    copy problem worth knowing about. `rebuild` forces a fresh build."""
    path = Path(path)
    sidecar = meta_path(path)
    if rebuild or not sidecar.is_file():
        if path.exists() and not rebuild:
            logger.info("token file %s has no metadata (interrupted build?): rebuilding", path)
        return write_token_file(docs, tok, path, corpus=corpus)
    meta = TokenFileMeta.read(sidecar)
    stale = _stale_reasons(meta, tok, docs)
    if stale:
        logger.warning("token file %s is stale (%s): rebuilding", path, "; ".join(stale))
        return write_token_file(docs, tok, path, corpus=corpus)
    if not path.is_file():
        logger.info("token file %s is missing (its metadata is there): rebuilding", path)
        return write_token_file(docs, tok, path, corpus=corpus)
    _check_intact(path, meta, verify=True)
    logger.info("reusing token file %s (%d tokens)", path, meta.num_tokens)
    return _memmap(path, meta)


def _stale_reasons(meta: TokenFileMeta, tok: Tokenizer, docs: Sequence[Document]) -> list[str]:
    reasons = []
    if meta.tokenizer_sha256 != tokenizer_sha256(tok):
        reasons.append("tokenizer changed")
    if meta.vocab_size != tok.get_vocab_size(with_added_tokens=True):
        reasons.append("vocab size changed")
    if meta.corpus_sha256 != corpus_sha256(docs):
        reasons.append("corpus changed")
    return reasons


def prepare_data(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    tok: Tokenizer,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.05,
    text_field: str = "text",
    cache: str | os.PathLike | None = None,
    rebuild: bool = False,
) -> DataSplits:
    """Load a corpus, split it by document, and build (or reuse) ``out_dir/{train,val}.bin``."""
    docs = load_corpus(sources, text_field=text_field, cache=cache)
    train_docs, val_docs = split_documents(docs, val_fraction)
    label = sources if isinstance(sources, (str, os.PathLike)) else ",".join(map(str, sources))
    out = Path(out_dir)
    return DataSplits(
        train=prepare_tokens(train_docs, tok, out / "train.bin", corpus=str(label), rebuild=rebuild),
        val=prepare_tokens(val_docs, tok, out / "val.bin", corpus=str(label), rebuild=rebuild),
    )


# --- windows ---------------------------------------------------------------------------------


def windows_at(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """The windows of `seq_len` tokens starting at `starts`: int64 ``(len(starts), seq_len)``."""
    index = starts[:, None] + np.arange(seq_len)[None, :]
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


def rows_per_rank(batch_size: int, rank: int, world_size: int) -> int:
    """The rows of a global batch of `batch_size` that each rank keeps; ConfigError unless they divide evenly."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in a world of size {world_size}")
    if batch_size < 1 or batch_size % world_size:
        raise ConfigError(f"global batch size {batch_size} must be a positive multiple of world size {world_size}")
    return batch_size // world_size


def eval_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    *,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[torch.Tensor]:
    """Fixed validation batches: consecutive non-overlapping windows from the start of `tokens`,
    grouped into full global batches (the ragged tail is dropped), sharded like the training batches."""
    local = rows_per_rank(batch_size, rank, world_size)
    n_batches = (len(tokens) // seq_len) // batch_size
    if n_batches == 0:
        raise DataError(
            f"the validation data holds {len(tokens)} tokens, fewer than one batch of "
            f"{batch_size} windows of {seq_len}; use a larger val_fraction or a smaller batch"
        )
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        first = b * batch_size + rank * local
        starts = (first + np.arange(local)) * seq_len
        yield windows_at(tokens, starts, seq_len)
