"""Wire frame: a 4-byte header length, the JSON header, then the raw tensor bytes (if any)."""

from __future__ import annotations

import struct
from typing import Any

import mlx.core as mx
import numpy as np
from pydantic import TypeAdapter

from shardline.dataplane.messages import TensorMeta

_LEN = struct.Struct("<I")
# bfloat16 has no numpy dtype: it travels as its bit pattern.
_CARRIER = {mx.bfloat16: (mx.uint16, np.uint16)}
_NP_BY_NAME = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int32": np.int32}
_MX_BY_NAME = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "int32": mx.int32}


class FrameError(ValueError):
    pass


def tensor_meta(x: mx.array) -> TensorMeta:
    return TensorMeta(dtype=str(x.dtype).removeprefix("mlx.core."), shape=list(x.shape))


def encode(message: Any, tensor: mx.array | None = None) -> bytes:
    """message must already carry tensor_meta(tensor) in its `tensor` field when a tensor is attached."""
    header = message.model_dump_json().encode()
    if tensor is None:
        return _LEN.pack(len(header)) + header
    if tensor.dtype in _CARRIER:
        tensor = tensor.view(_CARRIER[tensor.dtype][0])
    return _LEN.pack(len(header)) + header + memoryview(np.asarray(tensor)).tobytes()


def decode(data: bytes, adapter: TypeAdapter) -> tuple[Any, np.ndarray | None]:
    """The message and its tensor as a numpy view of the frame: it becomes an MLX array only when used."""
    if len(data) < _LEN.size:
        raise FrameError("frame shorter than its length prefix")
    (n,) = _LEN.unpack_from(data)
    if len(data) < _LEN.size + n:
        raise FrameError("frame shorter than its header")
    message = adapter.validate_json(data[_LEN.size : _LEN.size + n])
    meta: TensorMeta | None = getattr(message, "tensor", None)
    if meta is None:
        return message, None
    if meta.dtype not in _NP_BY_NAME:
        raise FrameError(f"unsupported tensor dtype {meta.dtype}")
    flat = np.frombuffer(data, dtype=_NP_BY_NAME[meta.dtype], offset=_LEN.size + n)
    if flat.size != int(np.prod(meta.shape)):
        raise FrameError(f"tensor payload has {flat.size} elements, header says {meta.shape}")
    return message, flat.reshape(meta.shape)


def to_mlx(array: np.ndarray, dtype: str) -> mx.array:
    out = mx.array(array)
    return out.view(mx.bfloat16) if dtype == "bfloat16" else out.astype(_MX_BY_NAME[dtype])
