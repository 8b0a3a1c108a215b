"""The order of a step, over both sides: the one object the optimizer and the attach() hooks talk to.

``StepCoordinator`` owns the split and its state (:class:`SplitState`), the CPU side that steps it
(:class:`HostSide`, or :data:`NO_HOST` without a CPU share), the step's gradient multiplier
(:class:`StepScale`), the speculation policy and the attachment's per-step notes (:class:`GradNotes`, or
a :class:`NoNotes` when not attached). The step's mode (exact, speculative, delayed) is chosen when it
opens; the null objects let ``step()`` read straight through.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from twinflow.base import distributed
from twinflow.host.host_side import NO_HOST, HostSide, NoHost
from twinflow.host.step_record import Phase, StepArgs, StepMode, Way
from twinflow.precision import state_precision as precisions
from twinflow.step.grad_notes import GradNotes, NoNotes
from twinflow.step.settings import Settings
from twinflow.step.speculation import SpeculationPolicy
from twinflow.step.split_state import SplitState, sparse_gradient_message, summary
from twinflow.step.step_scale import StepScale

log = logging.getLogger(__name__)


class StepCoordinator:
    """Builds the split, opens, seals and ends each step; the hooks' and the optimizer's one contact."""

    def __init__(self, groups: Callable[[], list[dict]], settings: Settings) -> None:
        self.groups, self.settings = groups, settings
        self.split = SplitState(groups(), settings.state_precision)
        self.host: HostSide | NoHost = NO_HOST
        self.scale = StepScale(self.split.device, self.split.mesh_group)
        this = weakref.ref(self)  # the policy reads the settings and the state's precision here, as they are now
        self.speculation = SpeculationPolicy(lambda: this().settings, lambda: this().split.precision)
        self.notes: GradNotes = NoNotes()
        self.on_build: list[Callable[[], None]] = []  # called after every build (the optimizer's state map, hooks)
        self.ratio: float | None = None
        self.summary: dict[str, Any] | None = None
        self.groups_added = False
        self.sync_gradients = True  # False inside no_sync(): gradients accumulate, nothing streams
        self.skipped_steps = 0  # fp16 steps with an inf/NaN gradient
        self.last_grad_norm: torch.Tensor | None = None

    # ------------------------------------------------------------- the split
    def build(self, ratio: float) -> dict[str, Any]:
        """Splits the parameters at `ratio` and creates their state (fresh) and the CPU side."""
        s, split = self.settings, self.split
        self.ratio = ratio
        split.build(ratio, s.placement, s.chunk_bytes)
        if split.host is not None:
            this = weakref.ref(self)
            self.host = HostSide(split.locals, split.group_of, split.host, split.device,
                                 lambda: getattr(this(), "settings", s).num_threads, split.versions.note)  # fmt: skip
            weakref.finalize(split, self.host.close)
        else:
            self.host = NO_HOST
        split.writer = self.host
        self.summary = summary(split, ratio, s.placement, self.host.pinned_bytes, self.host.chunk_count)
        log.info("TwinFlowAdam split: %s", self.summary)
        for listener in self.on_build:
            listener()
        return self.summary

    def rebuild_if_needed(self) -> bool:
        """A new split, keeping every stepped parameter's state (converted to the precision set), once groups were
        added, a frozen parameter unfrozen, or ``state_precision``, ``placement`` or ``chunk_bytes`` changed (not
        while a step is open, nor before ratio='auto' has built the first one)."""
        old, old_host, s = self.split, self.host, self.settings
        changed = (self.groups_added or old.needs_rebuild() or old.precision != precisions.of(s.state_precision)
                   or old.layout != (s.placement, s.chunk_bytes))  # fmt: skip
        if self.ratio is None or old.step_open or not changed:
            return False
        self.synchronize()
        self.split, self.groups_added = SplitState(self.groups(), self.settings.state_precision), False
        self.scale.mesh_group = self.split.mesh_group
        self.build(self.ratio)
        self.split.take_over(old)  # reads the old state before its CPU side closes
        old_host.close()
        return True

    def update(self, **changes: Any) -> None:
        """New settings from the next step on: a new ``state_precision``, ``placement`` or ``chunk_bytes``
        rebuilds the state so at the next step (converted, kept); the rest is read where it acts."""
        self.settings = dataclasses.replace(self.settings, **changes)

    def attach(self, notes: GradNotes) -> None:
        self.notes = notes
        self.speculation.attach(True, notes.eager, notes.fp16)

    def detach(self) -> None:
        self.synchronize()
        self.notes = NoNotes()
        self.speculation.attach(False)

    # ------------------------------------------------------------- a step
    def step_args(self) -> StepArgs:
        """The coming step's arguments (hyper-parameters checked; in-place writes to step counts counted)."""
        self.split.absorb_edits()
        return StepArgs.of(self.groups(), [s + 1 for s in self.split.steps])

    def mode(self, speculative: bool) -> StepMode:
        """The coming step's mode (the weights-first policy asked once, where it could apply)."""
        if not speculative and self.split.delaying(self.settings.delay_after):
            return StepMode(Way.DELAYED)
        # weights first where the step waits for its multiplier (not eager): the exact step, or speculation's redo
        first = (self.settings.weights_first and not self.notes.eager and self.host.chunk_count > 0
                 and self.host.weights_first.choose())  # fmt: skip
        if speculative:
            return StepMode(Way.SPECULATIVE, redo_weights_first=first)
        return StepMode(Way.WEIGHTS_FIRST if first else Way.EXACT)

    def open_step(self, args: StepArgs | None, mode: StepMode) -> None:
        """A step's first gradient is about to go down (`args`: the worker may start at once)."""
        self.host.open(args, mode)  # waits for the last step's writes: the masters are settled
        self.split.absorb_edits(during_step=True)  # before any gradient lands: the worker has not started
        moved = self.split.versions.moved()
        if moved:
            self.host.drop_late_for(moved)  # a delayed update must not overwrite the new weights
            self.split.refresh_masters(moved)
        self.scale.forget_norms()
        self.notes.open_step()

    def stream(self, i: int, grad: torch.Tensor) -> None:
        """Parameter i's final (reduced) gradient goes down to the CPU share; the first of a step opens it."""
        notes = self.notes
        with notes.lock:
            if self.host.phase is not Phase.OPEN:

                def last_scale() -> float | None:
                    self.host.finish()  # the last step's multiplier is known once its chunks are done
                    return self.host.last_scale

                # not while a delayed update is pending: its weights still sit in the set speculation writes
                spec = not notes.eager and self.speculation.speculate(
                    self.split.delaying(self.settings.delay_after) or self.host.late_pending, last_scale)  # fmt: skip
                self.open_step(self.step_args() if notes.eager or spec else None, self.mode(spec))
        if not notes.eager:
            self.scale.add_norm(i, grad)
        self.host.download(i, grad)
        notes.streamed.add(i)

    def step(self, args: StepArgs) -> None:
        """One step on both sides with `args` (the device side's work queued in stream order)."""
        split, host, notes = self.split, self.host, self.notes
        if host.phase is not Phase.OPEN:
            self.open_step(None, self.mode(False))
        with_grad = self.with_grad(notes.streamed)
        notes.check_grads_untouched(with_grad, split.params)
        fp16 = any(split.params[i].dtype == torch.float16 for i in with_grad)
        if fp16 and self.scale.overflow(self.grads_on_device(), bool(notes.streamed)):
            log.warning("inf/NaN gradient in an fp16 model: step skipped on both sides")
            self.skipped_steps += 1
            host.discard()
            self.end_step()
            return
        if self.settings.max_grad_norm is not None and not self.scale.clipped:
            self.last_grad_norm = self.clip(self.settings.max_grad_norm, 2.0)
        args = host.seal(args, self.scale.for_cpu)  # under eager overlap, the arguments the CPU stepped with
        self.step_device(with_grad, args.groups)
        if not notes.attached:
            host.finish()
        elif notes.unwaited:
            host.wait(notes.unwaited)
        self.end_step()

    def with_grad(self, streamed: set[int]) -> list[int]:
        """The parameters this step updates: those with a gradient, and those whose gradient already streamed.

        Refuses (before anything is stepped) a gradient on a parameter frozen when the split was made, and
        sparse gradients; then sends down the CPU share's gradients not streamed yet.
        """
        split = self.split
        with_grad = [i for i, p in enumerate(split.params) if p.grad is not None or i in streamed]
        unplanned = [i for i in with_grad if i not in split.planned]
        if unplanned:  # only reachable under attach(): a frozen parameter was unfrozen during this iteration
            raise RuntimeError(
                f"parameter {unplanned[0]} has a gradient but was frozen when TwinFlowAdam split the parameters; "
                "unfreeze parameters before the forward pass (the split is rebuilt there)"
            )
        for i in with_grad:
            g = split.params[i].grad
            if g is not None and g.is_sparse:
                self.host.reset()
                name = f" ({split.names[i]!r})" if split.names[i] else ""
                raise TypeError(sparse_gradient_message(f"parameter {i}{name}"))
        for i in with_grad:
            if i in self.host.chunks_of and not self.host.downloaded(i):
                self.host.download(i, distributed.local(split.params[i].grad))
        return with_grad

    def grads_on_device(self) -> list[torch.Tensor]:
        """The gradients still on the device: every one but those streamed to the host in backward."""
        streamed = self.notes.streamed
        grads = [p.grad for i, p in enumerate(self.split.params) if i not in streamed]
        return [distributed.local(g) for g in grads if g is not None]

    def step_device(self, with_grad: list[int], groups: list[dict[str, Any]]) -> None:
        """Launches the device side's step of `with_grad`, and counts the step of each."""
        split = self.split
        stepped = split.device_state.stepped(set(with_grad))
        split.device_state.step(stepped, groups, split.group_of, lambda i: distributed.local(split.params[i].grad),
                                self.scale.coef)  # fmt: skip
        for st in stepped:
            split.versions.note(st.seg.index)
        split.counted(with_grad)

    def end_step(self) -> None:
        self.scale.reset()
        self.notes.end_step()

    # ------------------------------------------------------- between steps
    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The coming step's gradients, both sides, clipped by one global norm; returns the norm."""
        streamed = self.notes.streamed
        return self.scale.clip(max_norm, norm_type, self.grads_on_device(), bool(streamed))

    def zero_grad(self) -> None:
        """Gradients already streamed for a step not taken are forgotten, with the step's multiplier."""
        try:
            if self.split.step_open:
                self.host.reset()
        finally:
            self.end_step()

    def synchronize(self) -> None:
        self.split.settle()

    def weights_changed(self) -> None:
        """Every weight counts as changed outside the optimizer: masters follow at the next step, and a delayed
        update not applied yet is dropped, not written over the new weights."""
        if not self.split.step_open:
            self.host.finish()
            self.host.drop_late_for(set(self.host.chunks_of), "were changed (weights_changed())")
        self.split.versions.forget()

    def wait(self, chunk_ids: list[int]) -> None:
        """The compute stream waits for these chunks' weights (a forward pre-hook)."""
        self.host.wait(chunk_ids)
