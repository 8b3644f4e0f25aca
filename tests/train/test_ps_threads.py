"""How many intra-op threads a PS takes: the cores it has, shared among the PS and workers of its machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardflow.cluster.spec import DYNAMIC, ClusterSpec, TaskSpec
from shardflow.train.ps_role import available_cores, cgroup_cpu_quota, ps_threads, roles_on_this_machine, threads_per_ps


def test_the_only_role_of_a_machine_takes_every_core():
    assert threads_per_ps(16, 1) == 16


def test_one_ps_beside_one_worker_takes_half_the_cores():
    assert threads_per_ps(16, 2) == 8


def test_more_roles_than_cores_still_give_a_ps_one_thread():
    assert threads_per_ps(2, 4) == 1


def test_every_ps_and_worker_of_a_local_cluster_is_on_this_machine():
    spec = ClusterSpec.local(num_workers=4, num_ps=3)
    assert roles_on_this_machine(spec, TaskSpec("ps", 1)) == 7


def test_only_the_roles_at_this_host_count():
    spec = ClusterSpec(
        {
            "chief": ("10.0.0.1:2222",),
            "ps": ("10.0.0.2:2222", "10.0.0.2:2223", "10.0.0.3:2222"),
            "worker": ("10.0.0.2:2224", "10.0.0.4:2222"),
        }
    )
    assert roles_on_this_machine(spec, TaskSpec("ps", 0)) == 3
    assert roles_on_this_machine(spec, TaskSpec("ps", 2)) == 1


def test_published_addresses_with_the_chief_on_loopback_mean_one_machine():
    spec = ClusterSpec({"chief": ("127.0.0.1:29500",), "ps": (DYNAMIC, DYNAMIC), "worker": (DYNAMIC,)})
    assert roles_on_this_machine(spec, TaskSpec("ps", 0)) == 3


def test_a_cgroup_v2_quota_caps_the_cores(tmp_path: Path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert available_cores(tmp_path) == min(len(os.sched_getaffinity(0)), 2)


def test_a_cgroup_v1_quota_of_minus_one_is_no_limit(tmp_path: Path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    assert available_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_the_environment_variable_overrides_the_rule(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARDFLOW_PS_THREADS", "3")
    assert ps_threads(ClusterSpec.local(num_workers=1, num_ps=8), TaskSpec("ps", 0)) == 3


def test_a_thread_count_below_one_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARDFLOW_PS_THREADS", "0")
    with pytest.raises(ValueError, match="SHARDFLOW_PS_THREADS=0"):
        ps_threads(ClusterSpec.local(num_workers=1, num_ps=1), TaskSpec("ps", 0))


def test_a_cgroup_v2_without_a_limit_leaves_the_affinity_mask(tmp_path: Path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
