"""Quantized layers on CPU: shardline's native kernel in place of MLX's `quantized_matmul`.

MLX's CPU `quantized_matmul` runs one element at a time: a 4-bit decode step there took about twice the
time of the float32 product with OpenBLAS, which reads eight times the bytes. The kernel in csrc/qmm (built
at install as `shardline.compute._qmm`, an MLX primitive) computes the same product from MLX's affine
layout (packed uint32 weights, one scale and bias per group) with vector code: below `gemm_rows` (16)
rows of x it rounds x to int16 per block of 32 and uses exact integer dot products (AVX2, AVX-512; float32
arithmetic on the dequantized weights on other CPUs); from there on it dequantizes tiles of the weights and
calls BLAS. The integer path's only difference from the float32 product is x's rounding (at
most max|x_block| / 65534 per element); SHARDLINE_QMM_INT=0 keeps every product in float32.

Mixture-of-experts layers (mlx-lm's QuantizedSwitchLinear, MLX's `gather_qmm`) get the gathered twin of
this kernel: compute/quantized_experts.py. GPU builds keep MLX's own kernels: `load_shard` installs these
layers only when the default device is the CPU. A build without the module (or against another MLX
release, whose C++ ABI may differ) falls back to MLX's op with one warning.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

log = logging.getLogger("shardline.compute")

SUPPORTED_BITS = (4, 8)
THREADS_ENV = "SHARDLINE_THREADS"  # threads of the kernel's products in this process
SUPPORTED_GROUP_SIZES = (32, 64, 128)

_native: ModuleType | None = None
_loaded = False


def _import_native() -> ModuleType:
    from shardline.compute import _qmm  # type: ignore[attr-defined]

    return _qmm


def native() -> ModuleType | None:
    """The kernel module, or None (with one warning) where it is missing or was built for another MLX."""
    global _native, _loaded
    if _loaded:
        return _native
    _loaded = True
    if os.environ.get("SHARDLINE_QMM", "1") == "0":
        return None  # asked for MLX's op: no warning
    try:
        module = _import_native()
    except ImportError as exc:
        log.warning("native quantized kernel unavailable (%s); using MLX's slower quantized_matmul", exc)
        return None
    if mx.__version__.split(".dev")[0] != module.MLX_VERSION:
        log.warning(
            "native quantized kernel was built against MLX %s, this is MLX %s; using MLX's quantized_matmul "
            "(reinstall shardline to rebuild it)",
            module.MLX_VERSION,
            mx.__version__,
        )
        return None
    try:  # a module built with another nanobind ABI loads, then refuses MLX's arrays
        w = mx.zeros((1, 4), dtype=mx.uint32)
        mx.eval(module.quantized_matmul(mx.zeros((1, 32)), w, mx.ones((1, 1)), mx.zeros((1, 1)), 32, 4))
        # ... and one built before decode attention took a paged cache's segments refuses lists.
        seg = [mx.zeros((1, 1, 1, 4))]
        mx.eval(module.decode_attention(mx.zeros((1, 1, 4)), seg, seg, 1.0))
    except (TypeError, RuntimeError) as exc:
        log.warning("native quantized kernel does not run here (%s); using MLX's quantized_matmul", exc)
        return None
    if os.environ.get("SHARDLINE_QMM_INT", "1") == "0":
        module.set_integer(False)
    if hasattr(module, "set_threads"):  # the runner's share of its node's cores (blas.runner_env)
        module.set_threads(max(1, int(os.environ.get(THREADS_ENV) or 1)))
    _native = module
    return _native


def reset_native() -> None:
    """Forget the import decision (tests switch the module off and on)."""
    global _native, _loaded
    _native, _loaded = None, False


def supported(bits: int, group_size: int, mode: str = "affine") -> bool:
    return mode == "affine" and bits in SUPPORTED_BITS and group_size in SUPPORTED_GROUP_SIZES


def quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """x @ dequantize(w, scales, biases, group_size, bits).T, on the native kernel when it can."""
    module = native()
    if module is not None and supported(bits, group_size):
        return module.quantized_matmul(x, w, scales, biases, group_size, bits)
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


class CpuQuantizedLinear(nn.Module):
    """`nn.QuantizedLinear` (affine mode) on the native kernel; same parameters under the same names."""

    def __init__(
        self,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        bias: mx.array | None,
        group_size: int,
        bits: int,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.scales = scales
        self.biases = biases
        if bias is not None:
            self.bias = bias
        self.group_size = group_size
        self.bits = bits

    @classmethod
    def of(cls, layer: nn.QuantizedLinear) -> CpuQuantizedLinear:
        return cls(
            layer["weight"], layer["scales"], layer["biases"], layer.get("bias"), layer.group_size, layer.bits
        )

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        return y + self["bias"] if "bias" in self else y


class CpuQuantizedEmbedding(nn.Module):
    """`nn.QuantizedEmbedding` (affine mode) whose `as_linear`, a tied output head, runs the native kernel."""

    def __init__(
        self, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
    ) -> None:
        super().__init__()
        self.weight = weight
        self.scales = scales
        self.biases = biases
        self.group_size = group_size
        self.bits = bits

    @classmethod
    def of(cls, layer: nn.QuantizedEmbedding) -> CpuQuantizedEmbedding:
        return cls(layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x],
            biases=self["biases"][x],
            group_size=self.group_size,
            bits=self.bits,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)


def _eligible(m: Any) -> bool:
    return (
        getattr(m, "mode", "affine") == "affine"
        and m.get("biases") is not None
        and supported(m.bits, m.group_size)
    )


def cpu_quantized(m: nn.Module) -> nn.Module:
    """The native-kernel twin of a quantized layer it supports, else m itself (GGUF block layers run the
    kernel as they are: compute/gguf_linear.py)."""
    if native() is None:
        return m
    if type(m) is nn.QuantizedLinear and _eligible(m):
        return CpuQuantizedLinear.of(m)
    if type(m) is nn.QuantizedEmbedding and _eligible(m):
        return CpuQuantizedEmbedding.of(m)
    if type(m) is QuantizedSwitchLinear and _eligible(m) and m.get("global_scale") is None:
        # Imported here: quantized_experts builds on this module.
        from shardline.compute.quantized_experts import CpuQuantizedSwitchLinear

        return CpuQuantizedSwitchLinear.of(m)
    return m


def make_cpu_quantized(module: nn.Module) -> None:
    """Replace every supported quantized layer under module in place (weights are shared, not copied)."""
    leaves = tree_map_with_path(
        lambda _p, m: cpu_quantized(m), module.leaf_modules(), is_leaf=nn.Module.is_module
    )
    module.update_modules(leaves)


def fused_projection(*layers: nn.Module) -> Any:
    """x -> [layer(x) for layer in layers] as one native op (x prepared once), for quantized layers of one
    format; None where they are not all native-kernel layers. Each output equals its layer's own, bit for
    bit: the kernel computes every output row alone."""
    module = native()
    if module is None or not layers:
        return None
    biases = [m.get("bias") for m in layers]
    if gguf := _gguf_args(layers):
        ws, types = gguf

        def project_blocks(x: mx.array) -> list[mx.array]:
            outs = module.gguf_matmul_many(x, ws, types)
            return [y if b is None else y + b for y, b in zip(outs, biases, strict=True)]

        return project_blocks
    if any(type(m) is not CpuQuantizedLinear for m in layers):
        return None
    group_size, bits = layers[0].group_size, layers[0].bits
    if any((m.group_size, m.bits) != (group_size, bits) for m in layers):
        return None
    ws = [m["weight"] for m in layers]
    ss = [m["scales"] for m in layers]
    bs = [m["biases"] for m in layers]

    def project(x: mx.array) -> list[mx.array]:
        outs = module.quantized_matmul_many(x, ws, ss, bs, group_size, bits)
        return [y if b is None else y + b for y, b in zip(outs, biases, strict=True)]

    return project


def fused_swiglu(gate: nn.Module, up: nn.Module) -> Any:
    """x -> silu(gate(x)) * up(x) as one native op (bias-free quantized layers of one format), else None."""
    module = native()
    if module is None:
        return None
    if (gguf := _gguf_args([gate, up])) and "bias" not in gate and "bias" not in up:
        (w_gate, w_up), (t_gate, t_up) = gguf
        return lambda x: module.gguf_swiglu(x, w_gate, t_gate, w_up, t_up)
    if type(gate) is not CpuQuantizedLinear or type(up) is not CpuQuantizedLinear:
        return None
    if (gate.group_size, gate.bits) != (up.group_size, up.bits) or "bias" in gate or "bias" in up:
        return None
    args = (gate["weight"], gate["scales"], gate["biases"], up["weight"], up["scales"], up["biases"])
    group_size, bits = gate.group_size, gate.bits

    def swiglu(x: mx.array) -> mx.array:
        return module.quantized_swiglu(x, *args, group_size, bits)

    return swiglu


def direct(layer: nn.Module) -> Any:
    """layer as a plain function of x: for a native-kernel layer, the op without the module's attribute
    lookups (a decode position makes a few hundred such calls); any other layer itself."""
    module = native()
    if module is not None and (gguf := _gguf_args([layer])):
        (w,), (qtype,) = gguf
        bias = layer.get("bias")
        if bias is None:
            return lambda x: module.gguf_matmul(x, w, qtype)
        return lambda x: module.gguf_matmul(x, w, qtype) + bias
    if module is None or type(layer) is not CpuQuantizedLinear:
        return layer
    w, s, b, bias = layer["weight"], layer["scales"], layer["biases"], layer.get("bias")
    group_size, bits = layer.group_size, layer.bits
    if bias is None:
        return lambda x: module.quantized_matmul(x, w, s, b, group_size, bits)
    return lambda x: module.quantized_matmul(x, w, s, b, group_size, bits) + bias


def _gguf_args(layers: Any) -> tuple[list[mx.array], list[int]] | None:
    """(weights, types) of GGUF block linear layers the kernel runs here, else None."""
    from shardline.compute.gguf_linear import GGUFLinear, kernel_runs_here

    if not all(type(m) is GGUFLinear for m in layers) or not kernel_runs_here():
        return None
    return [m["weight"] for m in layers], [int(m.qtype) for m in layers]
