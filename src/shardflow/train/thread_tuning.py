"""A CPU worker of a local cluster chooses its torch threads by timing its own steps.

The local launcher gives each role its share of the cores (SHARDFLOW_LOCAL_THREADS), counting a PS as a role even
though it mostly waits for pushes. Whether a worker gains from the cores an idle PS leaves depends on the model:
large matrix products run 1.4x faster on two threads (the rec benchmark model, 1 worker + 1 PS on 2 cores), while
the small ops of the benchmark MLP run slower, each op waiting for a thread that the PS or another program took
the core from. So where the launcher offers more (SHARDFLOW_WORKER_THREADS_UP_TO: the cores per worker), a worker
times its steps with each count in turns (again only for a close call), keeps the faster, and times them again
every RETUNE_S, as the machine's load may change.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from shardflow import env

WARMUP_STEPS = 10
"""Steps not timed at the start: the first ones allocate, fill caches and connect."""
STEPS_EACH = 8
"""Steps with one thread count in a row, at least; the first of them is not counted (the thread pool changes size in
it)."""
RUN_S = 0.3
"""A run of one count lasts about this long at least: short steps (1 ms) are timed over more of them."""
MARGIN = 0.05
"""More threads than the share are kept only when this much faster: they cost the most when the load changes."""
ROUNDS = 2
"""Each count is timed this many times, in turns, so that a change of the machine's load meets both."""
CLEAR = 1.25
"""After the first round, a count whose steps took this much longer than another's is not timed again: the rounds
after it are for close calls, and each run of a loser costs its slower steps."""
RETUNE_S = 60.0
"""Seconds between two timings."""
SLOWER = 1.5
"""Between timings: steps this much slower than the choice was timed at (the median of as many steps as a timing's
run, about RUN_S of them) time it again at once; more threads than a role's share can cost 10x once other programs
take the cores. A blip of a few slow steps (another process's burst on a shared core) is no reason: each timing
runs the slower count for RUN_S."""


class ThreadTuner:
    """Told each step's wall time (`step_done`), it sets torch's intra-op threads for the next step."""

    def __init__(
        self, name: str, choices: Sequence[int], clock: Callable[[], float] = time.monotonic, warmup: int = WARMUP_STEPS
    ) -> None:
        if len(set(choices)) < 2 or min(choices) < 1:
            raise ValueError(f"ThreadTuner needs at least two thread counts of 1 or more, got {list(choices)}")
        self.name = name
        self.choices = sorted(set(choices))
        self.threads = torch.get_num_threads()
        self.chosen = self.threads
        """The count the last timing chose (before any: the one it began with)."""
        self._clock = clock
        self._skip = warmup
        self._plan: deque[int] = deque()
        self._times: dict[int, list[float]] = {}
        self._next_timing = clock()
        self._chosen_s = 0.0
        self._each = STEPS_EACH
        self._since: deque[float] = deque(maxlen=STEPS_EACH)
        """The last steps' times: before a timing, they size its runs; after it, they tell a slowdown."""
        self.timings = 0
        """Timings completed."""

    @classmethod
    def for_worker(cls, name: str, device: torch.device) -> ThreadTuner | None:
        """The tuner of a CPU worker that the launcher offers more threads than it has; None otherwise."""
        up_to = env.get_int(env.WORKER_THREADS_UP_TO)
        have = torch.get_num_threads()
        if device.type != "cpu" or up_to is None or up_to <= have:
            return None
        return cls(name, (have, up_to))

    def step_done(self, seconds: float) -> None:
        if self._skip > 0:
            self._skip -= 1
            self._since.append(seconds)
            return
        if not self._plan:
            if self._clock() < self._next_timing and not self._slowed(seconds):
                return
            typical = statistics.median(self._since) if self._since else seconds
            self._each = max(STEPS_EACH, min(100 * STEPS_EACH, math.ceil(RUN_S / max(typical, 1e-6))))
            self._plan = deque(count for _ in range(ROUNDS) for count in self.choices for _ in range(self._each))
            self._times = {count: [] for count in self.choices}
            self._set(self._plan[0])
            return  # this step ran with the threads chosen before
        threads = self._plan.popleft()
        if len(self._plan) % self._each != self._each - 1:  # not the first step of its run
            self._times[threads].append(seconds)
        if self._plan and not self._clear_after_the_first_round():
            self._set(self._plan[0])
        else:
            self._plan.clear()
            self._choose()

    def _clear_after_the_first_round(self) -> bool:
        """Whether the first round just ended with one count CLEAR times slower than another."""
        if len(self._plan) != (ROUNDS - 1) * len(self.choices) * self._each:
            return False
        medians = [statistics.median(times) for times in self._times.values()]
        return max(medians) >= CLEAR * min(medians)

    def _slowed(self, seconds: float) -> bool:
        """Whether the median of the steps since the last check, as many as a timing's run, is SLOWER times the
        choice's; checked once per run's worth of steps (a median of hundreds each step: 1% of a 1 ms step)."""
        self._since.append(seconds)
        if len(self._since) < (self._since.maxlen or STEPS_EACH):
            return False
        if statistics.median(self._since) > SLOWER * self._chosen_s:
            return True  # the timing sizes its runs from these steps
        self._since.clear()
        return False

    def _choose(self) -> None:
        medians = {count: statistics.median(times) for count, times in self._times.items()}
        best, share = min(medians, key=lambda count: medians[count]), self.choices[0]
        if medians[best] > (1 - MARGIN) * medians[share]:
            best = share
        if best != self.chosen or self.timings == 0:
            others = ", ".join(f"{medians[count] * 1e3:.3g} ms with {count}" for count in medians if count != best)
            # On the role's output, as the PS's threads are (a role's log records below warnings go nowhere).
            print(f"{self.name}: {best} torch threads, {medians[best] * 1e3:.3g} ms a step ({others})", flush=True)
        self._set(best)
        self.chosen, self._chosen_s = best, medians[best]
        self._since = deque(maxlen=self._each)
        self.timings += 1
        self._next_timing = self._clock() + RETUNE_S

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
