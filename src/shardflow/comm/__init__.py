"""ZeroMQ data plane: msgpack headers with raw tensor frames, pipelined requests with deadlines."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardflow._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from shardflow.comm.client import Client
    from shardflow.comm.errors import CommError, DeadlineExceeded, ProtocolError
    from shardflow.comm.framing import decode, encode
    from shardflow.comm.server import Request, Server

# Imported on first use: the launcher and the command-line tool use comm.security and the control plane, which need
# no torch, and importing torch costs a process ~1.3 s of CPU.
_LAZY = {
    "Client": "shardflow.comm.client",
    "CommError": "shardflow.comm.errors",
    "DeadlineExceeded": "shardflow.comm.errors",
    "ProtocolError": "shardflow.comm.errors",
    "decode": "shardflow.comm.framing",
    "encode": "shardflow.comm.framing",
    "Request": "shardflow.comm.server",
    "Server": "shardflow.comm.server",
}

__all__ = [
    "Client",
    "CommError",
    "DeadlineExceeded",
    "ProtocolError",
    "Request",
    "Server",
    "decode",
    "encode",
]

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)
