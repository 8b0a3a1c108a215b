"""TwinFlowAdam: a fraction of the parameters steps on the CPU, the rest on the GPU, at once."""

from __future__ import annotations

import contextlib
import logging
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
    ) -> None:
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
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._group_of = [gi for gi, group in enumerate(self.param_groups) for _ in group["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        # What this process holds of each parameter (a DTensor's local shard under FSDP2): all math uses these.
        self._locals = [_local(p.detach()) for p in self._params]
        self._mesh_group = next(
            (p.device_mesh.get_group() for p in self._params if _DTensor is not None and isinstance(p, _DTensor)), None
        )
        self._check_params()
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
        segments = split([p.numel() for p in self._locals], self.ratio, self.placement)
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
        for i in pipeline.pieces_of:
            self._handles.append(self._params[i].register_post_accumulate_grad_hook(self._on_grad))
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
        self._handles.append(model.register_state_dict_pre_hook(lambda *args, **kwargs: self.synchronize()))

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
        if not self.sync_gradients or p.grad is None:
            return
        i = self._index[id(p)]
        pipeline = self._pipeline
        if pipeline.phase != "open":
            self._open_step(self._step_args() if self._attach_options["eager"] else None)
        grad = _local(p.grad)
        if not self._attach_options["eager"]:
            self._hook_norms.append(torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32))
        release = self._attach_options["release_grads"] and i in self._fully_cpu
        pipeline.download(i, grad)
        self._hooked.add(i)
        if release:
            self.released_grad_bytes += grad.numel() * grad.element_size()
            p.grad = None

    def _open_step(self, args: StepArgs | None) -> None:
        """A step's first gradient is about to go down (`args`: eager, the worker may start at once)."""
        self._pipeline.open(args)
        self._hook_norms, self._hooked, self.released_grad_bytes = [], set(), 0

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
        pipeline = self._pipeline
        if pipeline is not None and pipeline.phase != "open":
            self._open_step(None)
        with_grad = self._with_grad()
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
        self._step_device([st for st in self._dev if st.seg.index in has_grad], args.groups)
        for i in with_grad:
            self._steps[i] += 1
        if pipeline is not None:
            if self._model is None:
                pipeline.finish()
            elif self._unwaited:
                pipeline.wait(self._unwaited)
        self._end_step()
        return loss

    def _end_step(self) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        """torch.optim layout: per-parameter ``step``, ``exp_avg``, ``exp_avg_sq`` (+ ``master``), on the CPU."""
        self._require_state()
        self.synchronize()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(self._locals):
            if self._steps[i] == 0:
                continue
            full = {key: torch.empty(p.numel(), dtype=torch.float32) for key in ("exp_avg", "exp_avg_sq", "master")}
            for st in self._segments_of[i]:
                s, e = st.seg.start, st.seg.end
                full["exp_avg"][s:e] = st.exp_avg
                full["exp_avg_sq"][s:e] = st.exp_avg_sq
                full["master"][s:e] = st.master
            entry = {"step": torch.tensor(float(self._steps[i]))}
            entry.update({key: full[key].view(p.shape) for key in ("exp_avg", "exp_avg_sq")})
            if p.dtype != torch.float32:
                entry["master"] = full["master"].view(p.shape)
            state[i] = entry
        groups, index = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a TwinFlowAdam, CPUAdam or torch.optim.Adam(W) state dict, under any ratio or placement.

        Everything is checked before anything changes.
        """
        self._require_state()
        self.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups; this optimizer has {len(self.param_groups)}")
        for gi, (saved, ours) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(ours["params"]):
                raise ValueError(
                    f"param group {gi}: state dict has {len(saved['params'])} parameters, optimizer has "
                    f"{len(ours['params'])}"
                )
        id_to_index = {pid: i for i, pid in enumerate(pid for g in groups for pid in g["params"])}
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
        with torch.no_grad():
            for gi, saved in enumerate(groups):
                for key, value in saved.items():
                    if key != "params" and key in self.defaults:
                        self.param_groups[gi][key] = value
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


class _WaitFor:
    """Forward pre-hook: the module's CPU-stepped weights must be back before it runs."""

    def __init__(self, pipeline: HostPipeline, chunk_ids: list[int]) -> None:
        self.pipeline, self.chunk_ids = pipeline, chunk_ids

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.pipeline.wait(self.chunk_ids)


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
