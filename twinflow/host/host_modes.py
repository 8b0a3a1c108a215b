"""How the CPU share steps, one strategy per mode; each owns its own extra state and submits its own jobs.

- :class:`ExactMode`: a chunk steps in place once its gradients are down and the step's arguments are
  released (at ``open()`` under eager overlap, else at ``seal()``), and its weights go up at once.
- :class:`SpeculativeMode` (attached, clipping): chunks step as they land with multiplier 1, out of place
  (the weights into the second buffer set, the state into the scratch set), and are held. At ``seal()`` the
  verdict: multiplier 1 keeps them, anything else steps them again from the untouched state; either way
  the written set becomes current and the result is bit for bit the exact step's.
- :class:`DelayedMode` (``delay_after``): the step's chunks become a late job that runs during the next
  iteration's forward and backward; its weights go up at the next ``seal()``, after that backward (the
  earliest point no saved activation still needs the old weights), or at ``flush()``. The next step's
  gradients land in the second buffer set meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

from twinflow.base.transfer import NoEvent, Streams
from twinflow.host.executor import CpuExecutor, Job
from twinflow.host.host_state import HostState
from twinflow.host.staging import Piece, Staging
from twinflow.host.step_record import StepArgs, StepRecord

log = logging.getLogger(__name__)


class CommitsBehind(Protocol):
    """What speculation uses of :class:`twinflow.host.weights_first.WeightsFirstMode`."""

    def run(self, k: int, args: StepArgs | None = None) -> None: ...

    def behind(self, k: int, pieces: list[Piece], args: StepArgs, scale: float) -> None: ...


class HostSide(Protocol):
    """What a mode uses of the CPU side (:class:`twinflow.host.host_side.HostSide`)."""

    record: StepRecord
    executor: CpuExecutor
    staging: Staging
    state: HostState
    streams: Streams
    delayed: DelayedMode
    weights_first: CommitsBehind
    timeline: list[dict] | None

    @property
    def released_args(self) -> StepArgs | None: ...

    def chunk_rank(self, k: int) -> tuple: ...

    def seal_ready(self, args: StepArgs) -> None: ...

    def run_chunk(self, k: int, args: StepArgs, speculative: bool = False, peek: bool = False) -> list[Piece]: ...

    def mark_done(self, chunks: list[int]) -> None: ...

    def live(self, k: int) -> list[Piece]: ...

    def host_views(self, pieces: list[Piece]) -> list[torch.Tensor]: ...

    def spare_views(self, pieces: list[Piece]) -> list[torch.Tensor]: ...

    def upload(self, k: int, pieces: list[Piece], sources: list[torch.Tensor]) -> None: ...

    def kernel(self, ready: torch.cuda.Event | NoEvent | None, pieces: list[Piece], grads: list[torch.Tensor],
               args: StepArgs, scale: float | None, apart: bool = False, outs: object = ...,
               peek: bool = False) -> float: ...  # fmt: skip


class ExactMode:
    """In place, each chunk once; weights up as each chunk finishes."""

    name = "exact"

    def __init__(self, host: HostSide) -> None:
        self.host = host

    def prepare(self, args: StepArgs | None) -> None:
        """Before the step opens (nothing to make)."""

    def job(self, k: int) -> Job:
        return Job("chunk", k, partial(self.run, k), partial(self.host.chunk_rank, k))

    def seal(self, args: StepArgs, scale: Callable[[], float | Callable[[], float]]) -> StepArgs:
        host = self.host
        eager = host.released_args
        if eager is not None:  # the worker may already have stepped with these
            if eager.groups != args.groups:
                log.warning("hyper-parameters changed between backward and step(); under eager overlap the step "
                            "uses the values read when backward began delivering gradients")  # fmt: skip
            args = eager
        else:
            args.scale = scale()
        host.delayed.flush(wait=False)  # an exact step after a delayed one: the pending weights go up first
        host.seal_ready(args)
        return args

    def run(self, k: int) -> None:
        host = self.host
        try:
            host.run_chunk(k, host.record.args)
        finally:
            host.mark_done([k])

    def reset(self) -> None:
        if self.host.record.args is not None:
            raise RuntimeError(
                "zero_grad() after the CPU share already stepped in backward (eager overlap): that update "
                "cannot be undone. Call step() after backward, or attach with eager=False"
            )


class SpeculativeMode(ExactMode):
    """Chunks step before the multiplier is known, are held, and are kept or stepped again at the verdict."""

    name = "speculative"

    def __init__(self, host: HostSide) -> None:
        super().__init__(host)
        self.held: list[int] = []
        self.opened: StepArgs | None = None  # the arguments chunks were speculated with
        self.verdict: StepArgs | None = None
        self.rollbacks = 0  # speculative steps undone and redone (their multiplier was not 1)
        self.speculated_chunks = 0  # chunks stepped before their step's multiplier was known
        self.first = False  # this step's redo (and chunks stepped after the verdict) go new weights first

    def prepare(self, args: StepArgs | None) -> None:
        self.host.staging.make_spare()
        self.host.state.make_scratch()
        args.scale = 1.0
        self.held, self.opened, self.verdict = [], args, None

    def seal(self, args: StepArgs, scale: Callable[[], float | Callable[[], float]]) -> StepArgs:
        args.scale = scale()
        host = self.host
        with host.executor.condition:
            self.verdict = args
            host.executor.submit(Job("verdict", -1, self.settle_held, lambda: (0,)))
        host.seal_ready(args)
        return args

    def run(self, k: int) -> None:
        host = self.host
        with host.executor.condition:
            verdict = self.verdict
        if verdict is not None:  # known before this chunk started: an exact step with it
            if self.first:
                return host.weights_first.run(k, verdict)
            try:
                host.run_chunk(k, verdict)
            finally:
                host.mark_done([k])
            return
        try:  # multiplier 1, weights into the spare buffer, held
            host.run_chunk(k, self.opened, speculative=True)
        except BaseException:
            host.mark_done([k])
            raise
        with host.executor.condition:
            self.held.append(k)

    def settle_held(self) -> None:
        """The verdict on the held chunks: kept if it is 1 (and the hyper-parameters did not change), else
        stepped again with it from the state they started from; then uploaded."""
        host = self.host
        with host.executor.condition:
            held, self.held = self.held, []
        try:
            if held:
                self.judge(sorted(held))
        finally:
            host.mark_done(held)

    def judge(self, held: list[int]) -> None:
        host, verdict = self.host, self.verdict
        start = time.perf_counter()
        scale = verdict.read_scale()
        host.record.scale = scale
        redo = scale != 1.0 or verdict.groups != self.opened.groups
        self.speculated_chunks += len(held)
        self.rollbacks += redo
        for k in held:
            pieces = host.live(k)
            if redo and self.first:  # the peek from the state the chunk started from (still current); its commit
                host.weights_first.behind(k, host.run_chunk(k, verdict, peek=True), verdict, scale)
                continue
            if redo:
                host.kernel(host.staging.chunks[k].grad_ready, pieces, host.host_views(pieces), verdict, scale,
                            apart=True)  # fmt: skip
            host.state.flip(pieces)
            host.upload(k, pieces, host.spare_views(pieces))
        if host.timeline is not None:
            host.timeline.append({"verdict": held, "redo": redo, "start": start, "end": time.perf_counter()})

    def reset(self) -> None:
        """The held chunks are dropped: their current state is the one from before the step."""
        host = self.host
        host.executor.cancel("chunk")
        host.record.ready = []
        while host.executor.running is not None:  # a worker error stays for finish() to raise, after the reset
            host.executor.condition.wait()
        self.held = []


class DelayedMode(ExactMode):
    """The step's chunks run as a late job during the next iteration; its weights go up at the next seal."""

    name = "delayed"

    def __init__(self, host: HostSide) -> None:
        super().__init__(host)
        self.job_of: dict[int, list[tuple[Piece, torch.Tensor]]] = {}  # uploaded at the next seal or flush
        self.busy: set[int] = set()  # chunks whose kernel has not finished
        self.args: StepArgs | None = None
        self.scale: float | None = None
        self.ready = host.streams.event()  # the late job's gradients are all on the host
        # Once flush() has begun (after the next backward), the worker uploads each chunk it finishes; chunks
        # finished before that wait in `finished` for flush() to upload them.
        self.safe = False
        self.finished: list[int] = []
        self.late_jobs = 0  # delayed steps so far

    @property
    def pending(self) -> bool:
        """A delayed step's weights have not gone up yet."""
        return bool(self.job_of)

    def seal(self, args: StepArgs, scale: Callable[[], float | Callable[[], float]]) -> StepArgs:
        """Uploads the last late job's weights (after this backward), and makes this step the next late job."""
        args.scale = scale()
        host = self.host
        self.flush(wait=False)  # the forward's pre-hooks (or finish()) make the compute stream wait per chunk
        host.staging.make_spare()
        with host.executor.condition:
            record, job = host.record, {}
            for k, chunk in enumerate(host.staging.chunks):
                live = host.live(k)
                if live:
                    job[k] = list(zip(live, host.host_views(live)))
                    if record.missing[k] != 0:
                        chunk.grad_ready.record(host.streams.d2h_stream)
            self.job_of, self.busy = job, set(job)
            self.args, self.scale = args, None
            self.safe, self.finished = False, []
            self.late_jobs += 1
            self.ready.record(host.streams.d2h_stream)  # after every download of this step
            host.staging.swap_sets()  # the next step's gradients land in the other set
            record.nothing_left()  # the last job's uploads are queued: wait() waits on the device only
            record.args, record.waited = None, set()
            record.move("seal")
            for k in sorted(job):
                host.executor.submit(Job("late", k, partial(self.run_late, k), partial(lambda k: (2, k), k)))
        host.streams.compute_after_downloads()
        return args

    def run_late(self, k: int) -> None:
        host = self.host
        try:
            job = self.job_of.get(k)
            if job is None:
                return
            pieces, views = [pc for pc, _ in job], [h for _, h in job]
            self.scale = host.kernel(self.ready, pieces, views, self.args, self.scale)
            with host.executor.condition:
                upload = self.safe
                if not upload:  # flush() uploads it, once the next backward is done
                    self.finished.append(k)
                    self.busy.discard(k)
            if upload:
                host.upload(k, pieces, views)
        finally:
            with host.executor.condition:
                self.busy.discard(k)

    def wait_kernel(self) -> None:
        """Until the late job's kernel is done (caller holds the condition); raises the worker's error."""
        self.host.executor.wait_until(lambda: not self.busy)

    def flush(self, wait: bool = True) -> None:
        """Applies the pending late job: waits for its kernel, then uploads its weights (`wait`: the current
        stream sees them, else each chunk's ``uploaded`` event is left for ``wait()``). Call only where no saved
        activation needs the old weights: after backward, or outside a step."""
        if not self.job_of:
            return
        host = self.host
        if host.streams.cuda:  # after every kernel queued so far (the backward that read the old weights)
            host.streams.h2d_stream.wait_stream(torch.cuda.current_stream(host.streams.device))
        with host.executor.condition:
            self.safe = True  # from here on the worker uploads what it finishes
            finished, self.finished = self.finished, []
        for k in finished:
            if k in self.job_of:  # drop_for may have emptied it
                host.upload(k, *map(list, zip(*self.job_of[k])))
        with host.executor.condition:
            self.wait_kernel()
            job, self.job_of = self.job_of, {}
            self.busy = set()
        if wait:
            for k in job:
                host.streams.compute_waits(host.staging.chunks[k].uploaded)

    def drop_for(self, moved: set[int], why: str) -> None:
        """Parameters written outside the optimizer keep those weights: their pending upload is dropped."""
        if not any(pc.param in moved for live in self.job_of.values() for pc, _ in live):
            return
        log.warning("%d parameters %s while a delayed update was pending: they keep the new weights and that "
                    "step's CPU update is dropped (its moments stay); call synchronize() before writing weights "
                    "to keep it", len(moved), why)  # fmt: skip
        with self.host.executor.condition:
            self.wait_kernel()
            for k in list(self.job_of):
                self.job_of[k] = [(pc, h) for pc, h in self.job_of[k] if pc.param not in moved]
                if not self.job_of[k]:
                    del self.job_of[k]


def check_delay_after(delay_after: object) -> None:
    if delay_after is not None and (isinstance(delay_after, bool) or not isinstance(delay_after, int)
                                    or delay_after < 0):  # fmt: skip
        raise ValueError(
            f"delay_after={delay_after!r}; expected None (every update exact) or an int >= 0: the number of "
            "exact steps before the CPU share's updates are delayed by one step"
        )
