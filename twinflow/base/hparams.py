"""The hyper-parameters and flags of twinflow's Adam optimizers, checked by torch.optim's rules and named where
they fail (the optimizers' constructors, and each step's param groups)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def check_hyperparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raises ValueError naming the first invalid hyper-parameter (torch.optim's rules)."""
    lr_value = float(lr)
    if not (math.isfinite(lr_value) and lr_value >= 0.0):
        raise ValueError(f"Invalid learning rate: lr={lr!r}; expected a finite number >= 0")
    if not (math.isfinite(float(eps)) and eps >= 0.0):
        raise ValueError(f"Invalid epsilon value: eps={eps!r}; expected a finite number >= 0")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair (beta1, beta2)")
    for i, beta in enumerate(betas):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta!r}; expected a number in [0, 1)")
    if not (math.isfinite(float(weight_decay)) and weight_decay >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r}; expected a finite number >= 0")


# torch.optim.AdamW's flags, at the values twinflow runs (it picks its own kernels; the others are not implemented)
ADAMW_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None}  # fmt: skip


def check_adamw_flags(**flags: object) -> None:
    """torch.optim.AdamW's flags, accepted at their defaults (configs often spell them out), refused otherwise."""
    for name, value in flags.items():
        if value:
            raise ValueError(
                f"{name}={value!r} is not supported by TwinFlowAdam: leave it unset (it picks its own kernels: "
                "twinflow's on the CPU, torch's fused Adam on the device; amsgrad, maximize, capturable and "
                "differentiable are not implemented)"
            )


def adam_defaults(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    num_threads: int | None,
) -> dict[str, Any]:
    """Checks the arguments twinflow's Adam optimizers share; returns their Optimizer ``defaults``."""
    check_hyperparams(lr, betas, eps, weight_decay)
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads={num_threads!r}; expected a positive int or None for torch's default")
    # AdamW's flag keys too, at the values twinflow runs with: code reads group["amsgrad"] and the like, and a
    # state dict saved, loaded and saved again must not gain keys torch adds on loading.
    return dict(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        adamw_mode=adamw_mode,
        bias_correction=bias_correction,
        **ADAMW_FLAGS,
        decoupled_weight_decay=adamw_mode,
    )


def check_group_flags(index: int, group: dict[str, Any]) -> None:
    """Raises, naming the param group and the key, where a group's AdamW flag asks for what twinflow lacks, or
    ``decoupled_weight_decay`` contradicts ``adamw_mode`` (the key twinflow steps by)."""
    for name, default in ADAMW_FLAGS.items():
        if group.get(name):
            raise ValueError(
                f"param group {index}: {name}={group[name]!r} is not supported by twinflow's Adam; set it to "
                f"{default!r} (twinflow picks its own kernels; amsgrad, maximize, capturable and "
                "differentiable are not implemented)"
            )
    decoupled = group.get("decoupled_weight_decay", group["adamw_mode"])
    if bool(decoupled) != bool(group["adamw_mode"]):
        raise ValueError(
            f"param group {index}: decoupled_weight_decay={decoupled!r} but adamw_mode={group['adamw_mode']!r}; "
            "they name the same choice (AdamW's decoupled weight decay): set both to the same value"
        )


def align_group_flags(groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
    """After loading groups from another optimizer (torch's Adam/AdamW lack ``adamw_mode``): every key of
    ``defaults`` is present, and ``decoupled_weight_decay`` follows ``adamw_mode``, which this optimizer keeps
    (as torch's AdamW keeps its own ``decoupled_weight_decay`` on loading)."""
    for group in groups:
        for key, value in defaults.items():
            group.setdefault(key, value)
        group["decoupled_weight_decay"] = group["adamw_mode"]
