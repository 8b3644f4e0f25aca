"""Capture in a running job: each role records spans always; on request it cuts out the requested global
steps, aligns its clock with the chief's and hands its trace to the chief, which merges them. A tool asks from
outside the job (`shardflow profile capture`) through the job file the chief keeps in model_dir while it runs."""

from __future__ import annotations

import gzip
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from shardflow.cluster import control_keys
from shardflow.cluster.control_keys import ControlValueError
from shardflow.cluster.control_plane import ControlPlane, ControlPlaneError
from shardflow.comm.client import Client
from shardflow.comm.security import SECRET_FILE, Credentials, is_loopback, job_credentials, write_secret
from shardflow.comm.server import secure_server
from shardflow.profile import ClockEstimate, estimate_offset, set_recorder
from shardflow.profile.capture import check_capture_name, check_steps, write_capture
from shardflow.profile.clock import replied_time_ns, time_reply, time_request
from shardflow.profile.memory import MemorySampler
from shardflow.profile.recorder_setting import AlternatingRecorder, NoRecorder, make_recorder
from shardflow.profile.torch_ops import OpCapture
from shardflow.profile.torch_ops import warm_up as warm_up_op_capture
from shardflow.ps.connection import read_global_step
from shardflow.train import job_keys
from shardflow.train.job_keys import Capture

if TYPE_CHECKING:
    from shardflow.train.job import JobConfig
    from shardflow.train.role_context import RoleContext
    from shardflow.train.strategy import Strategy

log = logging.getLogger(__name__)

JOB_FILE = "job.json"
"""In model_dir while the job runs: where a tool of the same user finds it (`write_job_file`)."""


class RoleProfiler:
    """The always-on recorder of one role, and its side of captures."""

    def __init__(
        self,
        role: str,
        control: ControlPlane,
        steps_are_coarse: bool = False,
        counters: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        """`steps_are_coarse`: at_step is called only now and then (the PS: every 0.1 s), so the samplers start
        as soon as a capture is picked up rather than risk starting after its window. `counters`: the role's own
        counters, sampled with its memory."""
        self.role = role
        self.control = control
        self.steps_are_coarse = steps_are_coarse
        self.recorder = make_recorder(role)
        set_recorder(None if isinstance(self.recorder, NoRecorder) else self.recorder)
        self.capture: Capture | None = None
        self._finished: set[str] = set()
        # Memory and CPU are sampled always (every 0.1 s), so that every capture has counters, also one that is
        # picked up after its window (on demand); every 10 ms inside a window known ahead.
        self._sampler = MemorySampler(self.recorder, 0.1, counters)
        if not isinstance(self.recorder, NoRecorder):
            self._sampler.start()
        self._sampling_window = False
        self._ops: OpCapture | None = None

    def check_requests(self) -> None:
        """Pick up a capture request from the control plane (called about once a second)."""
        if self.capture is not None:
            return
        request = self.control.read_if_set(job_keys.CAPTURE_CURRENT)
        if request is not None and request.name not in self._finished:
            self.capture = request
            if request.ops:
                warm_up_op_capture()

    def at_step(self, step: int) -> None:
        """Called once per step with the global step: starts the samplers inside the window, dumps after it."""
        if isinstance(self.recorder, AlternatingRecorder):
            self.recorder.at_step(step)
        capture = self.capture
        if capture is None:
            return
        if step >= capture.last:
            self.dump()
        elif (step >= capture.first - 1 or self.steps_are_coarse) and not self._sampling_window:
            self._sampling_window = True
            self._sampler.sample_every(0.01)
            if capture.ops:
                self._ops = OpCapture(self.recorder)
                self._ops.start()

    def finish(self) -> None:
        """The role is ending: hand over whatever part of a pending capture it recorded."""
        if self.capture is not None:
            self.dump()
        self._sampler.stop()

    def dump(self) -> None:
        """Cut the pending capture's window out of the ring and hand it over to the chief."""
        capture, self.capture = self.capture, None
        if capture is None:
            return
        self._hand_over(capture.name, self._cut(capture))
        self._finished.add(capture.name)

    def _cut(self, capture: Capture) -> dict[str, Any]:
        extra: list[dict[str, Any]] = []
        if self._sampling_window:
            self._sampler.sample_every(0.1)
            self._sampling_window = False
        if self._ops is not None:
            self._ops.stop()
            extra = self._ops.events()
            self._ops = None
        clock = self._clock_offset()
        trace = self.recorder.to_role_trace(
            capture.first, capture.last, clock.offset_ns / 1000, clock.error_ns / 1000, extra_events=extra
        )
        trace["otherData"]["roles"][self.role]["clock_rtt_us"] = clock.rtt_ns / 1000
        return trace

    def _hand_over(self, name: str, trace: dict[str, Any]) -> None:
        self.control.set(control_keys.capture_part(name, self.role), gzip.compress(orjson.dumps(trace), 1))

    def _clock_offset(self) -> ClockEstimate:
        address = self.control.endpoint(control_keys.CHIEF_CLOCK, waiting_for="the chief's clock service")
        with Client(f"{self.role}-clock", credentials=job_credentials()) as client:
            client.connect("chief", address)

            def ping() -> tuple[int, int, int]:
                t0 = time.time_ns()
                header, _ = client.request("chief", time_request(), timeout_s=5.0)
                return t0, replied_time_ns(header), time.time_ns()

            return estimate_offset(ping, samples=16)


class ChiefProfiler(RoleProfiler):
    """The chief's recorder, its clock service, and the collection and merge of captures."""

    def __init__(self, control: ControlPlane, host: str, model_dir: Path) -> None:
        super().__init__("chief", control)
        self.model_dir = model_dir
        self._server = secure_server(f"tcp://{host}:0")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_clock, name="chief-clock", daemon=True)
        self._thread.start()
        control.publish_endpoint(control_keys.CHIEF_CLOCK, self._server.address)
        self.pending: list[Capture] = []
        self._own_traces: dict[str, dict[str, Any]] = {}
        """The chief's own part of each capture it cut, by capture name, until it is merged."""
        self.completed: list[Path] = []
        """Every capture merged in this job, during training or at its end."""
        self._refused_request: str | None = None

    def _serve_clock(self) -> None:
        while not self._stop.is_set():
            request = self._server.recv(timeout_s=0.2)
            if request is not None:
                self._server.reply(request, time_reply(time.time_ns()))

    def _clock_offset(self) -> ClockEstimate:
        return ClockEstimate(0, 0, 0)

    def _hand_over(self, name: str, trace: dict[str, Any]) -> None:
        self._own_traces[name] = trace

    def request(self, first: int, last: int, ops: bool = False, name: str | None = None) -> Capture:
        first, last = check_steps((first, last))
        name = check_capture_name(name or f"steps-{first}-{last}")
        capture = Capture(name=name, first=first, last=last, ops=ops)
        self.control.put(job_keys.CAPTURE_CURRENT, capture)
        self.capture = capture
        self.pending.append(capture)
        return capture

    def pick_up_request(self) -> None:
        """A tool asked for a capture of the running job through the control plane (`request_capture`): ask every
        role for it. A request that is not valid (anyone on the control plane can write it) is refused with one
        warning, never raised."""
        try:
            request = self.control.read_if_set(job_keys.CAPTURE_REQUEST)
        except ControlValueError as error:
            if str(error) != self._refused_request:  # one warning per request, not one per poll
                self._refused_request = str(error)
                log.warning("refused a capture request on the control plane: %s", error)
            return
        if request is None:
            return
        known = any(p.name == request.name for p in self.pending)
        if not known and not self.control.is_set(control_keys.capture_done(request.name)):
            self.request(request.first, request.last, ops=request.ops, name=request.name)

    def collect(self, roles: list[str], timeout_s: float, final: bool = False) -> list[Path]:
        """Merge every pending capture whose roles all reported; with `final`, wait for them."""
        done = []
        for capture in list(self.pending):
            name = capture.name
            keys = {role: control_keys.capture_part(name, role) for role in roles if role != "chief"}
            if not final and not all(self.control.is_set(key) for key in keys.values()):
                continue
            started = time.monotonic()
            if name not in self._finished:
                self.capture = capture
                self.dump()
            traces = [self._own_traces[name]]
            for role, key in keys.items():
                try:
                    data = self.control.get_bytes(
                        key, waiting_for=f"{role}'s part of capture {name}", timeout_s=timeout_s
                    )
                except ControlPlaneError:
                    log.warning("capture %s: %s sent no trace; merging without it", name, role)
                    continue
                traces.append(orjson.loads(gzip.decompress(data)))
            collected = time.monotonic()
            directory = write_capture(traces, self.model_dir / "profile" / name)
            del self._own_traces[name]
            timing = {"collect_s": collected - started, "merge_s": time.monotonic() - collected, "roles": len(roles)}
            (directory / "capture.json").write_text(json.dumps(timing))
            self.control.set(control_keys.capture_done(name), str(directory))
            self.pending.remove(capture)
            done.append(directory)
            self.completed.append(directory)
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._server.close()
        self._sampler.stop()


def request_capture(
    model_dir: str | os.PathLike[str],
    num_steps: int,
    ops: bool = False,
    timeout_s: float = 300.0,
    on_request: Callable[[Capture], None] | None = None,
) -> Path:
    """Ask the job running in `model_dir` to capture its next `num_steps` global steps on every role; returns the
    capture's directory once the chief has merged it. `on_request` is called with the request as soon as it is
    made, before the wait for the steps to run."""
    job_file = Path(model_dir) / JOB_FILE
    if not job_file.exists():
        raise FileNotFoundError(f"no running job in {model_dir}: {job_file} is written by the chief while it trains")
    job = json.loads(job_file.read_text())
    credentials = job_credentials(Path(model_dir))
    control = ControlPlane(job["control"], timeout_s=10.0, credentials=credentials)
    try:
        # A job file of before the strategy was written in it is a PS job's: only its chief wrote one.
        first = _global_step(control, credentials, job.get("strategy", "ParameterServerStrategy")) + 1
        first, last = check_steps((first, first + num_steps), what=f"--steps {num_steps}: the capture's global steps")
        name = f"on-demand-{first}-{last}"
        capture = Capture(name=name, first=first, last=last, ops=ops)
        control.put(job_keys.CAPTURE_REQUEST, capture)
        if on_request is not None:
            on_request(capture)
        done = control.get(
            control_keys.capture_done(name), waiting_for="the chief to merge the capture", timeout_s=timeout_s
        )
    finally:
        control.close()
    return Path(done)


def _global_step(control: ControlPlane, credentials: Credentials, strategy: str) -> int:
    """The job's global step now: ps:0's in a PS job; in an all-reduce or hybrid job the chief's, from the workers'
    progress (a hybrid job's PS count their tables' updates, not global steps)."""
    if strategy != "ParameterServerStrategy":
        return control.read(job_keys.GLOBAL_STEP, waiting_for="the chief's global step").step
    with Client("profile-capture", credentials=credentials) as client:
        address = control.endpoint(control_keys.ps_endpoint(0), waiting_for="ps:0's address")
        client.connect("ps:0", address)
        return read_global_step(client, "ps:0", timeout_s=10.0)


def write_job_file(job: JobConfig[Strategy], role: RoleContext) -> Path:
    """Where a tool of the same user finds the running job (`shardflow profile capture MODEL_DIR`): its control
    address, the chief's pid and the strategy's name; removed with `remove_job_file` at the job's end."""
    job.model_dir.mkdir(parents=True, exist_ok=True)
    secret = job_credentials().secret
    if secret is not None and is_loopback(f"tcp://{role.control.address}"):
        # A local job's secret is made by its launcher; a tool of the same user reads it here (mode 0600). A real
        # cluster's secret is never written into model_dir, which may be shared storage. Written first: a tool
        # that found the job file finds the secret too.
        write_secret(job.model_dir / SECRET_FILE, secret)
    path = job.model_dir / JOB_FILE
    # Readable by this user only (mode 0600, written atomically), as the secret beside it: it names the job's
    # control address and the chief's pid.
    fields = {"control": role.control.address, "pid": os.getpid(), "strategy": type(job.strategy).__name__}
    write_secret(path, json.dumps(fields))
    return path


def remove_job_file(model_dir: Path) -> None:
    """The job is over: so are its job file and its secret. One that cannot be removed (a read-only disk) is logged:
    raised, it would hide why the job ended."""
    for path in (model_dir / JOB_FILE, model_dir / SECRET_FILE):
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            log.warning("could not remove %s at the end of the job: %s", path, error)
