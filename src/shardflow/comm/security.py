"""CURVE encryption (and, with a cluster secret, authentication) for every address that is not loopback."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.auth.thread
from zmq.utils import z85

from shardflow import env


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ tcp:// endpoint stays on this machine (127.0.0.0/8, ::1, localhost)."""
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _derived(secret: str, purpose: str) -> CurveKeys:
    secret_key = z85.encode(hashlib.sha256(f"shardflow {purpose}\0{secret}".encode()).digest())
    return CurveKeys(zmq.curve_public(secret_key), secret_key)


def _keys(purpose: str, secret: str | None) -> CurveKeys:
    """Derived from the cluster secret when there is one (so every holder can prove it), else fresh."""
    secret = secret if secret is not None else env.get(env.CLUSTER_SECRET)
    if secret:
        return _derived(secret, purpose)
    public, secret_key = zmq.curve_keypair()
    return CurveKeys(public, secret_key)


def server_keys(secret: str | None = None) -> CurveKeys:
    return _keys("server", secret)


def client_keys(secret: str | None = None) -> CurveKeys:
    return _keys("client", secret)


def secure_socket(socket: zmq.Socket[Any], keys: CurveKeys, allowed_client: bytes | None) -> None:
    """Make `socket` a CURVE server; with `allowed_client`, only that client key may connect."""
    if allowed_client is not None:
        _authenticator(socket.context).allow(allowed_client)
    socket.curve_server = True
    socket.curve_secretkey = keys.secret


def secure_client(socket: zmq.Socket[Any], server_public: bytes, keys: CurveKeys) -> None:
    socket.curve_serverkey = server_public
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret


class _AllowedKeys:
    """ZAP credentials check: a client key is accepted only if a server of this process allowed it."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def allow(self, key: bytes) -> None:
        self.keys.add(key)

    def callback(self, domain: str, client_key: bytes) -> bool:
        return z85.encode(client_key) in self.keys or client_key in self.keys


_authenticators: dict[int, tuple[zmq.auth.thread.ThreadAuthenticator, _AllowedKeys]] = {}


def _authenticator(context: zmq.Context[Any]) -> _AllowedKeys:
    found = _authenticators.get(id(context))
    if found is None:
        authenticator = zmq.auth.thread.ThreadAuthenticator(context)
        authenticator.start()
        allowed = _AllowedKeys()
        authenticator.configure_curve_callback(domain="*", credentials_provider=allowed)
        found = _authenticators[id(context)] = (authenticator, allowed)
    return found[1]
