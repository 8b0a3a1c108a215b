"""The CPU side of TwinFlowAdam: gradients down, the kernel on a worker thread, weights up.

The CPU-owned elements, in parameter order, are cut once into chunks of at
most ``chunk_bytes`` of gradient, each with its own pinned host buffer. A
gradient lands in its chunk's buffer; the kernel updates the fp32 masters and
moments from it and writes the rounded weights back into the same buffer, in
place (each element's gradient is read before its weight is written), and
the upload reads them from there. So the pinned memory is the CPU share's
gradient, and nothing waits for a staging buffer to come free.

One step:

1. ``open()``; then ``download(i)`` for each parameter with a CPU share, from
   a post-accumulate-grad hook during backward or from ``step()``: copies on
   the download stream, queued after the gradient's producer.
2. A chunk whose parameters are all down (or declared gradient-less by
   ``seal()``) is ready. The worker thread runs ready chunks, lowest index
   first (the next forward needs the first parameters first), once the step
   is released: at ``open()`` in eager mode, else at ``seal()``, which also
   carries the clipping coefficient.
3. The worker uploads each chunk on the upload stream and records its event.
4. ``wait(chunks)`` makes the compute stream wait for those chunks (the next
   forward's pre-hooks call it); ``finish()`` waits for all.

Delayed update (``seal(..., delayed=True)``): the step's chunks become a
*late job* that the worker runs during the next iteration's forward and
backward, and its weights go up at the next ``seal()``, after that backward
(the earliest point no saved activation still needs the old weights). So
the CPU share's weights are one step stale. Downloads of the next step land
in a second set of buffers, since the late job still reads and writes the
first; the two sets swap at every delayed seal. ``flush()`` applies a
pending late job at once.

Speculation (``open(args, speculative=True)``, under clipping): the worker
steps chunks as they land, with multiplier 1, writing the weights into the
second buffer set so that the gradients stay where they landed, and holds
them. Its master and moments go out of place, into the other of two state
sets (the second: 12 bytes per element of host memory), so the state the
step started from stays untouched. At ``seal()`` the real multiplier is
known: 1 keeps the held chunks, anything else steps them again from the
untouched state with it; either way the pieces' current state is then the
other set, and the result bit for bit the exact step's. Outside readers see
the first set: ``settle_state()`` copies pieces whose current state is the
second one back first.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from twinflow import compact, ops
from twinflow.cpu_adam import check_group_flags, check_hyperparams
from twinflow.transfer import Streams, pinned_buffers, view

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every piece in a chunk buffer starts on a cache line


_LIVE: weakref.WeakSet = weakref.WeakSet()  # pipelines whose worker may be running


@atexit.register
def _stop_workers() -> None:
    """Ends every worker before the interpreter tears down (a worker killed inside its OpenMP pool aborts)."""
    for pipeline in list(_LIVE):
        pipeline.close()


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class HostSegment:
    """Elements [start, end) of parameter `index`, stepped on the CPU, and their fp32 state."""

    index: int
    start: int
    end: int
    master: torch.Tensor | compact.Master24
    exp_avg: torch.Tensor | None  # None: 8-bit moments, kept by the pipeline's pieces
    exp_avg_sq: torch.Tensor | None


@dataclass
class StepArgs:
    """What the kernel needs for one step, fixed when the step is released."""

    groups: list[dict]  # per param group: lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction
    steps: list[int]  # per parameter: its step count after this update
    scale: float | Callable[[], float] = 1.0  # gradient multiplier (clipping); a callable may block

    @classmethod
    def of(cls, param_groups: list[dict], steps: list[int]) -> StepArgs:
        """The step's arguments from torch.optim param groups (hyper-parameters checked, as plain numbers)."""
        groups = []
        for index, group in enumerate(param_groups):
            check_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            check_group_flags(index, group)
            beta1, beta2 = group["betas"]
            groups.append(
                dict(
                    lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["adamw_mode"]),
                    bias_correction=bool(group["bias_correction"]),
                )
            )  # fmt: skip
        return cls(groups=groups, steps=steps)


@dataclass
class _Piece:
    param: int
    start: int  # element range in the flattened parameter
    end: int
    host: torch.Tensor  # staged gradient in, rounded weight out; the parameter's dtype
    dst: torch.Tensor  # the parameter's elements [start, end)
    master: torch.Tensor | compact.Master24
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    spare: torch.Tensor | None = None  # the same place in the second buffer set (delayed update)
    # state_precision "int8": exp_avg codes, their scales, exp_avg_sq codes, their scales (twinflow.compact)
    q8: list[torch.Tensor] | None = None
    alt: list[torch.Tensor] | None = None  # speculation's second state set: master, exp_avg, exp_avg_sq
    flipped: bool = False  # the current master and moments are in `alt`

    def state(self, flipped: bool) -> list[torch.Tensor]:
        """The master, exp_avg and exp_avg_sq of one set: the first (the split's own buffers) or `alt`."""
        return self.alt if flipped else [self.master, self.exp_avg, self.exp_avg_sq]


@dataclass
class _Chunk:
    buffer: torch.Tensor
    spare: torch.Tensor | None = None  # the second buffer set's (delayed update)
    pieces: list[_Piece] = field(default_factory=list)
    params: list[int] = field(default_factory=list)  # distinct, in order
    grad_ready: object = None  # event: the chunk's gradients are on the host
    uploaded: object = None  # event: the chunk's weights are back on the device


def check_chunk_bytes(chunk_bytes: object) -> None:
    if not isinstance(chunk_bytes, int) or chunk_bytes < 256:
        raise ValueError(f"chunk_bytes={chunk_bytes!r}; expected an int >= 256")


def check_delay_after(delay_after: object) -> None:
    if delay_after is not None and (isinstance(delay_after, bool) or not isinstance(delay_after, int)
                                    or delay_after < 0):  # fmt: skip
        raise ValueError(
            f"delay_after={delay_after!r}; expected None (every update exact) or an int >= 0: the number of "
            "exact steps before the CPU share's updates are delayed by one step"
        )


def plan_chunks(segments: list[HostSegment], itemsizes: list[int], chunk_bytes: int) -> list[list[tuple]]:
    """Packs the segments' elements, in order, into chunks of at most `chunk_bytes`.

    Returns per chunk a list of (segment position, a, b, byte offset): elements
    [a, b) of the segment at `byte offset` in the chunk. Pure; deterministic.
    """
    chunks: list[list[tuple]] = []
    current: list[tuple] = []
    used = 0
    for pos, seg in enumerate(segments):
        size = itemsizes[seg.index]
        a, n = 0, seg.end - seg.start
        while a < n:
            room = (chunk_bytes - used) // size
            if room <= 0:
                chunks.append(current)
                current, used = [], 0
                continue
            b = min(n, a + room)
            current.append((pos, a, b, used))
            used += _aligned((b - a) * size)
            a = b
    if current:
        chunks.append(current)
    return chunks


class HostPipeline:
    """Moves the CPU share's gradients down, steps them with the kernel, and moves the weights back up."""

    def __init__(
        self,
        params: list[torch.Tensor],
        group_of: list[int],
        segments: list[HostSegment],
        chunk_bytes: int,
        device: torch.device,
        num_threads: int | None,
        precision: str = "fp32",
    ) -> None:
        ops.load()  # build the kernel now, in the caller's thread: a BuildError surfaces here, as itself
        self.params = params
        self.group_of = group_of
        self.num_threads = num_threads
        self.streams = Streams(device)
        itemsizes = [p.element_size() for p in params]
        plans = plan_chunks(segments, itemsizes, chunk_bytes)
        sizes = [max(_ALIGN, sum(_aligned((b - a) * itemsizes[segments[pos].index]) for pos, a, b, _ in plan))
                 for plan in plans]  # fmt: skip
        buffers = pinned_buffers(sizes, self.streams.cuda, "the CPU share's gradients")
        self._sizes = sizes
        self.pinned_bytes = sum(sizes) if self.streams.cuda else 0
        self.alt_bytes = 0  # host memory of speculation's second state set (made at the first speculative step)
        self.chunks: list[_Chunk] = []
        self.pieces_of: dict[int, list[tuple[int, _Piece]]] = {}
        for k, (plan, buf) in enumerate(zip(plans, buffers)):
            chunk = _Chunk(buf, grad_ready=self.streams.event(), uploaded=self.streams.event())
            for pos, a, b, offset in plan:
                seg = segments[pos]
                p = params[seg.index]
                piece = _Piece(
                    param=seg.index,
                    start=seg.start + a,
                    end=seg.start + b,
                    host=view(buf, offset, b - a, p.dtype),
                    dst=p.detach().view(-1)[seg.start + a : seg.start + b],
                    master=seg.master[a:b],
                    exp_avg=seg.exp_avg[a:b] if precision == "fp32" else None,
                    exp_avg_sq=seg.exp_avg_sq[a:b] if precision == "fp32" else None,
                    q8=None if precision == "fp32" else compact.fresh(b - a),
                )
                chunk.pieces.append(piece)
                if seg.index not in chunk.params:
                    chunk.params.append(seg.index)
                self.pieces_of.setdefault(seg.index, []).append((k, piece))
            self.chunks.append(chunk)
        self.chunks_of = {i: sorted({k for k, _ in pcs}) for i, pcs in self.pieces_of.items()}
        self._offsets = {id(pc): offset for chunk, plan in zip(self.chunks, plans)
                         for pc, (_, _, _, offset) in zip(chunk.pieces, plan)}  # fmt: skip

        self._cond = threading.Condition()
        self._phase = "idle"  # idle -> open (gradients arriving) -> sealed (all known) -> idle
        self._down: set[int] = set()
        self._missing: list[int] = []
        self._ready: list[int] = []
        self._done: list[bool] = [True] * len(self.chunks)
        self._waited: set[int] = set()
        self._args: StepArgs | None = None
        self._scale: float | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        # Set to a list to record host times (time.perf_counter) of every chunk and wait, for timeline plots.
        self.timeline: list[dict] | None = None
        self._ready_at: list[float] = [0.0] * len(self.chunks)
        # Per parameter, its version counter right after this pipeline last wrote its weights.
        self.written_version: dict[int, int] = {}
        # The late job (delayed update): per chunk the pieces it steps and the host views it uses.
        self._late: list[int] = []  # chunks not picked yet
        self._late_busy: set[int] = set()  # chunks not finished yet
        self._late_job: dict[int, list[tuple[_Piece, torch.Tensor]]] = {}  # uploaded at the next seal or flush
        self._late_args: StepArgs | None = None
        self._late_scale: float | None = None
        self._late_ready = self.streams.event()  # the late job's gradients are all on the host
        # Once flush() has begun (after the next backward), the worker uploads each chunk it finishes; chunks
        # finished before that wait in _late_finished for flush() to upload them.
        self._late_safe = False
        self._late_finished: list[int] = []
        self.late_jobs = 0  # delayed steps so far
        # Speculation: chunks stepped with multiplier 1 before seal(), held until the verdict (seal's args).
        self._spec = False
        self._spec_held: list[int] = []
        self._verdict: StepArgs | None = None
        self._running: int | None = None  # the chunk the worker is on (normal or speculative)
        self.rollbacks = 0  # speculative steps undone and redone (their multiplier was not 1)
        self.speculated_chunks = 0  # chunks stepped before their step's multiplier was known

    # ------------------------------------------------------------ main side
    @property
    def phase(self) -> str:
        return self._phase

    def downloaded(self, i: int) -> bool:
        return i in self._down

    @property
    def released_args(self) -> StepArgs | None:
        """The arguments an eager step was opened with (the worker may already use them), else None."""
        return self._args if self._phase == "open" else None

    def open(self, args: StepArgs | None = None, speculative: bool = False) -> None:
        """Starts a step's downloads; with `args` the worker may step chunks as soon as they are down
        (`speculative`: with multiplier 1, held until ``seal()`` gives the real one)."""
        self.finish()
        if speculative:
            self._make_spare()
            self._make_alts()
            args.scale = 1.0
        with self._cond:
            self._spec, self._spec_held, self._verdict = speculative, [], None
            self._raise_error()
            self._phase = "open"
            self._down = set()
            self._missing = [len(c.params) for c in self.chunks]
            self._ready = []
            self._done = [False] * len(self.chunks)
            self._waited = set()
            self._args, self._scale = args, None
        # Chunk buffers are reused: this step's downloads follow last step's uploads.
        if self.streams.cuda:
            self.streams.d2h_stream.wait_stream(self.streams.h2d_stream)
        if args is not None:
            self._start_worker()

    def download(self, i: int, grad: torch.Tensor) -> None:
        """Queues the copy of parameter i's CPU share of `grad` into its chunks' buffers.

        The caller may drop `grad` as soon as this returns.
        """
        if i in self._down:
            raise RuntimeError(
                f"the gradient of parameter {i} reached TwinFlowAdam twice in one step. With gradient "
                "accumulation, run every backward but the last inside `with optimizer.no_sync():`. A parameter "
                "used both inside and outside a reentrant activation checkpoint (use_reentrant=True) is also "
                "accumulated twice: use use_reentrant=False"
            )
        flat = grad.reshape(-1)
        pieces = self.pieces_of[i]
        self.streams.after_compute()
        with self.streams.d2h():
            torch._foreach_copy_(
                [pc.host for _, pc in pieces], [flat[pc.start : pc.end] for _, pc in pieces], non_blocking=True
            )
        if self.streams.cuda:
            # The copy may run after step() returns and the caller frees the gradient (zero_grad, or the
            # release below): the allocator must not hand its memory out before the copy has read it.
            flat.record_stream(self.streams.d2h_stream)
        with self._cond:
            self._down.add(i)
            for k in self.chunks_of[i]:
                self._missing[k] -= 1
                if self._missing[k] == 0:
                    self.chunks[k].grad_ready.record(self.streams.d2h_stream)
                    self._push_ready(k)
            self._cond.notify_all()

    def seal(self, args: StepArgs, scale: Callable[[], float | Callable[[], float]], delayed: bool = False) -> StepArgs:
        """Every gradient of the step is down: chunks wait for no one else, and the worker may run them all.

        Returns the step's arguments, which the device side uses too: those the step was opened with under
        eager overlap (the worker may already have used them), else `args` with the gradient multiplier
        ``scale()`` (clipping). `delayed`: the step becomes the late job, and the last one's weights go up now.
        """
        if self._spec:  # the worker checks the held chunks against these arguments
            args.scale = scale()
            self._seal_ready(args)
            return args
        eager = self.released_args
        if eager is not None:
            if eager.groups != args.groups:
                log.warning("hyper-parameters changed between backward and step(); under eager overlap the step "
                            "uses the values read when backward began delivering gradients")  # fmt: skip
            args = eager
        else:
            args.scale = scale()
        if delayed and eager is None:
            self._seal_late(args)
            return args
        self.flush(wait=False)  # an exact step after a delayed one: the pending weights go up first
        self._seal_ready(args)
        return args

    def _seal_ready(self, args: StepArgs) -> None:
        """Chunks still missing gradients become ready with what they have; the worker may run them all."""
        with self._cond:
            if self._spec:
                self._verdict = args
            for k, chunk in enumerate(self.chunks):
                if self._missing[k] == 0:
                    continue
                live = [i for i in chunk.params if i in self._down]
                self._missing[k] = 0
                if live:
                    chunk.grad_ready.record(self.streams.d2h_stream)
                    self._push_ready(k)
                else:
                    self._done[k] = True  # nothing to step or upload
            if self._args is None:
                self._args = args
            self._phase = "sealed"
            self._cond.notify_all()
        self.streams.compute_after_downloads()
        self._start_worker()

    def _push_ready(self, k: int) -> None:
        """Caller holds the lock."""
        self._ready.append(k)
        if self.timeline is not None:
            self._ready_at[k] = time.perf_counter()

    def _seal_late(self, args: StepArgs) -> None:
        """Uploads the last late job's weights (after this backward), and makes this step the next late job."""
        self.flush(wait=False)  # the forward's pre-hooks (or finish()) make the compute stream wait per chunk
        self._make_spare()
        with self._cond:
            job = {}
            for k, chunk in enumerate(self.chunks):
                live = self._job(k)
                if live:
                    job[k] = live
                    if self._missing[k] != 0:
                        chunk.grad_ready.record(self.streams.d2h_stream)
            self._late_job, self._late, self._late_busy = job, sorted(job), set(job)
            self._late_args, self._late_scale = args, None
            self._late_safe, self._late_finished = False, []
            self.late_jobs += 1
            self._late_ready.record(self.streams.d2h_stream)  # after every download of this step
            for chunk in self.chunks:  # the next step's gradients land in the other set
                chunk.buffer, chunk.spare = chunk.spare, chunk.buffer
                for pc in chunk.pieces:
                    pc.host, pc.spare = pc.spare, pc.host
            self._missing = [0] * len(self.chunks)
            self._ready, self._args = [], None
            self._done = [True] * len(self.chunks)  # the last job's uploads are queued: wait() waits on GPU only
            self._waited = set()
            self._phase = "sealed"
            self._cond.notify_all()
        self.streams.compute_after_downloads()
        self._start_worker()

    def _make_spare(self) -> None:
        """The second buffer set, made the first time a delayed or speculative step needs it."""
        if not self.chunks or self.chunks[0].spare is not None:
            return
        spares = pinned_buffers(self._sizes, self.streams.cuda, "the delayed update's second gradient buffers")
        self.pinned_bytes *= 2
        for chunk, buf in zip(self.chunks, spares):
            chunk.spare = buf
            for pc in chunk.pieces:
                pc.spare = view(buf, self._offsets[id(pc)], pc.end - pc.start, pc.host.dtype)

    @property
    def state_bytes(self) -> int:
        """Host memory of the CPU share's masters and moments (not speculation's second set)."""
        pieces = [pc for chunk in self.chunks for pc in chunk.pieces]
        if not pieces or pieces[0].q8 is None:
            return sum(12 * (pc.end - pc.start) for pc in pieces)
        return sum(pc.master.nbytes + sum(t.nbytes for t in pc.q8) for pc in pieces)

    def moment(self, i: int, key: str) -> torch.Tensor:
        """Parameter i's CPU-stepped `key` ("exp_avg" or "exp_avg_sq"), decoded from 8 bits, in element order."""
        decode = compact.decode_exp_avg if key == "exp_avg" else compact.decode_exp_avg_sq
        codes = 0 if key == "exp_avg" else 2
        return torch.cat([decode(pc.q8[codes], pc.q8[codes + 1]) for _, pc in self.pieces_of[i]])

    def set_moments(self, i: int, exp_avg: torch.Tensor | None, exp_avg_sq: torch.Tensor | None) -> None:
        """Encodes parameter i's moments (flat, the whole parameter; None: fresh) into its 8-bit pieces."""
        for _, pc in self.pieces_of[i]:
            if exp_avg is None:
                for t in pc.q8:
                    t.zero_()
            else:
                encoded = compact.encode(exp_avg[pc.start : pc.end], exp_avg_sq[pc.start : pc.end])
                torch._foreach_copy_(pc.q8, list(encoded))

    def _make_alts(self) -> None:
        """Speculation's second state set: a twin of each flat state buffer, each piece at the same offset (so
        at the same place in a cache line: the kernel's streaming stores line up in both directions)."""
        if not self.chunks or self.chunks[0].pieces[0].alt is not None:
            return
        twins: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            for pc in chunk.pieces:
                pc.alt = []
                for t in (pc.master, pc.exp_avg, pc.exp_avg_sq):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in twins:
                        # zeros, not empty: every page is touched here, once, not by the first speculative kernel
                        # to write it (faulting pages in from 16 threads ran it 3-4x slower on an H200 host)
                        twins[storage.data_ptr()] = torch.zeros(storage.nbytes() // 4, dtype=torch.float32)
                        self.alt_bytes += storage.nbytes()
                    offset = t.storage_offset()
                    pc.alt.append(twins[storage.data_ptr()][offset : offset + t.numel()])

    def unflip(self, params: set[int] | None = None) -> None:
        """Copies the current state of flipped pieces (of `params`, else all) back to the first set (call while
        the worker does not step them: outside a step, or before a step's first download)."""
        if not self.alt_bytes:
            return  # never speculated: nothing is in a second set
        for chunk in self.chunks:
            for pc in chunk.pieces:
                if pc.flipped and (params is None or pc.param in params):
                    torch._foreach_copy_(pc.state(False), pc.state(True))
                    pc.flipped = False

    @property
    def last_scale(self) -> float | None:
        """The multiplier of this step (after ``finish()``: of the last step), once the worker has read it."""
        return self._scale

    @property
    def late_pending(self) -> bool:
        """A delayed step's weights have not gone up yet."""
        return bool(self._late_job)

    def flush(self, wait: bool = True) -> None:
        """Applies the pending late job: waits for its kernel, then uploads its weights (`wait`: the current
        stream sees them, else each chunk's ``uploaded`` event is left for ``wait()``). Call only where no saved
        activation needs the old weights: after backward, or outside a step."""
        if not self._late_job:
            return
        if self.streams.cuda:  # after every kernel queued so far (the backward that read the old weights)
            self.streams.h2d_stream.wait_stream(torch.cuda.current_stream(self.streams.device))
        with self._cond:
            self._late_safe = True  # from here on the worker uploads what it finishes
            finished, self._late_finished = self._late_finished, []
        for k in finished:
            if k in self._late_job:  # drop_late_for may have emptied it
                self._upload(k, self._late_job[k])
        with self._cond:
            self._wait_late_kernel()
            job, self._late_job = self._late_job, {}
            self._late, self._late_busy = [], set()
        if wait:
            for k in job:
                self.streams.compute_waits(self.chunks[k].uploaded)

    def drop_late_for(self, moved: set[int], why: str = "were written outside the optimizer") -> None:
        """Parameters written outside the optimizer keep those weights: their pending upload is dropped."""
        if not self._late_job or not any(pc.param in moved for live in self._late_job.values() for pc, _ in live):
            return
        log.warning("%d parameters %s while a delayed update was pending: they keep the new weights and that "
                    "step's CPU update is dropped (its moments stay); call synchronize() before writing weights "
                    "to keep it", len(moved), why)  # fmt: skip
        with self._cond:
            self._wait_late_kernel()
            for k in list(self._late_job):
                self._late_job[k] = [(pc, h) for pc, h in self._late_job[k] if pc.param not in moved]
                if not self._late_job[k]:
                    del self._late_job[k]

    def discard(self) -> None:
        """Drops the open step's gradients (an fp16 overflow): nothing is stepped or uploaded."""
        self.flush()  # a delayed step's weights still go up: this is after backward
        with self._cond:
            if self._args is not None and self._phase == "open":
                raise RuntimeError("cannot discard a step whose CPU updates have already started (eager mode)")
            self._ready = []
            self._done = [True] * len(self.chunks)
            self._phase = "sealed"
            self._cond.notify_all()
        self.streams.compute_after_downloads()
        self.finish()

    def wait(self, chunk_ids: list[int]) -> None:
        """The compute stream waits for these chunks' uploads (host-blocks only until each upload is queued)."""
        if (self._phase == "open" and self._args is not None and not self._spec
                and torch._C._current_graph_task_id() == -1):  # fmt: skip
            raise RuntimeError(
                "TwinFlowAdam: the model ran forward after backward but before step(), while the CPU share was "
                "already stepping (attach() is eager by default), so it would read weights the CPU is writing. "
                "Call step() first; with gradient accumulation, run every backward but the last of a window inside "
                "`with optimizer.no_sync():`; to run forwards between backward and step(), attach with eager=False"
            )
        if self._phase != "sealed":
            return  # nothing of a finished step is in flight (or this is a recompute during backward)
        todo = [k for k in chunk_ids if k not in self._waited]
        if not todo:
            return
        start = time.perf_counter()
        with self._cond:
            while not all(self._done[k] for k in todo) and self._error is None:
                self._cond.wait()
            self._raise_error()
        if self.timeline is not None:
            self.timeline.append({"wait": todo, "start": start, "end": time.perf_counter()})
        for k in todo:
            self.streams.compute_waits(self.chunks[k].uploaded)
            self._waited.add(k)

    def settle(self) -> None:
        """Every update taken so far, a delayed one included, is in the weights the current stream sees (and
        in the first state set)."""
        self.finish()
        self.flush()
        self.unflip()

    def settle_state(self, params: set[int] | None = None) -> None:
        """Every update taken so far is in the masters and moments of the first state set (of `params`, else
        all); a delayed one's weights may still be pending (uploading them could change weights a backward still
        needs)."""
        self.finish()
        with self._cond:
            self._wait_late_kernel()
        self.unflip(params)

    def _wait_late_kernel(self) -> None:
        """Until the late job's kernel is done (caller holds the lock); raises the worker's error."""
        while self._late_busy and self._error is None:
            self._cond.wait()
        self._raise_error()

    def finish(self) -> None:
        """Waits for every chunk of the step in flight; the compute stream then sees all uploaded weights."""
        if self._phase == "open":
            raise RuntimeError("TwinFlowAdam: gradients were streamed but step() was not called yet")
        self.wait(list(range(len(self.chunks))))
        with self._cond:
            self._raise_error()
            self._phase = "idle"

    def reset(self) -> None:
        """Forgets an open step's downloads (zero_grad before step); refused once CPU updates have started."""
        with self._cond:
            if self._phase != "open":
                return
            if self._spec:  # the held chunks are dropped: their current state is the one from before the step
                self._ready = []
                while self._running is not None and self._error is None:
                    self._cond.wait()
                self._raise_error()
                self._spec_held = []
            elif self._args is not None:
                raise RuntimeError(
                    "zero_grad() after the CPU share already stepped in backward (eager overlap): that update "
                    "cannot be undone. Call step() after backward, or attach with eager=False"
                )
            self._phase = "sealed"
            self._ready = []
            self._done = [True] * len(self.chunks)
        self.streams.compute_after_downloads()
        self.finish()

    def close(self) -> None:
        """Stops the worker after the chunk it is running, and waits for it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, ops.BuildError):  # its message names the missing tool and the fix
                raise error
            raise RuntimeError("TwinFlowAdam's CPU worker failed") from error

    # ---------------------------------------------------------- worker side
    def _start_worker(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="twinflow-cpu-adam", daemon=True)
            self._thread.start()
            _LIVE.add(self)

    def _work(self) -> None:
        if self.streams.cuda:
            torch.cuda.set_device(self.streams.device)
        while True:
            with self._cond:
                while not (self._stop or (self._args is not None and self._ready) or self._late
                           or (self._verdict is not None and self._spec_held)):  # fmt: skip
                    self._cond.wait()
                if self._stop:
                    return
                task = "verdict" if self._verdict is not None and self._spec_held else "late"
                if self._args is not None and self._ready and task != "verdict":
                    task = "chunk"
                if task == "verdict":
                    held, self._spec_held = self._spec_held, []
                    args, self._running = self._verdict, -1
                elif task == "late":
                    k = self._pick_late()
                    job, args = self._late_job[k], self._late_args
                else:
                    k = self._pick()
                    self._running = k
                    job = self._job(k)
                    spec_args = self._args if self._spec and self._verdict is None else None
                    args = self._verdict if self._spec and self._verdict is not None else self._args
            error, done = None, []
            try:
                if task == "verdict":
                    done = self._settle_held(held, args)
                elif task == "late":
                    self._late_scale = self._kernel(self._late_ready, job, args, self._late_scale)
                    with self._cond:
                        upload = self._late_safe
                        if not upload:  # flush() uploads it, once the next backward is done
                            self._late_finished.append(k)
                            self._late_busy.discard(k)
                    if upload:
                        self._upload(k, job)
                elif spec_args is not None:  # no verdict yet: multiplier 1, weights into the spare buffer, held
                    self._run_chunk(k, job, spec_args, speculative=True)
                    with self._cond:
                        self._spec_held.append(k)
                else:
                    self._run_chunk(k, job, args)
                    done = [k]
            except BaseException as exc:  # surfaced in the main thread at its next wait
                error = exc
                done = held if task == "verdict" else [k]
            with self._cond:
                self._error = error or self._error
                if task == "late":
                    self._late_busy.discard(k)
                else:
                    self._running = None
                    for j in done:
                        self._done[j] = True
                self._cond.notify_all()

    def _settle_held(self, held: list[int], verdict: StepArgs) -> list[int]:
        """The verdict on chunks stepped with multiplier 1: kept if it is 1 (and the hyper-parameters did not
        change), else stepped again with it from the state they started from; then uploaded. Returns them."""
        start = time.perf_counter()
        scale = verdict.scale() if callable(verdict.scale) else float(verdict.scale)
        self._scale = scale
        redo = scale != 1.0 or verdict.groups != self._args.groups
        self.speculated_chunks += len(held)
        if redo:
            self.rollbacks += 1
        for k in sorted(held):
            job = self._job(k)
            if redo:
                self._kernel(self.chunks[k].grad_ready, job, verdict, scale, spare=True, apart=True)
            for pc, _ in job:
                pc.flipped = not pc.flipped
            self._upload(k, [(pc, pc.spare) for pc, _ in job])
        if self.timeline is not None:
            self.timeline.append({"verdict": sorted(held), "redo": redo, "start": start, "end": time.perf_counter()})
        return held

    def _job(self, k: int) -> list[tuple[_Piece, torch.Tensor]]:
        return [(pc, pc.host) for pc in self.chunks[k].pieces if pc.param in self._down]

    def _upload(self, k: int, job: list[tuple[_Piece, torch.Tensor]]) -> None:
        with self.streams.h2d():
            torch._foreach_copy_([pc.dst for pc, _ in job], [h for _, h in job], non_blocking=True)
            self.chunks[k].uploaded.record(self.streams.h2d_stream)
        for pc, _ in job:  # the version our own write left: a later change means the weights moved outside
            self.written_version[pc.param] = self.params[pc.param]._version

    def _pick(self) -> int:
        """The lowest ready chunk whose gradients have landed, else the lowest ready one (caller holds the lock).

        The next forward needs low indices first; a chunk still in flight would
        make the worker wait while landed ones could run.
        """
        landed = [k for k in self._ready if self.chunks[k].grad_ready.query()]
        k = min(landed or self._ready)
        self._ready.remove(k)
        return k

    def _pick_late(self) -> int:
        """The lowest chunk of the late job (caller holds the lock)."""
        return self._late.pop(0)

    def _kernel(self, ready: object | None, job: list[tuple[_Piece, torch.Tensor]], args: StepArgs,
                scale: float | None, spare: bool = False, apart: bool = False) -> float:  # fmt: skip
        """Steps `job`'s pieces from the gradients in their host views (on the host once `ready`, an event, if
        given), leaving the weights there or in the spare buffer; the state in place, or (`apart`) from each
        piece's current set into its other one, the current left as it was. Returns the gradient multiplier
        (read from `args` unless known)."""
        if ready is not None:
            ready.synchronize()
        if scale is None:
            scale = args.scale() if callable(args.scale) else float(args.scale)
        by_group: dict[int, list[tuple[_Piece, torch.Tensor]]] = {}
        for pc, host in job:
            by_group.setdefault(self.group_of[pc.param], []).append((pc, host))
        for gi, group_job in by_group.items():
            g = args.groups[gi]
            group_pieces = [pc for pc, _ in group_job]
            hosts = [h for _, h in group_job]
            hyper = dict(lr=g["lr"], beta1=g["beta1"], beta2=g["beta2"], eps=g["eps"], weight_decay=g["weight_decay"],
                         adamw_mode=g["adamw_mode"], bias_correction=g["bias_correction"], grad_scale=scale,
                         num_threads=self.num_threads)  # fmt: skip
            if group_pieces[0].q8 is not None:  # 8-bit moments: in place, never speculative
                masters, m24 = compact.kernel_masters([pc.master for pc in group_pieces])
                ops.adam_step_q8_(masters, hosts, *zip(*(pc.q8 for pc in group_pieces)),
                                  [args.steps[pc.param] for pc in group_pieces], out_copies=hosts,
                                  index_bases=[pc.start for pc in group_pieces], **m24, **hyper)  # fmt: skip
                continue
            current = [pc.state(pc.flipped) for pc in group_pieces]
            written = [pc.state(not pc.flipped) for pc in group_pieces] if apart else current
            ops.adam_step_(
                [w[0] for w in written],
                hosts,
                [w[1] for w in written],
                [w[2] for w in written],
                [args.steps[pc.param] for pc in group_pieces],
                # in place (each gradient element is read before its weight is written), or into the spare buffer
                out_copies=[pc.spare for pc in group_pieces] if spare else hosts,
                sources=tuple([c[k] for c in current] for k in range(3)) if apart else None,
                **hyper,
            )
        return scale

    def _run_chunk(self, k: int, job: list[tuple[_Piece, torch.Tensor]], args: StepArgs,
                   speculative: bool = False) -> None:  # fmt: skip
        """Steps chunk k once its gradients are down and uploads it; `speculative`: with multiplier 1, out of
        place, the weights left in the spare buffer for the verdict."""
        chunk = self.chunks[k]
        pieces = [pc for pc, _ in job]
        picked = time.perf_counter()
        chunk.grad_ready.synchronize()
        start = time.perf_counter()
        if speculative:
            self._kernel(None, job, args, 1.0, spare=True, apart=True)
        else:
            self._scale = self._kernel(None, job, args, self._scale)  # the gradients are down: waited for above
        kernel_end = time.perf_counter()
        if not speculative:
            self._upload(k, job)
        if self.timeline is not None:
            elements = sum(pc.end - pc.start for pc in pieces)
            times = {"ready": self._ready_at[k], "picked": picked, "start": start, "kernel_end": kernel_end}
            self.timeline.append({"chunk": k, **times, "end": time.perf_counter(), "elements": elements,
                                  **({"speculative": True} if speculative else {})})  # fmt: skip
