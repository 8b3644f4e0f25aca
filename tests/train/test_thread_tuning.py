"""A CPU worker's choice of torch threads (train/thread_tuning.py), fed step times that depend on the threads it
set, and the launcher's offer of more threads (cluster/local_job.py local_threads)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from shardflow import env
from shardflow.cluster import local_job
from shardflow.cluster.spec import ClusterSpec
from shardflow.train import thread_tuning
from shardflow.train.thread_tuning import RETUNE_S, ThreadTuner

STEPS_OF_A_TIMING = thread_tuning.ROUNDS * 2 * thread_tuning.STEPS_EACH


@pytest.fixture(autouse=True)
def one_thread(monkeypatch) -> Iterator[None]:
    # Runs of STEPS_EACH steps for the steps of 10 ms and more the tests feed; 50 for steps of 1 ms.
    monkeypatch.setattr(thread_tuning, "RUN_S", 0.05)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(tuner: ThreadTuner, count: int, seconds: Callable[[int], float], clock: Clock | None = None) -> None:
    """`count` steps, each taking seconds(the torch threads it ran with)."""
    for _ in range(count):
        if clock is not None:
            clock.now += 0.01
        tuner.step_done(seconds(torch.get_num_threads()))


def test_a_model_faster_on_more_threads_keeps_them_and_says_so(capsys):
    tuner = ThreadTuner("worker:0", (1, 2), warmup=3)
    _steps(tuner, 3 + 1 + STEPS_OF_A_TIMING, lambda threads: 0.030 if threads == 1 else 0.020)
    assert torch.get_num_threads() == 2 and tuner.timings == 1
    assert capsys.readouterr().out == "worker:0: 2 torch threads, 20 ms a step (30 ms with 1)\n"


def test_a_model_slower_on_more_threads_goes_back_to_its_share():
    tuner = ThreadTuner("worker:0", (1, 2), warmup=0)
    _steps(tuner, 1 + STEPS_OF_A_TIMING, lambda threads: 0.010 if threads == 1 else 0.013)
    assert torch.get_num_threads() == 1 and tuner.timings == 1


def test_more_threads_barely_faster_are_not_taken():
    tuner = ThreadTuner("worker:0", (1, 2), warmup=0)
    _steps(tuner, 1 + STEPS_OF_A_TIMING, lambda threads: 0.010 if threads == 1 else 0.0097)
    assert torch.get_num_threads() == 1 and tuner.timings == 1


def test_a_clear_loser_is_timed_in_one_round_only():
    # 2 threads 1.5x slower: known after one run of each; a second round would only add its slower steps.
    tuner = ThreadTuner("worker:0", (1, 2), warmup=0)
    _steps(tuner, 1 + 2 * thread_tuning.STEPS_EACH, lambda threads: 0.010 if threads == 1 else 0.015)
    assert tuner.timings == 1 and torch.get_num_threads() == 1


def test_a_close_call_is_timed_in_every_round():
    tuner = ThreadTuner("worker:0", (1, 2), warmup=0)
    _steps(tuner, 1 + 2 * thread_tuning.STEPS_EACH, lambda threads: 0.010 if threads == 1 else 0.0115)
    assert tuner.timings == 0
    _steps(tuner, STEPS_OF_A_TIMING - 2 * thread_tuning.STEPS_EACH, lambda threads: 0.010 if threads == 1 else 0.0115)
    assert tuner.timings == 1 and torch.get_num_threads() == 1


def test_short_steps_are_timed_over_runs_of_at_least_run_s():
    # 1 ms steps: runs of 50 steps, sized from the warm-up's steps.
    tuner = ThreadTuner("worker:0", (1, 2), warmup=3)
    each = round(thread_tuning.RUN_S / 0.001)
    _steps(tuner, 3 + 1 + STEPS_OF_A_TIMING, lambda threads: 0.001 if threads == 1 else 0.0005)
    assert tuner.timings == 0
    _steps(
        tuner, thread_tuning.ROUNDS * 2 * each - STEPS_OF_A_TIMING, lambda threads: 0.001 if threads == 1 else 0.0005
    )
    assert tuner.timings == 1 and torch.get_num_threads() == 2


def test_the_first_step_of_each_run_is_not_counted():
    # The first step on a new count pays for the thread pool's change: 10x slower, and still the faster count wins.
    tuner = ThreadTuner("worker:0", (1, 2), warmup=0)
    last = [1]

    def seconds(threads: int) -> float:
        changed, last[0] = threads != last[0], threads
        return (0.020 if threads == 2 else 0.030) * (10 if changed else 1)

    _steps(tuner, 1 + STEPS_OF_A_TIMING, seconds)
    assert torch.get_num_threads() == 2


def test_the_choice_is_timed_again_after_a_while_and_follows_the_machine():
    clock = Clock()
    tuner = ThreadTuner("worker:0", (1, 2), clock=clock, warmup=0)
    _steps(tuner, 1 + STEPS_OF_A_TIMING, lambda threads: 0.030 if threads == 1 else 0.020, clock)
    assert torch.get_num_threads() == 2
    # Other programs now take the cores: two threads' steps take 1.2x longer than when timed, not enough to time
    # them again at once, and longer than one thread's.
    _steps(tuner, 100, lambda threads: 0.020 if threads == 1 else 0.024, clock)
    assert torch.get_num_threads() == 2 and tuner.timings == 1
    clock.now += RETUNE_S
    _steps(tuner, 1 + STEPS_OF_A_TIMING, lambda threads: 0.020 if threads == 1 else 0.024, clock)
    assert torch.get_num_threads() == 1 and tuner.timings == 2


def test_steps_much_slower_than_the_choice_time_it_again_at_once():
    tuner = ThreadTuner("worker:0", (1, 2), warmup=0)
    _steps(tuner, 1 + STEPS_OF_A_TIMING, lambda threads: 0.030 if threads == 1 else 0.020)
    assert torch.get_num_threads() == 2
    # Two threads now wait for each other at every op: 10x.
    _steps(tuner, thread_tuning.STEPS_EACH + 1 + STEPS_OF_A_TIMING, lambda threads: 0.030 if threads == 1 else 0.2)
    assert torch.get_num_threads() == 1 and tuner.timings == 2


def test_a_few_slow_steps_among_short_ones_are_no_reason_to_time_again():
    # 1 ms steps: runs of 50. Ten steps 3x slower (another process's burst on the core) leave the choice alone; as
    # many slow steps as a run time it again.
    tuner = ThreadTuner("worker:0", (1, 2), warmup=3)
    each = round(thread_tuning.RUN_S / 0.001)
    _steps(tuner, 3 + 1 + 2 * 2 * each, lambda threads: 0.001 if threads == 1 else 0.0011)
    assert tuner.timings == 1
    _steps(tuner, 10, lambda threads: 0.003)
    _steps(tuner, 2 * each, lambda threads: 0.001 if threads == 1 else 0.0011)
    assert tuner.timings == 1
    _steps(tuner, each + 1 + 2 * 2 * each, lambda threads: 0.003 if threads == 1 else 0.0033)
    assert tuner.timings == 2


def test_a_worker_tunes_only_on_the_cpu_and_when_offered_more_threads(monkeypatch):
    monkeypatch.delenv(env.WORKER_THREADS_UP_TO, raising=False)
    assert ThreadTuner.for_worker("worker:0", torch.device("cpu")) is None
    monkeypatch.setenv(env.WORKER_THREADS_UP_TO, "1")
    assert ThreadTuner.for_worker("worker:0", torch.device("cpu")) is None
    monkeypatch.setenv(env.WORKER_THREADS_UP_TO, "2")
    assert ThreadTuner.for_worker("worker:0", torch.device("cuda")) is None
    tuner = ThreadTuner.for_worker("worker:0", torch.device("cpu"))
    assert tuner is not None and tuner.choices == [1, 2]


def test_tuning_needs_two_counts():
    with pytest.raises(ValueError, match="at least two thread counts"):
        ThreadTuner("worker:0", (2, 2))


@pytest.mark.parametrize(
    ("cores", "workers", "ps", "expected"),
    [
        (2, 1, 1, {env.LOCAL_THREADS: "1", env.WORKER_THREADS_UP_TO: "2"}),
        (2, 2, 2, {env.LOCAL_THREADS: "1"}),
        (16, 4, 4, {env.LOCAL_THREADS: "2", env.WORKER_THREADS_UP_TO: "4"}),
    ],
)
def test_the_launcher_offers_the_workers_the_cores_per_worker_beyond_their_share(
    monkeypatch, cores, workers, ps, expected
):
    monkeypatch.delenv(env.LOCAL_THREADS, raising=False)
    monkeypatch.setattr("shardflow.cluster.local_job.os.cpu_count", lambda: cores)
    assert local_job.local_threads(ClusterSpec.local(num_workers=workers, num_ps=ps)) == expected


def test_threads_the_user_set_are_kept_and_not_tuned(monkeypatch):
    monkeypatch.setenv(env.LOCAL_THREADS, "1")
    assert local_job.local_threads(ClusterSpec.local(num_workers=1, num_ps=1)) == {}
