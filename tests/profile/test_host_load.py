"""When the cores of a host, not the number of workers, limit a job, and how the diagnosis says so."""

import pytest
from synthetic import Cluster

from shardflow.profile.diagnose import diagnose
from shardflow.profile.events import load, write_table
from shardflow.profile.host_load import host_loads
from shardflow.profile.memory import CPU_CORES, USABLE_CPUS_BUSY
from shardflow.profile.merge import merge


def with_load(role_traces, cpus, busy, usable_busy=None):
    """The role traces as run on one host, each role on `cpus`, keeping busy[role] cores busy through the capture,
    and its usable cores `usable_busy` busy with any process."""
    for trace in role_traces:
        role, info = next(iter(trace["otherData"]["roles"].items()))
        info.update(host="node-1", cpus=cpus, cpu_count=16)
        window = [e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"] or [0.0]
        for ts in (min(window), max(window)):
            trace["traceEvents"].append({"ph": "C", "name": CPU_CORES, "ts": ts, "args": {"value": busy[role]}})
            if usable_busy is not None:
                counter = {"ph": "C", "name": USABLE_CPUS_BUSY, "ts": ts, "args": {"value": usable_busy}}
                trace["traceEvents"].append(counter)
    return role_traces


def table_of(role_traces, tmp_path):
    merged = merge(role_traces)
    return load(write_table(merged["traceEvents"], tmp_path / "events.parquet", merged["otherData"]))


COMPUTE_BOUND = Cluster(num_workers=2, input_us=50, compute_us=3000)
BUSY = {"chief": 0.0, "worker:0": 0.45, "worker:1": 0.45, "ps:0": 0.05}


@pytest.mark.parametrize(
    ("cpus", "usable_busy", "saturated"),
    [
        ([0], None, True),  # the job keeps 0.95 of its one core busy
        ([0, 1], 1.9, True),  # the job keeps 0.95 of 2 cores busy, other processes the rest
        ([0, 1, 2, 3], 1.2, False),
        ([0, 1], None, False),
    ],
)
def test_a_host_is_saturated_when_the_cores_the_job_may_use_are_busy(tmp_path, cpus, usable_busy, saturated):
    table = table_of(with_load(COMPUTE_BOUND.role_traces(), cpus, BUSY, usable_busy), tmp_path)
    (load,) = host_loads(table)
    assert (load.roles, load.usable_cores) == (["chief", "worker:0", "worker:1", "ps:0"], len(cpus))
    assert load.busy_cores == pytest.approx(0.95)
    assert load.saturated is saturated


def test_a_compute_bound_job_on_saturated_cores_is_not_told_to_add_workers(tmp_path):
    table = table_of(with_load(COMPUTE_BOUND.role_traces(), [0], BUSY), tmp_path)
    first = diagnose(table)[0]
    assert first.bottleneck == "compute" and "add workers" not in first.message
    assert "the 4 processes of this job on node-1 share 1 core and keep 0.95 busy" in first.message


def test_a_compute_bound_job_with_idle_cores_is_told_to_add_workers(tmp_path):
    table = table_of(with_load(COMPUTE_BOUND.role_traces(), list(range(8)), BUSY), tmp_path)
    assert diagnose(table)[0].message.endswith("add workers or a faster device")


def test_a_capture_that_did_not_record_its_hosts_has_no_host_load(tmp_path):
    merged = merge(COMPUTE_BOUND.role_traces())
    assert host_loads(load(write_table(merged["traceEvents"], tmp_path / "events.parquet"))) == []
