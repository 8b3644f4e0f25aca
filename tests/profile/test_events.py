"""write_table streams events into Parquet row groups, from memory or from a trace file; foreign (non
line-oriented) trace files read too."""

import json

import pyarrow.parquet as pq
from synthetic import Cluster

from shardflow.profile import events
from shardflow.profile.merge import merge
from shardflow.profile.trace import write_trace


def test_large_traces_are_written_in_several_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(events, "ROWS_PER_GROUP", 16)
    trace = merge(Cluster(num_steps=10).role_traces())
    table_path = events.write_table(trace["traceEvents"], tmp_path / "events.parquet")
    num_events = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    metadata = pq.ParquetFile(table_path).metadata
    assert metadata.num_rows == num_events and metadata.num_row_groups > 1


def test_the_table_of_a_trace_file_equals_the_table_of_its_events_in_memory(tmp_path):
    trace = merge(Cluster(num_steps=4).role_traces())
    from_memory = events.write_table(trace["traceEvents"], tmp_path / "memory.parquet")
    from_file = events.build_table(write_trace(trace, tmp_path / "merged.trace.json.gz"), tmp_path / "file.parquet")
    assert pq.read_table(from_memory).equals(pq.read_table(from_file))


def test_a_plain_json_trace_from_another_tool_reads_with_its_names(tmp_path):
    foreign = {
        "traceEvents": [
            {"ph": "X", "name": "aten::mm", "pid": 7, "tid": 8, "ts": 1.5, "dur": 2.0, "args": {"shape": "[[2,2]]"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "worker:3"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 8, "args": {"name": "compute"}},
        ]
    }
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(foreign, indent=2))
    (row,) = pq.read_table(events.build_table(path, tmp_path / "events.parquet")).to_pylist()
    assert (row["role"], row["thread"], row["name"]) == ("worker:3", "compute", "aten::mm")
    assert (row["ts"], row["dur"], row["shape"]) == (1.5, 2.0, "[[2,2]]")
