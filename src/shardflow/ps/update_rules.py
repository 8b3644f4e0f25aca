"""How pushed gradients become updates: the async, sync and ssp modes and the global step they count."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

from shardflow.ps.sparse import EmbeddingGrad, RowGrad

MODES = ("async", "sync", "ssp")
MAX_PULL_AHEAD = 1_000_000
"""A pull for a global step further than this ahead of the PS is refused at once: far more steps than a PS applies
while a request may wait (`ApplyConfig.hold_timeout_s`)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class UpdateRule:
    """When the parameter servers apply pushed gradients; ParameterServerStrategy and ApplyConfig both are one."""

    mode: str = "async"
    """async: apply each worker's update on arrival, one global step each; sync: average
    `replicas_to_aggregate` updates of one version and apply them as one step; ssp: async, with a worker held
    back while it is more than `max_staleness` steps ahead of the slowest."""
    replicas_to_aggregate: int | None = None
    """sync only: gradients averaged into one step; None means all workers. Fewer than the workers makes the
    rest backup workers, whose late gradients are dropped and counted."""
    max_staleness: int = 2
    """ssp only: how many steps a worker may run ahead of the slowest active worker."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.mode not in MODES:
            raise ValueError(f"{name}.mode must be one of {MODES}, got {self.mode!r}")
        if self.replicas_to_aggregate is not None and not (
            _is_int(self.replicas_to_aggregate) and self.replicas_to_aggregate >= 1
        ):
            raise ValueError(f"{name}.replicas_to_aggregate must be an int >= 1, got {self.replicas_to_aggregate!r}")
        if not (_is_int(self.max_staleness) and self.max_staleness >= 0):
            raise ValueError(f"{name}.max_staleness must be an int >= 0, got {self.max_staleness!r}")


@dataclass(frozen=True, kw_only=True)
class ApplyConfig(UpdateRule):
    """The update rule every PS follows, with the job's size and end; sent by the chief when it initialises them."""

    num_workers: int = 1
    """Workers in the job; a finished worker no longer counts toward aggregation or staleness."""
    max_steps: int | None = None
    """Global step at which every PS stops applying updates; later pushes are dropped and counted."""
    snapshot_every_n_steps: int | None = None
    """Every PS snapshots its state when the global step is a multiple of this, for exact checkpoints."""
    hold_timeout_s: float = 60.0
    """How long a PS holds a request it cannot answer yet (a sync push waiting for the other replicas, an ssp
    push waiting for the slowest worker, a pull waiting for its step) before it answers it with an error saying
    what it waited for; the chief sets the strategy's `request_timeout_s`, after which the requester gave up."""
    pushes_carry_global_step: bool = False
    """sf.HybridStrategy: a push's `local_step` is the workers' global step + 1 (the all-reduced step its rows belong
    to), so the PS records its spans at that step and a capture's window cuts its part as it cuts the workers'."""
    max_held_requests: int | None = None
    """How many pushes, and how many pulls, a PS holds at once; one more is refused with an error. None: 4 per
    worker and 16 more, well above the one push per worker that training holds (pulls never wait in training),
    and apart so that pulls cannot crowd out the pushes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (type(self.hold_timeout_s) in (int, float) and 0 < self.hold_timeout_s < math.inf):
            raise ValueError(f"ApplyConfig.hold_timeout_s must be a positive number, got {self.hold_timeout_s!r}")
        held = self.max_held_requests
        if held is not None and not (_is_int(held) and held >= 1):
            raise ValueError(f"ApplyConfig.max_held_requests must be an int >= 1 or None, got {held!r}")
        if not (_is_int(self.num_workers) and self.num_workers >= 1):
            raise ValueError(f"ApplyConfig.num_workers must be an int >= 1, got {self.num_workers!r}")
        if self.replicas_to_aggregate is not None and self.replicas_to_aggregate > self.num_workers:
            raise ValueError(
                f"ApplyConfig.replicas_to_aggregate must be between 1 and num_workers={self.num_workers}, "
                f"got {self.replicas_to_aggregate}"
            )
        if self.max_steps is not None and not (_is_int(self.max_steps) and self.max_steps >= 0):
            raise ValueError(f"ApplyConfig.max_steps must be an int >= 0 or None, got {self.max_steps!r}")
        every = self.snapshot_every_n_steps
        if every is not None and not (_is_int(every) and every >= 1):
            raise ValueError(f"ApplyConfig.snapshot_every_n_steps must be an int >= 1 or None, got {every!r}")

    @property
    def replicas(self) -> int:
        return self.replicas_to_aggregate or self.num_workers

    @property
    def held_limit(self) -> int:
        return self.max_held_requests or 4 * self.num_workers + 16

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ApplyConfig:
        return cls(**d)


Pending = TypeVar("Pending")
"""A request whose reply is still to be sent (the server's; opaque here)."""


class Gradients(NamedTuple):
    """What a push (or, in sync mode, the pushes of one step) brings to apply."""

    dense: list[torch.Tensor]
    """One flat tensor per dtype buffer."""
    rows: list[list[RowGrad]]
    """Per row-sparse table (`torch.nn.Embedding(sparse=True)`), one gradient per push."""
    embeddings: list[list[EmbeddingGrad]]
    """Per `sf.nn` table, one gradient per push."""


_Held = TypeVar("_Held", bound=tuple[Any, ...])


def _past_deadline(entries: list[_Held], now: float) -> tuple[list[_Held], list[_Held]]:
    """`entries` (each ending with its deadline) split into those still to hold and those past their deadline."""
    return [entry for entry in entries if entry[-1] > now], [entry for entry in entries if entry[-1] <= now]


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of `tensors` (all on one device) is finite, exactly. A finite sum proves it, since a
    NaN or inf element makes the sum NaN or inf, and costs a fraction of `isfinite` (1.2 MB of float32 on one CPU
    thread: 23 us against 860 us); a sum that is not finite may have overflowed from finite values, so then
    `isfinite(...).all()` decides. One read back to the host however many tensors, and as few torch calls as can
    be (this runs on every push, on the worker and on the PS: 40 us against 85 us for a per-sum isfinite)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    if all(map(math.isfinite, torch.stack([t.sum() for t in tensors]).tolist())):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def nonfinite_key(worker_index: int) -> str:
    """The stats key counting one worker's refused non-finite pushes ("nonfinite" counts them all)."""
    return f"nonfinite/worker:{worker_index}"


_Answered = TypeVar("_Answered", contravariant=True)


class Answer(Protocol[_Answered]):
    def __call__(
        self, pending: _Answered, /, *, stale: bool = False, dropped: bool = False, nonfinite: int = 0
    ) -> None: ...


class Refused(ValueError):
    """A request the PS will not hold: as many are held as may be, or it waits for a step no job reaches."""


class Updates(Generic[Pending]):
    """The global step and the update rule: which pushes make an update, and when each push and pull waiting
    for one is answered. Knows nothing of sockets or optimizers: `apply` makes an update of the mean of the
    gradients of the pushes it is given, `answer` replies to a push or pull (with the parameters, unless dropped).

    A request that cannot be answered yet is held: at most `config.held_limit` at once (one more raises Refused),
    each for at most `config.hold_timeout_s`, after which `expire` hands it back to be answered with an error.
    """

    def __init__(
        self,
        config: ApplyConfig,
        step: int,
        apply: Callable[[Gradients, list[Pending]], None],
        answer: Answer[Pending],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.step = step
        self._apply, self._answer, self._clock = apply, answer, clock
        self.active: set[int] = set(range(config.num_workers))
        self.finished_workers: set[int] = set()
        self.clocks: dict[int, int] = dict.fromkeys(self.active, 0)
        self.stats: dict[str, float] = {"applied": 0, "dropped_stale": 0, "dropped_after_max_steps": 0, "nonfinite": 0}
        # sync: gradients of the current version, summed, the pushes summed, and those of them not answered yet
        # with their deadlines (one past its deadline is answered with an error, its gradient stays in the sum).
        self._accumulated: Gradients | None = None
        self._accumulated_pushes: list[Pending] = []
        self._accumulated_workers: set[int] = set()
        self._waiting_for_update: list[tuple[Pending, float]] = []
        # ssp: pushes whose reply is held until the slowest worker catches up, with the clock each needs and its
        # deadline.
        self._held: list[tuple[Pending, int, float]] = []
        # Pulls waiting for a version that has not been applied yet, with the step each needs and its deadline.
        self._pulls: list[tuple[Pending, int, float]] = []
        self._next_deadline = math.inf

    @property
    def finished(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def pull(self, pending: Pending, min_step: int) -> None:
        """Answered once the global step reaches `min_step`; Refused if no job gets there while it waits."""
        if self.step >= min_step or self.finished:
            self._answer(pending)
            return
        max_steps = self.config.max_steps
        if max_steps is not None and min_step > max_steps:
            raise Refused(f"a pull for global step {min_step} waits for a step after max_steps={max_steps}")
        if min_step - self.step > MAX_PULL_AHEAD:
            raise Refused(
                f"a pull for global step {min_step} waits for more than {MAX_PULL_AHEAD} steps; "
                f"the PS is at {self.step}"
            )
        self._check_room(f"a pull for global step {min_step}", len(self._pulls))
        self._pulls.append((pending, min_step, self._deadline()))

    def in_sum(self, worker_index: int) -> bool:
        """sync: whether a step of the worker sits in the sum of the next global step, not applied yet."""
        return worker_index in self._accumulated_workers

    def hold_repeat(self, pending: Pending, worker_index: int) -> bool:
        """A push of a worker's step this PS had already (a restarted worker repeats it): held, as the step's first
        push was, while that step sits in the sum of the next update (True); else to be answered at once (False)."""
        if self.config.mode != "sync" or worker_index not in self._accumulated_workers:
            return False
        self._waiting_for_update.append((pending, self._deadline()))
        return True

    def admit(self, pending: Pending, base_step: int, worker_index: int) -> bool:
        """Whether a push is to be applied; one that is not (training is over, or sync and stale) is answered
        and counted here. Refused when the push may have to be held and as many requests are held as may be."""
        if self.finished:
            self.stats["dropped_after_max_steps"] += 1
            self._answer(pending, dropped=True)
            return False
        if self.config.mode == "async":
            return True
        if self.config.mode == "sync" and base_step != self.step:
            if base_step > self.step:
                raise ValueError(f"push for step {base_step} arrived before the PS reached it (at {self.step})")
            # A gradient computed on an older version is dropped and counted; its sender gets the current one.
            self.stats["dropped_stale"] += 1
            self._answer(pending, stale=True)
            return False
        if self.config.mode == "sync" and worker_index in self._accumulated_workers:
            # A worker's next step is computed on the update its last one is in (see RejoinReply.in_sum).
            raise Refused(
                f"a second push of worker:{worker_index} for global step {self.step + 1}, whose sum holds one of its "
                "steps already; a worker computes its next step on the update its last one is in"
            )
        self._check_room(f"a {self.config.mode} push", len(self._accumulated_pushes) + len(self._held))
        return True

    def refuse(self, pending: Pending, worker_index: int) -> None:
        """A push that held NaN or inf, or whose worker's loss did: never applied, never accumulated, not a step.
        Counted, in all and per worker; its sender gets the current parameters and goes on (in sync, with a
        gradient of the same version next)."""
        if self.finished:
            self.stats["dropped_after_max_steps"] += 1
            self._answer(pending, dropped=True)
            return
        self.stats["nonfinite"] += 1
        per_worker = nonfinite_key(worker_index)
        self.stats[per_worker] = self.stats.get(per_worker, 0) + 1
        self._answer(pending, nonfinite=int(self.stats["nonfinite"]))

    def push(self, pending: Pending, worker_index: int, gradients: Gradients) -> None:
        """An admitted push: applied now (async, ssp) or with the others of its version (sync)."""
        if self.config.mode == "sync":
            self._accumulate(gradients)
            self._accumulated_pushes.append(pending)
            self._accumulated_workers.add(worker_index)
            self._waiting_for_update.append((pending, self._deadline()))
            self._maybe_apply_sync()
            return
        self._update(gradients, [pending])
        self.clocks[worker_index] = self.clocks.get(worker_index, 0) + 1
        if self.config.mode == "ssp":
            self._held.append((pending, self.clocks[worker_index], self._deadline()))
            self._release_held()
        else:
            self._answer(pending)
        self._release_pulls()

    def done(self, worker_index: int) -> None:
        """A finished worker no longer counts toward aggregation or staleness."""
        self.finished_workers.add(worker_index)
        self.lost(worker_index)

    def lost(self, worker_index: int) -> None:
        """A lost worker (the chief saw its heartbeat stop) no longer counts toward aggregation or staleness, until
        it rejoins: the steps in progress complete with the remaining replicas."""
        self.active.discard(worker_index)
        if self.config.mode == "sync":
            self._maybe_apply_sync()
        self._release_held()

    def rejoined(self, worker_index: int) -> None:
        """A worker that starts (again) counts toward aggregation and staleness, unless it had finished."""
        if worker_index not in self.finished_workers:
            self.active.add(worker_index)

    def stop(self, at_step: int | None = None) -> None:
        """End training at global step `at_step` (None: the current one; never beyond max_steps): pushes go on
        until it, later ones are dropped; once there, everything waiting is answered."""
        max_steps = self.step if at_step is None else max(at_step, self.step)
        if self.config.max_steps is not None:
            max_steps = min(max_steps, self.config.max_steps)
        self.config = dataclasses.replace(self.config, max_steps=max_steps)
        if not self.finished:
            return
        self._release_held()
        self._release_pulls()
        waiting, self._waiting_for_update, self._accumulated = self._waiting_for_update, [], None
        self._accumulated_pushes, self._accumulated_workers = [], set()
        for pending, _ in waiting:
            self._answer(pending)

    def expire(self) -> list[tuple[Pending, str]]:
        """The held requests past their deadline, no longer held, each with what it waited for, for the server to
        answer with an error. Costs one clock read while none is due."""
        now = self._clock()
        if now < self._next_deadline:
            return []
        self._pulls, pulls = _past_deadline(self._pulls, now)
        self._held, held = _past_deadline(self._held, now)
        self._waiting_for_update, waiting = _past_deadline(self._waiting_for_update, now)
        held_for = f"held {self.config.hold_timeout_s:g}s"
        expired = [(p, f"{held_for} waiting for global step {step}; the PS is at {self.step}") for p, step, _ in pulls]
        staleness = self.config.max_staleness
        for pending, clock, _ in held:
            waits_for = (
                f"{self._slowest_worker()} to come within max_staleness={staleness} of this worker's step {clock}"
            )
            expired.append((pending, f"{held_for} waiting for {waits_for}"))
        arrived = f"{len(self._accumulated_pushes)} of {self._replicas_needed()} arrived"
        for pending, _ in waiting:
            waits_for = f"the other pushes of global step {self.step + 1} ({arrived}; this one's gradient stays in it)"
            expired.append((pending, f"{held_for} waiting for {waits_for}"))
        deadlines = (
            [d for *_, d in self._pulls] + [d for *_, d in self._held] + [d for _, d in self._waiting_for_update]
        )
        self._next_deadline = min(deadlines, default=math.inf)
        return expired

    def _check_room(self, what: str, num_held: int) -> None:
        """Refused if `num_held` requests of the kind of `what` are held already, the most that may be."""
        if num_held >= self.config.held_limit:
            raise Refused(
                f"{what} may have to be held, and this PS holds {num_held} of its kind already, the most it may "
                "(ApplyConfig.max_held_requests)"
            )

    def _deadline(self) -> float:
        deadline = self._clock() + self.config.hold_timeout_s
        self._next_deadline = min(self._next_deadline, deadline)
        return deadline

    def _slowest_worker(self) -> str:
        clocks = {w: self.clocks.get(w, 0) for w in self.active}
        if not clocks:
            return "the slowest active worker"
        slowest = min(clocks, key=clocks.__getitem__)
        return f"the slowest active worker (worker:{slowest}, at its step {clocks[slowest]})"

    def _replicas_needed(self) -> int:
        return min(self.config.replicas, max(len(self.active), 1))

    def _update(self, gradients: Gradients, pushes: list[Pending]) -> None:
        self._apply(gradients, pushes)
        self.step += 1
        self.stats["applied"] += 1

    def _accumulate(self, gradients: Gradients) -> None:
        """Sum the dense gradients; keep the row-sparse and table ones, summed row by row when the update is applied."""
        if self._accumulated is None:
            self._accumulated = gradients
            return
        for total, grad in zip(self._accumulated.dense, gradients.dense, strict=True):
            total.add_(grad)
        for kept, pushed in zip(self._accumulated.rows, gradients.rows, strict=True):
            kept.extend(pushed)
        for kept_grads, pushed_grads in zip(self._accumulated.embeddings, gradients.embeddings, strict=True):
            kept_grads.extend(pushed_grads)

    def _maybe_apply_sync(self) -> None:
        if self._accumulated is None or len(self._accumulated_pushes) < self._replicas_needed():
            return
        pushes, self._accumulated_pushes = self._accumulated_pushes, []
        self._accumulated_workers = set()
        waiting, self._waiting_for_update = self._waiting_for_update, []
        accumulated, self._accumulated = self._accumulated, None
        self._update(accumulated, pushes)
        for pending, _ in waiting:
            self._answer(pending)
        self._release_pulls()

    def _release_held(self) -> None:
        if not self._held:
            return
        active_clocks = [self.clocks.get(w, 0) for w in self.active]
        slowest = min(active_clocks) if active_clocks else None
        still_held = []
        for pending, clock, deadline in self._held:
            # The worker wants to start step `clock`; it may while it is at most max_staleness ahead.
            if slowest is None or clock - slowest <= self.config.max_staleness or self.finished:
                self._answer(pending)
            else:
                still_held.append((pending, clock, deadline))
        self._held = still_held

    def _release_pulls(self) -> None:
        if not self._pulls:
            return
        waiting, self._pulls = self._pulls, []
        for pending, min_step, deadline in waiting:
            if self.step >= min_step or self.finished:
                self._answer(pending)
            else:
                self._pulls.append((pending, min_step, deadline))
