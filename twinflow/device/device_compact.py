"""The device share's optimizer state in a compact precision (``state_precision`` "int8" or "int8_m24").

The moments are the CPU kernel's 8-bit codes with a scale per block of :data:`twinflow.precision.compact.BLOCK`
elements, the blocks counted from each segment's first element (a multiple of the block in the parameter, as the
CPU's pieces start: :func:`twinflow.base.partition.split` and :func:`twinflow.host.staging.plan_chunks` are given
the block as their alignment), so an element's block is the same on either side and state moves between the sides (a
new ratio, a checkpoint) without being quantised again. The master takes one of three forms, chosen per segment when
the state is made:

- a float32 parameter is its own master;
- a bfloat16 parameter under "int8_m24" keeps a 24-bit master as the weight itself, rounded to the nearest,
  plus a signed residual byte (:mod:`twinflow.precision.weight_master`): 3 bytes of state an element;
- otherwise (bfloat16 under "int8", float16) a float32 master beside the weight.

The step is :mod:`twinflow.precision.compact_step`'s float32 operations: on a GPU as one Triton kernel a segment
(:mod:`twinflow.device.compact_triton`), elsewhere as torch operations, one pass per batch of :data:`BATCH` elements
(where tests compare it with the CPU kernel); the same rounding noise as the CPU kernel, from the element's index in its
parameter and the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from twinflow.base.partition import Segment
from twinflow.device import compact_triton
from twinflow.precision import compact, compact_step, weight_master
from twinflow.precision import state_precision as precisions
from twinflow.precision.state_owner import FP32, RESIDUAL, WEIGHT, RawPart
from twinflow.precision.state_precision import StatePrecision

log = logging.getLogger(__name__)
BATCH = 1 << 24  # elements a step, a read or a write handles at once: a multiple of the block (bounded scratch)
F32 = torch.float32
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class CompactSegment:
    """A device-side segment's compact state; `weight` is the parameter's elements [start, end)."""

    seg: Segment
    weight: torch.Tensor
    master: torch.Tensor | None  # float32 master beside the weight; None: the weight holds it (with `residual`)
    residual: torch.Tensor | None  # int8: a bfloat16 weight's 24-bit master under "int8_m24"
    codes: list[torch.Tensor] = field(default_factory=list)  # exp_avg codes, scales, exp_avg_sq codes, scales
    count: int = 0  # steps taken: the bias correction's and the rounding noise's

    def batches(self, size: int | None = BATCH) -> list[tuple[int, int]]:
        """[a, b) ranges of at most `size` elements (a multiple of the block; None: the whole segment) covering
        the segment."""
        return compact.spans(self.seg.numel, size or max(self.seg.numel, 1))

    def codes_of(self, a: int, b: int) -> list[torch.Tensor]:
        """The codes and block scales of elements [a, b) (a at a block's start)."""
        lo, hi = a // compact.BLOCK, compact.blocks(b)
        return [self.codes[0][a:b], self.codes[1][lo:hi], self.codes[2][a:b], self.codes[3][lo:hi]]

    def master_of(self, a: int, b: int) -> torch.Tensor:
        """The float32 masters of elements [a, b) (a view where float32 is kept)."""
        if self.residual is not None:
            return weight_master.decode(self.weight[a:b].to(self.residual.device), self.residual[a:b])
        return (self.master if self.master is not None else self.weight)[a:b]


def new_segment(seg: Segment, flat: torch.Tensor, precision: StatePrecision) -> CompactSegment:
    """A segment's fresh state: masters from the weights `flat` (its elements), moments zero."""
    residual = master = None
    if precision.weight_is_master(flat.dtype):
        residual = torch.zeros(seg.numel, dtype=torch.int8, device=flat.device)  # the weight is the master
    elif flat.dtype != F32:
        master = flat.float()
    codes = compact.fresh(seg.numel, flat.device)  # made where they live: no host zeros, no copy
    return CompactSegment(seg, flat, master, residual, codes)


def step_functions(device: torch.device) -> tuple[Callable, Callable, int | None]:
    """The two steps (residual form, float32 master) for `device` and the elements a call steps at most: the Triton
    kernel on a GPU (:mod:`twinflow.device.compact_triton`), which needs no scratch and steps a segment in one
    launch (None), torch's operations elsewhere, :data:`BATCH` elements a call (the CPU suite checks those against
    the kernel, the interpreter's run of the Triton kernel against them, and the GPU suite the kernel on a GPU
    against the CPU). A GPU without Triton steps eagerly, many times slower, and says so once."""
    if compact_triton.available(device):
        return compact_triton.residual_step_, compact_triton.master_step_, None
    if device.type == "cuda":
        log.warning("Triton is not installed: the compact device step runs as torch operations, many times slower; "
                    "install the Triton that matches this torch (pip install triton)")  # fmt: skip
    return compact_step.residual_step_, compact_step.master_step_, BATCH


def _plain(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors detached: the same memory, out of autograd's sight."""
    return [t.detach() for t in tensors]


class CompactDeviceState:
    """The device side's compact masters, moments and step counts, per segment: the only owner of those tensors. A
    :class:`twinflow.precision.state_owner.StateOwner`."""

    def __init__(self, segments: list[Segment], weights: list[torch.Tensor], precision: StatePrecision | str) -> None:
        self.precision = precision = precisions.of(precision)
        self.weights = weights
        self.states = [new_segment(seg, weights[seg.index].view(-1)[seg.start : seg.end], precision)
                       for seg in segments]  # fmt: skip
        self.of = {st.seg.index: st for st in self.states}
        device = weights[segments[0].index].device if segments else torch.device("cpu")
        self.device = device
        self.residual_step, self.master_step, self.step_batch = step_functions(device)

    @property
    def state_bytes(self) -> int:
        """Device memory of the masters beside the weights, the residuals and the moments."""
        return sum(t.nbytes for t in self.tensors())

    def holds(self, i: int) -> bool:
        return i in self.of

    def range(self, i: int) -> tuple[int, int]:
        """The elements [start, end) of parameter i that step on the device."""
        seg = self.of[i].seg
        return seg.start, seg.end

    def view(self, i: int, key: str) -> torch.Tensor | None:
        """A live float32 view of parameter i's device elements of `key`, where one is kept (a float32 master),
        else None."""
        st = self.of[i]
        if key != "master" or st.residual is not None:
            return None
        return st.master if st.master is not None else st.weight

    def raw(self, i: int) -> list[RawPart]:
        """Parameter i's device state as kept, one part (live: codes, block scales, the master in its form), for a
        checkpoint to copy out or in unchanged."""
        st = self.of[i]
        if st.residual is not None:
            kind, tensors = RESIDUAL, (st.weight, st.residual)
        else:
            kind, tensors = (FP32, (st.master,)) if st.master is not None else (WEIGHT, (st.weight,))
        return [RawPart(st.seg.start, st.seg.end, st.codes, kind, tensors, st.weight)]

    def master_is_weight(self, i: int) -> bool:
        st = self.of[i]
        return st.master is None and st.residual is None

    @torch.no_grad()
    def read(
        self, i: int, key: str, out: torch.Tensor | None = None, lo: int = 0, hi: int | None = None
    ) -> torch.Tensor:
        """A float32 copy, in host memory (into `out` if given), of parameter i's device elements of `key` (or
        [lo, hi) of them), decoded a batch at a time (the device holds one batch of float32 at most)."""
        st = self.of[i]
        hi = st.seg.numel if hi is None else hi
        out = torch.empty(hi - lo, dtype=F32) if out is None else out
        for a, b in st.batches(compact.COPY_ELEMENTS):  # small batches: decoding's int64 scratch stays bounded
            x, y = max(a, lo), min(b, hi)  # the part of this batch asked for
            if x >= y:
                continue
            codes = st.codes_of(a, b)
            if key == "master":
                part = st.master_of(a, b)
            elif key == "exp_avg":
                part = compact.decode_exp_avg(codes[0], codes[1])
            else:
                part = compact.decode_exp_avg_sq(codes[2], codes[3])
            out[x - lo : y - lo].copy_(part[x - a : y - a])
        return out

    @torch.no_grad()
    def write(self, i: int, values: dict[str, torch.Tensor | None]) -> None:
        """Sets `values` (flat over parameter i's device elements; a moment None: fresh), encoded to the nearest
        code a batch at a time. A master also sets the weight where the weight holds it."""
        st = self.of[i]
        for a, b in st.batches(compact.COPY_ELEMENTS):  # small batches: encoding's int64 scratch stays bounded
            if "master" in values and not self.master_is_weight(i):
                master = values["master"][a:b].to(self.device, F32)
                if st.residual is not None:
                    weight, residual = weight_master.split(*compact.encode_master(master))
                    st.weight[a:b].copy_(weight)
                    st.residual[a:b].copy_(residual)
                else:
                    st.master[a:b].copy_(master)
            present = [key for key in MOMENTS if key in values]
            if not present:
                continue
            codes = st.codes_of(a, b)
            if len(present) == 2 and values["exp_avg"] is None and values["exp_avg_sq"] is None:
                for t in codes:
                    t.zero_()
                continue
            both = []
            for key in MOMENTS:
                if key not in values:  # the moments are encoded together: the other one as it is
                    both.append(compact.decode_exp_avg(codes[0], codes[1]) if key == "exp_avg"
                                else compact.decode_exp_avg_sq(codes[2], codes[3]))  # fmt: skip
                elif values[key] is None:
                    both.append(torch.zeros(b - a, dtype=F32, device=self.device))
                else:
                    both.append(values[key][a:b].to(self.device, F32))
            for target, value in zip(codes, compact.encode(*both)):
                target.copy_(value)

    def set_step(self, i: int, steps: int) -> None:
        if i in self.of:
            self.of[i].count = steps

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this side owns (not the weights, which hold masters in part)."""
        return [t for st in self.states for t in (st.master, st.residual, *st.codes) if t is not None]

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> CompactDeviceState:
        """The same state over `fn(t)` for every tensor t it holds, the weights included, its arithmetic where
        the codes are (``offload_states()``: host views of the moved bytes)."""
        other = CompactDeviceState.__new__(CompactDeviceState)
        other.precision, other.weights = self.precision, [fn(w) for w in self.weights]
        # on the host where the codes moved; where they stayed (only the gradients moved), on the device
        other.device = fn(self.states[0].codes[0]).device if self.states else self.device
        other.states = [replace(st, weight=fn(st.weight), master=None if st.master is None else fn(st.master),
                                residual=None if st.residual is None else fn(st.residual),
                                codes=[fn(c) for c in st.codes]) for st in self.states]  # fmt: skip
        other.of = {st.seg.index: st for st in other.states}
        other.residual_step, other.master_step, other.step_batch = step_functions(other.device)
        return other

    def stepped(self, with_grad: set[int]) -> list[CompactSegment]:
        return [st for st in self.states if st.seg.index in with_grad]

    @torch.no_grad()
    def step(self, states: list[CompactSegment], groups: list[dict[str, Any]], group_of: list[int],
             grad_of: Callable[[int], torch.Tensor], scale: torch.Tensor | None) -> None:  # fmt: skip
        """Launches the step of `states` (stream order; no host synchronisation): per param group, one copy of
        the batches' constants and noise keys to the device, then one fused pass per batch. Every tensor reaches
        the step detached, and the multiplier always as a float32 tensor (1 where there is none: a multiplication
        by 1 keeps every bit)."""
        scale = torch.ones((), dtype=F32, device=self.device) if scale is None else scale.detach().to(F32)
        by_group: dict[int, list[CompactSegment]] = {}
        for st in states:
            by_group.setdefault(group_of[st.seg.index], []).append(st)
        for gi, group_states in by_group.items():
            hyper, work, consts, meta = groups[gi], [], [], []
            per_count: dict[int, tuple[list[float], int]] = {}  # the segments of a group mostly share their count
            for st in group_states:
                st.count += 1
                if st.count not in per_count:
                    per_count[st.count] = compact_step.constant_values(st.count, hyper), compact.key(st.count)
                values, key = per_count[st.count]
                grad = grad_of(st.seg.index).reshape(-1)[st.seg.start : st.seg.end]
                for a, b in st.batches(self.step_batch):
                    work.append((st, a, b, grad[a:b]))
                    consts.append(values)
                    meta.append([st.seg.start + a, key])
            c_all, meta_all = self.to_device(torch.tensor(consts, dtype=F32)), self.to_device(torch.tensor(meta))
            l2 = compact_step.uses_l2(hyper)
            for k, (st, a, b, grad) in enumerate(work):
                codes, c, m = _plain(st.codes_of(a, b)), c_all[k].detach(), meta_all[k].detach()
                if st.residual is not None:
                    self.residual_step(*_plain([st.weight[a:b], st.residual[a:b], grad]), codes, c, scale, m, l2)
                else:
                    master, weight_out = _plain([st.master_of(a, b), st.weight[a:b]])
                    self.master_step(master, weight_out if st.master is not None else None, grad.detach(), codes, c,
                                     scale, m, l2)  # fmt: skip

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the device without waiting for the device (pinned, copied asynchronously)."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)
