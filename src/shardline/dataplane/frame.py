"""Wire frame: header length, sender's generation, the JSON header, then the raw tensor bytes (if any).

The generation sits in the fixed prefix so a receiver can drop a stale or forged frame before parsing it.
Everything a frame claims is checked against its bytes: a frame that lies is rejected, never trusted.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import mlx.core as mx
import numpy as np
from pydantic import TypeAdapter

from shardline.dataplane.messages import TensorMeta

_PREFIX = struct.Struct("<Iq")  # header length, generation
# A header is JSON of token lists and settings, far below this (a front refuses a request whose Submit could
# come near it). SHARDLINE_MAX_HEADER_BYTES lowers it for every process that starts with it set: tests reach
# the limit with small requests.
MAX_HEADER_BYTES = int(os.environ.get("SHARDLINE_MAX_HEADER_BYTES") or 16 << 20)
MAX_DIMS = 8  # activations are (batch, positions, hidden): anything deeper is a lie
MAX_DIM = 1 << 40  # beyond numpy's intp limits a reshape fails with its own error, not ours
# bfloat16 has no numpy dtype: it travels as its bit pattern.
_CARRIER = {mx.bfloat16: (mx.uint16, np.uint16)}
_NP_BY_NAME = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int32": np.int32}
_MX_BY_NAME = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "int32": mx.int32}


class FrameError(ValueError):
    pass


def tensor_meta(x: mx.array) -> TensorMeta:
    return TensorMeta(dtype=str(x.dtype).removeprefix("mlx.core."), shape=list(x.shape))


def encode(message: Any, tensor: mx.array | None = None, generation: int = 0) -> bytes:
    """message must already carry tensor_meta(tensor) in its `tensor` field when a tensor is attached."""
    header = message.model_dump_json().encode()
    prefix = _PREFIX.pack(len(header), generation)
    if tensor is None:
        return prefix + header
    if tensor.dtype in _CARRIER:
        tensor = tensor.view(_CARRIER[tensor.dtype][0])
    return prefix + header + memoryview(np.asarray(tensor)).tobytes()


def generation_of(data: bytes) -> int:
    if len(data) < _PREFIX.size:
        raise FrameError("frame shorter than its prefix")
    return _PREFIX.unpack_from(data)[1]


def decode(data: bytes, adapter: TypeAdapter) -> tuple[Any, np.ndarray | None]:
    """The message and its tensor as a numpy view of the frame: it becomes an MLX array only when used."""
    if len(data) < _PREFIX.size:
        raise FrameError("frame shorter than its prefix")
    n, _ = _PREFIX.unpack_from(data)
    if n > MAX_HEADER_BYTES:
        raise FrameError(f"header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    if len(data) < _PREFIX.size + n:
        raise FrameError("frame shorter than its header")
    message = adapter.validate_json(data[_PREFIX.size : _PREFIX.size + n])
    meta: TensorMeta | None = getattr(message, "tensor", None)
    payload = len(data) - _PREFIX.size - n
    if meta is None:
        if payload:
            raise FrameError(f"{payload} payload bytes after a header without a tensor")
        return message, None
    if meta.dtype not in _NP_BY_NAME:
        raise FrameError(f"unsupported tensor dtype {meta.dtype}")
    if len(meta.shape) > MAX_DIMS:
        raise FrameError(f"tensor of {len(meta.shape)} dimensions; at most {MAX_DIMS}")
    if any(d < 0 or d > MAX_DIM for d in meta.shape):
        raise FrameError(f"dimension out of range in shape {meta.shape}")
    dtype = np.dtype(_NP_BY_NAME[meta.dtype])
    want = math.prod(meta.shape) * dtype.itemsize
    if payload != want:
        raise FrameError(f"tensor payload has {payload} bytes, header {meta.dtype}{meta.shape} needs {want}")
    flat = np.frombuffer(data, dtype=dtype, offset=_PREFIX.size + n)
    return message, flat.reshape(meta.shape)


def to_mlx(array: np.ndarray, dtype: str) -> mx.array:
    out = mx.array(array)
    return out.view(mx.bfloat16) if dtype == "bfloat16" else out.astype(_MX_BY_NAME[dtype])
