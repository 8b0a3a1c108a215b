"""New weights first (``weights_first=True``): the CPU share's weights before its state.

In a step that waits for the norm (clipping, or attached with ``eager=False``), a chunk's peek runs the update's
arithmetic and writes only its rounded weights, into the second buffer set, and they go up at once. Its commit,
the same arithmetic writing the state (in place, bit for bit the single pass), runs behind every chunk of the
step, while the GPU runs the next forward and backward. Speculation's redo uses it too (:meth:`behind`).

Two buffer sets alternate. The commits read the gradients of their step, so the next step's gradients land in
the other set (the one the weights went up from): no download waits for a commit. What does wait for one:

- the chunk's next kernel (:meth:`commit_first`, on the worker: it runs the commit itself if the worker has not
  reached it), since it reads the state the commit writes;
- a step's open, for commits of steps before the last (their set is about to take gradients);
- every read of the state and every other mode's step (``HostSide.quiesce``, ``settle``, ``open``).

The peek moves fewer bytes than the single pass (16 against 28 a parameter in fp32), so the critical path after
the norm is shorter; but peek and commit together are about 1.6 times the single pass's work, and all of it must
fit in one iteration. So only the chunks the next forward needs first go weights first (:attr:`first_chunks`),
the rest take the single pass. The count adapts to what was measured (:meth:`choose`): after a step whose
commits did not keep up, it drops by the commits that chunks had to run themselves, and one more; after a step
whose commits left the worker idle for two commits' time before the next step's kernels, it grows by one. It
grows no faster: commits running beside the next forward and backward slow them too (they share the host's
memory with the gradients' copies), which the worker's idle time does not show. The first step goes weights
first in full.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from twinflow.host.executor import Job
from twinflow.host.host_modes import ExactMode, HostSide
from twinflow.host.staging import Piece
from twinflow.host.step_record import StepArgs


class WeightsFirstMode(ExactMode):
    """Exact, the first :attr:`first_chunks` chunks of each step new weights first, their state committed behind."""

    name = "weights_first"

    def __init__(self, host: HostSide) -> None:
        super().__init__(host)
        # under the executor's condition:
        self.pending: dict[int, int] = {}  # chunk -> the step whose commit of it has not ended
        self.todo: dict[int, Callable[[], None]] = {}  # chunk -> its commit, not started yet
        self.serial = 0  # the step being opened or run
        self.inline = 0  # commits a kernel had to run itself since the last choice
        self.commit_s: float | None = None  # a commit's seconds (running mean)
        self.last_end = 0.0  # when the last commit ended (host clock)
        self.slack: float | None = None  # the worker's idle seconds between a step's last commit and the next kernel
        self.seen = -1  # the step whose first kernel was seen
        self.committing = -1  # the last step that queued commits (its gradients' set stays with them)
        self.first_chunks = 1 << 30  # chunks (lowest index first: the next forward's order) that go weights first
        self.late_steps = 0  # steps in which commits did not keep up

    # ------------------------------------------------------------------ the policy
    def choose(self) -> bool:
        """Whether the coming step goes weights first at all, and for how many chunks (asked once per step it
        could): see the module's docstring. The measurements are a step old (a step's commits are judged at the
        next step's first kernel)."""
        chunks = self.host.chunk_count
        with self.host.executor.condition:
            inline, slack, cost = self.inline, self.slack, self.commit_s
            self.inline, self.slack = 0, None
        first = min(self.first_chunks, chunks)
        if inline:
            self.late_steps += 1
            first -= inline + 1
        elif slack is None or (cost is not None and slack >= 2 * cost):
            first += 1  # room for more commits, or nothing committed lately: one more chunk
        self.first_chunks = max(0, min(chunks, first))
        return self.first_chunks > 0

    # ------------------------------------------------------------------ a step
    def open_step(self) -> None:
        """At every step's open, before its downloads: commits of steps before the last have ended; after a step
        that went weights first, this step's gradients land in the other buffer set (its commits read the one
        they are in)."""
        with self.host.executor.condition:
            older = {k for k, step in self.pending.items() if step < self.serial}
            if older:
                self.inline += 1
                self.wait(older)
            if self.committing == self.serial:  # the next step's gradients land in the other set
                self.host.staging.swap_sets()
            self.serial += 1

    def prepare(self, args: StepArgs | None) -> None:
        self.host.staging.make_spare()

    def run(self, k: int, args: StepArgs | None = None) -> None:
        """Chunk k (with `args`, else the step's): weights first if it is one of the first chunks, else the single
        pass."""
        host = self.host
        with host.executor.condition:
            args = host.record.args if args is None else args
        peek = k < self.first_chunks
        try:
            pieces = host.run_chunk(k, args, peek=peek)
            if peek:
                self.behind(k, pieces, args, host.record.scale)
        finally:
            host.mark_done([k])

    def behind(self, k: int, pieces: list[Piece], args: StepArgs, scale: float) -> None:
        """Queues the commit of chunk k, whose weights are up (the state in place; its gradients read where they
        are now)."""
        host = self.host
        job = partial(self.commit, k, pieces, host.host_views(pieces), args, scale)
        with host.executor.condition:
            self.pending[k], self.todo[k], self.committing = self.serial, job, self.serial
            host.executor.submit(Job("commit", k, partial(self.start, k), lambda: (2, k)))

    def commit_first(self, k: int) -> None:
        """On the worker, before chunk k steps again: its last commit, run now if it has not started. The step's
        first kernel also measures how long the worker idled after the last commits, if they all had ended."""
        now = time.perf_counter()
        with self.host.executor.condition:
            if self.seen != self.serial:
                self.seen = self.serial
                if not self.todo and not self.pending and self.committing == self.serial - 1:
                    self.slack = now - self.last_end
            job = self.todo.pop(k, None)
            self.inline += job is not None
        if job is not None:
            job()

    def start(self, k: int) -> None:
        """The queued commit of chunk k, unless a kernel of the chunk has already run it."""
        with self.host.executor.condition:
            job = self.todo.pop(k, None)
        if job is not None:
            job()

    def commit(self, k: int, pieces: list[Piece], grads: list, args: StepArgs, scale: float) -> None:
        host = self.host
        begin = time.perf_counter()
        try:
            host.kernel(None, pieces, grads, args, scale, outs=None)
        finally:
            end = time.perf_counter()
            with host.executor.condition:
                self.pending.pop(k, None)
                seconds = end - begin
                self.commit_s = seconds if self.commit_s is None else 0.8 * self.commit_s + 0.2 * seconds
                self.last_end = end
                host.executor.condition.notify_all()
        if host.timeline is not None:
            host.timeline.append({"commit": k, "start": begin, "end": end})

    def wait(self, chunks: set[int] | None = None) -> None:
        """Until the commits of `chunks` (else all) have ended (caller holds the executor's condition); with none
        pending, at once (another job's error is raised where the step's own waits are)."""
        if self.pending.keys() & chunks if chunks is not None else self.pending:
            self.host.executor.wait_until(
                lambda: not (self.pending.keys() & chunks if chunks is not None else self.pending)
            )
