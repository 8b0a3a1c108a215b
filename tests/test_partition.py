"""The split: exact, deterministic, in parameter order."""

import pytest

from twinflow.base.partition import split


@pytest.mark.parametrize("placement", ["first", "last"])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.3, 0.5, 0.77, 1.0])
def test_split_is_exact_and_covers_everything(ratio: float, placement: str) -> None:
    numels = [7, 1000, 3, 250, 64, 1]
    segs = split(numels, ratio, placement)
    assert sum(s.numel for s in segs if s.on_cpu) == round(ratio * sum(numels))
    for i, n in enumerate(numels):  # each parameter covered once, in order, without gaps
        mine = [s for s in segs if s.index == i]
        assert mine[0].start == 0 and mine[-1].end == n
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
    flags = [s.on_cpu for s in segs]
    expected = sorted(flags, reverse=placement == "first")  # CPU part is one run at the front or the back
    assert flags == expected
    assert split(numels, ratio, placement) == segs


@pytest.mark.parametrize("bad, error", [(1.5, ValueError), (-0.1, ValueError), ("abc", TypeError), (True, TypeError)])
def test_bad_ratio(bad, error) -> None:
    with pytest.raises(error, match="ratio="):
        split([10], bad)


def test_bad_placement() -> None:
    with pytest.raises(ValueError, match="placement='middle'"):
        split([10], 0.5, "middle")
