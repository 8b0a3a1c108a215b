"""Speculative CPU steps under clipping: step before the norm is known, undo and redo when it clips.

With ``max_grad_norm`` the CPU cannot know a step's gradient multiplier
before the global norm is in, at ``step()``. Speculation (``speculate=True``,
attached) steps each chunk as its gradient lands, with multiplier 1, writing
the weights into a second pinned buffer so that the gradient stays where it
landed (pipeline.py). At ``step()`` the multiplier is known: 1 (nothing
clipped) keeps every speculative update, bit for bit the exact one; anything
else undoes them from the kept gradient and redoes them with the multiplier.

The undo inverts the kernel's float32 arithmetic. The master comes back to
about one ulp; a moment comes back to about one ulp of its *new* value,
which is more than one ulp of the old where the gradient dwarfed it, so a
redone moment can differ from the exact step's by about 1/c (first moment)
and 1/c^2 (second) ulp for a multiplier c. Costs: the second buffer set, and
one undo and one kernel pass per clipped step. ``SpeculationPolicy`` stops
speculating while steps keep clipping.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def undo_adam_(
    master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, step: int,
    group: dict,
) -> None:  # fmt: skip
    """Puts back, in place, the state from before the kernel's step number `step` with `grad` (multiplier 1).

    Mirrors csrc/adam_kernel.h: Adam (L2) adds wd * p to g; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    AdamW p *= 1 - lr wd; p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps).
    """
    lr, beta1, beta2, eps, wd = group["lr"], group["beta1"], group["beta2"], group["eps"], group["weight_decay"]
    bc1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
    bc2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 (the kernel's constants are float32)
    denom = exp_avg_sq.sqrt().mul_(f32(1.0 / bc2**0.5)).add_(f32(eps))
    master.addcdiv_(exp_avg, denom, value=float(f32(lr / bc1)))
    if group["adamw_mode"]:
        master.div_(f32(1.0 - lr * wd))
    g = grad.float()
    if not group["adamw_mode"] and wd != 0.0:
        g = g + f32(wd) * master
    # A zero beta leaves nothing of the old moment; the redo multiplies it by zero, so any finite value does.
    if beta1 == 0.0:
        exp_avg.zero_()
    else:
        exp_avg.sub_(g, alpha=float(f32(1.0 - beta1))).div_(f32(beta1))
    if beta2 == 0.0:
        exp_avg_sq.zero_()
    else:
        exp_avg_sq.sub_(g * g, alpha=float(f32(1.0 - beta2))).div_(f32(beta2)).clamp_(min=0.0)


class SpeculationPolicy:
    """Speculate unless the last `off_after` steps all clipped; back on after one that did not."""

    def __init__(self, off_after: int = 2) -> None:
        self.off_after = off_after
        self.clipped_in_a_row = 0
        self.skipped = 0  # steps not speculated because of clipping

    def note(self, last_scale: float | None) -> None:
        """The multiplier of the CPU share's last step (None: no step since the last note, e.g. one abandoned
        by zero_grad before step())."""
        if last_scale is not None:
            self.clipped_in_a_row = self.clipped_in_a_row + 1 if last_scale != 1.0 else 0

    def speculate(self) -> bool:
        go = self.clipped_in_a_row < self.off_after
        self.skipped += not go
        return go


def speculating(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt`'s coming step speculates: asked for, attached, clipping, not eager, delayed or fp16."""
    a, split = opt._attachment, opt._split
    if not opt.speculate or a is None or a.eager or a.fp16 or opt.max_grad_norm is None:
        return False
    if split.delaying(opt.delay_after):
        return False
    if any(g["adamw_mode"] and g["lr"] * g["weight_decay"] == 1.0 for g in opt.param_groups):
        return False  # the decay zeroes the master: nothing to undo from
    split.pipeline.finish()  # the last step's multiplier is known once its chunks are done
    opt._speculation.note(split.pipeline.last_scale)
    return opt._speculation.speculate()
