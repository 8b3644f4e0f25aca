"""Who may talk to a job's servers: one job secret, keys derived from it, and a ZAP handler that checks them.

Every server of a job (the chief's control service, each PS, the chief's clock) accepts only holders of the
job's secret. The mechanism depends on the address both ends use, so they always agree:

- a UNIX socket in a directory only this user can enter (a local cluster's runtime directory), unless
  `SHARDFLOW_ENCRYPT` is `always`: ZeroMQ PLAIN with a password derived from the secret. Authenticated, not
  encrypted: no other user can bind there or read the traffic, and encryption measurably costs.
- any TCP address, loopback included: CURVE with server and client keys derived from the secret, authenticated
  and encrypted. Any local process may bind a free loopback port first (a restarted role's, say); PLAIN would hand
  it the password, while CURVE's client sends nothing it could replay to a server whose secret key it lacks.
- no secret and `SHARDFLOW_INSECURE=1`: nothing (NULL), logged loudly, on any address. Without that opt-out a
  role refuses to serve or connect off loopback without a secret, and says how to give one.

The secret comes from `SHARDFLOW_CLUSTER_SECRET`, else the file `SHARDFLOW_CLUSTER_SECRET_FILE` names (a
Kubernetes Secret), else, for loopback only, a per-user secret file made on first use (mode 0600), so roles
started by hand on one machine need nothing. The local launcher makes a fresh random secret per job.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from shardflow import env

log = logging.getLogger(__name__)

NULL, PLAIN, CURVE = "null", "plain", "curve"
ZAP_DOMAIN = b"shardflow"
_PLAIN_USER = b"shardflow"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_WATCH_ENDPOINT = "inproc://shardflow.gatekeeper.watch"
_watch_numbers = itertools.count()
_LOCAL_SECRET = Path.home() / ".shardflow" / "cluster-secret"
SECRET_FILE = "job.secret"
"""The file in model_dir where a local job's chief leaves its secret for the user's tools (mode 0600)."""


class SecurityError(RuntimeError):
    """This process cannot authenticate as the job asks: no secret where one is needed, or an unreadable one."""


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ endpoint stays on this machine: tcp:// to 127.0.0.0/8, ::1 or localhost, or ipc://."""
    if address.startswith("ipc://"):
        return True
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_private_socket(address: str) -> bool:
    """Whether `address` is a UNIX socket in a directory that this user owns and no other user may enter, so that
    no other user's process can bind it first or listen to it (an abstract-namespace name is open to everyone)."""
    if not address.startswith("ipc://") or address.startswith("ipc://@"):
        return False
    try:
        directory = os.stat(os.path.dirname(address.removeprefix("ipc://")) or ".")
    except OSError:
        return False
    return directory.st_uid == os.geteuid() and directory.st_mode & 0o077 == 0


@dataclass(frozen=True)
class Credentials:
    """The job secret this process holds (None: none was given), and what it derives for each mechanism."""

    secret: str | None

    def mechanism(self, address: str) -> str:
        """The mechanism for a connection to (or a server advertised at) `address`; both ends compute the same."""
        if self.secret is None and env.get(env.INSECURE) == "1":
            return NULL
        if env.get(env.ENCRYPT) != "always" and is_private_socket(address):
            return PLAIN
        if self.secret is not None or is_loopback(address):
            return CURVE
        raise SecurityError(
            f"{address} is not a loopback address and this process has no cluster secret: set "
            f"{env.CLUSTER_SECRET} (the same value in every process of the job) or {env.CLUSTER_SECRET_FILE} (a file "
            f"holding it, e.g. a mounted Kubernetes Secret); {env.INSECURE}=1 turns authentication off instead"
        )

    def plain_password(self) -> bytes:
        return _derive(self._secret_or_local(), b"plain password").hex().encode()

    def server_keys(self) -> tuple[bytes, bytes]:
        """(public, secret) CURVE keys of every server of the job, z85-encoded."""
        return _curve_pair(_derive(self._secret_or_local(), b"curve server"))

    def client_keys(self) -> tuple[bytes, bytes]:
        """(public, secret) CURVE keys every member of the job connects with, z85-encoded."""
        return _curve_pair(_derive(self._secret_or_local(), b"curve client"))

    def _secret_or_local(self) -> str:
        return self.secret if self.secret is not None else local_secret()


def job_credentials(model_dir: Path | None = None) -> Credentials:
    """This process's credentials from its environment (see the module docstring); a tool acting on a local job
    in `model_dir` may take the secret its chief left there."""
    secret = env.get(env.CLUSTER_SECRET)
    if secret is not None:
        return Credentials(secret)
    path = env.get(env.CLUSTER_SECRET_FILE)
    if path is None and model_dir is not None and (model_dir / SECRET_FILE).exists():
        path = str(model_dir / SECRET_FILE)
    if path is None:
        return Credentials(None)
    try:
        secret = Path(path).read_text().strip()
    except OSError as error:
        raise SecurityError(f"{env.CLUSTER_SECRET_FILE}={path}: cannot read the cluster secret: {error}") from error
    if not secret:
        raise SecurityError(f"{env.CLUSTER_SECRET_FILE}={path}: the file is empty; it must hold the cluster secret")
    return Credentials(secret)


def new_secret() -> str:
    """A fresh random job secret (256 bits), as the local launcher hands to the roles it starts; marked as such
    (RANDOM_SECRET), so that no process of the job spends a scrypt on it."""
    return _RANDOM_PREFIX + secrets.token_urlsafe(32)


def local_secret() -> str:
    """This user's secret for jobs on loopback started without one; made on first use, readable by the user only."""
    try:
        return _LOCAL_SECRET.read_text().strip()
    except FileNotFoundError:
        pass
    _LOCAL_SECRET.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_secret(_LOCAL_SECRET, new_secret(), replace=False)  # another process may have made it first: use that
    return _LOCAL_SECRET.read_text().strip()


def write_secret(path: Path, secret: str, *, replace: bool = True) -> None:
    """Write `secret` to `path`, readable by this user only, atomically; with replace=False an existing file stays."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    try:
        if replace:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)
    except FileExistsError:
        pass
    finally:
        temporary.unlink(missing_ok=True)


_RANDOM_PREFIX = "sfk1."
RANDOM_SECRET = re.compile(re.escape(_RANDOM_PREFIX) + r"[A-Za-z0-9_-]{43}")
"""What new_secret makes: 256 random bits, which need no stretching. Give a secret of this form only as made by
new_secret (or 32 random bytes in URL-safe base64 after the prefix): it is taken at its word."""
_SALT = b"shardflow cluster secret"


@functools.lru_cache(maxsize=8)
def _master_key(secret: str) -> bytes:
    if RANDOM_SECRET.fullmatch(secret):
        return hmac.new(_SALT, secret.encode(), hashlib.sha256).digest()  # HKDF-Extract (RFC 5869)
    # scrypt: a secret typed by a person may be short; the derivation makes guessing it slow. ~50 ms of a core, and
    # as much again of every process of the job: a secret new_secret made skips it.
    return hashlib.scrypt(secret.encode(), salt=_SALT, n=2**14, r=8, p=1, dklen=32)


def _derive(secret: str, purpose: bytes) -> bytes:
    """HKDF-Expand (RFC 5869, one block) of the scrypt master key: independent keys per purpose."""
    return hmac.new(_master_key(secret), purpose + b"\x01", hashlib.sha256).digest()


def _curve_pair(seed: bytes) -> tuple[bytes, bytes]:
    secret_key = z85.encode(seed)
    return zmq.curve_public(secret_key), secret_key


def secure_server_socket(socket: zmq.Socket[Any], advertised: str, credentials: Credentials) -> str:
    """Make `socket` accept only the job's members at `advertised`; returns the mechanism used."""
    mechanism = credentials.mechanism(advertised)
    if mechanism == NULL:
        _warn_insecure(advertised)
        return mechanism
    gatekeeper = _gatekeeper(socket.context)
    socket.zap_domain = ZAP_DOMAIN
    if mechanism == PLAIN:
        gatekeeper.allow_password(credentials.plain_password())
        socket.plain_server = True
    else:
        gatekeeper.allow_key(z85.decode(credentials.client_keys()[0]))
        socket.curve_server = True
        socket.curve_secretkey = credentials.server_keys()[1]
    return mechanism


def secure_client_socket(socket: zmq.Socket[Any], address: str, credentials: Credentials) -> str:
    """Make `socket` prove the job's secret to the server at `address`; returns the mechanism used."""
    mechanism = credentials.mechanism(address)
    if mechanism == PLAIN:
        socket.plain_username = _PLAIN_USER
        socket.plain_password = credentials.plain_password()
    elif mechanism == CURVE:
        public, secret_key = credentials.client_keys()
        socket.curve_serverkey = credentials.server_keys()[0]
        socket.curve_publickey = public
        socket.curve_secretkey = secret_key
    else:
        _warn_insecure(address)
    return mechanism


_warned_insecure: set[str] = set()


def _warn_insecure(address: str) -> None:
    if address not in _warned_insecure:
        _warned_insecure.add(address)
        log.warning(
            "!!! %s=1: %s is served WITHOUT authentication or encryption; any process that reaches it can push, "
            "pull, stop the job or write control keys. Set %s to protect it.",
            env.INSECURE,
            address,
            env.CLUSTER_SECRET,
        )


class _Gatekeeper:
    """The context's ZAP handler: answers each handshake from the passwords and client keys its servers allow,
    and logs each refused peer address once (then counts). It also watches its servers' sockets for handshakes
    that fail before ZAP is asked: CURVE from another secret, or another mechanism."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self.passwords: set[bytes] = set()
        self.keys: set[bytes] = set()
        self.refused: dict[str, int] = {}
        """Refused handshakes by peer address."""
        self._context = context
        self._socket: zmq.Socket[bytes] = context.socket(zmq.REP)
        self._socket.linger = 0
        self._socket.bind(_ZAP_ENDPOINT)
        self._watch_requests: zmq.Socket[bytes] = context.socket(zmq.REP)
        self._watch_requests.linger = 0
        self._watch_requests.bind(_WATCH_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="shardflow-zap", daemon=True)
        self._thread.start()

    def allow_password(self, password: bytes) -> None:
        self.passwords.add(password)

    def allow_key(self, key: bytes) -> None:
        self.keys.add(key)

    def watch(self, socket: zmq.Socket[Any]) -> None:
        """Log the handshakes that fail on `socket`'s protocol; returns once they are watched."""
        endpoint = f"inproc://shardflow.handshakes.{next(_watch_numbers)}"
        socket.monitor(endpoint, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_MONITOR_STOPPED)
        request: zmq.Socket[bytes] = self._context.socket(zmq.REQ)
        try:
            request.connect(_WATCH_ENDPOINT)
            request.send_string(endpoint)
            request.recv()
        finally:
            request.close(linger=0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._watch_requests, zmq.POLLIN)
        try:
            while True:
                for ready, _ in poller.poll():
                    if ready is self._socket:
                        self._answer(self._socket.recv_multipart())
                    elif ready is self._watch_requests:
                        monitor = self._context.socket(zmq.PAIR)
                        monitor.connect(self._watch_requests.recv_string())
                        poller.register(monitor, zmq.POLLIN)
                        self._watch_requests.send(b"")
                    else:
                        self._handshake_failed(ready, poller)
        except zmq.ContextTerminated:
            for socket, _ in poller.sockets:
                socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> None:
        request_id = request[1] if len(request) > 1 else b""
        ok = self._check(request)
        status = (b"200", b"OK") if ok else (b"400", b"not a member of this job")
        self._socket.send_multipart([b"1.0", request_id, *status, b"", b""])

    def _handshake_failed(self, monitor: zmq.Socket[Any], poller: zmq.Poller) -> None:
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # its socket was closed
            poller.unregister(monitor)
            monitor.close(linger=0)
            return
        # The peer's own address is not in the event: a loopback listener's peers are on loopback.
        endpoint = event["endpoint"].decode(errors="replace")
        address = urlsplit(endpoint).hostname or endpoint
        if not is_loopback(endpoint):
            address = f"a peer of {endpoint}"
        self._refuse(address, "handshake (CURVE of another secret, or another mechanism)")

    def _check(self, request: list[bytes]) -> bool:
        # ZAP 1.0: version, request id, domain, address, routing id, mechanism, credentials...
        if len(request) < 6 or request[0] != b"1.0":
            return False
        address, mechanism, credentials = request[3], request[5], request[6:]
        if mechanism == b"PLAIN" and len(credentials) == 2:
            ok = any(hmac.compare_digest(credentials[1], p) for p in self.passwords) and credentials[0] == _PLAIN_USER
        elif mechanism == b"CURVE" and len(credentials) == 1:
            ok = any(hmac.compare_digest(credentials[0], k) for k in self.keys)
        else:
            ok = False
        if not ok:
            self._refuse(address.decode(errors="replace"), f"{mechanism.decode(errors='replace')} credentials")
        return ok

    def _refuse(self, address: str, what: str) -> None:
        count = self.refused.get(address, 0) + 1
        if count == 1 and len(self.refused) < 10_000:
            log.warning("refused a connection from %s: its %s do not hold this job's secret", address, what)
        if address in self.refused or len(self.refused) < 10_000:
            self.refused[address] = count


_gatekeepers: dict[int, _Gatekeeper] = {}
_gatekeepers_lock = threading.Lock()


def _gatekeeper(context: zmq.Context[Any]) -> _Gatekeeper:
    with _gatekeepers_lock:
        found = _gatekeepers.get(id(context))
        if found is None:
            found = _gatekeepers[id(context)] = _Gatekeeper(context)
        return found


def watch_handshakes(socket: zmq.Socket[Any]) -> None:
    """Have the gatekeeper log the handshakes that fail on a server's `socket` before its ZAP handler is asked."""
    _gatekeeper(socket.context).watch(socket)


def refused_peers(context: zmq.Context[Any] | None = None) -> dict[str, int]:
    """Refused handshakes by peer address, as this process's gatekeeper counted them."""
    found = _gatekeepers.get(id(context or zmq.Context.instance()))
    return dict(found.refused) if found is not None else {}
