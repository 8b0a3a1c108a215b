"""Speculative CPU steps under clipping: step before the norm is known, step again when it clips.

With ``max_grad_norm`` the CPU cannot know a step's gradient multiplier
before the global norm is in, at ``step()``. Speculation (``speculate=True``,
attached) steps each chunk as its gradient lands, with multiplier 1, writing
the weights into a second pinned buffer (the gradient stays where it
landed) and the master and moments out of place, into a second state set
(the state the step started from stays untouched; host_modes.py). At
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
from collections.abc import Callable

from twinflow.precision.state_precision import StatePrecision
from twinflow.step.settings import Settings


class SpeculationPolicy:
    """Whether a step speculates: asked for, eligible under the attachment, and not while steps keep clipping
    (off once the last `off_after` steps all clipped; back on after one that did not). It keeps no setting: it
    reads `settings()` (the optimizer's, as they are now) and `precision()` (the state's, as built) when asked."""

    def __init__(self, settings: Callable[[], Settings], precision: Callable[[], StatePrecision],
                 off_after: int = 2) -> None:  # fmt: skip
        self.settings, self.state_precision = settings, precision
        self.off_after = off_after
        self.clipped_in_a_row = 0
        self.skipped = 0  # steps not speculated because of clipping
        self.warned = False  # speculate=True that can do nothing was reported (once per optimizer)
        self.attached = self.eager = self.fp16 = False

    @property
    def asked(self) -> bool:
        return self.settings().speculate

    @property
    def max_grad_norm(self) -> float | None:
        return self.settings().max_grad_norm

    @property
    def delay_after(self) -> int | None:
        return self.settings().delay_after

    @property
    def precision(self) -> StatePrecision:
        """The state's precision, as built (a ``state_precision`` set since applies at the next step's rebuild)."""
        return self.state_precision()

    def attach(self, attached: bool, eager: bool = False, fp16: bool = False) -> None:
        """The attachment the coming steps run under (resolved once per attach() and detach())."""
        self.attached, self.eager, self.fp16 = attached, eager, fp16

    @property
    def eligible(self) -> bool:
        """Asked for, attached, clipping, not eager, not fp16, fp32 moments (8-bit ones step in place: nothing
        to roll back from)."""
        return (self.asked and self.attached and not self.eager and not self.fp16 and self.max_grad_norm is not None
                and self.precision.exact)  # fmt: skip

    @property
    def planned(self) -> bool:
        """Whether steps that do not clip will speculate (what ratio='auto' plans for)."""
        return self.eligible and self.delay_after is None

    def note(self, last_scale: float | None) -> None:
        """The multiplier of the CPU share's last step (None: no step since the last note, e.g. one abandoned
        by zero_grad before step())."""
        if last_scale is not None:
            self.clipped_in_a_row = self.clipped_in_a_row + 1 if last_scale != 1.0 else 0

    def speculate(self, delaying: bool, last_scale: Callable[[], float | None]) -> bool:
        """Whether the coming step speculates: eligible, not delayed, and not while steps keep clipping
        (`last_scale()`: the last step's multiplier, once its chunks are done)."""
        if not self.eligible or delaying:
            return False
        self.note(last_scale())
        go = self.clipped_in_a_row < self.off_after
        self.skipped += not go
        return go

    def idle_reasons(self) -> list[str]:
        """Why ``speculate=True`` can do nothing (or little) as set up now; empty: it can speculate."""
        reasons = []
        if not self.attached:
            reasons.append("the optimizer is not attached (speculation steps the CPU share during backward: call "
                           "attach(model))")  # fmt: skip
        if self.max_grad_norm is None:
            reasons.append("max_grad_norm is not set (without clipping, attach() already steps the CPU share "
                           "during backward, exactly)")  # fmt: skip
        if self.attached and self.fp16:
            reasons.append("the model has fp16 parameters (each step waits for the overflow check)")
        if not self.precision.exact:
            reasons.append(f"state_precision={self.precision.name!r} steps the state in place: nothing to roll back to")
        if self.delay_after is not None:
            reasons.append(f"delay_after={self.delay_after}: only the first {self.delay_after} steps can speculate; "
                           "the delayed update hides the CPU share after them")  # fmt: skip
        return reasons

    def warn_if_idle(self, final: bool) -> None:
        """One warning where ``speculate=True`` was asked for and cannot act (`final`: at a step, when nothing
        about the set-up can change any more; before it, an attach() still to come is not a reason)."""
        if not self.asked or self.warned:
            return
        reasons = self.idle_reasons()
        if not final:
            reasons = [r for r in reasons if not r.startswith("the optimizer is not attached")]
        if reasons:
            self.warned = True
            warnings.warn("speculate=True has no effect here: " + "; ".join(reasons), UserWarning, stacklevel=3)
