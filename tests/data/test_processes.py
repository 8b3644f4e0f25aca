"""map(use_processes=True): forked workers, shared-memory transfer without pickle, errors and crashes."""

from __future__ import annotations

import os
from multiprocessing import reduction
from typing import Any

import numpy as np
import pytest

from shardflow import data

D = data.Dataset


def describe(x: Any) -> Any:
    return {
        "pid": np.int64(os.getpid()),
        "square": np.full((2, 3), x * x, dtype=np.float32),
        "name": b"n%d" % x,
        "names": np.array([b"a", b"bb" * int(x)], dtype=object),
        "pair": (x, np.bool_(x % 2)),
    }


def test_process_map_equals_inline_map_and_runs_in_other_processes(same_elements: Any) -> None:
    in_processes = list(D.range(20).map(describe, num_parallel_calls=2, use_processes=True))
    inline = list(D.range(20).map(describe))
    assert {int(element["pid"]) for element in in_processes}.isdisjoint({os.getpid()})
    for element in in_processes + inline:
        element.pop("pid")
    same_elements(in_processes, inline)


def test_process_map_never_pickles(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle was used")

    monkeypatch.setattr(reduction.ForkingPickler, "dumps", refuse)
    assert list(D.range(10).map(lambda x: x + 1, num_parallel_calls=2, use_processes=True)) == list(range(1, 11))


def test_worker_errors_keep_their_type_message_and_position() -> None:
    def fail_on_three(x: Any) -> Any:
        if x == 3:
            raise ValueError("bad record 3")
        return x

    iterator = iter(D.range(6).map(fail_on_three, num_parallel_calls=2, use_processes=True))
    assert [next(iterator) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad record 3") as raised:
        next(iterator)
    assert any("worker process" in note for note in raised.value.__notes__)
    assert list(iterator) == [4, 5]
    iterator.close()


def test_a_crashed_worker_is_reported_with_its_exit_code() -> None:
    def crash(x: Any) -> Any:
        os._exit(7)

    iterator = iter(D.range(4).map(crash, num_parallel_calls=1, use_processes=True))
    with pytest.raises(RuntimeError, match="exited with code 7"):
        next(iterator)
    iterator.close()


def segments_named(prefix: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def test_close_leaves_no_shared_memory_behind() -> None:
    iterator: Any = iter(D.range(200).map(lambda x: np.zeros(100) + x, num_parallel_calls=2, use_processes=True))
    [next(iterator) for _ in range(5)]  # chunks are still in flight
    prefix = iterator._segments.prefix
    iterator.close()
    assert not segments_named(prefix)


def test_segments_of_a_dead_process_are_removed_by_the_next_map() -> None:
    dead_pid = 2**22 + 1  # above Linux's largest possible pid: never a live process
    stale = f"/dev/shm/shardflow-map-{dead_pid}-0000-1-0"
    with open(stale, "wb") as segment:
        segment.write(b"left behind by a killed job")
    assert list(D.range(3).map(lambda x: x, num_parallel_calls=1, use_processes=True)) == [0, 1, 2]
    assert not os.path.exists(stale)


def rows_and_scalars(x: Any) -> Any:
    if x == 37:
        raise ValueError("bad record 37")
    return {"row": np.full(3, x, dtype=np.float32), "pair": (np.int64(x), np.float16(x / 2))}


def test_chunks_that_cross_stacked_come_back_as_the_same_elements(same_elements: Any) -> None:
    def make(use_processes: bool) -> data.Dataset[Any]:
        inputs = D.from_tensor_slices({"x": np.arange(300), "v": np.arange(600.0).reshape(300, 2)})
        if not use_processes:
            return inputs.map(lambda e: rows_and_scalars(int(e["x"])))
        return inputs.map(lambda e: rows_and_scalars(int(e["x"])), num_parallel_calls=2, use_processes=True)

    def outcomes(dataset: data.Dataset[Any]) -> list[Any]:
        found: list[Any] = []
        iterator = iter(dataset)
        while True:
            try:
                found.append(next(iterator))
            except StopIteration:
                iterator.close()
                return found
            except ValueError as error:
                found.append(str(error))

    in_processes, inline = outcomes(make(True)), outcomes(make(False))
    assert in_processes[37] == inline[37] == "bad record 37"
    same_elements(in_processes[:37] + in_processes[38:], inline[:37] + inline[38:])


def test_elements_of_different_shapes_cross_one_by_one(same_elements: Any) -> None:
    def ragged(x: Any) -> Any:
        return np.arange(int(x) % 4)

    in_processes = list(D.range(50).map(ragged, num_parallel_calls=2, use_processes=True))
    same_elements(in_processes, list(D.range(50).map(ragged)))


def test_a_chunk_of_more_buffers_than_one_writev_takes_is_written_whole(tmp_path: Any) -> None:
    """A chunk of many small elements is more buffers than IOV_MAX (one writev of them all failed with EINVAL, and
    the map's worker died); some empty, one large."""
    from shardflow.data.processes import _IOV_MAX, write_all

    pieces: list[Any] = [bytes([k % 251]) * (k % 7) for k in range(3 * _IOV_MAX + 5)]
    pieces.append(np.arange(1 << 20, dtype=np.float32))
    path = tmp_path / "segment"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        write_all(descriptor, pieces)
    finally:
        os.close(descriptor)
    assert path.read_bytes() == b"".join(bytes(memoryview(piece).cast("B")) for piece in pieces)
