"""Write a safetensors file one tensor at a time (float32, float16, uint32 or uint8 tensors).

`safetensors.numpy.save_file` needs every array in memory at once; the importer streams instead and holds
one tensor at a time. The shapes are known up front, but not every dtype: a quantized matrix's scales are
stored as float16 only when that loses nothing, which is known once the tensor is converted. So the header
space is reserved for the largest offsets any choice of dtypes could give (every dtype name is at most 3
characters; only the offsets' digits vary), the tensors are written as they come, and the header, padded
with spaces to that size (the format allows it), is written last.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

DTYPES = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<u4"): "U32", np.dtype("u1"): "U8"}
_MAX_ITEMSIZE = 4


def _header(entries: dict[str, dict[str, object]], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = dict(entries)
    if metadata:
        header["__metadata__"] = metadata
    return json.dumps(header, separators=(",", ":")).encode("utf-8")


def write_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    arrays: Iterable[tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `arrays` (yielded in the order of `shapes`, with those shapes; float32, float16, uint32, uint8:
    GGUF blocks as stored)."""
    worst: dict[str, dict[str, object]] = {}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * _MAX_ITEMSIZE
        worst[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    reserved = len(_header(worst, metadata))
    reserved += -reserved % 8  # the format pads the header with spaces to 8-byte alignment

    expected = iter(shapes.items())
    entries: dict[str, dict[str, object]] = {}
    offset = 0
    with path.open("wb") as f:
        f.seek(8 + reserved)
        for name, array in arrays:
            want_name, want_shape = next(expected, (None, None))
            if name != want_name or tuple(array.shape) != want_shape:
                got = f"{name} {tuple(array.shape)}"
                raise ValueError(f"tensor {got} out of order; expected {want_name} {want_shape}")
            dtype = DTYPES.get(array.dtype.newbyteorder("<"))
            if dtype is None:
                raise ValueError(f"tensor {name}: dtype {array.dtype} is not float32, float16, uint32, uint8")
            data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
            span = [offset, offset + data.nbytes]
            entries[name] = {"dtype": dtype, "shape": list(want_shape), "data_offsets": span}
            f.write(data.data)
            offset += data.nbytes
        if (missing := next(expected, None)) is not None:
            raise ValueError(f"tensor {missing[0]} was never written")
        raw = _header(entries, metadata)
        assert len(raw) <= reserved, "offsets never exceed the all-float32 ones"
        f.seek(0)
        f.write(struct.pack("<Q", reserved))
        f.write(raw + b" " * (reserved - len(raw)))


def write_f32_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    arrays: Iterable[tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> None:
    """`write_safetensors` with every tensor converted to float32."""
    write_safetensors(
        path, shapes, ((n, np.asarray(a, dtype=np.float32)) for n, a in arrays), metadata=metadata
    )
