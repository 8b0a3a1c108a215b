"""Copy streams, events and pinned host buffers between the device and the host.

On CUDA the copies run on their own streams and are ordered with events; on
a CPU-only machine the same calls run with ordinary memory and synchronous
copies, so tests exercise the same logic there.
"""

from __future__ import annotations

import contextlib

import torch


class NoEvent:
    """Stands in for a CUDA event where copies are synchronous."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Streams:
    """One download (device-to-host) and one upload (host-to-device) stream, or stand-ins without CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None

    def event(self) -> torch.cuda.Event | NoEvent:
        return torch.cuda.Event() if self.cuda else NoEvent()

    def d2h(self):
        return torch.cuda.stream(self.d2h_stream) if self.cuda else contextlib.nullcontext()

    def h2d(self):
        return torch.cuda.stream(self.h2d_stream) if self.cuda else contextlib.nullcontext()

    def after_compute(self) -> None:
        """Downloads queued from now on start only after everything queued so far on the current stream."""
        if self.cuda:
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))

    def compute_after_downloads(self) -> None:
        """The current stream waits for every queued download (no host synchronisation).

        Whatever it runs next may write the gradients in place (zero_grad without set_to_none, an
        accumulating backward): those writes must not overtake the copies still reading them.
        """
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.d2h_stream)

    def compute_waits(self, event: torch.cuda.Event | NoEvent) -> None:
        """Work queued from now on on the current stream waits for `event` (no host synchronisation)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(event)


def pinned_buffers(sizes: list[int], pin: bool, what: str) -> list[torch.Tensor]:
    """One uint8 host tensor per size, page-locked when `pin`; a failure says how much and what to lower."""
    try:
        return [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes]
    except RuntimeError as exc:
        total = sum(sizes)
        raise RuntimeError(
            f"TwinFlowAdam could not allocate {total / 2**20:.1f} MiB of pinned host memory for {what} "
            f"({len(sizes)} buffers); lower the ratio, or free pinned memory held elsewhere"
        ) from exc


def view(buf: torch.Tensor, byte_offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` elements of `dtype` at `byte_offset` bytes into the uint8 buffer `buf`."""
    return buf[byte_offset : byte_offset + numel * dtype.itemsize].view(dtype)
