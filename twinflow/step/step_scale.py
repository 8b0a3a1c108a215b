"""One step's gradient multiplier: loss unscaling and clipping, applied on both sides; fp16 overflow.

Every gradient of a step is multiplied by one coefficient as it is consumed:
the device side multiplies its fp32 gradients, the CPU kernel multiplies as it
reads. The coefficient stays on the device (no host synchronisation); the CPU
worker reads it once the device has computed it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twinflow.base import distributed


def check_max_grad_norm(max_grad_norm: object) -> None:
    if max_grad_norm is not None and not (float(max_grad_norm) > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm!r}; expected a number > 0, or None for no clipping")


class StepScale:
    """The multiplier of the coming step and the norms it is computed from; reset after each step."""

    def __init__(self, device: torch.device, mesh_group: object | None) -> None:
        self.device = device
        self.mesh_group = mesh_group  # FSDP2: norms and overflow are reduced over the shards' ranks
        self.reset()

    def reset(self) -> None:
        # 2-norms of gradients streamed during backward (attach), by parameter: summed in the parameters' order,
        # not in the order they arrived (DDP's buckets may finish in either order), so the norm is reproducible
        self.hook_norms: dict[int, torch.Tensor] = {}
        self.coef: torch.Tensor | None = None  # the multiplier every gradient of this step gets
        self.inv_scale: float | None = None  # loss scaling: 1 / scale, set by unscale_()
        self.clipped = False

    def forget_norms(self) -> None:
        """A step's first gradient goes down: no norm noted before it belongs to this step."""
        self.hook_norms = {}

    def add_norm(self, i: int, grad: torch.Tensor) -> None:
        """Notes the 2-norm of parameter i's gradient, which leaves for the host before the step (fp32 whatever
        its dtype)."""
        self.hook_norms[i] = torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32)

    def norms(self, grads: list[torch.Tensor], norm_type: float, streamed: bool) -> list[torch.Tensor]:
        """Per-gradient norms: those noted while gradients streamed, and those of `grads`, still on the device."""
        if streamed and norm_type != 2.0:
            raise ValueError(
                f"norm_type={norm_type!r}: after attach(), gradients streamed in backward are measured by their "
                "2-norm; use norm_type=2.0"
            )
        # fp32 norms whatever the gradients' dtype: bf16 norms would round the clipping coefficient
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32) if grads else []
        return [self.hook_norms[i] for i in sorted(self.hook_norms)] + list(norms)

    def clip(self, max_norm: float, norm_type: float, grads: list[torch.Tensor], streamed: bool) -> torch.Tensor:
        """Sets the coefficient that clips the step's gradients to `max_norm`; returns their total norm."""
        norms = self.norms(grads, float(norm_type), streamed)
        if not norms:
            return torch.tensor(0.0, device=self.device)
        total = torch.linalg.vector_norm(torch.stack([n.to(self.device) for n in norms]), float(norm_type))
        if self.mesh_group is not None:  # FSDP2: each rank holds a shard of every gradient
            total = distributed.all_ranks_norm(total, float(norm_type), self.mesh_group)
        if self.inv_scale is not None:  # the norm of the true gradients, not of the loss-scaled ones
            total = total * self.inv_scale
        self.coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0) * (self.inv_scale or 1.0)
        self.clipped = True
        return total

    def unscale(self, inv_scale: float) -> None:
        if self.clipped:
            raise RuntimeError("unscale_ after clip_grad_norm_: unscale first, so that clipping sees true gradients")
        self.inv_scale = float(inv_scale)
        self.coef = torch.tensor(self.inv_scale, dtype=torch.float32, device=self.device)

    def overflow(self, grads: list[torch.Tensor], streamed: bool) -> bool:
        """Any inf/NaN among the step's gradients, on any rank (one host synchronisation)."""
        norms = self.norms(grads, 2.0, streamed)
        found = torch.logical_not(torch.isfinite(torch.stack([n.to(self.device) for n in norms]))).any().float()
        if self.mesh_group is not None:  # every rank skips together
            found = distributed.any_rank(found, self.mesh_group)
        return bool(found)

    def for_cpu(self) -> float | Callable[[], float]:
        """The coefficient as the CPU worker will read it (a callable blocks until the device has it)."""
        if self.coef is None:
            return 1.0
        if self.device.type != "cuda":
            return float(self.coef)
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(self.coef, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return lambda: (ready.synchronize(), float(host))[1]
