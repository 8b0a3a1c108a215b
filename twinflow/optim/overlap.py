"""TwinFlowAdam.attach(): the hooks that overlap the CPU share with backward and the next forward.

- Each CPU-owned gradient is copied to the host as soon as backward has
  finished it (a post-accumulate-grad hook), and may be released.
- Each module that owns CPU-stepped parameters waits, in a forward pre-hook,
  for the chunks holding its weights; under torch.compile that wait is a graph
  break, and dynamo is made to guard on module hooks.
- Gradients changed after backward (an outside ``clip_grad_norm_``) are
  detected at ``step()``: they cannot reach what already streamed.

Hook objects hold the optimizer; a copy of the model (deepcopy, pickle) gets
inert ones, since the copy is not attached.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

import torch

from twinflow.base import distributed
from twinflow.step.coordinator import StepCoordinator
from twinflow.step.grad_notes import GradNotes
from twinflow.step.split_state import SplitState, sparse_gradient_message

log = logging.getLogger(__name__)


def resolve(split: SplitState, model: torch.nn.Module, needs_all_grads: bool, release_grads: bool,
            eager: bool | None) -> GradNotes:  # fmt: skip
    """Checks `model` for attach() and resolves, once, how its steps run; returns the notes they keep."""
    fp16 = any(p.dtype == torch.float16 for p in split.params)
    needs_all_grads = needs_all_grads or fp16
    if eager is None:
        eager = not needs_all_grads
    elif eager and needs_all_grads:
        raise ValueError(
            "eager=True cannot be combined with max_grad_norm, delay_after or fp16 parameters: each needs "
            "every gradient before any update; leave eager unset"
        )
    ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    # FSDP2 runs the post-accumulate-grad hooks of its sharded parameters after each reduce-scatter, with the
    # reduced shard as the gradient: those stream as on one GPU.
    if ddp is not None and (ddp.find_unused_parameters or ddp.static_graph):
        # DDP reduces a zero gradient for a parameter a step did not use, and leaves its .grad None: streamed,
        # it would be stepped (weight decay, moments) where AdamW skips it.
        raise ValueError(
            "TwinFlowAdam.attach() got a DistributedDataParallel model with find_unused_parameters=True or "
            "static_graph=True: its buckets carry zeros for the parameters a step did not use, which attach() "
            "cannot tell from real gradients. Use neither, or TwinFlowAdam without attach() (exact either way)"
        )
    sparse = [
        n or "the model"
        for n, m in model.named_modules()
        if getattr(m, "sparse", False) is True and any(p.requires_grad for p in m.parameters(False))
    ]
    if sparse:  # refused before any backward: a sparse gradient found in one would leave a step half taken
        raise TypeError(sparse_gradient_message(f"module {sparse[0]!r} (sparse=True)"))
    fsdp = distributed.is_fully_sharded(model)
    if distributed.multi_process() and ddp is None and not fsdp:
        raise RuntimeError(
            "TwinFlowAdam.attach() on several processes takes the DistributedDataParallel model itself "
            "(opt.attach(ddp_model)) or the root fully_shard (FSDP2) model: gradients then stream once they "
            "are reduced. ZeroRedundancyOptimizer is not supported under attach(): use TwinFlowAdam "
            "without attach() there (step() runs after the reduction)"
        )
    return GradNotes(eager, release_grads, fp16, ddp is not None, fsdp)


class Attachment:
    """One attach() of a model to a coordinator: its hooks (their only owner). They talk to the coordinator
    through its public protocol: ``stream``, ``wait``, ``rebuild_if_needed``, ``synchronize``."""

    def __init__(self, coordinator: StepCoordinator, model: torch.nn.Module) -> None:
        self.coordinator, self.model = coordinator, model
        self.ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        self.handles: list[Any] = []

    def install(self) -> None:
        """Registers the hooks for the coordinator's current split (again after it is rebuilt)."""
        self.remove()
        c, model = self.coordinator, self.model
        split, host, notes = c.split, c.host, c.notes
        if not host.chunks_of:
            return
        trainable = sorted(i for i in split.planned if split.params[i].requires_grad)
        notes.choose_witness(trainable, split.fully_cpu, {i: split.locals[i].numel() for i in trainable})
        if self.ddp is not None:  # DDP's communication hook streams the CPU share; the witness is its copy
            reduced_buckets(self.ddp).attachment = self
        for i in trainable if self.ddp is None else ():
            hook = _OnGrad(self) if i in host.chunks_of else _NoteGrad(self)
            self.handles.append(split.params[i].register_post_accumulate_grad_hook(hook))
        # A module's pre-hook waits for its own parameters and its direct children's: modules such as
        # nn.MultiheadAttention read a child's weight without calling the child, and containers
        # (ParameterList) have no forward of their own. Coverage is counted per parameter.
        covered: set[int] = set()
        if notes.fsdp:  # FSDP2 gathers its next modules' weights ahead, on its own streams: all before the root's
            all_chunks = list(range(host.chunk_count))
            self.handles.append(model.register_forward_pre_hook(WaitBeforeGather(c, all_chunks), prepend=True))
            covered = set(host.chunks_of)
        for module in model.modules() if not notes.fsdp else ():
            owned = list(module.parameters(recurse=False))
            for child in module.children():
                owned += list(child.parameters(recurse=False))
            indices = {split.index[id(p)] for p in owned if split.index.get(id(p)) in host.chunks_of}
            if indices:
                covered |= indices
                chunk_ids = sorted({k for i in indices for k in host.chunks_of[i]})
                self.handles.append(module.register_forward_pre_hook(WaitFor(c, chunk_ids)))
        uncovered = [i for i in host.chunks_of if i not in covered]
        notes.unwaited = sorted({k for i in uncovered for k in host.chunks_of[i]})
        if uncovered:
            log.warning("%d CPU-stepped parameters belong to no module of the attached model; step() waits "
                        "for them", len(uncovered))  # fmt: skip
        self.handles.append(model.register_forward_pre_hook(_RebuildIfNeeded(self)))
        self.handles.append(model.register_state_dict_pre_hook(_Synchronize(self)))
        self.handles.append(model.register_load_state_dict_pre_hook(_Synchronize(self)))
        _make_compile_see_hooks()  # no compiled forward may run without these hooks

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.ddp is not None and self.ddp in _REDUCED:
            _REDUCED[self.ddp].attachment = None

    def name_of(self, i: int) -> str | None:
        param = self.coordinator.split.params[i]
        return next((n for n, q in self.model.named_parameters() if q is param), None)

    def note_grad(self, i: int, grad: torch.Tensor) -> None:
        self.coordinator.notes.note_grad(i, grad, lambda: self.name_of(i))

    def on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: the gradient of a CPU-stepped parameter is final; send it down."""
        if p.grad is None:
            return
        c = self.coordinator
        i = c.split.index[id(p)]
        self.note_grad(i, p.grad)
        if not c.sync_gradients:
            return
        c.stream(i, distributed.local(p.grad))
        if c.notes.releases(i, c.split.fully_cpu):
            p.grad = None

    def on_reduced(self, bucket: Any, reduced: torch.Tensor) -> None:
        """DDP's communication hook: `reduced` holds the bucket's gradients averaged over the ranks, one after
        the other in the bucket's parameter order; the CPU share goes down from there."""
        c = self.coordinator
        if not c.sync_gradients:  # a micro-step inside opt.no_sync() that DDP still reduced: not final yet
            return
        offset = 0
        for p in bucket.parameters():
            grad, offset = reduced[offset : offset + p.numel()].view_as(p), offset + p.numel()
            i = c.split.index.get(id(p))
            if i is None:
                continue
            self.note_grad(i, grad)
            if i in c.host.chunks_of:
                c.stream(i, grad)


class _ReducedBuckets:
    """The state of the communication hook on a DDP model (registered once per model, as DDP allows): the
    attachment it streams for, or None (detached: a plain all-reduce)."""

    def __init__(self, process_group: object) -> None:
        self.process_group = process_group
        self.attachment: Attachment | None = None

    def __deepcopy__(self, memo: dict) -> _ReducedBuckets:
        return _ReducedBuckets(self.process_group)


_REDUCED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DDP model -> its communication hook's state


def reduced_buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> _ReducedBuckets:
    """The state of `ddp`'s communication hook, registered the first time (DDP takes one per model)."""
    state = _REDUCED.get(ddp)
    if state is None:
        state = _REDUCED[ddp] = _ReducedBuckets(ddp.process_group)
        ddp.register_comm_hook(state, _all_reduce_then_stream)
    return state


def _all_reduce_then_stream(state: _ReducedBuckets, bucket):  # noqa: ANN001, ANN201 (DDP checks the annotations)
    """DDP's default all-reduce (average); once done, the attachment streams the bucket's CPU share."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def reduced(fut: torch.futures.Future) -> torch.Tensor:
        if state.attachment is not None:
            state.attachment.on_reduced(bucket, fut.value())
        return fut.value()

    return allreduce_hook(state.process_group, bucket).then(reduced)


class _AttachmentHook:
    """A hook object holding the attachment. A copy of the model (deepcopy, pickle) gets an inert one: the copy
    is not attached, and the optimizer's threads and locks cannot be copied."""

    def __init__(self, attachment: Attachment) -> None:
        self.attachment = attachment

    def __deepcopy__(self, memo: dict) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple:
        return (_Inert, ())


class _Inert:
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _OnGrad(_AttachmentHook):
    def __call__(self, p: torch.Tensor) -> None:
        self.attachment.on_grad(p)


class _NoteGrad(_AttachmentHook):
    """A device-stepped parameter's gradient is final: note its version (a later in-place change shows)."""

    def __call__(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            attachment = self.attachment
            attachment.note_grad(attachment.coordinator.split.index[id(p)], p.grad)


class _Synchronize(_AttachmentHook):
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.attachment.coordinator.synchronize()


class _RebuildIfNeeded(_AttachmentHook):
    """Root forward pre-hook: parameters unfrozen or added since the split join it before they are used."""

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.attachment.coordinator.rebuild_if_needed()


class WaitFor:
    """Forward pre-hook: the module's CPU-stepped weights must be back before it runs."""

    def __init__(self, coordinator: StepCoordinator, chunk_ids: list[int]) -> None:
        self.coordinator, self.chunk_ids = coordinator, chunk_ids

    def __deepcopy__(self, memo: dict) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple:
        return (_Inert, ())

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        wait(self.coordinator, self.chunk_ids)  # under torch.compile a graph break: the wait runs eagerly


class WaitBeforeGather(WaitFor):
    """FSDP2's root forward pre-hook, run before FSDP2's own: every CPU-stepped shard is back before FSDP2's
    all-gather streams read any. They wait on the post-optimizer event when one is set (``set_post_optim_event``),
    else on the current stream; the event is set here, after the waits, so both ways see the uploads."""

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        wait(self.coordinator, self.chunk_ids, gather_after=module)


@torch.compiler.disable
def wait(coordinator: StepCoordinator, chunk_ids: list[int], gather_after: torch.nn.Module | None = None) -> None:
    """Never traced: under torch.compile a graph break, then the wait, eagerly."""
    coordinator.wait(chunk_ids)
    if gather_after is not None and torch.cuda.is_available() and coordinator.split.device.type == "cuda":
        gather_after.set_post_optim_event(torch.cuda.current_stream().record_event())


def _make_compile_see_hooks() -> None:
    """Makes torch.compile guard on every module's hooks, so that no compiled forward runs without the waits.

    By default dynamo keeps no guard on a module's empty hook dicts (``torch._dynamo.config.
    skip_nnmodule_hook_guards``): a forward traced for a module without hooks (this model before attach(), or
    any other instance of its class, such as an AdamW reference or an evaluation copy, before or after) would
    also run for the attached model, without its waits, and read weights the CPU is still writing. Graphs
    compiled before this change have no such guard: they are dropped, and retraced at their next call.
    """
    compiled_before = "torch._dynamo" in sys.modules
    import torch._dynamo

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        log.info("TwinFlowAdam: torch.compile now guards on module hooks (skip_nnmodule_hook_guards=False)")
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        if compiled_before:
            torch.compiler.reset()
