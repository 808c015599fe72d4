"""Linear layers that keep their weight input-major, (in, out), for CPU matmul.

mlx-lm's `nn.Linear` keeps W as (out, in) and computes x @ W.T. The CPU BLAS kernels run faster on a plain
row-major right operand: over the 105 projections of the default model's 15-layer stage, in float32 on one
core, OpenBLAS took 12% less time at 1 row, 13% less at 8 and 3% less at a 128-row prompt chunk, and the
reference BLAS 45% less. Rows behave as before: with OpenBLAS a 2-row product gives each row's bits alone
and an 8-row one does not, in either layout.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path


class InputMajorLinear(nn.Module):
    """y = x @ W.T + b, with W.T stored contiguous (`weight_t`, (in, out))."""

    def __init__(self, weight_t: mx.array, bias: mx.array | None = None) -> None:
        super().__init__()
        self.weight_t = weight_t
        if bias is not None:
            self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> InputMajorLinear:
        return cls(mx.contiguous(linear["weight"].T), linear.get("bias"))

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight_t"])
        return x @ self["weight_t"]


def make_input_major(module: nn.Module) -> None:
    """Replace every plain `nn.Linear` under module in place (quantized layers stay as they are), and
    materialise the transposed weights, so that the (out, in) originals are freed layer by layer."""

    def swap(_path: str, m: nn.Module) -> nn.Module:
        return InputMajorLinear.of(m) if type(m) is nn.Linear else m

    leaves = tree_map_with_path(swap, module.leaf_modules(), is_leaf=nn.Module.is_module)
    module.update_modules(leaves)
    mx.eval(module.parameters())
