"""Freeing the device between phases (reinforcement learning's rollouts): ``TwinFlowAdam.offload_states()``.

The device share's optimizer state (masters, moments or compact codes, step counters), the gradients and, if
asked, the weights move into **one** host buffer, allocated on first use (pinned when a GPU is there) and reused
by every later offload of no more bytes, with non-blocking copies on a side stream; then each tensor's storage
is resized to nothing, so the caching allocator gets the memory back, and ``torch.cuda.empty_cache()`` hands it
to the driver for another process. :meth:`StateOffload.reload` resizes each storage again and copies its bytes
back: every tensor object and view stays the one it was (hooks, ``attach()``, schedulers and compiled graphs
hold the same tensors), and training resumes bit for bit. A storage's device address may change across a
cycle: CUDA graphs captured over these tensors must be captured again.

The CPU share's state lives in host memory already and does not move.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
KINDS = ("optimizer", "grads")


def check_include(include: object) -> tuple[str, ...]:
    """`include` as a tuple of :data:`KINDS`, or ValueError naming the offending entry."""
    if isinstance(include, str):
        include = (include,)
    items = tuple(include) if isinstance(include, list | tuple | set | frozenset) else None
    if items is None or any(k not in KINDS for k in items):
        bad = include if items is None else next(k for k in items if k not in KINDS)
        raise ValueError(f"offload_states(include=...): {bad!r} is not one of {KINDS}; pass a subset, e.g. "
                         'include=("optimizer", "grads")')  # fmt: skip
    return items


class StateOffload:
    """Owns the host buffer and what is out: per storage, its offset in the buffer and its size."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # uint8, host; pinned when the tensors are on a GPU
        self.allocations = 0  # how many times the buffer was (re)allocated: once, in steady use
        self.out: list[tuple[torch.UntypedStorage, int, int]] = []

    def check(self, what: str) -> None:
        """Raises while the state is out: `what` would read or write tensors that have no memory now."""
        if self.out:
            raise RuntimeError(f"{what} while the optimizer's device state is offloaded (offload_states()); call "
                               "reload_states() first")  # fmt: skip

    @property
    def offloaded(self) -> bool:
        return bool(self.out)

    @property
    def offloaded_bytes(self) -> int:
        return sum(n for _, _, n in self.out)

    def _room(self, nbytes: int, size: int, cuda: bool) -> torch.Tensor:
        """The buffer, made (`size` bytes) where there is none or it holds less than `nbytes`."""
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # the old one goes before the new one is made
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
            self.allocations += 1
        return self.buffer

    @torch.no_grad()
    def offload(self, tensors: list[torch.Tensor], reserve: int = 0) -> int:
        """Moves the storages of `tensors` (each once) into the buffer and frees them; returns the bytes moved.
        A new buffer holds at least `reserve` bytes (what a later offload may move: gradients absent now)."""
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in storages:
                storages[s.data_ptr()] = s
        if not storages:
            return 0
        cuda = any(s.device.type == "cuda" for s in storages.values())
        total = sum(s.nbytes() for s in storages.values())
        buffer = self._room(total, max(total, reserve), cuda)
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the copies read what the compute stream wrote
        offset = 0
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for s in storages.values():
                n = s.nbytes()
                buffer[offset : offset + n].copy_(_bytes(s), non_blocking=cuda)
                self.out.append((s, offset, n))
                offset += n
        if stream is not None:
            stream.synchronize()  # the bytes are on the host before the device memory is handed back
        for s, _, _ in self.out:
            s.resize_(0)
        if cuda:
            torch.cuda.empty_cache()
        return total

    @torch.no_grad()
    def reload(self) -> int:
        """Gives every storage moved out its size and bytes back; returns the bytes moved."""
        if not self.out:
            return 0
        cuda = any(s.device.type == "cuda" for s, _, _ in self.out)
        stream = torch.cuda.Stream() if cuda else None
        total = 0
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for s, offset, n in self.out:
                s.resize_(n)
                _bytes(s).copy_(self.buffer[offset : offset + n], non_blocking=cuda)
                total += n
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)  # the compute stream sees the bytes before it reads
            stream.synchronize()  # and the buffer may be written again by the next offload
        self.out = []
        return total


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def offload(opt: Any, include: object, weights: bool) -> int:
    """TwinFlowAdam.offload_states: settles pending work, then moves `include`'s tensors (and the weights)."""
    kinds = check_include(include)
    if opt.offload.offloaded:
        log.info("offload_states(): already offloaded; nothing moved")
        return 0
    opt.synchronize()  # a delayed update, a speculative step or an attached step in flight lands first
    split = opt.coordinator.split
    kept: list[torch.Tensor] = []  # what is always there: the state, and the weights if asked
    if "optimizer" in kinds and split.device_state is not None:
        kept += split.device_state.tensors()
    if weights:
        kept += list(split.locals)
    grads = [g for g in (p.grad for p in split.params) if g is not None] if "grads" in kinds else []
    # the buffer is made for the largest offload: every trainable parameter's gradient present
    grad_bytes = sum(p.numel() * p.element_size() for p, q in zip(split.locals, split.params) if q.requires_grad)
    reserve = sum(t.untyped_storage().nbytes() for t in kept) + (grad_bytes if "grads" in kinds else 0)
    moved = opt.offload.offload(kept + grads, reserve)
    log.info("offload_states(): %.2f GiB moved to host memory", moved / 2**30)
    return moved
