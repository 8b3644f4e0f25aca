"""as_torch() in torch's DataLoader: each worker process reads its own share, every element once per epoch, and
positions that StatefulDataLoader, torch.save and torch.distributed.checkpoint hold."""

from __future__ import annotations

import collections
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as load_checkpoint
from torch.distributed.checkpoint.state_dict_saver import save as save_checkpoint
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from shardflow import data

D = data.Dataset
NUM_FILES = 6
LINES_PER_FILE = 5


def workers(num_workers: int) -> dict[str, Any]:
    """DataLoader arguments for `num_workers` processes, forked: a spawned worker costs seconds to start."""
    return {"num_workers": num_workers, "multiprocessing_context": "fork"} if num_workers else {}


def write_text_files(directory: Path) -> list[str]:
    """Files whose lines are record ids: line j of file i is i * 100 + j."""
    names = []
    for file_index in range(NUM_FILES):
        path = directory / f"part-{file_index}.txt"
        path.write_text("".join(f"{file_index * 100 + line}\n" for line in range(LINES_PER_FILE)))
        names.append(str(path))
    return names


def record_id(line: bytes) -> np.int64:
    return np.int64(int(line))


ALL_IDS = [file_index * 100 + line for file_index in range(NUM_FILES) for line in range(LINES_PER_FILE)]


def records(source: str, directory: Path) -> data.Dataset[Any]:
    if source == "files":
        return data.TextLineDataset(write_text_files(directory)).map(record_id)
    return D.from_tensor_slices(np.array(ALL_IDS))


@pytest.mark.parametrize("source", ["memory", "files"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_reads_every_element_once_per_epoch(tmp_path: Path, source: str, num_workers: int) -> None:
    loader = DataLoader(records(source, tmp_path).batch(4).as_torch(), batch_size=None, **workers(num_workers))
    for _ in range(2):
        seen = collections.Counter(int(record) for batch in loader for record in batch)
        assert seen == collections.Counter(ALL_IDS)


def test_a_file_source_is_split_by_whole_files_between_workers(tmp_path: Path) -> None:
    def tag_with_worker(line: bytes) -> dict[str, np.int64]:
        worker = torch.utils.data.get_worker_info()
        assert worker is not None
        return {"record": record_id(line), "worker": np.int64(worker.id)}

    pipeline = data.TextLineDataset(write_text_files(tmp_path)).map(tag_with_worker)
    workers_of_file = collections.defaultdict(set)
    for element in DataLoader(pipeline.as_torch(), batch_size=None, **workers(2)):
        workers_of_file[int(element["record"]) // 100].add(int(element["worker"]))
    assert len(workers_of_file) == NUM_FILES
    assert all(len(readers) == 1 for readers in workers_of_file.values())
    assert set().union(*workers_of_file.values()) == {0, 1}


@pytest.mark.parametrize(("num_workers", "batch_sizes"), [(0, [4, 4, 2]), (2, [4, 4, 1, 1])])
def test_dataloader_batches_elements_with_its_collate(num_workers: int, batch_sizes: list[int]) -> None:
    pipeline = D.range(10).map(lambda i: {"id": i, "square": i * i})
    batches = list(DataLoader(pipeline.as_torch(), batch_size=4, **workers(num_workers)))
    # With workers, each batches its own share: worker 0 holds the even ids, worker 1 the odd ones.
    assert [len(batch["id"]) for batch in batches] == batch_sizes
    assert sorted(torch.cat([batch["id"] for batch in batches]).tolist()) == list(range(10))
    assert all(torch.equal(batch["square"], batch["id"] ** 2) for batch in batches)


def test_each_dataset_in_a_torch_chain_still_reads_its_share() -> None:
    chain = torch.utils.data.ChainDataset([D.range(6).as_torch(), D.range(100, 106).as_torch()])
    seen = [int(element) for element in DataLoader(chain, batch_size=None, **workers(2))]
    assert sorted(seen) == [*range(6), *range(100, 106)]


def test_set_epoch_reshuffles_a_seeded_pipeline_in_worker_processes() -> None:
    dataset = D.range(32).shuffle(32, seed=7).as_torch()

    def read_epoch(epoch: int) -> list[int]:
        dataset.set_epoch(epoch)
        return [int(element) for element in DataLoader(dataset, batch_size=None, **workers(2))]

    first, second, second_again = read_epoch(0), read_epoch(1), read_epoch(1)
    assert sorted(first) == sorted(second) == list(range(32))
    assert first != second and second == second_again


def shuffled_records(files: list[str]) -> data.Dataset[Any]:
    return data.TextLineDataset(files).map(record_id).shuffle(8, seed=5).batch(3)


def through_torch_save(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")  # torchdata 0.11 calls it on torch 2.13
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_exactly_mid_epoch(tmp_path: Path, num_workers: int) -> None:
    files = write_text_files(tmp_path)

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(shuffled_records(files).as_torch(), batch_size=None, **workers(num_workers))

    expected = [batch.tolist() for batch in loader()]
    first = loader()
    batches = iter(first)
    head = [next(batches).tolist() for _ in range(4)]
    state = through_torch_save(first.state_dict())
    del batches
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [batch.tolist() for batch in resumed] == expected


def test_iterator_state_dict_is_small_and_loads_with_weights_only() -> None:
    pipeline = D.range(100_000).shuffle(10_000, seed=1).batch(32)
    iterator = iter(pipeline.as_torch())
    for _ in range(5):
        next(iterator)
    state = through_torch_save(iterator.state_dict())
    assert len(json.dumps(state)) < 1024
    restored = iter(pipeline.as_torch())
    restored.load_state_dict(state)
    assert [next(restored).tolist() for _ in range(3)] == [next(iterator).tolist() for _ in range(3)]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no process group: meant here
def test_distributed_checkpoint_loads_into_a_fresh_iterators_state_dict(tmp_path: Path) -> None:
    def pipeline() -> data.TorchIterable:
        return D.range(50).shuffle(7, seed=2).batch(4).as_torch()

    iterator = iter(pipeline())
    for _ in range(3):
        next(iterator)
    save_checkpoint({"input": iterator.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    restored = iter(pipeline())
    template = {"input": restored.state_dict()}
    load_checkpoint(template, checkpoint_id=tmp_path, no_dist=True)
    restored.load_state_dict(template["input"])
    assert [batch.tolist() for batch in restored] == [batch.tolist() for batch in iterator]


def test_dataset_state_dict_resumes_a_dataloader_without_workers() -> None:
    def pipeline() -> data.TorchIterable:
        return D.range(20).shuffle(6, seed=3).batch(2).as_torch()

    expected = [batch.tolist() for batch in DataLoader(pipeline(), batch_size=None)]
    first = pipeline()
    batches = iter(DataLoader(first, batch_size=None))
    head = [next(batches).tolist() for _ in range(4)]
    resumed = pipeline()
    resumed.load_state_dict(first.state_dict())
    assert head + [batch.tolist() for batch in DataLoader(resumed, batch_size=None)] == expected


def test_loading_the_same_position_twice_reads_the_input_once() -> None:
    # StatefulDataLoader restores the dataset and then its iterator to the same position.
    reads = []

    def numbers() -> Any:
        for number in range(40):
            reads.append(number)
            yield np.int64(number)

    def pipeline() -> data.TorchIterable:
        return D.from_generator(numbers).shuffle(10, seed=1).as_torch()

    iterator = iter(pipeline())
    for _ in range(15):
        next(iterator)
    state = iterator.state_dict()
    restored = iter(pipeline())
    reads.clear()
    restored.load_state_dict(state)
    reads_for_one_load = len(reads)
    restored.load_state_dict(state)
    assert len(reads) == reads_for_one_load > 0
    assert next(restored) == next(iterator)


def test_a_position_from_a_worker_restores_only_in_that_worker() -> None:
    saved = {"num_workers": 2, "worker_index": 1, "position": "{}"}
    with pytest.raises(ValueError, match=r"saved in DataLoader worker 1 of num_workers=2 .* runs in a single process"):
        iter(D.range(4).as_torch()).load_state_dict(saved)


def test_copying_to_a_device_is_refused_in_worker_processes() -> None:
    loader = DataLoader(D.range(4).as_torch(device="meta"), batch_size=None, **workers(1))
    with pytest.raises(ValueError, match="pass pin_memory=True to the DataLoader"):
        list(loader)
