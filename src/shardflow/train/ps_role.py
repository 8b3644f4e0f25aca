"""The parameter server's role: serve this PS's shards at an address the other roles find on the control plane."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from shardflow import env
from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlaneError
from shardflow.cluster.runtime_dir import make_runtime_dir
from shardflow.cluster.spec import DYNAMIC, ClusterSpec, TaskSpec
from shardflow.comm.security import CURVE, NULL, PLAIN, is_loopback
from shardflow.comm.server import Server, secure_server
from shardflow.ps.clipping import StoreNormExchange
from shardflow.ps.server import ParameterServer
from shardflow.train.heartbeat import Heartbeat
from shardflow.train.profiling import RoleProfiler
from shardflow.train.role_context import RoleContext

_REPUBLISH_S = 1.0
_SECURITY = {
    PLAIN: "authenticated, plaintext on a private UNIX socket",
    CURVE: "authenticated and CURVE-encrypted",
    NULL: "NOT authenticated",
}


def advertised_address(address: str, chief_address: str) -> str:
    """The tcp:// endpoint peers reach this role at: its address in the cluster spec, or, where torchrun gives
    none, loopback on one machine and this host's address across machines (any free port)."""
    if address != DYNAMIC:
        return f"tcp://{address}"
    if is_loopback(f"tcp://{chief_address}"):
        return "tcp://127.0.0.1:0"
    return f"tcp://{socket.gethostbyname(socket.gethostname())}:0"


@contextlib.contextmanager
def local_endpoint(task: TaskSpec, advertised: str) -> Iterator[str | None]:
    """The ipc:// endpoint a PS on loopback serves this machine's roles at as well, or None: a PS advertised off
    loopback may have peers on other machines, and then every peer uses TCP. Under a local launcher the socket is
    in the launcher's private runtime directory (a restarted PS takes its predecessor's); a job on one machine
    without one (TF_CONFIG, torchrun) gets a private directory of this PS's own, removed when it stops. Over TCP
    every role speaks CURVE, which costs a loopback job half its speed; a private socket needs only PLAIN."""
    setting = env.get(env.LOCAL_SOCKETS) or "on"
    if setting not in ("on", "off"):
        raise ValueError(f"{env.LOCAL_SOCKETS}={setting!r}: use on (the default) or off (loopback TCP)")
    if setting == "off" or not is_loopback(advertised):
        yield None
        return
    runtime_dir = env.get(env.RUNTIME_DIR)
    own = make_runtime_dir() if runtime_dir is None else None
    try:
        yield f"ipc://{os.path.join(runtime_dir or own or '', task.name.replace(':', '-'))}"
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def available_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on: its affinity mask, capped by its cgroup's CPU quota (a container's CPU
    limit, rounded up), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)


def cgroup_cpu_quota(cgroup_root: Path) -> float | None:
    """The CPUs the quota of the cgroup this process sees at `cgroup_root` allows (a container sees its own there):
    quota over period, 1.5 for 150 ms every 100 ms; None where there is no limit or no file to read or parse.
    cgroup v2's cpu.max ("max 100000" or "150000 100000"), else v1's cpu.cfs_quota_us (-1: none) and
    cpu.cfs_period_us."""
    try:
        quota, _, period = (cgroup_root / "cpu.max").read_text().partition(" ")
    except OSError:
        try:
            quota = (cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text()
            period = (cgroup_root / "cpu" / "cpu.cfs_period_us").read_text()
        except OSError:
            return None
    try:
        cpus = int(quota) / int(period)
    except ValueError:  # "max", or a file this rule does not know: no limit it can use
        return None
    return cpus if cpus > 0 else None


def threads_per_ps(cores: int, roles_on_machine: int) -> int:
    """The intra-op threads of one PS: this machine's cores shared among the PS and workers on it, at least 1.
    Workers count because a CPU worker computes while the PS applies (a PS with threads beyond its share stalls
    at every op waiting for a descheduled one: 6x slower on 2 cores), and a GPU worker keeps a core busy too."""
    return max(1, cores // max(1, roles_on_machine))


def roles_on_this_machine(spec: ClusterSpec, task: TaskSpec) -> int:
    """The PS and workers of `spec` that run on `task`'s machine, itself included: those at its host; all of them
    where the addresses are published at run time (torchrun) and the chief is on loopback, a one-machine job;
    else only itself."""
    roles = [other for other in spec.tasks() if other.type in ("ps", "worker")]
    host = spec.address(task).rpartition(":")[0]
    if host:
        return sum(1 for other in roles if spec.address(other).rpartition(":")[0] == host)
    chief = spec.address(TaskSpec("chief", 0))
    return len(roles) if chief != DYNAMIC and is_loopback(f"tcp://{chief}") else 1


def ps_threads(spec: ClusterSpec, task: TaskSpec) -> int:
    """This PS's intra-op threads: SHARDFLOW_PS_THREADS where set, else `threads_per_ps` of the cores it has."""
    override = env.get_int(env.PS_THREADS)
    if override is not None:
        if override < 1:
            raise ValueError(f"{env.PS_THREADS}={override}: give a thread count of at least 1, or unset it")
        return override
    return threads_per_ps(available_cores(), roles_on_this_machine(spec, task))


def run_ps(role: RoleContext, heartbeat_timeout_s: float) -> None:
    """A parameter server: serve this PS's shards until the chief says the job is over; `heartbeat_timeout_s`: the
    strategy's, which sets how often it beats."""
    # One PS applies a large shard with several threads, so that one beside a GPU worker keeps up.
    torch.set_num_threads(ps_threads(role.spec, role.task))
    # Row numbers from the network are range-checked by the PS itself (ps/sparse.py) before torch.optim builds
    # sparse tensors from them; opting out of torch's own check explicitly also silences its warning.
    torch.sparse.check_sparse_tensor_invariants.disable()
    chief = role.spec.address(TaskSpec("chief", 0))
    advertised = advertised_address(role.spec.address(role.task), chief)
    with local_endpoint(role.task, advertised) as local:
        _serve(role, secure_server(advertised, local=local), heartbeat_timeout_s)


def _serve(role: RoleContext, server: Server, heartbeat_timeout_s: float) -> None:
    try:
        # A local cluster's roles all run here: they reach the PS over its UNIX socket. Other processes (tools,
        # what the cluster spec names) over TCP.
        address = server.local_address or server.address
        role.control.publish_endpoint(control_keys.ps_endpoint(role.task.index), address)
        also = f", and at {server.local_address} for this machine's roles" if server.local_address else ""
        print(
            f"{role.task.name} serving at {server.address} ({_SECURITY[server.mechanism]}){also}; "
            f"{torch.get_num_threads()} intra-op threads",
            flush=True,
        )
        # After its address is published: a chief that sees a restarted PS beat finds where it serves.
        heartbeat = Heartbeat(role.task.name, role.control, heartbeat_timeout_s)
        ps = ParameterServer(
            server,
            role.task.index,
            norm_exchange=_norm_exchange(role),
            # The chief asks for a capture up front (profile_steps) before it initialises the PS: known here before
            # the first push. A periodic check (every 0.1 s) can come after a fast job's window has passed.
            on_initialised=lambda: _check_captures(profiler, ps.capture_step),
        )
        # The sf.nn tables' rows, admissions and evictions go into captures as counters.
        profiler = RoleProfiler(role.task.name, role.control, steps_are_coarse=True, counters=ps.table_counters)
        profiler.check_requests()
        # Every 0.1 s: a capture request reaches the PS before the workers are past its first step.
        try:
            ps.serve(should_stop=_JobOver(role), poll_s=0.1, periodic=_Chores(role, profiler, address))
        finally:
            heartbeat.stop()
        profiler.finish()
    finally:
        server.close()


def _norm_exchange(role: RoleContext) -> StoreNormExchange | None:
    """How this PS agrees a sync step's gradient norm with the others (used only by sync mode with
    clip_grad_norm); None for the only PS."""
    if role.num_ps < 2:
        return None
    return StoreNormExchange(role.control, role.task.index, role.num_ps, role.control.timeout_s)


def _check_captures(profiler: RoleProfiler, step: int | None) -> None:
    """`step`: the global step as captures count it (ParameterServer.capture_step); None before there is one."""
    profiler.check_requests()
    if step is not None:
        profiler.at_step(step)


class _Chores:
    """What the PS does between requests at every poll: captures, and its address kept published."""

    def __init__(self, role: RoleContext, profiler: RoleProfiler, address: str) -> None:
        self.role, self.profiler, self.address = role, profiler, address
        self.endpoint = control_keys.ps_endpoint(role.task.index)
        self.republish_at = time.monotonic() + _REPUBLISH_S

    def __call__(self, step: int | None) -> None:
        _check_captures(self.profiler, step)
        if time.monotonic() >= self.republish_at:
            # A restarted chief's control service starts empty: it finds this PS again here.
            self.republish_at = time.monotonic() + _REPUBLISH_S
            control = self.role.control
            if not control.is_set(control_keys.endpoint_address(self.endpoint)):
                control.publish_endpoint(self.endpoint, self.address)


class _JobOver:
    """Whether the chief said the job is over; a lost control plane is an error naming this PS."""

    def __init__(self, role: RoleContext) -> None:
        self.role = role

    def __call__(self) -> bool:
        control = self.role.control
        try:
            return control.is_set(control_keys.SHUTDOWN)
        except RuntimeError as error:
            raise ControlPlaneError(
                f"{self.role.task.name} lost the chief's control plane at {control.address}: {error}"
            ) from error
