"""A worker's tensors between its device and the wire, which carries only host (CPU) tensors. On a CUDA device
the copies go through pinned host memory on a stream of their own, so they overlap the compute; on the CPU the
tensors are handed on as they are, without a copy (the received frames stay zero-copy views)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostStaging:
    """The copies between one device and the host, for one model replica."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copied: torch.cuda.Event | None = None
        """Recorded on the side stream after the latest copies to the host."""

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `tensors`, in pinned memory, made once the compute queued so far has produced them:
        call `wait_host` before anything reads them. On the CPU, `tensors` themselves."""
        stream = self._stream
        if stream is None:
            return list(tensors)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        copies = []
        with torch.cuda.stream(stream):
            for tensor in tensors:
                if tensor.is_cpu:
                    copies.append(tensor)
                    continue
                # The compute stream may free a temporary (a zero gradient, a row slice) before this stream reads it.
                tensor.record_stream(stream)
                pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                copies.append(pinned.copy_(tensor, non_blocking=True))
        self._copied = stream.record_event()
        return copies

    def wait_host(self) -> None:
        """Block until the copies `to_host` started are done: ZeroMQ reads a sent frame's memory as it is."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def to_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` (received host frames) copied to the device through pinned memory on the side stream; the
        compute stream runs nothing queued after this call before the copies are done. On the CPU, `tensors`
        themselves."""
        stream = self._stream
        if stream is None:
            return list(tensors)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            # Fresh device memory: what the compute stream still reads is not overwritten, so no wait for it.
            copies = [tensor.pin_memory().to(self.device, non_blocking=True) for tensor in tensors]
        compute.wait_stream(stream)
        for copy in copies:
            copy.record_stream(compute)  # allocated on the side stream, read on the compute stream
        return copies
