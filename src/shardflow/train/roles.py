"""One process, one role: what this process is in the cluster, and the PS and evaluator entry points."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch

from shardflow import env
from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane, ControlPlaneError
from shardflow.cluster.spec import DYNAMIC, ClusterSpec, TaskSpec
from shardflow.comm.security import CURVE, NULL, PLAIN, is_loopback
from shardflow.comm.server import secure_server
from shardflow.ps.clipping import StoreNormExchange
from shardflow.ps.server import ParameterServer
from shardflow.train import job_keys
from shardflow.train.checkpoints import store
from shardflow.train.heartbeat import Heartbeat
from shardflow.train.job import JobConfig
from shardflow.train.job_keys import EvaluationResult, ProgressReport
from shardflow.train.profiling import RoleProfiler
from shardflow.train.summaries import Summaries

log = logging.getLogger(__name__)


@dataclass
class RoleContext:
    """This process's task in the cluster and its connection to the chief's control plane."""

    spec: ClusterSpec
    task: TaskSpec
    control: ControlPlane
    last_report: ProgressReport | None = None
    """A worker's last progress report: sent again to a restarted chief, whose control service starts empty."""

    @property
    def num_workers(self) -> int:
        return self.spec.num("worker")

    @property
    def num_ps(self) -> int:
        return self.spec.num("ps")


_REPUBLISH_S = 1.0
_SECURITY = {
    PLAIN: "authenticated, plaintext on loopback",
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


def local_endpoint(task: TaskSpec, advertised: str) -> str | None:
    """The ipc:// endpoint a PS of a local cluster serves its roles at as well (in the launcher's private runtime
    directory; a restarted PS takes its predecessor's), or None: a PS advertised off loopback may have peers on
    other machines, and then every peer uses TCP."""
    setting = env.get(env.LOCAL_SOCKETS) or "on"
    if setting not in ("on", "off"):
        raise ValueError(f"{env.LOCAL_SOCKETS}={setting!r}: use on (the default) or off (loopback TCP)")
    runtime_dir = env.get(env.RUNTIME_DIR)
    if runtime_dir is None or setting == "off" or not is_loopback(advertised):
        return None
    return f"ipc://{os.path.join(runtime_dir, task.name.replace(':', '-'))}"


def run_ps(role: RoleContext) -> None:
    torch.set_num_threads(1)
    # Row numbers from the network are range-checked by the PS itself (ps/sparse.py) before torch.optim builds
    # sparse tensors from them; opting out of torch's own check explicitly also silences its warning.
    torch.sparse.check_sparse_tensor_invariants.disable()
    chief = role.spec.address(TaskSpec("chief", 0))
    advertised = advertised_address(role.spec.address(role.task), chief)
    server = secure_server(advertised, local=local_endpoint(role.task, advertised))
    try:
        # A local cluster's roles all run here: they reach the PS over its UNIX socket. Other processes (tools,
        # what the cluster spec names) over TCP.
        address = server.local_address or server.address
        role.control.publish_endpoint(control_keys.ps_endpoint(role.task.index), address)
        also = f", and at {server.local_address} for this machine's roles" if server.local_address else ""
        print(f"{role.task.name} serving at {server.address} ({_SECURITY[server.mechanism]}){also}", flush=True)
        # After its address is published: a chief that sees a restarted PS beat finds where it serves.
        heartbeat = Heartbeat(role.task.name, role.control)
        ps = ParameterServer(server, role.task.index)
        if role.num_ps > 1:  # used only by sync mode with clip_grad_norm
            control = role.control
            ps.norm_exchange = StoreNormExchange(control, role.task.index, role.num_ps, control.timeout_s)
        profiler = RoleProfiler(role.task.name, role.control, steps_are_coarse=True)
        profiler.check_requests()

        def on_initialised() -> None:
            # The chief asks for a capture up front (profile_steps) before it initialises the PS: known here before
            # the first push. A periodic check (every 0.1 s) can come after a fast job's window has passed.
            profiler.check_requests()
            profiler.at_step(ps.step)

        ps.on_initialised = on_initialised

        endpoint = control_keys.ps_endpoint(role.task.index)
        republish_at = [time.monotonic() + _REPUBLISH_S]

        def periodic(step: int) -> None:
            profiler.check_requests()
            profiler.at_step(step)
            if time.monotonic() >= republish_at[0]:
                # A restarted chief's control service starts empty: it finds this PS again here.
                republish_at[0] = time.monotonic() + _REPUBLISH_S
                if not role.control.is_set(control_keys.endpoint_address(endpoint)):
                    role.control.publish_endpoint(endpoint, address)

        def job_over() -> bool:
            try:
                return role.control.is_set(control_keys.SHUTDOWN)
            except RuntimeError as error:
                raise ControlPlaneError(
                    f"{role.task.name} lost the chief's control plane at {role.control.address}: {error}"
                ) from error

        # Every 0.1 s: a capture request reaches the PS before the workers are past its first step.
        try:
            ps.serve(should_stop=job_over, poll_s=0.1, periodic=periodic)
        finally:
            heartbeat.stop()
        profiler.finish()
    finally:
        server.close()


def run_evaluator(job: JobConfig, role: RoleContext) -> None:
    """The side-car evaluator: evaluate each new checkpoint as the chief writes it, until the job ends."""
    eval_spec = job.eval_spec
    evaluated: str | None = None
    summaries = None
    history = job.model_dir / "eval" / "history.jsonl"
    while True:
        over = role.control.is_set(control_keys.SHUTDOWN)
        path = store.latest(job.model_dir)
        if eval_spec is not None and path is not None and path.name != evaluated:
            evaluated = path.name
            step = store.global_step(path)
            model = job.build_model()
            model.load_state_dict(store.load_state(path)[0].params)
            metrics = job.evaluate(model, eval_spec)
            history.parent.mkdir(parents=True, exist_ok=True)
            with open(history, "a") as f:
                f.write(json.dumps({"global_step": step, "checkpoint": path.name, "metrics": metrics}) + "\n")
            if summaries is None:
                summaries = Summaries(job.model_dir)
            summaries.evaluation(step, metrics)
            log.info("evaluator: %s at global step %d: %s", path.name, step, metrics)
            continue
        if over:
            # The chief writes its final checkpoint before it says the job is over, so this one is the last.
            final = (
                EvaluationResult(metrics={})
                if evaluated is None
                else EvaluationResult(checkpoint=evaluated, metrics=metrics)
            )
            role.control.put(job_keys.EVAL_FINAL, final)
            break
        time.sleep(0.5)
    if summaries is not None:
        summaries.close()
