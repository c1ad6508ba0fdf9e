"""printpress's own C++ kernels (printpress/kernels/*.cpp): built on first use with torch's extension builder,
cached per machine, loaded once per process.

Each source registers its operators with `TORCH_LIBRARY`, so they are called as `torch.ops.<library>.<op>` and
appear inside compiled graphs as opaque operators (their shapes come from the fake implementations given here).
`printpress.quantize`'s int8 linear and `printpress.fast`'s few-row float32 linear are opt-in fast paths that are
not bit-exact anyway; the exact path's three give the same bits as ATen's: the draws (draw.cpp,
`sampling.draw_kernels`), the sampler's softmax and entropy (softmax.cpp, `sampling.softmax_kernels`) and the layers
(layers.cpp, `model.native_layers`). Where a kernel cannot be built (no compiler, no ninja), `load` warns once and
returns False, and its caller runs its slower fallback. A first build on a machine says so on stderr;
`python -m printpress.prebuild` builds the exact path's kernels ahead (`make setup` does).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from printpress.precision import cpu_flags, read_cpuinfo

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).resolve().parent / "kernels"

# Flags beyond -O3 -march=native, per source. layers.cpp and softmax.cpp give ATen's bits, so no multiply and add may
# become one fused multiply-add (GCC contracts them by default).
CFLAGS = {"layers.cpp": ["-ffp-contract=off"], "softmax.cpp": ["-ffp-contract=off"]}

_lock = threading.Lock()
_loaded: dict[str, bool] = {}  # source file name -> whether it loaded in this process


def load(source: str, fallback: str, register_fakes: Callable[[], None]) -> bool:
    """Build (first use on this machine: 10-20 s; torch caches it under ~/.cache/torch_extensions) and load
    printpress/kernels/`source`, then `register_fakes()` (the shapes of its operators for torch.compile). False,
    with one warning that ends with `fallback` (what runs instead), where it cannot be built."""
    with _lock:
        if source not in _loaded:
            _loaded[source] = _build(source, fallback)
            if _loaded[source]:
                register_fakes()
        return _loaded[source]


def loaded(source: str) -> bool:
    """Whether printpress/kernels/`source` is loaded in this process (without building it)."""
    return _loaded.get(source, False)


def machine_key() -> str:
    """This machine's architecture and CPU flags: what code compiled for it (-march=native, inductor's kernels)
    may assume, so a part of the names of what is built for it."""
    return f"{platform.machine()} {sorted(cpu_flags(read_cpuinfo()))}"


def library_name(path: Path) -> str:
    """The name (and build folder) of the library built from the source at `path`. -march=native: the library is
    built for this CPU, so its name carries the CPU's flags and torch's version; and the source's digest, so that
    checkouts of other versions (a worktree, another venv) never share a build folder: torch rebuilds a folder whose
    sources changed, and a process could then load the other version's operators. The headers beside it
    (printpress/kernels/*.h) count as part of every source."""
    headers = b"".join(header.read_bytes() for header in sorted(path.parent.glob("*.h")))
    digest = hashlib.sha256(path.read_bytes() + headers).hexdigest()[:16]
    key = f"{path.name} {digest} {machine_key()} {torch.__version__}"
    return f"printpress_{path.stem}_" + hashlib.sha256(key.encode()).hexdigest()[:10]


def _build(source: str, fallback: str) -> bool:
    from torch.utils import cpp_extension

    name = library_name(KERNELS / source)
    logger.info("loading the kernel %s (compiled on first use, then cached)", name)
    if not _built(name):
        print(f"printpress: compiling {source} for this machine (once; then cached)", file=sys.stderr, flush=True)
    try:
        cpp_extension.load(name=name, sources=[str(KERNELS / source)], is_python_module=False, verbose=False,
                           extra_cflags=["-O3", "-march=native", *CFLAGS.get(source, [])])
    except Exception as error:  # noqa: BLE001 - any build failure means "run the fallback"
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        logger.warning("the kernel %s could not be built (%s: %s); %s", source, type(error).__name__, first_line,
                       fallback)
        return False
    return True


def _built(name: str) -> bool:
    """Whether torch's extension cache already holds the library `name` (then loading it takes milliseconds)."""
    from torch.utils import cpp_extension

    try:
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001 - a private helper of torch's: when it changes, say nothing rather than fail
        return True
    return (folder / f"{name}.so").exists()

