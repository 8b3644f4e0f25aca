"""A state worker:0 hands the chief is streamed over the control plane (train/allreduce_state.py `stream`): at most
WINDOW chunks of it are stored at once, whatever its size, and the reader gets it whole."""

from __future__ import annotations

import threading

import pytest
import torch

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.train import allreduce_state
from shardflow.train.checkpoints.model_state import ModelState

WINDOW = allreduce_state.WINDOW


def _chunks(monkeypatch, num_chunks: int) -> tuple[ModelState, list[bytes]]:
    monkeypatch.setattr(allreduce_state, "CHUNK_BYTES", 4096)
    state = ModelState(step=3, params={"w": torch.arange(1024.0 * num_chunks)})
    return state, allreduce_state.encode(state)


def test_a_streamed_state_puts_no_chunk_past_the_window_until_the_reader_took_one(plane, monkeypatch):
    state, chunks = _chunks(monkeypatch, 3 * WINDOW)
    # A connection of its own, as worker:0's process has: a held wait on a shared one holds back the other's.
    worker_0 = ControlPlane(plane.address, timeout_s=10)
    sender = threading.Thread(
        target=allreduce_state.stream, args=(worker_0, "s", chunks), kwargs={"reader_gone": lambda: False}
    )
    sender.start()
    plane.wait([control_keys.state_chunk("s", WINDOW - 1)], waiting_for="the window's last chunk")
    assert not plane.is_set(control_keys.state_chunk("s", WINDOW))  # it waits for chunk 0 to be taken
    received = allreduce_state.receive(
        plane, "s", len(chunks), step=3, scalars={}, waiting_for="the stream", delete=True
    )
    sender.join()
    worker_0.close()
    assert torch.equal(received.params["w"], state.params["w"])
    left = [i for i in range(len(chunks)) if plane.is_set(control_keys.state_chunk("s", i))]
    taken = [i for i in range(len(chunks)) if plane.is_set(control_keys.state_taken("s", i))]
    assert (left, taken) == ([], [])


def test_a_stream_whose_reader_is_gone_stops_at_the_window(plane, monkeypatch):
    _, chunks = _chunks(monkeypatch, 2 * WINDOW)
    assert not allreduce_state.stream(plane, "s", chunks, reader_gone=lambda: True)
    assert plane.is_set(control_keys.state_chunk("s", WINDOW - 1))
    assert not plane.is_set(control_keys.state_chunk("s", WINDOW))


def test_a_reader_whose_sender_was_lost_amid_the_stream_stops_naming_the_chunk(plane, monkeypatch):
    _, chunks = _chunks(monkeypatch, 2 * WINDOW)
    assert not allreduce_state.stream(plane, "s", chunks, reader_gone=lambda: True)  # the window, then lost
    with pytest.raises(allreduce_state.StreamCut, match=f"'state/s/{WINDOW}'"):
        allreduce_state.receive(
            plane, "s", len(chunks), step=3, scalars={}, waiting_for="the stream", delete=True, sender_gone=lambda: True
        )
