"""One worker thread that runs the CPU share's jobs, knowing nothing of what they do.

Jobs come from a queue. The worker runs the job of lowest ``rank()`` among
those queued (ranked when it picks: a chunk whose gradients have landed goes
before one still in flight), one at a time, outside the lock. A job's
exception is kept and raised in the main thread at its next wait
(:meth:`CpuExecutor.wait_until`). The strategies that submit jobs share the
executor's ``condition`` for their own bookkeeping.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from twinflow.base import node
from twinflow.host import ops

_LIVE: weakref.WeakSet = weakref.WeakSet()  # executors whose worker may be running


@atexit.register
def _stop_workers() -> None:
    """Ends every worker before the interpreter tears down (a worker killed inside its OpenMP pool aborts)."""
    for executor in list(_LIVE):
        executor.close()


@dataclass
class Job:
    """A unit of CPU work: its `kind` ("chunk", "verdict", "late"), the chunk it is for, and its body."""

    kind: str
    chunk: int
    run: Callable[[], None]
    rank: Callable[[], tuple]


class CpuExecutor:
    """The CPU share's worker thread and its queue. ``gate``, when set (tests), is asked before a job may run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.condition = threading.Condition()
        self.queue: list[Job] = []
        self.running: Job | None = None
        self.error: BaseException | None = None
        self.reported: BaseException | None = None  # recorded by `reporting`: the loop does not record it again
        self.gate: Callable[[Job], bool] | None = None
        self.stopped = False
        self.thread: threading.Thread | None = None

    def submit(self, job: Job) -> None:
        """Queues `job` (caller holds the condition) and starts the worker if it is not running."""
        self.queue.append(job)
        self.condition.notify_all()
        if self.thread is None:
            self.thread = threading.Thread(target=self.work, name="twinflow-cpu-adam", daemon=True)
            self.thread.start()
            _LIVE.add(self)

    def cancel(self, kind: str) -> None:
        """Drops the queued jobs of `kind` (caller holds the condition); a running one finishes."""
        self.queue = [job for job in self.queue if job.kind != kind]

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Waits (caller holds the condition) until `done()`, or raises the worker's error."""
        while not done() and self.error is None:
            if self.stopped and self.running is None:
                raise RuntimeError(
                    "TwinFlowAdam's CPU worker was stopped (close(), or the interpreter exiting) with work still "
                    "queued; what it left undone cannot be waited for"
                )
            self.condition.wait()
        self.raise_error()

    @contextmanager
    def reporting(self) -> Iterator[None]:
        """On the worker: an exception of the block becomes the worker's error at once, before the job's own
        cleanup signals a waiter (who then sees it), not only once the job has returned."""
        try:
            yield
        except BaseException as exc:
            with self.condition:
                self.error = self.error or exc
                self.reported = exc
                self.condition.notify_all()
            raise

    def raise_error(self) -> None:
        """Raises, once, the exception a job ended with (caller holds the condition)."""
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, ops.BuildError):  # its message names the missing tool and the fix
                raise error
            raise RuntimeError("TwinFlowAdam's CPU worker failed") from error

    def close(self) -> None:
        """Stops the worker after the job it is running (queued ones are dropped), and waits for it."""
        with self.condition:
            self.stopped = True
            self.condition.notify_all()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def runnable(self) -> list[Job]:
        return [job for job in self.queue if self.gate is None or self.gate(job)]

    def work(self) -> None:
        """The worker thread's loop. Where twinflow chose the kernel's cores and is to pin (ops.automatic_share),
        this thread is pinned to them first: the kernel's OpenMP threads, which it starts, inherit its mask."""
        node.settle_torch_threads()  # before any other torch call: the count outside any window of another thread
        share = ops.automatic_share()
        if share is not None and share.pin:
            node.pin_this_thread(share.cpus)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self.condition:
                while not self.stopped and not self.runnable():
                    self.condition.wait()
                if self.stopped:
                    return
                job = min(self.runnable(), key=lambda j: j.rank())
                self.queue.remove(job)
                self.running = job
            error = None
            try:
                job.run()
            except BaseException as exc:  # surfaced in the main thread at its next wait
                error = exc
            with self.condition:
                if error is not None and error is not self.reported:
                    self.error = error or self.error
                self.running = None
                self.condition.notify_all()
