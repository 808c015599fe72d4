"""Mixture-of-experts layers on CPU: shardline's native gathered product in place of MLX's `gather_qmm`.

mlx-lm's expert layers (SwitchGLU, SwitchMLP) project through `QuantizedSwitchLinear`, which calls
`mx.gather_qmm`; on the CPU that runs one element at a time, as MLX's `quantized_matmul` does. The native
op (csrc/qmm/gather.cpp) runs the same product with the dense kernel's row kernels on each selected expert's
slice of the weights, in place: the pairs (row of x, expert) that share an expert run as one product of all
their rows, so a prefill reads each expert once, and a decode step (one row, k experts) is k small
products at the dense kernel's speed (8 of 64 experts of 1024 x 768, 4 bits: 3.6 GB/s as the dense
kernel's 3.5 on the same bytes, MLX's op 0.23; a prefill of 256 tokens x 8 experts with OpenBLAS 0.22 s
where MLX's op took 4.2 s, on a 2-core AVX-512 machine). Its numbers are the dense kernel's for the same
rows: integer dot products on x rounded to int16 below `gemm_rows` rows per expert, BLAS on dequantized
tiles from there.

`quantized.cpu_quantized` swaps a supported `QuantizedSwitchLinear` for `CpuQuantizedSwitchLinear` on the
CPU, with the dense layer's fallback rules; `measure` times a decode step against MLX's op and the dense
kernel on the same bytes.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from shardline.compute.quantized import CpuQuantizedLinear, native, supported


def gather_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    indices: mx.array,
    group_size: int,
    bits: int,
    sorted_indices: bool = False,
) -> mx.array:
    """mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, ...) in affine mode, on the
    native kernel when it can."""
    module = native()
    if module is not None and supported(bits, group_size):
        return module.gather_qmm(x, w, scales, biases, indices, group_size, bits, sorted_indices)
    return gather_qmm_mlx(x, w, scales, biases, indices, group_size, bits, sorted_indices)


def gather_qmm_mlx(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    indices: mx.array,
    group_size: int,
    bits: int,
    sorted_indices: bool = False,
) -> mx.array:
    """MLX's own op for the same product (GPU builds, formats the kernel lacks)."""
    return mx.gather_qmm(
        x,
        w,
        scales,
        biases,
        rhs_indices=indices,
        transpose=True,
        group_size=group_size,
        bits=bits,
        sorted_indices=sorted_indices,
    )


class CpuQuantizedSwitchLinear(CpuQuantizedLinear):
    """mlx-lm's `QuantizedSwitchLinear` (affine mode) on the native kernel; same parameters under the same
    names, the same call. Shapes are read from the arrays, so a layer holding a subset of the experts, or a
    slice of their rows or columns, works as given; a view (not row-contiguous) is copied at every call, so
    hand it contiguous arrays."""

    def __init__(
        self,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        bias: mx.array | None,
        group_size: int,
        bits: int,
    ) -> None:
        super().__init__(weight, scales, biases, bias, group_size, bits)
        self.mode = "affine"
        self.freeze()  # as mlx-lm's layer: inference weights

    @property
    def input_dims(self) -> int:
        return self["scales"].shape[2] * self.group_size

    @property
    def output_dims(self) -> int:
        return self["weight"].shape[1]

    @property
    def num_experts(self) -> int:
        return self["weight"].shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self["biases"],
            indices,
            self.group_size,
            self.bits,
            sorted_indices,
        )
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


def _time(calls: list[Any], repeat: int) -> tuple[float, float]:
    """(median, best) seconds of one call evaluated, cycling through `calls`, after one warm-up round."""
    for fn in calls:
        mx.eval(fn())
    times = []
    for r in range(repeat):
        fn = calls[r % len(calls)]
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], times[0]


def _decode_ops(
    module: Any,
    x: mx.array,
    weights: tuple[mx.array, mx.array, mx.array],
    idxs: list[mx.array],
    stacked: list[tuple[mx.array, ...]],
    group_size: int,
    bits: int,
) -> dict[str, list[Any]]:
    """measure's calls: per op, one per choice of experts."""
    q, s, b = weights
    x2 = x.reshape(1, -1)
    return {
        "native": [lambda i=i: module.gather_qmm(x, q, s, b, i, group_size, bits) for i in idxs],
        "mlx": [lambda i=i: gather_qmm_mlx(x, q, s, b, i, group_size, bits) for i in idxs],
        "dense": [lambda d=d: module.quantized_matmul(x2, *d, group_size, bits) for d in stacked],
    }


def measure(
    experts: int = 64,
    k: int = 8,
    shapes: tuple[tuple[int, int], ...] = ((1024, 768), (768, 1024)),
    bits: int = 4,
    group_size: int = 64,
    repeat: int = 200,
    seed: int = 0,
) -> dict[str, Any]:
    """Times one decode row through k of `experts` experts, for each (in, out) of `shapes`: the native
    gathered op ("native"), MLX's gather_qmm ("mlx"), and the dense native kernel over the same bytes (the
    k experts' rows stacked as one matrix: "dense"). Calls cycle through `experts // k` disjoint choices
    of k experts, as successive tokens pick different ones, so each op streams every expert's weights
    (the dense one its stacked copies of them) rather than rereading one cached set. GB/s counts the
    chosen experts' weights, scales and biases, once per call; float16 scales, as mlx-lm's checkpoints.
    -> {"isa", "bits", "group_size", "experts", "k", "shapes": [{"in", "out", "bytes", and for each op
    "<op>_us" (median), "<op>_best_us", "<op>_gbps" (at the median)}]}; {"error": ...} without the kernel."""
    module = native()
    if module is None or not supported(bits, group_size):
        return {"error": "the native kernel is unavailable or does not support this format"}
    sets = max(1, experts // k)
    results: list[dict[str, Any]] = []
    with mx.stream(mx.Device(mx.cpu)):
        mx.random.seed(seed)
        for k_in, n_out in shapes:
            w = mx.random.normal((experts, n_out, k_in)) * 0.05
            q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
            s, b = s.astype(mx.float16), b.astype(mx.float16)
            x = mx.random.normal((1, 1, 1, 1, k_in))
            # Choice j: experts j, j + sets, j + 2 sets, ...: spread over the stack, disjoint.
            idxs = [mx.arange(j, j + sets * k, sets, dtype=mx.uint32).reshape(1, 1, k) for j in range(sets)]
            stacked = [tuple(a[i.reshape(-1)].reshape(k * n_out, -1) for a in (q, s, b)) for i in idxs]
            mx.eval(q, s, b, x, idxs, stacked)
            nbytes = sum(a.nbytes for a in stacked[0])
            ops = _decode_ops(module, x, (q, s, b), idxs, stacked, group_size, bits)
            row: dict[str, Any] = {"in": k_in, "out": n_out, "bytes": nbytes}
            for name, calls in ops.items():
                # MLX's op is ten times slower: a tenth of the calls time it as well.
                median, best = _time(calls, repeat if name != "mlx" else max(len(calls), repeat // 10))
                row[f"{name}_us"] = round(median * 1e6, 1)
                row[f"{name}_best_us"] = round(best * 1e6, 1)
                row[f"{name}_gbps"] = round(nbytes / median / 1e9, 2)
            results.append(row)
    return {
        "isa": module.isa(),
        "bits": bits,
        "group_size": group_size,
        "experts": experts,
        "k": k,
        "shapes": results,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=2))
