"""Wire format: frame 0 is a msgpack header, then one raw frame per tensor. No pickle.

Also the frame-level socket calls, written out because pyzmq's send_multipart/recv_multipart
cost about twice as much Python per message, and the limits a server puts on what it receives.
"""

from __future__ import annotations

import math
import reprlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import zmq

from shardflow import env
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
            tensors.append(_tensor(spec, frames[index + 1]))
        except (ValueError, TypeError, RuntimeError) as error:
            raise ProtocolError(f"tensor {index} with spec {reprlib.repr(spec)}: {error}", header) from None
    return header, tensors


def _tensor(spec: Any, frame: Frame) -> torch.Tensor:
    """The tensor a [dtype name, shape] spec says `frame` holds; ValueError if it does not."""
    if type(spec) is not list or len(spec) != 2:
        raise ValueError("a tensor spec is [dtype name, shape]")
    dtype_name, shape = spec
    dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise ValueError(f"unknown dtype {reprlib.repr(dtype_name)}; supported: {', '.join(_DTYPES)}")
    # Each size's type first: an int times a str is a repeated str, which a peer could make gigabytes long.
    if type(shape) is not list or not all(type(size) is int and size >= 0 for size in shape):
        raise ValueError("a shape is a list of ints >= 0")
    numel = math.prod(shape)
    if not numel:  # torch.frombuffer refuses empty buffers
        if (frame.nbytes if isinstance(frame, memoryview) else len(frame)) != 0:
            raise ValueError("frame is not empty")
        return torch.empty(shape, dtype=dtype)
    tensor = torch.frombuffer(frame, dtype=dtype)
    if tensor.numel() != numel:
        raise ValueError(f"frame holds {tensor.numel()} elements")
    return tensor if len(shape) == 1 else tensor.view(shape)


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


_DEFAULT_MAX_FRAME_MB = 1024
CURVE_FRAME_OVERHEAD = 33
"""Bytes CURVE adds to each frame on the wire (libzmq's MESSAGE command: its name, a nonce, a flags byte and the
MAC), which ZMQ_MAXMSGSIZE counts. Without them in the socket's limit, an allowed frame within 32 bytes of the limit
closed an encrypted connection, and with it every request queued on it."""


def _max_frame_bytes() -> int:
    megabytes = env.get_int(env.MAX_FRAME_MB)
    if megabytes is None:
        megabytes = _DEFAULT_MAX_FRAME_MB
    if megabytes < 1:
        raise ValueError(f"{env.MAX_FRAME_MB}={megabytes}: the largest frame a server accepts must be >= 1 (MiB)")
    return megabytes << 20


@dataclass(frozen=True, kw_only=True)
class WireLimits:
    """The most a server takes in one message, so that no peer can make it hold memory without bound.

    ZeroMQ checks the frame size on the wire before it allocates (ZMQ_MAXMSGSIZE, set to the frame limit plus
    CURVE_FRAME_OVERHEAD): a bigger frame closes the sender's connection, unanswered, and the client's deadline
    names the server. The Receiver checks the rest, the frame limit exactly among them, as it takes the frames; a
    message over them is dropped unread and answered with an error naming the limit. ZeroMQ hands over a message's
    frames together, so those limits bound what one message costs until it is dropped.
    """

    max_header_bytes: int = 64 << 10
    """Size of the msgpack header (frame 0); a PS header is well under 1 KiB, input positions aside."""
    max_frames: int = 1 + 65_536
    """Frames per message: the header and at most this many minus one tensors (one per variable piece)."""
    max_frame_bytes: int = field(default_factory=_max_frame_bytes)
    """Size of one frame (a tensor): `SHARDFLOW_MAX_FRAME_MB` MiB, 1024 by default."""
    max_message_bytes: int = field(default_factory=lambda: 4 * _max_frame_bytes())
    """Size of all frames of a message together: 4 times `SHARDFLOW_MAX_FRAME_MB` MiB by default."""

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_frames", "max_frame_bytes", "max_message_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"WireLimits.{name} must be an int >= 1, got {value!r}")
        if self.max_message_bytes < self.max_frame_bytes:
            raise ValueError(
                f"WireLimits.max_message_bytes ({self.max_message_bytes}) must be at least max_frame_bytes "
                f"({self.max_frame_bytes})"
            )

    def problem(self, index: int, size: int, total: int) -> str | None:
        """What frame `index` (0: the header) of `size` bytes, `total` bytes with those before it, breaks."""
        if index == 0 and size > self.max_header_bytes:
            return f"its header frame has {size} bytes, more than the {self.max_header_bytes} allowed"
        if size > self.max_frame_bytes:
            return (
                f"its frame {index} has {size} bytes, more than the {self.max_frame_bytes} allowed "
                f"(set in MiB by {env.MAX_FRAME_MB})"
            )
        if index >= self.max_frames:
            return f"it has more than {self.max_frames} frames (a header and {self.max_frames - 1} tensors)"
        if total > self.max_message_bytes:
            return (
                f"its frames hold more than the {self.max_message_bytes} bytes a message may hold "
                f"(by default 4 times {env.MAX_FRAME_MB} MiB)"
            )
        return None


class OverLimit(list[zmq.Frame]):
    """What Receiver.recv returns for a message that broke its WireLimits: the routing frames and, when it was
    within its limit, the header, so that the sender can be answered; the other frames were dropped."""

    def __init__(self, frames: list[zmq.Frame], problem: str) -> None:
        super().__init__(frames)
        self.problem = problem


def peek_header(frames: Sequence[Frame]) -> dict[str, Any]:
    """The header in `frames[0]` when there is one and it is a msgpack map, else {}: enough to answer a message
    that is dropped for another reason."""
    try:
        header = msgpack.unpackb(frames[0], strict_map_key=False) if frames else {}
    except Exception:  # whatever the bytes are, there is no header to read
        return {}
    return header if type(header) is dict else {}


class Receiver:
    """Receives whole multipart messages from one socket, waiting up to a timeout.

    It waits inside zmq_recv (the RCVTIMEO option) rather than polling first: on loopback that
    measured about 40 µs less per round trip. The option is only set when the timeout changes.

    A receive cut off between the frames of a message (a signal handler that raised, such as the KeyboardInterrupt
    the launcher sends the chief when a role fails) leaves the rest of that message on the socket; the next receive
    drops it first, so that it never reads a message's tensor frame as the next message's header.
    """

    def __init__(self, socket: zmq.Socket[Any], limits: WireLimits | None = None, *, envelope: int = 0) -> None:
        """With `limits` (a server's), each message is checked against them and the socket's ZMQ_MAXMSGSIZE is
        set: make the Receiver before the socket binds, since ZeroMQ copies options into a listener when it binds.
        `envelope` counts the routing frames before the header (1 on a ROUTER); the limits do not count them."""
        self.socket = socket
        self.limits = limits
        self._envelope = envelope
        self._timeout_ms: int | None = None
        self._torn = False
        """Whether a receive stopped inside a message: its remaining frames are still on the socket."""
        if limits is not None:
            socket.maxmsgsize = limits.max_frame_bytes + CURVE_FRAME_OVERHEAD

    def recv(self, timeout_ms: int) -> list[zmq.Frame] | None:
        """The next message's frames, not copied, or None after `timeout_ms` (-1: no limit).
        A message over the limits comes as an OverLimit."""
        if self._torn:
            self._drop_rest()
        if timeout_ms != self._timeout_ms:
            self.socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            frame = self.socket.recv(copy=False)
        except zmq.Again:
            return None
        self._torn = frame.more
        if self.limits is not None:
            frames = self._limited(frame, self.limits)
        else:
            frames = [frame]
            while frame.more:
                frame = self.socket.recv(copy=False)
                frames.append(frame)
        self._torn = False
        return frames

    def _drop_rest(self) -> None:
        """Drop what is left of a message whose receive was cut off (ZeroMQ delivers whole messages: it is here)."""
        while self.socket.getsockopt(zmq.RCVMORE):
            self.socket.recv(NOBLOCK, copy=False)
        self._torn = False

    def _limited(self, frame: zmq.Frame, limits: WireLimits) -> list[zmq.Frame]:
        frames = [frame]
        total = 0
        while True:
            index = len(frames) - 1 - self._envelope  # 0: the header
            if index >= 0:
                size = len(frame)
                total += size
                problem = limits.problem(index, size, total)
                if problem is not None:
                    while frame.more:  # the rest is in memory already (ZeroMQ delivers whole messages): drop it
                        frame = self.socket.recv(copy=False)
                    return OverLimit(frames[: self._envelope + (index > 0)], problem)
            if not frame.more:
                return frames
            frame = self.socket.recv(copy=False)
            frames.append(frame)


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
