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


def split(numels: list[int], ratio: float, placement: str = "first", align: int = 1) -> list[Segment]:
    """Splits the concatenated elements so that about round(ratio * total) of them step on the CPU.

    "first" gives the CPU the leading elements in parameter order, "last" the
    trailing ones; the tensor at the boundary is cut into two segments, so the
    split is exact to the element, or (`align` > 1) to the nearest multiple of
    `align` elements in that tensor (compact state's blocks: an element's block
    is then the same on either side). Returns the segments in parameter order.
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
        inner = [_cut(lo - offset, n, align), _cut(hi - offset, n, align)]
        lo_here, hi_here = inner  # the CPU's elements of this tensor: [lo_here, hi_here)
        cuts = sorted({0, n, *inner})
        for a, b in zip(cuts, cuts[1:]):
            segments.append(Segment(index, a, b, on_cpu=lo_here <= a and b <= hi_here))
        offset += n
    return segments


def _cut(at: int, n: int, align: int) -> int:
    """A boundary `at` elements into a tensor of `n`, within [0, n], at the nearest multiple of `align`."""
    at = min(max(at, 0), n)
    if align > 1 and 0 < at < n:
        at = min(n, (at + align // 2) // align * align)
    return at
