"""The device side of TwinFlowAdam: torch's fused Adam over fp32 masters, per param group, in bounded batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from twinflow.base.partition import Segment
from twinflow.precision import state_precision as precisions
from twinflow.precision.state_owner import RawPart

UPCAST_ELEMENTS = 1 << 26  # bf16/fp16 gradients are upcast to fp32 at most this many at a time (256 MiB)


@dataclass
class SegmentState:
    """A device-side segment's optimizer state."""

    seg: Segment
    master: torch.Tensor  # fp32; a float32 parameter's own elements
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    device_step: torch.Tensor  # the fused kernel's step counter


def new_state(seg: Segment, flat: torch.Tensor) -> SegmentState:
    """A device-side segment's fresh state; `flat` is the parameter's elements [start, end).

    A float32 parameter is its own master (the fused kernel updates it in
    place); bf16/fp16 parameters get an fp32 copy and receive the rounded result.
    """
    master = flat if flat.dtype == torch.float32 else flat.float()
    step = torch.zeros((), dtype=torch.float32, device=flat.device)
    return SegmentState(seg, master, torch.zeros_like(master), torch.zeros_like(master), step)


class DeviceState:
    """The device side's masters, moments and step counters, per segment: the only owner of those tensors. A
    :class:`twinflow.precision.state_owner.StateOwner` in fp32."""

    precision = precisions.FP32

    def __init__(self, segments: list[Segment], weights: list[torch.Tensor]) -> None:
        self.weights = weights
        self.states = [new_state(seg, weights[seg.index].view(-1)[seg.start : seg.end]) for seg in segments]
        self.of = {st.seg.index: st for st in self.states}

    def holds(self, i: int) -> bool:
        return i in self.of

    def range(self, i: int) -> tuple[int, int]:
        """The elements [start, end) of parameter i that step on the device."""
        seg = self.of[i].seg
        return seg.start, seg.end

    def view(self, i: int, key: str) -> torch.Tensor:
        """Parameter i's device elements of `key` (live)."""
        return getattr(self.of[i], key)

    def read(
        self, i: int, key: str, out: torch.Tensor | None = None, lo: int = 0, hi: int | None = None
    ) -> torch.Tensor:
        """Parameter i's device elements of `key` (or [lo, hi) of them): the live view, or copied into `out` if
        given."""
        view = self.view(i, key)[lo:hi]
        return view if out is None else out.copy_(view)

    def raw(self, i: int) -> list[RawPart]:
        """Refused: fp32 state keeps no codes (:meth:`read` and :meth:`view` give it as kept)."""
        raise ValueError("the device share's state is fp32: it keeps no codes; read() it instead")

    def master_is_weight(self, i: int) -> bool:
        st = self.of[i]
        w = self.weights[i]
        return st.master.data_ptr() == w.data_ptr() + st.seg.start * w.element_size()

    @torch.no_grad()
    def write(self, i: int, values: dict[str, torch.Tensor | None]) -> None:
        """Sets `values` (flat over parameter i's device elements; a moment None: fresh)."""
        st = self.of[i]
        for key, value in values.items():
            if key == "master" and self.master_is_weight(i):
                continue  # a float32 parameter is its own master
            target = getattr(st, key)
            target.copy_(value) if value is not None else target.zero_()

    def set_step(self, i: int, steps: int) -> None:
        if i in self.of:
            self.of[i].device_step.fill_(steps)

    @property
    def state_bytes(self) -> int:
        """The masters and moments: 12 bytes an element (a float32 parameter's master counted, though it is the
        parameter itself)."""
        return 12 * sum(st.seg.numel for st in self.states)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this side owns (a float32 parameter that is its own master excepted: it is a weight)."""
        return [t for st in self.states for t in (st.master, st.exp_avg, st.exp_avg_sq, st.device_step)
                if t is not st.master or not self.master_is_weight(st.seg.index)]  # fmt: skip

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> DeviceState:
        """The same state over `fn(t)` for every tensor t it holds, the weights included (``offload_states()``:
        host views of the moved bytes)."""
        other = DeviceState.__new__(DeviceState)
        other.weights = [fn(w) for w in self.weights]
        other.states = [SegmentState(st.seg, fn(st.master), fn(st.exp_avg), fn(st.exp_avg_sq), fn(st.device_step))
                        for st in self.states]  # fmt: skip
        other.of = {st.seg.index: st for st in other.states}
        return other

    def stepped(self, with_grad: set[int]) -> list[SegmentState]:
        return [st for st in self.states if st.seg.index in with_grad]

    def step(self, states: list[SegmentState], groups: list[dict[str, Any]], group_of: list[int],
             grad_of: Callable[[int], torch.Tensor], scale: torch.Tensor | None) -> None:  # fmt: skip
        """Launches the step of `states` (:func:`step`)."""
        step(states, groups, group_of, self.weights, grad_of, scale)


def step(
    states: list[SegmentState],
    groups: list[dict[str, Any]],
    group_of: list[int],
    weights: list[torch.Tensor],
    grad_of: Callable[[int], torch.Tensor],
    scale: torch.Tensor | None,
) -> None:
    """Launches the step of `states` (stream order; no host synchronisation).

    `groups` holds the step's hyper-parameters per param group (``StepArgs``'
    layout), `weights[i]` parameter i as this process holds it, `grad_of(i)`
    its gradient, and `scale` the multiplier every gradient gets (clipping,
    unscaling) or None. bf16/fp16 gradients are upcast at most
    ``UPCAST_ELEMENTS`` at a time (a large segment is cut into several
    batches), so the temporary memory stays bounded.
    """
    by_group: dict[int, list[SegmentState]] = {}
    for st in states:
        by_group.setdefault(group_of[st.seg.index], []).append(st)
    limit = UPCAST_ELEMENTS
    for gi, group_states in by_group.items():
        torch._foreach_add_([st.device_step for st in group_states], 1)  # the kernels read the new step
        batch: list[tuple[SegmentState, int, int]] = []
        upcast = 0
        for st in group_states:
            low = weights[st.seg.index].dtype != torch.float32
            size = limit if low else st.seg.numel
            for a in range(0, st.seg.numel, size):
                b = min(st.seg.numel, a + size)
                if batch and low and upcast + b - a > limit:
                    _step_batch(groups[gi], batch, weights, grad_of, scale)
                    batch, upcast = [], 0
                batch.append((st, a, b))
                upcast += b - a if low else 0
        if batch:
            _step_batch(groups[gi], batch, weights, grad_of, scale)


def _step_batch(
    group: dict[str, Any],
    pieces: list[tuple[SegmentState, int, int]],
    weights: list[torch.Tensor],
    grad_of: Callable[[int], torch.Tensor],
    scale: torch.Tensor | None,
) -> None:
    """Elements [a, b) of each segment: upcast gradients, scale, fused Adam, rounded copy back."""
    grads, masters, exp_avgs, exp_avg_sqs, steps, low = [], [], [], [], [], []
    for st, a, b in pieces:
        p = weights[st.seg.index]
        g = grad_of(st.seg.index).reshape(-1)[st.seg.start + a : st.seg.start + b]
        grads.append(g if g.dtype == torch.float32 else g.float())
        masters.append(st.master[a:b])
        exp_avgs.append(st.exp_avg[a:b])
        exp_avg_sqs.append(st.exp_avg_sq[a:b])
        steps.append(st.device_step)
        if p.dtype != torch.float32:
            low.append((p.view(-1)[st.seg.start + a : st.seg.start + b], masters[-1]))
    if scale is not None:
        torch._foreach_mul_(grads, scale)
    if group["bias_correction"]:
        fused = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
        fused(
            masters, grads, exp_avgs, exp_avg_sqs, [], steps,
            lr=group["lr"], beta1=group["beta1"], beta2=group["beta2"], weight_decay=group["weight_decay"],
            eps=group["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip
    else:
        _adam_no_bias_correction(masters, grads, exp_avgs, exp_avg_sqs, group)
    if low:
        torch._foreach_copy_([dst for dst, _ in low], [m for _, m in low])


def _adam_no_bias_correction(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    group: dict[str, Any],
) -> None:
    """Adam/AdamW without bias correction (torch's fused kernels always correct); `group` as ``StepArgs``'."""
    beta1, beta2 = group["beta1"], group["beta2"]
    lr, wd = group["lr"], group["weight_decay"]
    if wd != 0:
        if group["adamw_mode"]:
            torch._foreach_mul_(params, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr)
