"""The optimizer state's precision, resolved once from its name: what each side keeps, and what it costs.

A name ("fp32", "int8" or "int8_m24", TwinFlowAdam's ``state_precision``) becomes a :class:`StatePrecision` where
the state is built (:func:`of`); the state's owners, the planner and the checkpoint code ask it what they need
(coded moments, 24-bit masters, bytes an element, whether a step can be redone) and never compare names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinflow.precision.compact import BLOCK


@dataclass(frozen=True)
class StatePrecision:
    """One precision of the optimizer's state on both sides."""

    name: str
    coded_moments: bool  # exp_avg and exp_avg_sq as 8-bit codes with a scale per block of BLOCK elements
    masters24: bool  # masters in 24 bits (bfloat16 and one more byte of mantissa)

    def __str__(self) -> str:
        return self.name

    @property
    def exact(self) -> bool:
        """Whether a step over this state is AdamW's to the bit (fp32): coded state is rounded stochastically, in
        place, so a step cannot be redone from the state it started from either (no speculation)."""
        return not self.coded_moments

    @property
    def align(self) -> int:
        """Elements a cut between the sides (and a chunk's start) falls on a multiple of: a block of codes."""
        return BLOCK if self.coded_moments else 1

    @property
    def host_bytes(self) -> float:
        """Host state per CPU-stepped element (float32 masters unless 24-bit; per-block scales included)."""
        if not self.coded_moments:
            return 12.0
        return 2 + 2 / BLOCK + (3 if self.masters24 else 4)

    def weight_is_master(self, dtype: torch.dtype) -> bool:
        """Whether a `dtype` parameter's weight is the top of its 24-bit master on the device (plus a residual
        byte; :mod:`twinflow.precision.weight_master`)."""
        return self.masters24 and dtype == torch.bfloat16

    def device_bytes(self, dtype: torch.dtype) -> float:
        """Device state per device-stepped element of a `dtype` parameter (a float32 parameter is its own master)."""
        moments = 2 + 2 / BLOCK if self.coded_moments else 8.0
        if dtype == torch.float32:
            return moments
        return moments + (1 if self.weight_is_master(dtype) else 4)


FP32 = StatePrecision("fp32", coded_moments=False, masters24=False)
INT8 = StatePrecision("int8", coded_moments=True, masters24=False)
INT8_M24 = StatePrecision("int8_m24", coded_moments=True, masters24=True)
ALL = (FP32, INT8, INT8_M24)


def of(precision: object) -> StatePrecision:
    """The precision named `precision` (or `precision` itself); a ValueError naming what is expected otherwise."""
    if isinstance(precision, StatePrecision):
        return precision
    for known in ALL:
        if precision == known.name:
            return known
    raise ValueError(
        f"state_precision={precision!r}; expected 'fp32' (the default: exact), 'int8' (the CPU share's "
        "moments in 8 bits with a scale per 256 elements, float32 masters: 6 bytes of host state a parameter "
        "instead of 12, not exact) or 'int8_m24' (those moments and 24-bit masters: 5 bytes)"
    )


def check_name(precision: object) -> str:
    """`precision` as a setting keeps it: its name, checked."""
    return of(precision).name
