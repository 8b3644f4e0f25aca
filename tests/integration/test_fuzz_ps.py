"""A live PS fuzzed during a real job: at least 10,000 random, truncated, oversized and wrong-typed messages from a
member of the job. The PS never crashes (one process from start to end, never restarted), answers every message it
receives with an error and counts each one, its memory stays within RSS_GROWTH_BOUND of what it held before, it
keeps serving the workers throughout, and the job ends at its exact global step.

The job is tests/integration/jobs/gated.py with frames limited to 1 MiB (SHARDFLOW_MAX_FRAME_MB=1), hence messages
to 4 MiB: its workers wait before their last batches until the fuzzing is over, so the job outlasts it however slow
the machine. Messages come from hypothesis strategies (derandomized: the same ones every run), in batches.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import typing
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError, ProtocolError
from shardflow.comm.framing import CURVE_FRAME_OVERHEAD, decode, encode, peek_header
from shardflow.comm.security import CURVE, PLAIN, Credentials, secure_client_socket
from shardflow.comm.server import LogLimiter
from shardflow.ps import protocol

SECRET = "the secret of the fuzzed job"
MAX_FRAME_MB = 1
NUM_MESSAGES = 10_000
RSS_GROWTH_BOUND = 64 << 20
"""The stated bound: the PS's peak resident memory (VmHWM) during the fuzzing exceeds its resident memory (VmRSS)
before it by less than 64 MiB, while the fuzzer sends it hundreds of MiB, messages of up to 6 MiB among them, and
tries to make it hold requests."""
HOLD_S = 6.0
"""The job's request_timeout_s, hence how long its PS holds a request before it gives up on it."""
NUM_WORKERS, NUM_BATCHES, GATE_AT = 2, 1700, 800
PS = "ps:0"
# gated.py's model, Linear(4, 16), Tanh, Linear(16, 1): 97 float32 parameters in 4 pieces, all on ps:0.
PIECES = (64, 16, 16, 1)
PS_LIMITS = protocol.Limits(num_workers=NUM_WORKERS, buffers=((torch.float32, sum(PIECES)),), num_tables=0)
HARMLESS = (protocol.Status, protocol.Pull, protocol.Rows, protocol.GetState)
"""The requests a well-formed fuzz message may be: they read or wait. Any other would change the job (a valid push
is applied, a valid stop ends it), so the fuzzer spoils such a message before it sends it."""


# -- AUTHENTICATION: the one place the fuzzer gets the job's socket security --------------------------------------
def connect_as_job_member(address: str) -> tuple[Client, zmq.Socket[bytes], zmq.Socket[bytes]]:
    """The fuzzer's connections to the PS at `address`, each proving the job's secret (SECRET) as a member of the
    job does: a Client for well-framed requests, and two raw DEALERs, one for garbage and one for frames over the
    frame limit (the PS's ZeroMQ drops that connection, which then reconnects)."""
    credentials = Credentials(SECRET)
    client = Client("fuzzer", credentials=credentials)
    client.connect(PS, address)
    raws = []
    for _ in range(2):
        raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        raw.linger = 0
        secure_client_socket(raw, address, credentials)
        raw.connect(address)
        raws.append(raw)
    return client, raws[0], raws[1]


# -- messages ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """One fuzz message. route: "client" (framed by Client, answered by its seq), "raw" (any frames), "big" (a
    frame over the frame limit)."""

    route: str
    header: dict[str, Any] = dataclasses.field(default_factory=dict)
    tensors: tuple[torch.Tensor, ...] = ()
    frames: tuple[bytes, ...] = ()


def _spoiled(header: dict[str, Any], tensors: typing.Sequence[torch.Tensor]) -> dict[str, Any]:
    """`header`, with a field no request has when it would make a request that changes the job."""
    try:
        message = protocol.decode_request(header, tensors, PS_LIMITS, "fuzzer")
    except protocol.PSProtocolError:
        return header
    return header if isinstance(message, HARMLESS) else {**header, "not_a_field": 1}


_REQUESTS = typing.get_args(protocol.PSRequest)
_FIELDS = {cls.op: list(cls.__struct_fields__) for cls in _REQUESTS}
_INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack carries
_NEAR = st.integers(-2, 3) | st.integers(2**62, 2**63 + 1)  # around the bounds of steps and indices
_SCALARS = st.none() | st.booleans() | _INTS | _NEAR | st.floats() | st.text(max_size=6) | st.binary(max_size=6)
_VALUES = _SCALARS | st.lists(_SCALARS, max_size=3) | st.dictionaries(st.text(max_size=3), _SCALARS, max_size=3)
_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool, torch.bfloat16)
_TENSORS = st.lists(
    st.builds(lambda dtype, numel: torch.zeros(numel, dtype=dtype), st.sampled_from(_DTYPES), st.integers(0, 100)),
    max_size=5,
)
_PUSH_FRAMES = st.lists(st.sampled_from(PIECES), max_size=5).map(lambda sizes: [torch.zeros(n) for n in sizes])
# Fields whose right type is not an int, with values near the right ones; every other field is a step or an index.
_NEAR_FIELDS = {
    "frame_counts": st.lists(_NEAR, max_size=3),
    "table_indices": st.lists(_NEAR, max_size=3),
    "found_in": st.sampled_from(["loss", "gradients", "nowhere"]),
    "input_state": st.none() | st.dictionaries(st.text(max_size=3), _SCALARS, max_size=2),
    "dtypes": st.lists(st.sampled_from(["float32", "int64", "complex64", "tensor"]), max_size=2),
    "snapshot_step": st.none() | _NEAR,
}


def _client_probe(header: dict[str, Any], tensors: list[torch.Tensor]) -> Probe:
    return Probe("client", _spoiled(header, tensors), tuple(tensors))


# Wrong types: any op, any of its fields (or none, or one more), any values and frames.
_WRONG_TYPES = st.builds(
    _client_probe,
    st.one_of(
        [
            st.fixed_dictionaries({"op": st.just(op)}, optional=dict.fromkeys([*names, "extra"], _VALUES))
            for op, names in _FIELDS.items()
        ]
    ),
    _TENSORS,
)
# Valid ops with bad fields: every field there with a value of the right type, in range or just out of it.
_BAD_FIELDS = st.builds(
    _client_probe,
    st.one_of(
        [
            st.fixed_dictionaries({"op": st.just(op), **{name: _NEAR_FIELDS.get(name, _NEAR) for name in names}})
            for op, names in _FIELDS.items()
        ]
    ),
    _PUSH_FRAMES | _TENSORS,
)
_READS = st.sampled_from(
    [protocol.Status().header(), protocol.Pull(min_step=0).header(), protocol.GetState().header()]
).map(lambda header: Probe("client", dict(header)))
_FULL_FRAME = torch.zeros(MAX_FRAME_MB << 20, dtype=torch.uint8)
_OVER_TOTAL = st.integers(5, 6).map(lambda count: Probe("client", {"op": "push"}, (_FULL_FRAME,) * count))
_GARBAGE = st.lists(st.binary(max_size=40), min_size=1, max_size=4).map(
    lambda frames: Probe("raw", frames=tuple(frames))
)
_SHAPES = st.lists(_INTS | st.sampled_from([0, -1, 2**40, 2**62]) | st.floats() | st.text(max_size=2), max_size=3)
_SPECS = st.lists(
    st.tuples(st.sampled_from(["float32", "int64", "cfloat", 7]), _SHAPES).map(list) | _VALUES, max_size=4
)
# Well-formed msgpack headers with wrong or huge tensor specs, and few or many frames.
_RAW_HEADERS = st.builds(
    lambda header, specs, frames: Probe("raw", frames=(msgpack.packb({**header, "t": specs}), *frames)),
    st.fixed_dictionaries({"op": st.sampled_from([*_FIELDS, 5])}, optional={"q": _VALUES, "s": _VALUES}),
    _SPECS,
    st.lists(st.binary(max_size=32), max_size=4) | st.integers(50, 400).map(lambda n: [b""] * n),
)


_PUSH = protocol.Push(worker_index=0, local_step=1, base_step=0, frame_counts=(len(PIECES),))
_PUSH_WIRE = [bytes(f) for f in encode({**_PUSH.header(), "s": "fuzz-raw", "q": 0}, [torch.zeros(n) for n in PIECES])]


def _truncated(cut: str, at: int) -> Probe:
    """An encoded push, cut: its header, a tensor frame, its last frame dropped, or one frame too many."""
    frames = list(_PUSH_WIRE)
    index = 0 if cut == "header" else 1 + at % len(PIECES)
    if cut in ("header", "tensor"):
        frames[index] = frames[index][: at % len(frames[index])]
    elif cut == "drop":
        frames.pop()
    else:
        frames.append(b"\0" * 4)
    return Probe("raw", frames=tuple(frames))


_TRUNCATED = st.builds(_truncated, st.sampled_from(["header", "tensor", "drop", "extra"]), st.integers(0, 2**20))
_OVER_HEADER = st.integers(64 << 10, 80 << 10).map(
    lambda size: Probe("raw", frames=(msgpack.packb({"op": "pull", "min_step": 0, "pad": "x" * size}),))
)
# Over by more than CURVE_FRAME_OVERHEAD: ZeroMQ refuses it on any mechanism, unanswered (see WireLimits).
_OVER_FRAME = st.integers(CURVE_FRAME_OVERHEAD + 1, MAX_FRAME_MB << 20).map(
    lambda extra: Probe("big", frames=(msgpack.packb({"op": "push", "t": []}), bytes((MAX_FRAME_MB << 20) + extra)))
)
# Per 200 probes: 50 wrong types, 50 bad fields, 25 garbage, 25 raw headers, 25 truncated, 22 reads, and one over
# the total size, the header size and the frame size each (those are costly to send).
_WEIGHTED = (
    [_WRONG_TYPES] * 50
    + [_BAD_FIELDS] * 50
    + [_GARBAGE] * 25
    + [_RAW_HEADERS] * 25
    + [_TRUNCATED] * 25
    + [_READS] * 22
    + [_OVER_TOTAL, _OVER_HEADER, _OVER_FRAME]
)

_CHOOSE = st.sampled_from(_WEIGHTED)


@st.composite
def probes(draw: st.DrawFn) -> Probe:
    """One probe of the mix above (a composite: cheaper to draw than a flatmap)."""
    probe: Probe = draw(draw(_CHOOSE))
    return probe


# -- the fuzzer -------------------------------------------------------------------------------------------------


class Fuzzer:
    """Sends probes to the PS and accounts for every answer. At most WINDOW requests of each route are in flight,
    so the workers' requests never queue behind thousands of the fuzzer's; pulls may be held by the PS until
    their deadline, so they are collected at the end."""

    WINDOW = 32

    def __init__(self, address: str) -> None:
        self.client, self.raw, self.big = connect_as_job_member(address)
        self.sent = {"client": 0, "raw": 0, "big": 0}
        self.answers = {"ok": 0, "error": 0}
        self.raw_answered = 0
        self._in_flight: deque[int] = deque()
        self._pulls: list[int] = []
        self._raw_q = 0

    def send(self, probe: Probe) -> None:
        self.sent[probe.route] += 1
        if probe.route == "client":
            seq = self.client.send(PS, dict(probe.header), probe.tensors)
            (self._pulls if probe.header["op"] == protocol.Pull.op else self._in_flight).append(seq)
            while len(self._in_flight) > self.WINDOW:
                self._answer(self._in_flight.popleft(), timeout_s=30)
        elif probe.route == "raw":
            self.raw.send_multipart(self._routable(probe.frames))
            self._drain_raw(self.WINDOW)
        else:
            self.big.send_multipart(probe.frames)

    def settle(self, timeout_s: float = 30) -> None:
        """Wait for the answers to every request sent so far but the pulls."""
        while self._in_flight:
            self._answer(self._in_flight.popleft(), timeout_s)
        self._drain_raw(0, timeout_s)

    def settle_pulls(self, timeout_s: float) -> None:
        for seq in self._pulls:
            self._answer(seq, timeout_s)
        self._pulls = []

    def status(self) -> protocol.StatusReply:
        header, _ = self.client.request(PS, protocol.Status().header(), timeout_s=30)
        return protocol.StatusReply.decode(header, PS)

    def close(self) -> None:
        self.client.close()
        self.raw.close(linger=0)
        self.big.close(linger=0)

    def _answer(self, seq: int, timeout_s: float) -> None:
        # A deadline here (DeadlineExceeded) fails the test: the PS must answer every request it receives.
        try:
            self.client.recv(PS, seq, timeout_s)
        except CommError as error:
            if "no reply from" in str(error):
                raise
            self.answers["error"] += 1
        else:
            self.answers["ok"] += 1

    def _routable(self, frames: tuple[bytes, ...]) -> list[bytes]:
        """The frames; a header with a sender and a seq gets a new seq (never taken for a retry, so always
        answered), and is spoiled like a client's if it would make a request that changes the job."""
        wire = peek_header(frames[:1])
        if not (type(wire.get("s")) is str and type(wire.get("q")) is int):
            return list(frames)
        self._raw_q += 1
        wire = {**wire, "s": "fuzz-raw", "q": self._raw_q}
        try:
            header, tensors = decode([msgpack.packb(wire), *frames[1:]])
        except ProtocolError:
            return [msgpack.packb(wire), *frames[1:]]
        if _spoiled(header, tensors) is not header:
            wire["not_a_field"] = 1
        return [msgpack.packb(wire), *frames[1:]]

    def _drain_raw(self, allowed: int, timeout_s: float = 30) -> None:
        """Read the raw socket's answers until at most `allowed` raw messages are unanswered."""
        deadline = time.monotonic() + timeout_s
        while self.sent["raw"] - self.raw_answered > allowed or self.raw.poll(0):
            if not self.raw.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                unanswered = self.sent["raw"] - self.raw_answered
                pytest.fail(f"the PS left {unanswered} raw messages unanswered for {timeout_s}s")
            header, _ = decode(self.raw.recv_multipart())
            self.raw_answered += 1
            self.answers["error" if "error" in header else "ok"] += 1


# -- the job ----------------------------------------------------------------------------------------------------


class ServingLine:
    """Reads the job's output as it comes (so its pipe never fills) and finds the line where ps:0 says its
    addresses: loopback TCP (CURVE) and the private UNIX socket (PLAIN) this machine's roles use."""

    def __init__(self, job: Any, transport: str) -> None:
        self.lines: list[str] = []
        self.address: str | None = None
        self._group = {"tcp": 1, "ipc": 2}[transport]
        self._found = threading.Event()
        self._stdout = job.proc.stdout
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> str:
        if not self._found.wait(timeout_s) or self.address is None:
            pytest.fail(f"ps:0 never said where it serves within {timeout_s}s:\n{self.text()}")
        return self.address

    def text(self) -> str:
        return "".join(self.lines)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _read(self) -> None:
        assert self._stdout is not None
        for line in self._stdout:
            self.lines.append(line)
            found = re.search(r"ps:0 serving at (tcp://\S+)(?:.*and at (ipc://\S+))?", line)
            if found and self.address is None:
                self.address = found.group(self._group)
                self._found.set()
        self._found.set()


def _memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) << 10 for name in ("VmRSS", "VmHWM")}


def _wait_for_step(fuzzer: Fuzzer, step: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while (current := fuzzer.status().step) < step:
        if time.monotonic() > deadline:
            pytest.fail(f"ps:0 reached global step {current}, not {step}, within {timeout_s}s")
        time.sleep(0.05)
    return current


@pytest.fixture
def fuzzed_job(start_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Path]]:
    """gated.py started with a secret the test knows and frames limited to MAX_FRAME_MB; its gate path."""
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET", SECRET)
    monkeypatch.setenv("SHARDFLOW_MAX_FRAME_MB", str(MAX_FRAME_MB))
    gate = tmp_path / "gate"
    job = start_job(
        "gated.py",
        gate=str(gate),
        num_batches=NUM_BATCHES,
        num_workers=NUM_WORKERS,
        gate_at=GATE_AT,
        step_delay_s=0.01,
        request_timeout_s=HOLD_S,
    )
    yield job, gate
    gate.touch()  # when the test failed early, the workers still finish


def _fuzz(fuzzer: Fuzzer) -> None:
    """Pulls for a step the job never reaches (more than the PS holds), messages of too many frames, then
    hypothesis's batches of probes."""
    for _ in range(40):
        fuzzer.send(Probe("client", protocol.Pull(min_step=500_000).header()))
    for _ in range(3):  # more frames than a message may have (65,537)
        fuzzer.send(Probe("raw", frames=(msgpack.packb({"op": "pull", "s": "x", "q": 0, "t": []}),) + (b"",) * 65_537))

    @settings(
        max_examples=NUM_MESSAGES // 40,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(probes(), min_size=40, max_size=50))
    def fuzz_batch(probes: list[Probe]) -> None:
        for probe in probes:
            fuzzer.send(probe)
        fuzzer.settle()

    fuzz_batch()
    fuzzer.settle_pulls(timeout_s=HOLD_S + 30)


# Over TCP every frame is encrypted (CURVE): 33 bytes longer on the wire, which the PS's ZMQ_MAXMSGSIZE once did not
# allow for, so that the fuzzer's frames of exactly the limit closed its request connection and lost what was on it.
@pytest.mark.parametrize(("transport", "mechanism"), [("ipc", PLAIN), ("tcp", CURVE)], ids=["private-socket", "tcp"])
def test_a_live_ps_survives_ten_thousand_malformed_messages_and_the_job_ends_exact(
    fuzzed_job, tmp_path, transport: str, mechanism: str
) -> None:
    job, gate = fuzzed_job
    output = ServingLine(job, transport)
    address = output.wait(timeout_s=60)
    assert Credentials(SECRET).mechanism(address) == mechanism
    fuzzer = Fuzzer(address)
    try:
        step_before = _wait_for_step(fuzzer, 20, timeout_s=60)  # training, and the PS warmed up
        ps_process = job.roles()["ps:0"]
        before = _memory(ps_process.pid)
        started = time.monotonic()
        _fuzz(fuzzer)
        fuzzing_s = time.monotonic() - started
        after = _memory(ps_process.pid)
        status = fuzzer.status()
        assert job.roles()["ps:0"].pid == ps_process.pid  # never crashed, so never restarted
    finally:
        fuzzer.close()
        gate.touch()
    returncode, _ = job.finish(timeout_s=120)
    output.join(timeout_s=10)
    out = output.text()
    print(f"fuzzed for {fuzzing_s:.1f}s: sent {fuzzer.sent}, answers {fuzzer.answers}, stats {status.stats}")
    print(f"ps:0 memory before {before}, after {after}")
    warnings = [line for line in output.lines if line.startswith("[ps:0]") and "serving at" not in line]

    assert sum(fuzzer.sent.values()) >= NUM_MESSAGES
    assert returncode == 0, out
    assert out.count("ps:0 serving at") == 1, out
    # Every message that reached the PS got an answer, and every error it answered is counted: all but the
    # frames over the limit, which ZeroMQ refused before allocating them (closing that connection).
    assert fuzzer.raw_answered == fuzzer.sent["raw"]
    assert fuzzer.answers["ok"] + fuzzer.answers["error"] == fuzzer.sent["client"] + fuzzer.sent["raw"]
    counters = ("wire_malformed", "malformed", "failed", "refused", "expired")
    assert sum(status.stats[name] for name in counters) == fuzzer.answers["error"], status.stats
    assert all(status.stats[name] > 0 for name in counters), status.stats
    assert after["VmHWM"] - before["VmRSS"] < RSS_GROWTH_BOUND, (before, after)
    # Its log was not flooded: the server's and the PS's warnings each at most LogLimiter's lines per interval.
    limiter = LogLimiter()
    assert len(warnings) <= 2 * limiter.max_lines * (fuzzing_s // limiter.every_s + 2), "".join(warnings)
    # It kept serving the workers while it was fuzzed, and after: the job ends exact.
    assert status.step > step_before
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == NUM_BATCHES
