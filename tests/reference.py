"""A float64 reference Adam/AdamW, written from the algorithm's definition."""

import torch


def adam_reference(
    param: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
) -> torch.Tensor:
    """Runs len(grads) steps in float64 and returns the final parameter."""
    p = param.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    beta1, beta2 = betas
    for step, g in enumerate(grads, start=1):
        g = g.double()
        if adamw_mode:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        p = p - (lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps)
    return p
