"""Capture in a running job: each role records spans always; on request it cuts out the requested global
steps, aligns its clock with the chief's and hands its trace to the chief, which merges them."""

from __future__ import annotations

import gzip
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from shardflow.cluster.rendezvous import ControlPlane, ControlPlaneError
from shardflow.comm.client import Client
from shardflow.comm.server import secure_server
from shardflow.profile import ClockEstimate, SpanRecorder, estimate_offset, set_recorder
from shardflow.profile.capture import finalize
from shardflow.profile.memory import MemorySampler
from shardflow.profile.torch_ops import OpCapture
from shardflow.profile.trace import role_file_name

log = logging.getLogger(__name__)

CURRENT = "capture/current"
# Tests inject a clock skew into one role ("worker:1=250000", in µs) to check that alignment finds it.
SKEW_ENV = "SHARDFLOW_TEST_CLOCK_SKEW_US"


def _injected_skew_ns(role: str) -> int:
    target, _, micros = os.environ.get(SKEW_ENV, "").partition("=")
    return int(float(micros) * 1000) if target == role else 0


# "off" disables the always-on recorder; "alternate:N" records in every other block of N global steps only.
# benchmarks/profiler_overhead.py measures with them what the recorder costs a real run.
RECORDER_ENV = "SHARDFLOW_RECORDER"


class _NoRecorder(SpanRecorder):
    """Records nothing, at the cost of a method call."""

    def __init__(self, role: str) -> None:
        super().__init__(role, capacity=1)

    def end(self, name: str, step: int, start: int, arg0: int = -1, arg1: int = -1, thread: str | None = None) -> None:
        return None

    def flow(self, name: str, step: int, flow_id: int, start: bool, thread: str | None = None) -> None:
        return None


class _AlternatingRecorder(SpanRecorder):
    """Records in blocks of `block` global steps with an even block number and drops everything in the others, so
    one run measures its steps with and without recording under the same load. Off, it costs what _NoRecorder
    does plus an attribute test; on, that test is extra (the overhead measured is a little above the real one)."""

    def __init__(self, role: str, block: int) -> None:
        super().__init__(role)
        self.block = block
        self.on = True

    def at_step(self, step: int) -> None:
        self.on = (step // self.block) % 2 == 0

    def end(self, name: str, step: int, start: int, arg0: int = -1, arg1: int = -1, thread: str | None = None) -> None:
        if self.on:
            super().end(name, step, start, arg0, arg1, thread)

    def flow(self, name: str, step: int, flow_id: int, start: bool, thread: str | None = None) -> None:
        if self.on:
            super().flow(name, step, flow_id, start, thread)


def _make_recorder(role: str) -> SpanRecorder:
    setting = os.environ.get(RECORDER_ENV, "on")
    if setting == "off":
        return _NoRecorder(role)
    if setting.startswith("alternate:") and setting.partition(":")[2].isdigit():
        return _AlternatingRecorder(role, max(1, int(setting.partition(":")[2])))
    if setting != "on":
        raise ValueError(f"{RECORDER_ENV}={setting!r}: use on, off or alternate:N (blocks of N global steps)")
    return SpanRecorder(role)


def _part_key(name: str, role: str) -> str:
    return f"capture/{name}/part/{role}"


class RoleProfiler:
    """The always-on recorder of one role, and its side of captures."""

    def __init__(self, role: str, control: ControlPlane, steps_are_coarse: bool = False) -> None:
        """`steps_are_coarse`: at_step is called only now and then (the PS: every 0.1 s), so the samplers start
        as soon as a capture is picked up rather than risk starting after its window."""
        self.role = role
        self.control = control
        self.steps_are_coarse = steps_are_coarse
        self.recorder = _make_recorder(role)
        self.skew_ns = _injected_skew_ns(role)
        self.recorder.base_time_ns += self.skew_ns
        set_recorder(None if isinstance(self.recorder, _NoRecorder) else self.recorder)
        self.capture: dict[str, Any] | None = None
        self._finished: set[str] = set()
        self._sampler: MemorySampler | None = None
        self._ops: OpCapture | None = None

    def check_requests(self) -> None:
        """Pick up a capture request from the control plane (called about once a second)."""
        if self.capture is not None or not self.control.is_set(CURRENT):
            return
        request = json.loads(self.control.get(CURRENT, waiting_for="the capture request"))
        if request["name"] not in self._finished:
            self.capture = request

    def at_step(self, step: int) -> None:
        """Called once per step with the global step: starts the samplers inside the window, dumps after it."""
        if isinstance(self.recorder, _AlternatingRecorder):
            self.recorder.at_step(step)
        capture = self.capture
        if capture is None:
            return
        if step >= capture["last"]:
            self.dump()
        elif (step >= capture["first"] - 1 or self.steps_are_coarse) and self._sampler is None:
            self._sampler = MemorySampler(self.recorder, 0.01)
            self._sampler.start()
            if capture.get("ops"):
                self._ops = OpCapture(self.recorder)
                self._ops.start()

    def finish(self) -> None:
        """The role is ending: hand over whatever part of a pending capture it recorded."""
        if self.capture is not None:
            self.dump()

    def dump(self) -> None:
        capture, self.capture = self.capture, None
        if capture is None:
            return
        extra: list[dict[str, Any]] = []
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._ops is not None:
            self._ops.stop()
            extra = self._ops.events()
            self._ops = None
        clock = self._clock_offset()
        trace = self.recorder.to_role_trace(
            capture["first"], capture["last"], clock.offset_ns / 1000, clock.error_ns / 1000, extra_events=extra
        )
        trace["otherData"]["roles"][self.role]["clock_rtt_us"] = clock.rtt_ns / 1000
        self.control.set(_part_key(capture["name"], self.role), gzip.compress(orjson.dumps(trace), 1))
        self._finished.add(capture["name"])

    def _clock_offset(self) -> ClockEstimate:
        address, key = self.control.endpoint("chief/clock", waiting_for="the chief's clock service")
        with Client(f"{self.role}-clock") as client:
            client.connect("chief", address, server_key=key)

            def ping() -> tuple[int, int, int]:
                t0 = time.time_ns() + self.skew_ns
                header, _ = client.request("chief", {"op": "time"}, timeout_s=5.0)
                return t0, int(header["time_ns"]), time.time_ns() + self.skew_ns

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
        control.publish_endpoint("chief/clock", self._server.address, self._server.public_key)
        self.pending: list[dict[str, Any]] = []
        self.completed: list[Path] = []
        """Every capture merged in this job, during training or at its end."""

    def _serve_clock(self) -> None:
        while not self._stop.is_set():
            request = self._server.recv(timeout_s=0.2)
            if request is not None:
                self._server.reply(request, {"time_ns": time.time_ns()})

    def _clock_offset(self) -> ClockEstimate:
        return ClockEstimate(0, 0, 0)

    def request(self, first: int, last: int, ops: bool = False, name: str | None = None) -> dict[str, Any]:
        if not 0 <= first < last:
            raise ValueError(f"profile_steps must be (first, last) with 0 <= first < last, got ({first}, {last})")
        capture = {"name": name or f"steps-{first}-{last}", "first": first, "last": last, "ops": ops}
        self.control.set(CURRENT, json.dumps(capture))
        self.capture = dict(capture)
        self.pending.append(capture)
        return capture

    def collect(self, roles: list[str], timeout_s: float, final: bool = False) -> list[Path]:
        """Write and merge every pending capture whose roles all reported; with `final`, wait for them."""
        done = []
        for capture in list(self.pending):
            keys = {role: _part_key(capture["name"], role) for role in roles if role != "chief"}
            if not final and not all(self.control.is_set(key) for key in keys.values()):
                continue
            started = time.monotonic()
            if capture["name"] not in self._finished:
                self.capture = dict(capture)
                self.dump()
            directory = self.model_dir / "profile" / capture["name"]
            directory.mkdir(parents=True, exist_ok=True)
            for role, key in keys.items():
                try:
                    data = self.control.get_bytes(
                        key, waiting_for=f"{role}'s part of capture {capture['name']}", timeout_s=timeout_s
                    )
                except ControlPlaneError:
                    log.warning("capture %s: %s sent no trace; merging without it", capture["name"], role)
                    continue
                (directory / role_file_name(role)).write_bytes(data)
            chief_part = self.control.get_bytes(_part_key(capture["name"], "chief"), waiting_for="the chief's part")
            (directory / role_file_name("chief")).write_bytes(chief_part)
            collected = time.monotonic()
            finalize(directory)
            timing = {"collect_s": collected - started, "merge_s": time.monotonic() - collected, "roles": len(roles)}
            (directory / "capture.json").write_text(json.dumps(timing))
            self.control.set(f"capture/{capture['name']}/done", str(directory))
            self.pending.remove(capture)
            done.append(directory)
            self.completed.append(directory)
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._server.close()


REQUEST = "capture/request"


def request_capture(
    model_dir: str | os.PathLike[str], num_steps: int, ops: bool = False, timeout_s: float = 300.0
) -> Path:
    """Ask the job running in `model_dir` to capture its next `num_steps` global steps on every role; returns the
    capture's directory once the chief has merged it."""
    if num_steps < 1:
        raise ValueError(f"--steps must be at least 1, got {num_steps}")
    job_file = Path(model_dir) / "job.json"
    if not job_file.exists():
        raise FileNotFoundError(f"no running job in {model_dir}: {job_file} is written by the chief while it trains")
    job = json.loads(job_file.read_text())
    control = ControlPlane(job["control"], is_chief=False, timeout_s=10.0)
    with Client("profile-capture") as client:
        address, key = control.endpoint("ps/0", waiting_for="ps:0's address")
        client.connect("ps:0", address, server_key=key)
        header, _ = client.request("ps:0", {"op": "step"}, timeout_s=10.0)
    first = int(header["step"]) + 1
    name = f"on-demand-{first}-{first + num_steps}"
    control.set(REQUEST, json.dumps({"name": name, "first": first, "last": first + num_steps, "ops": ops}))
    done = control.get(f"capture/{name}/done", waiting_for="the chief to merge the capture", timeout_s=timeout_s)
    return Path(done)
