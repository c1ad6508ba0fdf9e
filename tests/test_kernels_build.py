"""Every C++ kernel builds where a compiler and ninja are present (as on CI's machines). A kernel that fails to compile
only logs a warning and its fallback runs, the same numbers slower, and the tests of its fast path skip as they do on a
machine without a compiler: a broken kernel source would otherwise pass the suite unnoticed."""

from __future__ import annotations

import os
import shutil

import pytest
from torch.utils import cpp_extension

from printpress.fast import rows_linear_ready
from printpress.model import native_layers
from printpress.native import KERNELS
from printpress.quantize import load_kernel
from printpress.sampling import draw_kernels, softmax_kernels

LOADERS = {"layers.cpp": native_layers, "draw.cpp": draw_kernels, "softmax.cpp": softmax_kernels,
           "int8_linear.cpp": load_kernel, "rows_linear.cpp": rows_linear_ready}


def test_every_kernel_source_has_a_loader_here():
    assert {path.name for path in KERNELS.glob("*.cpp")} == set(LOADERS)


@pytest.mark.parametrize("source", sorted(LOADERS))
def test_every_kernel_builds_where_a_compiler_is_present(source):
    if shutil.which(os.environ.get("CXX", "c++")) is None or not cpp_extension.is_ninja_available():
        pytest.skip("no C++ compiler or ninja on this machine: the kernels' fallbacks run")
    assert LOADERS[source](), f"printpress/kernels/{source} did not build (the warning logged above says why)"
