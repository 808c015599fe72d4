"""Frames: every dtype survives bit-exact, the generation travels in the prefix, and lies are rejected."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.dataplane import frame
from shardline.dataplane.messages import RING, Step, TensorMeta

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "int32": mx.int32}


def _step(tensor: mx.array | None) -> Step:
    meta = frame.tensor_meta(tensor) if tensor is not None else None
    return Step(seq=3, request_id="r", pos=0, n=2, tensor=meta)


def _bits(x: mx.array) -> np.ndarray:
    return np.asarray(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(1, 2, 8), (3,), (1, 0, 4), (2, 3, 5, 7)])
def test_round_trip_is_bit_exact(dtype: str, shape: tuple[int, ...]) -> None:
    x = (mx.random.normal(shape) * 100).astype(DTYPES[dtype])
    data = frame.encode(_step(x), x, generation=41)
    assert frame.generation_of(data) == 41
    message, payload = frame.decode(data, RING)
    assert message == _step(x)
    back = frame.to_mlx(payload, dtype)
    assert back.dtype == DTYPES[dtype] and tuple(back.shape) == shape
    assert np.array_equal(_bits(back), _bits(x))


@pytest.mark.timeout(30)
def test_message_without_tensor_round_trips() -> None:
    data = frame.encode(_step(None), generation=-1)
    assert frame.generation_of(data) == -1
    assert frame.decode(data, RING) == (_step(None), None)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(cut=st.integers(min_value=0))
def test_truncated_frames_are_rejected(cut: int) -> None:
    x = mx.ones((1, 3, 4))
    data = frame.encode(_step(x), x)
    cut %= len(data)  # every proper prefix: in the prefix, the header or the payload
    with pytest.raises(ValueError):  # FrameError, or pydantic's ValidationError for a cut header
        frame.decode(data[:cut], RING)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("extra", [1, 4, 1000])
def test_oversized_payloads_are_rejected(extra: int) -> None:
    x = mx.ones((1, 3, 4))
    data = frame.encode(_step(x), x) + b"\x00" * extra
    with pytest.raises(frame.FrameError, match="payload"):
        frame.decode(data, RING)
    bare = frame.encode(_step(None)) + b"\x01" * extra
    with pytest.raises(frame.FrameError, match="without a tensor"):
        frame.decode(bare, RING)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (TensorMeta(dtype="float64", shape=[1, 3, 4]), "unsupported tensor dtype"),
        (TensorMeta(dtype="float32", shape=[1, 3, 5]), "needs"),
        (TensorMeta(dtype="float32", shape=[1, -3, -4]), "negative"),
    ],
)
def test_headers_that_lie_about_the_tensor_are_rejected(meta: TensorMeta, match: str) -> None:
    x = mx.ones((1, 3, 4))
    honest = frame.encode(_step(x), x)
    header = _step(x).model_copy(update={"tensor": meta})
    lying = frame.encode(header) + honest[len(frame.encode(_step(x))) :]
    with pytest.raises(frame.FrameError, match=match):
        frame.decode(lying, RING)


@pytest.mark.timeout(30)
def test_garbage_and_huge_headers_are_rejected() -> None:
    import struct

    with pytest.raises(ValueError):
        frame.decode(struct.pack("<Iq", 9, 0) + b"not json!", RING)
    with pytest.raises(frame.FrameError, match="exceeds"):
        frame.decode(struct.pack("<Iq", frame.MAX_HEADER_BYTES + 1, 0), RING)
    with pytest.raises(frame.FrameError, match="prefix"):
        frame.generation_of(b"\x00\x01")
