"""printpress_layers (printpress/kernels/layers.cpp): the exact layers from C++ give the Python layers' bits.

The reference parity tests (test_model.py, test_parity_random.py) run through the C++ layers wherever they can be
built; here both sides of `model.NATIVE_LAYERS` run the same passes and must agree bit for bit: every tiny
architecture, fp32 and bf16, each activation, padded batches, canvases with self-conditioning and one-token AR steps
(the experts' one-row path), and after the model's weights, modules or dtype change under a plan."""

from __future__ import annotations

import itertools
import platform

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_CONFIGS
from torch import nn

import printpress
import printpress.model as model_module
from printpress.checkpoint import save_model
from printpress.config import ModelConfig, TextConfig
from printpress.model import DiffusionGemma, NativePlan, SelfConditioningPlan, native_layers
from printpress.quantize import quantize_model


@pytest.fixture(autouse=True)
def native(monkeypatch):
    """The C++ layers on, with their weights read ahead of each product (the path of a machine where that pays), and
    the process's own choice back afterwards."""
    if not native_layers():
        pytest.skip("no C++ compiler for printpress's layers on this machine")
    monkeypatch.setattr(model_module, "NATIVE_LAYERS", True)
    monkeypatch.setattr(model_module, "_warm_chosen", True)
    ops = torch.ops.printpress_layers
    before = ops.warm_enabled()
    ops.set_warm(True, True)
    yield
    ops.set_warm(*before)


def tiny_model(name: str, dtype: torch.dtype = torch.float32, **overrides) -> DiffusionGemma:
    torch.manual_seed(3)
    model = DiffusionGemma(TextConfig(**dict(TINY_CONFIGS[name], **overrides))).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)  # norms and scales that are not ones, so a misplaced one shows
        for layer in model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
            layer.encoder_layer_scalar.uniform_(0.5, 1.5)
    return model.to(dtype).requires_grad_(False)


def passes(model: DiffusionGemma) -> list[torch.Tensor]:
    """Logits of a left-padded prompt batch, two canvases after it (the second self-conditioned), a few one-token AR
    steps of one row (past the sliding window: the ring wraps), a decoder pass after them, and one after a full
    cache (no free slots: the prefix is copied); then every key and value the caches hold."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :4] = False
    canvas = torch.randint(3, vocab, (2, 8), generator=g)
    with torch.no_grad():
        cache = model.new_cache(2, 40)
        out = [model.encode(ids, cache, attention_mask=mask)]
        out.append(model.denoise(canvas, cache))
        out.append(model.denoise(canvas, cache, self_conditioning_logits=3 * out[-1]))
        row = model.new_cache(1, 40)
        out.append(model.encode(ids[:1, :9], row))
        out += [model.encode(ids[:1, i : i + 1], row, logits="last") for i in range(9, 11)]
        out.append(model.denoise(canvas[:1], row))
        full = model.new_cache(1, 9)
        model.encode(ids[:1, :9], full, logits="none")
        out.append(model.denoise(canvas[:1], full))
    return out + [kv for c in (cache, row, full) for layer in c.layers for kv in (layer.keys, layer.values)]


def both_sides(model: DiffusionGemma, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ops = torch.ops.printpress_layers
    layer_op, layers_op = ops.layer, ops.layers
    one_call = []  # the native side runs a pass's layers in one call (`layers`, with the plans' LayerStack)
    monkeypatch.setattr(ops, "layers", lambda *args: one_call.append(args) or layers_op(*args))
    native_out = passes(model)
    assert all(isinstance(layer._native, NativePlan) for layer in model.layers)  # the C++ layers ran
    assert isinstance(model.self_conditioning._native, SelfConditioningPlan)  # and the self-conditioning
    assert len(one_call) >= 8  # every pass of `passes`
    monkeypatch.setattr(model_module, "NATIVE_LAYERS", False)
    calls = []  # the Python side must not reach the C++ layers (a plan kept from the native side would)
    monkeypatch.setattr(ops, "layer", lambda *args: calls.append(args) or layer_op(*args))
    monkeypatch.setattr(ops, "layers", lambda *args: calls.append(args) or layers_op(*args))
    python_out = passes(model)
    monkeypatch.setattr(ops, "layer", layer_op)
    monkeypatch.setattr(ops, "layers", layers_op)
    monkeypatch.setattr(model_module, "NATIVE_LAYERS", True)
    assert not calls
    return native_out, python_out


def test_a_layer_stack_refuses_a_layer_or_a_pass_it_cannot_run():
    """LayerStack.add takes a layer's weights as `layer` does; `layers` takes one cache and join per layer: the errors
    name what is wrong."""
    model = tiny_model("gqa")
    with torch.no_grad():
        plans = [layer._plan() for layer in model.layers]
    stack = torch.classes.printpress_layers.LayerStack()
    plan = plans[0]
    with pytest.raises(RuntimeError, match="16 after attention per mode, not 6, 15 and 16"):
        stack.add(plan.attention, plan.after_decoder[:-1], plan.after_encoder, plan.head_dim, plan.eps, plan.gqa,
                  plan.scale, plan.top_k, plan.root_size, plan.act, True)
    stack = model_module.layer_stack(plans, model.specs)
    assert stack.size() == len(model.layers)
    cache = model.new_cache(1, 8)
    joins = [cache.encoder_join(i, 1) for i in range(len(model.layers))][:-1]  # one short
    x, rope = torch.randn(1, model.config.hidden_size), model.rope(torch.arange(1))
    with pytest.raises(RuntimeError, match=f"one cache and join per layer \\({len(model.layers)}\\)"):
        torch.ops.printpress_layers.layers(x, stack, True, 1, 1, *rope[True], *rope[False], None, None,
                                           *model_module.join_arguments(joins))


def test_a_block_is_written_into_the_cache_through_atens_copy_only_with_gradients_on():
    """A pass's keys and values go into the cache by memcpy with gradients off (the model's only way); with gradients
    on, through ATen's copy, which autograd sees (the cache tensors' version counters move). The same keys either
    way."""
    model = tiny_model("gqa")
    with torch.no_grad():
        stack = model_module.layer_stack([layer._plan() for layer in model.layers], model.specs)
    x, rope = torch.randn(1, model.config.hidden_size), model.rope(torch.arange(1))

    def written(gradients: bool) -> tuple[list[bool], list[torch.Tensor]]:
        cache = model.new_cache(1, 8)
        joins = [cache.encoder_join(i, 1) for i in range(len(model.layers))]
        before = [j.keys._version for j in joins]
        with torch.set_grad_enabled(gradients):
            torch.ops.printpress_layers.layers(x, stack, True, 1, 1, *rope[True], *rope[False], None, None,
                                               *model_module.join_arguments(joins))
        return [j.keys._version != v for j, v in zip(joins, before)], [j.keys.detach().clone() for j in joins]

    moved_off, keys_off = written(False)
    moved_on, keys_on = written(True)
    assert not any(moved_off) and all(moved_on)
    assert_bit_equal(keys_off, keys_on)


def assert_bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for index, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"pass {index}: largest difference {(x - y).abs().max()}"


# bf16 where ATen's grouped product takes the experts' widths (its rows must be multiples of 16 bytes: not
# default_pattern's 12 bf16 values, in C++ or in Python).
@pytest.mark.parametrize(("name", "dtype"), [(name, torch.float32) for name in TINY_CONFIGS] + [
    (name, torch.bfloat16) for name in TINY_CONFIGS if TINY_CONFIGS[name]["moe_intermediate_size"] % 8 == 0])
def test_the_cpp_layers_give_the_python_layers_bits(name, dtype, monkeypatch):
    assert_bit_equal(*both_sides(tiny_model(name, dtype), monkeypatch))


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_every_activation(activation, monkeypatch):
    assert_bit_equal(*both_sides(tiny_model("gqa", hidden_activation=activation), monkeypatch))


@pytest.mark.parametrize("top_k", [4, 5, 8])
def test_tokens_with_many_experts(top_k, monkeypatch):
    """From four slots a token's experts are summed in two orders, by column (ATen's sum over the slots: one after
    the other for the columns in whole groups of vectors, in four interleaved sequences for the rest); hidden 48
    has both kinds."""
    assert_bit_equal(*both_sides(tiny_model("mha", top_k_experts=top_k), monkeypatch))


def verification(model: DiffusionGemma) -> list[torch.Tensor]:
    """A speculative verification's pass: a block of 6 tokens after a prompt, encoded tentatively, 4 of them kept;
    its logits, then every key and value the cache holds."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=g)
    with torch.no_grad():
        cache = model.new_cache(1, 40)
        model.encode(ids[:, :10], cache, logits="none")
        logits, keep = model.encode_tentatively(ids[:, 10:], cache)
        keep(4)
    return [logits] + [kv for layer in cache.layers for kv in (layer.keys, layer.values)]


@pytest.mark.parametrize("name", ["gqa", "mha", "default_pattern"])
def test_a_few_rows_layers_run_in_buffers_of_their_own_with_the_same_bits(name, monkeypatch):
    """A pass over a few rows of one batch row (an AR step, a verification, a canvas of 8) computes each layer between
    its parts in buffers instead of ATen tensors (`rows_layer`), wherever its norms and gated activation take their
    loops: the Python layers' bits, and `layer`'s (`set_layers_in_buffers(False)`). default_pattern's router has 3 experts: its
    AR steps' products of the router are at::mm's, still in buffers. The experts of more than one row run in buffers
    too, their pairs in a stable order of their own where they are few (gqa's 12 and 16), else in at::sort's
    (default_pattern's 18 and 24)."""
    ops = torch.ops.printpress_layers
    model = tiny_model(name)
    if ops.fused_norm_width() == 0:
        pytest.skip("the one-loop norms do not give ATen's bits on this CPU: no layer runs in buffers")
    inner, expert = model.config.intermediate_size, model.config.moe_intermediate_size
    pairs = [torch.zeros(t * model.config.top_k_experts, 2 * expert) for t in (1, 6, 8)]  # the experts' gate and up
    loops = (ops.fused_slot_sums() and ops.gated_fused(pairs[0][:1, :expert], pairs[0][:1, expert:], 0)
             and all(ops.gated_fused(pair[:, :expert], pair[:, expert:], 0) for pair in pairs[1:])
             and all(ops.gated_fused(torch.zeros(t, inner), torch.zeros(t, inner), 0) for t in (1, 6, 8)))
    before = ops.layers_in_buffers()
    native_out, python_out = both_sides(model, monkeypatch)
    assert_bit_equal(native_out, python_out)
    if loops:  # the two one-token AR steps and the two canvases of 8 of one batch row in `passes`
        assert ops.layers_in_buffers() - before == 4 * model.config.num_hidden_layers
    checked = ops.layers_in_buffers()
    native_verification = verification(model)
    if loops:
        assert ops.layers_in_buffers() - checked == model.config.num_hidden_layers
    monkeypatch.setattr(model_module, "NATIVE_LAYERS", False)
    assert_bit_equal(native_verification, verification(model))
    monkeypatch.setattr(model_module, "NATIVE_LAYERS", True)
    ops.set_experts_in_buffers(False)  # more rows' experts by `experts`, the rest of the layer in buffers
    try:
        assert_bit_equal(native_out, passes(model))
        assert_bit_equal(native_verification, verification(model))
    finally:
        ops.set_experts_in_buffers(True)
    ops.set_attention_in_loops(False)  # ATen's attention, the rest of the layer in buffers
    try:
        assert_bit_equal(native_out, passes(model))
        assert_bit_equal(native_verification, verification(model))
    finally:
        ops.set_attention_in_loops(True)
    ran = ops.layers_in_buffers()
    ops.set_layers_in_buffers(False)
    try:
        layer_out, layer_verification = passes(model), verification(model)
    finally:
        ops.set_layers_in_buffers(True)
    assert ops.layers_in_buffers() == ran
    assert_bit_equal(native_out, layer_out)
    assert_bit_equal(native_verification, layer_verification)


def test_the_attention_loops_give_the_flash_kernels_bits():
    """`attention_loops` (printpress/kernels/aten_attention.h: ATen's CPU flash kernel for float32 without its tensors,
    its products MKL's sgemm calls) against F.scaled_dot_product_attention, bit for bit: 1 to 11 query rows over 1 to
    40 keys (rows of whole vectors of keys, and rows with tails, where the kernel's exps take another form), no mask,
    bool and additive masks, with rows that see no key, grouped-query heads, two batch rows, head sizes 8, 16 and 64,
    and a cache's first slots as the keys. The form checked at load (`attention_form`) is the one that passes; another
    form fails here (the tail's exp in float: 15 of the 720 cases without additive masks in one check)."""
    ops = torch.ops.printpress_layers
    if ops.fused_norm_width() == 0:
        pytest.skip("no ATen vector code on this CPU: ATen's attention runs")
    if ops.attention_form() == 0:
        pytest.skip("no form of the attention's loops gives ATen's bits with this torch: ATen's attention runs")
    g = torch.Generator().manual_seed(5)
    checked = 0
    for d, heads, kv_heads, t, s, b, masked in itertools.product([8, 16, 64], [2, 3], [1, 2], [1, 3, 8, 11],
                                                                 [1, 4, 5, 11, 40], [1, 2], [None, "bool", "float"]):
        if heads % kv_heads:
            continue
        q = torch.randn(b, t, heads, d, generator=g).transpose(1, 2)  # as a pass's buffer of rows is viewed
        k, v = (torch.randn(b, kv_heads, s + 3, d, generator=g)[:, :, :s] for _ in range(2))
        mask = torch.rand(b, 1, t, s, generator=g) < 0.7 if masked else None
        if masked:
            mask[-1, 0, 0] = False  # a row that sees no key: zeros
        if masked == "float":  # additive: any values where a key is seen (the model's are 0), -inf elsewhere
            mask = torch.randn(b, 1, t, s, generator=g).masked_fill(~mask, float("-inf"))
        expected = F.scaled_dot_product_attention(q, k, v, mask, scale=d**-0.5, enable_gqa=heads != kv_heads)
        with torch.no_grad():  # the loops run without gradients only (the model calls them so)
            got = ops.attention_loops(q, k, v, mask, d**-0.5, heads != kv_heads)
        assert torch.equal(got, expected.transpose(1, 2)), (d, heads, kv_heads, t, s, b, masked)
        checked += 1
    assert checked == 1080
    q, k = torch.randn(1, 3, 1, 64), torch.randn(1, 1, 513, 64)
    with torch.no_grad(), pytest.raises(RuntimeError, match="at most 512 keys"):  # ATen splits longer rows: its call
        ops.attention_loops(q, k, k, None, 0.125, True)


def test_the_router_in_loops_leaves_equal_experts_to_atens_top_k(monkeypatch):
    """In buffers the router's softmax and top-k run in loops (ATen's softmax from its vector headers, the form checked
    against at::softmax once per process), where the top experts are unique; where two of them score the same (here
    two experts with the same router weights, in every layer), at::topk orders them, as the Python layers' topk does.
    (torch 2.13's topk puts the lower index first, as the loops' selection would; the loops leave ties to it anyway,
    so that the bits do not hang on that.)"""
    ops = torch.ops.printpress_layers
    model = tiny_model("gqa")
    if ops.fused_norm_width() == 0 or ops.router_form() == 0:
        pytest.skip("the router's loops do not give ATen's bits on this CPU")
    with torch.no_grad():
        for layer in model.layers:
            layer.router.proj.weight[1] = layer.router.proj.weight[0]
    before = ops.layers_in_buffers()
    native_out, python_out = both_sides(model, monkeypatch)
    assert_bit_equal(native_out, python_out)
    assert ops.layers_in_buffers() > before
    native_verification = verification(model)
    monkeypatch.setattr(model_module, "NATIVE_LAYERS", False)
    assert_bit_equal(native_verification, verification(model))


def test_a_plan_follows_its_model_when_weights_modules_or_dtype_change(monkeypatch):
    model = tiny_model("gqa")
    passes(model)  # the plans are made
    first = model.layers[0]._native
    model.to(torch.bfloat16)  # the layer scalars are new buffer tensors now
    assert_bit_equal(*both_sides(model, monkeypatch))
    assert model.layers[0]._native is not first
    model.float()
    layer = model.layers[1]
    replacement = nn.Linear(*reversed(layer.self_attn.o_proj.weight.shape), bias=False)  # made before the plans
    passes(model)
    layer.post_feedforward_layernorm.weight = nn.Parameter(torch.full_like(layer.post_feedforward_layernorm.weight, 2))
    assert_bit_equal(*both_sides(model, monkeypatch))
    passes(model)
    layer.self_attn.o_proj = replacement
    assert_bit_equal(*both_sides(model, monkeypatch))


def test_reading_weights_ahead_changes_no_number():
    model = tiny_model("mha")
    weights = [tensor.clone() for tensor in model.state_dict().values()]
    ops = torch.ops.printpress_layers
    ops.set_warm(False, False)
    cold = passes(model)
    ops.set_warm(True, True)
    assert_bit_equal(cold, passes(model))
    assert_bit_equal(weights, list(model.state_dict().values()))


def test_the_head_read_ahead_in_blocks_gives_the_whole_products_bits(monkeypatch):
    """An embedding larger than the head's blocks (8192 x 32 floats: 1 MiB, blocks of 3072 rows): every pass,
    its last block short, bit-equal with the Python path; the blocks checked against the whole product on the first
    call of each shape, and holding (MKL computes each column alike) where torch has MKL."""
    ops = torch.ops.printpress_layers
    checked, held = ops.head_checks()
    model = tiny_model("gqa", vocab_size=8192)
    assert_bit_equal(*both_sides(model, monkeypatch))
    new_checked, new_held = ops.head_checks()
    assert new_checked > checked
    if torch.backends.mkl.is_available():
        assert new_held - held == new_checked - checked
    assert_bit_equal(*both_sides(model, monkeypatch))  # the shapes known now: through the blocks


def test_whether_to_read_weights_ahead_is_measured_once_on_the_first_model_that_runs_the_cpp_layers(monkeypatch):
    ops = torch.ops.printpress_layers
    monkeypatch.setattr(model_module, "_warm_chosen", False)
    monkeypatch.setattr(model_module, "warm_measurement", None)
    quantized = tiny_model("gqa")
    quantize_model(quantized, kernel=False)  # no C++ layers: nothing chosen
    passes(quantized)
    assert not model_module._warm_chosen and model_module.warm_measurement is None

    model = tiny_model("gqa")
    passes(model)
    measured = model_module.warm_measurement
    few_without, few_with, many_without, many_with = measured
    assert all(0 < seconds < 1 for seconds in measured)
    assert ops.warm_enabled() == (few_with < few_without, many_with < many_without)
    passes(tiny_model("mha"))
    assert model_module.warm_measurement is measured  # once per process

    for forced in (False, True):
        monkeypatch.setattr(model_module, "_warm_chosen", False)
        monkeypatch.setattr(model_module, "warm_measurement", None)
        monkeypatch.setattr(model_module, "WARM_WEIGHTS", forced)
        ops.set_warm(not forced, not forced)
        passes(model)
        assert ops.warm_enabled() == (forced, forced) and model_module.warm_measurement is None
    with pytest.raises(RuntimeError, match="at least one round, not 0"):
        ops.choose_warm([model.layers[0].mlp.up_proj.weight], 0)


def test_layers_the_cpp_operators_do_not_cover_run_in_python():
    """A quantized model's int8 modules, passes that record gradients (training) and weights off the CPU (a GPU's;
    here the meta device's) take the Python methods."""
    model = tiny_model("gqa")
    passes(model)
    quantize_model(model, kernel=False)
    passes(model)
    assert all(layer._native is None for layer in model.layers) and model.self_conditioning._native is None

    model = tiny_model("gqa").requires_grad_(True)
    cache = model.new_cache(1, 16)
    logits = model.encode(torch.randint(3, model.config.vocab_size, (1, 6)), cache)
    assert all(layer._plan() is None for layer in model.layers)
    logits.sum().backward()
    assert model.layers[0].self_attn.q_proj.weight.grad is not None

    model = tiny_model("gqa").to("meta")
    with torch.no_grad():
        assert all(layer._plan() is None for layer in model.layers)


def test_the_one_loop_norm_holds_on_this_cpu_and_gives_atens_bits():
    """The float32 RMS norm in one loop (ATen's summation order, `rms_rows`): its self-check against ATen passes on
    x86 CPUs, where ATen's sums run 8 float lanes (its AVX2 kernel, also on AVX-512 CPUs), and so does the experts'
    weighted sums'; and the norm gives `RMSNorm`'s bits for rows of every length around the lane and level
    boundaries, with and without a weight.
    Inputs it does not take (bf16, a strided view) give ATen's bits through ATen's operators."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert torch.ops.printpress_layers.fused_norm_width() == 8
        assert torch.ops.printpress_layers.fused_slot_sums()  # the experts' weighted sums' own check
    g = torch.Generator().manual_seed(0)
    for n in [1, 5, 8, 9, 31, 32, 33, 64, 192, 1023, 1024, 1025, 4100, 16400]:
        norm = model_module.RMSNorm(n, 1e-6)
        norm.weight.data.uniform_(0.5, 1.5, generator=g)
        x = torch.randn(3, n, generator=g) * torch.logspace(-6, 6, n)
        for weight in (norm.weight, None):
            expected = norm(x) if weight is not None else model_module.rms_normalize(x, 1e-6)
            got = torch.ops.printpress_layers.rms_norm(x, weight, 1e-6)
            assert torch.equal(got, expected), n
    x = torch.randn(4, 6, 64, generator=g)
    norm = model_module.RMSNorm(64, 1e-6)
    for value in (x.bfloat16(), x.transpose(0, 1)):
        assert torch.equal(torch.ops.printpress_layers.rms_norm(value, norm.weight, 1e-6), norm(value))


def test_with_gradients_on_the_operators_inside_dispatch_through_autograd():
    """With gradients off the C++ operators run the ATen operators inside them below autograd's dispatch keys (the
    model calls them only so); with gradients on they dispatch as usual, so a product they hand to at::mm (more rows
    than the kernels take) is recorded and its gradient is at::mm's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 24, generator=g, requires_grad=True)
    weight_t = torch.randn(24, 16, generator=g)
    out = torch.ops.printpress_layers.product(x, weight_t)
    assert out.grad_fn is not None
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(70, 16) @ weight_t.t())
    with torch.no_grad():
        assert torch.equal(torch.ops.printpress_layers.product(x, weight_t), x @ weight_t)


def added_as_the_rows_kernel_adds(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (m, k) times weight (n, k), k a multiple of 4, in the order layers.cpp's `rows_kernel` documents (what MKL's
    product of one to three rows does on an AMD EPYC), each product and each sum a float32 operator of its own: four
    interleaved sums, (sum 0 + sum 2) + (sum 1 + sum 3); for one row, the first four products added in turn first and
    the sums starting at the fifth element, the first carrying on from them."""
    m, k = x.shape
    lead = 4 if m == 1 else 0
    sums = torch.zeros(m, weight.shape[0], 4)
    if lead:
        first = x[0, 0] * weight[:, 0]
        for i in (1, 2, 3):
            first = first + x[0, i] * weight[:, i]
        sums[0, :, 0] = first
    for i in range(lead, k, 4):
        sums = sums + x[:, None, i : i + 4] * weight[None, :, i : i + 4]
    return (sums[..., 0] + sums[..., 2]) + (sums[..., 1] + sums[..., 3])


@pytest.mark.parametrize("rows,cols", [(1, 384), (1, 192), (8, 384), (32, 384), (64, 192), (3, 37), (5, 48), (2, 1)])
@pytest.mark.parametrize("layout", ["contiguous", "halves", "three_dims"])
def test_the_gated_activation_in_one_loop_gives_atens_bits(rows, cols, layout):
    """act(gate) * up in one loop (`gated`, GELU's tanh form): on CPUs where ATen runs its AVX2 or AVX-512 kernels
    the loop's self-check holds, and it gives at::gelu(gate, "tanh") * up's bits, for the MLPs' separate products
    (contiguous; the self-conditioning MLP's in three dimensions) and the experts' halves of one product, with runs
    that end in whole pairs of vectors and runs with a scalar tail. Another activation runs as the operators."""
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    both = torch.randn(rows, 2 * cols, generator=g) * 4.0
    gate, up = both[:, :cols], both[:, cols:]
    if layout != "halves":
        gate, up = gate.contiguous(), up.contiguous()
    ops = torch.ops.printpress_layers
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert ops.gated_fused(gate, up, 0)
    if layout == "three_dims":
        gate, up = gate[None], up[None]
    assert torch.equal(ops.gated(gate, up, 0), F.gelu(gate, approximate="tanh") * up)
    assert not ops.gated_fused(gate, up, 2)
    assert torch.equal(ops.gated(gate, up, 2), F.silu(gate) * up)


def mixed_numbers(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random numbers of magnitudes 2^-6 to 2^6, both signs, with exact zeros of both signs among them."""
    values = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-6, 7, shape, generator=g)
    zeros = torch.rand(shape, generator=g)
    values[zeros < 0.05] = 0.0
    values[zeros > 0.95] = -0.0
    return values


ROWS_KERNEL = platform.machine() in ("x86_64", "AMD64")  # layers.cpp builds it where the compiler has SSE2


@pytest.mark.skipif(not ROWS_KERNEL, reason="the rows kernel is built for x86 CPUs only")
def test_the_rows_kernel_adds_in_its_documented_order():
    """The kernel itself (whether or not MKL adds that way on this CPU): bit for bit the order written in layers.cpp,
    for one, two and three rows, inner sizes from 4 to 768 and widths around its blocks of 8 weight rows; the last
    n % 4 outputs are at::mm's of those weight rows alone."""
    g = torch.Generator().manual_seed(11)
    for m in (1, 2, 3):
        for k in (4, 8, 12, 64, 192, 384, 768):
            for n in (1, 3, 4, 5, 8, 12, 13, 64, 100):
                x, weight = mixed_numbers((m, k), g), mixed_numbers((n, k), g)
                got = torch.ops.printpress_layers.rows_kernel_product(x, weight)
                whole = n // 4 * 4
                assert torch.equal(got[:, :whole], added_as_the_rows_kernel_adds(x, weight[:whole])), (m, k, n)
                assert torch.equal(got[:, whole:], x @ weight[whole:].t()), (m, k, n)
    with pytest.raises(RuntimeError, match="k a multiple"):
        torch.ops.printpress_layers.rows_kernel_product(torch.ones(1, 6), torch.ones(3, 6))


def test_products_of_a_few_rows_give_atens_bits_and_use_the_kernel_where_its_order_holds():
    """A product of one to three rows gives at::mm's bits (F.linear's) whatever its shape: through the kernel where
    its order was checked to be MKL's on this machine (each inner size, row count and number of outputs mod 4 checked
    once, against at::mm, and found to hold exactly where the documented order is MKL's), through at::mm elsewhere:
    two or three rows with n % 4 == 1 outputs (MKL adds their last output in yet another order) or not starting on
    16 bytes, an inner size not a multiple of 4, a weight that does not start on 16 bytes, two threads. And an AR step
    of a model runs its products through that check."""
    ops = torch.ops.printpress_layers
    g = torch.Generator().manual_seed(12)
    for m in (1, 2, 3):
        for k, n in [(192, 1024), (384, 192), (96, 21), (96, 22), (8, 3), (20, 5), (20, 9), (30, 16), (6, 4)]:
            x, weight = mixed_numbers((m, k), g), mixed_numbers((n, k), g)
            assert torch.equal(ops.rows_product(x, weight.t()), torch.nn.functional.linear(x, weight)), (m, k, n)
    storage = mixed_numbers((1 + 64 * 192,), g)
    shifted = storage[1:].view(64, 192)  # starts 4 bytes past an allocation: MKL reads it in another order
    for m in (1, 2):
        x = mixed_numbers((m, 192), g)
        assert torch.equal(ops.rows_product(x, shifted.t()), torch.nn.functional.linear(x, shifted))
    weight = mixed_numbers((64, 192), g)
    for m in (1, 2, 3):  # rows that start 4 bytes in: MKL adds two or three of them in another order too
        x = mixed_numbers((1 + m * 192,), g)[1:].view(m, 192)
        assert torch.equal(ops.rows_product(x, weight.t()), torch.nn.functional.linear(x, weight)), m
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weight = mixed_numbers((4096, 64), g)
        for m in (1, 3):
            x = mixed_numbers((m, 64), g)
            assert torch.equal(ops.rows_product(x, weight.t()), torch.nn.functional.linear(x, weight))
    finally:
        torch.set_num_threads(threads)
    checked, held = ops.rows_kernel_checks()
    probes = [mixed_numbers((m, k), g) for m in (1, 2, 3) for k in (192, 384, 96, 8, 20, 64)]
    weights = {k: mixed_numbers((40, k), g) for k in (192, 384, 96, 8, 20, 64)}
    mkl_adds_so = all(torch.equal(x @ weights[x.shape[1]].t(), added_as_the_rows_kernel_adds(x, weights[x.shape[1]]))
                      for x in probes)
    assert checked >= 20
    if mkl_adds_so:  # as on an AMD EPYC: all but the two- and three-row products with n % 4 == 1 hold
        assert 0 < held < checked
    else:
        assert held == 0

    # an AR step of a model whose hidden size no product has had yet: its products (q's, the head's) ask for the check
    hidden = next(h for h in range(44, 400, 4) if ops.rows_kernel_verdict(h, 1, 0) == -1)
    model = tiny_model("gqa", hidden_size=hidden)
    with torch.no_grad():
        cache = model.new_cache(1, 8)
        model.encode(torch.tensor([[3, 4, 5]]), cache, logits="none")
        model.encode(torch.tensor([[6]]), cache, logits="last")
    assert ops.rows_kernel_verdict(hidden, 1, 0) == (1 if mkl_adds_so else 0)

    ops.set_rows_kernel(False)  # the switch the benchmarks' A/B uses: every product at::mm's, nothing checked
    try:
        x, weight = mixed_numbers((1, 52), g), mixed_numbers((40, 52), g)
        checked = ops.rows_kernel_checks()[0]
        assert torch.equal(ops.rows_product(x, weight.t()), torch.nn.functional.linear(x, weight))
        assert ops.rows_kernel_checks()[0] == checked
    finally:
        ops.set_rows_kernel(True)


def half_valued(model: DiffusionGemma, dtype: torch.dtype) -> DiffusionGemma:
    """`model` with every weight rounded to `dtype` and kept in float32: what loading a checkpoint stored in float16
    (the shipped model's) or bfloat16 (the released ones') as float32 gives."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(dtype).float())
            if dtype == torch.bfloat16 and param.dim() > 1:
                param.view(-1)[0] = 2.0**-30  # a bfloat16 that no float16 holds: the copies are bfloat16 ones
    return model


HALF_WIDTH = pytest.mark.skipif(not ROWS_KERNEL, reason="the half-width kernels are built for x86 CPUs only")


@HALF_WIDTH
def test_the_kernels_read_a_half_width_copy_in_the_same_order():
    """From a float16 or bfloat16 copy of a weight (its values widened exactly), the one-to-three-row kernel gives the
    bits it gives from the float32 weight, and so the documented order, for inner sizes from 4 to 768 and widths
    around its blocks of 16 outputs and their groups of 4 (a last group of 1 to 3 blocks; a 1000 x 768 weight in
    several pieces, each read ahead where the process reads weights ahead)."""
    ops = torch.ops.printpress_layers
    if not ops.half_width_kernels():
        pytest.skip("no AVX-512 and no AVX2 with F16C on this CPU: no half-width copies are made")
    g = torch.Generator().manual_seed(21)
    for m in (1, 2, 3):
        for k in (4, 8, 64, 192, 384, 768):
            for n in (1, 3, 4, 5, 12, 16, 17, 20, 33, 64, 100, 200) + ((1000,) if k == 768 else ()):
                x = mixed_numbers((m, k), g)
                for dtype in (torch.float16, torch.bfloat16):
                    weight = mixed_numbers((n, k), g).to(dtype)
                    got = ops.rows_kernel_product(x, weight)
                    assert torch.equal(got, ops.rows_kernel_product(x, weight.float())), (m, k, n, dtype)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        ops.rows_kernel_product(torch.ones(1, 8), torch.ones(3, 8, dtype=torch.float64))


@HALF_WIDTH
@pytest.mark.parametrize("threads", [1, 2])
def test_products_of_four_or_more_rows_from_half_valued_weights_give_atens_bits(threads):
    """4 to 64 rows times a weight whose values are float16s (or bfloat16s), handed over transposed (a linear's) or
    stored as it is multiplied (an embedding's), give at::mm's bits: through the kernel of MKL's order where its check
    holds (inner sizes in one run, two halves and runs of 192), through at::mm where it does not or the weight's values
    do not fit half width; a weight's copy is made once per layout."""
    ops = torch.ops.printpress_layers
    if not ops.half_width_kernels():
        pytest.skip("no AVX-512 and no AVX2 with F16C on this CPU: no half-width copies are made")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(22 + threads)
        keep = []  # the weights live through the test, so their copies stay counted
        rows = [4, 5, 6, 7, 8, 9, 12, 16, 33, 64]
        for dtype in (torch.float16, torch.bfloat16):
            for k, n in [(192, 16), (192, 29), (384, 192), (96, 100), (20, 17), (18, 16), (500, 64), (768, 40),
                         (768, 1000)]:
                weight = mixed_numbers((n, k), g).to(dtype).float()
                weight[0, 0] = 2.0**-30 if dtype == torch.bfloat16 else weight[0, 0]  # (no float16 holds it)
                stored = weight.t().contiguous()  # (k, n): an embedding's layout
                keep += [weight, stored]
                ops.allow_half_width([weight, stored])  # (as printpress.load marks an inference model's weights)
                for m in rows:
                    x = mixed_numbers((m, k), g)
                    got = ops.rows_product(x, weight.t())
                    assert torch.equal(got, torch.nn.functional.linear(x, weight)), (m, k, n)
                    assert torch.equal(ops.product(x, stored), x @ stored), (m, k, n)
        verdicts = {(k, m, n % 4, plain): ops.few_rows_verdict(k, m, n % 4, plain)
                    for k, n in [(192, 16), (192, 29), (500, 64)] for m in rows for plain in (False, True)}
        assert -1 not in verdicts.values()  # every shape asked for the check
        ops.rows_product(mixed_numbers((1, 192), g), keep[0].t())  # (the one-row check, as the probe below)
        if ops.rows_kernel_verdict(192, 1, 0) == 1:  # MKL adds as on an AMD EPYC: so do its products of 4 or more
            # rows in either layout, except, on more than one thread, of 5-7 and 9-11 rows the rows after the first
            # four or eight: their last outputs where the outputs are not in whole groups of 4, and all of them where
            # the weight is stored as multiplied
            split = {key: threads > 1 and key[1] % 4 != 0 and key[1] < 12 for key in verdicts}
            assert verdicts == {key: int(not split[key] or (key[2] == 0 and not key[3])) for key in verdicts}
        fp16, bf16, neither = ops.half_width_copies()
        assert fp16 >= 14 and bf16 >= 14
        weight = mixed_numbers((32, 64), g)  # float32 values that do not fit: at::mm, remembered as not fitting
        ops.allow_half_width([weight])
        x = mixed_numbers((5, 64), g)
        assert torch.equal(ops.rows_product(x, weight.t()), torch.nn.functional.linear(x, weight))
        assert ops.half_width_copies()[2] == neither + 1
    finally:
        torch.set_num_threads(before)


@HALF_WIDTH
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_valued_model_reads_its_weights_at_half_width_with_the_same_bits(dtype, monkeypatch):
    """A model whose weights are float16s (or bfloat16s) in float32: the C++ layers read half-width copies for their
    products of up to 8 rows and give the Python layers' bits; after a weight changes in place (an optimizer's step)
    they give the new weights' bits, not the old copy's; with the copies off, the same bits again."""
    ops = torch.ops.printpress_layers
    if not ops.half_width_kernels():
        pytest.skip("no AVX-512 and no AVX2 with F16C on this CPU: no half-width copies are made")
    model = half_valued(tiny_model("gqa"), dtype)
    assert model_module.allow_half_width(model)
    before = ops.half_width_copies()
    assert_bit_equal(*both_sides(model, monkeypatch))
    after = ops.half_width_copies()
    assert after[0 if dtype == torch.float16 else 1] > before[0 if dtype == torch.float16 else 1]
    with torch.no_grad():  # new values, in place: every copy of this weight is stale now
        for layer in model.layers:
            layer.self_attn.q_proj.weight.copy_(layer.self_attn.q_proj.weight.flip(0))
            layer.mlp.down_proj.weight.mul_(2.0)
    assert_bit_equal(*both_sides(model, monkeypatch))
    made = ops.half_width_copies_made()
    passes(model)  # one-row and many-row passes alternate: each reads the copies made before, none made again
    assert ops.half_width_copies_made() == made
    ops.set_half_width(False)
    try:
        native_out = passes(model)
    finally:
        ops.set_half_width(True)
    assert_bit_equal(native_out, passes(model))


@HALF_WIDTH
def test_only_a_model_marked_for_inference_reads_half_width_copies(tmp_path, monkeypatch):
    """A model not marked (one being trained: its weights may change through `.data` or an FSDP all-gather, which the
    copies could not notice) makes no copy and keeps at::mm's products, even after its weights change behind the
    version counter; `printpress.load` marks the model it loads."""
    ops = torch.ops.printpress_layers
    if not ops.half_width_kernels():
        pytest.skip("no AVX-512 and no AVX2 with F16C on this CPU: no half-width copies are made")
    model = half_valued(tiny_model("gqa"), torch.float16)
    before = ops.half_width_copies()
    assert_bit_equal(*both_sides(model, monkeypatch))
    assert ops.half_width_copies() == before  # not marked: no copies
    for layer in model.layers:  # behind the version counter: what a marked model's copies would not see
        layer.self_attn.q_proj.weight.data.mul_(2.0)
    assert_bit_equal(*both_sides(model, monkeypatch))

    saved = save_model(model, ModelConfig(model.config, canvas_length=8), tmp_path / "m", dtype=torch.float16)
    loaded = printpress.load(saved).model
    with torch.no_grad():
        cache = loaded.new_cache(1, 8)
        loaded.encode(torch.tensor([[3, 4, 5]]), cache, logits="none")
    assert ops.half_width_copies()[0] > before[0]


def test_a_copied_model_makes_its_own_layer_stack_and_computes_the_same():
    """A model's LayerStack (a C++ object) stays with its process and model: copy.deepcopy and pickle give a model
    without it, which makes its own on its first pass and computes the original's bits."""
    import copy
    import pickle

    model = tiny_model("gqa")
    first = passes(model)
    stack = model._stack_memo.value[1]
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin._stack_memo.value is None
        assert_bit_equal(passes(twin), first)
        assert twin._stack_memo.value[1] is not stack
