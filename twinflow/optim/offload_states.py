"""Freeing the device between phases (reinforcement learning's rollouts): ``TwinFlowAdam.offload_states()``.

The device share's optimizer state (masters, moments or compact codes, step counters), the gradients and, if
asked, the weights move into **one** host buffer, allocated on first use (pinned when a GPU is there) and reused
by every later offload of no more bytes, with non-blocking copies on a side stream; then each tensor's storage
is resized to nothing, so the caching allocator gets the memory back, and ``torch.cuda.empty_cache()`` hands it
to the driver for another process. :func:`reload` resizes each storage again and copies its bytes back: every
tensor object and view stays the one it was (hooks, ``attach()``, schedulers and compiled graphs hold the same
tensors), and training resumes bit for bit. A storage's device address may change across a cycle: CUDA graphs
captured over these tensors must be captured again.

While the state is out, the optimizer reads it where it is: a stand-in of the device state over host views of
the buffer (:meth:`StateOffload.host_view`) serves ``opt.state``, ``state_dict()``, copies and checkpoints
(copies, never views of the buffer, which the next offload overwrites), and an in-place write to a copy
``opt.state`` handed out lands in the buffer before it goes back. Steps, loads and assignments wait for
``reload_states()``.

The CPU share's state lives in host memory already and does not move.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from collections.abc import Callable
from typing import Any

import torch

from twinflow.base import distributed

log = logging.getLogger(__name__)
KINDS = ("optimizer", "grads")
ALIGN = 64  # each storage's place in the buffer starts at a multiple: a host view of any dtype is aligned


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


# DeepSpeed's names (its OffloadStateTypeEnum's values) for what ``engine.offload_states(include=...)`` moves
ENGINE_NAMES = {"optim_states": "optimizer", "hp_params": "optimizer", "lp_grads": "grads",
                "contiguous_grad_buffer": "grads", "lp_params": "weights"}  # fmt: skip


def engine_include(include: object) -> tuple[tuple[str, ...], bool]:
    """An engine's `include` (DeepSpeed's names or ours, ``"weights"`` among them; None: everything) as
    (:data:`KINDS` to move, whether the weights move), or ValueError naming the offending entry."""
    if include is None:
        return KINDS, True
    items = [include] if isinstance(include, str) else include
    if not isinstance(items, list | tuple | set | frozenset):
        items = [items]  # one enum member
    names = [ENGINE_NAMES.get(str(getattr(k, "value", k)), str(getattr(k, "value", k))) for k in items]
    for name, given in zip(names, items):
        if name not in (*KINDS, "weights"):
            raise ValueError(f"offload_states(include=...): {given!r} is not one of {(*KINDS, 'weights')} or "
                             f"DeepSpeed's {tuple(ENGINE_NAMES)}; pass None to move everything")  # fmt: skip
    return tuple(dict.fromkeys(n for n in names if n != "weights")), "weights" in names


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """`nbytes` of host memory; `pinned`: page-locked for the GPU's copies. Made as ordinary memory whose pages
    torch's threads touch at once, then registered with CUDA (unregistered when the tensor object goes).
    cudaHostAlloc, the usual path, locks one page after another: about 1.3 GB/s on an H100 host
    (benchmarks/pin_probe.py), against about 12 GB/s this way. Where registering fails, the usual path."""
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    buffer[:: mmap.PAGESIZE].zero_()  # a byte of every page: the pages made now, by all of torch's threads
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) != 0:
        log.info("offload_states(): registering the host buffer failed; pinning it with cudaHostAlloc")
        del buffer
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())  # before the memory is freed
    return buffer


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StateOffload:
    """Owns the host buffer and what is out: per storage, its offset in the buffer and its size."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # uint8, host; pinned when the tensors are on a GPU
        self.allocations = 0  # how many times the buffer was (re)allocated: once, in steady use
        self.out: list[tuple[torch.UntypedStorage, int, int]] = []
        self.place: dict[int, tuple[int, int]] = {}  # id(storage) -> (offset, bytes), while out
        self.transient: set[int] = set()  # id(storage) of the gradients among them
        # (parameter, gradient) pairs whose gradient is out: ``p.grad`` is None meanwhile, so that nothing outside
        # (a framework's ``module.cpu()`` at teardown, a norm) reads a tensor that has no memory. Only the
        # optimizer's zero_grad() drops them; a module's zero_grad() meanwhile finds no gradient to clear
        self.detached: list[tuple[torch.Tensor, torch.Tensor]] = []

    def check(self, what: str) -> None:
        """Raises while the state is out: `what` would write tensors that have no memory now."""
        if self.out:
            raise RuntimeError(f"{what} while the optimizer's device state is offloaded (offload_states()); call "
                               "reload_states() first")  # fmt: skip

    @property
    def offloaded(self) -> bool:
        return bool(self.out)

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """`t` itself unless its storage is out; then a host tensor over its bytes in the buffer, with its dtype,
        shape, strides and offset (reads see the moved values, writes reach what ``reload`` brings back)."""
        where = self.place.get(id(t.untyped_storage()))
        if where is None:
            return t
        offset, n = where
        flat = self.buffer[offset : offset + n].view(t.dtype)  # as_strided's offset counts from the buffer's start
        return flat.as_strided(t.shape, t.stride(), flat.storage_offset() + t.storage_offset())

    def _room(self, nbytes: int, size: int, cuda: bool) -> torch.Tensor:
        """The buffer, made (`size` bytes) where there is none or it holds less than `nbytes`."""
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # the old one goes before the new one is made
            self.buffer = host_buffer(size, cuda)
            self.allocations += 1
        return self.buffer

    @torch.no_grad()
    def offload(self, tensors: list[torch.Tensor], reserve: int = 0, transient: list[torch.Tensor] = ()) -> int:
        """Moves the storages of `tensors` (each once) into the buffer and frees them; returns the bytes moved.
        A new buffer holds at least `reserve` bytes (what a later offload may move: gradients absent now).
        `transient` (among `tensors`): freed soon after the reload (gradients). If anything fails, every storage
        keeps (or gets back) its memory and bytes, and nothing is out."""
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes():
                storages.setdefault(id(s), s)
        if not storages:
            return 0
        device = next(iter(storages.values())).device
        cuda = device.type == "cuda"
        room = sum(_aligned(s.nbytes()) for s in storages.values())
        buffer = self._room(room, max(room, reserve), cuda)
        stream = torch.cuda.Stream(device) if cuda else None
        if stream is not None:  # every stream's work on these tensors is done (a step's gradient downloads too)
            torch.cuda.synchronize(device)
        offset, out, place = 0, [], {}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for key, s in storages.items():
                n = s.nbytes()
                buffer[offset : offset + n].copy_(_bytes(s), non_blocking=cuda)
                out.append((s, offset, n))
                place[key] = (offset, n)
                offset += _aligned(n)
        if stream is not None:
            stream.synchronize()  # the bytes are on the host before the device memory is handed back
        freed = []
        try:
            for s, offset, n in out:
                s.resize_(0)  # refused for a storage that cannot resize (shared memory, DLPack)
                freed.append((s, offset, n))
        except BaseException:
            self.out = freed
            self.reload()  # what was freed gets its memory and bytes back
            raise
        self.out, self.place = out, place
        self.transient = {id(t.untyped_storage()) for t in transient}
        if cuda:
            torch.cuda.empty_cache()
        return sum(n for _, _, n in out)

    @torch.no_grad()
    def reload(self) -> int:
        """Gives every storage moved out its size and bytes back; returns the bytes moved."""
        if not self.out:
            return 0
        device = self.out[0][0].device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for s, _, n in self.out:
            if id(s) in self.transient:  # gradients, freed soon: from the current stream's pool, for its reuse
                s.resize_(n)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for s, _, n in self.out:
                if id(s) not in self.transient:  # the state: in segments of its own, all handed back at an offload
                    s.resize_(n)
                    if stream is not None:  # used on the current stream: a free waits for its work there
                        _bytes(s).record_stream(torch.cuda.current_stream(device))
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for s, offset, n in self.out:
                _bytes(s).copy_(self.buffer[offset : offset + n], non_blocking=stream is not None)
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)  # the compute stream sees the bytes first
            stream.synchronize()  # and the buffer may be written again by the next offload
        total = sum(n for _, _, n in self.out)
        self.out, self.place, self.transient = [], {}, set()
        return total

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """The storages of `tensors` are not brought back (``zero_grad(set_to_none=True)`` dropped the gradients
        they held): their bytes stay in the buffer unused."""
        gone = {id(t.untyped_storage()) for t in tensors}
        self.out = [(s, offset, n) for s, offset, n in self.out if id(s) not in gone]
        self.place = {k: v for k, v in self.place.items() if k not in gone}


def where_now(optimizer: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a tensor of `optimizer`'s model is read where it is now: TwinFlowAdam's :meth:`StateOffload.host_view`
    (the host buffer, for what ``offload_states()`` moved); any other optimizer's tensors as they are."""
    offload = getattr(optimizer, "offload", None)
    return offload.host_view if isinstance(offload, StateOffload) else lambda t: t


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
    if not split.built:
        log.info("offload_states(): no state yet (ratio='auto' builds it at the first step); nothing moved")
        return 0
    if split.step_open and weights:  # the CPU share may be stepping, and writing its weights, right now
        raise RuntimeError("offload_states(weights=True) between backward and step(): the CPU share may be "
                           "writing the weights; call step() first (the state and gradients may move now)")  # fmt: skip
    if not split.step_open:  # synchronize() settled the state
        split.absorb_edits()  # in-place writes to opt.state's copies reach the state before it moves
    kept: list[torch.Tensor] = []  # what is always there: the state, and the weights if asked
    if "optimizer" in kinds:
        kept += split.device_state.tensors()
    if weights:
        kept += list(split.locals)
    held = [(p, p.grad) for p in split.params if p.grad is not None] if "grads" in kinds else []
    grads = [distributed.local(g) for _, g in held]
    # the buffer is made for the largest offload: every trainable parameter's gradient present
    grad_bytes = sum(_aligned(p.numel() * p.element_size()) for p, q in zip(split.locals, split.params)
                     if q.requires_grad)  # fmt: skip
    unique = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in kept}
    reserve = sum(map(_aligned, unique.values())) + (grad_bytes if "grads" in kinds else 0)
    moved = opt.offload.offload(kept + grads, reserve, transient=grads)
    if moved:
        split.stand_in(split.device_state.mapped(opt.offload.host_view))
    if grads and opt.offload.offloaded:  # the gradients leave their parameters until they come back
        opt.offload.detached = held
        for p, _ in held:
            p.grad = None
    log.info("offload_states(): %.2f GiB moved to host memory", moved / 2**30)
    return moved


def reload(opt: Any) -> int:
    """TwinFlowAdam.reload_states: the bytes come back, and the device state takes its place again."""
    if not opt.offload.offloaded:
        return 0
    split = opt.coordinator.split
    if not split.step_open:
        split.absorb_edits()  # writes to copies opt.state handed out while offloaded: into the buffer first
    detached, opt.offload.detached = opt.offload.detached, []
    moved = opt.offload.reload()
    split.come_back()
    for p, grad in detached:
        if p.grad is None:
            p.grad = grad
        else:  # a backward meanwhile: it adds to the gradient that was out, as it would have without the offload
            p.grad.add_(grad)
    return moved


def before_zero_grad(opt: Any, set_to_none: bool) -> None:
    """TwinFlowAdam.zero_grad while offloaded: gradients set to None are not brought back; zeroing them in place
    would write memory they do not have, and is refused."""
    if not opt.offload.offloaded or not opt.offload.detached:
        return
    if not set_to_none:
        raise RuntimeError("zero_grad(set_to_none=False) while the gradients are offloaded (offload_states()): "
                           "they have no device memory to zero; call zero_grad() to drop them, or reload_states() "
                           "first")  # fmt: skip
    opt.offload.forget([distributed.local(g) for _, g in opt.offload.detached])
    opt.offload.detached = []
