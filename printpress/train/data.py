"""Training data: token files built once per (corpus, tokenizer) and a resumable batch sampler.

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

Batches are random windows of ``seq_len`` tokens (they may straddle document boundaries; the
eos/bos pair between them is part of what the model learns). Batch ``k`` depends only on
``(seed, k)``, so a run resumed at step ``k`` draws exactly the batches an unbroken run would.
With data parallelism every rank draws the same global batch and keeps a contiguous slice of
rows: rank ``r`` of ``w`` takes rows ``[r*B/w, (r+1)*B/w)``, so concatenating the ranks' batches
in rank order gives the single-process batch of global size ``B``.
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
from printpress.tokenizer import encode_batch, tokenizer_sha256

logger = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "TokenFileMeta",
    "TokenFile",
    "DataSplits",
    "BatchSampler",
    "MixedBatchSampler",
    "token_dtype",
    "write_token_file",
    "write_token_documents",
    "open_token_file",
    "prepare_tokens",
    "prepare_data",
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
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self)) + "\n", encoding="utf-8")
        os.replace(tmp, path)


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
    tmp = path.with_name(path.name + ".tmp")
    digest, index, n = hashlib.sha256(), [], 0
    with open(tmp, "wb") as fh:
        for name, ids in documents:
            data = np.asarray(ids, dtype=dtype).tobytes()
            fh.write(data)
            digest.update(data)
            index.append([name, n, len(ids)])
            n += len(ids)
    os.replace(tmp, path)
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


# --- batches ---------------------------------------------------------------------------------


def _step_seed(seed: int, step: int) -> int:
    """An independent 63-bit seed per (seed, step): batch k can be drawn without drawing 0..k-1."""
    data = f"printpress.batch:{seed}:{step}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    index = starts[:, None] + np.arange(seq_len)[None, :]
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


def _check_sharding(batch_size: int, rank: int, world_size: int) -> int:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in a world of size {world_size}")
    if batch_size < 1 or batch_size % world_size:
        raise ConfigError(f"global batch size {batch_size} must be a positive multiple of world size {world_size}")
    return batch_size // world_size


@dataclass
class BatchSampler:
    """Random training windows; `step` is the index of the next batch (save it with `state_dict`).

    `batch_size` is the global batch size; this rank gets rows ``[rank*B/w, (rank+1)*B/w)``."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    step: int = 0
    # Windows start only at multiples of seq_len: for data whose documents are exactly seq_len tokens
    # (task data such as Sudoku), so every window is one whole example and canvases line up with it.
    aligned: bool = False

    def __post_init__(self) -> None:
        self.local_batch_size = _check_sharding(self.batch_size, self.rank, self.world_size)
        if self.seq_len < 1:
            raise ConfigError(f"seq_len must be positive, got {self.seq_len}")
        if len(self.tokens) < self.seq_len:
            raise DataError(
                f"the data holds {len(self.tokens)} tokens, fewer than one window of seq_len {self.seq_len}"
            )

    def global_starts(self, step: int) -> np.ndarray:
        """Start offsets of all `batch_size` windows of batch `step` (identical on every rank)."""
        gen = torch.Generator().manual_seed(_step_seed(self.seed, step))
        if self.aligned:
            windows = len(self.tokens) // self.seq_len
            return torch.randint(0, windows, (self.batch_size,), generator=gen).numpy() * self.seq_len
        high = len(self.tokens) - self.seq_len + 1
        return torch.randint(0, high, (self.batch_size,), generator=gen).numpy()

    def batch(self, step: int) -> torch.Tensor:
        """This rank's rows of batch `step`: int64 ``(batch_size // world_size, seq_len)``."""
        lo = self.rank * self.local_batch_size
        starts = self.global_starts(step)[lo : lo + self.local_batch_size]
        return _windows(self.tokens, starts, self.seq_len)

    def next_batch(self) -> torch.Tensor:
        out = self.batch(self.step)
        self.step += 1
        return out

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The data position; rank and world size are left out so a run may resume on another layout."""
        return {
            "seed": self.seed,
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict[str, int], *, strict: bool = True) -> None:
        """Restore the position. With `strict`, refuse a state whose batch size, window length or
        data size differ from this sampler's, because the batches would then silently differ."""
        expected = {"batch_size": self.batch_size, "seq_len": self.seq_len, "num_tokens": len(self.tokens)}
        mismatched = [f"{k} {state[k]} != {v}" for k, v in expected.items() if k in state and state[k] != v]
        if mismatched:
            if strict:
                raise DataError(f"cannot resume data position: {', '.join(mismatched)}")
            logger.warning(
                "resuming data position with %s: batches differ from the original run", ", ".join(mismatched)
            )
        self.seed = int(state["seed"])
        self.step = int(state["step"])


@dataclass
class MixedBatchSampler:
    """Batches of real windows with a fixed share of rows from a second token file (a teacher's continuations).

    Global rows ``[0, B - extra_rows)`` are real windows, rows ``[B - extra_rows, B)`` whole rows of the second
    file (aligned, exactly ``seq_len`` tokens each). The layout is fixed, so `is_real(row)` needs no state, and
    like `BatchSampler` batch k depends only on (seed, k), and rank r of w keeps rows ``[r*B/w, (r+1)*B/w)``.
    """

    real: np.ndarray
    extra: np.ndarray
    seq_len: int
    batch_size: int
    extra_rows: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    step: int = 0

    def __post_init__(self) -> None:
        self.local_batch_size = _check_sharding(self.batch_size, self.rank, self.world_size)
        if not 0 < self.extra_rows < self.batch_size:
            raise ConfigError(f"the mixed batch needs 0 < extra rows < batch size {self.batch_size}, got {self.extra_rows}")
        if len(self.extra) % self.seq_len:
            raise DataError(f"the second token file holds {len(self.extra)} tokens, not whole rows of seq_len {self.seq_len}")
        self._real = BatchSampler(self.real, self.seq_len, self.batch_size - self.extra_rows, seed=self.seed)
        self._extra = BatchSampler(self.extra, self.seq_len, self.extra_rows, seed=self.seed + 1, aligned=True)

    def is_real(self, row: int) -> bool:
        """Whether global row `row` of every batch is a real window."""
        return row < self.batch_size - self.extra_rows

    def batch(self, step: int) -> torch.Tensor:
        """This rank's rows of batch `step`: int64 ``(batch_size // world_size, seq_len)``."""
        both = torch.cat([self._real.batch(step), self._extra.batch(step)])
        lo = self.rank * self.local_batch_size
        return both[lo : lo + self.local_batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "step": self.step, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "num_tokens": len(self.real), "extra_tokens": len(self.extra), "extra_rows": self.extra_rows}

    def load_state_dict(self, state: dict[str, int], *, strict: bool = True) -> None:
        expected = {"batch_size": self.batch_size, "seq_len": self.seq_len, "num_tokens": len(self.real),
                    "extra_tokens": len(self.extra), "extra_rows": self.extra_rows}
        mismatched = [f"{k} {state.get(k)} != {v}" for k, v in expected.items() if state.get(k) != v]
        if mismatched and strict:
            raise DataError(f"cannot resume data position: {', '.join(mismatched)}")
        self.seed = int(state["seed"])
        self.step = int(state["step"])


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
    grouped into full global batches (the ragged tail is dropped), sharded like `BatchSampler`."""
    local = _check_sharding(batch_size, rank, world_size)
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
        yield _windows(tokens, starts, seq_len)
