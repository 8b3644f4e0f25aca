"""The cluster a JobSet pod or a Slurm heterogeneous-job task sees, where cluster_from_env looks first, and the
torchrun warning about num_workers; errors say what to fix."""

import json
import logging

import pytest

from shardflow.cluster import spec as spec_module
from shardflow.cluster.managers import expand_nodelist, from_jobset, from_slurm_hetjob
from shardflow.cluster.spec import ClusterSpecError, TaskSpec, cluster_from_env

JOBSET_POD = {
    "JOBSET_NAME": "clicks",
    "REPLICATED_JOB_NAME": "worker",
    "JOB_INDEX": "2",
    "JOB_COMPLETION_INDEX": "0",
    "REPLICATED_JOB_REPLICAS": "3",
    "SHARDFLOW_NUM_PS": "2",
    "SHARDFLOW_NUM_WORKERS": "3",
    "SHARDFLOW_PORT": "3333",
}

SLURM_TASK = {
    "SLURM_HET_SIZE": "3",
    "SLURM_JOB_ID_HET_GROUP_0": "700",
    "SLURM_JOB_ID_HET_GROUP_1": "701",
    "SLURM_JOB_ID_HET_GROUP_2": "702",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "cpu07",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "cpu[08-09]",
    "SLURM_JOB_NODELIST_HET_GROUP_2": "gpu[1,3-4]",
    "SLURM_JOB_ID": "702",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "3",
}

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "5", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_jobset_pod_is_its_replicated_job_at_its_job_index_and_knows_every_stable_dns_name():
    spec, task = from_jobset(JOBSET_POD)

    assert task == TaskSpec("worker", 2)
    assert spec.roles == {
        "chief": ("clicks-chief-0-0.clicks:3333",),
        "ps": ("clicks-ps-0-0.clicks:3333", "clicks-ps-1-0.clicks:3333"),
        "worker": ("clicks-worker-0-0.clicks:3333", "clicks-worker-1-0.clicks:3333", "clicks-worker-2-0.clicks:3333"),
    }


def test_jobset_port_defaults_to_2222():
    spec, _ = from_jobset({key: value for key, value in JOBSET_POD.items() if key != "SHARDFLOW_PORT"})
    assert spec.address(TaskSpec("chief", 0)) == "clicks-chief-0-0.clicks:2222"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SHARDFLOW_NUM_WORKERS": ""}, "lacks SHARDFLOW_NUM_WORKERS"),
        ({"REPLICATED_JOB_REPLICAS": "4"}, "has 4 replicas but the job has 3 worker; keep SHARDFLOW_NUM_WORKERS"),
        ({"JOB_COMPLETION_INDEX": "1"}, r"one pod per Job \(parallelism: 1"),
        ({"REPLICATED_JOB_NAME": "trainer"}, "'trainer' is not a role; name the replicated jobs chief, ps, worker"),
        ({"JOB_INDEX": ""}, "lacks JOB_INDEX; map them from the pod's jobset.sigs.k8s.io annotations"),
        ({"JOB_INDEX": "3", "REPLICATED_JOB_REPLICAS": ""}, "JobSet: task worker:3 is out of range"),
        ({"SHARDFLOW_NUM_PS": "two"}, "SHARDFLOW_NUM_PS='two' is not an integer"),
    ],
)
def test_jobset_pod_with_an_environment_that_does_not_fit_says_what_to_fix(change, message):
    with pytest.raises(ClusterSpecError, match=message):
        from_jobset({**JOBSET_POD, **change})


def test_slurm_task_is_its_components_role_at_its_procid_and_each_role_has_its_own_port():
    spec, task = from_slurm_hetjob(SLURM_TASK)

    assert task == TaskSpec("worker", 1)
    assert spec.roles == {
        "chief": ("cpu07:2222",),
        "ps": ("cpu08:2223", "cpu09:2223"),
        "worker": ("gpu1:2224", "gpu3:2224", "gpu4:2224"),
    }
    chief = {**SLURM_TASK, "SLURM_JOB_ID": "700", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    assert from_slurm_hetjob(chief)[1] == TaskSpec("chief", 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_HET_SIZE": "2"}, "SLURM_HET_SIZE=2, but a shardflow heterogeneous job has 3 components"),
        # One srun across every component: each task sees the leader's job ID and a rank across all of them.
        ({"SLURM_JOB_ID": "700", "SLURM_STEP_NUM_TASKS": "6"}, r"own `srun --het-group=0 --ntasks-per-node=1`"),
        ({"SLURM_STEP_NUM_TASKS": "6"}, "the step has 6 tasks but component 2 \\(worker\\) has 3 node\\(s\\)"),
        ({"SLURM_JOB_ID": "999"}, "SLURM_JOB_ID=999 is none of the components' SLURM_JOB_ID_HET_GROUP_0..2"),
        ({"SLURM_JOB_NODELIST_HET_GROUP_1": ""}, "lacks SLURM_JOB_NODELIST_HET_GROUP_1, which sbatch sets"),
        ({"SLURM_PROCID": ""}, "Slurm: the environment lacks SLURM_PROCID"),
    ],
)
def test_slurm_task_with_an_environment_that_does_not_fit_says_what_to_fix(change, message):
    with pytest.raises(ClusterSpecError, match=message):
        from_slurm_hetjob({**SLURM_TASK, **change})


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node07", ["node07"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a1,b[9-11],c", ["a1", "b9", "b10", "b11", "c"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("x[1-2]-ib", ["x1-ib", "x2-ib"]),
    ],
)
def test_slurm_nodelist_expands_as_scontrol_show_hostnames_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-", "node[3-1]", "node[a-b]", "n1,,n2", "n]1[", "node[1-2:2]"])
def test_slurm_nodelist_that_cannot_be_read_is_named(nodelist):
    with pytest.raises(ClusterSpecError, match="cannot read"):
        expand_nodelist(nodelist)


def _found(environ, **counts):
    found = cluster_from_env(environ, **counts)
    assert found is not None
    return found


def test_cluster_from_env_prefers_shardflow_cluster_and_tf_config_then_jobset_then_slurm_then_torchrun():
    tf_config = json.dumps({"cluster": {"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3"]}, "task": {"type": "ps"}})
    everything = {**TORCHRUN, **SLURM_TASK, **JOBSET_POD, "TF_CONFIG": tf_config}

    assert _found(everything, num_ps=1)[1] == TaskSpec("ps", 0)
    without_tf_config = {**everything, "TF_CONFIG": ""}
    assert _found(without_tf_config, num_ps=1)[1] == TaskSpec("worker", 2)  # the JobSet pod
    without_jobset = {key: value for key, value in without_tf_config.items() if key != "JOBSET_NAME"}
    assert _found(without_jobset, num_ps=1)[0].address(TaskSpec("chief", 0)) == "cpu07:3333"
    without_slurm = {key: value for key, value in without_jobset.items() if key != "SLURM_HET_SIZE"}
    assert _found(without_slurm, num_ps=1)[0].num("worker") == 3  # torchrun: 5 ranks, 1 PS


def test_torchrun_chief_warns_once_when_num_workers_disagrees_with_the_world_size(caplog, monkeypatch):
    monkeypatch.setattr(spec_module, "_warned_worker_counts", set())  # as in a fresh process
    caplog.set_level(logging.WARNING, logger="shardflow.cluster.spec")
    environ = {**TORCHRUN, "WORLD_SIZE": "7"}

    spec, _ = _found(environ, num_ps=2, num_workers=3)
    _found(environ, num_ps=2, num_workers=3)

    assert spec.num("worker") == 4
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1
    assert "num_workers=3, but torchrun's WORLD_SIZE=7 with num_ps=2 leaves 4 workers" in warnings[0]
    assert "start 6 processes or set num_workers=4" in warnings[0]


def test_torchrun_is_quiet_when_num_workers_matches_and_in_ranks_other_than_the_chief(caplog, monkeypatch):
    monkeypatch.setattr(spec_module, "_warned_worker_counts", set())
    caplog.set_level(logging.WARNING, logger="shardflow.cluster.spec")

    cluster_from_env({**TORCHRUN, "WORLD_SIZE": "8"}, num_ps=2, num_workers=5)
    cluster_from_env({**TORCHRUN, "WORLD_SIZE": "9", "RANK": "3"}, num_ps=2, num_workers=5)

    assert caplog.records == []
