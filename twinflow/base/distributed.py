"""What twinflow needs from torch.distributed: local shards, reductions over a mesh, the rank.

Under FSDP2 parameters and gradients are DTensors; the optimizer steps the
shard this process holds, and a global quantity (the gradient norm, an fp16
overflow) is reduced over the parameters' device mesh. Without
torch.distributed every helper here is the identity.
"""

from __future__ import annotations

import torch

try:  # FSDP2 parameters and gradients are DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without torch.distributed
    DTensor = None


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor (FSDP2's parameters, gradients and what a checkpoint holds of them)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard (FSDP2), else the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def mesh_group(params: list[torch.Tensor]) -> object | None:
    """The process group of the first DTensor's device mesh (FSDP2's shard group), else None."""
    return next((p.device_mesh.get_group() for p in params if is_dtensor(p)), None)


def all_ranks_norm(norm: torch.Tensor, norm_type: float, group: object) -> torch.Tensor:
    """The norm over every rank's shards, from this rank's norm of its own."""
    import torch.distributed as dist

    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.pow(norm_type)
    dist.all_reduce(powered, group=group)
    return powered.pow(1.0 / norm_type)


def any_rank(flag: torch.Tensor, group: object) -> torch.Tensor:
    """`flag` (a 0-dim float tensor, 0 or 1) set where any rank of `group` set it."""
    import torch.distributed as dist

    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


def is_fully_sharded(module: torch.nn.Module) -> bool:
    """Whether `module` is an FSDP2 (``fully_shard``) module."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without torch.distributed, or before FSDP2
        return False
    return isinstance(module, FSDPModule)


def multi_process() -> bool:
    """Whether torch.distributed runs with more than one process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def largest_over_ranks(value: float, device: torch.device) -> float:
    """The largest `value` any rank of the default group gave (every rank calls it; a tensor on `device`, which
    the group's backend can reduce: the rank's GPU under NCCL)."""
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def wait_for_ranks(device: torch.device) -> None:
    """Returns once every rank of the default group has called it (a reduction of one element on `device`)."""
    import torch.distributed as dist

    t = torch.zeros(1, device=device)
    dist.all_reduce(t)
    t.item()  # the host waits for the reduction, not only the device
