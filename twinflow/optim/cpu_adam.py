"""CPUAdam: a torch.optim.Optimizer over host tensors, stepped by the C++ kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from twinflow.base.hparams import ParamsT, adam_defaults, align_group_flags, check_group_flags, check_hyperparams
from twinflow.host import ops


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over float32 CPU parameters, using twinflow's SIMD kernel.

    Behaves like ``torch.optim.AdamW`` (``adamw_mode=True``, decoupled weight
    decay) or ``torch.optim.Adam`` (``adamw_mode=False``, L2 penalty added to
    the gradient), with the same state layout (``step``, ``exp_avg``,
    ``exp_avg_sq``), so state dicts move between them. ``bias_correction=False``
    drops Adam's bias correction, as DeepSpeed's CPU Adam allows. All
    parameters of a step are updated in one parallel region of
    ``num_threads`` threads (default: ``torch.get_num_threads()``).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,  # torch.optim.AdamW's default
        adamw_mode: bool = True,
        bias_correction: bool = True,
        *,
        num_threads: int | None = None,
    ) -> None:
        defaults = adam_defaults(lr, betas, eps, weight_decay, adamw_mode, bias_correction, num_threads)
        super().__init__(params, defaults)
        self.num_threads = num_threads
        if self.param_groups:
            ops.load()  # build the kernel now: a missing compiler is reported here, not at the first step

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "num_threads": self.num_threads}  # a copy steps too

    def __setstate__(self, state: dict[str, Any]) -> None:
        # State dicts from torch.optim.AdamW/Adam lack our group keys.
        state.setdefault("num_threads", getattr(self, "num_threads", None))
        super().__setstate__(state)
        align_group_flags(self.param_groups, self.defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step; returns the closure's loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            check_group_flags(index, group)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        check_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        params, grads, exp_avgs, exp_avg_sqs, steps, fresh = [], [], [], [], [], {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError("CPUAdam does not support sparse gradients; use torch.optim.SparseAdam")
            state = self.state[p] if p in self.state else None
            if state is None:
                # Built here, committed only after the kernel succeeded.
                state = fresh[p] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(int(state["step"].item()) + 1)
        beta1, beta2 = group["betas"]
        ops.adam_step_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            steps,
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw_mode=group["adamw_mode"],
            bias_correction=group["bias_correction"],
            num_threads=self.num_threads,
        )
        for p in params:
            if p in fresh:
                self.state[p] = fresh[p]
            self.state[p]["step"] += 1
