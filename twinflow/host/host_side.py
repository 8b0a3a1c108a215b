"""The CPU side of TwinFlowAdam: gradients down, the kernel on the worker, weights up.

One step:

1. ``open(args, mode)``; then ``download(i)`` for each parameter with a CPU share, from a
   post-accumulate-grad hook during backward or from ``step()``: copies on the download stream, queued
   after the gradient's producer.
2. A chunk whose parameters are all down (or declared gradient-less by ``seal()``) is ready; the mode
   (:mod:`twinflow.host.host_modes`) submits its job to the worker (:mod:`twinflow.host.executor`) once the step's
   arguments are released: at ``open()`` under eager overlap or speculation, else at ``seal()``, which also
   carries the clipping coefficient. The worker runs ready chunks lowest index first (the next forward
   needs the first parameters first), those whose gradients have landed before those still in flight.
3. Each chunk's weights go up on the upload stream, which records its event.
4. ``wait(chunks)`` makes the compute stream wait for those chunks (the next forward's pre-hooks call it);
   ``finish()`` waits for all.

This class owns the step's bookkeeping and the staging; the state belongs to
:class:`twinflow.host.host_state.HostState`, which it steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from twinflow.base.transfer import NoEvent, Streams
from twinflow.host import ops
from twinflow.host.executor import CpuExecutor
from twinflow.host.host_modes import DelayedMode, ExactMode, SpeculativeMode
from twinflow.host.host_state import HostState
from twinflow.host.staging import Piece, Staging
from twinflow.host.step_record import EXACT, Phase, StepArgs, StepMode, StepRecord, Way
from twinflow.host.weights_first import WeightsFirstMode


class HostSide:
    """Moves the CPU share's gradients down, steps them with the kernel, and moves the weights back up."""

    def __init__(self, weights: list[torch.Tensor], group_of: list[int], state: HostState, device: torch.device,
                 num_threads: Callable[[], int | None], note_written: Callable[[int], None]) -> None:  # fmt: skip
        ops.load()  # build the kernel now, in the caller's thread: a BuildError surfaces here, as itself
        self.weights, self.group_of, self.num_threads = weights, group_of, num_threads
        self.state, self.note_written = state, note_written
        self.streams = Streams(device)
        self.staging = Staging(weights, state.pieces, self.streams)
        self.executor = CpuExecutor(device)
        self.record = StepRecord(len(self.staging.chunks))
        self.exact, self.speculative, self.delayed = ExactMode(self), SpeculativeMode(self), DelayedMode(self)
        self.weights_first = WeightsFirstMode(self)
        self.mode: ExactMode = self.exact
        self.by_way = {Way.EXACT: self.exact, Way.WEIGHTS_FIRST: self.weights_first, Way.SPECULATIVE: self.speculative,
                       Way.DELAYED: self.delayed}  # fmt: skip
        # Set to a list to record host times (time.perf_counter) of every chunk and wait, for timeline plots.
        self.timeline: list[dict] | None = None
        self.ready_at: list[float] = [0.0] * len(self.staging.chunks)

    # ------------------------------------------------------------------ reading
    @property
    def phase(self) -> Phase:
        return self.record.phase

    @property
    def chunks_of(self) -> dict[int, list[int]]:
        """Per CPU-stepped parameter, the chunks that hold its elements."""
        return self.staging.chunks_of

    @property
    def chunk_count(self) -> int:
        return len(self.staging.chunks)

    def downloaded(self, i: int) -> bool:
        return i in self.record.down

    @property
    def released_args(self) -> StepArgs | None:
        """The arguments an eager step was opened with (the worker may already use them), else None."""
        return self.record.args if self.record.phase is Phase.OPEN else None

    @property
    def last_scale(self) -> float | None:
        """The multiplier of this step (after ``finish()``: of the last step), once the worker has read it."""
        return self.record.scale

    @property
    def late_pending(self) -> bool:
        return self.delayed.pending

    @property
    def pinned_bytes(self) -> int:
        return self.staging.pinned_bytes

    # ---------------------------------------------------------------- a step
    def open(self, args: StepArgs | None, mode: StepMode = EXACT) -> None:
        """Starts a step's downloads in `mode`; with `args` the worker may step chunks as soon as they are down."""
        self.finish()
        if mode.second_sets:
            with self.executor.condition:
                self.weights_first.wait()
        elif args is not None and self.delayed.pending:  # eager chunks would step before the late job
            with self.executor.condition:
                self.delayed.wait_kernel()
        self.weights_first.open_step()  # may move this step's gradients to the other buffer set
        self.speculative.first = mode.redo_weights_first
        self.mode = self.by_way[mode.way]
        self.mode.prepare(args)
        with self.executor.condition:
            self.executor.raise_error()
            self.record.open([len(c.params) for c in self.staging.chunks], args)
        if self.streams.cuda:  # chunk buffers are reused: this step's downloads follow last step's uploads
            self.streams.d2h_stream.wait_stream(self.streams.h2d_stream)

    def download(self, i: int, grad: torch.Tensor) -> None:
        """Queues the copy of parameter i's CPU share of `grad` into its chunks' buffers (`grad` may be dropped
        as soon as this returns)."""
        if i in self.record.down:
            raise RuntimeError(
                f"the gradient of parameter {i} reached TwinFlowAdam twice in one step. With gradient "
                "accumulation, run every backward but the last inside `with optimizer.no_sync():`. A parameter "
                "used both inside and outside a reentrant activation checkpoint (use_reentrant=True) is also "
                "accumulated twice: use use_reentrant=False"
            )
        self.staging.download(i, grad)
        with self.executor.condition:
            for k in self.record.landed(i, self.staging.chunks_of[i]):
                self.staging.chunks[k].grad_ready.record(self.streams.d2h_stream)
                self.make_ready(k)

    def make_ready(self, k: int) -> None:
        """Chunk k has all its gradients (caller holds the condition): its job runs once the step is released."""
        self.record.ready.append(k)
        if self.timeline is not None:
            self.ready_at[k] = time.perf_counter()
        if self.record.args is not None:
            self.executor.submit(self.mode.job(k))

    def seal(self, args: StepArgs, scale: Callable[[], float | Callable[[], float]]) -> StepArgs:
        """Every gradient of the step is down: returns the step's arguments, which the device side uses too
        (those the worker stepped with under eager overlap, else `args` with the multiplier ``scale()``)."""
        return self.mode.seal(args, scale)

    def seal_ready(self, args: StepArgs) -> None:
        """Chunks still missing gradients become ready with what they have; the worker may run them all."""
        record = self.record
        with self.executor.condition:
            released = record.args is not None
            if not released:
                record.args = args
                for k in record.ready:
                    self.executor.submit(self.mode.job(k))
            for k, chunk in enumerate(self.staging.chunks):
                if record.missing[k] == 0:
                    continue
                live = [i for i in chunk.params if i in record.down]
                record.missing[k] = 0
                if live:
                    chunk.grad_ready.record(self.streams.d2h_stream)
                    self.make_ready(k)
                else:
                    record.done[k] = True  # nothing to step or upload
            record.move("seal")
        self.streams.compute_after_downloads()

    def discard(self) -> None:
        """Drops the open step's gradients (an fp16 overflow): nothing is stepped or uploaded."""
        self.delayed.flush()  # a delayed step's weights still go up: this is after backward
        with self.executor.condition:
            if self.record.args is not None and self.record.phase is Phase.OPEN:
                raise RuntimeError("cannot discard a step whose CPU updates have already started (eager mode)")
            self.record.nothing_left()
            self.record.move("seal")
        self.streams.compute_after_downloads()
        self.finish()

    def reset(self) -> None:
        """Forgets an open step's downloads (zero_grad before step); refused once CPU updates have started."""
        with self.executor.condition:
            if self.record.phase is not Phase.OPEN:
                return
            self.mode.reset()
            self.executor.cancel("chunk")
            self.record.nothing_left()
            self.record.move("seal")
        self.streams.compute_after_downloads()
        self.finish()

    def wait(self, chunk_ids: list[int]) -> None:
        """The compute stream waits for these chunks' uploads (host-blocks only until each upload is queued)."""
        record = self.record
        if (record.phase is Phase.OPEN and record.args is not None and self.mode is self.exact
                and torch._C._current_graph_task_id() == -1):  # fmt: skip
            raise RuntimeError(
                "TwinFlowAdam: the model ran forward after backward but before step(), while the CPU share was "
                "already stepping (attach() is eager by default), so it would read weights the CPU is writing. "
                "Call step() first; with gradient accumulation, run every backward but the last of a window inside "
                "`with optimizer.no_sync():`; to run forwards between backward and step(), attach with eager=False"
            )
        if record.phase is not Phase.SEALED:
            return  # nothing of a finished step is in flight (or this is a recompute during backward)
        todo = [k for k in chunk_ids if k not in record.waited]
        if not todo:
            return
        start = time.perf_counter()
        with self.executor.condition:
            self.executor.wait_until(lambda: all(record.done[k] for k in todo))
        if self.timeline is not None:
            self.timeline.append({"wait": todo, "start": start, "end": time.perf_counter()})
        for k in todo:
            self.streams.compute_waits(self.staging.chunks[k].uploaded)
            record.waited.add(k)

    def finish(self) -> None:
        """Waits for every chunk of the step in flight; the compute stream then sees all uploaded weights."""
        if self.record.phase is Phase.OPEN:
            raise RuntimeError("TwinFlowAdam: gradients were streamed but step() was not called yet")
        self.wait(list(range(self.chunk_count)))
        with self.executor.condition:
            self.executor.raise_error()
            self.record.move("finish")

    def settle(self) -> None:
        """Every update taken so far, a delayed one included, is in the weights the current stream sees (and in
        the state's first set)."""
        self.finish()
        self.delayed.flush()
        with self.executor.condition:
            self.weights_first.wait()
        self.state.settle()

    def quiesce(self, params: set[int] | None = None) -> None:
        """No kernel writes the state, and the current state of `params` (else all) is in the first set; a
        delayed update's weights may still be pending (uploading them could change weights backward needs)."""
        self.finish()
        with self.executor.condition:
            self.delayed.wait_kernel()
            self.weights_first.wait()
        self.state.settle(params)

    def drop_late_for(self, moved: set[int], why: str = "were written outside the optimizer") -> None:
        """Parameters written outside the optimizer keep those weights: a pending delayed upload is dropped, and
        the last step's commits end first (their masters are about to follow the new weights)."""
        self.delayed.drop_for(moved, why)
        with self.executor.condition:
            self.weights_first.wait()

    def close(self) -> None:
        self.executor.close()

    # -------------------------------------------------------- worker side
    def chunk_rank(self, k: int) -> tuple:
        """The order chunk jobs run in: those whose gradients have landed first, then the lowest index."""
        return (1, not self.staging.chunks[k].grad_ready.query(), k)

    def mark_done(self, chunks: list[int]) -> None:
        with self.executor.condition:
            for k in chunks:
                self.record.done[k] = True
            self.executor.condition.notify_all()

    def live(self, k: int) -> list[Piece]:
        """Chunk k's pieces whose parameters have a gradient this step."""
        return [pc for pc in self.staging.chunks[k].pieces if pc.param in self.record.down]

    def host_views(self, pieces: list[Piece]) -> list[torch.Tensor]:
        return [self.staging.hosts[pc.id] for pc in pieces]

    def spare_views(self, pieces: list[Piece]) -> list[torch.Tensor]:
        return [self.staging.spares[pc.id] for pc in pieces]

    def upload(self, k: int, pieces: list[Piece], sources: list[torch.Tensor]) -> None:
        self.staging.upload(k, pieces, sources)
        for pc in pieces:  # the version our own write left: a later change means the weights moved outside
            self.note_written(pc.param)

    def kernel(self, ready: torch.cuda.Event | NoEvent | None, pieces: list[Piece], grads: list[torch.Tensor],
               args: StepArgs, scale: float | None, apart: bool = False, outs: object = ...,
               peek: bool = False) -> float:  # fmt: skip
        """Steps `pieces` from the gradients in `grads` (on the host once `ready`, an event, if given), the
        weights written back in place or (`apart`) into the spare buffer with the state out of place, or into
        `outs` if given (None: no weights, the state only). `peek`: the weights only, the state left as it
        was. Returns the multiplier (read from `args` unless known)."""
        with self.executor.reporting():  # seen by whoever the caller's cleanup wakes
            return self.step_groups(ready, pieces, grads, args, scale, apart, outs, peek)

    def step_groups(self, ready: torch.cuda.Event | NoEvent | None, pieces: list[Piece], grads: list[torch.Tensor],
                    args: StepArgs, scale: float | None, apart: bool, outs: object, peek: bool) -> float:  # fmt: skip
        if ready is not None:
            ready.synchronize()
        if scale is None:
            scale = args.read_scale()
        if outs is ...:
            outs = self.spare_views(pieces) if apart else grads
        by_group: dict[int, list[int]] = {}
        for n, pc in enumerate(pieces):
            by_group.setdefault(self.group_of[pc.param], []).append(n)
        for gi, members in by_group.items():
            g = args.groups[gi]
            hyper = dict(lr=g["lr"], beta1=g["beta1"], beta2=g["beta2"], eps=g["eps"], weight_decay=g["weight_decay"],
                         adamw_mode=g["adamw_mode"], bias_correction=g["bias_correction"], grad_scale=scale,
                         num_threads=self.num_threads(), **({"peek": True} if peek else {}))  # fmt: skip
            group_pieces = [pieces[n] for n in members]
            group_outs = None if outs is None else [outs[n] for n in members]
            self.state.step(group_pieces, [grads[n] for n in members], group_outs,
                            [args.steps[pc.param] for pc in group_pieces], apart, hyper)  # fmt: skip
        return scale

    def run_chunk(self, k: int, args: StepArgs, speculative: bool = False, peek: bool = False) -> list[Piece]:
        """Steps chunk k once its gradients are down and uploads it; returns its pieces. `speculative`: with
        multiplier 1, out of place, the weights left in the spare buffer for the verdict. `peek`: the weights
        only, into the spare buffer (once its last upload has ended), the state left as it was."""
        self.weights_first.commit_first(k)  # the state this kernel reads
        with self.executor.condition:
            pieces = self.live(k)
        grads = self.host_views(pieces)
        picked = time.perf_counter()
        self.staging.chunks[k].grad_ready.synchronize()
        if peek:
            self.staging.chunks[k].uploaded.synchronize()  # the last step's weights have left the spare buffer
        start = time.perf_counter()
        outs = self.spare_views(pieces) if peek else grads
        if speculative:
            self.kernel(None, pieces, grads, args, 1.0, apart=True)
        else:
            self.record.scale = self.kernel(None, pieces, grads, args, self.record.scale, outs=outs, peek=peek)
        kernel_end = time.perf_counter()
        if not speculative:
            self.upload(k, pieces, outs)
        if self.timeline is not None:
            times = {"ready": self.ready_at[k], "picked": picked, "start": start, "kernel_end": kernel_end}
            self.timeline.append({"chunk": k, **times, "end": time.perf_counter(),
                                  "elements": sum(pc.numel for pc in pieces),
                                  **({"speculative": True} if speculative else {}),
                                  **({"peek": True} if peek else {})})  # fmt: skip
        return pieces


class NoHost:
    """No CPU share: every call of the CPU side's protocol is a no-op (the coordinator and the split read straight
    through it)."""

    phase = Phase.IDLE
    chunks_of: dict[int, list[int]] = {}
    chunk_count = pinned_bytes = 0
    last_scale = released_args = timeline = None
    late_pending = False

    def open(self, args: StepArgs | None, mode: StepMode = EXACT) -> None:
        pass

    def seal(self, args: StepArgs, scale: Callable[[], Any]) -> StepArgs:
        return args  # the device side takes its multiplier from the step scale

    def wait(self, chunk_ids: list[int]) -> None:
        pass

    def downloaded(self, i: int) -> bool:
        return False

    def finish(self) -> None:
        pass

    discard = reset = settle = close = finish

    def quiesce(self, params: set[int] | None = None) -> None:
        pass

    def drop_late_for(self, moved: set[int], why: str = "") -> None:
        pass


NO_HOST = NoHost()
