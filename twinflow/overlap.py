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
import threading
from typing import Any

import torch

from twinflow import distributed, speculation
from twinflow.pipeline import HostPipeline
from twinflow.split_state import sparse_gradient_message

log = logging.getLogger(__name__)


class Attachment:
    """One attach() of a TwinFlowAdam `opt`: its hooks, and what they note during a step (their only owner)."""

    def __init__(
        self, opt: torch.optim.Optimizer, model: torch.nn.Module, release_grads: bool, eager: bool | None
    ) -> None:
        self.fp16 = any(p.dtype == torch.float16 for p in opt._split.params)
        needs_all_grads = opt.max_grad_norm is not None or self.fp16 or opt.delay_after is not None
        if eager is None:
            eager = not needs_all_grads
        elif eager and needs_all_grads:
            raise ValueError(
                "eager=True cannot be combined with max_grad_norm, delay_after or fp16 parameters: each needs "
                "every gradient before any update; leave eager unset"
            )
        ddp = torch.nn.parallel.DistributedDataParallel
        self.ddp = model if isinstance(model, ddp) else None  # gradients stream once DDP has averaged them
        # FSDP2 runs the post-accumulate-grad hooks of its sharded parameters after each reduce-scatter, with the
        # reduced shard as the gradient: those stream as on one GPU.
        if self.ddp is not None and (self.ddp.find_unused_parameters or self.ddp.static_graph):
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
        self.fsdp = distributed.is_fully_sharded(model)
        if distributed.multi_process() and self.ddp is None and not self.fsdp:
            raise RuntimeError(
                "TwinFlowAdam.attach() on several processes takes the DistributedDataParallel model itself "
                "(opt.attach(ddp_model)) or the root fully_shard (FSDP2) model: gradients then stream once they "
                "are reduced. ZeroRedundancyOptimizer is not supported under attach(): use TwinFlowAdam "
                "without attach() there (step() runs after the reduction)"
            )
        self.lock = threading.Lock()
        self.opt, self.model = opt, model
        self.release_grads, self.eager = release_grads, eager
        self.handles: list[Any] = []
        self.unwaited: list[int] = []  # chunks of parameters no module owns: step() waits for them
        self.witness: int | None = None
        self.released: set[int] = set()  # parameters whose device gradient the last backward handed back
        self.end_step()

    @property
    def released_grad_bytes(self) -> int:
        locals_ = self.opt._split.locals
        return sum(locals_[i].numel() * locals_[i].element_size() for i in self.released)

    def open_step(self) -> None:
        """The step's first gradient goes down."""
        self.streamed: set[int] = set()  # parameters whose gradient went down during this backward
        self.released = set()

    def end_step(self) -> None:
        self.streamed = set()
        self.grad_version: dict[int, int] = {}  # each gradient's version when backward finished it
        self.witness_grad: torch.Tensor | None = None

    def install(self) -> None:
        """Registers the hooks for the optimizer's current split (again after it is rebuilt)."""
        self.remove()
        split, model = self.opt._split, self.model
        pipeline = split.pipeline
        if pipeline is None:
            return
        self.end_step()
        trainable = sorted(i for i in split.planned if split.params[i].requires_grad)
        # The witness: one gradient kept on the device (not released) and copied when backward ends, so that
        # a change made to the gradients afterwards (an outside clip_grad_norm_) shows in its values, and a
        # multiplication by exactly 1 (Trainer's logged norm with max_norm=inf) is told apart from a clip.
        kept = [i for i in trainable if i not in split.fully_cpu] or trainable
        large = [i for i in kept if split.locals[i].numel() >= 1024]  # not a bias, whose gradient may be 0
        sizes = {i: split.locals[i].numel() for i in kept}
        self.witness = min(large, key=sizes.get) if large else (max(kept, key=sizes.get) if kept else None)
        if self.ddp is not None:  # DDP's communication hook streams the CPU share; the witness is its copy
            _hook_reduced_buckets(self.ddp).attachment = self
        for i in trainable if self.ddp is None else ():
            hook = _OnGrad(self) if i in pipeline.pieces_of else _NoteGrad(self)
            self.handles.append(split.params[i].register_post_accumulate_grad_hook(hook))
        # A module's pre-hook waits for its own parameters and its direct children's: modules such as
        # nn.MultiheadAttention read a child's weight without calling the child, and containers
        # (ParameterList) have no forward of their own. Coverage is counted per parameter.
        covered: set[int] = set()
        if self.fsdp:  # FSDP2 gathers its next modules' weights ahead, on its own streams: all before the root's
            all_chunks = list(range(len(pipeline.chunks)))
            self.handles.append(model.register_forward_pre_hook(_WaitBeforeGather(pipeline, all_chunks), prepend=True))
            covered = set(pipeline.chunks_of)
        for module in model.modules() if not self.fsdp else ():
            owned = list(module.parameters(recurse=False))
            for child in module.children():
                owned += list(child.parameters(recurse=False))
            indices = {split.index[id(p)] for p in owned if split.index.get(id(p)) in pipeline.chunks_of}
            if indices:
                covered |= indices
                chunk_ids = sorted({k for i in indices for k in pipeline.chunks_of[i]})
                self.handles.append(module.register_forward_pre_hook(_WaitFor(pipeline, chunk_ids)))
        uncovered = [i for i in pipeline.chunks_of if i not in covered]
        self.unwaited = sorted({k for i in uncovered for k in pipeline.chunks_of[i]})
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
        if getattr(self.ddp, "_twinflow_reduced", None) is not None:
            self.ddp._twinflow_reduced.attachment = None

    def on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: the gradient of a CPU-stepped parameter is final; send it down."""
        if p.grad is None:
            return
        split = self.opt._split
        i = split.index[id(p)]
        self.note_grad(i, p.grad)
        if not self.opt.sync_gradients:
            return
        self._stream(i, distributed.local(p.grad))
        if self.release_grads and i in split.fully_cpu and i != self.witness:
            self.released.add(i)
            p.grad = None

    def _stream(self, i: int, grad: torch.Tensor) -> None:
        """Parameter i's final (reduced) gradient goes down to the CPU share; the first of a step opens it."""
        opt, pipeline = self.opt, self.opt._split.pipeline
        with self.lock:  # under DDP, buckets arrive on several communication threads
            if pipeline.phase != "open":
                spec = not self.eager and speculation.speculating(opt)
                opt._open_step(opt._step_args() if self.eager or spec else None, spec)
        if not self.eager:
            opt._scale.add_norm(grad)
        pipeline.download(i, grad)
        self.streamed.add(i)

    def on_reduced(self, bucket: Any, reduced: torch.Tensor) -> None:
        """DDP's communication hook: `reduced` holds the bucket's gradients averaged over the ranks, one after
        the other in the bucket's parameter order; the CPU share goes down from there."""
        split = self.opt._split
        if not self.opt.sync_gradients:  # a micro-step inside opt.no_sync() that DDP still reduced: not final yet
            return
        offset = 0
        for p in bucket.parameters():
            grad, offset = reduced[offset : offset + p.numel()].view_as(p), offset + p.numel()
            i = split.index.get(id(p))
            if i is None:
                continue
            self.note_grad(i, grad)
            if i in split.pipeline.pieces_of:
                self._stream(i, grad)

    def refuse_after_eager(self, what: str) -> None:
        """`what` (a clip, an unscale) cannot reach a CPU share that stepped during backward."""
        if self.streamed and self.eager:
            raise RuntimeError(
                f"{what} after an eager overlapped backward: the CPU share has already stepped with unscaled, "
                "unclipped gradients. Pass max_grad_norm= to TwinFlowAdam (the CPU then waits for the norm)"
            )

    def note_grad(self, i: int, grad: torch.Tensor) -> None:
        """Backward has finished parameter i's gradient: note its version, copy the witness."""
        if grad.is_sparse:  # attach() refused sparse modules; this one turned sparse since (or is not a module's)
            name = next((n for n, q in self.model.named_parameters() if q is self.opt._split.params[i]), None)
            what = f"parameter {i}" + (f" ({name!r})" if name else "")
            raise TypeError(sparse_gradient_message(what) + "; then call zero_grad() before the next backward")
        self.grad_version[i] = grad._version
        if i == self.witness:
            self.witness_grad = distributed.local(grad).detach().clone()

    def check_grads_untouched(self, with_grad: list[int]) -> None:
        """Gradients changed after backward (an outside clip) cannot reach what already streamed: refused."""
        params = self.opt._split.params
        w, copy = self.witness, self.witness_grad
        if self.ddp is not None or self.fsdp:
            # No version to compare: DDP writes its averages in, and an in-place change of FSDP2's DTensor gradients
            # (clip_grad_norm_'s foreach multiply) leaves their versions alone. The witness's values tell.
            gone = [i for i in self.streamed if params[i].grad is None and i not in self.released]
            if gone:  # DDP with a static graph turned on later reduces zeros for a parameter the step did not use
                raise RuntimeError(
                    f"parameter {gone[0]} streamed a gradient to the CPU share but has none after backward (DDP "
                    "static_graph with an unused parameter?): attach() cannot step it as AdamW would (skip it)"
                )
            witness = params[w].grad if copy is not None else None
            if copy is not None and (witness is None or not torch.equal(distributed.local(witness), copy)):
                raise RuntimeError(
                    f"gradient of parameter {w} was changed after backward (by torch.nn.utils.clip_grad_norm_?) "
                    "while TwinFlowAdam is attached to a DDP or FSDP2 model: the CPU share's gradients left once "
                    "reduced, so the change cannot reach them. Clip with TwinFlowAdam(max_grad_norm=...)"
                )
            return
        changed = [i for i in with_grad if params[i].grad is not None and i in self.grad_version
                   and params[i].grad._version != self.grad_version[i]]  # fmt: skip
        if not changed:
            return
        if w in changed and copy is not None and torch.equal(distributed.local(params[w].grad), copy):
            # Written with the same values: clip_grad_norm_ multiplied by 1 (Hugging Face Trainer's logged norm,
            # max_norm=inf). Exact only if the clipper saw every gradient; released ones it could not see.
            if not self.released:
                return
            raise RuntimeError(
                "gradients were passed through an outside clip_grad_norm_ after backward while TwinFlowAdam is "
                "attached and released the CPU share's gradients, so the norm it took left them out. Use "
                "opt.attach(model, release_grads=False) with TwinFlowAdam(max_grad_norm=...), and let the "
                "training loop not clip (Hugging Face Trainer: max_grad_norm=0 in TrainingArguments)"
            )
        raise RuntimeError(
            f"gradient of parameter {changed[0]} was changed after backward (by torch.nn.utils.clip_grad_norm_, "
            "or an unscale?) while TwinFlowAdam is attached: the CPU share's gradients left during backward, so "
            "the change cannot reach them and the step would be silently off. Clip with "
            "TwinFlowAdam(max_grad_norm=...) (with Hugging Face Trainer, set max_grad_norm=0 in "
            "TrainingArguments so it does not clip again), or do not attach()"
        )


class _ReducedBuckets:
    """The state of the communication hook on a DDP model (registered once per model, as DDP allows): the
    attachment it streams for, or None (detached: a plain all-reduce)."""

    def __init__(self, process_group: object) -> None:
        self.process_group = process_group
        self.attachment: Attachment | None = None

    def __deepcopy__(self, memo: dict) -> _ReducedBuckets:
        return _ReducedBuckets(self.process_group)


def _hook_reduced_buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> _ReducedBuckets:
    state = getattr(ddp, "_twinflow_reduced", None)
    if state is None:
        state = ddp._twinflow_reduced = _ReducedBuckets(ddp.process_group)
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
            self.attachment.note_grad(self.attachment.opt._split.index[id(p)], p.grad)


class _Synchronize(_AttachmentHook):
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.attachment.opt.synchronize()


class _RebuildIfNeeded(_AttachmentHook):
    """Root forward pre-hook: parameters unfrozen or added since the split join it before they are used."""

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.attachment.opt._rebuild_if_needed()


class _WaitFor:
    """Forward pre-hook: the module's CPU-stepped weights must be back before it runs."""

    def __init__(self, pipeline: HostPipeline, chunk_ids: list[int]) -> None:
        self.pipeline, self.chunk_ids = pipeline, chunk_ids

    def __deepcopy__(self, memo: dict) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple:
        return (_Inert, ())

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        _wait(self.pipeline, self.chunk_ids)  # under torch.compile a graph break: the wait runs eagerly


class _WaitBeforeGather(_WaitFor):
    """FSDP2's root forward pre-hook, run before FSDP2's own: every CPU-stepped shard is back before FSDP2's
    all-gather streams read any. They wait on the post-optimizer event when one is set (``set_post_optim_event``),
    else on the current stream; the event is set here, after the waits, so both ways see the uploads."""

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        _wait(self.pipeline, self.chunk_ids, gather_after=module)


@torch.compiler.disable
def _wait(pipeline: HostPipeline, chunk_ids: list[int], gather_after: torch.nn.Module | None = None) -> None:
    """Never traced: under torch.compile a graph break, then the wait, eagerly."""
    pipeline.wait(chunk_ids)
    if gather_after is not None and pipeline.streams.cuda:
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
