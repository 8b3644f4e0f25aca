"""TFRecord read + parse_example throughput, shardflow side by side with tf.data in one run.

The files hold Examples of 16 floats ("x"), an int64 label ("y") and a bytes id ("id"), 200k records in 8 files
(20k with --quick), written once under --data-dir. Each repeat runs every pipeline once, alternating; the best
repeat is kept. Figures are records/s on one core, except the last tf.data line, which lets AUTOTUNE use them all.

Usage: python benchmarks/input_formats.py [--quick] [--repeats R] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from result_line import print_result, row

from shardflow.data.example import FixedLenFeature, make_example, parse_example
from shardflow.data.sources import TFRecordDataset, TFRecordWriter

NUM_FILES = 8
BATCH_SIZE = 256
SPEC = {
    "x": FixedLenFeature([16], np.float32),
    "y": FixedLenFeature([1], np.int64),
    "id": FixedLenFeature([], bytes),
}


def write_files(directory: Path, num_records: int) -> list[str]:
    """The benchmark's files, written once per size and reused."""
    directory = directory / f"{num_records}"
    files = [str(directory / f"examples-{index}.tfrecord") for index in range(NUM_FILES)]
    if all(os.path.exists(name) for name in files):
        return files
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index, name in enumerate(files):
        with TFRecordWriter(name + ".partial") as writer:
            for record in range(num_records // NUM_FILES):
                x = rng.random(16, dtype=np.float32)
                writer.write(make_example({"x": x, "y": [record % 10], "id": b"user%d-%d" % (index, record)}))
        os.replace(name + ".partial", name)
    return files


def batches_of(records: Iterator[bytes]) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for record in records:
        batch.append(record)
        if len(batch) == BATCH_SIZE:
            yield batch
            batch = []
    if batch:
        yield batch


def shardflow_pipelines(files: list[str]) -> dict[str, Callable[[], int]]:
    def read_batch() -> int:
        return sum(len(batch) for batch in batches_of(iter(TFRecordDataset(files))))

    batches = list(batches_of(iter(TFRecordDataset(files))))

    def parse() -> int:
        return sum(len(parse_example(batch, SPEC)["y"]) for batch in batches)

    def read_batch_parse() -> int:
        return sum(len(parse_example(batch, SPEC)["y"]) for batch in batches_of(iter(TFRecordDataset(files))))

    return {"read+batch": read_batch, "parse_example of read batches": parse, "read+batch+parse": read_batch_parse}


def tf_data_pipelines(files: list[str]) -> dict[str, Callable[[], int]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    spec = {
        "x": tf.io.FixedLenFeature([16], tf.float32),
        "y": tf.io.FixedLenFeature([1], tf.int64),
        "id": tf.io.FixedLenFeature([], tf.string),
    }
    one_core = tf.data.Options()
    one_core.threading.private_threadpool_size = 1
    one_core.autotune.enabled = False

    def count(dataset: tf.data.Dataset) -> int:
        return sum(int((batch["y"] if isinstance(batch, dict) else batch).shape[0]) for batch in dataset)

    def read_batch() -> int:
        return count(tf.data.TFRecordDataset(files).batch(BATCH_SIZE).with_options(one_core))

    def read_batch_parse() -> int:
        parsed = tf.data.TFRecordDataset(files).batch(BATCH_SIZE).map(lambda batch: tf.io.parse_example(batch, spec))
        return count(parsed.with_options(one_core))

    def autotuned() -> int:
        auto = tf.data.AUTOTUNE
        parsed = tf.data.TFRecordDataset(files).batch(BATCH_SIZE)
        return count(parsed.map(lambda batch: tf.io.parse_example(batch, spec), num_parallel_calls=auto).prefetch(auto))

    return {"read+batch": read_batch, "read+batch+parse": read_batch_parse, "read+batch+parse, AUTOTUNE": autotuned}


def records_per_second(pipeline: Callable[[], int], expected: int) -> float:
    started = time.perf_counter()
    count = pipeline()
    elapsed = time.perf_counter() - started
    assert count == expected, f"the pipeline produced {count} records, expected {expected}"
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20k records and one repeat, for a smoke run")
    parser.add_argument("--repeats", type=int, metavar="R", help="repeats per pipeline, best kept (3; 1 with --quick)")
    parser.add_argument("--data-dir", type=Path, default=Path("bench-data/input_formats"), help="(%(default)s)")
    args = parser.parse_args()
    num_records = 20_000 if args.quick else 200_000
    repeats = args.repeats or (1 if args.quick else 3)
    files = write_files(args.data_dir, num_records)

    peers = {"shardflow": shardflow_pipelines(files), "tf.data": tf_data_pipelines(files)}
    best: dict[tuple[str, str], float] = {}
    for _ in range(repeats):
        for peer, pipelines in peers.items():
            for name, pipeline in pipelines.items():
                rate = records_per_second(pipeline, num_records)
                best[peer, name] = max(best.get((peer, name), 0.0), rate)

    print(f"{num_records:,} Examples in {NUM_FILES} files, batch {BATCH_SIZE}, best of {repeats}, records/s")
    names = list(dict.fromkeys(name for pipelines in peers.values() for name in pipelines))
    print(f"{'pipeline':<34}{'shardflow':>12}{'tf.data':>12}{'ratio':>8}")
    for name in names:
        mine, theirs = best.get(("shardflow", name)), best.get(("tf.data", name))
        ratio = f"{mine / theirs:>8.2f}" if mine and theirs else ""
        print(f"{name:<34}{f'{mine:,.0f}' if mine else '-':>12}{f'{theirs:,.0f}' if theirs else '-':>12}{ratio}")
    figures = {"quick": args.quick, "num_records": num_records}
    figures.update({f"{peer}:{name}": round(rate) for (peer, name), rate in best.items()})
    mine, theirs = "read+batch+parse", "read+batch+parse, AUTOTUNE"
    rows = [
        row(f"{name}, records/s", best["shardflow", name], "tf.data, one core", best["tf.data", name])
        for name in names
        if ("tf.data", name) in best and ("shardflow", name) in best
    ]
    rows.append(
        row(f"{mine}, records/s", best["shardflow", mine], "tf.data, AUTOTUNE on every core", best["tf.data", theirs])
    )
    print_result("input_formats", figures, rows)


if __name__ == "__main__":
    main()
