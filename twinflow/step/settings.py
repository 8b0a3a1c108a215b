"""The optimizer's settings: their one home.

The coordinator keeps the current :class:`Settings` (``TwinFlowAdam``'s setting properties replace it between
steps); everything that acts on a setting (the speculation policy, the CPU side's thread count, the split's
layout and precision) reads it from there when it acts, so a setting changed after the state exists takes full
effect at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """The optimizer's settings that shape a step, checked by its constructor."""

    placement: str
    chunk_bytes: int
    num_threads: int | None
    max_grad_norm: float | None
    delay_after: int | None
    state_precision: str
    speculate: bool
    weights_first: bool = False
