"""Wire format: tensors and headers survive encode/decode exactly, and bad frames are refused."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
import zmq

from shardflow.comm import ProtocolError, decode, encode

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(int(np.prod(shape))) % 7 - 3).to(dtype).reshape(shape)


def round_trip(header: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
    # bytes(...) copies each frame, as the network does.
    return decode([zmq.Frame(bytes(frame)) for frame in encode(header, tensors)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (), (0,), (2, 0, 3)], ids=str)
def test_every_dtype_and_shape_round_trips_exactly(dtype: torch.dtype, shape: tuple) -> None:
    tensor = sample(dtype, shape)
    _, (received,) = round_trip({"op": "push"}, [tensor])
    assert received.dtype == dtype
    assert received.shape == tensor.shape
    assert torch.equal(received, tensor)


def test_non_contiguous_tensor_round_trips() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert not tensor.is_contiguous()
    _, (received,) = round_trip({"op": "push"}, [tensor])
    assert torch.equal(received, tensor)


def test_tensor_requiring_grad_is_sent_as_its_values() -> None:
    tensor = torch.ones(3, requires_grad=True)
    _, (received,) = round_trip({"op": "push"}, [tensor])
    assert torch.equal(received, tensor.detach())


def test_header_values_round_trip() -> None:
    header = {"op": "pull", "key": b"\x00\xff", "name": "dense/w", "step": 12, "ids": [1, 2, [3]]}
    received, tensors = round_trip(dict(header), [])
    assert received == header
    assert tensors == []


def test_several_tensors_keep_their_order() -> None:
    tensors = [torch.ones(2), torch.zeros(3, dtype=torch.int64), torch.tensor(True)]
    _, received = round_trip({"op": "push"}, tensors)
    assert [t.dtype for t in received] == [t.dtype for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(received, tensors, strict=True))


def test_encode_shares_tensor_memory() -> None:
    tensor = torch.arange(100_000, dtype=torch.float32)
    frame = encode({"op": "push"}, [tensor])[1]
    assert np.frombuffer(frame, dtype=np.uint8).ctypes.data == tensor.data_ptr()


def test_decode_shares_frame_memory() -> None:
    frames = [zmq.Frame(bytes(f)) for f in encode({"op": "push"}, [torch.ones(100_000)])]
    _, (tensor,) = decode(frames)
    assert tensor.data_ptr() == np.frombuffer(frames[1].buffer, dtype=np.uint8).ctypes.data


def test_decode_accepts_bytes_and_memoryviews() -> None:
    frames = encode({"op": "push"}, [torch.ones(2, 2)])
    _, (tensor,) = decode([bytes(frames[0]), frames[1]])
    assert torch.equal(tensor, torch.ones(2, 2))


def test_truncated_tensor_frame_raises_protocol_error() -> None:
    header, frame = encode({"op": "push"}, [torch.ones(10)])
    with pytest.raises(ProtocolError, match="tensor 0"):
        decode([header, bytes(frame)[:-4]])


def test_tensor_frame_of_wrong_size_for_dtype_raises_protocol_error() -> None:
    header, frame = encode({"op": "push"}, [torch.ones(10)])
    with pytest.raises(ProtocolError, match="tensor 0"):
        decode([header, bytes(frame)[:-1]])


def test_missing_tensor_frame_raises_protocol_error() -> None:
    header, _ = encode({"op": "push"}, [torch.ones(10)])
    with pytest.raises(ProtocolError, match="1 tensors but 0 tensor frames"):
        decode([header])


def test_missing_header_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="no header"):
        decode([])


def test_header_that_is_not_msgpack_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="msgpack"):
        decode([b"\xc1"])


def test_header_that_is_not_a_map_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="map"):
        decode([msgpack.packb([1, 2])])


def test_unknown_dtype_raises_protocol_error() -> None:
    header = msgpack.packb({"op": "push", "t": [["complex64", [1]]]})
    with pytest.raises(ProtocolError, match="unknown dtype 'complex64'"):
        decode([header, bytes(8)])


def test_unsupported_dtype_is_refused_when_encoding() -> None:
    with pytest.raises(ValueError, match="complex64"):
        encode({"op": "push"}, [torch.ones(2, dtype=torch.complex64)])
