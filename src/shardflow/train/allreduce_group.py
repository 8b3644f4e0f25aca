"""The workers' gloo group of `sf.AllReduceStrategy`, and its forming again after a worker is lost: each forming is a
new generation of the group's rendezvous keys (cluster/dist_store.py); the members that lived through the last one
hand those restarted the state to go on from, and how many batches of each worker were applied so far, over the
group itself."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from torch._C._distributed_c10d import BroadcastOptions, ProcessGroupGloo

from shardflow.cluster import control_keys
from shardflow.cluster.dist_store import ControlPlaneStore, gloo_group
from shardflow.cluster.spec import TaskSpec, host_of
from shardflow.structs import prepared
from shardflow.train import allreduce_state, job_keys
from shardflow.train.allreduce_replay import Replay
from shardflow.train.job_keys import RejoinState
from shardflow.train.ps_role import advertised_address
from shardflow.train.role_context import RoleContext
from shardflow.train.strategy import AllReduceStrategy

GROUP = "workers"
_POLL_S = 0.2
"""How often a worker forming the group looks whether the others announced the same generation."""
_CHECK_EVERY_S = 1.0
"""How often a worker waiting in a collective looks at the heartbeats of the others."""


class GroupLostError(RuntimeError):
    """The workers' group cannot be formed again: a worker did not come back in time, or the survivors disagree."""


class NoSurvivorsError(GroupLostError):
    """Every worker of the group was lost at once: the state they held is gone (HybridStrategy: its chief goes back
    to the latest checkpoint with every PS)."""


class GenerationPassed(RuntimeError):
    """Another worker announced a later generation than the one this worker forms: it will not come to this one's
    rendezvous (it waits for this worker at its own), so forming goes on at `generation`."""

    def __init__(self, message: str, generation: int) -> None:
        super().__init__(message)
        self.generation = generation


class JobOverError(Exception):
    """The chief ended the job while this worker waited for the others to form the group."""


class PeerLostError(RuntimeError):
    """Another worker of the group was restarted or went silent while this one waited for it in a collective."""


class Peers:
    """The other workers of one generation of the group as their heartbeats show them (train/heartbeat.py: a beat
    names its process). One whose beat comes from another process (it was restarted) or stops for
    `heartbeat_timeout_s` is lost: a collective waiting for it is given up, rather than waiting out its deadline,
    as gloo does where a lost peer's connection closes while this worker waits to send to it."""

    def __init__(self, role: RoleContext, heartbeat_timeout_s: float, generation: int) -> None:
        self.control = role.control
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.generation = generation
        """This group's: another worker that announced a later one gave it up (it will wait for this one there)."""
        others = [f"worker:{index}" for index in range(role.num_workers) if index != role.task.index]
        now = time.monotonic()
        self.beats = {name: (self._beat(name), now) for name in others}
        self.pids = {name: beat.partition(":")[0] for name, (beat, _) in self.beats.items()}
        self.interrupt: Callable[[], None] | None = None
        """Called while a collective waits; raises to give it up (HybridStrategy: the PS were restored)."""

    def _beat(self, name: str) -> str:
        return (self.control.get_if_set(control_keys.heartbeat(name)) or b"").decode()

    def wait(self, work: Any) -> None:
        """Wait for `work` (a collective of this group); PeerLostError names the lost workers it would wait for."""
        while True:
            try:
                work.wait(datetime.timedelta(seconds=_CHECK_EVERY_S))
                return
            except RuntimeError:
                if work.is_completed():  # gloo's own error: a peer closed its connection, or the deadline passed
                    raise
            lost = self._lost()
            if lost:
                raise PeerLostError(f"{', '.join(lost)} lost (restarted, or no heartbeat) during the collective")
            if self.interrupt is not None:
                self.interrupt()

    def check(self, waiting_for: str) -> None:
        """Raise PeerLostError naming the workers lost (see the class) while this one waits for `waiting_for`."""
        lost = self._lost()
        if lost:
            raise PeerLostError(f"{', '.join(lost)} lost (restarted, or no heartbeat) while waiting for {waiting_for}")

    def _lost(self) -> list[str]:
        now, lost = time.monotonic(), []
        for name, (last, _) in self.beats.items():
            joined = self.control.get_if_set(control_keys.allreduce_joined(name))
            if joined is not None and int(joined) > self.generation:
                # Alive, but it gave this group up (it took this worker for lost, and this one was only slow).
                lost.append(f"{name} (forming generation {int(joined)})")
                continue
            # Not there yet: a restarted chief's control service, before the worker's next beat.
            beat = self._beat(name) or last
            if beat != last:
                self.beats[name] = (beat, now)
            pid = beat.partition(":")[0]
            self.pids[name] = self.pids[name] or pid  # known only from its first beat on that service
            if pid != self.pids[name] or now - self.beats[name][1] > self.heartbeat_timeout_s:
                lost.append(name)
        return lost


def generation_to_join(role: RoleContext) -> int:
    """0 at the job's start; for a restarted worker, the generation after the last one it joined. Restarted with
    the chief, whose control service lost that, it learns it from the others' `allreduce/live` keys (put before the
    job's start it read): the one they form, or the one after theirs."""
    joined = role.control.get_if_set(control_keys.allreduce_joined(role.task.name))
    if joined is not None:
        return int(joined) + 1
    others = [f"worker:{index}" for index in range(role.num_workers) if index != role.task.index]
    live = [role.control.read_if_set(job_keys.allreduce_live(name)) for name in others]
    trained = [worker for worker in live if worker is not None and worker.joined]
    return max((worker.generation if worker.forming else worker.generation + 1 for worker in trained), default=0)


def form(
    strategy: AllReduceStrategy,
    role: RoleContext,
    generation: int,
    deadline: float,
    replay: Replay | None = None,
    interrupt: Callable[[], None] | None = None,
) -> ProcessGroupGloo:
    """The group's `generation`, formed once every worker announced it (or a later one) before `deadline`
    (time.monotonic()); GroupLostError names those that did not. The announcement goes through `replay`, where
    given: a restarted chief gets it again. `interrupt` is called while others are awaited, in gloo's rendezvous
    too, and raises to give the wait up (HybridStrategy: a PS was lost, and every worker goes back to a checkpoint
    first). GenerationPassed where another worker announced a later generation meanwhile: it waits there."""
    control, name = role.control, role.task.name
    if replay is not None:
        replay.set_joined(generation)
    else:
        control.set(control_keys.allreduce_joined(name), str(generation))
    members = [f"worker:{index}" for index in range(role.num_workers)]

    def interrupted() -> None:
        """Raise to give this generation up: `interrupt`'s reason, or a worker that announced a later one."""
        if interrupt is not None:  # also when every worker announced it: one may have gone back meanwhile
            interrupt()
        _check_not_passed(name, generation, _announced(control, members))

    while True:
        if interrupt is not None:
            interrupt()
        announced = _announced(control, members)
        _check_not_passed(name, generation, announced)
        missing = [member for member in members if announced[member] < generation]
        if not missing:
            break
        if control.is_set(control_keys.SHUTDOWN):
            raise JobOverError(f"{name}: the job ended while {', '.join(missing)} had not joined the group")
        if time.monotonic() > deadline:
            limit = (
                f"startup_timeout_s={strategy.startup_timeout_s:g}s"
                if generation == 0
                else f"worker_rejoin_timeout_s={strategy.worker_rejoin_timeout_s:g}s"
            )
            raise GroupLostError(
                f"{name}: {', '.join(missing)} did not join generation {generation} of the all-reduce group within "
                f"{limit}: lost for good; run the job again to resume from its last checkpoint"
            )
        time.sleep(_POLL_S)
    setter = replay.set_rendezvous if replay is not None else None
    store = ControlPlaneStore(
        control, GROUP, generation, members, timeout_s=strategy.request_timeout_s, setter=setter, interrupt=interrupted
    )
    return _rendezvous(store, strategy, role)


def _rendezvous(store: ControlPlaneStore, strategy: AllReduceStrategy, role: RoleContext) -> ProcessGroupGloo:
    """gloo's group formed through `store`. A worker that announced the generation may never come to its rendezvous
    (it went back to a checkpoint, or died and was restarted into a later one): the store's interrupt gives the wait
    up, and what it raised goes on."""
    # The spec's host; under torchrun, which names only the chief's, loopback or this machine's address (as a PS's).
    advertised = advertised_address(role.spec.address(role.task), role.spec.address(TaskSpec("chief", 0)))
    host = host_of(advertised)
    try:
        return gloo_group(store, role.task.index, role.num_workers, host, timeout_s=strategy.request_timeout_s)
    except RuntimeError:
        if store.interrupted is not None:
            raise store.interrupted from None
        raise


def _announced(control: Any, members: list[str]) -> dict[str, int]:
    """The generation each member announced last (-1: none yet)."""
    return {member: int(control.get_if_set(control_keys.allreduce_joined(member)) or b"-1") for member in members}


def _check_not_passed(name: str, generation: int, announced: dict[str, int]) -> None:
    """GenerationPassed where a member announced a later generation than `generation`."""
    later = {member: joined for member, joined in announced.items() if joined > generation}
    if later:
        named = ", ".join(f"{member} generation {joined}" for member, joined in later.items())
        raise GenerationPassed(f"{name}: {named} announced while it formed {generation}", max(later.values()))


def rejoin(
    group: Any,
    role: RoleContext,
    survived: RejoinState | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> RejoinState:
    """Agree in a newly formed `group` on where training goes on: a survivor passes its own run (`survived`), a
    restarted worker None and gets the first survivor's run and state, loaded into `model` and `optimizer`. Both
    travel over the group (broadcast), never through the control store, whatever their size. The run agreed on;
    GroupLostError where no worker survived or the survivors stopped at different global steps."""
    survivors = _survivors(group, role, survived)
    step = max(survivors.values())
    if len(survivors) == role.num_workers and min(survivors.values()) == step:
        assert survived is not None
        return survived
    # A survivor one step behind gave up a collective that the others completed (it was slow, or its peer died
    # after the others took their part): it takes their state, as a restarted worker does.
    source = min(worker for worker, at in survivors.items() if at == step)
    run_data = state_data = None
    if role.task.index == source:
        assert survived is not None
        state = allreduce_state.capture(model, optimizer, survived.step)
        survived = msgspec.structs.replace(survived, scalars=state.scalars)
        run_data, state_data = msgspec.json.encode(survived), allreduce_state.to_bytes(state)
    run_data = _broadcast(group, source, run_data)
    state_data = _broadcast(group, source, state_data)
    if survived is not None and survived.step == step:
        return survived
    run = msgspec.json.decode(run_data, type=prepared(RejoinState))
    allreduce_state.restore(
        model, optimizer, allreduce_state.from_bytes(state_data, step=run.step, scalars=run.scalars)
    )
    return run


def _broadcast(group: Any, root: int, data: bytes | None) -> bytes:
    """`data`, given on rank `root` (None on the others), on every rank of `group`."""
    options = BroadcastOptions()
    options.rootRank = root
    size = torch.tensor([len(data) if data is not None else 0])
    group.broadcast([size], options).wait()
    if data is not None:
        group.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], options).wait()
        return data
    buffer = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast([buffer], options).wait()
    return buffer.numpy().tobytes()


def _survivors(group: Any, role: RoleContext, survived: RejoinState | None) -> dict[int, int]:
    """The workers that lived through the last generation, each with the global step it stopped at: one step apart
    at the most (a collective one of them completed included every worker's part)."""
    num_workers, index = role.num_workers, role.task.index
    who = torch.zeros(2 * num_workers, dtype=torch.float64)
    if survived is not None:
        who[index], who[num_workers + index] = 1.0, survived.step + 1.0
    group.allreduce([who]).wait()
    survivors = {worker: int(who[num_workers + worker]) - 1 for worker in range(num_workers) if who[worker]}
    if not survivors:
        raise NoSurvivorsError(
            f"{role.task.name}: every worker of the all-reduce group was lost at once; run the job again to resume "
            "from its last checkpoint"
        )
    steps = sorted(set(survivors.values()))
    if steps[-1] - steps[0] > 1:
        raise GroupLostError(
            f"{role.task.name}: the surviving workers {sorted(survivors)} stopped at global steps {steps}, more than "
            "one apart; the group cannot go on: run the job again to resume from its last checkpoint"
        )
    return survivors
