"""Progress of long work measured in bytes, on stderr: a tqdm bar where tqdm is installed and stderr is a
terminal, else a line at every tenth of the total, which logs and pipes keep readable."""

from __future__ import annotations

import sys
import time
from typing import IO, Any


def terminal_bar(stream: IO[str], bar: bool | None, **tqdm_args: Any) -> Any:
    """A tqdm bar on `stream` where `bar` says so (None: where `stream` is a terminal) and tqdm is installed, else
    None (the caller prints lines instead)."""
    if not (stream.isatty() if bar is None else bar):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the examples and test extras, not with twinflow
        return None
    return tqdm(file=stream, leave=False, **tqdm_args)


class ByteProgress:
    """``update(n)`` as bytes are done; ``close()`` at the end (a line with the total and the rate)."""

    def __init__(self, total: int, what: str, bar: bool | None = None, stream: IO[str] | None = None) -> None:
        self.total, self.what, self.done, self.stream = max(int(total), 0), what, 0, stream or sys.stderr
        self.start, self.next_line = time.perf_counter(), 0.1
        self.bar = terminal_bar(self.stream, bar, total=self.total, desc=what, unit="B", unit_scale=True)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        while self.total and self.done >= self.next_line * self.total and self.next_line < 1.0:
            print(f"{self.what}: {self.next_line:.0%} ({_gb(self.done)} of {_gb(self.total)})", file=self.stream,
                  flush=True)  # fmt: skip
            self.next_line = round(self.next_line + 0.1, 1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        seconds = time.perf_counter() - self.start
        rate = f", {self.done / seconds / 1e9:.2f} GB/s" if seconds > 0 else ""
        print(f"{self.what}: {_gb(self.done)} in {seconds:.1f} s{rate}", file=self.stream, flush=True)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


SHOWN_FROM = 1 << 30  # bytes: a checkpoint's work shows its progress from this size on (smaller ends in seconds)


class NoProgress:
    """Stands in for a :class:`ByteProgress` where none is shown."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def shown(total: int, what: str, first_rank: bool) -> ByteProgress | NoProgress:
    """A :class:`ByteProgress` of `total` bytes on the first rank where the work is at least ``SHOWN_FROM``
    bytes; else one that shows nothing."""
    return ByteProgress(total, what) if first_rank and total >= SHOWN_FROM else NoProgress()
