"""The opt-in compiled AR step (printpress.fast): one graph per step, close to the exact path, never in the way.

The graph is captured with the "eager" backend here (seconds: it checks that the whole step is one graph and
computes what the exact path computes); `-m slow` also compiles it with inductor, as users run it.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import printpress
from printpress.fast import CompiledARStep, compile_ar_step, remove_compiled_ar_step
from printpress.sampling import row_argmax

from helpers import TINY_CONFIGS, bench_module, make_reference


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fast") / "gqa"
    make_reference("gqa").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(folder):
    return printpress.load(folder).model


def run_steps(model, batch: torch.Tensor, mask: torch.Tensor | None, steps: int):
    """Encode a (padded) prompt, then `steps` AR steps feeding back the argmax; the logits of each step and the
    final cache."""
    generator = torch.Generator().manual_seed(3)
    cache = model.new_cache(batch.shape[0], batch.shape[1] + steps + 8)
    with torch.no_grad():
        logits = model.encode(batch, cache, attention_mask=mask, logits="last")
        out = []
        for _ in range(steps):
            token = torch.randint(3, model.config.vocab_size, (batch.shape[0], 1), generator=generator)
            logits = model.encode(token, cache, logits="last")
            out.append(logits)
    return out, cache


def padded_prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    batch = torch.randint(3, vocab, (2, 9), generator=generator)
    mask = torch.ones_like(batch, dtype=torch.bool)
    mask[1, :4] = False  # the second row is left padded
    return batch.masked_fill(~mask, 0), mask


@pytest.mark.slow  # compiles the step
def test_the_step_is_one_graph_and_computes_the_exact_paths_logits(model):
    batch, mask = padded_prompts(model.config.vocab_size)
    exact, exact_cache = run_steps(model, batch, mask, steps=12)  # 9 + 12 positions: the 5-slot ring wraps
    step = compile_ar_step(model, backend="eager")
    try:
        fast, fast_cache = run_steps(model, batch, mask, steps=12)
    finally:
        remove_compiled_ar_step(model)
    assert step.failure is None  # fullgraph=True: a graph break would have been a failure
    for a, b in zip(exact, fast):
        assert (a - b).abs().max() < 1e-5
    assert fast_cache.length == exact_cache.length
    assert torch.equal(fast_cache.pad_mask, exact_cache.pad_mask)
    assert torch.equal(fast_cache.slot_positions, exact_cache.slot_positions)
    for exact_layer, fast_layer in zip(exact_cache.layers, fast_cache.layers):
        assert (exact_layer.keys - fast_layer.keys).abs().max() < 1e-5


def test_a_failing_graph_falls_back_to_the_exact_path_once(model, caplog):
    batch, _ = padded_prompts(model.config.vocab_size)
    exact, _ = run_steps(model, batch, None, steps=3)
    step = compile_ar_step(model, backend="eager")
    model.compiled_encoder = None  # the prompt runs eagerly too: only the step's fallback is under test
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no compiler here")

    step._graph = broken
    try:
        with caplog.at_level(logging.WARNING, logger="printpress.fast"):
            fallback, _ = run_steps(model, batch, None, steps=3)
    finally:
        remove_compiled_ar_step(model)
    assert len(calls) == 1 and "no compiler here" in step.failure
    assert sum("exact eager path" in r.message for r in caplog.records) == 1
    assert all(torch.equal(a, b) for a, b in zip(exact, fallback))  # the exact path, bit for bit


def test_a_model_changed_after_compiling_runs_the_exact_path(folder, caplog):
    """The graph keeps no guards on parameters (`input_and_code_guards`): its own check sends a model whose
    parameters changed dtype (to bfloat16) to the exact path, never into a graph made for float32."""
    model = printpress.load(folder).model
    step = compile_ar_step(model, backend="eager")
    calls = []
    step._graph = lambda *args: calls.append(1)
    model.to(torch.bfloat16)
    batch, _ = padded_prompts(model.config.vocab_size)
    with caplog.at_level(logging.WARNING, logger="printpress.fast"):
        logits, _ = run_steps(model, batch, None, steps=2)
    assert calls == [] and all("changed dtype, device or shape" in graph.failure
                               for graph in (step, model.compiled_encoder))  # the prompt is a block
    assert sum("exact eager path" in r.message for r in caplog.records) == 2  # once per graph
    assert torch.isfinite(logits[-1]).all()  # what the eager path computes in bfloat16


@pytest.mark.slow
def test_inductor_compiles_the_step_of_the_shipped_model():
    pipe = printpress.load()
    exact = pipe.generate("ROMEO:", mode="ar", temperature=0, max_new_tokens=24)
    step = compile_ar_step(pipe.model)
    try:
        fast = pipe.generate("ROMEO:", mode="ar", temperature=0, max_new_tokens=24)
    finally:
        remove_compiled_ar_step(pipe.model)
    assert step.failure is None
    assert len(fast.token_ids) == len(exact.token_ids)
    # Not bit-exact: greedy tokens agree where no two logits are within rounding of each other.
    assert sum(a == b for a, b in zip(fast.token_ids, exact.token_ids)) >= 20


# -- the compiled decoder pass -----------------------------------------------------------------------------------


def decoder_passes(model, caches, canvas: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor | None):
    """Logits of a first step (no self-conditioning) and a self-conditioned step per cache."""
    with torch.no_grad():
        return [(model.denoise(canvas[: c.batch_size], c),
                 model.denoise(canvas[: c.batch_size], c, self_conditioning_probs=probs[: c.batch_size],
                               self_conditioning_mask=None if mask is None else mask[: c.batch_size]))
                for c in caches]


def decoder_caches(model):
    """A one-row cache whose sliding ring has wrapped, a left-padded batch, and two requests stacked."""
    from printpress.cache import StackedCache

    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(5)
    long, short = model.new_cache(1, 40), model.new_cache(1, 40)
    with torch.no_grad():
        model.encode(torch.randint(3, vocab, (1, 13), generator=generator), long, logits="none")
        model.encode(torch.randint(3, vocab, (1, 4), generator=generator), short, logits="none")
        batch, mask = padded_prompts(vocab)
        padded = model.new_cache(2, 40)
        model.encode(batch, padded, attention_mask=mask, logits="none")
    return [long, padded, StackedCache([long, short], 8)]


@pytest.mark.slow  # compiles the pass
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_the_decoder_pass_is_one_graph_and_computes_the_exact_paths_logits(model, dtype, tolerance):
    from printpress.fast import compile_decoder, remove_compiled_decoder

    if dtype != torch.float32:  # bf16: the routed experts' kernel in bf16, the eager path's bf16 kernels
        model = copy.deepcopy(model).to(dtype)
    caches = decoder_caches(model)
    generator = torch.Generator().manual_seed(6)
    canvas = torch.randint(3, model.config.vocab_size, (2, 8), generator=generator)
    probs = torch.softmax(torch.randn(2, 8, model.config.vocab_size, generator=generator), dim=-1)
    mask = torch.tensor([True, False])
    exact = decoder_passes(model, caches, canvas, probs, mask)
    compiled = compile_decoder(model, backend="eager")
    try:
        fast = decoder_passes(model, caches, canvas, probs, mask)
    finally:
        remove_compiled_decoder(model)
    assert compiled.failure is None  # fullgraph=True: a graph break would have been a failure
    for pair_exact, pair_fast in zip(exact, fast):
        for a, b in zip(pair_exact, pair_fast):
            assert a.shape == b.shape and (a - b).abs().max() < tolerance


def test_a_compiled_pass_holds_more_variants_than_dynamos_default_limit(model):
    """Each variant of a pass is a graph of its own (a canvas length, self-conditioned or not, padded rows, batch 1
    or more, a block of 1 token or more); past dynamo's default of 8 per function every later call went eager (a
    sliding canvas at three canvas lengths did). A graph of ranks 1 to 10 (a rank is never made dynamic) is ten."""
    from printpress.fast import CompiledGraph

    class Doubled(CompiledGraph):
        graph = staticmethod(lambda model, x: x * 2)

    doubled = Doubled(model, backend="eager")
    for rank in range(1, 11):
        x = torch.ones((2,) * rank)
        out = doubled._run(x)  # None once the graph has failed
        assert out is not None and torch.equal(out, x * 2), doubled.failure


@pytest.mark.slow  # compiles the pass
def test_a_batch_whose_rows_are_all_conditioned_runs_the_graph_of_a_masked_one(model):
    """Rows in step (every one self-conditioned, no mask) and rows out of step (a mask) run one graph, so what a
    warm-up compiles covers both; with every row conditioned the two give the same logits, bit for bit."""
    from printpress.fast import compile_decoder, remove_compiled_decoder

    cache = decoder_caches(model)[1]
    generator = torch.Generator().manual_seed(13)
    canvas = torch.randint(3, model.config.vocab_size, (2, 8), generator=generator)
    probs = torch.softmax(torch.randn(2, 8, model.config.vocab_size, generator=generator), dim=-1)
    compiled = compile_decoder(model, backend="eager")
    try:
        with torch.no_grad():
            masked = model.denoise(canvas, cache, self_conditioning_probs=probs,
                                   self_conditioning_mask=torch.tensor([True, True]))
            with torch._dynamo.config.patch(error_on_recompile=True):
                unmasked = model.denoise(canvas, cache, self_conditioning_probs=probs)
    finally:
        remove_compiled_decoder(model)
    assert compiled.failure is None and torch.equal(masked, unmasked)


def test_a_failing_decoder_graph_falls_back_to_the_exact_path_once(model, caplog):
    from printpress.fast import compile_decoder, remove_compiled_decoder

    caches = decoder_caches(model)[:1]
    canvas = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(7))
    probs = torch.full((1, 8, model.config.vocab_size), 1 / model.config.vocab_size)
    exact = decoder_passes(model, caches, canvas, probs, None)
    compiled = compile_decoder(model, backend="eager")

    def broken(*args):
        raise RuntimeError("no compiler here")

    compiled._graph = broken
    try:
        with caplog.at_level(logging.WARNING, logger="printpress.fast"):
            fallback = decoder_passes(model, caches, canvas, probs, None)
    finally:
        remove_compiled_decoder(model)
    assert "no compiler here" in compiled.failure
    assert sum("exact eager path" in r.message for r in caplog.records) == 1
    assert all(torch.equal(a, b) for a, b in zip(exact[0], fallback[0]))  # the exact path, bit for bit


def fused_passes(model):
    """What fused passes meet, each from its own cache: a sliding canvas's pass after a commit of 1 and of 3
    tokens (self-conditioned, then not), the last after the 5-slot ring has wrapped, and a fused speculative round
    (a block of 4, canvases of 3 for 3 outcomes). Each pass's outputs and each cache's readable keys after it."""
    generator = torch.Generator().manual_seed(9)
    vocab = model.config.vocab_size

    def tokens(*shape):
        return torch.randint(3, vocab, shape, generator=generator)

    out = []
    with torch.no_grad():
        for prefix, block, probs in ((4, 1, True), (11, 3, False), (13, 3, True)):
            cache = model.new_cache(1, 40)
            model.encode(tokens(1, prefix), cache, logits="none")
            signal = torch.softmax(torch.randn(1, 8, vocab, generator=generator), -1) if probs else None
            out.append(((model.encode_and_denoise(tokens(1, block), tokens(1, 8), cache, signal),), cache))
        cache = model.new_cache(1, 40)
        model.encode(tokens(1, 9), cache, logits="none")
        out.append((model.verify_and_draft(tokens(1, 4), tokens(3, 3), cache), cache))
    return [(outputs, readable_cache(cache)) for outputs, cache in out]


def readable_cache(cache) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: the positions attention can read and their keys and values (the sliding ring oldest first)."""
    return [(cache.prefix_positions(layer.sliding),
             *(cache.sliding_prefix(i) if layer.sliding else cache.full_prefix(i))) for i, layer in enumerate(cache.layers)]


@pytest.mark.slow  # compiles the passes
def test_the_fused_passes_are_graphs_and_compute_the_exact_paths_logits_and_caches(model):
    from printpress.fast import compile_decoder, remove_compiled_decoder

    exact = fused_passes(model)
    compile_decoder(model, backend="eager")
    fused = model.compiled_fused_pass
    try:
        fast = fused_passes(model)
    finally:
        remove_compiled_decoder(model)
    assert fused.failure is None and model.compiled_fused_pass is None  # fullgraph: a break would have failed
    for (exact_out, exact_cache), (fast_out, fast_cache) in zip(exact, fast, strict=True):
        for a, b in zip(exact_out, fast_out, strict=True):
            assert a.shape == b.shape and (a - b).abs().max() < 1e-4
        for (positions, keys, values), (fast_positions, fast_keys, fast_values) in zip(exact_cache, fast_cache):
            assert torch.equal(positions, fast_positions)
            assert (keys - fast_keys).abs().max() < 1e-5 and (values - fast_values).abs().max() < 1e-5


def test_a_failing_fused_graph_falls_back_to_the_exact_path_once(model, caplog):
    from printpress.fast import compile_decoder, remove_compiled_decoder

    exact = fused_passes(model)
    compile_decoder(model, backend="eager")
    fused = model.compiled_fused_pass
    fused._graph = lambda *args: (_ for _ in ()).throw(RuntimeError("no compiler here"))
    model.compiled_decoder.failure = "not this test's"  # the canvas-only passes (none here) stay eager too
    try:
        with caplog.at_level(logging.WARNING, logger="printpress.fast"):
            fallback = fused_passes(model)
    finally:
        remove_compiled_decoder(model)
    assert "no compiler here" in fused.failure
    assert sum("exact eager path" in r.message for r in caplog.records) == 1
    for (exact_out, exact_cache), (fallback_out, fallback_cache) in zip(exact, fallback, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(exact_out, fallback_out, strict=True))  # bit for bit
        assert all(torch.equal(a, b) for layer in zip(exact_cache, fallback_cache) for a, b in zip(*layer))


# -- the compiled encoder block --------------------------------------------------------------------------------


def encoder_blocks(model):
    """What blocks meet: a prompt into an empty cache (logits "last"), then blocks of 3 and 6 tokens (logits
    "all"), the last after the 5-slot sliding ring has wrapped; each block's logits and the final cache."""
    generator = torch.Generator().manual_seed(8)
    vocab = model.config.vocab_size
    cache = model.new_cache(2, 40)
    blocks = [(torch.randint(3, vocab, (2, 7), generator=generator), "last"),
              (torch.randint(3, vocab, (2, 3), generator=generator), "all"),
              (torch.randint(3, vocab, (2, 6), generator=generator), "all")]
    with torch.no_grad():
        out = [model.encode(ids, cache, attention_mask=torch.ones_like(ids, dtype=torch.bool) if index == 0 else None,
                            logits=logits) for index, (ids, logits) in enumerate(blocks)]
    return out, cache


@pytest.mark.slow  # compiles the block
def test_the_encoder_block_is_one_graph_and_computes_the_exact_paths_logits_and_cache(model):
    exact, exact_cache = encoder_blocks(model)
    compile_ar_step(model, backend="eager")
    block = model.compiled_encoder
    try:
        fast, fast_cache = encoder_blocks(model)
    finally:
        remove_compiled_ar_step(model)
    assert block.failure is None and model.compiled_encoder is None
    for a, b in zip(exact, fast):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
    assert fast_cache.length == exact_cache.length == 16
    assert torch.equal(fast_cache.slot_positions, exact_cache.slot_positions)
    for exact_layer, fast_layer in zip(exact_cache.layers, fast_cache.layers):
        assert (exact_layer.keys - fast_layer.keys).abs().max() < 1e-5
        assert (exact_layer.values - fast_layer.values).abs().max() < 1e-5


def tentative_blocks(model, tentative: bool):
    """A 7-token prompt, then blocks of 5 tokens (as long as the sliding ring) of which only the first 2, 5, 1 and 4
    are kept (the ring wraps): each through `encode_tentatively` then `keep(n)`, or (not `tentative`) its first n
    tokens encoded alone. Each block's logits over its kept tokens, and the final cache."""
    generator = torch.Generator().manual_seed(9)
    vocab = model.config.vocab_size
    cache = model.new_cache(1, 40)
    out = []
    with torch.no_grad():
        model.encode(torch.randint(3, vocab, (1, 7), generator=generator), cache, logits="last")
        for n in (2, 5, 1, 4):
            block = torch.randint(3, vocab, (1, 5), generator=generator)
            if tentative:
                logits, keep = model.encode_tentatively(block, cache)
                keep(n)
            else:
                logits = model.encode(block[:, :n], cache, logits="all")
            out.append(logits[:, :n])
    return out, cache


@pytest.mark.parametrize("compiled", [False, True])
def test_a_tentative_block_leaves_only_its_kept_tokens_in_the_cache(model, compiled):
    """What a speculative verification relies on: after `keep(n)` the cache is what encoding the block's first n
    tokens alone leaves, and the block's logits over them are theirs (the compiled block writes only the kept
    tokens; the exact path writes all and rolls the ring back)."""
    expected, expected_cache = tentative_blocks(model, tentative=False)
    if compiled:
        compile_ar_step(model, backend="eager")
    block = model.compiled_encoder
    try:
        got, cache = tentative_blocks(model, tentative=True)
    finally:
        remove_compiled_ar_step(model)
    assert block is None or block.failure is None
    assert cache.length == expected_cache.length == 19
    assert torch.equal(cache.slot_positions, expected_cache.slot_positions)
    assert torch.equal(cache.pad_mask, expected_cache.pad_mask)
    for a, b in zip(expected, got, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
    for expected_layer, layer in zip(expected_cache.layers, cache.layers, strict=True):
        read = slice(None) if layer.sliding else slice(0, cache.length)  # a full layer's later slots are never read
        assert (expected_layer.keys[:, :, read] - layer.keys[:, :, read]).abs().max() < 1e-5
        assert (expected_layer.values[:, :, read] - layer.values[:, :, read]).abs().max() < 1e-5


def test_a_one_token_verification_runs_the_compiled_ar_step(model):
    """A speculative round with no draft verifies the last token alone: with compiled passes that is the compiled
    AR step, not the exact eager pass (4.6 against 1.4 ms on the shipped model), and keep(0) / keep(1) leave the
    cache as it was / as encoding the token would."""
    compile_ar_step(model, backend="eager")
    step, calls = model.compiled_ar_step, []
    run = step._run
    step._run = lambda *args: calls.append(len(args)) or run(*args)
    token = torch.tensor([[5]])
    try:
        with torch.no_grad():
            cache, expected_cache = model.new_cache(1, 12), model.new_cache(1, 12)
            for c in (cache, expected_cache):
                model.encode(torch.tensor([[3, 4, 6, 7, 8, 9]]), c, logits="last")
            before = [layer.keys.clone() for layer in cache.layers]
            logits, keep = model.encode_tentatively(token, cache)
            keep(0)
            assert cache.length == 6
            for keys, layer in zip(before, cache.layers, strict=True):  # a full layer's later slots are never read
                read = slice(None) if layer.sliding else slice(0, 6)
                assert torch.equal(keys[:, :, read], layer.keys[:, :, read])
            again, keep = model.encode_tentatively(token, cache)
            keep(1)
            expected = model.encode(token, expected_cache, logits="last")
    finally:
        del step._run
        remove_compiled_ar_step(model)
    assert len(calls) == 3  # the two verifications and the step (a prompt is a block: the compiled block runs it)
    assert torch.equal(logits, expected) and torch.equal(again, expected)
    assert cache.length == expected_cache.length == 7
    for layer, expected_layer in zip(cache.layers, expected_cache.layers, strict=True):
        assert torch.equal(layer.keys, expected_layer.keys) and torch.equal(layer.values, expected_layer.values)


def test_compiled_passes_give_the_argmax_of_their_logits_when_asked(model):
    """`argmax=True` with compiled passes (greedy decoding's passes): the compiled AR step's and the compiled block's
    tokens are `row_argmax` of the logits the same graphs give, for a prompt, an AR step and a tentative block, and
    both caches end the same."""
    compile_ar_step(model, backend="eager")
    step, block, calls = model.compiled_ar_step, model.compiled_encoder, []
    runs = step._run, block._run
    step._run = lambda *args: calls.append("step") or runs[0](*args)
    block._run = lambda *args: calls.append("block") or runs[1](*args)
    prompt, token, draft = torch.tensor([[3, 4, 6, 7, 8, 9]]), torch.tensor([[5]]), torch.tensor([[5, 10, 12]])
    try:
        with torch.no_grad():
            caches = [model.new_cache(1, 16) for _ in range(2)]
            got = [model.encode(prompt, caches[1], logits="last", argmax=True),
                   model.encode(token, caches[1], logits="last", argmax=True)]
            tokens, keep = model.encode_tentatively(draft, caches[1], argmax=True)
            keep(2)
            want = [model.encode(prompt, caches[0], logits="last"), model.encode(token, caches[0], logits="last")]
            logits, keep = model.encode_tentatively(draft, caches[0])
            keep(2)
    finally:
        del step._run, block._run
        remove_compiled_ar_step(model)
    assert calls == ["block", "step", "block"] * 2
    assert all(torch.equal(g, row_argmax(w)) for g, w in zip(got, want)) and torch.equal(tokens, row_argmax(logits))
    assert tokens.shape == (1, 3) and caches[0].length == caches[1].length == 9
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_block_without_logits_runs_the_compiled_block_and_returns_none(model):
    """A prompt or a diffusion canvas committed with logits="none" is a block like any other: the compiled graph of
    "last" writes its keys and values (the one row of logits dropped), and encode returns None as the eager path."""
    ids = torch.tensor([[3, 4, 6, 7, 8, 9, 11]])
    exact_cache, cache = model.new_cache(1, 12), model.new_cache(1, 12)
    calls = []
    compile_ar_step(model, backend="eager")
    block = model.compiled_encoder
    run = block._run
    block._run = lambda *args: calls.append(args[-1]) or run(*args)
    try:
        with torch.no_grad():
            assert model.encode(ids, cache, logits="none") is None
            remove_compiled_ar_step(model)
            assert model.encode(ids, exact_cache, logits="none") is None
    finally:
        remove_compiled_ar_step(model)
    assert calls == [True]  # the graph of "last" (one row of logits), run once
    assert cache.length == exact_cache.length == 7
    for layer, exact_layer in zip(cache.layers, exact_cache.layers, strict=True):
        assert torch.allclose(layer.keys, exact_layer.keys, atol=1e-5)
        assert torch.allclose(layer.values, exact_layer.values, atol=1e-5)


def test_a_compiled_decoder_s_steps_take_the_fused_softmax_and_entropy(folder, monkeypatch):
    """The diffusion engine's sampler step asks for the exact softmax and entropies (the reference's bits) unless
    the model's decoder is compiled, whose logits are not the reference's anyway."""
    from printpress import canvas
    from printpress.fast import compile_decoder, remove_compiled_decoder

    pipe = printpress.load(folder)
    asked = []
    original = canvas.probabilities_and_entropy

    def recorded(processed, free, exact=True):
        asked.append(exact)
        return original(processed, free, exact)

    monkeypatch.setattr(canvas, "probabilities_and_entropy", recorded)
    pipe.generate([5, 6, 7], seed=0, max_new_tokens=8)
    exact_steps = len(asked)
    compile_decoder(pipe.model, backend="eager")
    try:
        pipe.generate([5, 6, 7], seed=0, max_new_tokens=8)
    finally:
        remove_compiled_decoder(pipe.model)
    assert exact_steps > 0 and set(asked[:exact_steps]) == {True} and set(asked[exact_steps:]) == {False}


def test_padded_one_token_and_failing_blocks_run_the_exact_path(model, caplog):
    exact, _ = encoder_blocks(model)
    compile_ar_step(model, backend="eager")
    block = model.compiled_encoder
    ids, cache = torch.ones(2, 4, dtype=torch.long), model.new_cache(2, 8)
    mask = torch.tensor([[False, True, True, True], [True] * 4])
    try:
        with torch.no_grad():
            assert not block.covers(ids, cache, mask, "all")  # padding: the eager path's masks
            assert not block.covers(ids[:, :1], cache, None, "last")  # one token: the AR step's graph
            assert block.covers(ids, cache, None, "none")  # a prompt or a committed canvas: no logits wanted
            assert block.covers(ids, cache, torch.ones_like(mask), "all")
        assert not block.covers(ids, cache, None, "all")  # training: the eager path
        block._graph = lambda *args: (_ for _ in ()).throw(RuntimeError("no compiler here"))
        with caplog.at_level(logging.WARNING, logger="printpress.fast"):
            fallback, _ = encoder_blocks(model)
    finally:
        remove_compiled_ar_step(model)
    assert "no compiler here" in block.failure
    assert all(torch.equal(a, b) for a, b in zip(exact, fallback))  # the exact path, bit for bit


@pytest.mark.slow  # compiles the graphs a server meets
@pytest.mark.parametrize("sliding", [False, True])
def test_warm_up_compiles_what_typical_requests_then_run(folder, sliding):
    """After `Pipeline.warm_up`, requests of other prompt lengths and lengths, one or two prompts, by diffusion
    (whole or sliding canvases), AR and speculative decoding, compile nothing more (dynamo refuses to recompile
    here, which would show as a failed graph); an exact model has nothing to warm up."""
    from printpress.fast import compile_decoder

    pipe = printpress.load(folder)
    assert pipe.warm_up() is False
    compile_ar_step(pipe.model, backend="eager")
    compile_decoder(pipe.model, backend="eager")
    pipe.generation_config.sliding = sliding  # the checkpoint's sampler, which warm_up runs
    assert pipe.warm_up() is True
    vocab = pipe.config.text.vocab_size
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n, new_tokens in ((3, 25), (12, 40)):
            prompts = [[(5 * i + 4) % vocab for i in range(n)], [(3 * i + 1) % vocab for i in range(n + 4)]]
            for batch in (prompts[:1], prompts):
                pipe.generate(batch, seed=1, max_new_tokens=new_tokens, eos_token_ids=[])
                pipe.generate(batch, seed=1, mode="ar", max_new_tokens=new_tokens, eos_token_ids=[])
            for temperature in (0.0, 0.8):
                pipe.generate(prompts, seed=1, mode="speculative", temperature=temperature, max_new_tokens=new_tokens,
                              eos_token_ids=[])
        model = pipe.model
        cache = model.new_cache(1, 30)
        with torch.no_grad():
            model.encode(torch.tensor(prompts[:1]), cache, logits="last")
            for n in (2, 4):  # verification blocks of 2 tokens (their experts gathered) and of more (routed)
                model.encode_tentatively(torch.tensor(prompts[:1])[:, :n], cache)[1](1)
    assert [getattr(model, name).failure for name in ("compiled_ar_step", "compiled_encoder", "compiled_decoder",
                                                      "compiled_fused_pass")] == [None] * 4


# -- the load option -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice, ar, decoder", [(None, False, False), ("ar", True, False), ("decoder", False, True),
                                                 ("all", True, True)])
def test_load_compiles_the_passes_it_is_asked_to(folder, choice, ar, decoder):
    loaded = printpress.load(folder, compile=choice).model
    assert (loaded.compiled_ar_step is not None, loaded.compiled_decoder is not None) == (ar, decoder)
    assert all(graph is None or (graph.model is loaded and graph.backend == "inductor")
               for graph in (loaded.compiled_ar_step, loaded.compiled_decoder))


def test_load_gives_compiled_passes_bf16_weights_only_with_them(folder, tmp_path):
    from printpress.errors import CheckpointError

    loaded = printpress.load(folder, compile="all", compile_weights="bfloat16").model
    assert loaded.compiled_ar_step.weights == loaded.compiled_encoder.weights == "bfloat16"
    assert loaded.compiled_decoder.weights == loaded.compiled_fused_pass.weights == "bfloat16"
    assert printpress.load(folder, compile="decoder", compile_weights="bfloat16").model.compiled_decoder.weights == \
        "bfloat16"
    assert printpress.load(folder, compile="ar").model.compiled_ar_step.weights == "float32"
    with pytest.raises(CheckpointError, match="compile_weights bfloat16 applies to compiled passes: give compile ar, "
                                              "decoder or all too"):
        printpress.load(tmp_path / "no such folder", compile_weights="bfloat16")
    with pytest.raises(CheckpointError, match="compile_weights 'int8' is not supported; use float32 or bfloat16"):
        printpress.load(tmp_path / "no such folder", compile="ar", compile_weights="int8")


def test_load_refuses_an_unknown_compile_choice_before_reading_anything(tmp_path):
    from printpress.errors import CheckpointError

    with pytest.raises(CheckpointError, match="compile 'fast' is not supported; use ar, decoder, all"):
        printpress.load(tmp_path / "no such folder", compile="fast")


# -- few-row linears: the kernel and the pass that puts it into compiled graphs -----------------------------------


@pytest.fixture(scope="module")
def rows_kernel():
    from printpress.fast import rows_linear_ready

    if not rows_linear_ready():
        pytest.skip("no C++ compiler for the kernel on this machine")
    return lambda x, weight: torch.ops.printpress_fast.rows_linear(x, weight, 64)  # the kernel itself, to 64 rows


# Streamed to 4 rows, register tiles from 5; with AVX-512, packed panels from 2 (9 and 31: blocks of 8 and the rest).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 31])
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (3, 7), (4, 8), (5, 9), (17, 33), (64, 192),
                                                       (6, 1031)])  # K sliced by 512 in the tiles
def test_the_rows_kernel_computes_a_linear(rows_kernel, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    exact = (x.double() @ weight.double().T).float()
    got = rows_kernel(x, weight)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # Another summation order than a float64 product: within float32 rounding of the terms' magnitude.
    scale = (x.abs().double() @ weight.abs().double().T).float()
    assert bool(((got - exact).abs() <= 4e-7 * in_features * scale + 1e-30).all())


def test_the_rows_kernel_reads_strided_inputs_and_refuses_other_dtypes_and_shapes(rows_kernel):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, 2, generator=generator).T  # (2, 9), not contiguous
    weight = torch.randn(9, 6, generator=generator).T  # (6, 9), not contiguous
    assert torch.allclose(rows_kernel(x, weight), x @ weight.T, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 only"):
        rows_kernel(x.double(), weight.double())
    with pytest.raises(RuntimeError, match=r"expects x \(M, K\) and weight \(N, K\)"):
        rows_kernel(x, weight[:, :5])


def test_a_packed_copy_follows_its_weight(rows_kernel):
    """From 2 rows on (AVX-512) a product reads a copy of the weight packed in panels: made again when the weight
    changes in place, and a transposed view, which starts at the same address, gets its own."""
    generator = torch.Generator().manual_seed(4)
    x, weight = torch.randn(3, 40, generator=generator), torch.randn(40, 40, generator=generator)
    first = rows_kernel(x, weight)
    weight.mul_(2.0)  # scaling by 2 is exact: the same sums, doubled
    assert torch.equal(rows_kernel(x, weight), 2 * first)
    assert torch.allclose(rows_kernel(x, weight.T), x @ weight, atol=1e-4)
    torch.ops.printpress_fast.forget_weight_copies()
    assert torch.equal(rows_kernel(x, weight), 2 * first)


def test_more_rows_than_the_kernels_limit_go_to_aten_bit_for_bit(rows_kernel):
    generator = torch.Generator().manual_seed(3)
    # K long enough that the kernels' summation order is not MKL's (at 33 the packed panels' can be).
    x, weight = torch.randn(5, 200, generator=generator), torch.randn(17, 200, generator=generator)
    assert torch.equal(torch.ops.printpress_fast.rows_linear(x, weight, 4), torch.nn.functional.linear(x, weight))
    assert not torch.equal(torch.ops.printpress_fast.rows_linear(x, weight, 5), torch.nn.functional.linear(x, weight))


def test_the_pass_takes_products_whose_rows_are_known_only_at_run_time(rows_kernel):
    from torch.fx.experimental.proxy_tensor import make_fx

    from printpress.fast import FewRowLinears

    inputs = (torch.randn(3, 8), torch.randn(5, 8))
    graph_module = make_fx(torch.nn.functional.linear, tracing_mode="symbolic")(*inputs)
    FewRowLinears()(graph_module.graph)
    graph_module.recompile()
    assert torch.ops.printpress_fast.rows_linear.default in targets(graph_module)
    for rows in (2, 9):  # the kernel, then MKL's GEMM
        x = torch.randn(rows, 8)
        assert torch.allclose(graph_module(x, inputs[1]), torch.nn.functional.linear(x, inputs[1]), atol=1e-5)


def test_the_expert_kernel_reads_each_rows_expert_in_place(rows_kernel):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 9, generator=generator)
    stack = torch.randn(4, 6, 9, generator=generator)
    index = torch.tensor([3, 0, 3, 1, 2])
    expected = torch.bmm(stack[index], x[:, :, None]).squeeze(-1)
    assert torch.allclose(torch.ops.printpress_fast.expert_rows(x, stack, index), expected, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"expert 4 is not in \[0, 4\)"):
        torch.ops.printpress_fast.expert_rows(x, stack, torch.tensor([0, 1, 2, 3, 4]))
    with pytest.raises(RuntimeError, match=r"expects x \(R, K\), weight \(E, N, K\) and index \(R,\)"):
        torch.ops.printpress_fast.expert_rows(x, stack, index[:3])


def rounded(tensor: torch.Tensor) -> torch.Tensor:
    """The float64 value of each float32 weight rounded to bfloat16 (what the bf16 kernels multiply by)."""
    return tensor.to(torch.bfloat16).double()


@pytest.mark.parametrize("rows", [1, 2, 4, 7])
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (5, 9), (17, 33), (64, 192), (6, 37)])
def test_the_bf16_kernels_multiply_by_the_weights_rounded_to_bfloat16(rows_kernel, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 10 + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    got = torch.ops.printpress_fast.rows_linear_bf16(x, weight)
    scale = (x.abs().double() @ weight.abs().double().T)
    exact = x.double() @ rounded(weight).T  # the rounded weights, summed exactly
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert bool(((got.double() - exact).abs() <= 4e-7 * in_features * scale + 1e-30).all())
    if in_features >= 9:  # and not the float32 weights' product (bfloat16 keeps 8 bits of mantissa)
        assert (got.double() - x.double() @ weight.double().T).abs().max() > 1e-4 * scale.max()
    stack = torch.randn(3, out_features, in_features, generator=generator)
    index = torch.randint(0, 3, (rows,), generator=generator)
    chosen = torch.ops.printpress_fast.expert_rows_bf16(x, stack, index)
    expected = torch.einsum("rk,rnk->rn", x.double(), rounded(stack)[index])
    assert (chosen.double() - expected).abs().max() <= 4e-7 * in_features * scale.max() + 1e-30


def test_a_bf16_copy_follows_its_weight_and_the_ops_refuse_bad_input(rows_kernel):
    ops = torch.ops.printpress_fast
    generator = torch.Generator().manual_seed(6)
    x, weight = torch.randn(2, 16, generator=generator), torch.randn(8, 16, generator=generator)
    first = ops.rows_linear_bf16(x, weight)
    weight.mul_(2.0)  # in place: the version counter moves, so the copy is made again
    assert torch.equal(ops.rows_linear_bf16(x, weight), 2 * first)
    weight.div_(2.0)
    ops.forget_weight_copies()
    assert torch.equal(ops.rows_linear_bf16(x, weight), first)
    square = torch.randn(16, 16, generator=generator)
    ops.rows_linear_bf16(x, square)  # a transposed view starts at the same address, with other strides
    assert torch.allclose(ops.rows_linear_bf16(x, square.T), x @ square.to(torch.bfloat16).float(), atol=1e-5)
    with pytest.raises(RuntimeError, match="takes float32 x and weight"):
        ops.rows_linear_bf16(x, weight.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"expects x \(M, K\) and weight \(N, K\)"):
        ops.rows_linear_bf16(x, weight[:, :5])
    with pytest.raises(RuntimeError, match=r"expert 3 is not in \[0, 3\)"):
        ops.expert_rows_bf16(x, torch.randn(3, 8, 16), torch.tensor([0, 3]))


@pytest.mark.parametrize("rows, op", [(1, "rows_linear_bf16"), (4, "rows_linear_bf16"), (5, "rows_linear")])
def test_bf16_weights_take_the_products_of_a_few_rows_known_when_compiling(rows_kernel, rows, op):
    from torch.fx.experimental.proxy_tensor import make_fx

    from printpress.fast import FewRowLinears

    graph_module, inputs = traced_linears(rows)
    FewRowLinears("bfloat16")(graph_module.graph)
    assert getattr(torch.ops.printpress_fast, op).default in targets(graph_module)
    symbolic = make_fx(torch.nn.functional.linear, tracing_mode="symbolic")(torch.randn(3, 8), torch.randn(5, 8))
    FewRowLinears("bfloat16")(symbolic.graph)  # rows known only at run time: the float32 weights
    assert torch.ops.printpress_fast.rows_linear.default in targets(symbolic)
    with pytest.raises(ValueError, match="weights must be one of float32, bfloat16, not 'int8'"):
        FewRowLinears("int8")


def test_compile_ar_step_refuses_unknown_weights_before_compiling(model):
    with pytest.raises(ValueError, match="weights must be one of float32, bfloat16, not 'float16'"):
        compile_ar_step(model, weights="float16")
    assert model.compiled_ar_step is None


@pytest.mark.slow  # compiles the step with inductor
def test_a_step_with_bf16_weights_moves_the_logits_by_the_rounding_only(model, rows_kernel):
    batch, _ = padded_prompts(model.config.vocab_size)
    exact, _ = run_steps(model, batch[:1], None, 3)
    compile_ar_step(model, weights="bfloat16", ahead_of_time=False)
    try:
        low, _ = run_steps(model, batch[:1], None, 3)
    finally:
        remove_compiled_ar_step(model)
    differences = [(a - b).abs().max().item() for a, b in zip(exact, low)]
    assert all(1e-5 < d < 0.05 for d in differences), differences  # bfloat16's rounding, and no more


def test_the_pass_reads_the_chosen_experts_in_place(rows_kernel):
    from torch.fx.experimental.proxy_tensor import make_fx

    from printpress.fast import FewRowLinears

    def chosen(rows, stack, index):  # as `static_experts` computes a few tokens' experts
        return torch.bmm(stack[index], rows[:, :, None]).squeeze(-1)

    generator = torch.Generator().manual_seed(2)
    inputs = (torch.randn(4, 8, generator=generator), torch.randn(3, 5, 8, generator=generator),
              torch.tensor([2, 0, 2, 1]))
    graph_module = make_fx(chosen)(*inputs)
    expected = graph_module(*inputs)
    FewRowLinears()(graph_module.graph)
    graph_module.recompile()
    aten = torch.ops.aten
    assert torch.ops.printpress_fast.expert_rows.default in targets(graph_module)
    assert aten.bmm.default not in targets(graph_module) and aten.index.Tensor not in targets(graph_module)
    assert torch.allclose(graph_module(*inputs), expected, atol=1e-5)


def routed_inputs(tokens: int = 7, hidden: int = 12, inner: int = 6, experts: int = 4, seed: int = 4):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    weights = torch.softmax(torch.randn(tokens, 2, generator=generator), dim=-1)
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)])
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=generator) / hidden**0.5
    down = torch.randn(experts, hidden, inner, generator=generator) / inner**0.5
    return x, weights, chosen, gate_up, down


@pytest.mark.parametrize("code, act", [(0, lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
                                       (1, torch.nn.functional.gelu), (2, torch.nn.functional.silu)])
@pytest.mark.parametrize("tokens, max_rows", [(7, 8), (7, 0), (12, 8)])  # experts of 2-9 rows: ours, MKL's, both
def test_the_routed_experts_kernel_runs_each_expert_on_its_own_tokens(rows_kernel, code, act, tokens, max_rows):
    x, weights, chosen, gate_up, down = routed_inputs(tokens)
    expected = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):  # token by token, in float64
        for slot in range(2):
            e = int(chosen[t, slot])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            expected[t] += weights[t, slot].double() * (down[e].double() @ (act(gate) * up))
    got = torch.ops.printpress_fast.routed_experts(x, weights, chosen, gate_up, down, code, max_rows)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, atol=1e-5)


def test_the_routed_experts_kernel_s_gelu_holds_over_the_whole_range(rows_kernel):
    """GELU (tanh form) inside the float32 routed experts, written through exp on AVX-512: each gate value through
    one expert whose gate row copies an input, whose up row reads a constant 1 and whose down product is the
    identity, so the kernel's output is GELU of the inputs itself (17 of them: a vector and a tail)."""
    values = torch.cat([torch.linspace(-60, 60, 16), torch.tensor([-1e4])]).reshape(-1, 1)
    values = torch.cat([values, torch.linspace(-4, 4, 17)[:, None]], dim=0)  # where the curve bends
    inner = 17
    x = torch.cat([values.reshape(-1, inner), torch.ones(2, 1)], dim=1)  # (2, 18): 17 values, then a 1
    gate_up = torch.zeros(1, 2 * inner, inner + 1)
    gate_up[0, :inner, :inner] = torch.eye(inner)
    gate_up[0, inner:, inner] = 1.0
    down = torch.eye(inner + 1, inner)[None]
    got = torch.ops.printpress_fast.routed_experts(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), gate_up,
                                                   down, 0, 8)
    expected = torch.nn.functional.gelu(x[:, :inner].double(), approximate="tanh").float()
    assert torch.allclose(got[:, :inner], expected, atol=1e-6, rtol=1e-6), (got[:, :inner] - expected).abs().max()
    assert torch.equal(got[:, inner], torch.zeros(2))


def test_the_routed_experts_kernel_runs_bf16_and_sums_the_experts_in_float32(rows_kernel):
    x, weights, chosen, gate_up, down = (t.bfloat16() if t.is_floating_point() else t for t in routed_inputs())
    # The dense form on the same bf16 tensors, in float64 from there on: what the kernel computes, up to bf16's
    # rounding of each expert's products and of the result.
    gate, up = torch.matmul(x.double(), gate_up.double().transpose(1, 2)).chunk(2, dim=-1)
    every = torch.matmul(torch.nn.functional.gelu(gate, approximate="tanh") * up, down.double().transpose(1, 2))
    expected = (every[chosen, torch.arange(x.shape[0])[:, None]] * weights.double()[..., None]).sum(dim=1)
    for router_weights in (weights, weights.float()):
        got = torch.ops.printpress_fast.routed_experts(x, router_weights, chosen, gate_up, down, 0, 8)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), expected, atol=0.02, rtol=0.02)


def test_the_routed_experts_kernel_refuses_bad_experts_activations_and_shapes(rows_kernel):
    x, weights, chosen, gate_up, down = routed_inputs()
    op = torch.ops.printpress_fast.routed_experts
    with pytest.raises(RuntimeError, match=r"expert 4 is not in \[0, 4\)"):
        op(x, weights, chosen.clone().fill_(4), gate_up, down, 0, 8)
    with pytest.raises(RuntimeError, match=r"activation 3 is not 0 \(GELU, tanh\), 1 \(GELU\) or 2 \(SiLU\)"):
        op(x, weights, chosen, gate_up, down, 3, 8)
    with pytest.raises(RuntimeError, match=r"expects x \(T, H\), weights and experts \(T, k\)"):
        op(x, weights, chosen, gate_up, down[:, :5], 0, 8)
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        op(x.double(), weights, chosen, gate_up, down, 0, 8)
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        op(x.bfloat16(), weights, chosen, gate_up, down, 0, 8)  # weights of another dtype than x's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_graphs_run_a_canvas_s_experts_through_the_routed_kernel(rows_kernel, monkeypatch, dtype):
    from printpress import fast
    from printpress.model import gelu_tanh, static_experts

    x, weights, chosen, gate_up, down = (t.to(dtype) if t.is_floating_point() else t for t in routed_inputs())
    dense = static_experts(x, weights, chosen, gate_up, down, gelu_tanh)  # eager: every expert on every token
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def experts(x, weights, chosen):
        return static_experts(x, weights, chosen, gate_up, down, gelu_tanh)

    monkeypatch.setattr(fast, "_routed_experts", True)  # as `CompiledGraph._run` sets it
    got = torch.compile(experts, backend=backend, fullgraph=True)(x, weights, chosen)
    assert any("routed_experts" in str(node.target) for node in graphs[0].graph.nodes)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 0.02
    assert torch.allclose(got.float(), dense.float(), atol=tolerance, rtol=tolerance)


def test_compiled_graphs_compute_tanh_from_exp_and_eager_passes_keep_aten_s():
    from printpress.model import gelu_tanh, softcap

    x = torch.linspace(-60, 60, 4001)
    reference_gelu = torch.nn.functional.gelu(x, approximate="tanh")
    assert torch.equal(gelu_tanh(x), reference_gelu)  # the exact path: ATen's kernel
    assert torch.equal(softcap(x.clone(), 30.0), torch.tanh(x / 30.0) * 30.0)
    compiled_gelu = torch.compile(gelu_tanh, backend="eager", fullgraph=True)(x)
    compiled_cap = torch.compile(lambda t: softcap(t, 30.0), backend="eager", fullgraph=True)(x)
    assert not torch.equal(compiled_gelu, reference_gelu)  # the exp form ran
    assert torch.allclose(compiled_gelu, reference_gelu, atol=1e-5, rtol=1e-5)
    assert torch.allclose(compiled_cap, torch.tanh(x / 30.0) * 30.0, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 8, 31, 64, 65])  # streamed, panels (with a rest), past the limit: ATen's
def test_the_capped_kernel_is_the_softcap_of_the_product(rows_kernel, rows):
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 40, generator=generator), torch.randn(70, 40, generator=generator)
    got = torch.ops.printpress_fast.rows_linear_capped(x, weight, 3.0, 64)  # logits up to ~20: the cap bends them
    expected = torch.tanh((x.double() @ weight.double().t()) / 3.0) * 3.0
    assert got.shape == (rows, 70) and torch.allclose(got.double(), expected, atol=2e-5, rtol=0)
    with pytest.raises(RuntimeError, match="takes a positive cap, not 0"):
        torch.ops.printpress_fast.rows_linear_capped(x, weight, 0.0, 64)


@pytest.mark.parametrize("own, weights, rows, capped", [(True, "float32", 1, True), (True, "float32", 8, True),
                                                        (True, "bfloat16", 1, False), (True, "bfloat16", 8, True),
                                                        (False, "float32", 8, False)])
def test_compiled_graphs_make_the_logits_and_their_softcap_in_one_kernel_call(rows_kernel, monkeypatch, model, own,
                                                                                weights, rows, capped):
    """Unless the graph reads the product through bfloat16 copies (a few rows: `FewRowLinears`), or may not use
    printpress's operators."""
    from printpress import fast

    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    monkeypatch.setattr(fast, "_own_operators", own)  # as `CompiledGraph._run` sets them
    monkeypatch.setattr(fast, "_bf16_weights", weights == "bfloat16")
    hidden = torch.randn(1, rows, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    got = torch.compile(lambda h: fast._logits(model, h), backend=backend, fullgraph=True)(hidden)
    assert any("rows_linear_capped" in str(node.target) for node in graphs[0].graph.nodes) == capped
    assert torch.allclose(got, model.logits(hidden), atol=1e-5)


@pytest.fixture(scope="module")
def amx(rows_kernel):
    from printpress.fast import amx_available

    if not amx_available():
        pytest.skip("this CPU has no AMX tiles (amx_bf16) for the kernel")


@pytest.mark.parametrize("rows, out_features, in_features", [(16, 192, 192), (17, 64, 192), (32, 4096, 192),
                                                             (33, 192, 4096), (70, 96, 64)])
def test_the_amx_product_is_that_of_both_factors_rounded_to_bfloat16(amx, rows, out_features, in_features):
    """Row blocks of 32 with a rest (17, 33, 70 rows), blocks of 32 channels and 32 inputs, sums in float32."""
    generator = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, 2 * in_features, generator=generator)[:, ::2]  # strided rows
    weight = torch.randn(out_features, in_features, generator=generator)
    got = torch.ops.printpress_fast.amx_linear(x, weight, 0.0)
    scale = x.abs().double() @ weight.abs().double().T
    assert got.shape == (rows, out_features) and got.dtype == torch.float32 and got.is_contiguous()
    assert bool(((got.double() - rounded(x) @ rounded(weight).T).abs() <= 1e-6 * scale + 1e-30).all())
    assert (got.double() - x.double() @ weight.double().T).abs().max() > 1e-4 * scale.max()  # not float32's product


@pytest.mark.parametrize("rows", [1, 8, 15])
def test_fewer_rows_than_the_tiles_take_go_through_the_float32_kernels(amx, rows):
    """A graph compiled for any block length hands the op a verification's few rows: float32's product, capped."""
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 64, generator=generator), torch.randn(96, 64, generator=generator)
    exact = x.double() @ weight.double().T
    assert torch.allclose(torch.ops.printpress_fast.amx_linear(x, weight, 0.0).double(), exact, atol=1e-5)
    assert torch.allclose(torch.ops.printpress_fast.amx_linear(x, weight, 4.0).double(), 4 * torch.tanh(exact / 4),
                          atol=1e-5)


def test_the_amx_product_takes_a_transposed_weight_caps_and_follows_its_weight(amx):
    ops = torch.ops.printpress_fast
    generator = torch.Generator().manual_seed(3)
    embedding = torch.randn(256, 64, generator=generator)
    probs = torch.softmax(torch.randn(20, 256, generator=generator), dim=-1)
    hidden = torch.randn(20, 64, generator=generator) * 3
    # probabilities @ embedding through its transposed view, then the logits through the embedding itself: two
    # packed copies of one weight, which must not stand in for each other
    soft = ops.amx_linear(probs, embedding.t(), 0.0)
    assert torch.allclose(soft.double(), rounded(probs) @ rounded(embedding), atol=1e-6)
    logits = ops.amx_linear(hidden, embedding, 5.0)
    assert torch.allclose(logits.double(), 5 * torch.tanh(rounded(hidden) @ rounded(embedding).T / 5), atol=2e-5)
    assert torch.equal(ops.amx_linear(probs, embedding.t(), 0.0), soft)
    embedding.mul_(2.0)  # in place: the packed copies are made again
    assert torch.allclose(ops.amx_linear(probs, embedding.t(), 0.0), 2 * soft, atol=1e-6)
    assert ops.amx_linear(hidden[:0], embedding, 0.0).shape == (0, 256)
    with pytest.raises(RuntimeError, match="takes whole multiples of 32 output channels and inputs, not 64 x 48"):
        ops.amx_linear(torch.randn(4, 48), torch.randn(64, 48), 0.0)
    with pytest.raises(RuntimeError, match="takes a cap of 0 \\(none\\) or more, not -1"):
        ops.amx_linear(hidden, embedding, -1.0)
    with pytest.raises(RuntimeError, match="takes float32 x and weight"):
        ops.amx_linear(hidden.double(), embedding, 0.0)


def test_the_routed_experts_through_amx_round_each_product_s_factors(amx):
    """Experts of 32 tokens each (through the tiles) give the float64 sums of bfloat16-rounded factors; the same
    call without AMX is the float32 one."""
    generator = torch.Generator().manual_seed(8)
    tokens, hidden, inner, experts = 64, 64, 96, 4
    x = torch.randn(tokens, hidden, generator=generator)
    chosen = torch.stack([torch.arange(tokens) % experts, (torch.arange(tokens) + 1) % experts], dim=1)
    weights = torch.softmax(torch.randn(tokens, 2, generator=generator), dim=-1)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=generator) / hidden**0.5
    down = torch.randn(experts, hidden, inner, generator=generator) / inner**0.5
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for slot in range(2):
            e = int(chosen[t, slot])
            gate, up = (rounded(gate_up[e]) @ rounded(x[t])).float().chunk(2)
            middle = torch.nn.functional.gelu(gate, approximate="tanh") * up
            expected[t] += weights[t, slot].double() * (rounded(down[e]) @ rounded(middle))
    got = torch.ops.printpress_fast.routed_experts_amx(x, weights, chosen, gate_up, down, 0, 64)
    assert torch.allclose(got.double(), expected, atol=1e-4, rtol=0)
    plain = torch.ops.printpress_fast.routed_experts(x, weights, chosen, gate_up, down, 0, 64)
    assert (got - plain).abs().max() > 1e-4  # the tiles ran, not the float32 kernels


@pytest.mark.parametrize("weights, rows, amx_ops", [("bfloat16", 32, 2), ("bfloat16", 8, 0), ("float32", 32, 0)])
def test_bf16_weights_put_a_canvas_s_products_on_amx_tiles(amx, weights, rows, amx_ops):
    """The pass's linear (16 rows or more known when compiling, or rows known only at run time) and an embedding
    product (probs @ weight, a graph input) become amx_linear under weights="bfloat16"; fewer rows known when
    compiling, or float32 weights, keep the float32 kernels."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from printpress import fast

    def pass_like(x, weight, probs, embedding):
        return torch.nn.functional.linear(x, weight), probs @ embedding

    inputs = (torch.randn(rows, 64), torch.randn(96, 64), torch.randn(rows, 128), torch.randn(128, 64))
    graph_module = make_fx(pass_like)(*inputs)
    with pytest.MonkeyPatch.context() as patch:  # as `CompiledGraph._run` sets them
        patch.setattr(fast, "_bf16_weights", weights == "bfloat16")
        patch.setattr(fast, "_amx", weights == "bfloat16")
        fast.FewRowLinears(weights)(graph_module.graph)
    graph_module.recompile()
    found = [n for n in graph_module.graph.nodes if n.target is torch.ops.printpress_fast.amx_linear.default]
    assert len(found) == amx_ops
    symbolic = make_fx(pass_like, tracing_mode="symbolic")(*inputs)  # rows known at run time: the op decides then
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast, "_bf16_weights", weights == "bfloat16")
        patch.setattr(fast, "_amx", weights == "bfloat16")
        fast.FewRowLinears(weights)(symbolic.graph)
    dynamic = [n for n in symbolic.graph.nodes if n.target is torch.ops.printpress_fast.amx_linear.default]
    assert len(dynamic) == (2 if weights == "bfloat16" else 0)
    linear, soft = graph_module(*inputs)
    factors = [rounded(t) if amx_ops else t.double() for t in inputs]  # the tiles' factors, rounded to bfloat16
    assert torch.allclose(linear.double(), factors[0] @ factors[1].T, atol=1e-4)
    assert torch.allclose(soft.double(), factors[2] @ factors[3], atol=1e-4)


@pytest.mark.slow  # compiles the pass with inductor
def test_a_canvas_pass_with_bf16_weights_moves_the_logits_by_the_rounding_only(amx, tmp_path):
    """A model whose products come in blocks of 32 (hidden 64, MLPs 96 and 32, vocab 128): its compiled canvas-16
    pass with weights="bfloat16" runs on the tiles, so its logits move from the exact pass's by more than a float32
    graph's reordering (under 1e-4: `test_the_decoder_pass_is_one_graph_and_computes_the_exact_paths_logits`) and
    by no more than bfloat16's rounding, first step and self-conditioned."""
    from printpress.fast import compile_decoder, remove_compiled_decoder

    config = dict(TINY_CONFIGS["gqa"], hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_attention_heads=4, head_dim=16, global_head_dim=32)
    make_reference(config, canvas_length=16).save_pretrained(tmp_path)
    model = printpress.load(tmp_path).model
    caches = decoder_caches(model)[:1]  # one row after 13 tokens, its sliding ring wrapped
    generator = torch.Generator().manual_seed(6)
    canvas = torch.randint(3, model.config.vocab_size, (1, 16), generator=generator)
    probs = torch.softmax(torch.randn(1, 16, model.config.vocab_size, generator=generator), dim=-1)
    exact = decoder_passes(model, caches, canvas, probs, None)
    compiled = compile_decoder(model, weights="bfloat16", ahead_of_time=False)
    try:
        passes = decoder_passes(model, caches, canvas, probs, None)
    finally:
        remove_compiled_decoder(model)
    assert compiled.failure is None
    differences = [(a - b).abs().max().item() for pair, pairs in zip(exact, passes) for a, b in zip(pair, pairs)]
    assert all(1e-4 < d < 0.1 for d in differences), differences


def test_amx_linear_needs_amx(rows_kernel):
    from printpress.fast import amx_available

    if amx_available():
        pytest.skip("this CPU has AMX: the refusal is for CPUs without it")
    with pytest.raises(RuntimeError, match="needs a CPU with AMX"):
        torch.ops.printpress_fast.amx_linear(torch.randn(32, 32), torch.randn(32, 32), 0.0)


def joined_attention(q, past_k, past_v, k, v, mask, scale=1.0):
    """ATen's attention over the two key segments joined, (B*T, Hq*D) as `Attention.attend` returns it."""
    b, t, heads, d = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2), attn_mask=mask, scale=scale,
        enable_gqa=True)
    return out.transpose(1, 2).reshape(b * t, heads * d)


# (B, T, Hq, Hkv, P, N, D): a canvas of 32 over a prefix, an AR step, grouped heads, no prefix, a head_dim of 16,
# and one that is not a multiple of 16 (plain loops); lanes of 16 queries with a rest in most.
ATTENTION_SHAPES = [(1, 32, 3, 1, 64, 32, 64), (1, 1, 3, 1, 80, 1, 64), (2, 5, 4, 2, 13, 5, 32), (3, 2, 2, 2, 0, 2, 64),
                    (1, 40, 8, 1, 3, 40, 16), (1, 7, 3, 1, 20, 7, 24)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("masked", [False, True])
def test_the_attention_kernel_computes_aten_s_attention_over_both_segments(rows_kernel, shape, masked):
    b, t, heads, kv_heads, past, new, d = shape
    generator = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(b, t, heads, d, generator=generator)
    past_k, past_v = (torch.randn(b, kv_heads, past, d, generator=generator) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, new, d, generator=generator) for _ in range(2))
    mask = None
    if masked:  # random keys hidden, each query seeing at least one of the block's, and the last keys none sees
        mask = torch.rand(b, 1, t, past + new, generator=generator) < 0.6
        mask[..., past:] |= torch.eye(t, new, dtype=torch.bool)
        mask[..., past + min(t, new):] = False
    for scale in (1.0, 0.125):
        got = torch.ops.printpress_fast.small_attention(q, past_k, past_v, k, v, mask, scale)
        assert got.shape == (b * t, heads * d) and got.is_contiguous()
        assert torch.allclose(got, joined_attention(q, past_k, past_v, k, v, mask, scale), atol=1e-5)


def test_the_attention_kernel_reads_strided_inputs_broadcasts_a_mask_and_gives_a_query_that_sees_nothing_zeros(
        rows_kernel):
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 20, 64, generator=generator).transpose(1, 2)  # (B, T, Hq, D), a view of (B, Hq, T, D)
    past_k = torch.randn(2, 1, 40, 64, generator=generator)[:, :, ::3][:, :, :12]  # rows 3 * D apart
    past_v = torch.randn(2, 1, 12, 64, generator=generator)
    k = torch.randn(2, 1, 20, 128, generator=generator)[..., ::2]  # rows of D not contiguous (copied first)
    v = torch.randn(2, 1, 64, 20, generator=generator).transpose(2, 3)
    mask = torch.rand(1, 1, 1, 32, generator=generator) < 0.5  # one row of keys for every sequence and query
    mask[..., 12] = True
    got = torch.ops.printpress_fast.small_attention(q, past_k, past_v, k, v, mask, 1.0)
    assert torch.allclose(got, joined_attention(q, past_k, past_v, k, v, mask), atol=1e-5)
    blind = torch.ones(2, 1, 20, 32, dtype=torch.bool)
    blind[1, 0, 7] = False  # query 7 of the second sequence sees nothing
    got = torch.ops.printpress_fast.small_attention(q, past_k, past_v, k, v, blind, 1.0).view(2, 20, -1)
    assert torch.equal(got[1, 7], torch.zeros(3 * 64))
    assert torch.allclose(got.view(40, -1)[:20], joined_attention(q, past_k, past_v, k, v, None)[:20], atol=1e-5)


def test_a_hidden_key_s_score_does_not_enter_the_softmax(rows_kernel):
    """A masked key whose score dwarfs the seen ones' (100 x the query): were it the softmax's shift, every seen
    key's exp would underflow to 0."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 3, 32, generator=generator)
    past_k, past_v = torch.randn(1, 1, 6, 32, generator=generator), torch.randn(1, 1, 6, 32, generator=generator)
    k, v = torch.randn(1, 1, 4, 32, generator=generator), torch.randn(1, 1, 4, 32, generator=generator)
    past_k[0, 0, 2] = 100 * q[0, :, 0].mean(0)
    mask = torch.ones(1, 1, 4, 10, dtype=torch.bool)
    mask[..., 2] = False
    got = torch.ops.printpress_fast.small_attention(q, past_k, past_v, k, v, mask, 1.0)
    assert torch.allclose(got, joined_attention(q, past_k, past_v, k, v, mask), atol=1e-5)


def test_the_attention_kernel_refuses_other_dtypes_shapes_and_masks(rows_kernel):
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 1, 4, 16)
    op = torch.ops.printpress_fast.small_attention
    with pytest.raises(RuntimeError, match="float32 on the CPU only"):
        op(q.double(), k, k, k, k, None, 1.0)
    with pytest.raises(RuntimeError, match="with Hq a multiple of Hkv"):
        op(q, torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
           None, 1.0)
    with pytest.raises(RuntimeError, match=r"a mask is bool and broadcasts to \(B, 1, T, P \+ N\) = \(1, 1, 4, 8\)"):
        op(q, k, k, k, k, torch.ones(1, 1, 4, 7, dtype=torch.bool), 1.0)
    with pytest.raises(RuntimeError, match="a mask is bool"):
        op(q, k, k, k, k, torch.zeros(1, 1, 4, 8), 1.0)


@pytest.mark.parametrize("wanted", [True, False])
def test_compiled_graphs_attend_through_the_kernel_where_it_is_wanted(rows_kernel, monkeypatch, model, wanted):
    from printpress import fast

    index = next(i for i, spec in enumerate(model.specs) if not spec.sliding)  # head_dim 16 (the kernel's lanes)
    layer = model.layers[index]
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(6, model.config.hidden_size, generator=generator)
    inputs = layer.attention_inputs(x, (1, 6), model.rope(torch.arange(10, 16)[None])[False])
    past_k, past_v = (torch.randn(1, inputs[1].shape[1], 10, inputs[1].shape[3], generator=generator)
                      for _ in range(2))
    mask = torch.rand(1, 1, 6, 16, generator=generator) < 0.7
    mask[..., 10:] |= torch.eye(6, dtype=torch.bool)
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def attend(q, k, v, past_k, past_v, mask):
        new_keys, new_values = [], []
        out = fast._attend_after(layer, (q, k, v), mask, past_k, past_v, new_keys, new_values, 4)
        return out, new_keys[0], new_values[0]

    monkeypatch.setattr(fast, "_own_operators", wanted)  # as `CompiledGraph._run` sets it
    got, kept_k, kept_v = torch.compile(attend, backend=backend, fullgraph=True)(*inputs, past_k, past_v, mask)
    assert any("small_attention" in str(node.target) for node in graphs[0].graph.nodes) == wanted
    joined = lambda k, v: (torch.cat([past_k, k], 2), torch.cat([past_v, v], 2))  # noqa: E731
    expected = layer.self_attn.attend(*inputs, mask, joined)
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.equal(kept_k, inputs[1][:, :, :4]) and torch.equal(kept_v, inputs[2][:, :, :4])


def traced_linears(rows: int, dtype=torch.float32):
    """An aten graph of F.linear and of a plain matmul (x @ m: no transposed weight), with fake values on its
    nodes, as inductor's passes see it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, weight, m):
        return torch.nn.functional.linear(x, weight), x @ m

    inputs = (torch.randn(rows, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype), torch.randn(8, 3, dtype=dtype))
    return make_fx(f)(*inputs), inputs


def targets(graph_module) -> list:
    return [node.target for node in graph_module.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_the_pass_puts_the_kernel_in_place_of_few_row_products_with_a_transposed_weight(rows_kernel, rows):
    from printpress.fast import FewRowLinears

    graph_module, inputs = traced_linears(rows)
    expected = graph_module(*inputs)
    before = FewRowLinears.replaced
    FewRowLinears()(graph_module.graph)
    graph_module.recompile()
    aten = torch.ops.aten
    assert targets(graph_module) == [torch.ops.printpress_fast.rows_linear.default, aten.mm.default]  # x @ m stays
    assert FewRowLinears.replaced == before + 1
    got = graph_module(*inputs)
    assert torch.allclose(got[0], expected[0], atol=1e-5) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("past_the_limit, dtype", [(True, torch.float32), (False, torch.float64)])
def test_the_pass_leaves_more_rows_and_other_dtypes_to_the_gemm(rows_kernel, past_the_limit, dtype):
    from printpress.fast import PANELS_MAX_ROWS, ROWS_LINEAR_MAX_ROWS, FewRowLinears, rows_linear_max_rows

    limit = rows_linear_max_rows()
    assert limit == (PANELS_MAX_ROWS if torch.ops.printpress_fast.packed_panels() else ROWS_LINEAR_MAX_ROWS)
    graph_module, _ = traced_linears(limit + 1 if past_the_limit else 1, dtype)
    before = targets(graph_module)
    FewRowLinears()(graph_module.graph)
    assert targets(graph_module) == before


@pytest.mark.slow  # compiles the step with inductor
def test_the_compiled_step_runs_the_kernel_and_stays_close_to_the_exact_path(model, rows_kernel):
    from printpress.fast import FewRowLinears

    batch, _ = padded_prompts(model.config.vocab_size)
    exact, _ = run_steps(model, batch[:1], None, 3)
    before = FewRowLinears.replaced
    compile_ar_step(model, ahead_of_time=False)  # (a package already on disk would run no pass)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):  # run the pass, not a cached graph
            fast, _ = run_steps(model, batch[:1], None, 3)
    finally:
        remove_compiled_ar_step(model)
    assert FewRowLinears.replaced > before
    for a, b in zip(exact, fast):
        assert torch.allclose(a, b, atol=1e-4)


def test_a_kernel_that_cannot_be_built_warns_once_and_the_pass_leaves_the_graph(monkeypatch, caplog):
    from torch.utils import cpp_extension

    from printpress import native
    from printpress.fast import FewRowLinears, rows_linear_ready

    def no_compiler(**_):
        raise RuntimeError("Error building extension: no compiler\nthe build log")

    monkeypatch.setattr(native, "_loaded", {})  # as in a fresh process
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="printpress.native"):
        assert not rows_linear_ready()
        assert not rows_linear_ready()  # tried once per process
        graph_module, _ = traced_linears(1)
        before = targets(graph_module)
        FewRowLinears()(graph_module.graph)
    assert targets(graph_module) == before
    assert [record.getMessage() for record in caplog.records] == [
        "the kernel rows_linear.cpp could not be built (RuntimeError: Error building extension: no compiler); "
        "compiled graphs keep MKL's GEMM for their few-row linears"]


def test_the_benchmark_times_mkl_and_the_kernel_at_each_shape_and_row_count(model, rows_kernel):
    bench = bench_module("rows_linear")
    shapes = bench.weight_shapes(model)
    assert tuple(model.embed_tokens.weight.shape) in shapes
    assert tuple(model.layers[0].self_attn.q_proj.weight.shape) in shapes
    rows = bench.ops([(8, 16)], [1, 5], reps=3)
    assert [(row["out"], row["in"], row["rows"]) for row in rows] == [(8, 16, 1), (8, 16, 5)]
    for row in rows:
        assert row["max_relative_difference"] < 1e-5
        assert min(row["mkl_hot_us"], row["kernel_hot_us"], row["mkl_cold_us"], row["kernel_cold_us"]) > 0
    # The MKL side of its AR-step comparison: the shipped step's class on a graph function of its own (compiling is
    # lazy, so this only builds it).
    step = bench.MKLStep(model)
    assert step.graph is not CompiledARStep.graph and step.graph.__name__ == "ar_step_graph_copy"


# -- the Python around a compiled call: cache writes, the parameters' check ---------------------------------------


@pytest.mark.parametrize("kernel", [True, False], ids=["write_rows", "foreach"])
@pytest.mark.parametrize("start, n", [(0, 1), (4, 1), (5, 1), (11, 1), (3, 2), (4, 5), (2, 9), (3, 7), (0, 10)])
def test_writing_every_layer_at_once_stores_what_writing_each_does(model, monkeypatch, kernel, start, n):
    """`KVCache.write_all` (the compiled passes' store) leaves the cache bit for bit as `write` per layer does, the
    ring (5 slots here) wrapped or not and blocks longer than it too, through the kernel's op or without it."""
    from printpress import native
    from printpress.model import native_layers

    if kernel and not native_layers():
        pytest.skip("no C++ compiler for printpress's layers on this machine")
    if not kernel:
        monkeypatch.setattr(native, "loaded", lambda source: False)
    generator = torch.Generator().manual_seed(start * 31 + n)
    caches = [model.new_cache(2, 32) for _ in range(2)]
    assert caches[0].window == 5  # the cases above wrap the ring, fill it whole, and overrun it
    spare = 2  # a block's outputs may hold more tokens than are kept (a verification's)
    blocks = [(torch.randn(layer.keys.shape[:2] + (n + spare, layer.keys.shape[3]), generator=generator),
               torch.randn(layer.values.shape[:2] + (n + spare, layer.values.shape[3]), generator=generator))
              for layer in caches[0].layers]
    for cache in caches:
        cache.advance(start, None) if start else None
    for index, (k, v) in enumerate(blocks):
        caches[0].write(index, k[:, :, :n], v[:, :, :n])
    caches[1].write_all([k for k, _ in blocks], [v for _, v in blocks], n)
    for cache in caches:
        cache.advance(n, None)
    assert torch.equal(caches[0].slot_positions, caches[1].slot_positions)
    assert torch.equal(caches[0].pad_mask, caches[1].pad_mask)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_write_rows_op_copies_any_layout_and_refuses_rows_that_do_not_fit():
    from printpress.model import native_layers

    if not native_layers():
        pytest.skip("no C++ compiler for printpress's layers on this machine")
    target, source = torch.zeros(2, 3, 8, 4), torch.randn(2, 3, 5, 4)
    strided = torch.randn(2, 5, 3, 4).transpose(1, 2)  # rows not contiguous: copied through ATen
    torch.ops.printpress_layers.write_rows([target, target], [source, strided], [1, 6], [2, 0], [3, 2])
    assert torch.equal(target[:, :, 1:4], source[:, :, 2:5]) and torch.equal(target[:, :, 6:8], strided[:, :, 0:2])
    assert not target[:, :, [0, 4, 5]].any()
    with pytest.raises(RuntimeError, match=r"rows 3\.\.6 of a \[2, 3, 5, 4\] block do not fit at 0"):
        torch.ops.printpress_layers.write_rows([target], [source], [0], [3], [3])
    with pytest.raises(RuntimeError, match="as many sources, starts, offsets and counts as targets"):
        torch.ops.printpress_layers.write_rows([target], [source], [0, 1], [0], [1])


def test_the_metadata_signature_moves_with_a_dtype_or_a_shape_only(rows_kernel):
    tensors = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16)]
    signature = torch.ops.printpress_fast.metadata_signature(tensors)
    assert torch.ops.printpress_fast.metadata_signature([torch.ones(3, 4), tensors[1].clone()]) == signature
    assert torch.ops.printpress_fast.metadata_signature([tensors[0].double(), tensors[1]]) != signature
    assert torch.ops.printpress_fast.metadata_signature([torch.zeros(4, 3), tensors[1]]) != signature
    assert torch.ops.printpress_fast.metadata_signature(tensors[:1]) != signature


def test_a_model_changed_between_compiled_steps_runs_the_exact_path(folder, rows_kernel, caplog):
    """After steps that ran through the graph, the parameters' check stands on their signature; a change of dtype
    after them still sends the next step to the exact path."""
    model = printpress.load(folder).model
    step = compile_ar_step(model, backend="eager")
    batch, _ = padded_prompts(model.config.vocab_size)
    run_steps(model, batch, None, steps=2)
    assert step.failure is None and step._signature is not None
    model.to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="printpress.fast"):
        logits, _ = run_steps(model, batch, None, steps=2)
    assert "changed dtype, device or shape" in step.failure
    assert torch.isfinite(logits[-1]).all()


def test_a_kernel_s_library_is_named_by_its_source_s_contents(tmp_path):
    """Two versions of a kernel (another checkout, a worktree) build into folders of their own: a shared one would
    be rebuilt under the other process, which could then load operators of another schema. The headers the
    kernels share count as part of each."""
    from printpress import native

    for path in [*native.KERNELS.glob("*.h"), native.KERNELS / "rows_linear.cpp"]:
        (tmp_path / path.name).write_bytes(path.read_bytes())
    source, header = tmp_path / "rows_linear.cpp", tmp_path / "argmax.h"
    first = native.library_name(source)
    assert first == native.library_name(native.KERNELS / "rows_linear.cpp") and first.startswith("printpress_rows_")
    source.write_bytes(source.read_bytes() + b"// another version\n")
    second = native.library_name(source)
    header.write_bytes(header.read_bytes() + b"// another version\n")
    assert len({first, second, native.library_name(source)}) == 3


def test_a_build_is_announced_and_a_cached_library_is_not(capsys):
    """A kernel compiled on this machine for the first time says so on stderr before the wait (`make setup` builds
    the exact path's kernels with `python -m printpress.prebuild`): `_built` tells a library in torch's cache from one
    that is not, and loading what is loaded says nothing."""
    from printpress import native, prebuild
    from printpress.sampling import draw_kernels

    if not draw_kernels():
        pytest.skip("no C++ compiler for printpress's kernels on this machine")
    assert native._built(native.library_name(native.KERNELS / "draw.cpp"))
    assert not native._built("printpress_never_built_0000000000")
    prebuild.main()  # builds (and says so) whatever this process has not loaded yet
    capsys.readouterr()
    prebuild.main()  # everything loaded now: nothing to say
    assert capsys.readouterr().err == ""
