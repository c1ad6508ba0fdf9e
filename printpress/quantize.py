"""Opt-in int8 weight-only quantization: `printpress.load(..., quantize="int8")`, `--quantize int8`. NOT exact.

What is quantized: every linear layer of the layers (attention q/k/v/o projections, the dense MLP) and of the
self-conditioning MLP, and the expert weights (gate_up_proj, down_proj, per expert). Each output channel gets
one float32 scale, max |w| / 127, and its weights round to int8 in [-127, 127] (symmetric, no zero point). What
stays exact: the embedding (so the tied LM head: the logits are computed from the float weights), the norms,
the router (its argmax picks the experts), the layer scalars.

How it runs: the int8 weights are packed once into blocks of 16 output channels (`pack`), and a small C++
kernel (printpress/kernels/int8_linear.cpp, compiled on first use with torch's extension builder and cached per
machine) reads each weight byte once, converting to float in registers, so a step reads a quarter of fp32's
weight bytes. Where it cannot run (no C++ compiler, activations that are not float32 CPU tensors: bf16,
CUDA), a layer dequantizes its weights on each call instead (`dequantize`): the same numbers, slower than the
float model. Under `torch.compile` (the opt-in compiled AR step, printpress.fast) the kernel is an opaque
operator; the experts' compiled path dequantizes inside the graph.

Measured on this project's machine (docs/benchmarks.md, "int8 weights"): the quality cost is small next to
sampling noise, and the speed depends on the size: the AR step of a DRAM-bound model gains, a cache-resident
model like the shipped one barely does (its steps are bound by per-operation overhead, not bytes).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from printpress import native
from printpress.model import Experts, Router, static_experts
from printpress.runtime_options import check_quantize

logger = logging.getLogger(__name__)

BLOCK = 16  # output channels per packed block (the kernel's register tile width)


# --------------------------------------------------------------------------------------------
# The numbers: quantize, pack, dequantize
# --------------------------------------------------------------------------------------------


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of weights (..., out, in): (int8 weights, float32 scales (..., out)),
    with weight ~= q * scale[..., None] and |q| <= 127. An all-zero row gets the smallest positive scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights (..., out, in) and scales (..., out) in the kernel's layout: blocks of BLOCK output channels,
    k-major, (..., ceil(out / BLOCK), in, BLOCK), and the scales padded to a whole block (padding rows: zeros)."""
    pad = -q.shape[-2] % BLOCK
    if pad:
        q = torch.cat([q, q.new_zeros(*q.shape[:-2], pad, q.shape[-1])], dim=-2)
        scale = torch.cat([scale, scale.new_ones(*scale.shape[:-1], pad)], dim=-1)
    blocks = q.unflatten(-2, (-1, BLOCK)).transpose(-1, -2).contiguous()
    return blocks, scale.contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The int8 weights (..., out, in) back from `pack`'s layout."""
    return packed.transpose(-1, -2).flatten(-3, -2)[..., :out_features, :]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, out_features: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weights (..., out, in) that packed int8 weights and their scales stand for."""
    weights = unpack(packed, out_features).float() * scale[..., :out_features, None]
    return weights if dtype == torch.float32 else weights.to(dtype)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int,
                kernel: bool) -> torch.Tensor:
    """x @ W^T for the weights W that (packed, scale) stand for: the C++ kernel for float32 CPU activations when
    `kernel`, else a dequantized copy of W through F.linear."""
    if kernel and x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.ops.printpress_int8.linear(x, packed, scale, out_features)
    return F.linear(x, dequantize(packed, scale, out_features, x.dtype))


# --------------------------------------------------------------------------------------------
# The kernel: compiled once per machine, loaded once per process
# --------------------------------------------------------------------------------------------


def load_kernel() -> bool:
    """Build (first use on this machine, 12-17 s here; then cached) and load the int8 kernel; False, with one
    warning, where it cannot be built (no compiler, no ninja)."""
    return native.load("int8_linear.cpp", "int8 layers dequantize their weights on each call, slower than float32",
                       _register_fake)


def _register_fake() -> None:
    @torch.library.register_fake("printpress_int8::linear")
    def _(x, packed, scale, out_features):  # shapes for torch.compile
        return x.new_empty((*x.shape[:-1], out_features))


# --------------------------------------------------------------------------------------------
# The modules that replace the float ones
# --------------------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """An nn.Linear with int8 weights (`pack`'s layout) and per-output-channel scales; the bias stays float."""

    quantized = "int8"

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None, kernel: bool) -> None:
        super().__init__()
        (self.out_features, self.in_features), self.kernel = weight.shape, kernel
        packed, scale = pack(*quantize_rows(weight))
        self.register_buffer("packed", packed.to(weight.device))
        self.register_buffer("scale", scale.to(weight.device))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_linear(x, self.packed, self.scale, self.out_features, self.kernel)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class Int8Experts(Experts):
    """`Experts` with int8 expert weights. The routing, grouping and weighting are Experts' own; each expert's MLP
    runs on its int8 weights (`expert_mlp`), and canvases run the used experts one after the other (the grouped
    GEMM has no int8 form). The packed weights keep Experts' names, so the expert count reads as before."""

    quantized = "int8"

    def __init__(self, experts: Experts, kernel: bool) -> None:
        nn.Module.__init__(self)
        self.act, self.kernel = experts.act, kernel
        self.gate_up_features, self.down_features = experts.gate_up_proj.shape[1], experts.down_proj.shape[1]
        device = experts.gate_up_proj.device
        for name in ("gate_up_proj", "down_proj"):
            packed, scale = pack(*quantize_rows(getattr(experts, name)))
            self.register_buffer(name, packed.to(device))
            self.register_buffer(name.removesuffix("_proj") + "_scale", scale.to(device))

    def expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = int8_linear(x, self.gate_up_proj[expert], self.gate_up_scale[expert], self.gate_up_features,
                               self.kernel).chunk(2, dim=-1)
        return int8_linear(self.act(gate) * up, self.down_proj[expert], self.down_scale[expert], self.down_features,
                           self.kernel)

    def _grouped(self, gathered: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
        return self._expert_loop(gathered, counts)

    def _static(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The compiled graph's path (printpress.fast): Experts' own (`static_experts`) on weights dequantized in
        the graph. A few tokens dequantize only the experts they use, renumbered in the order they are used."""
        n, k = experts.shape
        gate_up, gate_up_scale, down, down_scale = self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale
        if n * k <= gate_up.shape[0]:
            chosen = experts.reshape(-1)
            gate_up, gate_up_scale, down, down_scale = (t[chosen] for t in (gate_up, gate_up_scale, down, down_scale))
            experts = torch.arange(n * k, device=experts.device).view(n, k)
        return static_experts(x, weights, experts, dequantize(gate_up, gate_up_scale, self.gate_up_features, x.dtype),
                              dequantize(down, down_scale, self.down_features, x.dtype), self.act)


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


def quantize_model(model: nn.Module, mode: str = "int8", kernel: bool | None = None) -> dict[str, float]:
    """Replace the model's linear layers (but the router's) and expert weights with int8 ones, in place; returns
    {"layers", "float_mib", "int8_mib", "kernel"}. `kernel`: None builds and uses the C++ kernel where the model
    is on the CPU (falling back if it cannot be built), False always dequantizes (a reference for tests)."""
    check_quantize(mode)
    device = next(model.parameters()).device
    if kernel is None:
        kernel = device.type == "cpu" and load_kernel()
    elif kernel and not load_kernel():
        kernel = False
    layers, float_bytes, int8_bytes = 0, 0, 0
    for module in list(model.modules()):
        if isinstance(module, Router) or getattr(module, "quantized", None):
            continue
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                new: nn.Module = Int8Linear(child.weight, child.bias, kernel)
            elif type(child) is Experts:
                new = Int8Experts(child, kernel)
            else:
                continue
            float_bytes += sum(p.numel() * p.element_size() for p in child.parameters())
            int8_bytes += sum(b.numel() * b.element_size() for b in new.buffers())
            setattr(module, name, new)
            layers += 1
    if mode == "int8-head" and isinstance(getattr(model, "lm_head", False), type(None)):
        # The embedding stays float (lookups, the soft embedding of self-conditioning); the logits read a copy.
        model.lm_head = Int8Linear(model.embed_tokens.weight, None, kernel)
        int8_bytes += sum(b.numel() * b.element_size() for b in model.lm_head.buffers())
        layers += 1
    report = {"layers": layers, "float_mib": float_bytes / 2**20, "int8_mib": int8_bytes / 2**20, "kernel": kernel}
    logger.info("int8: %d weight sets quantized, %.1f MiB -> %.1f MiB (%s)", layers, report["float_mib"],
                report["int8_mib"], "C++ kernel" if kernel else "dequantized on each call: no kernel")
    return report


def is_quantized(model: nn.Module) -> bool:
    return any(getattr(module, "quantized", None) for module in model.modules())
