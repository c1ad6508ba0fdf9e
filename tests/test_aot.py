"""Compiled graphs called without dynamo (printpress.aot): a package per variant, built once, kept on disk, reading
the live model's weights; whatever it cannot build or load runs through dynamo's graph as before.

Each build compiles with inductor (10-20 s for a tiny model), so the tests share this module's packages.
"""

from __future__ import annotations

import logging

import pytest
import torch

import printpress
from printpress.aot import AheadOfTimeGraphs
from printpress.fast import compile_ar_step

from helpers import make_reference

pytestmark = pytest.mark.slow  # compiles with inductor


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    return tmp_path_factory.mktemp("packages")


@pytest.fixture
def cache_in(packages, monkeypatch):
    monkeypatch.setenv("PRINTPRESS_CACHE", str(packages))
    return packages / "aot"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two tiny models of one configuration with different weights."""
    root = tmp_path_factory.mktemp("aot-models")
    for seed in (0, 1):
        make_reference("gqa", seed=seed).save_pretrained(root / str(seed))
    return [root / "0", root / "1"]


def steps(model, prompt: int, max_length: int, n: int) -> list[torch.Tensor]:
    """The logits of `n` AR steps (fixed random tokens) after a random prompt, in a cache of `max_length`."""
    generator = torch.Generator().manual_seed(prompt)
    cache = model.new_cache(1, max_length)
    vocab = model.config.vocab_size
    with torch.no_grad():
        model.encode(torch.randint(3, vocab, (1, prompt), generator=generator), cache, logits="last")
        return [model.encode(torch.randint(3, vocab, (1, 1), generator=generator), cache, logits="last")
                for _ in range(n)]


# A cache shorter than the sliding window (its ring as long as the cache) and one whose ring wraps.
SHORT, LONG = (3, 5, 2), (9, 40, 12)


def ar_packages(folder):
    return sorted(folder.glob("ar_step_graph-*.pt2"))


def test_one_package_runs_every_cache_length_without_dynamo(folders, cache_in):
    model = printpress.load(folders[0]).model
    exact = [steps(model, *case) for case in (SHORT, LONG)]
    step = compile_ar_step(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ahead = [steps(model, *case) for case in (SHORT, LONG)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # dynamo compiled nothing
    assert step.failure is None and len(ar_packages(cache_in)) == 1  # built once, for the short cache
    assert list(step.ahead._runners.values()) != [None]
    for a, e in zip(sum(ahead, []), sum(exact, [])):
        assert (a - e).abs().max() < 1e-5


def test_decoder_passes_run_their_packages_first_step_and_self_conditioned(folders, cache_in):
    from printpress.fast import compile_decoder

    model = printpress.load(folders[0]).model
    generator = torch.Generator().manual_seed(4)
    cache = model.new_cache(1, 40)
    canvas = torch.randint(3, model.config.vocab_size, (1, 8), generator=generator)
    with torch.no_grad():
        model.encode(torch.randint(3, model.config.vocab_size, (1, 13), generator=generator), cache, logits="none")

        def passes():
            first = model.denoise(canvas, cache)
            return first, model.denoise(canvas, cache, self_conditioning_probs=torch.softmax(first, dim=-1))

        exact = passes()
        compiled = compile_decoder(model)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        ahead = passes()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert len(compiled.ahead._runners) == 2 and None not in compiled.ahead._runners.values()
    assert all((a - e).abs().max() < 1e-4 for a, e in zip(ahead, exact))


def test_another_model_of_the_configuration_loads_the_package_and_reads_its_own_weights(folders, cache_in,
                                                                                          monkeypatch, caplog):
    steps(printpress.load(folders[0], compile="ar").model, *SHORT)  # the package exists (built here or above)
    built = ar_packages(cache_in)

    def no_build(*args):
        raise AssertionError("built again")

    monkeypatch.setattr(AheadOfTimeGraphs, "_build", no_build)
    model = printpress.load(folders[1]).model
    exact = steps(model, *LONG)
    step = compile_ar_step(model)
    with caplog.at_level(logging.WARNING, logger="printpress.aot"):
        ahead = steps(model, *LONG)
    assert not [r for r in caplog.records if r.name == "printpress.aot"] and ar_packages(cache_in) == built
    assert all((a - e).abs().max() < 1e-5 for a, e in zip(ahead, exact))
    with torch.no_grad():
        model.norm.weight.mul_(2.0)  # an in-place change reaches the package: it holds the model's own tensors
    changed = steps(model, *LONG)
    same = printpress.load(folders[1]).model
    with torch.no_grad():
        same.norm.weight.mul_(2.0)
    assert all((a - e).abs().max() < 1e-5 for a, e in zip(changed, steps(same, *LONG)))
    assert not torch.equal(changed[0], ahead[0]) and step.failure is None


def test_a_package_is_keyed_by_the_machine_it_was_compiled_for(folders, monkeypatch):
    """Another CPU (other flags: no AVX-512, no AMX) never loads this one's packages from a shared cache folder: its
    kernels were compiled for this CPU."""
    from printpress import native

    model = printpress.load(folders[0]).model
    key = AheadOfTimeGraphs(lambda model, x: x, model, lambda tensors: None, {}, tag="t")._key([], ())
    assert AheadOfTimeGraphs(lambda model, x: x, model, lambda tensors: None, {}, tag="t")._key([], ()) == key
    monkeypatch.setattr(native, "read_cpuinfo", lambda: "flags\t\t: fpu sse sse2 avx avx2\n")
    assert AheadOfTimeGraphs(lambda model, x: x, model, lambda tensors: None, {}, tag="t")._key([], ()) != key


def test_a_damaged_package_is_built_again(folders, cache_in):
    steps(printpress.load(folders[0], compile="ar").model, *SHORT)
    (package,) = ar_packages(cache_in)
    package.write_bytes(b"not a package")
    model = printpress.load(folders[0]).model
    exact = steps(model, *SHORT)
    step = compile_ar_step(model)
    assert all((a - e).abs().max() < 1e-5 for a, e in zip(steps(model, *SHORT), exact))
    assert list(step.ahead._runners.values()) != [None] and package.stat().st_size > 1000


def test_where_no_package_can_be_written_the_step_runs_through_dynamo(folders, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("PRINTPRESS_CACHE", str(blocked))  # its aot/ folder cannot be made
    model = printpress.load(folders[0]).model
    exact = steps(model, *SHORT)
    step = compile_ar_step(model)
    model.compiled_encoder = None  # only the step's package is under test
    with caplog.at_level(logging.WARNING, logger="printpress.aot"):
        ahead = steps(model, *SHORT)
    assert sum("no ahead-of-time package" in r.message for r in caplog.records) == 1
    assert list(step.ahead._runners.values()) == [None] and step.failure is None
    assert all((a - e).abs().max() < 1e-5 for a, e in zip(ahead, exact))


@pytest.mark.parametrize("backend, ahead_of_time, expected", [("inductor", True, True), ("inductor", False, False),
                                                              ("eager", True, False)])
def test_packages_serve_inductor_graphs_unless_declined(folders, backend, ahead_of_time, expected):
    model = printpress.load(folders[0]).model
    step = compile_ar_step(model, backend=backend, ahead_of_time=ahead_of_time)
    assert (step.ahead is not None) == expected and (model.compiled_encoder.ahead is not None) == expected
