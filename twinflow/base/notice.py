"""One-line notices a user should see without configuring logging: a kernel build, a checkpoint written,
``steps_per_print``, a decision twinflow took on the user's behalf.

They go through the ``twinflow.notice`` logger at INFO. Where the application configured logging (the root
logger has a handler), they reach its handlers like any record; where it did not, one fallback handler
writes them to stderr, prefixed ``[twinflow]``, as DeepSpeed's own logger does. Silence them with
``logging.getLogger("twinflow.notice").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import sys

NOTICE_LOGGER = "twinflow.notice"


class _FallbackHandler(logging.StreamHandler):
    """Writes to stderr only while the application has configured no handler of its own (no double lines)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # sys.stderr at each write: pytest and notebooks swap it
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _logger() -> logging.Logger:
    log = logging.getLogger(NOTICE_LOGGER)
    if not any(isinstance(h, _FallbackHandler) for h in log.handlers):
        handler = _FallbackHandler()
        handler.setFormatter(logging.Formatter("[twinflow] %(message)s"))
        log.addHandler(handler)
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
    return log


def notice(message: str, *args: object) -> None:
    """Logs one line at INFO on ``twinflow.notice`` (printed to stderr when logging is not configured)."""
    _logger().info(message, *args)


def notice_on_first_rank(message: str, *args: object) -> None:
    """:func:`notice`, on rank 0 of a torch.distributed job only (every process where there is none): for a line
    that every rank would write alike, as DeepSpeed logs on rank 0."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        notice(message, *args)
