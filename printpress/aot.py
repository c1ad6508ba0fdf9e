"""Compiled graphs called without dynamo: one graph function of `printpress.fast` compiled ahead of time with
AOTInductor (`torch.export`, then `torch._inductor.aoti_compile_and_package`) per variant, kept on disk.

A graph called through `torch.compile` pays dynamo's entry on every call (its guards, its frame handling, the
compiled function's Python wrappers): 0.3-0.4 ms of a 1.65 ms AR step of the shipped model on one CPU thread
(docs/benchmarks.md §6, "Compiled graphs called without dynamo"). The same inductor kernels in an AOTInductor
package are called from its C++ runner with none of that. A package holds no weights (`PACKAGE_CONFIGS`) and is
given the live model's tensors (`load_constants(..., user_managed=True)`), as a dynamo graph reads them: an
in-place change of a weight reaches it, and one package serves every model of the same configuration.

What a package covers is fixed when it is exported: the static sizes of its inputs (batch, block length where it
is not dynamic, canvas), their dtypes and devices, and the Python values the graph function takes (a flag such as
"logits for the last token only"). The sizes that change from one request to the next (the cache's length, the
sliding ring's, a block's) are exported as dynamic dimensions within [2, `MAX_SIZE`]. `AheadOfTimeGraphs` keys its
packages by all of that plus the model's configuration, torch's version and printpress's source, builds one the
first time a variant is called (10-30 s on a CPU, like dynamo's compile), writes it to `cache_folder()` with an
atomic rename, and later processes load it in well under a second. Whatever it cannot cover or build returns None,
and the caller falls back to its dynamo graph.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from printpress.native import machine_key

logger = logging.getLogger(__name__)

MAX_SIZE = 1 << 20  # the largest cache, ring or block length a package accepts
SMALLEST = {"block": 3}  # the smallest size of a dynamic dimension, by name, where it is not 2
# A package holds no weights and inlines none: in an AOTInductor graph the weights are constants, and inductor would
# otherwise write the small ones (a router's per-expert scales, a layer's scalar, a tiny model's norms) into its code
# as the numbers of the model it was built from, which another model of the configuration would then compute with.
PACKAGE_CONFIGS = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True}
PACKAGE_SOURCES = ("aot.py", "fast.py", "model.py", "cache.py", "kernels/rows_linear.cpp")  # what a graph is made of


def cache_folder() -> Path:
    """Where packages are kept: $PRINTPRESS_CACHE/aot, else $XDG_CACHE_HOME/printpress/aot, else
    ~/.cache/printpress/aot."""
    root = os.environ.get("PRINTPRESS_CACHE")
    if root:
        return Path(root) / "aot"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "printpress" / "aot"


class _Bound(nn.Module):
    """A graph function with its model and Python constants bound, as `torch.export` wants a module."""

    def __init__(self, graph: Callable, model: nn.Module, constants: tuple) -> None:
        super().__init__()
        self.graph, self.model, self.constants = graph, model, constants

    def forward(self, *tensors):
        return self.graph(self.model, *tensors, *self.constants)


def _source_digest() -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    here = Path(__file__).resolve().parent
    for name in PACKAGE_SOURCES:
        digest.update(name.encode() + (here / name).read_bytes())
    return digest.hexdigest()


_UNSEEN = object()
_SHAPES_KEPT = 4096  # exact input shapes remembered per graph (each cache length is one)


def _is_marks(x) -> bool:
    """A leaf of `dynamic`'s answer: one tensor's {dim: name}, or None."""
    return isinstance(x, dict) or x is None


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def _leaves(tree, out: list | None = None) -> list:
    """The leaves of nested tuples and lists (tensors, None) in order: `pytree.tree_leaves` with None a leaf, for
    the graphs' inputs, which hold nothing else, at a fraction of its cost per call."""
    out = [] if out is None else out
    for item in tree:
        if type(item) in (tuple, list):
            _leaves(item, out)
        else:
            out.append(item)
    return out


def _rebuild(spec) -> Callable[[Iterator], object] | None:
    """A function that builds the tree `spec` describes from an iterator of its leaves, where it is made of tuples,
    lists and leaves only (the graphs' outputs); None otherwise."""
    if spec.is_leaf():
        return next
    if spec.type not in (tuple, list):
        return None
    children = [_rebuild(child) for child in spec.children()]
    if any(child is None for child in children):
        return None
    kind = spec.type
    return lambda leaves: kind([child(leaves) for child in children])


class _Runner:
    """A loaded package, called with its flat input tensors. The package's own `__call__` parses its input and
    output tree specs from JSON on every call (about 30 us); this parses them once, and rebuilds the outputs' tree
    without pytree's generic walk."""

    def __init__(self, package) -> None:
        self.loader = package.loader
        self.outputs = pytree.treespec_loads(package.loader.get_call_spec()[1])
        self.rebuild = _rebuild(self.outputs)

    def __call__(self, tensors: list[torch.Tensor]):
        flat = self.loader.boxed_run(tensors)
        if self.rebuild is None:
            return pytree.tree_unflatten(flat, self.outputs)
        return self.rebuild(iter(flat))


class AheadOfTimeGraphs:
    """The packages of one graph function for one model.

    `dynamic(tensors)` names, for the graph's tensor inputs (a pytree: tensors, lists of tensors, None), which
    dimensions are dynamic: the same structure with a dict {dim: name} per tensor (dims of one name are one size).
    `constants` are the graph's trailing Python arguments, part of each variant. `inductor_configs` are inductor's
    options (a custom pass, for instance); `tag` says what they are, for the key (passes have no stable repr)."""

    def __init__(self, graph: Callable, model: nn.Module, dynamic: Callable, inductor_configs: dict, tag: str,
                 before_export: Callable[[], None] = lambda: None) -> None:
        self.graph, self.model, self.dynamic = graph, model, dynamic
        self.inductor_configs, self.tag, self.before_export = inductor_configs, tag, before_export
        self._runners: dict[str, _Runner | None] = {}  # variant key -> loaded package, None where it failed
        self._by_shapes: dict[tuple, _Runner | None] = {}  # the same, by the inputs' exact shapes (cheap to look up)
        self._model_key = None

    def __call__(self, tensors: tuple, constants: tuple = ()):
        """The graph's outputs for these inputs, or None if no package covers them (the caller runs its dynamo
        graph)."""
        leaves = _leaves(tensors)  # the package's order, with the inputs left out
        shapes = (constants, *[None if t is None else (t.shape, t.dtype, t.device) for t in leaves])
        runner = self._by_shapes.get(shapes, _UNSEEN)
        if runner is _UNSEEN:
            runner = self._runner(tensors, constants)
            if len(self._by_shapes) < _SHAPES_KEPT:
                self._by_shapes[shapes] = runner
        return None if runner is None else runner([t for t in leaves if t is not None])

    def _runner(self, tensors: tuple, constants: tuple) -> _Runner | None:
        """The package for these inputs' variant: loaded, built first if no process has, or None."""
        dims = self.dynamic(tensors)
        signature = None if dims is None else self._signature(tensors, dims)
        if signature is None:
            return None
        key = self._key(signature, constants)
        if key not in self._runners:
            self._runners[key] = self._load_or_build(key, tensors, dims, constants)
        return self._runners[key]

    def _signature(self, tensors: tuple, dims) -> list | None:
        """The static part of the inputs (dtypes, devices, static sizes, which are None), or None where a dynamic
        size falls outside [2, MAX_SIZE] (sizes 0 and 1 are specialised by export)."""
        leaves = _leaves(tensors)
        dim_leaves = pytree.tree_leaves(dims, is_leaf=_is_marks)
        signature = []
        for tensor, marks in zip(leaves, dim_leaves, strict=True):
            if tensor is None:
                signature.append(None)
                continue
            marks = marks or {}
            if any(not SMALLEST.get(name, 2) <= tensor.shape[d] <= MAX_SIZE for d, name in marks.items()):
                return None
            shape = [f"{marks[d]}" if d in marks else size for d, size in enumerate(tensor.shape)]
            signature.append([str(tensor.dtype), str(tensor.device.type), shape])
        return signature

    def _key(self, signature: list, constants: tuple) -> str:
        if self._model_key is None:
            parameters = [(name, str(t.dtype), list(t.shape)) for name, t in self._constants().items()]
            config = getattr(self.model, "config", None)
            config = config.to_dict() if hasattr(config, "to_dict") else repr(config)
            # The machine too: a package's kernels are compiled for its CPU (AVX-512, AMX), and a cache folder may be
            # shared with another (a home directory on several hosts), where they could not run.
            self._model_key = json.dumps([_source_digest(), machine_key(), config, parameters], sort_keys=True,
                                         default=str)
        text = json.dumps([self._model_key, self.graph.__name__, self.tag, signature, repr(constants)], default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def _constants(self) -> dict[str, torch.Tensor]:
        bound = _Bound(self.graph, self.model, ())
        return {**dict(bound.named_parameters()), **dict(bound.named_buffers())}

    def _load_or_build(self, key: str, tensors: tuple, dims, constants: tuple) -> _Runner | None:
        path = cache_folder() / f"{self.graph.__name__}-{key}.pt2"
        try:
            if path.exists():
                try:
                    return self._load(path)
                except Exception as error:  # noqa: BLE001 - a damaged package is built again
                    logger.warning("%s: the package %s could not be loaded (%s: %s); building it again",
                                   self.graph.__name__, path, type(error).__name__, _first_line(error))
            self._build(path, tensors, dims, constants)
            return self._load(path)
        except Exception as error:  # noqa: BLE001 - any failure means "call it through dynamo"
            logger.warning("%s: no ahead-of-time package for this variant (%s: %s); calling it through dynamo",
                           self.graph.__name__, type(error).__name__, _first_line(error))
            return None

    def _load(self, path: Path) -> _Runner:
        package = torch._inductor.aoti_load_package(str(path))
        live = self._constants()
        package.load_constants({name: live[name] for name in package.get_constant_fqns()}, check_full_update=True,
                               user_managed=True)  # the live model's tensors, not copies
        return _Runner(package)

    def _build(self, path: Path, tensors: tuple, dims, constants: tuple) -> None:
        names: dict[str, torch.export.Dim] = {}

        def spec(marks):
            if marks is None:
                return None
            return {d: names.setdefault(name, torch.export.Dim(name, min=SMALLEST.get(name, 2), max=MAX_SIZE))
                    for d, name in marks.items()}

        marks, spec_of_dims = pytree.tree_flatten(dims, is_leaf=_is_marks)
        leaves = _leaves(tensors)
        shapes = pytree.tree_unflatten([None if t is None else spec(m) for m, t in zip(marks, leaves, strict=True)],
                                       spec_of_dims)
        logger.info("compiling %s ahead of time (once; kept in %s)", self.graph.__name__, path.parent)
        self.before_export()
        with torch.no_grad(), warnings.catch_warnings():
            # torch's own deprecation notice from pickling its tree specs, nothing a user can act on
            warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
            exported = torch.export.export(_Bound(self.graph, self.model, constants), tuple(tensors),
                                           dynamic_shapes=(tuple(shapes),), strict=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
                built = torch._inductor.aoti_compile_and_package(
                    exported, package_path=str(Path(scratch) / path.name),
                    inductor_configs={**self.inductor_configs, **PACKAGE_CONFIGS})
                os.replace(built, path)  # atomic: another process sees the whole package or none
