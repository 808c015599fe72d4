"""Wire frames: tensors survive bit for bit, and a frame whose bytes contradict its header is refused."""

from __future__ import annotations

import struct

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shardline.dataplane.frame import (
    MAX_HEADER_BYTES,
    FrameError,
    decode,
    encode,
    generation_of,
    tensor_meta,
    to_mlx,
)
from shardline.dataplane.messages import RING, Release, Step, TensorMeta

PREFIX = struct.Struct("<Iq")  # the documented layout: header length, generation
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "int32": mx.int32}
# Same-width unsigned views: comparing bit patterns makes NaN, -0.0 and subnormals exact.
BITS = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16, mx.int32: mx.uint32}
SHAPES = [(), (0,), (1,), (7,), (2, 3, 4), (1, 0, 5), (3, 17)]


def step(tensor: mx.array | None = None) -> Step:
    return Step(
        seq=3, request_id="req-1", pos=5, n=2, tensor=tensor_meta(tensor) if tensor is not None else None
    )


def make_tensor(dtype: mx.Dtype, shape: tuple[int, ...], seed: int = 0) -> mx.array:
    key = mx.random.key(seed)
    if dtype == mx.int32:
        x = mx.random.randint(-(2**31), 2**31 - 1, shape, dtype=mx.int32, key=key)
    else:
        x = (mx.random.normal(shape, key=key) * 100).astype(dtype)
    size = int(np.prod(shape)) if shape else 1
    if dtype != mx.int32 and size >= 6:
        # Values that a lossy path would change: infinities, NaN, negative zero, a subnormal, the extremes.
        specials = mx.array([np.inf, -np.inf, np.nan, -0.0, 1e-40, -3.0e38], dtype=mx.float32).astype(dtype)
        x = mx.concatenate([specials, x.reshape(-1)[6:]]).reshape(shape)
    mx.eval(x)
    return x


def bits(x: mx.array) -> np.ndarray:
    return np.array(x.view(BITS[x.dtype]))


def forged(header: bytes, payload: bytes = b"", generation: int = 0) -> bytes:
    return PREFIX.pack(len(header), generation) + header + payload


def header_with(meta: TensorMeta) -> bytes:
    return Step(seq=1, request_id="r", pos=0, n=1, tensor=meta).model_dump_json().encode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_round_trip_bit_exact(dtype_name: str, shape: tuple[int, ...]) -> None:
    x = make_tensor(DTYPES[dtype_name], shape, seed=len(shape))
    msg = step(x)
    data = encode(msg, x, generation=9)
    got, arr = decode(data, RING)
    assert got == msg
    assert arr is not None and arr.shape == shape
    # A view over the frame, not a copy: read-only and sharing the frame's memory.
    assert not arr.flags.writeable
    if arr.size:
        assert np.shares_memory(arr, np.frombuffer(data, dtype=np.uint8))
    y = to_mlx(arr, got.tensor.dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.array_equal(bits(y), bits(x))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_non_contiguous_tensors_travel_in_logical_order(dtype_name: str) -> None:
    base = make_tensor(DTYPES[dtype_name], (6, 10), seed=4)
    base_bits = bits(base)  # contiguous: the reference views are taken in numpy, independently of MLX
    views = {
        "transposed": (base.T, base_bits.T),
        "strided": (base[::2, 1::3], base_bits[::2, 1::3]),
        "broadcast": (mx.broadcast_to(base[:1], (4, 10)), np.broadcast_to(base_bits[:1], (4, 10))),
    }
    for name, (x, want) in views.items():
        got, arr = decode(encode(step(x), x), RING)
        assert arr is not None
        y = to_mlx(arr, got.tensor.dtype)
        assert y.shape == x.shape, name
        assert np.array_equal(bits(y), want), name


@pytest.mark.timeout(60)
def test_message_without_tensor() -> None:
    msg = Release(request_id="abc")
    got, arr = decode(encode(msg, generation=4), RING)
    assert got == msg and arr is None


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(generation=st.integers(-(2**63), 2**63 - 1))
def test_generation_is_carried(generation: int) -> None:
    x = mx.arange(3, dtype=mx.int32)
    data = encode(step(x), x, generation=generation)
    assert generation_of(data) == generation
    assert decode(data, RING)[0] == step(x)  # the generation does not disturb the rest


@pytest.mark.timeout(60)
@pytest.mark.parametrize("length", [0, 1, PREFIX.size - 1])
def test_generation_of_short_frame(length: int) -> None:
    with pytest.raises(FrameError):
        generation_of(bytes(length))


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    dtype_name=st.sampled_from(list(DTYPES)),
    shape=st.sampled_from([(1,), (7,), (2, 3, 4), (3, 17)]),
    with_tensor=st.booleans(),
)
def test_truncated_frames_are_refused(
    data: st.DataObject, dtype_name: str, shape: tuple[int, ...], with_tensor: bool
) -> None:
    x = make_tensor(DTYPES[dtype_name], shape) if with_tensor else None
    frame = encode(step(x), x)
    header_len = PREFIX.unpack_from(frame)[0]
    # Weight the cut points that matter: inside the prefix, inside the header, at the header's end.
    cut = data.draw(
        st.one_of(
            st.integers(0, len(frame) - 1),
            st.sampled_from([0, PREFIX.size - 1, PREFIX.size, PREFIX.size + header_len - 1]),
            st.just(PREFIX.size + header_len) if with_tensor else st.just(len(frame) - 1),
        )
    )
    with pytest.raises(FrameError):
        decode(frame[:cut], RING)


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(extra=st.binary(min_size=1, max_size=64), with_tensor=st.booleans())
def test_extra_bytes_are_refused(extra: bytes, with_tensor: bool) -> None:
    x = make_tensor(mx.float32, (2, 3)) if with_tensor else None
    with pytest.raises(FrameError):
        decode(encode(step(x), x) + extra, RING)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float64", "int64", "uint8", "uint16", "bool", "complex64", "", "Float32"])
def test_unsupported_dtype_is_refused(dtype: str) -> None:
    with pytest.raises(FrameError, match="unsupported"):
        decode(forged(header_with(TensorMeta(dtype=dtype, shape=[2])), bytes(16)), RING)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("dtype", "shape", "payload"),
    [
        ("float32", [3], 8),
        ("float32", [2, 2], 12),
        ("float32", [], 0),  # a scalar still needs its 4 bytes
        ("float32", [0], 4),
        ("float16", [4], 16),  # right byte count for float32, wrong for float16
        ("int32", [5], 19),  # not a whole number of elements
        ("bfloat16", [1, 3], 4),
        ("float32", [-1], 0),
        ("float32", [-2, -2], 16),  # the product matches the payload; a negative dimension still lies
    ],
)
def test_shape_not_matching_payload_is_refused(dtype: str, shape: list[int], payload: int) -> None:
    with pytest.raises(FrameError):
        decode(forged(header_with(TensorMeta(dtype=dtype, shape=shape)), bytes(payload)), RING)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("shape", "payload"),
    [([1] * 70, 4), ([0, 2**63], 0), ([0, 2**62], 0)],
    ids=["70_dims", "dim_2_63", "dim_2_62"],
)
def test_unrepresentable_shape_is_frame_error(shape: list[int], payload: int) -> None:
    with pytest.raises(FrameError):
        decode(forged(header_with(TensorMeta(dtype="float32", shape=shape)), bytes(payload)), RING)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", [1, 4, 100])
def test_payload_without_tensor_header_is_refused(payload: int) -> None:
    for msg in (step(), Release(request_id="x")):
        with pytest.raises(FrameError, match="without a tensor"):
            decode(forged(msg.model_dump_json().encode(), bytes(payload)), RING)


@pytest.mark.timeout(60)
def test_header_length_prefix_that_lies() -> None:
    header = step().model_dump_json().encode()
    with pytest.raises(FrameError, match="exceeds"):
        decode(struct.pack("<Iq", MAX_HEADER_BYTES + 1, 0) + header, RING)
    with pytest.raises(FrameError, match="shorter than its header"):
        decode(struct.pack("<Iq", len(header) + 1, 0) + header, RING)
    # A prefix shorter than the header cuts the JSON: validation refuses it.
    with pytest.raises(ValidationError):
        decode(struct.pack("<Iq", len(header) - 1, 0) + header, RING)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "header",
    [b"", b"{not json", b"\xff\xfe\x00", b"[]", b"null", b'{"kind": "nope"}', b'{"kind": "step"}'],
    ids=["empty", "broken", "not_utf8", "array", "null", "unknown_kind", "missing_fields"],
)
def test_garbage_header_is_a_validation_error(header: bytes) -> None:
    # decode lets pydantic's ValidationError through; it is a ValueError, like FrameError.
    with pytest.raises(ValidationError):
        decode(forged(header), RING)
    assert issubclass(ValidationError, ValueError) and issubclass(FrameError, ValueError)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(data=st.data(), with_tensor=st.booleans())
def test_corrupted_frames_never_raise_anything_but_value_error(
    data: st.DataObject, with_tensor: bool
) -> None:
    x = make_tensor(mx.float16, (2, 5)) if with_tensor else None
    frame = bytearray(encode(step(x), x, generation=1))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    try:
        msg, arr = decode(bytes(frame), RING)
    except ValueError:
        return
    # What still decodes is self-consistent: the tensor matches what the header declares.
    meta = getattr(msg, "tensor", None)
    if meta is None:
        assert arr is None
    else:
        assert arr is not None and list(arr.shape) == meta.shape
