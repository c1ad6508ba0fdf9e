"""Opt-in compiled AR step and decoder pass: one `torch.compile` graph each. Faster; NOT bit-exact to the reference.

The decoder pass (`compile_decoder`) follows the same recipe as the AR step below: the cache is read as the eager
`denoise` reads it (oldest first, with its validity masks), a canvas's experts run each on its own tokens in one
opaque operator of printpress's own (`printpress_fast::routed_experts`; without a compiler for it, every expert on
every token, then the router's choice), and the rest of the pass is one graph; it covers every decoder pass of a
model (diffusion steps, speculative drafts, edits), for any cache length and batch. Inside the graphs tanh (the
logits' softcap, GELU) is computed from exp, 3x cheaper on CPU (`printpress.model.gelu_tanh`, `softcap`), and
where the kernel has its AVX-512 code the attentions run through another of its operators
(`printpress_fast::small_attention`: the cached keys and the block's read in place, not joined first).

The exact engine runs an AR step as ~700 small eager kernels, each paying dispatch cost (docs/benchmarks.md,
"Roofline"). Here one step (1 token per row after the cache, `logits="last"`) is a single graph, the way gpt-fast
runs a decode step: static shapes, the cache read whole under a mask (no chronological reordering of the
sliding ring), the experts gathered per token instead of grouped by a sort. Inductor then fuses the norms, RoPE
and the elementwise work around the GEMMs.

What it costs: fused kernels sum in another order and the ring is attended in slot order, so logits differ
from the exact path in the last bits (~1e-6 on the shipped model). Greedy decoding then usually, but not
always, picks the same tokens, and sampled decoding draws from (numerically) the same distribution but not
the reference's stream. The exact path stays the default; this one is enabled per model:

    import printpress
    from printpress.fast import compile_ar_step

    pipe = printpress.load()
    compile_ar_step(pipe.model)            # AR steps of this model now run compiled (the first call compiles)
    pipe.generate("ROMEO:", mode="ar", temperature=0)

Where it can, each graph is also compiled ahead of time and called without dynamo (`printpress.aot`: one package per
variant of one row, kept on disk). `compile_ar_step(model, weights="bfloat16")` has an AR step's products read
bfloat16 copies of the weights (`FewRowLinears`): faster again, and no longer the float32 model's numbers.

Anything the graph does not cover (several tokens at once, padding masks in the new block, `logits` other than
"last") runs the exact eager path. If compiling or running the graph fails (no compiler, an unsupported op), a
warning is logged once and every later step runs the exact eager path: the caller sees no error.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from printpress import native
from printpress.cache import KVCache

# printpress.model imports this module (for the type of `DiffusionGemma.compiled_ar_step`), so the model is typed
# here as the nn.Module it is, not imported: the package keeps no import cycle (tests/test_imports.py).
DiffusionGemma = nn.Module

logger = logging.getLogger(__name__)


def ar_step_graph(
    model: DiffusionGemma,
    ids: torch.Tensor,
    position: torch.Tensor,
    offsets: torch.Tensor,
    pad_mask: torch.Tensor,
    slot_positions: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One AR step as a pure function of tensors (what `torch.compile` captures): the next-token logits (B, 1, V)
    and each layer's new key and value, which the caller writes into the cache. The inputs are
    `_causal_block`'s, with `ids` (B, 1). A function of its own rather than `encoder_block_graph(..., last=True)`:
    dynamo keeps graphs and guards per function, so an AR step's call checks only the step's few variants, not
    every block length and logits mode as well."""
    hidden, new_keys, new_values = _causal_block(model, ids, position, offsets, pad_mask, slot_positions, keys, values)
    return _logits(model, hidden), new_keys, new_values


def _causal_block(model: DiffusionGemma, ids: torch.Tensor, position: torch.Tensor, offsets: torch.Tensor,
                  pad_mask: torch.Tensor, slot_positions: torch.Tensor, keys: list[torch.Tensor],
                  values: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """An encoder pass over the block `ids` (B, T) after the cache, read as the cache holds it: the final hidden
    states (B, T, H) and each layer's new keys and values (B, H_kv, T, D), which the caller writes into the cache.

    `position` (0-d) is the cache slot of the block's first token (the cache length); `offsets` (B,) each row's left
    pads; `pad_mask` (B, L) which cached slots hold real tokens; `slot_positions` (W,) the position each
    sliding-ring slot holds (-1: empty); `keys`/`values` the cache's own tensors per layer (full: (B, H_kv, L, D),
    sliding: the ring (B, H_kv, W, D)), read only, whole: the masks (`_block_masks`) hide empty, padded, future
    and too distant slots, so nothing is gathered or reordered before the call."""
    b, t = ids.shape
    x = model.embed(ids).reshape(b * t, -1)
    ropes = model.rope(position + torch.arange(t, device=ids.device)[None, :] - offsets[:, None])
    full_mask, sliding_mask = _block_masks(position, t, pad_mask, slot_positions, model.config.sliding_window)
    new_keys, new_values = [], []
    for index, (layer, spec) in enumerate(zip(model.layers, model.specs)):
        # The block's keys go after every cached slot.
        attended = _attend_after(layer, layer.attention_inputs(x, (b, t), ropes[spec.sliding]),
                                 sliding_mask if spec.sliding else full_mask, keys[index], values[index], new_keys,
                                 new_values)
        x = layer.after_attention(x, attended, (b, t), True)
    return model.norm(x).view(b, t, -1), new_keys, new_values


def _attend_after(layer, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                  past_k: torch.Tensor, past_v: torch.Tensor, new_keys: list | None = None,
                  new_values: list | None = None, stored: int | None = None) -> torch.Tensor:
    """`Attention.attend` of a block's queries over the keys and values `past_k` / `past_v` (B, H_kv, S, D) and then
    the block's own (`inputs`: `Layer.attention_inputs`), (B*T, heads*D). The block's keys and values are also kept
    in `new_keys` / `new_values` when given, for the caller to write into the cache (only the first `stored` rows,
    when given: a fused pass's canvas rows follow its block and are never stored). Inside a graph that may
    (`small_attention_wanted`), printpress's kernel reads both segments in place instead of ATen's attention over
    the two joined."""
    q, k, v = inputs
    if new_keys is not None:
        new_keys.append(k[:, :, :stored])
        new_values.append(v[:, :, :stored])
    attention = layer.self_attn
    if small_attention_wanted(mask, q, past_k, past_v, k, v):
        return torch.ops.printpress_fast.small_attention(q, past_k, past_v, k, v, mask, attention.scale)
    return attention.attend(q, k, v, mask, lambda k, v: (torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)))


def _block_masks(position: torch.Tensor, t: int, pad_mask: torch.Tensor, slot_positions: torch.Tensor, window: int):
    """(B, 1, T, S + T) masks of a block of T queries at positions `position` + 0..T-1 over the cache's slots (S:
    the full layers' L, the ring's W) and then the block's own keys (causal).

    Full layers: slots before `position` holding real tokens. Sliding layers: ring slots holding a real token less
    than `window` positions before the query (the ring keeps the window before the block's first token; a later
    query of a long block sees less of it), and the block's keys within the window too."""
    device = pad_mask.device
    queries = position + torch.arange(t, device=device)  # (T,)
    block = torch.arange(t, device=device)
    causal = block[None, :] <= block[:, None]  # (T, T)
    before = pad_mask & (torch.arange(pad_mask.shape[1], device=device) < position)  # (B, L)
    full = torch.cat([before[:, None, :].expand(-1, t, -1), causal[None].expand(pad_mask.shape[0], -1, -1)], dim=2)
    filled = (slot_positions >= 0) & pad_mask[:, slot_positions.clamp(min=0)]  # (B, W)
    near = queries[:, None] - slot_positions[None, :] < window  # (T, W)
    ring = filled[:, None, :] & near[None]
    own = causal & (block[:, None] - block[None, :] < window)
    sliding = torch.cat([ring, own[None].expand(pad_mask.shape[0], -1, -1)], dim=2)
    return full[:, None], sliding[:, None]


def _cache_inputs(cache: KVCache) -> tuple:
    """What `_causal_block` reads of a cache, marked dynamic in every size that changes between requests (the
    cache's length, and the ring's for a short one): the graphs compile once for any. A cache's tensors are marked
    once (the marks stay on them; a cache that replaces its tensors, dropping rows, gets new ones marked)."""
    if not getattr(cache.pad_mask, "_printpress_marked_dynamic", False):
        torch._dynamo.maybe_mark_dynamic(cache.pad_mask, 1)
        torch._dynamo.maybe_mark_dynamic(cache.slot_positions, 0)
        for layer in cache.layers:
            torch._dynamo.maybe_mark_dynamic(layer.keys, 2)
            torch._dynamo.maybe_mark_dynamic(layer.values, 2)
        cache.pad_mask._printpress_marked_dynamic = True
    return (torch.tensor(cache.length, device=cache.device), cache.offsets, cache.pad_mask, cache.slot_positions,
            [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])


def _causal_block_sizes(model: DiffusionGemma, tensors: tuple) -> tuple | None:
    """`_causal_block`'s inputs' sizes that vary between calls (for `CompiledGraph.dynamic_sizes`): the cache's
    length and the ring's, and the block's length from 3 tokens on (a step and a block of 2 are variants of their
    own: their products and experts are chosen for so few rows). One row only: batches (the server's) leave
    dynamo's entry a smaller share of a call, and the graph specialises on the batch size anyway."""
    ids = tensors[0]
    if ids.shape[0] != 1:
        return None
    layers = _cached_lengths(model)
    return {1: "block"} if ids.shape[1] >= 3 else {}, {}, {}, {1: "length"}, {0: "window"}, layers, layers


def _cached_lengths(model: DiffusionGemma) -> list[dict]:
    """Each layer's cached keys' (or values') dynamic size: the full layers' length, the sliding ones' window."""
    return [{2: "window" if spec.sliding else "length"} for spec in model.specs]


def _unaliased(ids: torch.Tensor) -> torch.Tensor:
    """The token ids as a tensor of their own with row-major strides (a copy of a few ints): dynamo guards a view's
    base and its strides, so a graph first called with a view (speculative's `torch.cat(...)[None]`, a slice of a
    longer row) would otherwise compile again for ids that are not one, or that view a base of another shape."""
    return ids.clone(memory_format=torch.contiguous_format)


def _store(cache: KVCache, new_keys: list[torch.Tensor], new_values: list[torch.Tensor], n: int | None = None) -> None:
    """Write a block's new keys and values into the cache (its first `n` tokens; all when None) and advance it."""
    n = new_keys[0].shape[2] if n is None else n
    cache.write_all(new_keys, new_values, n)
    cache.advance(n, None)


def _metadata_signature(tensors: list[torch.Tensor]) -> int | None:
    """A number that changes with any of the tensors' dtypes, devices or sizes; None where printpress's kernel is not
    loaded (then `CompiledGraph._parameters_unchanged` checks every parameter)."""
    if not native.loaded("rows_linear.cpp"):
        return None
    return torch.ops.printpress_fast.metadata_signature(tensors)


def input_and_code_guards(entries) -> list[bool]:
    """Which of dynamo's guards a compiled pass keeps: those on its tensor inputs and on code, not those on the
    model's modules and parameters (about 1,000 checks of module attributes and a hundred parameter tensors), which
    cost 0.7 ms per call on the shipped model, a sixth of a compiled AR step. An inference model's structure does
    not change; `CompiledGraph._parameters_unchanged` checks, more cheaply, what could (a parameter's dtype, device
    or shape after `model.to(...)`)."""
    return [not isinstance(entry.value, nn.Parameter) and not entry.orig_guard.source.is_unspecialized_nn_module()
            for entry in entries]


# -- few-row linears: printpress's own kernel in place of MKL's GEMM ------------------------------------------------

# Up to this many rows, printpress_fast::rows_linear (printpress/kernels/rows_linear.cpp) beats MKL's GEMM on
# this project's CPU at the weight shapes of the shipped and the 99.7M benchmark models: 1.1-2.3x at 1-4 rows
# (weights streamed past each row), 1.1-1.8x at 5-8 rows (3 x 4 register tiles); from 12 rows MKL is as fast or
# faster (docs/benchmarks.md §6, "Few-row linears"). Where the CPU has AVX-512 the kernel multiplies 2 rows or
# more through packed weight panels, 1.05-1.5x MKL's GEMM up to PANELS_MAX_ROWS (a canvas of 32 is such a product;
# §6, "Packed panels"): `rows_linear_max_rows()` says which limit holds.
ROWS_LINEAR_MAX_ROWS = 8
PANELS_MAX_ROWS = 64
# The weights the few-row products read: the model's own, or (opt-in, not the float32 model's numbers) a bfloat16
# copy of each for products of up to BF16_MAX_ROWS rows, where reading the weights is what costs.
WEIGHT_COPIES = ("float32", "bfloat16")
BF16_MAX_ROWS = 4


def rows_linear_ready() -> bool:
    """Whether the few-row linear kernel is built and loaded (first use on a machine builds it: 10-20 s)."""
    global _max_rows
    ready = native.load("rows_linear.cpp", "compiled graphs keep MKL's GEMM for their few-row linears",
                        _register_rows_linear_fake)
    if ready and _max_rows is None:
        _max_rows = PANELS_MAX_ROWS if torch.ops.printpress_fast.packed_panels() else ROWS_LINEAR_MAX_ROWS
    return ready


_max_rows: int | None = None  # `rows_linear_max_rows()`, known once the kernel has loaded


def _register_rows_linear_fake() -> None:
    """Shapes for torch.compile: each op's output from its inputs' (the ops of one shape share a function)."""
    def products(x, weight, *rest):  # x (M, K) @ weight (N, K)^T -> (M, N)
        return x.new_empty((x.shape[0], weight.shape[0]))

    def chosen_experts(x, weight, index):  # row r through expert index[r] of weight (E, N, K) -> (R, N)
        return x.new_empty((x.shape[0], weight.shape[1]))

    def routed(x, weights, experts, gate_up, down, activation, max_rows):  # x's shape
        return x.new_empty(x.shape)

    def attention(q, past_k, past_v, k, v, mask, scale):  # (B * T, Hq * D)
        return q.new_empty((q.shape[0] * q.shape[1], q.shape[2] * q.shape[3]))

    for fake, ops in ((products, ("rows_linear", "rows_linear_bf16", "rows_linear_capped", "amx_linear")),
                      (chosen_experts, ("expert_rows", "expert_rows_bf16")),
                      (routed, ("routed_experts", "routed_experts_amx")), (attention, ("small_attention",))):
        for op in ops:
            torch.library.register_fake(f"printpress_fast::{op}")(fake)


# Whether the graph being called may run a canvas's experts through printpress_fast::routed_experts (each expert on
# its own tokens only) instead of every expert on every token: `CompiledGraph._run` sets it before each call, so
# that `static_experts` reads it while the graph is traced (and dynamo guards on it).
_routed_experts = False


ROUTED_DTYPES = (torch.float32, torch.bfloat16)  # what printpress_fast::routed_experts computes in


def rows_linear_max_rows() -> int:
    """The most rows of a product the compiled graphs hand printpress's kernel (more go to MKL's GEMM):
    `PANELS_MAX_ROWS` where it multiplies through packed panels (AVX-512), else `ROWS_LINEAR_MAX_ROWS` (also
    before the kernel has loaded). A global read, so that a graph being traced may ask."""
    return ROWS_LINEAR_MAX_ROWS if _max_rows is None else _max_rows


def routed_experts_wanted(*tensors: torch.Tensor) -> bool:
    """Inside a graph being traced: whether `static_experts` runs a canvas's experts through the routed kernel."""
    return _routed_experts and all(t.dtype in ROUTED_DTYPES and t.device.type == "cpu" for t in tensors)


# Whether the graph being called may run its attentions and its logits through printpress's own operators
# (printpress_fast::small_attention, rows_linear_capped) instead of ATen's: set with `_routed_experts`, where the
# kernel has loaded with its AVX-512 code (elsewhere their plain loops are slower than ATen's), and whether its
# few-row products read bfloat16 copies of the weights (`FewRowLinears`' option, which then keeps the logits').
_own_operators = False
_bf16_weights = False
_amx = False  # and whether, with them, a canvas's products go through AMX tiles (`amx_wanted`)


AMX_MIN_ROWS = 16  # products of fewer rows keep the float32 kernels under weights="bfloat16" (see `amx_wanted`)
AMX_BLOCK = 32  # amx_linear's output channels and inputs come in whole multiples of this


def amx_available() -> bool:
    """Whether the kernel runs products through AMX tiles here: built for a CPU with amx_bf16, and allowed the
    tiles by the operating system (Linux)."""
    return rows_linear_ready() and torch.ops.printpress_fast.amx_available()


def amx_wanted(x, weight) -> bool:
    """Inside a graph being traced with `weights="bfloat16"`: whether the product x (M, K) @ weight^T, weight (N, K)
    given as fake tensors, goes through `printpress_fast::amx_linear`: float32 on the CPU, AMX here, whole blocks of
    channels and inputs, and at least `AMX_MIN_ROWS` rows, or rows known only at run time (a graph for any block
    length or batch: the op takes fewer rows through the float32 kernels then)."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dim() == 2 and weight.dim() == 2):
        return False
    rows = x.shape[0]
    return (_bf16_weights and _amx and (not isinstance(rows, int) or rows >= AMX_MIN_ROWS)
            and _float32_on_cpu(x, weight) and weight.shape[0] % AMX_BLOCK == 0 and weight.shape[1] % AMX_BLOCK == 0)


def routed_experts_op():
    """The routed-experts operator a graph being traced calls: through AMX tiles under `weights="bfloat16"` where
    the CPU has them, else in float32 (or the model's bfloat16)."""
    return torch.ops.printpress_fast.routed_experts_amx if _bf16_weights and _amx else \
        torch.ops.printpress_fast.routed_experts


def own_operators_available() -> bool:
    """Whether the kernel is loaded with its AVX-512 code, where its attention and capped logits beat ATen's."""
    return rows_linear_ready() and rows_linear_max_rows() == PANELS_MAX_ROWS


def _float32_on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def small_attention_wanted(mask: torch.Tensor | None, *tensors: torch.Tensor) -> bool:
    """Inside a graph being traced: whether `_attend_after` runs printpress_fast::small_attention on the queries,
    keys and values `tensors` (float32 on the CPU, head_dim a multiple of 16: the kernel's vectors) under `mask`
    (bool, or none)."""
    return (_own_operators and tensors[0].shape[-1] % 16 == 0 and (mask is None or mask.dtype == torch.bool)
            and _float32_on_cpu(*tensors))


def _logits(model: DiffusionGemma, hidden: torch.Tensor) -> torch.Tensor:
    """`model.logits(hidden)` inside a compiled graph. Where the graph may use printpress's operators, a float32
    model's product with its tied embedding and the softcap run as one (`printpress_fast::rows_linear_capped`: each
    part of the product capped while it is in cache, not a pass of its own over the (rows, vocab) logits), unless
    the product is one the graph reads through bfloat16 copies (a few rows known when compiling, `FewRowLinears`)
    or the model has an LM head of its own (an int8 one, `printpress.quantize`). Under `weights="bfloat16"` a
    canvas's logits (`amx_wanted`) go through AMX tiles, capped there too."""
    cap, weight = model.config.final_logit_softcapping, model.embed_tokens.weight
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = flat.shape[0]
    bf16_product = _bf16_weights and isinstance(rows, int) and rows <= BF16_MAX_ROWS
    if cap and model.lm_head is None and amx_wanted(flat, weight):
        return torch.ops.printpress_fast.amx_linear(flat, weight, cap).view(*hidden.shape[:-1], -1)
    if (not cap or not _own_operators or bf16_product or model.lm_head is not None
            or not _float32_on_cpu(hidden, weight)):
        return model.logits(hidden)
    logits = torch.ops.printpress_fast.rows_linear_capped(flat, weight, cap, rows_linear_max_rows())
    return logits.view(*hidden.shape[:-1], -1)


class FewRowLinears(CustomGraphPass):
    """An inductor pass (run on the graph after autograd, before lowering). Every `mm(x, weight.t())` with a
    contiguous 2-D weight and a float32 CPU x of at most `rows_linear_max_rows()` rows, or of rows known only at run
    time (a graph compiled for any batch size: the kernel then hands more rows to MKL), becomes
    `printpress_fast::rows_linear(x, weight, rows_linear_max_rows())`. An AR step is such products only (one row per
    sequence), bound by reading the weights; the kernel streams them at the memory's speed where MKL's GEMM reaches
    60-70% of it. Likewise the chosen experts of a few tokens (`static_experts`: their weights gathered, then a
    batched product) become `printpress_fast::expert_rows`, which reads each expert's weights in place.

    Another summation order than MKL's, so only the compiled paths (not exact anyway) use it; where the kernel
    cannot be built, the pass leaves the graph as it is. `replaced` counts the products replaced in this process.

    `weights="bfloat16"` (opt-in): products of at most `BF16_MAX_ROWS` rows known when compiling (an AR step of a
    few sequences, their chosen experts) read a bfloat16 copy of each weight instead (`rows_linear_bf16`,
    `expert_rows_bf16`: half the bytes, the weights rounded to bfloat16, the sums in float32).
    """

    replaced = 0

    def __init__(self, weights: str = "float32") -> None:
        if weights not in WEIGHT_COPIES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_COPIES)}, not {weights!r}")
        self.weights = weights

    def _bf16(self, rows) -> bool:
        """Whether a product of these rows (a fake tensor's) reads the weights' bfloat16 copies."""
        count = rows.shape[0] if isinstance(rows, torch.Tensor) else None
        return self.weights == "bfloat16" and isinstance(count, int) and count <= BF16_MAX_ROWS

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not rows_linear_ready():
            return
        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is aten.mm.default:
                self._linear(graph, node)
            elif node.op == "call_function" and node.target is aten.bmm.default:
                self._experts(graph, node)

    def _linear(self, graph: torch.fx.Graph, node: torch.fx.Node) -> None:
        """mm(x, weight.t()) -> rows_linear(x, weight); under `weights="bfloat16"` a canvas's products, and its
        probabilities' product with the embedding (mm(probs, weight)), through AMX tiles where `amx_wanted`."""
        x, transposed = node.args
        weight = _transposed_weight(transposed)
        if self._amx(graph, node, x, transposed, weight):
            return
        if weight is None or not _few_float_rows(x.meta.get("val"), rows_linear_max_rows()):
            return
        with graph.inserting_before(node):
            if self._bf16(x.meta.get("val")):
                fused = graph.call_function(torch.ops.printpress_fast.rows_linear_bf16.default, (x, weight))
            else:
                fused = graph.call_function(torch.ops.printpress_fast.rows_linear.default,
                                            (x, weight, rows_linear_max_rows()))
        fused.meta = dict(node.meta)
        _replace(graph, node, fused, transposed)

    def _amx(self, graph: torch.fx.Graph, node: torch.fx.Node, x, second, weight) -> bool:
        """mm(x, weight.t()) or mm(x, weight) with a weight of the model's (a graph input) -> amx_linear, where
        `amx_wanted`; whether it replaced the node."""
        aten = torch.ops.aten
        if self.weights != "bfloat16" or not isinstance(second, torch.fx.Node):
            return False
        if weight is None:  # mm(probs, embedding): the weight (K, N) itself, a graph input
            value = second.meta.get("val")
            if (second.op != "placeholder" or not isinstance(value, torch.Tensor) or value.dim() != 2
                    or not value.is_contiguous() or not amx_wanted(x.meta.get("val"), value.t())):
                return False
            with graph.inserting_before(node):
                view = graph.call_function(aten.permute.default, (second, [1, 0]))
                view.meta = {"val": value.t()}
                fused = graph.call_function(torch.ops.printpress_fast.amx_linear.default, (x, view, 0.0))
            fused.meta = dict(node.meta)
            _replace(graph, node, fused)
            return True
        if not amx_wanted(x.meta.get("val"), weight.meta.get("val")):
            return False
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.printpress_fast.amx_linear.default, (x, weight, 0.0))
        fused.meta = dict(node.meta)
        _replace(graph, node, fused, second)
        return True

    def _experts(self, graph: torch.fx.Graph, node: torch.fx.Node) -> None:
        """bmm(weight[index], rows.unsqueeze(-1)) -> expert_rows(rows, weight, index).unsqueeze(-1): the chosen
        experts' products of `static_experts` (a few tokens), without the copy of their weights."""
        aten = torch.ops.aten
        gathered, column = node.args
        if not (isinstance(gathered, torch.fx.Node) and gathered.target is aten.index.Tensor
                and isinstance(column, torch.fx.Node) and column.target is aten.unsqueeze.default
                and column.args[1] in (-1, 2)):
            return
        weight, indices = gathered.args
        rows = column.args[0]
        stack = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else None
        if (len(indices) != 1 or not isinstance(indices[0], torch.fx.Node) or stack is None or stack.dim() != 3
                or stack.dtype != torch.float32 or stack.device.type != "cpu" or not stack.is_contiguous()
                or not _few_float_rows(rows.meta.get("val"), limit=None)):
            return
        with graph.inserting_before(node):
            op = torch.ops.printpress_fast.expert_rows_bf16 if self._bf16(rows.meta.get("val")) else \
                torch.ops.printpress_fast.expert_rows
            products = graph.call_function(op.default, (rows, weight, indices[0]))
            products.meta = {"val": node.meta["val"].squeeze(-1)}
            fused = graph.call_function(aten.unsqueeze.default, (products, -1))
        fused.meta = dict(node.meta)
        _replace(graph, node, fused, gathered, column)

    def uuid(self) -> bytes:
        """Inductor's cache key for the pass: this file, the kernel, the row limit, whether the kernel loads (and
        runs AMX tiles)."""
        ready = rows_linear_ready()  # first: loading the kernel settles the row limit
        amx = ready and amx_available()
        digest = hashlib.sha256(f"{rows_linear_max_rows()} {ready} {self.weights} {amx}".encode())
        for path in (Path(__file__), native.KERNELS / "rows_linear.cpp"):
            digest.update(path.read_bytes())
        return digest.digest()


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, by: torch.fx.Node, *inputs: torch.fx.Node) -> None:
    """`node`'s uses now read `by`; `node` goes, and so do the `inputs` nothing else reads."""
    node.replace_all_uses_with(by)
    graph.erase_node(node)
    for unused in inputs:
        if not unused.users:
            graph.erase_node(unused)
    FewRowLinears.replaced += 1


def _transposed_weight(node) -> torch.fx.Node | None:
    """The contiguous (N, K) float32 CPU weight whose transpose `node` is, or None."""
    aten = torch.ops.aten
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.permute.default and [dim % 2 for dim in node.args[1]] == [1, 0]:
        source = node.args[0]
    elif node.target is aten.t.default:
        source = node.args[0]
    else:
        return None
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if (value is None or value.dim() != 2 or value.dtype != torch.float32 or value.device.type != "cpu"
            or not value.is_contiguous()):
        return None
    return source


def _few_float_rows(value, limit: int | None) -> bool:
    """Whether a (fake) tensor is a float32 CPU matrix whose rows are at most `limit` (if any) or not known until
    it runs (a graph compiled for any batch size: the kernel hands more rows to MKL then)."""
    if not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.dtype == torch.float32
            and value.device.type == "cpu"):
        return False
    rows = value.shape[0]
    return not isinstance(rows, int) or limit is None or 1 <= rows <= limit


GRAPH_VARIANTS = 64  # graphs dynamo may compile per pass function (`CompiledGraph`), instead of its default 8


class CompiledGraph:
    """A graph function compiled whole (`fullgraph=True`), run until it first fails: the failure is logged once,
    kept in `.failure`, and from then on the caller's exact eager path runs."""

    what = "compiled graph"  # the words of the warning

    graph: Callable = None  # the pure function of tensors a subclass compiles
    python_arguments = 0  # how many of the graph's trailing arguments are Python values (part of a variant)

    def __init__(self, model: DiffusionGemma, backend: str = "inductor", rows_kernel: bool = True,
                 routed_experts: bool = True, ahead_of_time: bool = False, weights: str = "float32") -> None:
        self.model = model
        self.backend = backend
        self.routed_experts = routed_experts
        self.rows_kernel = rows_kernel
        self.weights = weights
        self.failure: str | None = None
        options = {"guard_filter_fn": input_and_code_guards}
        inductor_configs = {}
        if backend == "inductor":
            options["cpp_wrapper"] = True  # the kernels are called from C++, not one Python call each
            if rows_kernel:  # the kernel is built when the first graph is compiled, not here
                inductor_configs["post_grad_custom_post_pass"] = FewRowLinears(weights)
        # The same graph compiled ahead of time where a variant can be (`printpress.aot`: no dynamo entry per call).
        self.ahead = None
        if ahead_of_time and backend == "inductor":
            from printpress.aot import AheadOfTimeGraphs

            self.ahead = AheadOfTimeGraphs(type(self).graph, model, self.dynamic_sizes, inductor_configs,
                                           tag=f"rows_kernel={rows_kernel} routed_experts={routed_experts} "
                                               f"weights={weights}",
                                           before_export=self._set_routing)
        options.update(inductor_configs)
        graph = torch.compile(type(self).graph, backend=backend, fullgraph=True, options=options)
        # Each variant a model meets is a graph of its own (a canvas length, self-conditioned or not, batch 1 or
        # more, padded rows or not, a block of 1 token or more): bench/compiled_decoder.py's three canvas lengths
        # with sliding canvases went past dynamo's default limit of 8 per function, and the pass went eager.
        self._graph = torch._dynamo.config.patch(recompile_limit=GRAPH_VARIANTS)(graph)
        self._parameter_list = list(model.parameters())
        self._parameters = [(p, p.dtype, p.device, p.shape) for p in self._parameter_list]
        self._signature: int | None = None  # see `_parameters_unchanged`

    def _set_routing(self) -> None:
        global _routed_experts, _own_operators, _bf16_weights, _amx
        ready = rows_linear_ready()
        _routed_experts = self.routed_experts and ready
        _own_operators = self.rows_kernel and ready and own_operators_available()
        _bf16_weights = self.weights == "bfloat16"
        _amx = _bf16_weights and self.rows_kernel and ready and amx_available()

    def dynamic_sizes(self, tensors: tuple):
        """For `printpress.aot`: which sizes of the graph's tensor inputs vary between calls (the structure of
        `tensors`, a {dim: name} dict per tensor), or None where this graph is not compiled ahead of time."""
        return None

    def _parameters_unchanged(self) -> bool:
        """Whether every parameter keeps the dtype, device and shape the graph was made for (the guards that
        would have checked it are dropped: `input_and_code_guards`). Once that has held, a signature of them all
        (`printpress_fast::metadata_signature`, one call where the kernel is loaded) stands for it until it moves."""
        if self._signature is not None and self._signature == _metadata_signature(self._parameter_list):
            return True
        unchanged = all(p.dtype == dtype and p.device == device and p.shape == shape
                        for p, dtype, device, shape in self._parameters)
        if unchanged:
            self._signature = _metadata_signature(self._parameter_list)
        return unchanged

    def _run(self, *args):
        """The graph's outputs, or None if it failed (now or before)."""
        if not self._parameters_unchanged():
            self.failure = "the model's parameters changed dtype, device or shape after it was compiled"
            logger.warning("%s unavailable (%s); running the exact eager path (compile it again)", self.what,
                           self.failure)
            return None
        self._set_routing()
        if self.ahead is not None:
            split = len(args) - self.python_arguments
            try:
                out = self.ahead(args[:split], args[split:])
            except Exception as error:  # noqa: BLE001 - a package that fails to run: dynamo's graph from now on
                logger.warning("%s: its ahead-of-time package failed (%s: %s); calling it through dynamo", self.what,
                               type(error).__name__, error)
                self.ahead, out = None, None
            if out is not None:
                return out
        try:
            return self._graph(self.model, *args)
        except Exception as error:  # noqa: BLE001 - any compiler failure means "use the eager path"
            self.failure = f"{type(error).__name__}: {error}"
            logger.warning("%s unavailable (%s); running the exact eager path", self.what, self.failure)
            return None


class CompiledARStep(CompiledGraph):
    """`model.encode(ids (B, 1), cache, logits="last")` through one compiled graph; see the module docstring."""

    what = "compiled AR step"
    graph = staticmethod(ar_step_graph)

    def dynamic_sizes(self, tensors: tuple):
        return _causal_block_sizes(self.model, tensors)

    def covers(self, input_ids: torch.Tensor, cache: object, attention_mask: torch.Tensor | None, logits: str) -> bool:
        """Whether this call is an AR step the graph runs (else the eager path runs it)."""
        return (self.failure is None and input_ids.shape[1] == 1 and attention_mask is None and logits == "last"
                and isinstance(cache, KVCache) and not torch.is_grad_enabled())

    def __call__(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """The step's logits (B, 1, V), with the cache advanced; None if the graph failed (nothing was written:
        the caller runs the eager path)."""
        cache.check_room(1)
        out = self._run(_unaliased(input_ids), *_cache_inputs(cache))
        if out is None:
            return None
        logits, new_keys, new_values = out
        _store(cache, new_keys, new_values)
        return logits


def compile_ar_step(model: DiffusionGemma, backend: str = "inductor", rows_kernel: bool = True,
                    routed_experts: bool = True, ahead_of_time: bool = True,
                    weights: str = "float32") -> CompiledARStep:
    """Run this model's encoder passes through compiled graphs from now on (opt-in, not bit-exact): AR steps (one
    token per row) and unpadded blocks (speculative verifications, prompts: `CompiledEncoderBlock`). Returns the
    step object (`.failure` says why it fell back, if it did; `model.compiled_encoder` is the block's).
    `remove_compiled_ar_step` undoes both. `rows_kernel=False` keeps MKL's GEMM for the few-row products
    (`FewRowLinears`); `routed_experts=False` runs a block's experts densely (every expert on every token) instead
    of each on its own tokens (`printpress_fast::routed_experts`); `ahead_of_time=False` calls every graph through
    dynamo (`printpress.aot`). `weights="bfloat16"` (opt-in, another model's numbers: its weights rounded to
    bfloat16) has the products of AR steps of up to `BF16_MAX_ROWS` sequences read bfloat16 copies of the weights,
    made on first use and kept beside them (half their bytes again in memory)."""
    if weights not in WEIGHT_COPIES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_COPIES)}, not {weights!r}")
    step = CompiledARStep(model, backend, rows_kernel, routed_experts, ahead_of_time, weights)
    model.compiled_ar_step = step
    model.compiled_encoder = CompiledEncoderBlock(model, backend, rows_kernel, routed_experts, ahead_of_time, weights)
    return step


def remove_compiled_ar_step(model: DiffusionGemma) -> None:
    """Back to the exact encoder passes; the kernel's weight copies (the bfloat16 ones of `weights="bfloat16"`, the
    packed panels of few-row products: every model's) are dropped (a model still compiled makes its own again)."""
    model.compiled_ar_step = None
    model.compiled_encoder = None
    if native.loaded("rows_linear.cpp"):
        torch.ops.printpress_fast.forget_weight_copies()


# -- a block of the encoder (a verification, a prompt) ----------------------------------------------------------


def encoder_block_graph(
    model: DiffusionGemma,
    ids: torch.Tensor,
    position: torch.Tensor,
    offsets: torch.Tensor,
    pad_mask: torch.Tensor,
    slot_positions: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    last: bool,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A causal pass over a block `ids` (B, T) after the cache, as a pure function of tensors: the float32
    next-token logits (B, T, V), or (B, 1, V) with `last`, and each layer's new keys and values, which the caller
    writes into the cache (all of them, or a speculative verification's kept ones). The inputs are
    `_causal_block`'s."""
    hidden, new_keys, new_values = _causal_block(model, ids, position, offsets, pad_mask, slot_positions, keys, values)
    return _logits(model, hidden[:, -1:] if last else hidden), new_keys, new_values


def cached_prefixes(model: DiffusionGemma, cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's cached keys and values as the eager passes read them (the sliding ring oldest first), marked
    dynamic in their length: the context grows with every block and canvas, and the graphs are compiled once for
    any length."""
    prefixes = [cache.sliding_prefix(i) if spec.sliding else cache.full_prefix(i) for i, spec in enumerate(model.specs)]
    keys, values = [k for k, _ in prefixes], [v for _, v in prefixes]
    for tensor in (*keys, *values):
        torch._dynamo.maybe_mark_dynamic(tensor, 2)
    return keys, values


class CompiledEncoderBlock(CompiledGraph):
    """`model.encode(ids (B, T >= 2), cache, logits="all" | "last")` through compiled graphs for any T and cache
    length (a few variants: logits for the last token or all, blocks of 2 tokens, whose experts are gathered
    rather than routed): speculative verifications and unpadded prompts. See `compile_ar_step`."""

    what = "compiled encoder block"
    graph = staticmethod(encoder_block_graph)
    python_arguments = 1  # `last`
    dynamic_sizes = CompiledARStep.dynamic_sizes

    def covers(self, input_ids: torch.Tensor, cache: object, attention_mask: torch.Tensor | None, logits: str) -> bool:
        """Whether this call is a block the graph runs: more than one token, none of them padding (a prompt, a
        verification, a committed canvas; logits "none" runs the graph of "last" and drops its one row)."""
        return (self.failure is None and input_ids.shape[1] > 1
                and isinstance(cache, KVCache) and not torch.is_grad_enabled()
                and (attention_mask is None or bool(attention_mask.all())))

    def __call__(self, input_ids: torch.Tensor, cache: KVCache, logits: str) -> torch.Tensor | None:
        """The block's logits, with the cache advanced; None if the graph failed (nothing was written)."""
        out = self.tentatively(input_ids, cache, logits)
        if out is None:
            return None
        block_logits, keep = out
        keep(input_ids.shape[1])
        return block_logits

    def tentatively(self, input_ids: torch.Tensor, cache: KVCache,
                    logits: str = "all") -> tuple[torch.Tensor, Callable[[int], None]] | None:
        """The block's logits and `keep(n)`, which writes the block's first n tokens into the cache (nothing is
        written before: a verification keeps only what it accepts); None if the graph failed."""
        cache.check_room(input_ids.shape[1])
        # Any block length: one left static would pin it to the first one seen, and each new prompt length would
        # compile again.
        torch._dynamo.maybe_mark_dynamic(input_ids, 1)
        out = self._run(_unaliased(input_ids), *_cache_inputs(cache), logits != "all")
        if out is None:
            return None
        block_logits, new_keys, new_values = out
        return block_logits, lambda n: _store(cache, new_keys, new_values, n)


# -- the decoder pass -------------------------------------------------------------------------------------------


def decoder_pass_graph(
    model: DiffusionGemma,
    canvas_ids: torch.Tensor,
    probs: torch.Tensor | None,
    self_conditioning_mask: torch.Tensor | None,
    positions: torch.Tensor,
    prefix_keys: list[torch.Tensor],
    prefix_values: list[torch.Tensor],
    full_valid: torch.Tensor | None,
    sliding_valid: torch.Tensor | None,
) -> torch.Tensor:
    """One decoder pass as a pure function of tensors (what `torch.compile` captures): float32 logits (B, C, V).

    The inputs are what the eager `denoise` reads: the canvas, the previous step's probabilities (or None), the
    canvas's RoPE positions (C,) or per row (B, C), each layer's cached keys/values oldest first, and which cached
    keys hold real tokens per layer kind (None: all). The canvas sees every valid cached key and all of itself."""
    b, c = canvas_ids.shape
    x = model.embed_canvas(canvas_ids, None, self_conditioning_mask, probs=probs).reshape(b * c, -1)
    ropes = model.rope(positions)
    masks = {sliding: None if valid is None else torch.cat([valid, valid.new_ones(b, c)], dim=1)[:, None, None, :]
             for sliding, valid in ((True, sliding_valid), (False, full_valid))}
    for index, (layer, spec) in enumerate(zip(model.layers, model.specs)):
        attended = _attend_after(layer, layer.attention_inputs(x, (b, c), ropes[spec.sliding]), masks[spec.sliding],
                                 prefix_keys[index], prefix_values[index])
        x = layer.after_attention(x, attended, (b, c), False)
    return _logits(model, model.norm(x).view(b, c, -1))


class CompiledDecoderPass(CompiledGraph):
    """`model.denoise(...)` through one compiled graph per canvas shape; see `compile_decoder`."""

    what = "compiled decoder pass"
    graph = staticmethod(decoder_pass_graph)

    def dynamic_sizes(self, tensors: tuple):
        """The cached prefix's lengths (full layers', sliding ones'), for one row (see `_causal_block_sizes`)."""
        if tensors[0].shape[0] != 1:
            return None
        layers = _cached_lengths(self.model)
        return {}, {}, {}, {}, layers, layers, {1: "length"}, {1: "window"}

    def covers(self) -> bool:
        """Whether the graph runs this pass (inference only, and only while it has not failed)."""
        return self.failure is None and not torch.is_grad_enabled()

    def __call__(self, canvas_ids: torch.Tensor, cache, self_conditioning_logits: torch.Tensor | None,
                 self_conditioning_probs: torch.Tensor | None,
                 self_conditioning_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The pass's logits (B, C, V); None if the graph failed (the caller runs the eager path)."""
        probs = self_conditioning_probs
        if probs is None and self_conditioning_logits is not None:
            probs = torch.softmax(self_conditioning_logits, dim=-1, dtype=torch.float32)
        if probs is not None and self_conditioning_mask is None and canvas_ids.shape[0] > 1:
            # Every row conditioned is the all-true mask (a product by 1, the same numbers): one graph for a batch
            # whether or not its rows are in step, so a warm-up's rows, which are, compile what later ones need.
            self_conditioning_mask = torch.ones(canvas_ids.shape[0], dtype=torch.bool, device=canvas_ids.device)
        c = canvas_ids.shape[1]
        positions = cache.row_positions(torch.arange(cache.length, cache.length + c, device=canvas_ids.device))
        keys, values = cached_prefixes(self.model, cache)
        full_valid = sliding_valid = None
        if not cache.all_valid():
            full_valid, sliding_valid = cache.prefix_valid(False), cache.prefix_valid(True)
        for valid in (full_valid, sliding_valid):
            if valid is not None:
                torch._dynamo.maybe_mark_dynamic(valid, 1)
        return self._run(canvas_ids, probs, self_conditioning_mask, positions, keys, values, full_valid, sliding_valid)


# -- the fused pass: a block encoded and canvas rows denoised beside it ----------------------------------------


def fused_pass_graph(
    model: DiffusionGemma,
    block_ids: torch.Tensor,
    canvas_ids: torch.Tensor,
    probs: torch.Tensor | None,
    positions: torch.Tensor,
    prefix_keys: list[torch.Tensor],
    prefix_values: list[torch.Tensor],
    full_mask: torch.Tensor | None,
    sliding_mask: torch.Tensor | None,
    canvas_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
    """`DiffusionGemma._encode_beside` as a pure function of tensors: the block `block_ids` (1, m) in encoder mode
    and the canvas rows `canvas_ids` (1, R) in decoder mode (self-conditioned on `probs` (1, R, V), or not) in one
    pass over the cached prefix, under the masks `_fused_mask` gives (keys: prefix, block, canvas rows).

    Returns the block's float32 logits (m, V) and the canvas rows' final hidden states (1, R, H) (`verify_and_draft`),
    or with `canvas_logits` None and the canvas rows' logits (1, R, V) (`encode_and_denoise`); then each layer's new
    block keys and values, which the caller writes into the cache (the canvas's are never stored)."""
    m, rows = block_ids.shape[1], canvas_ids.shape[1]
    x = torch.cat([model.embed(block_ids), model.embed_canvas(canvas_ids, None, probs=probs)], dim=1)
    x = x.reshape(m + rows, -1)
    is_encoder = torch.arange(m + rows, device=x.device) < m
    ropes = model.rope(positions)
    new_keys, new_values = [], []
    for index, (layer, spec) in enumerate(zip(model.layers, model.specs)):
        attended = _attend_after(layer, layer.attention_inputs(x, (1, m + rows), ropes[spec.sliding]),
                                 sliding_mask if spec.sliding else full_mask, prefix_keys[index],
                                 prefix_values[index], new_keys, new_values, m)
        x = layer.after_attention(x, attended, (1, m + rows), is_encoder)
    hidden = model.norm(x).view(1, m + rows, -1)
    if canvas_logits:
        return None, _logits(model, hidden[:, m:]), new_keys, new_values
    return _logits(model, hidden[0, :m]), hidden[:, m:], new_keys, new_values


class CompiledFusedPass(CompiledGraph):
    """`DiffusionGemma._encode_beside` (a sliding canvas's pass after a commit, a fused speculative round) through
    compiled graphs for any block, canvas and cache length; see `compile_decoder`."""

    what = "compiled fused pass"
    graph = staticmethod(fused_pass_graph)
    covers = CompiledDecoderPass.covers  # inference only, and only while it has not failed

    def __call__(self, block: torch.Tensor, canvas_rows: torch.Tensor, positions: torch.Tensor, masks, cache: KVCache,
                 probs: torch.Tensor | None, canvas_logits: bool):
        """What `_encode_beside` returns (the block's logits and the canvas rows' hidden states, or with
        `canvas_logits` None and their logits), with the block written to the cache and the cache advanced. None
        if the graph failed (nothing was written: the caller runs the eager path)."""
        keys, values = cached_prefixes(self.model, cache)
        torch._dynamo.maybe_mark_dynamic(block, 1)
        torch._dynamo.maybe_mark_dynamic(canvas_rows, 1)
        torch._dynamo.maybe_mark_dynamic(positions, positions.dim() - 1)
        if probs is not None:
            torch._dynamo.maybe_mark_dynamic(probs, 1)
        for mask in (masks.full, masks.sliding):
            if mask is not None:
                torch._dynamo.maybe_mark_dynamic(mask, 2)
                torch._dynamo.maybe_mark_dynamic(mask, 3)
        out = self._run(block, canvas_rows, probs, positions, keys, values, masks.full, masks.sliding, canvas_logits)
        if out is None:
            return None
        block_logits, canvas_out, new_keys, new_values = out
        _store(cache, new_keys, new_values)  # the block's rows only (`_attend_after` keeps the first m)
        return block_logits, canvas_out


def compile_decoder(model: DiffusionGemma, backend: str = "inductor", rows_kernel: bool = True,
                    routed_experts: bool = True, ahead_of_time: bool = True,
                    weights: str = "float32") -> CompiledDecoderPass:
    """Run this model's decoder passes (diffusion steps, speculative drafts, edits) through one compiled graph
    from now on: opt-in and not bit-exact, like `compile_ar_step` (fused kernels sum in another order; tanh is
    computed from exp). A canvas's experts run each on its own tokens through `printpress_fast::routed_experts`
    where the kernel builds (`routed_experts=False`, or no compiler: every expert on every token, then the
    router's choice). Returns the pass object (`.failure` says why it fell back, if it did);
    `remove_compiled_decoder` undoes it. The fused passes (a sliding canvas's pass after a commit, a fused
    speculative round: a block encoded beside canvas rows) run through their own graphs from then on too
    (`model.compiled_fused_pass`). `weights="bfloat16"` (opt-in, another model's numbers: weights and inputs of
    the products rounded to bfloat16, sums in float32) runs the products of `AMX_MIN_ROWS` rows or more (a canvas's
    linears, experts, logits and self-conditioning) through AMX tiles where the CPU has them (`amx_available`);
    elsewhere only canvases of up to `BF16_MAX_ROWS` rows change: they read bfloat16 copies, as an AR step does."""
    if weights not in WEIGHT_COPIES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_COPIES)}, not {weights!r}")
    compiled = CompiledDecoderPass(model, backend, rows_kernel, routed_experts, ahead_of_time, weights)
    model.compiled_decoder = compiled
    model.compiled_fused_pass = CompiledFusedPass(model, backend, rows_kernel, routed_experts, weights=weights)
    return compiled


def remove_compiled_decoder(model: DiffusionGemma) -> None:
    model.compiled_decoder = None
    model.compiled_fused_pass = None
