"""Speculative CPU steps under clipping: step before the norm is known, step again when it clips.

With ``max_grad_norm`` the CPU cannot know a step's gradient multiplier
before the global norm is in, at ``step()``. Speculation (``speculate=True``,
attached) steps each chunk as its gradient lands, with multiplier 1, writing
the weights into a second pinned buffer (the gradient stays where it
landed) and the master and moments out of place, into a second state set
(the state the step started from stays untouched; pipeline.py). At
``step()`` the multiplier is known: 1 (nothing clipped) keeps every
speculative update; anything else steps the chunks again from the untouched
state with the multiplier. Either way the result is bit for bit the exact
step's.

Costs: the second buffer set (pinned, 2 bytes per CPU-stepped element in a
16-bit model), the second state set (12 bytes per element of host memory;
the kernel moves the same bytes in and out of place), a copy back whenever
the state is read (``opt.state``, ``state_dict()``, ``synchronize()``) while
the current state is in the second set, and one more kernel pass per
clipped step. ``SpeculationPolicy`` stops speculating while steps keep
clipping.
"""

from __future__ import annotations

import warnings

import torch


class SpeculationPolicy:
    """Speculate unless the last `off_after` steps all clipped; back on after one that did not."""

    def __init__(self, off_after: int = 2) -> None:
        self.off_after = off_after
        self.clipped_in_a_row = 0
        self.skipped = 0  # steps not speculated because of clipping
        self.warned = False  # speculate=True that can do nothing was reported (once per optimizer)

    def note(self, last_scale: float | None) -> None:
        """The multiplier of the CPU share's last step (None: no step since the last note, e.g. one abandoned
        by zero_grad before step())."""
        if last_scale is not None:
            self.clipped_in_a_row = self.clipped_in_a_row + 1 if last_scale != 1.0 else 0

    def speculate(self) -> bool:
        go = self.clipped_in_a_row < self.off_after
        self.skipped += not go
        return go


def _eligible(opt: torch.optim.Optimizer) -> bool:
    """Asked for, attached, clipping, not eager, not fp16, fp32 moments (8-bit ones step in place: nothing to
    roll back from)."""
    a = opt._attachment
    return (opt.speculate and a is not None and not a.eager and not a.fp16 and opt.max_grad_norm is not None
            and opt.state_precision == "fp32")  # fmt: skip


def planned(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` will speculate on steps that do not clip (what ratio='auto' plans for)."""
    return _eligible(opt) and opt.delay_after is None


def speculating(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt`'s coming step speculates: eligible, not delayed, and not while steps keep clipping."""
    split = opt._split
    if not _eligible(opt) or split.delaying(opt.delay_after):
        return False
    split.pipeline.finish()  # the last step's multiplier is known once its chunks are done
    opt._speculation.note(split.pipeline.last_scale)
    return opt._speculation.speculate()


def idle_reasons(opt: torch.optim.Optimizer) -> list[str]:
    """Why ``speculate=True`` can do nothing (or little) for `opt` as set up now; empty: it can speculate."""
    a = opt._attachment
    reasons = []
    if a is None:
        reasons.append("the optimizer is not attached (speculation steps the CPU share during backward: call "
                       "attach(model))")  # fmt: skip
    if opt.max_grad_norm is None:
        reasons.append("max_grad_norm is not set (without clipping, attach() already steps the CPU share during "
                       "backward, exactly)")  # fmt: skip
    if a is not None and a.fp16:
        reasons.append("the model has fp16 parameters (each step waits for the overflow check)")
    if opt.state_precision != "fp32":
        reasons.append(f"state_precision={opt.state_precision!r} steps the state in place: nothing to roll back to")
    if opt.delay_after is not None:
        reasons.append(f"delay_after={opt.delay_after}: only the first {opt.delay_after} steps can speculate; the "
                       "delayed update hides the CPU share after them")  # fmt: skip
    return reasons


def warn_if_idle(opt: torch.optim.Optimizer, final: bool) -> None:
    """One warning where ``speculate=True`` was asked for and cannot act (`final`: at a step, when nothing about
    the set-up can change any more; before it, an attach() still to come is not a reason)."""
    if not opt.speculate or opt._speculation.warned:
        return
    reasons = idle_reasons(opt)
    if not final:
        reasons = [r for r in reasons if not r.startswith("the optimizer is not attached")]
    if reasons:
        opt._speculation.warned = True
        warnings.warn("speculate=True has no effect here: " + "; ".join(reasons), UserWarning, stacklevel=3)
