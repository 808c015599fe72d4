"""Write a float32 safetensors file one tensor at a time.

`safetensors.numpy.save_file` needs every array in memory at once; dequantized to float32
a GGUF grows 4-8x, so the importer streams instead and holds one tensor at a time.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def write_f32_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    arrays: Iterable[tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `arrays` (yielded in the order of `shapes`, with those shapes) as F32 tensors."""
    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8-byte alignment

    expected = iter(shapes.items())
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, array in arrays:
            want_name, want_shape = next(expected, (None, None))
            if name != want_name or tuple(array.shape) != want_shape:
                got = f"{name} {tuple(array.shape)}"
                raise ValueError(f"tensor {got} out of order; expected {want_name} {want_shape}")
            f.write(np.ascontiguousarray(array, dtype="<f4").data)
    if (missing := next(expected, None)) is not None:
        raise ValueError(f"tensor {missing[0]} was never written")
