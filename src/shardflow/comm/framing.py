"""Wire format: frame 0 is a msgpack header, then one raw frame per tensor. No pickle.

Also the frame-level socket calls, written out because pyzmq's send_multipart/recv_multipart
cost about twice as much Python per message.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
import torch
import zmq

from shardflow.comm.errors import ProtocolError

Frame = zmq.Frame | bytes | memoryview

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def encode(header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> list[Any]:
    """Frames for `header` and `tensors`; sets header["t"] to the tensors' dtypes and shapes.

    Tensor frames are zero-copy views of the tensors' memory: ZeroMQ may still read them after
    the send call returns, so a tensor must not be modified in place until the peer has it
    (for a request, until its reply arrived). Send a clone of a tensor that will change.
    """
    frames: list[Any] = [b""]
    specs = []
    for tensor in tensors:
        dtype_name = _DTYPE_NAMES.get(tensor.dtype)
        if dtype_name is None:
            supported = ", ".join(_DTYPES)
            raise ValueError(f"cannot send a {tensor.dtype} tensor; supported dtypes: {supported}")
        if not tensor.is_cpu:
            raise ValueError(f"tensors must be on the CPU to be sent; got one on {tensor.device}")
        specs.append([dtype_name, list(tensor.shape)])
        if tensor.requires_grad:
            tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        if dtype_name == "bfloat16":  # numpy has no bfloat16; the bytes are the same
            tensor = tensor.view(torch.int16)
        frames.append(tensor.numpy().data)
    header["t"] = specs
    frames[0] = msgpack.packb(header)
    return frames


def decode(frames: Sequence[Frame]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header (without "t") and the tensors of a message made by `encode`.

    The tensors are read-only views over the received frames, without a copy: do not write to
    them (clone first). Each keeps its frame's memory alive for as long as it is referenced.
    """
    if not frames:
        raise ProtocolError("empty message: no header frame")
    try:
        header = msgpack.unpackb(frames[0], strict_map_key=False)
    except Exception as error:
        raise ProtocolError(f"header frame is not valid msgpack: {error}") from error
    if type(header) is not dict:
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    specs = header.pop("t", [])
    if type(specs) is not list or len(specs) != len(frames) - 1:
        num_specs = len(specs) if type(specs) is list else "malformed"
        raise ProtocolError(
            f"header describes {num_specs} tensors but {len(frames) - 1} tensor frames followed",
            header,
        )
    tensors = []
    for index, spec in enumerate(specs):
        try:
            dtype_name, shape = spec
            numel = math.prod(shape)
            if numel:
                tensor = torch.frombuffer(frames[index + 1], dtype=_DTYPES[dtype_name])
                if tensor.numel() != numel:
                    raise ValueError(f"frame holds {tensor.numel()} elements")
                tensors.append(tensor if len(shape) == 1 else tensor.view(shape))
            else:
                tensors.append(_empty_tensor(frames[index + 1], _DTYPES[dtype_name], shape))
        except KeyError:
            message = f"tensor {index}: unknown dtype {spec[0]!r}"
            raise ProtocolError(message, header) from None
        except (ValueError, TypeError, RuntimeError) as error:
            message = f"tensor {index} with spec {spec!r}: {error}"
            raise ProtocolError(message, header) from error
    return header, tensors


def _empty_tensor(frame: Frame, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    # torch.frombuffer refuses empty buffers.
    if (frame.nbytes if isinstance(frame, memoryview) else len(frame)) != 0:
        raise ValueError("frame is not empty")
    return torch.empty(shape, dtype=dtype)


# Plain ints: combining pyzmq's IntFlag members runs Python enum code on every send.
SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)


def send_frames(socket: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0) -> None:
    """Send one multipart message; pyzmq copies frames under its copy threshold (64 KiB) and
    sends larger ones from the caller's memory."""
    last = len(frames) - 1
    more = flags | SNDMORE
    for i in range(last):
        socket.send(frames[i], more, copy=False)
    socket.send(frames[last], flags, copy=False)


class Receiver:
    """Receives whole multipart messages from one socket, waiting up to a timeout.

    It waits inside zmq_recv (the RCVTIMEO option) rather than polling first: on loopback that
    measured about 40 µs less per round trip. The option is only set when the timeout changes.
    """

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        self.socket = socket
        self._timeout_ms: int | None = None

    def recv(self, timeout_ms: int) -> list[zmq.Frame] | None:
        """The next message's frames, not copied, or None after `timeout_ms` (-1: no limit)."""
        if timeout_ms != self._timeout_ms:
            self.socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            frame = self.socket.recv(copy=False)
        except zmq.Again:
            return None
        frames = [frame]
        while frame.more:
            frame = self.socket.recv(copy=False)
            frames.append(frame)
        return frames


def timeout_ms(timeout_s: float) -> int:
    """A timeout in whole milliseconds, rounded up so that a wait is never cut short."""
    return max(0, math.ceil(timeout_s * 1000))


def _silence_read_only_warning() -> None:
    # torch warns once per process that a frame's buffer is read-only; tensors from decode() are
    # documented as read-only views, so use up that one warning here, silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(b"\0", dtype=torch.uint8)


_silence_read_only_warning()
