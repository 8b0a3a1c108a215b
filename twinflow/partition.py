"""Which elements step where (pure functions, deterministic, in parameter order)."""

from __future__ import annotations

import math
from dataclasses import dataclass

PLACEMENTS = ("first", "last")


@dataclass(frozen=True)
class Segment:
    """Elements [start, end) of the flattened parameter `index` (in optimizer order), on one side."""

    index: int
    start: int
    end: int
    on_cpu: bool

    @property
    def numel(self) -> int:
        return self.end - self.start


def check_ratio(ratio: object) -> float:
    """Returns ratio as a float, or raises naming the value and what is expected."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float):
        raise TypeError(f"ratio={ratio!r} ({type(ratio).__name__}); expected a number in [0, 1]")
    value = float(ratio)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"ratio={ratio!r}; expected a number in [0, 1] (0: all on the GPU, 1: all on the CPU)")
    return value


def check_placement(placement: object) -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}; expected one of {PLACEMENTS}")
    return placement  # type: ignore[return-value]


def split(numels: list[int], ratio: float, placement: str = "first") -> list[Segment]:
    """Splits the concatenated elements so that round(ratio * total) of them step on the CPU.

    "first" gives the CPU the leading elements in parameter order, "last" the
    trailing ones; the tensor at the boundary is cut into two segments, so the
    split is exact to the element. Returns the segments in parameter order.
    """
    ratio = check_ratio(ratio)
    check_placement(placement)
    total = sum(numels)
    cpu_total = round(ratio * total)
    # With "first", the CPU owns global elements [0, cpu_total); with "last", [total - cpu_total, total).
    lo, hi = (0, cpu_total) if placement == "first" else (total - cpu_total, total)
    segments: list[Segment] = []
    offset = 0
    for index, n in enumerate(numels):
        cuts = sorted({0, n, min(max(lo - offset, 0), n), min(max(hi - offset, 0), n)})
        for a, b in zip(cuts, cuts[1:]):
            segments.append(Segment(index, a, b, on_cpu=lo <= offset + a and offset + b <= hi))
        offset += n
    return segments
