"""A worker's input: auto-sharded as tf.distribute does when input_fn does not shard it, exactly once across the
workers and resumable; an empty first epoch fails naming the worker, unless allowed."""

from __future__ import annotations

import glob
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from shardflow import data
from shardflow.train.input import EmptyInputError, InputPosition
from shardflow.train.specs import InputContext, TrainSpec

NUM_RECORDS = 48


def drain(position: InputPosition, limit: int = 10**6) -> list[int]:
    seen: list[int] = []
    for _ in range(limit):
        batch = position.next()
        if batch is None:
            break
        seen.extend(int(i) for i in np.asarray(batch).reshape(-1))
    return seen


def unsharded(ctx: InputContext) -> data.Dataset:
    """A pipeline that forgets .shard(), with a shuffle whose seed each process draws for itself."""
    return data.Dataset.range(NUM_RECORDS).shuffle(NUM_RECORDS).batch(4)


def write_files(directory: Path, num_files: int = 4) -> str:
    per_file = NUM_RECORDS // num_files
    for f in range(num_files):
        lines = [str(f * per_file + r) for r in range(per_file)]
        (directory / f"part-{f}.txt").write_text("\n".join(lines) + "\n")
    return str(directory / "part-*.txt")


def test_a_pipeline_without_shard_is_read_once_across_workers(capsys):
    spec = TrainSpec(unsharded, epochs=1)
    shares = [drain(InputPosition(spec, InputContext(2, w))) for w in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(NUM_RECORDS))
    assert len(shares[0]) == len(shares[1]) == NUM_RECORDS // 2
    out = capsys.readouterr().out
    assert (
        "worker:1 keeps elements 1, 3, 5, ... of the input (AutoShardPolicy.DATA, as input_fn does not shard it" in out
    )


def test_a_pipeline_reading_files_is_sharded_by_file(tmp_path, capsys):
    pattern = write_files(tmp_path)

    def input_fn(ctx: InputContext) -> data.Dataset:
        files = data.Dataset.list_files(pattern)
        return files.interleave(data.TextLineDataset, cycle_length=2).map(int).batch(4)

    spec = TrainSpec(input_fn, epochs=1)
    shares = [drain(InputPosition(spec, InputContext(2, w))) for w in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(NUM_RECORDS))
    # Whole files: records 0-11 and 24-35 are files 0 and 2 of the sorted list.
    assert sorted(shares[0]) == [*range(12), *range(24, 36)]
    assert "worker:0 reads files 0, 2, 4, ... of the pipeline's sorted file list (AutoShardPolicy.FILE" in (
        capsys.readouterr().out
    )


def test_policy_off_in_the_pipeline_options_reads_everything_and_says_so(capsys):
    def input_fn(ctx: InputContext) -> data.Dataset:
        options = data.Options()
        options.experimental_distribute.auto_shard_policy = data.AutoShardPolicy.OFF
        return unsharded(ctx).with_options(options)

    spec = TrainSpec(input_fn, epochs=1)
    assert sorted(drain(InputPosition(spec, InputContext(2, 1)))) == list(range(NUM_RECORDS))
    assert "worker:1 reads the whole input, as each of the 2 workers does (AutoShardPolicy.OFF" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("how", ["shard", "worker_index"])
def test_an_input_fn_that_shards_itself_is_left_alone(how, capsys):
    def input_fn(ctx: InputContext) -> data.Dataset:
        ids = data.Dataset.range(NUM_RECORDS)
        if how == "shard":
            return ids.shard(3, 0).batch(4)  # its own choice of shards, whatever the workers
        return ids.skip(ctx.worker_index * 10).take(10).batch(5)

    spec = TrainSpec(input_fn, epochs=1)
    seen = drain(InputPosition(spec, InputContext(2, 1)))
    assert seen == (list(range(0, NUM_RECORDS, 3)) if how == "shard" else list(range(10, 20)))
    assert "worker:1 reads the share of the input that" in capsys.readouterr().out


def test_a_generator_that_reads_worker_index_only_when_iterated_counts_as_sharding(capsys):
    def input_fn(ctx: InputContext):
        yield from range(ctx.worker_index, 8, ctx.num_workers)

    assert drain(InputPosition(TrainSpec(input_fn, epochs=1), InputContext(2, 1))) == [1, 3, 5, 7]
    captured = capsys.readouterr()
    assert "worker:1 reads the share of the input that input_fn gives it" in captured.out, captured


def test_an_unsharded_generator_is_read_whole_with_a_warning(caplog):
    def input_fn(ctx: InputContext):
        yield from range(4)

    assert drain(InputPosition(TrainSpec(input_fn, epochs=1), InputContext(2, 0))) == [0, 1, 2, 3]
    assert "input_fn returned a generator and did not read ctx.worker_index" in caplog.text


def test_an_auto_sharded_position_resumes_exactly():
    def input_fn(ctx: InputContext) -> data.Dataset:
        return data.Dataset.range(NUM_RECORDS).shuffle(16, seed=5).batch(2)

    spec = TrainSpec(input_fn, epochs=2)
    seen: Counter[int] = Counter()
    for w in range(2):
        first = InputPosition(spec, InputContext(2, w))
        seen.update(drain(first, limit=15))  # into the second epoch
        state = json.loads(json.dumps(first.get_state()))
        seen.update(drain(InputPosition(spec, InputContext(2, w), state)))
    assert seen == Counter({record: 2 for record in range(NUM_RECORDS)})


def test_an_empty_first_epoch_fails_naming_the_worker_and_an_empty_glob(tmp_path):
    def input_fn(ctx: InputContext):
        for path in sorted(glob.glob(str(tmp_path / "*.tfrecord")))[ctx.worker_index :: ctx.num_workers]:
            yield from data.TFRecordDataset(path).batch(4)

    with pytest.raises(EmptyInputError) as raised:
        InputPosition(TrainSpec(input_fn, max_steps=40), InputContext(2, 1)).next()
    message = str(raised.value)
    assert message.startswith("worker:1 read no batch in its first epoch: input_fn(InputContext(num_workers=2, "), (
        message
    )
    assert "Likely a glob that matches no file" in message and "TrainSpec(allow_empty_input=True)" in message


def test_an_empty_share_of_a_non_empty_input_says_so():
    def input_fn(ctx: InputContext) -> data.Dataset:
        return data.Dataset.range(2).shard(ctx.num_workers, ctx.worker_index)  # 2 records, 3 workers

    with pytest.raises(EmptyInputError, match="the whole input is not empty, but this worker's share is"):
        InputPosition(TrainSpec(input_fn, epochs=2), InputContext(3, 2)).next()


def test_an_allowed_empty_input_ends_even_without_epochs(caplog):
    spec = TrainSpec(lambda ctx: iter(()), max_steps=40, allow_empty_input=True)
    position = InputPosition(spec, InputContext(2, 0))
    assert position.next() is None and position.next() is None
    assert "worker:0 has no input (TrainSpec.allow_empty_input=True): it trains no step" in caplog.text


def test_an_input_fn_returning_a_used_up_iterator_ends_the_input_after_the_first_epoch(caplog):
    batches = iter([1, 2, 3])
    position = InputPosition(TrainSpec(lambda ctx: batches, max_steps=100), InputContext(1, 0))
    assert drain(position) == [1, 2, 3]
    assert "epoch 1 of its input yielded no batch" in caplog.text
