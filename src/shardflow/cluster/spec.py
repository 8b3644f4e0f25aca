"""Cluster specs: the tasks of a job and their addresses, from TF_CONFIG, a cluster manager, torchrun or free ports."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from shardflow import env

ROLES = ("chief", "worker", "ps", "evaluator")
DYNAMIC = "*"

_TASK_ORDER = ("chief", "ps", "worker", "evaluator")
_SINGLE_ROLES = ("chief", "evaluator")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_held: dict[str, socket.socket] = {}
"""The ports of local clusters this process made, by address, each held by a socket bound to it that never listens
(ClusterSpec.local); release_local_ports closes them."""


class ClusterSpecError(ValueError):
    """A cluster spec or task that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class TaskSpec:
    """One process of the cluster: its role and its index within that role."""

    type: str
    index: int

    def __post_init__(self) -> None:
        _check_role(self.type)
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ClusterSpecError(f"task index of {self.type!r} must be a non-negative integer, got {self.index!r}")

    @property
    def name(self) -> str:
        if self.type in _SINGLE_ROLES and self.index == 0:
            return self.type
        return f"{self.type}:{self.index}"


@dataclass(frozen=True)
class ClusterSpec:
    """Role -> addresses ("host:port", or DYNAMIC when published at run time); one chief always."""

    roles: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        if not isinstance(self.roles, Mapping):
            raise ClusterSpecError(f"the cluster must map roles to address lists, got {type(self.roles).__name__}")
        for role in self.roles:
            _check_role(role)
        roles: dict[str, tuple[str, ...]] = {}
        for role in ROLES:
            addresses = _address_list(role, self.roles.get(role, ()))
            if addresses:
                roles[role] = addresses
        object.__setattr__(self, "roles", MappingProxyType(roles))
        _check_counts(roles)
        _check_addresses(roles)

    def __hash__(self) -> int:
        return hash(tuple(self.roles.items()))

    def __repr__(self) -> str:
        return f"ClusterSpec(roles={dict(self.roles)!r})"

    def num(self, role: str) -> int:
        _check_role(role)
        return len(self.roles.get(role, ()))

    def address(self, task: TaskSpec) -> str:
        self.validate_task(task)
        return self.roles[task.type][task.index]

    def tasks(self) -> list[TaskSpec]:
        return [TaskSpec(role, i) for role in _TASK_ORDER for i in range(self.num(role))]

    def validate_task(self, task: TaskSpec) -> None:
        num = self.num(task.type)
        if task.index >= num:
            raise ClusterSpecError(
                f"task {task.type}:{task.index} is out of range: the cluster has {_count(num, task.type)}"
            )

    def to_json(self, task: TaskSpec) -> str:
        """The TF_CONFIG-compatible JSON that tells the process running `task` its role."""
        self.validate_task(task)
        cluster = {role: list(addresses) for role, addresses in self.roles.items()}
        return json.dumps({"cluster": cluster, "task": {"type": task.type, "index": task.index}})

    @classmethod
    def from_tf_config(cls, config: str | Mapping[str, Any], source: str = "TF_CONFIG") -> tuple[ClusterSpec, TaskSpec]:
        """Parses TFJob's TF_CONFIG; "master" means chief; the evaluator may be in "task" only."""
        roles, task = _read_tf_config(config, source)
        try:
            task_spec = TaskSpec("chief" if task["type"] == "master" else task["type"], task.get("index", 0))
            # As in TF the evaluator may be in "task" only: it listens nowhere.
            if task_spec.type == "evaluator" and not roles.get("evaluator"):
                roles["evaluator"] = [DYNAMIC]
            spec = cls(roles)
            spec.validate_task(task_spec)
        except ClusterSpecError as error:
            raise ClusterSpecError(f"{source}: {error}") from None
        return spec, task_spec

    @classmethod
    def from_torchrun(cls, environ: Mapping[str, str], num_ps: int) -> tuple[ClusterSpec, TaskSpec]:
        """Maps torchrun ranks to roles: 0 is the chief, 1..num_ps the PS, the rest workers. torchrun's own store
        holds MASTER_PORT, so the chief's control service listens on MASTER_PORT + 1."""
        missing = [name for name in _TORCHRUN_VARS if not environ.get(name)]
        if missing:
            raise ClusterSpecError(
                f"the torchrun environment lacks {', '.join(missing)}: start the job with torchrun "
                "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
        rank, world_size, port = (_env_int(environ, name) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
        if num_ps < 0:
            raise ClusterSpecError(f"num_ps must be >= 0, got {num_ps}")
        if world_size < num_ps + 2:
            raise ClusterSpecError(
                f"WORLD_SIZE={world_size} is too small for num_ps={num_ps}: need at least one "
                f"chief, {num_ps} PS and one worker, so start {num_ps + 2} or more processes"
            )
        if not 0 <= rank < world_size:
            raise ClusterSpecError(f"RANK={rank} is out of range for WORLD_SIZE={world_size}")
        spec = cls(
            {
                "chief": (f"{_bracketed(environ['MASTER_ADDR'])}:{port + 1}",),
                "ps": (DYNAMIC,) * num_ps,
                "worker": (DYNAMIC,) * (world_size - 1 - num_ps),
            }
        )
        if rank == 0:
            return spec, TaskSpec("chief", 0)
        if rank <= num_ps:
            return spec, TaskSpec("ps", rank - 1)
        return spec, TaskSpec("worker", rank - 1 - num_ps)

    @classmethod
    def local(cls, num_workers: int, num_ps: int, evaluator: bool = False, host: str = "127.0.0.1") -> ClusterSpec:
        """A cluster on `host` with a distinct free TCP port for every task, held for it until
        `release_local_ports(spec)`: each by a socket of this process bound to it with SO_REUSEADDR that never
        listens. The kernel then hands the port to no other bind to port 0 and no outgoing connection, while the
        role's ZeroMQ socket (SO_REUSEADDR too) binds and listens on it, and again after each restart (a port let
        go could be taken by another program before its role bound it: docs/architecture.md)."""
        for name, value in (("num_workers", num_workers), ("num_ps", num_ps)):
            if value < 0:
                raise ClusterSpecError(f"{name} must be >= 0, got {value}")
        ports = iter(_free_ports(host, 1 + num_ps + num_workers + int(evaluator)))

        def addresses(count: int) -> tuple[str, ...]:
            return tuple(f"{_bracketed(host)}:{next(ports)}" for _ in range(count))

        return cls(
            {
                "chief": addresses(1),
                "ps": addresses(num_ps),
                "worker": addresses(num_workers),
                "evaluator": addresses(int(evaluator)),
            }
        )


def cluster_from_env(
    environ: Mapping[str, str] | None = None, num_ps: int | None = None, num_workers: int | None = None
) -> tuple[ClusterSpec, TaskSpec] | None:
    """This process's cluster and task from, first found, SHARDFLOW_CLUSTER, TF_CONFIG, a JobSet or a Slurm
    heterogeneous job (cluster/managers.py), or torchrun; else None. Under torchrun the chief warns once when
    `num_workers` (the strategy's) differs from the workers the world size leaves."""
    from shardflow.cluster import managers  # it builds on this module

    if environ is None:
        environ = os.environ
    for name in (env.CLUSTER, "TF_CONFIG"):
        if environ.get(name, "").strip():
            return ClusterSpec.from_tf_config(environ[name], source=name)
    found = managers.from_cluster_manager(environ)
    if found is not None:
        return found
    if "RANK" in environ and "WORLD_SIZE" in environ:
        if num_ps is None:
            if not environ.get(env.NUM_PS):
                raise ClusterSpecError(
                    "running under torchrun (RANK and WORLD_SIZE are set) but the number of PS "
                    f"is unknown: pass num_ps or set {env.NUM_PS}"
                )
            num_ps = _env_int(environ, env.NUM_PS)
        spec, task = ClusterSpec.from_torchrun(environ, num_ps)
        if num_workers is not None and task.type == "chief":
            _warn_on_worker_count(spec, num_workers)
        return spec, task
    return None


_warned_worker_counts: set[tuple[int, int, int]] = set()


def _warn_on_worker_count(spec: ClusterSpec, num_workers: int) -> None:
    """torchrun decides the workers (WORLD_SIZE - 1 - num_ps); a strategy that expects others is told once."""
    given, num_ps = spec.num("worker"), spec.num("ps")
    if given == num_workers or (given, num_ps, num_workers) in _warned_worker_counts:
        return
    _warned_worker_counts.add((given, num_ps, num_workers))
    logging.getLogger(__name__).warning(
        "the strategy says num_workers=%d, but torchrun's WORLD_SIZE=%d with num_ps=%d leaves %d workers (rank 0 "
        "is the chief, ranks 1..num_ps the PS): training uses %d; start %d processes or set num_workers=%d",
        num_workers,
        given + num_ps + 1,
        num_ps,
        given,
        given,
        num_workers + num_ps + 1,
        given,
    )


def _read_tf_config(config: str | Mapping[str, Any], source: str) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """The "cluster" (with "master" renamed to "chief") and "task" objects of a TF_CONFIG."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as error:
            raise ClusterSpecError(
                f'{source} is not valid JSON ({error}); expected {{"cluster": {{...}}, "task": {{...}}}}'
            ) from None
    if not isinstance(config, Mapping):
        raise ClusterSpecError(f"{source} must be a JSON object, got {type(config).__name__}")
    cluster = config.get("cluster")
    if not isinstance(cluster, Mapping):
        raise ClusterSpecError(
            f'{source} has no "cluster" object: add {{"cluster": {{"chief": ["host:port"], '
            '"worker": [...], "ps": [...]}}'
        )
    task = config.get("task")
    if not isinstance(task, Mapping) or "type" not in task:
        raise ClusterSpecError(
            f'{source} has no "task" with a "type": add {{"task": {{"type": "worker", '
            '"index": 0}} naming this process'
        )
    roles = dict(cluster)
    if "master" in roles:
        if "chief" in roles:
            raise ClusterSpecError(f'{source} names both "master" and "chief": keep only "chief"')
        roles["chief"] = roles.pop("master")
    return roles, task


def _check_role(role: object) -> None:
    if role not in ROLES:
        raise ClusterSpecError(f"unknown role {role!r}: valid roles are {', '.join(ROLES)}")


def _address_list(role: str, addresses: object) -> tuple[str, ...]:
    if isinstance(addresses, str) or not isinstance(addresses, list | tuple):
        raise ClusterSpecError(f'role {role!r} must list its addresses, e.g. ["host:2222"], got {addresses!r}')
    for index, address in enumerate(addresses):
        if address != DYNAMIC and not _is_host_port(address):
            raise ClusterSpecError(
                f'address {address!r} of {TaskSpec(role, index).name} is not host:port (e.g. "10.0.0.2:2222")'
            )
    return tuple(addresses)


def _is_host_port(address: object) -> bool:
    if not isinstance(address, str):
        return False
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _check_counts(roles: Mapping[str, tuple[str, ...]]) -> None:
    if "chief" not in roles:
        raise ClusterSpecError(
            'the cluster has no \'chief\': add one address under "chief" (TF_CONFIG may call it "master")'
        )
    for role in _SINGLE_ROLES:
        if len(roles.get(role, ())) > 1:
            raise ClusterSpecError(
                f"the cluster has {len(roles[role])} {role} addresses {list(roles[role])}: "
                f"keep {'exactly' if role == 'chief' else 'at most'} one {role}"
            )


def _check_addresses(roles: Mapping[str, tuple[str, ...]]) -> None:
    owners: dict[str, str] = {}
    for role, addresses in roles.items():
        for index, address in enumerate(addresses):
            name = TaskSpec(role, index).name
            if address in owners:
                raise ClusterSpecError(
                    f"address {address!r} is used by both {owners[address]} and {name}: give every task its own port"
                )
            if address != DYNAMIC:
                owners[address] = name


def _count(num: int, role: str) -> str:
    return f"{num} {role}" if role == "ps" or num == 1 else f"{num} {role}s"


def host_of(address: str) -> str:
    """The host of "host:port" or "tcp://host:port", without an IPv6 host's brackets ("" for none)."""
    return address.removeprefix("tcp://").rpartition(":")[0].strip("[]")


def _bracketed(host: str) -> str:
    """An IPv6 host in brackets, so that "host:port" splits at the last colon."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _env_int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ClusterSpecError(f"{name}={environ[name]!r} is not an integer") from None


def _free_ports(host: str, count: int) -> list[int]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), 0))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock, port in zip(sockets, ports, strict=True):
        _held[f"{_bracketed(host)}:{port}"] = sock
    return ports


def release_local_ports(spec: ClusterSpec) -> None:
    """Lets go of the ports ClusterSpec.local held for `spec`'s tasks (none held: nothing)."""
    for role in ROLES:
        for index in range(spec.num(role)):
            held = _held.pop(spec.address(TaskSpec(role, index)), None)
            if held is not None:
                held.close()
