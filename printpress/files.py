"""Writing a file whole or not at all, safely beside other processes writing the same file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced_atomically(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` to write to; when the block ends without an error it is renamed onto `path`
    (readers see the old file or the new one, never half of one), else removed.

    The name is unique to this call, so two processes writing the same file at once (two benchmarks reading the
    same cached token files, say) each rename a whole file of their own instead of renaming each other's. The file
    gets the permissions a plain `open()` would have given it."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
