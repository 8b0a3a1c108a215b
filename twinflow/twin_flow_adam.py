"""TwinFlowAdam: a fraction of the parameters steps on the CPU, the rest on the GPU, at once."""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from twinflow import ops, tune
from twinflow.cpu_adam import ParamsT, adam_defaults, check_hyperparams
from twinflow.partition import Segment, check_placement, check_ratio, split
from twinflow.pipeline import HostPipeline, HostSegment, StepArgs

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:  # FSDP2 parameters and gradients are DTensors; TwinFlowAdam steps their local shards
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch without torch.distributed
    _DTensor = None
_UPCAST_ELEMENTS = tune.UPCAST_ELEMENTS  # device side: bf16/fp16 gradients are upcast at most this many at a time


@dataclass
class _SegmentState:
    """The optimizer state of one segment; its only owner."""

    seg: Segment
    master: torch.Tensor  # fp32; for a float32 parameter on the device side, the parameter slice itself
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    device_step: torch.Tensor | None = None  # device side: the fused kernel's step counter


class TwinFlowAdam(torch.optim.Optimizer):
    """Adam/AdamW with `ratio` of the parameter elements stepped on the CPU, the rest on the GPU.

    A drop-in for ``torch.optim.AdamW``. The split is exact to the element, in
    parameter order: ``placement="first"`` gives the CPU the first ``ratio`` of
    the elements, ``"last"`` the last (a tensor at the boundary is cut in two).
    ``ratio="auto"`` chooses the ratio at the first ``step()`` from that
    iteration's measured memory and times (see :mod:`twinflow.tune`).
    The CPU side keeps fp32 masters, ``exp_avg`` and ``exp_avg_sq`` in host
    memory and updates them with twinflow's kernel on a worker thread; the
    device side runs torch's fused Adam over fp32 masters. bf16/fp16
    parameters keep fp32 masters on both sides and receive the rounded result.

    Plain use (``step()`` after ``backward()``) moves the CPU share's gradients
    down inside ``step()`` and returns once every weight is back. After
    ``attach(model)``, gradients leave during backward, the CPU steps while
    the GPU works, and the next forward waits only for the weights it uses.

    ``max_grad_norm`` clips by one global norm inside ``step()``.
    ``state_dict()`` uses torch.optim's layout keyed by parameter index (with
    a ``master`` entry for low-precision parameters), so it loads under another
    ratio or placement and into ``torch.optim.AdamW``, and back.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,  # torch.optim.AdamW's default
        adamw_mode: bool = True,
        bias_correction: bool = True,
        ratio: float | str = 0.4,
        placement: str = "first",
        *,
        chunk_bytes: int = 128 << 20,
        num_threads: int | None = None,
        max_grad_norm: float | None = None,
        memory_margin: float = 0.1,
        memory_budget: int | None = None,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        # torch.optim.AdamW's flags, accepted at their defaults (configs often spell them out), refused otherwise.
        flags = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused, capturable=capturable,
                     differentiable=differentiable)  # fmt: skip
        for name, value in flags.items():
            if value:
                raise ValueError(
                    f"{name}={value!r} is not supported by TwinFlowAdam: leave it unset (it picks its own kernels: "
                    "twinflow's on the CPU, torch's fused Adam on the device; amsgrad, maximize, capturable and "
                    "differentiable are not implemented)"
                )
        defaults = adam_defaults(lr, betas, eps, weight_decay, adamw_mode, bias_correction, num_threads)
        self.auto_ratio = ratio == "auto"
        self.ratio = None if self.auto_ratio else check_ratio(ratio)
        self.placement = check_placement(placement)
        if not isinstance(chunk_bytes, int) or chunk_bytes < 256:
            raise ValueError(f"chunk_bytes={chunk_bytes!r}; expected an int >= 256")
        if max_grad_norm is not None and not (float(max_grad_norm) > 0):
            raise ValueError(f"max_grad_norm={max_grad_norm!r}; expected a number > 0, or None for no clipping")
        super().__init__(params, defaults)
        self.chunk_bytes = chunk_bytes
        self.num_threads = num_threads
        self.max_grad_norm = max_grad_norm
        self.memory_margin = memory_margin
        self.memory_budget = memory_budget
        self._index_params()
        self._taken_state: dict[int, dict[str, torch.Tensor]] | None = None
        self.register_load_state_dict_post_hook(_put_taken_state, prepend=True)
        self.device = self._locals[0].device if self._params else torch.device("cpu")
        self._steps = [0] * len(self._params)
        self.sync_gradients = True
        self.released_grad_bytes = 0  # GPU gradient memory handed back during the last backward
        self.skipped_steps = 0  # fp16 steps skipped for an inf/NaN gradient
        self.auto_decision: dict[str, Any] | None = None
        self._model: torch.nn.Module | None = None
        self._attach_options: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._grad_version: dict[int, int] = {}  # under attach(): each gradient's version when backward ended
        self._witness: int | None = None  # under attach(): a gradient kept and copied (see _install_hooks)
        self._witness_grad: torch.Tensor | None = None
        self._hook_norms: list[torch.Tensor] = []
        self._clip_coef: torch.Tensor | None = None  # the multiplier every gradient of this step gets
        self._unscale: float | None = None  # loss scaling: 1 / scale, set by unscale_()
        self._clipped = False
        self._pipeline: HostPipeline | None = None
        self._unwaited: list[int] = []
        self._probe = tune.IterationProbe(self.device) if self.auto_ratio else None
        if not self.auto_ratio:
            self._build_state()
        elif self._params:
            ops.load()  # 'auto' probes the kernel at the first step: build it now, outside any timed step

    # ----------------------------------------------------------------- set-up
    def _index_params(self) -> None:
        """Numbers the parameters of every group in order; a parameter listed twice is refused."""
        self._params, self._group_of, self._index = [], [], {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) in self._index:
                    raise ValueError(
                        f"parameter {self._index[id(p)]} (shape {tuple(p.shape)}) is a duplicate: it appears "
                        "twice in the param groups; list each parameter once (torch.optim would step it twice)"
                    )
                self._index[id(p)] = len(self._params)
                self._params.append(p)
                self._group_of.append(gi)
        # What this process holds of each parameter (a DTensor's local shard under FSDP2): all math uses these.
        self._locals = [_local(p.detach()) for p in self._params]
        self._mesh_group = next(
            (p.device_mesh.get_group() for p in self._params if _DTensor is not None and isinstance(p, _DTensor)), None
        )
        self._check_params()
        self._plan_stale = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim's; the new parameters join the split at the next step (the state so far is kept)."""
        super().add_param_group(param_group)
        if hasattr(self, "_params"):  # torch's __init__ adds the first groups before our state exists
            self._plan_stale = True

    def _needs_replan(self) -> bool:
        """Groups were added, or a parameter frozen when the split was made now takes gradients."""
        return self._plan_stale or any(p.requires_grad and i not in self._planned for i, p in enumerate(self._params))

    def _replan(self) -> None:
        """Rebuilds the split over the current parameters, carrying every stepped parameter's state across."""
        self.synchronize()
        kept = {self._params[i]: entry for i, entry in self._export_state().items()}
        steps = {self._params[i]: n for i, n in enumerate(self._steps)}
        model = self._model
        if model is not None:
            self.detach()
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
        self._index_params()
        self._steps = [steps.get(p, 0) for p in self._params]
        self._build_state()
        self._import_state({self._index[id(p)]: entry for p, entry in kept.items()})
        if model is not None:
            self.attach(model, **self._attach_options)

    def _check_params(self) -> None:
        devices = sorted({str(p.device) for p in self._params})
        if len(devices) > 1:
            raise ValueError(
                f"TwinFlowAdam got parameters on several devices {devices}; it steps the parameters of one "
                "device: build one optimizer per device (or per rank with DDP/FSDP)"
            )
        for i, p in enumerate(self._locals):
            if p.dtype not in _DTYPES:
                raise TypeError(f"parameter {i} has dtype {p.dtype}; expected float32, bfloat16 or float16")
            if not p.is_contiguous():
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not contiguous")

    def _build_state(self) -> None:
        # Frozen parameters take no part (no state, no hooks): with LoRA most of the model is frozen.
        self._planned = {i for i, p in enumerate(self._params) if p.requires_grad}
        numels = [p.numel() if i in self._planned else 0 for i, p in enumerate(self._locals)]
        segments = split(numels, self.ratio, self.placement)
        # Per parameter, its version counter right after the optimizer last wrote it (see _refresh_moved_masters).
        self._written = [p._version for p in self._locals]
        self._segments_of: list[list[_SegmentState]] = [[] for _ in self._params]
        self._cpu: list[_SegmentState] = []
        self._dev: list[_SegmentState] = []
        # The CPU side's masters and moments: three flat host buffers, one slice per segment.
        cpu_total = sum(seg.numel for seg in segments if seg.on_cpu)
        host = [torch.empty(cpu_total, dtype=torch.float32) for _ in range(3)]
        offset = 0
        with torch.no_grad():
            for seg in segments:
                p = self._locals[seg.index]
                flat = p.view(-1)[seg.start : seg.end]
                if seg.on_cpu:
                    master, exp_avg, exp_avg_sq = (h[offset : offset + seg.numel] for h in host)
                    offset += seg.numel
                    master.copy_(flat)
                    exp_avg.zero_()
                    exp_avg_sq.zero_()
                    st = _SegmentState(seg, master, exp_avg, exp_avg_sq)
                    self._cpu.append(st)
                else:
                    master = flat if p.dtype == torch.float32 else flat.float()
                    step = torch.zeros((), dtype=torch.float32, device=p.device)
                    st = _SegmentState(seg, master, torch.zeros_like(master), torch.zeros_like(master), step)
                    self._dev.append(st)
                self._segments_of[seg.index].append(st)
        self._fully_cpu = {i for i, sts in enumerate(self._segments_of) if sts and all(s.seg.on_cpu for s in sts)}
        if self._cpu:
            host_segments = [
                HostSegment(s.seg.index, s.seg.start, s.seg.end, s.master, s.exp_avg, s.exp_avg_sq) for s in self._cpu
            ]
            self._pipeline = HostPipeline(
                self._locals, self._group_of, host_segments, self.chunk_bytes, self.device, self.num_threads
            )
            weakref.finalize(self, self._pipeline.close)
        self.split_summary = self._summarise()
        log.info("TwinFlowAdam split: %s", self.split_summary)
        if self._model is not None:
            self._install_hooks()

    def _summarise(self) -> dict[str, Any]:
        def side(states: list[_SegmentState]) -> dict[str, int]:
            tensors = {st.seg.index for st in states}
            elements = sum(st.seg.numel for st in states)
            state_bytes = sum(st.seg.numel * 12 for st in states)  # fp32 master, exp_avg, exp_avg_sq
            return {"tensors": len(tensors), "elements": elements, "state_bytes": state_bytes}

        cpu, dev = side(self._cpu), side(self._dev)
        total = cpu["elements"] + dev["elements"]
        return {
            "ratio_requested": "auto" if self.auto_ratio else self.ratio,
            "ratio_achieved": cpu["elements"] / total if total else 0.0,
            "placement": self.placement,
            "cpu": cpu,
            "device": dev | {"device": str(self.device)},
            "pinned_bytes": self._pipeline.pinned_bytes if self._pipeline else 0,
            "chunks": len(self._pipeline.chunks) if self._pipeline else 0,
        }

    # ---------------------------------------------------------------- overlap
    def attach(self, model: torch.nn.Module, *, release_grads: bool = True, eager: bool | None = None) -> TwinFlowAdam:
        """Overlaps the CPU share with the model's backward and next forward.

        - Each CPU-owned gradient is copied to the host as soon as backward
          has finished it (a post-accumulate-grad hook); with
          ``release_grads`` the GPU memory of a gradient wholly owned by the
          CPU is handed back once the copy is queued.
        - ``eager`` (default: on unless ``max_grad_norm`` is set or the model
          is fp16) lets the CPU step chunks while backward still runs. It
          needs every gradient to be final when backward delivers it: no
          ``clip_grad_norm_`` afterwards (pass ``max_grad_norm`` instead,
          which waits for the global norm) and no overflow skipping.
        - The next forward waits, module by module, only for the weights it
          is about to use (a forward pre-hook per module that owns
          CPU-stepped parameters); parameters that no module of `model`
          owns are waited for at the end of ``step()``.
        - Under ``torch.compile`` a wait is a graph break where one is due.
          attach() makes torch.compile guard on module hooks (it sets
          ``torch._dynamo.config.skip_nnmodule_hook_guards = False``) and
          drops the graphs compiled before (``torch.compiler.reset()``).

        With gradient accumulation, run every backward but the last of a
        window inside ``with optimizer.no_sync():``. Under eager overlap the
        step's hyper-parameters (lr, ...) are those read when backward began
        delivering gradients, on both sides.

        Not supported: torch.distributed with more than one process (the
        hooks would read gradients before DDP averages them; refused), and
        ``torch.amp.GradScaler`` (loss scaling needs every gradient first;
        bf16 needs none, and fp16 models get TwinFlowAdam's own overflow
        skipping).
        """
        if self._model is not None:
            raise RuntimeError("TwinFlowAdam.attach() was already called; call detach() first")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size() > 1:
                raise RuntimeError(
                    "TwinFlowAdam.attach() under torch.distributed: its hooks read each gradient before DDP's "
                    "all-reduce has averaged it. Use TwinFlowAdam without attach() there (step() runs after "
                    "the all-reduce)"
                )
        fp16 = any(p.dtype == torch.float16 for p in self._params)
        if eager is None:
            eager = self.max_grad_norm is None and not fp16
        elif eager and (self.max_grad_norm is not None or fp16):
            raise ValueError(
                "eager=True cannot be combined with max_grad_norm or fp16 parameters: both need every gradient "
                "before any update; leave eager unset"
            )
        self._model = model
        self._attach_options = {"release_grads": release_grads, "eager": eager}
        if self._probe is not None:
            self._probe.attach(model)
        if self.ratio is not None:
            self._install_hooks()
        return self

    def _install_hooks(self) -> None:
        model, pipeline = self._model, self._pipeline
        if pipeline is None:
            return
        self._grad_version = {}
        trainable = sorted(i for i in self._planned if self._params[i].requires_grad)
        # The witness: one gradient kept on the device (not released) and copied when backward ends, so that
        # a change made to the gradients afterwards (an outside clip_grad_norm_) shows in its values, and a
        # multiplication by exactly 1 (Trainer's logged norm with max_norm=inf) is told apart from a clip.
        kept = [i for i in trainable if i not in self._fully_cpu] or trainable
        large = [i for i in kept if self._locals[i].numel() >= 1024]  # not a bias, whose gradient may be 0
        sizes = {i: self._locals[i].numel() for i in kept}
        self._witness = min(large, key=sizes.get) if large else (max(kept, key=sizes.get) if kept else None)
        self._witness_grad = None
        for i in trainable:
            hook = _OnGrad(self) if i in pipeline.pieces_of else _NoteGrad(self)
            self._handles.append(self._params[i].register_post_accumulate_grad_hook(hook))
        # A module's pre-hook waits for its own parameters and its direct children's: modules such as
        # nn.MultiheadAttention read a child's weight without calling the child, and containers
        # (ParameterList) have no forward of their own. Coverage is counted per parameter.
        covered: set[int] = set()
        for module in model.modules():
            owned = list(module.parameters(recurse=False))
            for child in module.children():
                owned += list(child.parameters(recurse=False))
            indices = {
                self._index[id(p)] for p in owned if id(p) in self._index and self._index[id(p)] in pipeline.chunks_of
            }
            if indices:
                covered |= indices
                chunk_ids = sorted({k for i in indices for k in pipeline.chunks_of[i]})
                self._handles.append(module.register_forward_pre_hook(_WaitFor(pipeline, chunk_ids)))
        uncovered = [i for i in pipeline.chunks_of if i not in covered]
        self._unwaited = sorted({k for i in uncovered for k in pipeline.chunks_of[i]})
        if uncovered:
            log.warning("%d CPU-stepped parameters belong to no module of the attached model; step() waits "
                        "for them", len(uncovered))  # fmt: skip
        self._handles.append(model.register_forward_pre_hook(_ReplanIfNeeded(self)))
        self._handles.append(model.register_state_dict_pre_hook(_Synchronize(self)))
        self._handles.append(model.register_load_state_dict_pre_hook(_Synchronize(self)))
        _make_compile_see_hooks()  # no compiled forward may run without these hooks

    def detach(self) -> None:
        """Removes the hooks of ``attach()``; steps are plain again."""
        self.synchronize()
        for handle in self._handles:
            handle.remove()
        self._handles, self._model = [], None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of backward passes inside accumulate on the GPU and are not streamed (DDP's ``no_sync``)."""
        previous, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = previous

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: the gradient of a CPU-stepped parameter is final; send it down."""
        if p.grad is None:
            return
        i = self._index[id(p)]
        self._note_grad(i, p.grad)
        if not self.sync_gradients:
            return
        pipeline = self._pipeline
        if pipeline.phase != "open":
            self._open_step(self._step_args() if self._attach_options["eager"] else None)
        grad = _local(p.grad)
        if not self._attach_options["eager"]:
            self._hook_norms.append(torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32))
        release = self._attach_options["release_grads"] and i in self._fully_cpu and i != self._witness
        pipeline.download(i, grad)
        self._hooked.add(i)
        if release:
            self.released_grad_bytes += grad.numel() * grad.element_size()
            p.grad = None

    def _open_step(self, args: StepArgs | None) -> None:
        """A step's first gradient is about to go down (`args`: eager, the worker may start at once)."""
        self._pipeline.open(args)  # waits for the last step's writes: the masters are settled
        self._refresh_moved_masters()
        self._hook_norms, self._hooked, self.released_grad_bytes = [], set(), 0

    @torch.no_grad()
    def _refresh_moved_masters(self) -> None:
        """Masters follow weights changed outside the optimizer (``model.load_state_dict``, PEFT, EMA swaps).

        A parameter's version counter moves with every in-place write; after its own writes the optimizer notes
        the count, so a higher one means someone else wrote. Its moments stay, as in torch.optim.AdamW.
        """
        written = self._pipeline.written_version if self._pipeline is not None else {}
        for i, p in enumerate(self._locals):
            if p._version > max(self._written[i], written.get(i, -1)):
                flat = p.view(-1)
                for st in self._segments_of[i]:
                    piece = flat[st.seg.start : st.seg.end]
                    if st.master.data_ptr() != piece.data_ptr():  # an fp32 device-side master is the weight
                        st.master.copy_(piece)
                self._written[i] = p._version

    def _note_grad(self, i: int, grad: torch.Tensor) -> None:
        """Backward has finished parameter i's gradient (hook): note its version, copy the witness."""
        self._grad_version[i] = grad._version
        if i == self._witness:
            self._witness_grad = grad.detach().clone()

    def _check_grads_untouched(self, with_grad: list[int]) -> None:
        """Under attach(): gradients changed after backward (an outside clip) cannot reach what already streamed."""
        changed = [
            i
            for i in with_grad
            if self._params[i].grad is not None
            and i in self._grad_version
            and self._params[i].grad._version != self._grad_version[i]
        ]
        if not changed:
            return
        w, copy = self._witness, self._witness_grad
        if w in changed and copy is not None and torch.equal(_local(self._params[w].grad), copy):
            # Written with the same values: clip_grad_norm_ multiplied by 1 (Hugging Face Trainer's logged norm,
            # max_norm=inf). Exact only if the clipper saw every gradient; released ones it could not see.
            if self.released_grad_bytes == 0:
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

    def synchronize(self) -> None:
        """Waits until every weight of the last step is back on the device (the current stream sees it)."""
        if self._pipeline is not None and self._pipeline.phase != "open":
            self._pipeline.finish()

    # ------------------------------------------------------------------- step
    def _step_args(self) -> StepArgs:
        groups = []
        for group in self.param_groups:
            check_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            beta1, beta2 = group["betas"]
            groups.append(
                dict(
                    lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["adamw_mode"]),
                    bias_correction=bool(group["bias_correction"]),
                )
            )  # fmt: skip
        return StepArgs(groups=groups, steps=[s + 1 for s in self._steps])

    def _grads_not_streamed(self, with_grad: list[int]) -> list[torch.Tensor]:
        grads = [self._params[i].grad for i in with_grad if i not in self._hooked]
        return [_local(g) for g in grads if g is not None]

    def _norms(self, with_grad: list[int], norm_type: float) -> list[torch.Tensor]:
        """Per-gradient norms: those taken in backward hooks, and those of the gradients still on the GPU."""
        if self._hooked and norm_type != 2.0:
            raise ValueError(
                f"norm_type={norm_type!r}: after attach(), gradients streamed in backward are measured by their "
                "2-norm; use norm_type=2.0"
            )
        grads = self._grads_not_streamed(with_grad)
        # fp32 norms whatever the gradients' dtype: bf16 norms would round the clipping coefficient
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32) if grads else []
        return list(self._hook_norms) + list(norms)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips all gradients (both sides) by one global norm, in the coming ``step()``; no host synchronisation.

        Returns the total norm, as ``torch.nn.utils.clip_grad_norm_`` does. The
        gradients are scaled as they are consumed: the device side multiplies
        its fp32 gradients, the CPU kernel multiplies as it reads.
        """
        if self._hooked and self._attach_options.get("eager"):
            raise RuntimeError(
                "clip_grad_norm_ after an eager overlapped backward: the CPU share has already stepped with "
                "unclipped gradients. Pass max_grad_norm= to TwinFlowAdam (the CPU then waits for the norm)"
            )
        return self._clip(max_norm, norm_type, self._with_grad())

    def _clip(self, max_norm: float, norm_type: float, with_grad: list[int]) -> torch.Tensor:
        norms = self._norms(with_grad, float(norm_type))
        if not norms:
            return torch.tensor(0.0, device=self.device)
        total = torch.linalg.vector_norm(torch.stack([n.to(self.device) for n in norms]), float(norm_type))
        if self._mesh_group is not None:  # FSDP2: each rank holds a shard of every gradient
            total = self._all_ranks_norm(total, float(norm_type))
        if self._unscale is not None:  # the norm of the true gradients, not of the loss-scaled ones
            total = total * self._unscale
        self._clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0) * (self._unscale or 1.0)
        self._clipped = True
        return total

    def unscale_(self, inv_scale: float) -> None:
        """Loss scaling: every gradient of the coming step is multiplied by `inv_scale` (1 / loss scale).

        Call before ``clip_grad_norm_`` (or a ``max_grad_norm`` step): clipping
        then measures the unscaled gradients. Like the clipping coefficient, it is
        applied as the gradients are consumed, on both sides.
        """
        if self._hooked and self._attach_options.get("eager"):
            raise RuntimeError("unscale_ after an eager overlapped backward: the CPU share has already stepped")
        if self._clipped:
            raise RuntimeError("unscale_ after clip_grad_norm_: unscale first, so that clipping sees true gradients")
        self._unscale = float(inv_scale)
        self._clip_coef = torch.tensor(self._unscale, dtype=torch.float32, device=self.device)

    def _all_ranks_norm(self, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The norm over every rank's shards, from this rank's norm of its own."""
        import torch.distributed as dist

        if norm_type == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._mesh_group)
            return local
        powered = local.pow(norm_type)
        dist.all_reduce(powered, group=self._mesh_group)
        return powered.pow(1.0 / norm_type)

    def _with_grad(self) -> list[int]:
        return [i for i, p in enumerate(self._params) if p.grad is not None or i in self._hooked]

    def _overflow(self, with_grad: list[int]) -> bool:
        """For fp16 models: any inf/NaN gradient on either side (one host synchronisation)."""
        if not any(self._params[i].dtype == torch.float16 for i in with_grad):
            return False
        norms = self._norms(with_grad, 2.0)
        found = torch.logical_not(torch.isfinite(torch.stack([n.to(self.device) for n in norms]))).any().float()
        if self._mesh_group is not None:  # every rank skips together
            import torch.distributed as dist

            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._mesh_group)
        return bool(found)

    def _cpu_scale(self) -> float | Callable[[], float]:
        """The clipping coefficient as the CPU worker will read it (blocking until the GPU has it)."""
        if self._clip_coef is None:
            return 1.0
        if self.device.type != "cuda":
            return float(self._clip_coef)
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(self._clip_coef, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return lambda: (ready.synchronize(), float(host))[1]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step on both sides.

        Plain: returns once every weight is back (device work in stream
        order). After ``attach()``: returns once the device step is queued;
        the CPU share finishes in the background and the next forward waits
        for what it uses.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        args = self._step_args()  # checks the hyper-parameters before anything moves
        if self.ratio is None:
            self._choose_ratio()
        if not self._step_open() and self._needs_replan():
            self._replan()
            args = self._step_args()
        pipeline = self._pipeline
        if pipeline is None:
            self._refresh_moved_masters()
        elif pipeline.phase != "open":
            self._open_step(None)
        with_grad = self._with_grad()
        unplanned = [i for i in with_grad if i not in self._planned]
        if unplanned:  # only reachable under attach(): a frozen parameter was unfrozen during this iteration
            raise RuntimeError(
                f"parameter {unplanned[0]} has a gradient but was frozen when TwinFlowAdam split the parameters; "
                "unfreeze parameters before the forward pass (the split is rebuilt there)"
            )
        for i in with_grad:
            g = self._params[i].grad
            if g is not None and g.is_sparse:
                if pipeline is not None:
                    pipeline.reset()
                raise TypeError(f"parameter {i} has a sparse gradient; TwinFlowAdam needs dense gradients")
        if pipeline is not None:
            for i in with_grad:
                if i in pipeline.pieces_of and not pipeline.downloaded(i):
                    pipeline.download(i, _local(self._params[i].grad))
        if self._model is not None:
            self._check_grads_untouched(with_grad)
        if self._overflow(with_grad):
            log.warning("inf/NaN gradient in an fp16 model: step skipped on both sides")
            self.skipped_steps += 1
            if pipeline is not None:
                pipeline.discard()
            self._end_step()
            return loss
        if self.max_grad_norm is not None and not self._clipped:
            self.last_grad_norm = self._clip(self.max_grad_norm, 2.0, with_grad)
        if pipeline is not None:
            eager = pipeline.released_args
            if eager is not None:  # the CPU share has been stepping since backward: both sides use its values
                if eager.groups != args.groups:
                    log.warning("hyper-parameters changed between backward and step(); under eager overlap the "
                                "step uses the values read when backward began delivering gradients")  # fmt: skip
                args = eager
            else:
                args.scale = self._cpu_scale()
            pipeline.seal(args)
        has_grad = set(with_grad)
        stepped = [st for st in self._dev if st.seg.index in has_grad]
        self._step_device(stepped, args.groups)
        for st in stepped:
            self._written[st.seg.index] = self._locals[st.seg.index]._version
        for i in with_grad:
            self._steps[i] += 1
        if pipeline is not None:
            if self._model is None:
                pipeline.finish()
            elif self._unwaited:
                pipeline.wait(self._unwaited)
        self._end_step()
        return loss

    def _step_open(self) -> bool:
        return self._pipeline is not None and self._pipeline.phase == "open"

    def _end_step(self) -> None:
        self._grad_version, self._witness_grad = {}, None
        self._clip_coef = None
        self._unscale = None
        self._clipped = False
        self._hook_norms, self._hooked = [], set()

    def _choose_ratio(self) -> None:
        """ratio="auto": measure, decide, build the state (first step only)."""
        self.auto_decision = self._probe.decide(
            self._locals,  # what this process steps: under FSDP2 its shards, not the whole model
            upcast_elements=_UPCAST_ELEMENTS,
            placement=self.placement,
            eager=self._model is not None and self._attach_options.get("eager", False),
            release_grads=self._model is not None and self._attach_options.get("release_grads", False),
            margin=self.memory_margin,
            budget=self.memory_budget,
            num_threads=self.num_threads,
        )
        self.ratio = self.auto_decision["ratio"]
        self._probe.detach()
        log.info("TwinFlowAdam ratio='auto' chose %.3f: %s", self.ratio, self.auto_decision)
        self._build_state()

    def _step_device(self, states: list[_SegmentState], groups: list[dict[str, Any]]) -> None:
        """Launches torch's fused Adam over the device-side masters, per param group in bounded batches.

        bf16/fp16 gradients are upcast to fp32 at most _UPCAST_ELEMENTS at a
        time (a large segment is cut into several pieces), so the temporary
        memory stays under 256 MiB.
        """
        by_group: dict[int, list[_SegmentState]] = {}
        for st in states:
            by_group.setdefault(self._group_of[st.seg.index], []).append(st)
        for gi, group_states in by_group.items():
            torch._foreach_add_([st.device_step for st in group_states], 1)  # the kernels read the new step
            batch: list[tuple[_SegmentState, int, int]] = []
            upcast = 0
            for st in group_states:
                low = self._locals[st.seg.index].dtype != torch.float32
                size = _UPCAST_ELEMENTS if low else st.seg.numel
                for a in range(0, st.seg.numel, size):
                    b = min(st.seg.numel, a + size)
                    if batch and low and upcast + b - a > _UPCAST_ELEMENTS:
                        self._step_device_batch(groups[gi], batch)
                        batch, upcast = [], 0
                    batch.append((st, a, b))
                    upcast += b - a if low else 0
            if batch:
                self._step_device_batch(groups[gi], batch)

    def _step_device_batch(self, group: dict[str, Any], pieces: list[tuple[_SegmentState, int, int]]) -> None:
        """Elements [a, b) of each segment: upcast gradients, clip, fused Adam, rounded copy back.

        `group` holds this step's hyper-parameters (``_step_args``' layout).
        """
        grads, masters, exp_avgs, exp_avg_sqs, steps, low = [], [], [], [], [], []
        for st, a, b in pieces:
            p = self._locals[st.seg.index]
            g = _local(self._params[st.seg.index].grad).reshape(-1)[st.seg.start + a : st.seg.start + b]
            grads.append(g if g.dtype == torch.float32 else g.float())
            masters.append(st.master[a:b])
            exp_avgs.append(st.exp_avg[a:b])
            exp_avg_sqs.append(st.exp_avg_sq[a:b])
            steps.append(st.device_step)
            if p.dtype != torch.float32:
                low.append((p.view(-1)[st.seg.start + a : st.seg.start + b], masters[-1]))
        if self._clip_coef is not None:
            torch._foreach_mul_(grads, self._clip_coef)
        if group["bias_correction"]:
            fused = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
            fused(
                masters, grads, exp_avgs, exp_avg_sqs, [], steps,
                lr=group["lr"], beta1=group["beta1"], beta2=group["beta2"], weight_decay=group["weight_decay"],
                eps=group["eps"], amsgrad=False, maximize=False,
            )  # fmt: skip
        else:
            _foreach_adam_no_bias_correction(masters, grads, exp_avgs, exp_avg_sqs, group)
        if low:
            torch._foreach_copy_([dst for dst, _ in low], [m for _, m in low])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim's; also forgets gradients already streamed to the host for a step not yet taken."""
        if self._pipeline is not None and self._pipeline.phase == "open":
            self._pipeline.reset()
        self._end_step()  # a clipping coefficient of a step never taken must not reach the next one
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ state
    def _require_state(self) -> None:
        if self.ratio is None:
            raise RuntimeError("ratio='auto' is decided at the first step(); there is no state before it")
        if self._pipeline is not None and self._pipeline.phase == "open":
            raise RuntimeError(
                "TwinFlowAdam's state is in the middle of a step (gradients streamed, step() not called yet); "
                "call step() first, then save or load"
            )

    def _entry(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter i's state in torch.optim's layout (+ ``master`` for low precision).

        Views of the live buffers where the parameter is on one side whole; a copy for the one cut in two.
        """
        p, states = self._locals[i], self._segments_of[i]
        entry = {"step": torch.tensor(float(self._steps[i]))}
        keys = ("exp_avg", "exp_avg_sq") + (("master",) if p.dtype != torch.float32 else ())
        for key in keys:
            if len(states) == 1:
                entry[key] = getattr(states[0], key).view(p.shape)
            else:
                full = torch.empty(p.numel(), dtype=torch.float32)
                for st in states:
                    full[st.seg.start : st.seg.end] = getattr(st, key)
                entry[key] = full.view(p.shape)
        return entry

    def _export_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every stepped parameter's entry, by index."""
        return {i: self._entry(i) for i in range(len(self._params)) if self._steps[i] > 0 and self._segments_of[i]}

    @property
    def state(self) -> dict:
        """Per-parameter state as torch.optim keeps it (``step``, ``exp_avg``, ``exp_avg_sq``, ``master``).

        Derived on each read from the optimizer's own buffers, after the CPU share's last step has finished.
        """
        if getattr(self, "_segments_of", None) is not None and not (
            self._pipeline is not None and self._pipeline.phase == "open"
        ):
            self.synchronize()
            self._state_map.clear()
            self._state_map.update({self._params[i]: entry for i, entry in self._export_state().items()})
        return self._state_map

    @state.setter
    def state(self, value: dict) -> None:
        self._state_map = value  # torch's __init__, load_state_dict and __setstate__ assign it

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's ``state_dict`` (its hooks run) after the CPU share's last step has finished.

        Layout: per-parameter ``step``, ``exp_avg``, ``exp_avg_sq`` (+ ``master`` for bf16/fp16 parameters),
        keyed by parameter index; it loads under another ratio or placement and into ``torch.optim.AdamW``.
        """
        self._require_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's ``load_state_dict`` (its hooks run): a TwinFlowAdam, CPUAdam or torch Adam(W) state dict,
        under any ratio or placement. Everything is checked before anything changes.
        """
        self._require_state()
        self.synchronize()
        # Ours runs after every user pre-hook (they may rewrite the state dict); the tensors go straight into our
        # buffers instead of through torch's per-parameter cast, which would put the CPU share's state on the GPU.
        handle = self.register_load_state_dict_pre_hook(_take_state)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()

    def _validated(self, state_dict: dict[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
        """The state dict's per-parameter entries by our index, checked (raises before anything changes)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups; this optimizer has {len(self.param_groups)}")
        for gi, (saved, ours) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(ours["params"]):
                raise ValueError(
                    f"param group {gi}: state dict has {len(saved['params'])} parameters, optimizer has "
                    f"{len(ours['params'])}"
                )
        ours = [self._index[id(p)] for group in self.param_groups for p in group["params"]]
        id_to_index = dict(zip((pid for g in groups for pid in g["params"]), ours))
        loaded: dict[int, dict[str, torch.Tensor]] = {}
        for pid, entry in state_dict["state"].items():
            if pid not in id_to_index:
                raise ValueError(f"state dict has state for parameter {pid!r}, which none of its param groups lists")
            i = id_to_index[pid]
            p = self._locals[i]
            missing = [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in entry]
            if missing:
                raise ValueError(
                    f"state of parameter {i}: no {missing[0]!r} entry (an Adam state has step, exp_avg and "
                    "exp_avg_sq); the state dict is incomplete or not from an Adam-family optimizer"
                )
            for key in ("exp_avg", "exp_avg_sq") + (("master",) if "master" in entry else ()):
                if entry[key].numel() != p.numel():
                    raise ValueError(
                        f"state of parameter {i}: {key} has {entry[key].numel()} elements, expected {p.numel()}"
                    )
            loaded[i] = entry
        return loaded

    @torch.no_grad()
    def _import_state(self, loaded: dict[int, dict[str, torch.Tensor]]) -> None:
        """Sets every parameter's state from `loaded` (by index; absent: fresh), and its weights from a master."""
        for i, p in enumerate(self._locals):
            entry = loaded.get(i)
            self._steps[i] = int(entry["step"]) if entry is not None else 0
            if entry is None:
                flat = {"exp_avg": None, "exp_avg_sq": None, "master": p.reshape(-1)}
            else:
                flat = {k: entry[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")}
                flat["master"] = entry["master"].reshape(-1) if "master" in entry else p.reshape(-1)
            for st in self._segments_of[i]:
                s, e = st.seg.start, st.seg.end
                for key in ("exp_avg", "exp_avg_sq"):
                    target = getattr(st, key)
                    target.copy_(flat[key][s:e]) if flat[key] is not None else target.zero_()
                if st.master.data_ptr() != p.data_ptr() + s * p.element_size():
                    st.master.copy_(flat["master"][s:e])
                if st.device_step is not None:
                    st.device_step.fill_(self._steps[i])
            if entry is not None and "master" in entry:  # the model's weights follow the masters
                p.copy_(entry["master"].view(p.shape))
            self._written[i] = p._version

    # ------------------------------------------------------ copies, pickling
    def __getstate__(self) -> dict[str, Any]:
        """What a copy needs: settings, param groups and each stepped parameter's state (not the attachment)."""
        if getattr(self, "_segments_of", None) is None:  # ratio='auto' not decided yet: nothing stepped
            state: dict[int, dict[str, torch.Tensor]] = {}
        else:
            self.synchronize()
            state = {i: {k: v.clone() for k, v in e.items()} for i, e in self._export_state().items()}
        settings = {key: getattr(self, key) for key in _SETTINGS}
        return {
            "defaults": self.defaults,
            "param_groups": self.param_groups,
            "twinflow": {"settings": settings, "state": state, "skipped_steps": self.skipped_steps},
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        ours = state.get("twinflow")
        if ours is None:  # torch's load_state_dict passes the loaded groups this way
            super().__setstate__(state)
            for group in self.param_groups:
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
            return
        settings = dict(ours["settings"])
        settings.pop("auto_ratio")
        decided = settings.pop("ratio")
        ratio = "auto" if decided is None else decided
        d = state["defaults"]
        TwinFlowAdam.__init__(
            self, state["param_groups"], lr=d["lr"], betas=d["betas"], eps=d["eps"],
            weight_decay=d["weight_decay"], adamw_mode=d["adamw_mode"], bias_correction=d["bias_correction"],
            ratio=ratio, **settings,
        )  # fmt: skip
        self.skipped_steps = ours["skipped_steps"]
        if ours["state"]:
            self._import_state(ours["state"])


_SETTINGS = (
    "auto_ratio", "ratio", "placement", "chunk_bytes", "num_threads", "max_grad_norm", "memory_margin",
    "memory_budget",
)  # fmt: skip


def _take_state(opt: TwinFlowAdam, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The last load_state_dict pre-hook: checks the entries, puts them into the buffers once torch has taken
    the param groups (a post-hook), and hands torch the state dict without them."""
    opt._taken_state = opt._validated(state_dict)
    return {**state_dict, "state": {}}


def _put_taken_state(opt: TwinFlowAdam) -> None:
    """The first load_state_dict post-hook: the entries `_take_state` checked go into the buffers."""
    taken, opt._taken_state = opt._taken_state, None
    if taken is not None:
        opt._import_state(taken)


class _OptimizerHook:
    """A hook object holding the optimizer. A copy of the model (deepcopy, pickle) gets an inert one: the copy
    is not attached, and the optimizer's threads and locks cannot be copied."""

    def __init__(self, opt: TwinFlowAdam) -> None:
        self.opt = opt

    def __deepcopy__(self, memo: dict) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple:
        return (_Inert, ())


class _Inert:
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _OnGrad(_OptimizerHook):
    def __call__(self, p: torch.Tensor) -> None:
        self.opt._on_grad(p)


class _NoteGrad(_OptimizerHook):
    """A device-stepped parameter's gradient is final: note its version (a later in-place change shows)."""

    def __call__(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.opt._note_grad(self.opt._index[id(p)], p.grad)


class _Synchronize(_OptimizerHook):
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.opt.synchronize()


class _ReplanIfNeeded(_OptimizerHook):
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if self.opt.ratio is not None and not self.opt._step_open() and self.opt._needs_replan():
            self.opt._replan()


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


@torch.compiler.disable
def _wait(pipeline: HostPipeline, chunk_ids: list[int]) -> None:
    """Never traced: under torch.compile a graph break, then the wait, eagerly."""
    pipeline.wait(chunk_ids)


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


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard (FSDP2), else the tensor itself."""
    return t.to_local() if _DTensor is not None and isinstance(t, _DTensor) else t


def _foreach_adam_no_bias_correction(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    group: dict[str, Any],
) -> None:
    """Adam/AdamW without bias correction (torch's fused kernels always correct); `group` as ``_step_args``'."""
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
