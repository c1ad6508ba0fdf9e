"""`python -m printpress.prebuild`: build printpress's exact-path kernels for this machine now (`make setup` does), so
that the first generation does not wait for them: the draws, the sampler's softmax and entropy, and the layers
(printpress/native.py). Each says so on stderr when it is compiled; cached ones load in milliseconds."""

from __future__ import annotations

from printpress.model import native_layers
from printpress.sampling import draw_kernels, softmax_kernels


def main() -> None:
    draw_kernels()
    softmax_kernels()
    native_layers()


if __name__ == "__main__":
    main()
