"""ZeroMQ data plane: msgpack headers with raw tensor frames, pipelined requests with deadlines."""

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError, DeadlineExceeded, ProtocolError
from shardflow.comm.framing import decode, encode
from shardflow.comm.server import Request, Server

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
