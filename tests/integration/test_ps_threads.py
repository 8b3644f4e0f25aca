"""A PS of a local cluster takes its share of the cores it has as intra-op threads, and says how many."""

from __future__ import annotations

import re

from shardflow.train.ps_role import available_cores, threads_per_ps


def _reported_threads(out: str) -> list[int]:
    return [int(n) for n in re.findall(r"\[ps:\d+\] ps:\d+ serving at .*; (\d+) intra-op threads", out)]


def test_a_local_clusters_ps_reports_the_threads_it_took_from_its_cores(run_job, monkeypatch):
    monkeypatch.delenv("SHARDFLOW_PS_THREADS", raising=False)
    proc, _ = run_job("regression.py", mode="async", num_workers=1, num_ps=2, epochs=1, num_batches=20)
    assert proc.returncode == 0, proc.stdout
    assert _reported_threads(proc.stdout) == [threads_per_ps(available_cores(), 3)] * 2, proc.stdout


def test_the_ps_threads_variable_reaches_a_local_clusters_ps(run_job):
    proc, _ = run_job(
        "regression.py",
        env={"SHARDFLOW_PS_THREADS": "3"},
        mode="async",
        num_workers=1,
        num_ps=1,
        epochs=1,
        num_batches=20,
    )
    assert proc.returncode == 0, proc.stdout
    assert _reported_threads(proc.stdout) == [3], proc.stdout
