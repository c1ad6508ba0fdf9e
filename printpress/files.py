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
        give_default_modes(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def give_default_modes(path: Path) -> None:
    """Give `path`, and everything under it if it is a folder, the permissions `open()` and `mkdir()` would have
    given them under this process's umask: `tempfile` makes its files and folders private (0600, 0700), and a model
    folder written through one must stay readable by whoever may read its parent (a server's user, a container)."""
    umask = os.umask(0)
    os.umask(umask)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~umask)
