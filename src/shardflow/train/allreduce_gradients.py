"""The mean gradient of one all-reduce step: each worker's gradients summed over the group in buckets, with a few
flags beside them, and divided by the number of workers that had a batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardflow.profile import spans
from shardflow.profile.recorder import SpanRecorder

FLAGS = HAD_BATCH, SAVE, STOP, ABORT, EVALUATE = range(5)
"""The flags every step all-reduces beside the gradients: how many workers had a batch, and worker:0's requests
(a checkpoint at this step, the last step, the end of the job, an evaluation by EvalSpec.every_n_secs), so that
every worker decides alike. Then one per
worker: whether that worker had a batch, so that every worker counts the batches of each one that were applied."""


class GradientReducer:
    """The parameters' gradients in buckets of at most `bucket_bytes` (one dtype each, in the order of
    `parameters`), each copied into a flat buffer of its own, reused every step, and all-reduced at once.

    The buffers are in host memory, where gloo sums them: page-locked where the parameters are on a GPU, so that
    each gradient comes over in one asynchronous copy and the mean goes back as one (several workers may then share
    a GPU, which NCCL refuses). On the CPU the gradients become views of the buffers: no copy back."""

    def __init__(
        self,
        group: Any,
        parameters: Sequence[torch.nn.Parameter],
        bucket_bytes: int,
        num_flags: int = len(FLAGS),
        wait: Callable[[Any], None] = lambda work: work.wait(),
    ) -> None:
        self.group = group
        """A gloo process group (cluster/dist_store.py gloo_group; torch's stubs lack its collectives)."""
        self.wait = wait
        """Waits for one of its collectives (allreduce_group.py Peers.wait gives up on a lost worker)."""
        self.buckets: list[list[torch.nn.Parameter]] = []
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in parameters:
            if param.requires_grad:
                by_dtype.setdefault(param.dtype, []).append(param)
        for params in by_dtype.values():
            bucket: list[torch.nn.Parameter] = []
            size = 0
            for param in params:
                nbytes = param.numel() * param.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    self.buckets.append(bucket)
                    bucket, size = [], 0
                bucket.append(param)
                size += nbytes
            if bucket:
                self.buckets.append(bucket)
        sizes = [sum(p.numel() for p in bucket) for bucket in self.buckets]
        # The flags ride at the end of the first bucket where its dtype counts workers exactly: no collective of
        # their own, whose round trip would cost as much as a small model's gradients.
        self.separate_flags = not self.buckets or self.buckets[0][0].dtype not in (torch.float32, torch.float64)
        if not self.separate_flags:
            sizes[0] += num_flags
        self.device = next((param.device for param in parameters), torch.device("cpu"))
        """Where the parameters are; the buffers are in host memory whatever it is."""
        pinned = self.device.type == "cuda"
        self.flat = [
            torch.empty(size, dtype=bucket[0].dtype, pin_memory=pinned)
            for size, bucket in zip(sizes, self.buckets, strict=True)
        ]
        if self.separate_flags:
            self.flags = torch.zeros(num_flags, dtype=torch.float64)
        else:
            self.flags = self.flat[0][-num_flags:]
        self.nbytes = sum(_nbytes(flat) for flat in self.flat) + (_nbytes(self.flags) if self.separate_flags else 0)
        """Bytes all-reduced per step: every bucket's, and the flags'."""

    def reduce(self, flags: Sequence[float], recorder: SpanRecorder | None = None, step: int = -1) -> list[float]:
        """Sum every worker's gradients (zeros where a worker has none, e.g. its input ended) and `flags` over the
        group; returns the summed flags. The sums stay in the flat buffers until `apply`. `recorder` records the
        ALLREDUCE span of global step `step` and one ALLREDUCE_BUCKET span per collective (profile/spans.py)."""
        started = time.perf_counter_ns()
        self.flags.copy_(torch.tensor(flags, dtype=self.flags.dtype))
        # Per collective: its work, its bucket (-1: the flags alone), its bytes and when it was issued.
        works = [self._issue(self.flags, -1)] if self.separate_flags else []
        on_device = self.device.type == "cuda"
        if on_device:  # the last step's mean may still be on its way to the device from these buffers
            torch.cuda.synchronize(self.device)
        for index, (bucket, flat) in enumerate(zip(self.buckets, self.flat, strict=True)):
            offset = 0
            for param in bucket:
                part = flat[offset : offset + param.numel()]
                if param.grad is None:
                    part.zero_()
                else:
                    part.copy_(param.grad.reshape(-1), non_blocking=on_device)
                offset += param.numel()
            if on_device:  # the bucket's copies done before gloo reads it
                torch.cuda.synchronize(self.device)
            works.append(self._issue(flat, index))
        for work, index, nbytes, issued in works:
            self.wait(work)
            if recorder is not None:
                recorder.end(spans.ALLREDUCE_BUCKET, step, issued, index, nbytes, thread=spans.ALLREDUCE_TRACK)
        if recorder is not None:
            recorder.end(spans.ALLREDUCE, step, started, len(self.buckets), self.nbytes)
        return self.flags.tolist()

    def _issue(self, flat: torch.Tensor, bucket: int) -> tuple[Any, int, int, int]:
        issued = time.perf_counter_ns()
        return self.group.allreduce([flat]), bucket, _nbytes(flat), issued

    def apply(self, contributors: float) -> None:
        """Each parameter's gradient becomes the summed one divided by `contributors`: the mean over the workers
        that had a batch, as one process would compute on their batches together (of equal sizes)."""
        for bucket, flat in zip(self.buckets, self.flat, strict=True):
            flat.div_(contributors)
            offset = 0
            for param in bucket:
                mean = flat[offset : offset + param.numel()].view_as(param)
                param.grad = mean if mean.device == param.device else mean.to(param.device, non_blocking=True)
                offset += param.numel()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
