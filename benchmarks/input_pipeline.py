"""The design's input pipelines, shardflow.data side by side with tf.data and torch's DataLoader in one run.

Files are generated once, as the tf.data peer measurement writes them (200k tf.train.Examples of 16 floats "x", an
int64 label "y" and a bytes id "id" in 8 TFRecord files; the same number of CSV lines of 16 floats and an int label
in 8 files), under --data-dir (default: a folder in the system's temp directory). The files are read once before
timing, so every run finds them in the page cache. Each repeat runs every pipeline once, the peers alternating which
goes first; the best repeat is kept. Printed with the figures: the machine's load (the cores other processes kept
busy), its speed (the time of a fixed Python loop) and each peer's CPU time per record (threads and worker processes).

  tfrecord  list_files -> interleave(TFRecordDataset, cycle_length=4) -> shuffle(10k) -> batch(256) -> parse_example
            -> prefetch
  csv       list_files -> interleave(TextLineDataset, cycle_length=4) -> shuffle(10k) -> batch(256) -> decode_csv
            -> prefetch
  python    a pure-Python function per record (about 20 us) over in-memory rows, batch(256): shardflow's map in 2
            processes, DataLoader(num_workers=2), tf.data's py_function
  state     the iterator state of the tfrecord pipeline after 50 batches (in its second shuffle window): shardflow's
            JSON against the files of a tf.train.Checkpoint of tf.data's iterator

Usage: python benchmarks/input_pipeline.py [--quick] [--repeats R] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import result_line

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

NUM_FILES = 8
BATCH_SIZE = 256
SHUFFLE_BUFFER = 10_000
CYCLE_LENGTH = 4
NUM_COLUMNS = 16
MAP_WORKERS = 2
STATE_AFTER_BATCHES = 50

Pipeline = Callable[[], int]
"""One full pass over a pipeline; returns the number of records it produced."""


def write_files(directory: Path, num_records: int) -> tuple[str, str]:
    """The TFRecord and CSV files (glob patterns), written once per size as the tf.data peer writes them."""
    import tensorflow as tf

    directory = directory / str(num_records)
    done = directory / "complete"
    patterns = str(directory / "t-*.tfrecord"), str(directory / "c-*.csv")
    if done.exists():
        return patterns
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = num_records // NUM_FILES
    for file_index in range(NUM_FILES):
        with tf.io.TFRecordWriter(str(directory / f"t-{file_index}.tfrecord")) as writer:
            for index in range(per_file):
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=rng.random(16).astype(np.float32))),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[index % 10])),
                    "id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"user%d" % index])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        rows = rng.random((per_file, NUM_COLUMNS))
        with open(directory / f"c-{file_index}.csv", "w") as lines:
            for index in range(per_file):
                lines.write(",".join(f"{value:.6f}" for value in rows[index]) + f",{index % 10}\n")
    done.touch()
    return patterns


def warm_page_cache(patterns: tuple[str, ...]) -> None:
    import glob

    for pattern in patterns:
        for name in glob.glob(pattern):
            Path(name).read_bytes()


def python_heavy(row: np.ndarray) -> np.float32:
    """Interpreter-bound work on one record, the same function in every peer."""
    values = row.tolist()
    total = 0.0
    for round_index in range(12):
        for value in values:
            total = total * 0.5 + value * value - round_index
    return np.float32(total)


# shardflow


def shardflow_pipelines(tfrecords: str, csvs: str, rows: np.ndarray) -> dict[str, Pipeline]:
    from shardflow import data

    features = {
        "x": data.FixedLenFeature([16], np.float32),
        "y": data.FixedLenFeature([1], np.int64),
        "id": data.FixedLenFeature([], bytes),
    }
    defaults: list[Any] = [[0.0]] * NUM_COLUMNS + [[0]]
    autotune = data.AUTOTUNE

    def files(pattern: str, source: Any, decode: Callable[[Any], Any]) -> Any:
        """list_files -> interleave(source) -> shuffle -> batch -> map(decode) -> prefetch, as the design states."""
        return (
            data.Dataset.list_files(pattern, shuffle=False)
            .interleave(source, cycle_length=CYCLE_LENGTH, num_parallel_calls=autotune)
            .shuffle(SHUFFLE_BUFFER)
            .batch(BATCH_SIZE)
            .map(decode, num_parallel_calls=autotune)
            .prefetch(autotune)
        )

    def tfrecord() -> int:
        pipeline = files(tfrecords, data.TFRecordDataset, lambda batch: data.parse_example(batch, features))
        return _count(pipeline, lambda batch: len(batch["y"]))

    def csv() -> int:
        pipeline = files(csvs, data.TextLineDataset, lambda lines: data.decode_csv(lines, defaults))
        return _count(pipeline, lambda columns: len(columns[-1]))

    def python() -> int:
        pipeline = (
            data.Dataset.from_tensor_slices(rows)
            .map(python_heavy, num_parallel_calls=MAP_WORKERS, use_processes=True)
            .batch(BATCH_SIZE)
            .prefetch(autotune)
        )
        return _count(pipeline, len)

    return {"tfrecord": tfrecord, "csv": csv, "python": python}


def _count(pipeline: Any, records_in: Callable[[Any], int]) -> int:
    """Records in a pass over a shardflow pipeline, closed at the end so that its worker processes are reaped (and
    their CPU time counted as this run's)."""
    iterator = iter(pipeline)
    try:
        return sum(records_in(batch) for batch in iterator)
    finally:
        iterator.close()


def shardflow_state_bytes(tfrecords: str) -> int:
    from shardflow import data

    features = {"x": data.FixedLenFeature([16], np.float32), "y": data.FixedLenFeature([1], np.int64)}
    pipeline = (
        data.Dataset.list_files(tfrecords, shuffle=False)
        .interleave(data.TFRecordDataset, cycle_length=CYCLE_LENGTH, num_parallel_calls=data.AUTOTUNE)
        .shuffle(SHUFFLE_BUFFER)
        .batch(BATCH_SIZE)
        .map(lambda batch: data.parse_example(batch, features), num_parallel_calls=data.AUTOTUNE)
        .prefetch(data.AUTOTUNE)
    )
    iterator = iter(pipeline)
    for _ in range(STATE_AFTER_BATCHES):
        next(iterator)
    state = json.dumps(iterator.get_state())
    iterator.close()
    return len(state.encode())


# tf.data


def tf_data_pipelines(tfrecords: str, csvs: str, rows: np.ndarray) -> dict[str, Pipeline]:
    import tensorflow as tf

    spec = {
        "x": tf.io.FixedLenFeature([16], tf.float32),
        "y": tf.io.FixedLenFeature([1], tf.int64),
        "id": tf.io.FixedLenFeature([], tf.string),
    }
    defaults: list[Any] = [[0.0]] * NUM_COLUMNS + [[0]]
    autotune = tf.data.AUTOTUNE

    def tfrecord() -> int:
        files = tf.data.Dataset.list_files(tfrecords, shuffle=False)
        pipeline = (
            files.interleave(tf.data.TFRecordDataset, cycle_length=CYCLE_LENGTH, num_parallel_calls=autotune)
            .shuffle(SHUFFLE_BUFFER)
            .batch(BATCH_SIZE)
            .map(lambda batch: tf.io.parse_example(batch, spec), num_parallel_calls=autotune)
            .prefetch(autotune)
        )
        return sum(int(batch["y"].shape[0]) for batch in pipeline)

    def csv() -> int:
        files = tf.data.Dataset.list_files(csvs, shuffle=False)
        pipeline = (
            files.interleave(tf.data.TextLineDataset, cycle_length=CYCLE_LENGTH, num_parallel_calls=autotune)
            .shuffle(SHUFFLE_BUFFER)
            .batch(BATCH_SIZE)
            .map(lambda lines: tf.io.decode_csv(lines, defaults), num_parallel_calls=autotune)
            .prefetch(autotune)
        )
        return sum(int(columns[-1].shape[0]) for columns in pipeline)

    def heavy(row: tf.Tensor) -> tf.Tensor:
        return tf.py_function(lambda value: python_heavy(value.numpy()), [row], Tout=tf.float32)

    def python() -> int:
        pipeline = (
            tf.data.Dataset.from_tensor_slices(rows)
            .map(heavy, num_parallel_calls=autotune)
            .batch(BATCH_SIZE)
            .prefetch(autotune)
        )
        return sum(int(batch.shape[0]) for batch in pipeline)

    return {"tfrecord": tfrecord, "csv": csv, "python": python}


def tf_data_state_bytes(tfrecords: str) -> int:
    import tensorflow as tf

    spec = {"x": tf.io.FixedLenFeature([16], tf.float32), "y": tf.io.FixedLenFeature([1], tf.int64)}
    autotune = tf.data.AUTOTUNE
    pipeline = (
        tf.data.Dataset.list_files(tfrecords, shuffle=False)
        .interleave(tf.data.TFRecordDataset, cycle_length=CYCLE_LENGTH, num_parallel_calls=autotune)
        .shuffle(SHUFFLE_BUFFER)
        .batch(BATCH_SIZE)
        .map(lambda batch: tf.io.parse_example(batch, spec), num_parallel_calls=autotune)
        .prefetch(autotune)
    )
    iterator = iter(pipeline)
    for _ in range(STATE_AFTER_BATCHES):
        next(iterator)
    with tempfile.TemporaryDirectory() as directory:
        tf.train.Checkpoint(iterator=iterator).write(os.path.join(directory, "ckpt"))
        return sum(path.stat().st_size for path in Path(directory).iterdir())


# torch DataLoader


def dataloader_pipelines(rows: np.ndarray) -> dict[str, Pipeline]:
    import torch.utils.data

    class Rows(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, index: int) -> np.float32:
            return python_heavy(rows[index])

    def python() -> int:
        loader = torch.utils.data.DataLoader(Rows(), batch_size=BATCH_SIZE, num_workers=MAP_WORKERS)
        return sum(len(batch) for batch in loader)

    return {"python": python}


# Measurement


class Run:
    """One timed pass: records, wall seconds, this process's CPU seconds (its threads and reaped children), and the
    cores that other processes kept busy meanwhile."""

    def __init__(self, pipeline: Pipeline) -> None:
        times = psutil.cpu_times()
        machine_before, own_before = sum(times) - times.idle - getattr(times, "iowait", 0.0), _own_cpu_s()
        started = time.perf_counter()
        self.records = pipeline()
        self.wall = time.perf_counter() - started
        self.cpu = _own_cpu_s() - own_before
        times = psutil.cpu_times()
        machine = sum(times) - times.idle - getattr(times, "iowait", 0.0) - machine_before
        self.others_cores = max(0.0, machine - self.cpu) / self.wall


def python_loop_seconds() -> float:
    """Seconds a fixed pure-Python loop takes: the speed of this (shared, virtual) machine at the time of the run."""
    started = time.perf_counter()
    total = 0
    for step in range(5_000_000):
        total += step
    return time.perf_counter() - started


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20k records and one repeat, for a smoke run")
    parser.add_argument("--repeats", type=int, metavar="R", help="repeats per pipeline, best kept (3; 1 with --quick)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "shardflow-bench-input-pipeline",
        help="where the generated files are kept between runs (%(default)s)",
    )
    args = parser.parse_args()
    num_records = 20_000 if args.quick else 200_000
    num_rows = 2_000 if args.quick else 20_000
    repeats = args.repeats or (1 if args.quick else 3)

    tfrecords, csvs = write_files(args.data_dir, num_records)
    warm_page_cache((tfrecords, csvs))
    rows = np.random.default_rng(1).random((num_rows, NUM_COLUMNS)).astype(np.float32)
    expected = {"tfrecord": num_records, "csv": num_records, "python": num_rows}
    peers = {
        "shardflow": shardflow_pipelines(tfrecords, csvs, rows),
        "tf.data": tf_data_pipelines(tfrecords, csvs, rows),
        "DataLoader": dataloader_pipelines(rows),
    }

    speed = [python_loop_seconds()]
    best: dict[tuple[str, str], float] = {}
    cpu_per_record: dict[tuple[str, str], float] = {}
    others: list[float] = []
    for repeat in range(repeats):
        for name in expected:
            order = [peer for peer in peers if name in peers[peer]]
            order = order if repeat % 2 == 0 else order[::-1]
            for peer in order:
                run = Run(peers[peer][name])
                assert run.records == expected[name], f"{peer} {name} produced {run.records}, expected {expected[name]}"
                if run.records / run.wall > best.get((peer, name), 0.0):
                    best[peer, name] = run.records / run.wall
                    cpu_per_record[peer, name] = run.cpu / run.records * 1e6
                others.append(run.others_cores)
    speed.append(python_loop_seconds())
    state = {"shardflow": shardflow_state_bytes(tfrecords), "tf.data": tf_data_state_bytes(tfrecords)}

    busy = f"{np.median(others):.2f} (median, max {max(others):.2f})"
    print(f"{num_records:,} records in {NUM_FILES} files, batch {BATCH_SIZE}, best of {repeats}, records/s")
    print(f"load: {busy} of {os.cpu_count()} cores busy with other processes")
    print(f"speed: a 5M-step Python loop took {speed[0]:.2f} s before the runs and {speed[1]:.2f} s after")
    print(f"{'pipeline':<10}{'shardflow':>12}{'tf.data':>12}{'ratio':>8}{'DataLoader':>12}{'ratio':>8}   CPU us/record")
    for name in expected:
        mine = best["shardflow", name]
        row = f"{name:<10}{mine:>12,.0f}{best['tf.data', name]:>12,.0f}{mine / best['tf.data', name]:>8.2f}"
        if ("DataLoader", name) in best:
            row += f"{best['DataLoader', name]:>12,.0f}{mine / best['DataLoader', name]:>8.2f}"
        else:
            row += " " * 20
        print(row + "   " + ", ".join(f"{peer} {cpu:.1f}" for (peer, of), cpu in cpu_per_record.items() if of == name))
    state_ratio = state["shardflow"] / state["tf.data"]
    print(f"{'state':<10}{state['shardflow']:>11,}B{state['tf.data']:>11,}B{state_ratio:>8.5f}")
    figures: dict[str, Any] = {"quick": args.quick, "num_records": num_records}
    figures["others_cores_median"] = round(float(np.median(others)), 2)
    figures["python_loop_s"] = [round(seconds, 2) for seconds in speed]
    figures.update({f"{peer}:{name}": round(rate) for (peer, name), rate in best.items()})
    figures.update({f"{peer}:{name}:cpu_us_per_record": round(cpu, 1) for (peer, name), cpu in cpu_per_record.items()})
    figures.update({f"{peer}:state_bytes": size for peer, size in state.items()})
    result_line.print_result("input_pipeline", figures, result_rows(best, state))


def result_rows(best: dict[tuple[str, str], float], state: dict[str, int]) -> list[dict[str, Any]]:
    """BENCHMARKS.md's rows: each pipeline against its peers, and the iterator state against tf.data's checkpoint."""
    targets = {("tf.data", "tfrecord"): ">= 1", ("tf.data", "csv"): ">= 1", ("tf.data", "python"): ">= 1.5"}
    targets["DataLoader", "python"] = ">= 1"
    rows = [
        result_line.row(f"{name} pipeline, records/s", best["shardflow", name], peer, best[peer, name], target=target)
        for (peer, name), target in targets.items()
    ]
    rows.append(
        result_line.row(
            "iterator state, bytes",
            state["shardflow"],
            "tf.data checkpoint",
            state["tf.data"],
            target="shardflow's state <= 1 KB",
            met=state["shardflow"] <= 1024,
        )
    )
    return rows


if __name__ == "__main__":
    main()
