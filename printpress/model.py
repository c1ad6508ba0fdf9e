"""The DiffusionGemma text backbone: one set of weights, two modes.

- `encode`: causal attention over new tokens plus the cached context; writes the KV cache; its logits
  are next-token logits, so the same weights are also an autoregressive LM.
- `denoise`: bidirectional attention over a canvas plus the cached context; reads the cache, never
  writes it; a self-conditioning block mixes in the previous step's predictions before the first layer.
- `verify_and_draft`: both in one pass, for fused speculative rounds: `encode` of a block, and a first
  `denoise` step of a canvas after each of its prefixes.

Module and parameter names follow the checkpoint keys under `model.decoder.` one to one (see
`printpress.checkpoint`), so loading is a plain, auditable key map.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from printpress import native
from printpress.cache import KVCache, KVJoin
from printpress.config import FULL, SLIDING, LayerSpec, TextConfig
from printpress.sampling import capped_argmax, row_argmax

if TYPE_CHECKING:
    from printpress.fast import CompiledARStep, CompiledDecoderPass, CompiledEncoderBlock, CompiledFusedPass

KVFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
LogitsMode = Literal["all", "last", "none"]

logger = logging.getLogger(__name__)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return gelu_tanh
    if name == "gelu":
        return F.gelu
    return F.silu


# Inside compiled graphs (printpress.fast: opt-in, not bit-exact) tanh is written with exp: on CPU, inductor's
# vectorised tanh costs 3.4 ns an element against exp's 1.1 (one thread), and a decoder pass over a canvas of 32
# computes it for 0.35M elements (the softcap over the vocabulary, the experts' and the MLP's GELU). The eager
# passes keep ATen's tanh, which the exact path's parity with the reference needs.


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: 0.5 x (1 + tanh(u)), which is x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)."""
    if not torch.compiler.is_compiling():
        return F.gelu(x, approximate="tanh")
    return x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in place at inference; tanh(y) = 1 - 2 / (exp(2y) + 1) inside compiled graphs
    (absolute error ~1e-7 of the cap, then)."""
    if torch.compiler.is_compiling():
        return (1.0 - 2.0 / (torch.exp(logits * (2.0 / cap)) + 1.0)) * cap
    if logits.requires_grad:
        return torch.tanh(logits / cap) * cap
    return logits.div_(cap).tanh_().mul_(cap)  # in place: a (B, C, vocab) tensor per step at inference


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32: the part of Gemma's RMSNorm before its weight.

    Several norms of a layer read the same tensor and differ only in their weights (the dense MLP's, the experts'
    and the router's; the keys' and the values' on K=V layers): they share this, saving five kernels each, with
    the same operations on the same values, so the result is bit-identical."""
    h = x.float()
    return h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class RMSNorm(nn.Module):
    """Gemma 4 RMSNorm: computed in fp32, scaled by `weight` (not `1 + weight`); optionally weightless."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(rms_normalize(x, self.eps), x.dtype)

    def scale(self, normalized: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This norm's weight applied to `rms_normalize`'s output, cast back to the input's `dtype`."""
        h = normalized
        if self.weight is not None:
            h = h * (self.weight if self.weight.dtype == torch.float32 else self.weight.float())
        return h if h.dtype == dtype else h.to(dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax router over experts; the top-k weights are renormalised, then scaled per expert."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.top_k = config.top_k_experts
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.root_size = config.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(self.norm(x))

    def route(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and experts (T, k) from the already normed input (`self.norm(x)`)."""
        h = normed * self.scale * self.root_size
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Experts(nn.Module):
    """Packed expert weights: gate_up_proj (E, 2I, H) and down_proj (E, H, I), as in the checkpoint."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act = activation(config.hidden_activation)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._static(x, weights, experts)
        training = torch.is_grad_enabled() and (x.requires_grad or self.gate_up_proj.requires_grad)
        if x.shape[0] == 1 and not training:
            return self._one_token(x, weights, experts)
        # Group the (token, slot) pairs by expert with one sort (the reference's: the row order inside a
        # group can change a threaded GEMM's rounding), run every used expert, then undo the sort.
        top_k = experts.shape[-1]
        flat_experts = experts.reshape(-1)
        _, order = torch.sort(flat_experts)
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0])
        gathered = x.index_select(0, order // top_k)
        slot_weights = weights.reshape(-1).index_select(0, order)
        if training:
            out = self._expert_loop(gathered, counts.tolist())  # grouped_mm has no CPU backward
        else:
            out = self._grouped(gathered, torch.cumsum(counts, dim=0, dtype=torch.int32))
        # As the reference: weight by the fp32 router weights, put the (token, slot) rows back in order and sum
        # each token's k expert outputs in slot order. The same summation order keeps the result bit-equal.
        weighted = torch.empty_like(out, dtype=slot_weights.dtype).index_copy_(0, order, out * slot_weights[:, None])
        return weighted.view(-1, top_k, x.shape[-1]).sum(dim=1).to(x.dtype)

    def expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """One expert's gated MLP over the rows of x routed to it (printpress.quantize overrides it for int8)."""
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[expert])

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """One token (an AR step): its k experts one after the other, with no sort, gather or scatter.

        Each expert sees the one-row GEMMs the grouped path runs for it, and the k weighted outputs are summed in
        slot order as there, so the result is bit-identical; the grouped path would also run an empty GEMM for
        every expert the token does not use."""
        rows = [self.expert_mlp(x, expert) for expert in experts[0].tolist()]
        weighted = torch.cat(rows) * weights.reshape(-1, 1)
        return weighted.sum(dim=0, keepdim=True).to(x.dtype)

    def _static(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Static shapes for compiled graphs (`printpress.fast`): `static_experts` on these weights."""
        return static_experts(x, weights, experts, self.gate_up_proj, self.down_proj, self.act)

    def _grouped(self, gathered: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Two grouped GEMMs over all experts (what the reference runs): far fewer calls than a Python loop."""
        gate, up = F.grouped_mm(gathered, self.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        return F.grouped_mm(self.act(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)

    def _expert_loop(self, gathered: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = torch.empty_like(gathered)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            out[start:end] = self.expert_mlp(gathered[start:end], expert)
            start = end
        return out


def static_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The experts with static shapes, for compiled graphs (`printpress.fast`): no sort, no sizes that depend on the
    routing. A few tokens gather their experts' weights; more than the expert count run every expert on every
    token. Not bit-identical to the grouped path (other kernels, other summation order)."""
    from printpress import fast  # loaded already: the graph being traced is one of its compiled passes

    n, k = experts.shape
    if n * k <= gate_up_proj.shape[0]:
        chosen = experts.reshape(-1)
        rows = x.repeat_interleave(k, dim=0)[:, :, None]  # (n*k, H, 1)
        gate, up = torch.bmm(gate_up_proj[chosen], rows).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(down_proj[chosen], (act(gate) * up)[:, :, None]).view(n, k, -1)
    elif (code := ACTIVATION_CODES.get(act)) is not None and fast.routed_experts_wanted(x, weights, gate_up_proj,
                                                                                          down_proj):
        # Each expert on its own tokens (printpress/kernels/rows_linear.cpp): half the products of the dense path.
        return fast.routed_experts_op()(x, weights, experts, gate_up_proj, down_proj, code, fast.rows_linear_max_rows())
    else:
        gate, up = torch.matmul(x, gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # (E, n, I) each
        every = torch.matmul(act(gate) * up, down_proj.transpose(1, 2))  # (E, n, H)
        out = every[experts, torch.arange(n, device=x.device)[:, None]]  # (n, k, H)
    return (out * weights[..., None]).sum(dim=1).to(x.dtype)


# The activations printpress's C++ operators know, by their code for them (printpress_fast::routed_experts computes
# them itself; printpress_layers calls ATen's).
ACTIVATION_CODES = {gelu_tanh: 0, F.gelu: 1, F.silu: 2}


def rope_inv_freq(config: TextConfig, spec: LayerSpec) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2 of them); proportional RoPE pads the unrotated tail with zeros."""
    params = config.rope_parameters[SLIDING if spec.sliding else FULL]
    theta = float(params["rope_theta"])
    fraction = float(params.get("partial_rotary_factor", 1.0))
    if params.get("rope_type", "default") == "proportional":
        angles = int(fraction * spec.head_dim // 2)
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / spec.head_dim
        rotated = 1.0 / (theta**exponents)
        tail = torch.zeros(spec.head_dim // 2 - angles)
        return torch.cat([rotated, tail]) / float(params.get("factor", 1.0))
    dim = int(spec.head_dim * fraction)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout: x * cos + cat(-x2, x1) * sin, written as x * cos + cat(x2, x1) * cat(-sin1, sin2).

    Negating a factor of a product is exact, so this is bit-identical to the usual form; `signed_sin` is built
    once per pass (`DiffusionGemma.rope`) and the swap is one `roll`, two kernels fewer per call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    scale = 1.0  # of the attention logits: the q/k norms already set their scale

    def __init__(self, config: TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        h, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.head_dim = spec.head_dim
        self.num_heads = heads
        self.num_kv_heads = spec.num_kv_heads
        self.q_proj = nn.Linear(h, heads * spec.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * spec.head_dim, bias=bias)
        # Full-attention layers share K and V: the values are the keys before their norm and rotation.
        self.v_proj = None if spec.shares_kv else nn.Linear(h, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * spec.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(spec.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(spec.head_dim, config.rms_norm_eps)
        self.v_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, with_scale=False)

    def forward(
        self,
        x: torch.Tensor,
        shape: tuple[int, int],
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        kv_fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Attention for x (B*T, H), the rows of `shape` = (B, T) sequences; returns (B*T, H)."""
        return self.o_proj(self.attend(*self.project(x, shape, rope), mask, kv_fn))

    def project(self, x: torch.Tensor, shape: tuple[int, int], rope: tuple[torch.Tensor, torch.Tensor]):
        """Normed, rotated queries (B, T, heads, D), keys and values (B, kv_heads, T, D) of x (B*T, H)."""
        b, t = shape
        cos, sin = rope
        q = rotate(self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)), cos, sin)
        k_raw = self.k_proj(x).view(b, t, -1, self.head_dim)
        k_normalized = rms_normalize(k_raw, self.k_norm.eps)
        k = rotate(self.k_norm.scale(k_normalized, x.dtype), cos, sin).transpose(1, 2)
        if self.v_proj is None:  # K=V layer: the values are the keys' norm without its weight
            v = self.v_norm.scale(k_normalized, x.dtype).transpose(1, 2)
        else:
            v = self.v_norm(self.v_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               kv_fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Attention of the block's queries over the keys/values `kv_fn` joins to the block's; (B*T, heads*D),
        before the output projection."""
        b, t = q.shape[:2]
        k, v = kv_fn(k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return out.transpose(1, 2).reshape(b * t, -1)


# -- the exact layers in C++ (printpress/kernels/layers.cpp) ----------------------------------------------------
#
# `Layer.attention_inputs` and `Layer.after_attention` are ~35 and ~75 small ATen operators each; with gradients off
# (inference), outside compiled graphs, printpress_layers runs the same operators from C++ in the same order, so the
# same bits without the Python between them. `NATIVE_LAYERS = False` turns it off (the tests compare both sides).
NATIVE_LAYERS = True

# Bumped whenever a module registers a submodule, a parameter or a buffer (a quantized linear swapped in, a new
# weight assigned) and whenever a layer's tensors are converted or moved (`Layer._apply`): a layer's plan (the list of
# its weights it hands the C++ operators) is remade when the generation it was made in has passed.
_generation = 0


def _bump_generation(*_args) -> None:
    global _generation
    _generation += 1


torch.nn.modules.module.register_module_module_registration_hook(_bump_generation)
torch.nn.modules.module.register_module_parameter_registration_hook(_bump_generation)
torch.nn.modules.module.register_module_buffer_registration_hook(_bump_generation)


# AR steps read their RoPE tables from tables of blocks of positions (`DiffusionGemma._block_rope`); the blocks used
# last are kept.
ROPE_BLOCK = 64
ROPE_BLOCKS_KEPT = 8
_rope_rows_checked: dict[tuple, bool] = {}  # `DiffusionGemma._rope_rows_hold`, per head sizes, dtype and device type

# Whether the C++ layers read each weight ahead of its product (layers.cpp, `warm`: the same numbers, faster where
# the weights leave the caches between passes): None measures it once per process, after the first pass of a model
# whose layers all ran through them (`choose_warm_weights`, ~60 ms on the shipped model), for products of a few rows
# and of many apart; True or False decides both without measuring.
WARM_WEIGHTS: bool | None = None
WARM_ROUNDS = 7  # cycles over the weights with and without, the medians compared
_warm_chosen = False
# Where it was measured: seconds per cycle over the weights, products of 1 row without and with, of 32 rows without
# and with (each kind is turned on where it wins).
warm_measurement: tuple[float, float, float, float] | None = None


def choose_warm_weights(model: DiffusionGemma) -> None:
    """Turns the C++ layers' weight warming on or off for this process (WARM_WEIGHTS, or measured on `model`'s
    weights), once, after a pass in which all of `model`'s layers ran through the C++ layers (their plans current,
    their weights plain tensors holding their data: not FSDP's shards or freed gathers). Makes no plan itself."""
    global _warm_chosen, warm_measurement
    plans = [layer._native for layer in model.layers]
    if _warm_chosen or not all(isinstance(plan, NativePlan) and plan.generation == _generation for plan in plans):
        return
    weights = [w for plan in plans for w in plan.attention + plan.after_decoder]
    if any(type(w) not in (torch.Tensor, nn.Parameter) or w.untyped_storage().nbytes() == 0 for w in weights):
        return
    _warm_chosen = True
    if WARM_WEIGHTS is None:
        warm_measurement = tuple(torch.ops.printpress_layers.choose_warm(weights, WARM_ROUNDS))
        logger.info("weights read ahead of their products (few rows, many): %s; a cycle over them with 1 row %.2f ms "
                    "without, %.2f with; 32 rows %.2f without, %.2f with", torch.ops.printpress_layers.warm_enabled(),
                    *(1e3 * t for t in warm_measurement))
    else:
        torch.ops.printpress_layers.set_warm(WARM_WEIGHTS, WARM_WEIGHTS)


def warm_choice() -> dict | None:
    """What this process chose for reading weights ahead (which kinds of products, and the cycle times in ms it
    measured to choose, if it measured): speed figures depend on it, so reports record it. None before a choice."""
    if not _warm_chosen:
        return None
    few, many = torch.ops.printpress_layers.warm_enabled()
    return {"few_rows": few, "many_rows": many,
            "cycle_ms_1_row_without_with_32_rows_without_with":
                None if warm_measurement is None else [round(1e3 * t, 3) for t in warm_measurement]}


def settle_warm_weights(model: DiffusionGemma) -> None:
    """Makes `model`'s layer plans and this process's weight-reading choice now rather than in its first pass (a
    server's or a chat's first request); nothing where the C++ layers do not run or the choice is made."""
    with torch.no_grad():
        for layer in model.layers:
            layer._plan()
        choose_warm_weights(model)


def _cpp_layers_for(x: torch.Tensor) -> bool:
    """Whether printpress_layers' operators may take `x` now: on, loaded, a CPU tensor, gradients off, not
    compiling (the model's head and final norm ask this; the layers' plans ask it in `Planned._plan`)."""
    return (NATIVE_LAYERS and native.loaded("layers.cpp") and x.is_cpu and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def allow_half_width(model: nn.Module) -> bool:
    """Lets printpress_layers read `model`'s weights from half-width copies where their values are float16s or
    bfloat16s (the same bits, fewer bytes: layers.cpp, "the half-width copies"): for a model used for inference, whose
    weights change, if at all, only through in-place operations on the parameters (which the copies notice), not
    through `.data` or storage tricks (which they would not). `printpress.load` calls it. False where the C++ layers
    are not built or not on, or the model is not a float32 one on the CPU (nothing to copy)."""
    weight = model.get_parameter("embed_tokens.weight") if hasattr(model, "embed_tokens") else None
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    if not NATIVE_LAYERS or not native_layers():
        return False
    torch.ops.printpress_layers.allow_half_width([param.detach() for param in model.parameters()])
    return True


def native_layers() -> bool:
    """Whether printpress_layers is loaded (built on a machine's first inference pass, ~10 s, then cached)."""
    return native.load("layers.cpp", "the layers run through Python (the same numbers, slower)", lambda: None)


@dataclass
class NativePlan:
    """What a layer hands printpress_layers: its weights in the operators' order, and its sizes."""

    generation: int
    attention: list[torch.Tensor]
    after_decoder: list[torch.Tensor]
    after_encoder: list[torch.Tensor]
    head_dim: int
    eps: float
    top_k: int
    root_size: float
    act: int
    gqa: bool  # fewer key/value heads than query heads
    scale: float  # the attention's


def stock_modules(module: nn.Module, linears: list[nn.Module], norms: list[nn.Module]) -> bool:
    """Whether printpress_layers can run `module`'s part: its tensors on the CPU, its `linears` plain nn.Linear
    without a bias, its `norms` RMSNorm with one eps, and the library built."""
    return (all(tensor.device.type == "cpu" for tensor in (*module.parameters(), *module.buffers()))
            and all(type(linear) is nn.Linear and linear.bias is None for linear in linears)
            and all(type(norm) is RMSNorm for norm in norms) and len({norm.eps for norm in norms}) == 1
            and native_layers())


def native_plan(layer: Layer) -> NativePlan | None:
    """The layer's plan, or None where the C++ layers cannot stand in for the Python methods (weights off the CPU,
    another module swapped in, a bias, an activation they do not know, norms with different eps, the library not
    built)."""
    attn, mlp, router, experts = layer.self_attn, layer.mlp, layer.router, layer.experts
    linears = [attn.q_proj, attn.k_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, router.proj]
    linears += [] if attn.v_proj is None else [attn.v_proj]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm, layer.post_feedforward_layernorm_1, layer.pre_feedforward_layernorm_2,
             layer.post_feedforward_layernorm_2, attn.q_norm, attn.k_norm, attn.v_norm, router.norm]
    act = ACTIVATION_CODES.get(mlp.act)
    if (type(experts) is not Experts or act is None or ACTIVATION_CODES.get(experts.act) != act
            or attn.v_norm.weight is not None or router.norm.weight is not None
            or not stock_modules(layer, linears, norms)):
        return None
    # The matrices go transposed, (in, out): the views the products read, made once here rather than per product.
    attention = [layer.input_layernorm.weight, attn.q_proj.weight.t(), attn.k_proj.weight.t(), attn.q_norm.weight,
                 attn.k_norm.weight] + ([] if attn.v_proj is None else [attn.v_proj.weight.t()])
    after = [attn.o_proj.weight.t(), layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
             mlp.gate_proj.weight.t(), mlp.up_proj.weight.t(), mlp.down_proj.weight.t(),
             layer.post_feedforward_layernorm_1.weight, router.scale, router.proj.weight.t(), router.per_expert_scale,
             layer.pre_feedforward_layernorm_2.weight, experts.gate_up_proj.transpose(1, 2),
             experts.down_proj.transpose(1, 2), layer.post_feedforward_layernorm_2.weight,
             layer.post_feedforward_layernorm.weight]
    return NativePlan(_generation, attention, after + [layer.layer_scalar], after + [layer.encoder_layer_scalar],
                      attn.head_dim, layer.input_layernorm.eps, router.top_k, router.root_size, act,
                      attn.num_kv_heads != attn.num_heads, attn.scale)


def _has_global_hooks() -> bool:
    """Whether forward hooks registered for every module (`nn.modules.module.register_module_forward_hook`) would
    see a layer's call."""
    module = torch.nn.modules.module
    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def native_layer(plan: NativePlan, x: torch.Tensor, shape: tuple[int, int], rope, mask, join: KVJoin,
                 encoder: bool) -> torch.Tensor:
    """`Layer.forward` by its plan: attention_inputs, attend and after_attention in one C++ call."""
    return torch.ops.printpress_layers.layer(
        x, plan.attention, plan.after_encoder if encoder else plan.after_decoder, shape[0], shape[1], plan.head_dim,
        plan.eps, rope[0], rope[1], join.keys, join.values, mask, join.in_place, join.start, join.wrap, join.keep,
        join.write_at, join.slots, plan.gqa, plan.scale, plan.top_k, plan.root_size, plan.act)


class ProcessOnly:
    """A value a model keeps for this process only, such as a LayerStack (a C++ object that cannot be copied): a copy
    of the model (copy.deepcopy, pickle) holds None in its place and makes its own."""

    __slots__ = ("value",)

    def __init__(self, value=None) -> None:
        self.value = value

    def __reduce__(self):
        return ProcessOnly, ()


def layer_stack(plans: list[NativePlan], specs: list[LayerSpec]) -> torch.ScriptObject:
    """The layers' plans handed to printpress_layers once, for `printpress_layers.layers` to run them all in one call
    (layers.cpp, "a model's layers in one call")."""
    stack = torch.classes.printpress_layers.LayerStack()
    for plan, spec in zip(plans, specs):
        stack.add(plan.attention, plan.after_decoder, plan.after_encoder, plan.head_dim, plan.eps, plan.gqa, plan.scale,
                  plan.top_k, plan.root_size, plan.act, spec.sliding)
    return stack


def join_arguments(joins: list[KVJoin]) -> list[list]:
    """What `printpress_layers.layers` takes of each layer's join, one list per field, in the operator's order: the
    cache's keys and values, whether in place, start, wrap, keep, write_at and slots."""
    return [[j.keys for j in joins], [j.values for j in joins], [j.in_place for j in joins], [j.start for j in joins],
            [j.wrap for j in joins], [j.keep for j in joins], [j.write_at for j in joins], [j.slots for j in joins]]


def _native_now() -> bool:
    """Whether the C++ operators may stand in for the Python methods now: on, gradients off, not compiling."""
    return NATIVE_LAYERS and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class Planned(nn.Module):
    """A module printpress_layers can stand in for: its plan (the weights it hands the C++ operator, in order) is
    made on first use and remade when the generation it was made in has passed; None where the C++ operator cannot
    stand in (`make_plan`)."""

    _native: object = False  # the plan once made (None: not possible)

    def make_plan(self):
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        _bump_generation()  # the tensors a plan holds may be replaced (buffers are, on a dtype or device change)
        return super()._apply(fn, recurse)

    def _plan(self):
        """The plan, where the C++ operator stands in for the Python methods now (`_native_now`)."""
        if not _native_now():
            return None
        plan = self._native
        if plan is False or (plan is not None and plan.generation != _generation):
            plan = self._native = self.make_plan()
        return plan


class Layer(Planned):
    def __init__(self, config: TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, spec)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_activation)
        self.router = Router(config)
        self.experts = Experts(config)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
        self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        # The checkpoint stores a scalar per mode; they are equal in released weights but kept apart to be exact.
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def make_plan(self) -> NativePlan | None:
        return native_plan(self)

    def forward(self, x, shape: tuple[int, int], rope, mask, kv_fn, encoder: bool | torch.Tensor) -> torch.Tensor:
        """One layer over x (B*T, H), the rows of `shape` = (B, T) sequences. Rows, not (B, T, H): every linear
        is then one mm, without the views matmul wraps around a 3-D input (the same mm, so the same bits).

        `encoder` picks the mode's layer scalar: a bool, or a (T,) bool tensor when one sequence mixes encoder
        (clean) and decoder (canvas) tokens, as block-diffusion training does."""
        plan = None if isinstance(encoder, torch.Tensor) or not isinstance(kv_fn, KVJoin) else self._plan()
        if plan is not None:  # the three parts in one C++ call
            return native_layer(plan, x, shape, rope, mask, kv_fn, encoder)
        attended = self.self_attn.attend(*self.attention_inputs(x, shape, rope), mask, kv_fn)
        return self.after_attention(x, attended, shape, encoder)

    def attention_inputs(self, x: torch.Tensor, shape: tuple[int, int], rope: tuple[torch.Tensor, torch.Tensor]):
        """Queries, keys and values of the layer's input (the part before the cache is read)."""
        plan = self._plan()
        if plan is not None:
            return torch.ops.printpress_layers.attention_inputs(x, plan.attention, shape[0], shape[1], plan.head_dim,
                                                                plan.eps, rope[0], rope[1])
        return self.self_attn.project(self.input_layernorm(x), shape, rope)

    def after_attention(self, x: torch.Tensor, attended: torch.Tensor, shape: tuple[int, int],
                        encoder: bool | torch.Tensor) -> torch.Tensor:
        """The rest of the layer, from the attention output (before `o_proj`): per token, no cache."""
        plan = None if isinstance(encoder, torch.Tensor) else self._plan()
        if plan is not None:
            return torch.ops.printpress_layers.after_attention(
                x, attended, plan.after_encoder if encoder else plan.after_decoder, plan.top_k, plan.root_size,
                plan.eps, plan.act)
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(attended))
        # The dense MLP, the experts and the router each norm this same x: normalize once, weight three times.
        normalized = rms_normalize(x, self.pre_feedforward_layernorm.eps)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm.scale(normalized, x.dtype)))
        weights, experts = self.router.route(self.router.norm.scale(normalized, x.dtype))
        sparse = self.experts(self.pre_feedforward_layernorm_2.scale(normalized, x.dtype), weights, experts)
        x = x + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(sparse))
        if isinstance(encoder, torch.Tensor):
            scalar = torch.where(encoder[:, None], self.encoder_layer_scalar, self.layer_scalar)
            return (x.view(*shape, -1) * scalar).view(x.shape)
        return x * (self.encoder_layer_scalar if encoder else self.layer_scalar)


@dataclass
class SelfConditioningPlan:
    """What printpress_layers.self_conditioning takes: the pre-norm's and the MLP's weights, eps, the activation."""

    generation: int
    weights: list[torch.Tensor]
    eps: float
    act: int


class SelfConditioning(Planned):
    """Mixes the previous step's soft predictions into the canvas embeddings (zeros at the first step)."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_norm = RMSNorm(h, eps)
        self.post_norm = RMSNorm(h, eps, with_scale=False)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.act = activation(config.hidden_activation)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is None:  # the MLP of zeros is zero: skip it
            return self.post_norm(embeds)
        plan = self._plan()
        if plan is not None:
            return torch.ops.printpress_layers.self_conditioning(embeds, soft, plan.weights, plan.eps, plan.act)
        normed = self.pre_norm(soft)
        return self.post_norm(embeds + self.down_proj(self.act(self.gate_proj(normed)) * self.up_proj(normed)))

    def make_plan(self) -> SelfConditioningPlan | None:
        """The plan where printpress_layers can stand in (CPU weights, the stock modules, a known activation)."""
        linears = [self.gate_proj, self.up_proj, self.down_proj]
        act = ACTIVATION_CODES.get(self.act)
        if (act is None or self.pre_norm.weight is None or self.post_norm.weight is not None
                or not stock_modules(self, linears, [self.pre_norm, self.post_norm])):
            return None
        weights = [self.pre_norm.weight] + [linear.weight.t() for linear in linears]  # transposed, as in `native_plan`
        return SelfConditioningPlan(_generation, weights, self.pre_norm.eps, act)


@dataclass
class Masks:
    """Boolean attention masks per layer kind, (B or 1, 1, T, S); None means "attend to everything"."""

    sliding: torch.Tensor | None
    full: torch.Tensor | None

    def __getitem__(self, sliding: bool) -> torch.Tensor | None:
        return self.sliding if sliding else self.full


class DiffusionGemma(nn.Module):
    """The shared backbone with `encode` (causal, writes the cache) and `denoise` (bidirectional)."""

    # The model's draft table (printpress/draft_table.py), which `load` reads from beside the weights: speculative
    # drafts and `canvas_start="table"` read it. None: the model has none.
    draft_table = None

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.specs = config.layers
        # On the meta device (`checkpoint.build_empty`, whose loader writes every value) nn.Embedding's own draw is
        # skipped: a normal_ there imports torch._dynamo (~1.1 s of every load). Elsewhere it draws as it always did,
        # so a seed gives the same initial weights as before.
        meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size) if meta else None)
        self.layers = nn.ModuleList(Layer(config, spec) for spec in self.specs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(config)
        for name, value in self.rope_buffers(config).items():
            self.register_buffer(name, value, persistent=False)
        self._rope_memo: tuple | None = None  # (key, positions, tables) of the last canvas (`_canvas_rope`)
        # RoPE tables of the blocks of ROPE_BLOCK positions used last, newest last (`_block_rope`).
        self._rope_blocks: OrderedDict[tuple, dict] = OrderedDict()
        self._rope_rows: OrderedDict[tuple, dict] = OrderedDict()  # one position's views of them (`_block_rope`)
        self._rope_head_dims: tuple[int, ...] | None = None
        self._embed_scale_memo: torch.Tensor | None = None
        self._stack_memo = ProcessOnly()  # holds (generation, the layers' LayerStack): `_layer_stack`
        # Opt-in, not bit-exact: AR steps through one compiled graph (`printpress.fast.compile_ar_step`).
        self.compiled_ar_step: CompiledARStep | None = None
        # ... and blocks of several unpadded tokens (verifications, prompts), with it (`CompiledEncoderBlock`).
        self.compiled_encoder: CompiledEncoderBlock | None = None
        # Opt-in, not bit-exact: decoder passes through one compiled graph (`printpress.fast.compile_decoder`).
        self.compiled_decoder: CompiledDecoderPass | None = None
        # ... and the fused passes (a block encoded beside canvas rows), with it (`CompiledFusedPass`).
        self.compiled_fused_pass: CompiledFusedPass | None = None
        # Opt-in, not exact: the logits from an int8 copy of the tied embedding (`printpress.quantize`, "int8-head").
        self.lm_head: nn.Module | None = None
        self.reset_parameters()

    @staticmethod
    def rope_buffers(config: TextConfig) -> dict[str, torch.Tensor]:
        """RoPE inverse frequencies per layer kind (computed from the config, never stored), on the default device.
        Computed on the CPU, as the reference computes them: on the meta device (`checkpoint.build_empty`) arange runs
        through torch._refs, whose first use imports torch._dynamo (~1.1 s of every load)."""
        device = torch.get_default_device()
        with torch.device("cpu"):
            return {f"{kind}_inv_freq": rope_inv_freq(config, spec).to(device)
                    for kind, spec in _first_spec_per_kind(config).items()}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init as the reference does it: N(0, initializer_range) matrices, ones for norms and scales."""
        if self.embed_tokens.weight.is_meta:  # no values to draw (the loader writes them); see __init__
            return
        std = self.config.initializer_range
        for name, param in self.named_parameters():
            if param.dim() >= 2:
                nn.init.normal_(param, 0.0, std)
            else:
                nn.init.ones_(param)
        if self.config.pad_token_id is not None:
            self.embed_tokens.weight[self.config.pad_token_id].zero_()

    # -- shared pieces ------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight().dtype

    def embedding_weight(self) -> torch.Tensor:
        """`self.embed_tokens.weight`, found without nn.Module's attribute fallback: on Python 3.11 each lookup that
        reaches `Module.__getattr__` first builds the AttributeError of the plain lookup (~2 us), and a pass made
        several of these."""
        module = self._modules["embed_tokens"]
        if torch.compiler.is_compiling():
            return module.weight
        weight = module._parameters.get("weight") if type(module) is nn.Embedding else None
        return weight if weight is not None else module.weight

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        return KVCache(self.config, batch_size, max_length, dtype=self.dtype, device=self.embedding_weight().device)

    def embed_scale(self) -> torch.Tensor:
        """The embeddings' scale, rounded to the weight dtype first as the reference rounds it (it matters in bf16);
        kept while the weights' dtype and device stay."""
        weight = self.embedding_weight()
        if torch.compiler.is_compiling():
            return torch.tensor(self.config.embed_scale, dtype=torch.float32, device=weight.device).to(weight.dtype)
        memo = self._embed_scale_memo
        if memo is None or memo.dtype != weight.dtype or memo.device != weight.device:
            memo = self._embed_scale_memo = torch.tensor(self.config.embed_scale, dtype=torch.float32,
                                                         device=weight.device).to(weight.dtype)
        return memo

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # F.embedding's own operator, without its Python checks (~30 us a call here): padding_idx as F.embedding
        # passes it (it only keeps that row's gradient at zero)
        weight, pad = self.embedding_weight(), self.config.pad_token_id
        padding_idx = -1 if pad is None else pad if pad >= 0 else weight.shape[0] + pad
        return torch.embedding(weight, ids, padding_idx) * self.embed_scale()

    def embed_canvas(
        self,
        canvas_ids: torch.Tensor,
        self_conditioning_logits: torch.Tensor | None,
        self_conditioning_mask: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Canvas embeddings with the previous step's soft predictions mixed in (the decoder's input).

        `self_conditioning_mask` (B,) zeroes the signal of some rows, as if they had no previous step.
        `probs` may replace the logits: their float32 softmax, already computed.
        """
        soft = None
        if self_conditioning_logits is not None and probs is None:
            probs = F.softmax(self_conditioning_logits, dim=-1, dtype=torch.float32)
        if probs is not None:
            probs = probs.to(self.dtype)
            weight = self.embed_tokens.weight
            if probs.is_contiguous() and _cpp_layers_for(probs):
                # matmul's mm of the rows, by printpress_layers where a kernel of its order applies: the same bits.
                rows = torch.ops.printpress_layers.product(probs.view(-1, probs.shape[-1]), weight)
                soft = rows.view(*probs.shape[:-1], -1) * self.embed_scale()
            else:
                soft = (probs @ weight) * self.embed_scale()
            if self_conditioning_mask is not None:
                soft = soft * self_conditioning_mask.to(soft.dtype)[:, None, None]
        return self.self_conditioning(self.embed(canvas_ids), soft)

    def logits(self, hidden: torch.Tensor, capped: bool = True) -> torch.Tensor:
        """float32 next-token logits of final hidden states (..., H): the head, then the final softcap (`capped=False`
        leaves it to the caller, as `capped_argmax` does)."""
        head, cap = self.lm_head, self.config.final_logit_softcapping if capped else None
        if head is None and hidden.is_contiguous() and _cpp_layers_for(hidden):
            # F.linear's mm, its weight read ahead in blocks where that pays (layers.cpp, `head`), and for float32
            # the softcap's operators in the same call: the same bits.
            in_call = cap if cap and hidden.dtype == torch.float32 else 0.0
            rows = torch.ops.printpress_layers.head(hidden.view(-1, hidden.shape[-1]), self.embedding_weight(),
                                                    in_call)
            logits = rows.view(*hidden.shape[:-1], -1)
            if in_call:
                return logits
            logits = logits.float()
        else:
            logits = (F.linear(hidden, self.embed_tokens.weight) if head is None else head(hidden)).float()
        return softcap(logits, cap) if cap else logits

    def rope(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos and signed sin (see `rotate`) per layer kind for `positions` (T,) or per row (B, T), shaped
        (1 or B, T, 1, D)."""
        out = {}
        rows = positions if positions.dim() == 2 else positions[None]
        for kind in _first_spec_per_kind(self.config):
            freqs = rows.float()[..., None] * getattr(self, f"{kind}_inv_freq").float()
            emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
            sin = emb.sin().to(self.dtype)
            half = sin.shape[-1] // 2
            out[kind == "sliding"] = (emb.cos().to(self.dtype), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1))
        return out

    def _block_rope(self, start: int, t: int,
                    device: torch.device) -> dict[bool, tuple[torch.Tensor, torch.Tensor]] | None:
        """`self.rope` of positions start..start + t - 1 (the same for every row) as views into the tables of the block
        of ROPE_BLOCK positions they lie in, kept for the last ROPE_BLOCKS_KEPT blocks: an AR step reads its row
        rather than computing it (~70 us of small kernels on the shipped model), and a position's views are kept too
        (as many as the blocks' positions), so a step makes none (~20 us of indexing). None where the positions span
        two blocks, inside compiled graphs, or where a table's rows are not the positions' own computation on this
        machine (`_rope_rows_hold`)."""
        if t == 1 and not torch.compiler.is_compiling():  # an AR step: its position's views, once made
            row_key = (start, self.dtype, device)
            row = self._rope_rows.get(row_key)
            if row is not None:
                return row
        block = start // ROPE_BLOCK
        if (start + t - 1) // ROPE_BLOCK != block or torch.compiler.is_compiling() or not self._rope_rows_hold(device):
            return None
        key = (block, self.dtype, device)
        tables = self._rope_blocks.get(key)
        if tables is None:
            tables = self._rope_blocks[key] = self.rope(
                torch.arange(block * ROPE_BLOCK, (block + 1) * ROPE_BLOCK, device=device))
            while len(self._rope_blocks) > ROPE_BLOCKS_KEPT:
                self._rope_blocks.popitem(last=False)
        else:
            self._rope_blocks.move_to_end(key)
        first = start - block * ROPE_BLOCK
        views = {kind: (cos[:, first : first + t], sin[:, first : first + t]) for kind, (cos, sin) in tables.items()}
        if t == 1:
            self._rope_rows[row_key] = views
            while len(self._rope_rows) > ROPE_BLOCK * ROPE_BLOCKS_KEPT:
                self._rope_rows.popitem(last=False)
        return views

    def _rope_rows_hold(self, device: torch.device) -> bool:
        """Whether the rows of a table of many positions are, bit for bit, the tables of each position alone (cos
        and sin give each element the same bits whatever the length of the tensor around it): checked once per
        process for each head size, dtype and device, on the first ROPE_BLOCK positions."""
        if self._rope_head_dims is None:  # (the config's layer list is rebuilt on each access)
            self._rope_head_dims = tuple(spec.head_dim for spec in _first_spec_per_kind(self.config).values())
        key = (self._rope_head_dims, self.dtype, device.type)
        holds = _rope_rows_checked.get(key)
        if holds is None:
            table = self.rope(torch.arange(ROPE_BLOCK, device=device))
            holds = all(
                torch.equal(whole[:, p : p + 1], alone)
                for p in (*range(8), ROPE_BLOCK - 1)
                for kind, tables in self.rope(torch.arange(p, p + 1, device=device)).items()
                for whole, alone in zip(table[kind], tables)
            )
            _rope_rows_checked[key] = holds
            if not holds:
                logger.info("RoPE tables computed per step: a table's rows differ from single positions' here")
        return holds

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, masks: Masks, kv: KVFn | list[KVJoin] | None,
        encoder: bool | torch.Tensor, ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """All layers and the final norm. `kv` turns each layer's block keys/values into the keys/values it attends
        to (joining a cache): one `KVJoin` per layer (which the C++ layers can run), or a function `kv(layer, k, v)`;
        None attends within the block only. `ropes`: `self.rope(positions)`, if the caller already has it."""
        if ropes is None:
            ropes = self.rope(positions)
        b, t, h = x.shape
        x = x.reshape(b * t, h)
        stack = self._layer_stack() if isinstance(kv, list) and isinstance(encoder, bool) else None
        if stack is not None:  # every layer in one C++ call, without nn.Module's call around each
            sliding, full = ropes.get(True, (None, None)), ropes.get(False, (None, None))
            # the operator's own callable: the packet's call first looks through every argument for a traced
            # stand-in of the LayerStack (~50 us here), which only a compiler's tracing makes, never this path
            packet = torch.ops.printpress_layers.layers
            x = getattr(packet, "_op", packet)(x, stack, encoder, b, t, *sliding, *full, masks.sliding, masks.full,
                                               *join_arguments(kv))
        else:
            for index, (layer, spec) in enumerate(zip(self.layers, self.specs)):
                if kv is None:
                    layer_kv = _identity_kv
                elif isinstance(kv, list):
                    layer_kv = kv[index]
                else:
                    layer_kv = lambda k, v, i=index: kv(i, k, v)
                x = layer(x, (b, t), ropes[spec.sliding], masks[spec.sliding], layer_kv, encoder)
        if not _warm_chosen:
            choose_warm_weights(self)
        if type(self.norm) is RMSNorm and _cpp_layers_for(x):
            return torch.ops.printpress_layers.rms_norm(x, self.norm.weight, self.norm.eps).view(b, t, h)
        return self.norm(x).view(b, t, h)

    def _layer_stack(self) -> torch.ScriptObject | None:
        """Every layer's plan as one LayerStack (`layer_stack`), where each layer is a stock `Layer` that its C++ call
        stands in for now (its plan made in this generation: `Planned._plan`) and no hook would see its call; else
        None (each layer is then called as a module)."""
        if not _native_now():
            return None
        memo = self._stack_memo.value
        if memo is not None and memo[0] == _generation:
            stack = memo[1]
        else:
            plans = [layer._plan() if type(layer) is Layer else None for layer in self.layers]
            if any(plan is None for plan in plans):
                return None
            stack = layer_stack(plans, self.specs)
            self._stack_memo.value = (_generation, stack)
        if _has_global_hooks() or any(layer._forward_hooks or layer._forward_pre_hooks for layer in self.layers):
            return None
        return stack

    # -- encoder --------------------------------------------------------------------------------------------
    def encode(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        attention_mask: torch.Tensor | None = None,
        logits: LogitsMode = "all",
        argmax: bool = False,
    ) -> torch.Tensor | None:
        """Causal pass over `input_ids` (B, T) after what `cache` holds; appends them to the cache.

        `attention_mask` (B, T) marks real tokens (False for left padding). Returns float32 next-token
        logits for every position ("all"), the last one ("last"), or nothing ("none"); with `argmax`, their argmax
        instead (int64, the first of equal maxima: greedy decoding's tokens), which the exact path finds without
        softcapping the whole vocabulary (`capped_argmax`).
        """
        step = self.compiled_ar_step
        if step is not None and step.covers(input_ids, cache, attention_mask, logits):
            out = step(input_ids, cache)
            if out is not None:
                return row_argmax(out) if argmax else out
        block = self.compiled_encoder
        if block is not None and block.covers(input_ids, cache, attention_mask, logits):
            out = block(input_ids, cache, logits)
            if out is not None:
                return None if logits == "none" else row_argmax(out) if argmax else out
        hidden = self._encoder_pass(input_ids, cache, attention_mask)
        if logits == "none":
            return None
        return self._block_logits(hidden[:, -1:] if logits == "last" else hidden, argmax)

    def _encoder_pass(self, input_ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None,
                      tentative: bool = False) -> tuple[torch.Tensor, Callable[[int], None]] | torch.Tensor:
        """`encode`'s eager pass: the final hidden states (B, T, H), the cache advanced; with `tentative` (no
        padding), the hidden states and `keep(n)`, the cache holding the block only as `KVCache.tentative_joins`
        leaves it until then."""
        t = input_ids.shape[1]
        cache.check_room(t)
        start = cache.length
        positions = torch.arange(start, start + t, device=input_ids.device)
        new_valid = None if attention_mask is None else attention_mask.to(torch.bool)
        masks = self._encoder_masks(cache, positions, new_valid)
        if tentative:
            joins, keep = cache.tentative_joins(t)
        else:
            joins = [cache.encoder_join(index, t) for index in range(len(self.layers))]
        if start == 0 and new_valid is not None:
            cache.set_offsets(new_valid)
        row_positions = cache.row_positions(positions)
        ropes = self._block_rope(start, t, input_ids.device) if row_positions is positions else None
        hidden = self.run_layers(self.embed(input_ids), row_positions, masks, joins, encoder=True, ropes=ropes)
        if tentative:
            return hidden, keep
        cache.advance(t, new_valid)
        return hidden

    def _block_logits(self, hidden: torch.Tensor, argmax: bool) -> torch.Tensor:
        """`self.logits(hidden)`, or with `argmax` their argmax, found without the softcap's tanh over the whole
        vocabulary (`capped_argmax`)."""
        if argmax:
            return capped_argmax(self.logits(hidden, capped=False), self.config.final_logit_softcapping)
        return self.logits(hidden)

    def encode_tentatively(self, input_ids: torch.Tensor, cache: KVCache,
                           argmax: bool = False) -> tuple[torch.Tensor, Callable[[int], None]]:
        """A causal pass over a block (B, T) of which only a leading part is kept, decided from its logits (a
        speculative verification): returns float32 logits for every position (with `argmax`, their argmax, as
        `encode` gives it) and `keep(n)`, which leaves the cache holding the block's first n tokens after what it
        held, as if only they had been encoded.

        The exact path writes the block's sliding-window keys and values beside the rings (`KVCache.tentative_joins`;
        in place while a ring has room after its filled slots) and `keep(n)` writes the kept ones in; a one-token
        block, which a compiled AR step may run, is encoded and rolled back (`KVCache.snapshot` / `truncate`); a
        compiled encoder block (`printpress.fast`) writes only the kept tokens."""
        block = self.compiled_encoder
        if block is not None and block.covers(input_ids, cache, None, "all"):
            out = block.tentatively(input_ids, cache)
            if out is not None:
                return (row_argmax(out[0]), out[1]) if argmax else out
        if input_ids.shape[1] > 1:
            hidden, keep = self._encoder_pass(input_ids, cache, None, tentative=True)
            return self._block_logits(hidden, argmax), keep
        snapshot = cache.snapshot(input_ids.shape[1])
        # One token's "all" is its "last", which a compiled AR step runs (a verification with no draft).
        out = self.encode(input_ids, cache, logits="last", argmax=argmax)
        return out, lambda n: cache.truncate(snapshot.length + n, snapshot)

    def _has(self, sliding: bool) -> bool:
        return any(spec.sliding == sliding for spec in self.specs)

    def _encoder_masks(self, cache: KVCache, positions: torch.Tensor, new_valid: torch.Tensor | None) -> Masks:
        """Causal (and windowed) masks over cached + new keys, None where every key is visible.

        One new token with no padding anywhere (an AR step) sees every cached key: the causal rule allows all of
        them and the sliding ring holds only the window before it. Attention without a mask is bit-identical to
        attention with an all-true one, and skipping it saves ~25 kernels per step."""
        if len(positions) == 1 and (new_valid is None or bool(new_valid.all())) and cache.all_valid():
            return Masks(sliding=None, full=None)
        if new_valid is None and _cpp_layers_for(positions) and cache.all_valid():  # no padding: from positions
            return Masks(sliding=self._causal_mask(cache, positions, sliding=True) if self._has(True) else None,
                         full=self._causal_mask(cache, positions, sliding=False) if self._has(False) else None)
        return Masks(
            sliding=self._encoder_mask(cache, positions, new_valid, sliding=True) if self._has(True) else None,
            full=self._encoder_mask(cache, positions, new_valid, sliding=False) if self._has(False) else None,
        )

    def _causal_mask(self, cache: KVCache, positions: torch.Tensor, sliding: bool) -> torch.Tensor:
        """`_encoder_mask` where every cached and new position holds a real token (a verification's block, a
        prompt), in one C++ call (a dozen operators from Python took ~0.1 ms a pass, cold between passes), and
        additive (0 where a key is seen, -inf elsewhere, the model's dtype), as scaled_dot_product_attention turns a
        boolean mask into in each layer: the same bits (tests/test_model.py) without that conversion per layer."""
        return torch.ops.printpress_layers.causal_mask(cache.prefix_positions(True) if sliding else None, cache.length,
                                                       len(positions), self.config.sliding_window if sliding else 0,
                                                       cache.batch_size, self.dtype)

    def _encoder_mask(self, cache: KVCache, positions: torch.Tensor, new_valid, sliding: bool) -> torch.Tensor | None:
        key_positions = torch.cat([cache.prefix_positions(sliding), positions])
        past_valid = cache.prefix_valid(sliding)
        new = new_valid if new_valid is not None else torch.ones(cache.batch_size, len(positions), dtype=torch.bool,
                                                                  device=positions.device)
        key_valid = torch.cat([past_valid, new], dim=1)  # (B, S)
        q, k = positions[:, None], key_positions[None, :]
        allowed = k <= q
        if sliding:
            allowed &= q - k < self.config.sliding_window
        mask = allowed[None, None] & key_valid[:, None, None, :]
        return _never_empty(mask)

    # -- decoder --------------------------------------------------------------------------------------------
    def denoise(
        self,
        canvas_ids: torch.Tensor,
        cache: KVCache,
        self_conditioning_logits: torch.Tensor | None = None,
        self_conditioning_probs: torch.Tensor | None = None,
        self_conditioning_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bidirectional pass over the canvas (B, C) and the cached context; returns float32 logits (B, C, V).

        Self-conditioning takes the previous step's logits, or their float32 softmax if the caller already
        has it (the sampler does: passing it saves one softmax over the vocabulary per step).
        `self_conditioning_mask` (B,) marks rows that have a previous step (the others get none)."""
        compiled = self.compiled_decoder
        if compiled is not None and compiled.covers():
            out = compiled(canvas_ids, cache, self_conditioning_logits, self_conditioning_probs, self_conditioning_mask)
            if out is not None:
                return out
        c = canvas_ids.shape[1]
        x = self.embed_canvas(canvas_ids, self_conditioning_logits, self_conditioning_mask, probs=self_conditioning_probs)
        masks = Masks(sliding=self._decoder_mask(cache, c, sliding=True), full=self._decoder_mask(cache, c, sliding=False))
        joins = [cache.decoder_join(index, c) for index in range(len(self.layers))]
        positions, ropes = self._canvas_rope(cache, c, canvas_ids.device)
        return self.logits(self.run_layers(x, positions, masks, joins, encoder=False, ropes=ropes))

    def _canvas_rope(self, cache: KVCache, canvas: int, device: torch.device) -> tuple[torch.Tensor, dict]:
        """Positions and RoPE tables of a canvas after `cache`. Every denoising step of a canvas has the same
        positions, so the last call's are kept while the cache length, canvas length and row offsets match."""
        key = (cache.length, canvas, tuple(cache.offsets.tolist()), self.dtype, device)
        if self._rope_memo is None or self._rope_memo[0] != key:
            positions = cache.row_positions(torch.arange(cache.length, cache.length + canvas, device=device))
            self._rope_memo = (key, positions, self.rope(positions))
        return self._rope_memo[1], self._rope_memo[2]

    def _decoder_mask(self, cache: KVCache, canvas: int, sliding: bool) -> torch.Tensor | None:
        if cache.all_valid():
            return None
        past_valid = cache.prefix_valid(sliding)
        if bool(past_valid.all()):
            return None
        canvas_valid = torch.ones(cache.batch_size, canvas, dtype=torch.bool, device=past_valid.device)
        return torch.cat([past_valid, canvas_valid], dim=1)[:, None, None, :]

    # -- encoder and decoder in one pass (fused speculative rounds) -----------------------------------------
    def verify_and_draft(
        self, block: torch.Tensor, canvases: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode(block)` and, for every outcome j < n, a first `denoise` step of canvas j after block[:j + 1],
        in one forward pass (mode="speculative" with fused drafts; TiDAR's layout).

        `block` (1, m + 1) is encoded causally after the cache at positions start..start + m (start =
        cache.length) and written to the cache exactly as `encode` writes it. Canvas j of `canvases` (n, L),
        n <= m + 1, sits at positions start + j + 1 .. start + j + L in decoder mode (no self-conditioning): it
        sees what `denoise` would see after the block's first j + 1 tokens were encoded (the cached prefix and
        block rows 0..j, the sliding layers the last `sliding_window - 1` positions before the canvas), and its
        own canvas bidirectionally; nothing else sees it and its keys are never stored. So the block's logits
        are `encode`'s and canvas j's are that `denoise`'s, up to rounding (more rows per GEMM, another key
        order). Batch 1 only.

        Returns the block's float32 next-token logits (m + 1, V) and the canvases' final hidden states
        (n, L, H): the caller turns only the realised outcome's positions into logits (`self.logits`), since the
        head over every canvas row would cost as much as a good part of the pass.
        """
        m1, (n, length) = block.shape[1], canvases.shape
        if not 0 <= n <= m1:
            raise ValueError(f"{n} canvases for a block of {m1} tokens: at most one per outcome")
        outcome = torch.arange(n, device=block.device).repeat_interleave(length)  # the outcome j of each canvas row
        logits, hidden = self._encode_beside(block, canvases.reshape(1, n * length), outcome, length, cache, None)
        return logits, hidden.view(n, length, -1)

    def encode_and_denoise(self, block: torch.Tensor, canvas: torch.Tensor, cache: KVCache,
                           self_conditioning_probs: torch.Tensor | None = None) -> torch.Tensor:
        """`encode(block)` and then `denoise(canvas)` after it, in one forward pass (a sliding canvas's step after a
        commit): `block` (1, m) is written to the cache exactly as `encode` writes it, and the canvas (1, L) sits right
        after it in decoder mode, self-conditioned on `self_conditioning_probs` (1, L, V) when given. The canvas's
        float32 logits (1, L, V) are `denoise`'s up to rounding (more rows per GEMM, another key order). Batch 1."""
        outcome = torch.full((canvas.shape[1],), block.shape[1] - 1, device=block.device)
        return self._encode_beside(block, canvas, outcome, canvas.shape[1], cache, self_conditioning_probs,
                                   canvas_logits=True)[1]

    def _encode_beside(self, block: torch.Tensor, canvas_rows: torch.Tensor, outcome: torch.Tensor, length: int,
                       cache: KVCache, probs: torch.Tensor | None, canvas_logits: bool = False):
        """The fused pass: `block` encoded after the cache, and canvas rows (1, R) in decoder mode, canvases of `length`
        rows one after another, row r after the block's first outcome[r] + 1 tokens (`_fused_mask`). Returns the
        block's logits (m, V) and the canvas rows' final hidden states (1, R, H); with `canvas_logits`, None and the
        canvas rows' logits (1, R, V). Through `compiled_fused_pass` when the decoder is compiled."""
        if block.shape[0] != 1 or not cache.all_valid():
            raise ValueError("a fused encoder and decoder pass takes one unpadded sequence (batch 1)")
        m1 = block.shape[1]
        cache.check_room(m1)
        start, device = cache.length, block.device
        block_positions = torch.arange(start, start + m1, device=device)
        canvas_positions = start + 1 + outcome + torch.arange(outcome.numel(), device=device) % length
        positions = torch.cat([block_positions, canvas_positions])
        masks = Masks(
            sliding=self._fused_mask(cache, block_positions, outcome, sliding=True) if self._has(True) else None,
            full=self._fused_mask(cache, block_positions, outcome, sliding=False) if self._has(False) else None,
        )
        compiled = self.compiled_fused_pass
        if compiled is not None and compiled.covers():
            out = compiled(block, canvas_rows, cache.row_positions(positions), masks, cache, probs, canvas_logits)
            if out is not None:
                return out

        def kv_fn(index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            block_k, block_v, canvas_k, canvas_v = k[:, :, :m1], v[:, :, :m1], k[:, :, m1:], v[:, :, m1:]
            if self.specs[index].sliding:
                past_k, past_v = cache.sliding_prefix(index)
                keys = torch.cat([past_k, block_k, canvas_k], dim=2)
                values = torch.cat([past_v, block_v, canvas_v], dim=2)
                cache.write(index, block_k, block_v)  # after the concatenation, as in `encode`
                return keys, values
            past_k, past_v = cache.full_with_block(index, block_k, block_v)  # the block written, as `encode` does
            return torch.cat([past_k, canvas_k], dim=2), torch.cat([past_v, canvas_v], dim=2)

        x = torch.cat([self.embed(block), self.embed_canvas(canvas_rows, None, probs=probs)], dim=1)
        is_encoder = torch.arange(x.shape[1], device=device) < m1
        hidden = self.run_layers(x, cache.row_positions(positions), masks, kv_fn, encoder=is_encoder)
        cache.advance(m1, None)
        if canvas_logits:
            return None, self.logits(hidden[:, m1:])
        return self.logits(hidden[0, :m1]), hidden[:, m1:]

    def _fused_mask(self, cache: KVCache, block_positions: torch.Tensor, outcome: torch.Tensor,
                    sliding: bool) -> torch.Tensor:
        """(1, 1, rows, keys) for `verify_and_draft`: rows = block, then canvas rows (of outcome `outcome`);
        keys = cached prefix (in `sliding_prefix` order), block, canvas rows.

        Block rows: `_encoder_mask`'s causal (and windowed) rule, and no canvas key. Canvas rows of outcome j,
        starting at position s = start + j + 1: every cached key and block rows 0..j, on sliding layers only
        those at s - (sliding_window - 1) or later (what the ring would hold once block[:j + 1] was encoded);
        and the rows of their own canvas."""
        window = self.config.sliding_window
        prefix = cache.prefix_positions(sliding)
        m1, device = block_positions.numel(), block_positions.device
        context = torch.cat([prefix, block_positions])  # positions of the keys the cache and the block give
        q = block_positions[:, None]
        block_rows = context[None, :] <= q
        if sliding:
            block_rows &= q - context[None, :] < window
        canvas_start = block_positions[0] + 1 + outcome[:, None]
        canvas_context = torch.cat([torch.ones(outcome.numel(), prefix.numel(), dtype=torch.bool, device=device),
                                    torch.arange(m1, device=device)[None, :] <= outcome[:, None]], dim=1)
        if sliding:
            canvas_context &= context[None, :] >= canvas_start - (window - 1)
        rows = torch.cat([
            torch.cat([block_rows, block_rows.new_zeros(m1, outcome.numel())], dim=1),
            torch.cat([canvas_context, outcome[:, None] == outcome[None, :]], dim=1),
        ])
        return rows[None, None]


def _identity_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


def _first_spec_per_kind(config: TextConfig) -> dict[str, LayerSpec]:
    found: dict[str, LayerSpec] = {}
    for spec in config.layers:
        found.setdefault("sliding" if spec.sliding else "full", spec)
    return found


def _never_empty(mask: torch.Tensor) -> torch.Tensor:
    """Let a query with no visible key (a left-pad position) see every key, so softmax stays finite.

    Such rows are padding: nothing reads their output, but NaNs would leak through the MoE scatter.
    """
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty
