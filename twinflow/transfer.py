"""Pinned, double-buffered staging between the device and the host.

Two buffers per direction, each of `chunk_size` elements, allocated once and
reused every step. On CUDA the copies run on their own streams and are
ordered with events; on a CPU-only machine the same code runs with ordinary
memory and synchronous copies, so tests exercise the same logic.
"""

from __future__ import annotations

import contextlib

import torch


class _NoEvent:
    """Stands in for a CUDA event where copies are synchronous."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Staging:
    """Two download (gradient) and two upload (weight) byte buffers, and the streams that fill them.

    Buffers hold raw bytes so one chunk can carry pieces of several dtypes;
    `chunk_bytes` is the size of each of the four buffers.
    """

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.cuda = device.type == "cuda"
        try:
            self.grad_bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
            self.param_bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        except RuntimeError as exc:
            raise RuntimeError(
                f"TwinFlowAdam could not allocate {4 * chunk_bytes / 2**20:.1f} MiB of pinned host memory for its "
                f"staging buffers (4 x {chunk_bytes} bytes); pass a smaller chunk_bytes to TwinFlowAdam"
            ) from exc
        self.pinned_bytes = 4 * chunk_bytes if self.cuda else 0
        if self.cuda:
            self.d2h_stream = torch.cuda.Stream(device)
            self.h2d_stream = torch.cuda.Stream(device)
            self.grad_ready = [torch.cuda.Event() for _ in range(2)]
            self.upload_done = [torch.cuda.Event() for _ in range(2)]
        else:
            self.grad_ready = [_NoEvent() for _ in range(2)]
            self.upload_done = [_NoEvent() for _ in range(2)]

    @staticmethod
    def view(buf: torch.Tensor, byte_offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return buf[byte_offset : byte_offset + numel * dtype.itemsize].view(dtype)

    def d2h(self):
        return torch.cuda.stream(self.d2h_stream) if self.cuda else contextlib.nullcontext()

    def h2d(self):
        return torch.cuda.stream(self.h2d_stream) if self.cuda else contextlib.nullcontext()

    def start_step(self) -> None:
        """Downloads may start once everything queued so far (backward, clipping) has run."""
        if self.cuda:
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))

    def finish_step(self) -> None:
        """Work queued after step() (the next forward) waits for the uploaded weights."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d_stream)
