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

import torch


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
