"""What an asynchronous portable save writes from: the host copy of the state, kept for the next asynchronous save
(:class:`HostCopies`), DCP's staging step that takes that copy as it is (:class:`AlreadyStaged`), and the process
group the background write talks through (:func:`background_group`).

The save copies every tensor it writes (the model's weights, the optimizer's state as kept) to host memory while
training waits; the files are then written from that copy in the background. Into new host memory a copy from an
H200 ran at 1.1-1.3 GB/s (each page is touched for the first time by the copy), and at 12.5 GB/s into memory that
was copied to before; from host memory, 6-8 against 30 GB/s (``benchmarks/host_copy_probe.py``, BENCHMARKS.md).
So a new copy is zero-filled first, on torch's intra-op threads raised to the count :class:`HostCopies` is given
(portable's: the checkpoint's file-thread count, at most eight; a rank that torchrun gave one thread fills on
several), before anything is copied into it;
and each tensor's copy is kept, by its key, and the next asynchronous save copies into it again where the tensor
is the same (shape, dtype, mesh and placements), as DCP's own stager caches its copies. What is kept is this
rank's share of the checkpoint, in host memory, until it is released
(``engine.wait_checkpoint(release_memory=True)``) or a save of other tensors replaces it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from twinflow.base.distributed import is_dtensor, local
from twinflow.base.node import torch_threads


def _fits(kept: torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `kept` holds a copy of a tensor like `like` in `dtype`: the same shapes, mesh and placements."""
    if kept.dtype != dtype or kept.shape != like.shape or local(kept).shape != local(like).shape:
        return False
    if is_dtensor(like):  # the same mesh object: one made again (a new process group) gets new copies
        return is_dtensor(kept) and kept.device_mesh is like.device_mesh and kept.placements == like.placements
    return not is_dtensor(kept)


class HostCopies:
    """The host copies of one asynchronous save after another, by key (a process's saves go through one, and a
    save begins only once the one before it is written)."""

    def __init__(self, make: Callable[[torch.Tensor, torch.dtype], torch.Tensor], threads: int) -> None:
        self.make = make  # make(like, dtype): a new tensor of `like`'s logical shape, its elements in host memory
        self.threads = threads  # torch threads the copies are made and filled on
        self.kept: dict[str, torch.Tensor] = {}
        self.used: dict[str, torch.Tensor] = {}
        self.reused = 0  # bytes the last save copied into copies kept from the one before

    def begin(self, keys: set[str]) -> None:
        """A save of `keys` begins: the copies of other keys are freed first."""
        self.kept = {k: v for k, v in self.kept.items() if k in keys}
        self.used, self.reused = {}, 0

    def copy(
        self, key: str, like: torch.Tensor, dtype: torch.dtype, fill: Callable[[torch.Tensor], Any]
    ) -> torch.Tensor:
        """The host tensor kept for `key`, its local elements given flat to fill(): the logical tensor DCP writes, a
        DTensor over `like`'s mesh where `like` is one. Where none fits `like` and `dtype`, a new one, made, its
        pages touched (zero-filled: see the module), then filled."""
        kept = self.kept.pop(key, None)  # one that does not fit is freed before its replacement is made
        if kept is not None and _fits(kept, like, dtype):
            self.reused += local(kept).nbytes
        else:
            kept = self.make(like, dtype)
            local(kept).zero_()
        fill(local(kept).view(-1))
        self.used[key] = kept
        return kept

    def stage(self, tree: Any) -> Any:
        """`tree` (nested dicts) with each tensor copied into host memory (a DTensor: its piece, over the same mesh),
        and each value with a ``stage_into(copies, key)`` (a tensor read when it is saved) read into it, keyed by
        its path joined by dots: into the copies kept from the last save, where they fit. Training may then change
        the originals while the copy is written."""
        self.begin(set(_paths(tree)))
        try:
            with torch_threads(self.threads):  # the new copies' fills (and the copies within host memory) run parallel
                return _staged(self, tree, "")
        finally:
            self.end()

    def end(self) -> None:
        """The save has copied what it copies (or failed): its copies are the ones kept."""
        self.kept, self.used = {**self.kept, **self.used}, {}

    @property
    def nbytes(self) -> int:
        """The host memory the kept copies take."""
        return sum(local(t).nbytes for t in self.kept.values())

    def release(self) -> None:
        """Frees the kept copies (the next asynchronous save makes its own again)."""
        self.kept, self.used = {}, {}


class AlreadyStaged:
    """DCP's staging step for a state dict copied through :class:`HostCopies`: nothing more to copy (DCP's own
    stager copies every tensor again, and failed on FSDP2's DTensors here: "copy_() on an invalid python
    storage")."""

    _synchronize_after_execute = True
    should_synchronize_after_execute = True

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


_checkpoint_group: tuple[Any, Any] | None = None  # (the default group it was made under, the gloo group)


def background_group() -> Any:
    """A gloo process group of every rank for the background writes' collectives (made once per default group, by
    every rank: the training's own group stays free of them); None without torch.distributed. A default group
    destroyed and made again (an elastic restart, a test) gets a group of its own: the old one died with it."""
    global _checkpoint_group  # noqa: PLW0603 (one group a default group, made at its first asynchronous save)
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _checkpoint_group is None or _checkpoint_group[0] is not world:
        _checkpoint_group = (world, dist.new_group(backend="gloo"))
    return _checkpoint_group[1]


def _paths(tree: Any, at: str = "") -> Any:
    if not isinstance(tree, dict):
        yield at
        return
    for k, v in tree.items():
        yield from _paths(v, f"{at}.{k}" if at else k)


def _staged(copies: HostCopies, tree: Any, key: str) -> Any:
    if isinstance(tree, dict):
        return {k: _staged(copies, v, f"{key}.{k}" if key else k) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        held = local(tree).detach()
        return copies.copy(key, tree, tree.dtype, lambda out: out.view(held.shape).copy_(held))
    stage_into = getattr(tree, "stage_into", None)
    return stage_into(copies, key) if stage_into is not None else tree
