"""The diagnosis names the bottleneck of three simulated clusters: input-bound, PS-bound and compute-bound."""

import pytest
from synthetic import Cluster

from shardflow.profile.diagnose import diagnose
from shardflow.profile.events import load, write_table
from shardflow.profile.merge import merge


def table_of(role_traces, tmp_path):
    return load(write_table(merge(role_traces)["traceEvents"], tmp_path / "events.parquet"))


def diagnosed(cluster: Cluster, tmp_path):
    return diagnose(table_of(cluster.role_traces(), tmp_path))


def test_slow_input_pipeline_is_input_bound_and_names_the_slowest_worker(tmp_path):
    cluster = Cluster(num_workers=3, input_us=3000, compute_us=1000)
    first = diagnosed(cluster, tmp_path)[0]
    assert first.bottleneck == "input"
    assert first.message.startswith("input-bound: worker:")
    assert "waits for data 7" in first.message and "raise num_parallel_calls or prefetch" in first.message


def test_one_ps_serving_many_workers_is_ps_bound(tmp_path):
    cluster = Cluster(num_workers=6, num_ps=1, input_us=50, compute_us=500, apply_us=400)
    first = diagnosed(cluster, tmp_path)[0]
    assert (first.bottleneck, first.role) == ("ps", "ps:0")
    assert first.message.startswith("PS-bound: ps:0 applies 100% of all bytes")
    assert first.message.endswith("add a PS or repartition")


def test_the_busiest_of_two_ps_is_named_with_its_share_of_bytes(tmp_path):
    cluster = Cluster(num_workers=6, num_ps=2, input_us=50, compute_us=500, apply_us=400)
    cluster.bytes_per_ps = 1000
    first = diagnosed(cluster, tmp_path)[0]
    assert first.bottleneck == "ps" and "applies 50% of all bytes" in first.message


def test_heavy_forward_and_backward_is_compute_bound(tmp_path):
    cluster = Cluster(num_workers=2, input_us=50, compute_us=3000, skew_us={"worker:1": 1500.0})
    first = diagnosed(cluster, tmp_path)[0]
    assert first.bottleneck == "compute"
    assert first.fraction == pytest.approx(0.96, abs=0.01)
    assert first.message.startswith("compute-bound: forward and backward take 96% of each step")


def test_a_capture_without_workers_has_no_diagnosis(tmp_path):
    traces = [t for t in Cluster().role_traces() if "worker" not in next(iter(t["otherData"]["roles"]))]
    assert diagnose(table_of(traces, tmp_path)) == []
