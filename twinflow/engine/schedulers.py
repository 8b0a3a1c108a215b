"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as torch LR schedulers.

Same parameter names, defaults and values step for step as DeepSpeed's: its
scheduler counts a ``last_batch_iteration`` t that starts at -1 and reaches
k - 1 after k calls of ``step()``, and sets the learning rate f(t) each time.
Here torch's ``last_epoch`` is k, so every schedule evaluates f(k - 1).
Being ``torch.optim.lr_scheduler.LRScheduler`` subclasses, they carry
torch's ``state_dict``, ``get_last_lr`` and work with any optimizer.
"""

from __future__ import annotations

import math

import torch

from twinflow.engine import config as cfg


def _warmup(t: int, steps: int, warmup_type: str) -> float:
    """DeepSpeed's warm-up fraction at iteration t < steps: log(t + 1) / log(steps), or t / steps."""
    if warmup_type == "log":
        return math.log(t + 1) / math.log(steps)
    return t / steps


class WarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then warmup_max_lr."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.warmup_min_lr, self.warmup_max_lr = warmup_min_lr, warmup_max_lr
        self.warmup_num_steps = max(2, warmup_num_steps)  # as DeepSpeed: log(1) would divide by zero
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _gamma(self, t: int) -> float:
        return _warmup(t, self.warmup_num_steps, self.warmup_type) if t < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        t = self.last_epoch - 1
        if t < 0:
            return [self.warmup_min_lr for _ in self.optimizer.param_groups]
        lr = self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self._gamma(t)
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, **kwargs) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, **kwargs)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return super()._gamma(t)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """A ratio of each group's lr: warmup_min_ratio to 1 over warmup_num_steps, then cosine to cos_min_ratio."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def ratio(self, t: int) -> float:
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            rise = _warmup(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * rise
        done = t - self.warmup_num_steps + 1
        span = self.total_num_steps - self.warmup_num_steps
        cosine = (1 + math.cos(math.pi * done / span)) / 2 if span > 0 else 0.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        return [base * self.ratio(self.last_epoch - 1) for base in self.base_lrs]


def build_scheduler(
    scheduler: cfg.WarmupLR | cfg.WarmupDecayLR | cfg.WarmupCosineLR, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler a validated config's ``scheduler`` section describes, bound to `optimizer`."""
    params = {k: v for k, v in scheduler.params.model_dump().items() if k in type(scheduler.params).model_fields}
    classes = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
    return classes[scheduler.type](optimizer, **params)
