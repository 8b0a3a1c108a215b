"""twinflow.base.progress: long work's bytes on stderr, a line a tenth where no bar can be drawn."""

from __future__ import annotations

import io

from twinflow.base.progress import ByteProgress


def test_without_a_terminal_a_line_comes_at_every_tenth_and_one_at_the_end() -> None:
    out = io.StringIO()  # not a terminal: no bar
    meter = ByteProgress(10_000_000_000, "writing hub", stream=out)
    for _ in range(40):
        meter.update(250_000_000)  # 2.5% at a time
    meter.close()
    lines = out.getvalue().splitlines()
    assert [line.split(": ")[1].split(" ")[0] for line in lines[:-1]] == [f"{k}0%" for k in range(1, 10)]
    assert lines[3] == "writing hub: 40% (4.00 GB of 10.00 GB)"
    assert lines[-1].startswith("writing hub: 10.00 GB in ") and "GB/s" in lines[-1]


def test_one_large_update_passes_several_tenths_at_once() -> None:
    out = io.StringIO()
    meter = ByteProgress(1000, "x", stream=out)
    meter.update(350)
    assert out.getvalue().count("\n") == 3  # 10%, 20%, 30%
    meter.update(0)
    assert out.getvalue().count("\n") == 3


def test_nothing_to_write_prints_only_the_total() -> None:
    out = io.StringIO()
    meter = ByteProgress(0, "empty", stream=out)
    meter.update(0)
    meter.close()
    assert out.getvalue().startswith("empty: 0.00 GB in ") and out.getvalue().count("\n") == 1
