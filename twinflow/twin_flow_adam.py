"""TwinFlowAdam: a fraction of the parameters steps on the CPU, the rest on the GPU, at once.

This file is the optimizer's face: torch.optim's interface and the order of a
step. Each job lives in its own file: the split and all of the state
(split_state.py), the CPU side (pipeline.py, with the kernel in ops.py), the
device side (device_side.py), the step's gradient multiplier (step_scale.py),
the attach() hooks (overlap.py) and torch.distributed (distributed.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from twinflow import device_side, ops, speculation
from twinflow.compact import check_state_precision
from twinflow.cpu_adam import ParamsT, adam_defaults, align_group_flags, check_adamw_flags
from twinflow.notice import notice
from twinflow.overlap import Attachment
from twinflow.partition import check_placement, check_ratio
from twinflow.pipeline import StepArgs, check_chunk_bytes, check_delay_after
from twinflow.speculation import SpeculationPolicy
from twinflow.split_state import ENTRY_KEYS, SplitState, refresh_moved_masters, validated
from twinflow.state_map import ParamState, StateMap
from twinflow.step_scale import StepScale, check_max_grad_norm
from twinflow.tune import IterationProbe, explain

log = logging.getLogger(__name__)


class TwinFlowAdam(torch.optim.Optimizer):
    """Adam/AdamW with `ratio` of the parameter elements stepped on the CPU, the rest on the GPU.

    A drop-in for ``torch.optim.AdamW``. The split is exact to the element, in parameter order:
    ``placement="first"`` gives the CPU the first ``ratio`` of the elements, ``"last"`` the last (a tensor at
    the boundary is cut in two); ``ratio="auto"`` chooses at the first ``step()`` from that iteration's measured
    memory and times (:mod:`twinflow.tune`). Both sides keep fp32 masters and moments: the CPU's in host memory,
    stepped by twinflow's kernel on a worker thread, the device's stepped by torch's fused Adam; bf16/fp16
    parameters receive the rounded result. Plain ``step()`` returns once every weight is back; after
    ``attach(model)`` gradients leave during backward and the next forward waits only for the weights it uses.
    ``max_grad_norm`` clips by one global norm. ``delay_after=n`` (opt-in, not exact): after n exact steps, the
    CPU share's update of each step runs during the next iteration and reaches the weights at its ``step()``
    (one step stale: ZeRO-Offload's delayed parameter update; the CPU stays hidden when clipping). ``state``,
    ``state_dict()`` and ``load_state_dict()`` are torch.optim's (with a ``master`` entry for bf16/fp16
    parameters): state moves to and from ``torch.optim.AdamW`` and across ratios and placements;
    ``synchronize()`` and ``save_checkpoint`` apply a pending delayed update. ``speculate=True`` (attached,
    clipping): the CPU steps as gradients land, out of place, and again from the untouched state when the norm
    clips: bit for bit the exact step (:mod:`twinflow.speculation`). ``state_precision="int8"`` (opt-in, not
    exact): the CPU's moments in 8 bits, 6 bytes a parameter; "int8_m24": and 24-bit masters, 5 (:mod:`.compact`).
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
        delay_after: int | None = None,
        speculate: bool = False,
        state_precision: str = "fp32",
        memory_margin: float = 0.1,
        memory_budget: int | None = None,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        check_adamw_flags(amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused, capturable=capturable,
                          differentiable=differentiable)  # fmt: skip
        defaults = adam_defaults(lr, betas, eps, weight_decay, adamw_mode, bias_correction, num_threads)
        self.auto_ratio = ratio == "auto"
        self.ratio = None if self.auto_ratio else check_ratio(ratio)
        self.placement = check_placement(placement)
        self.state_precision = check_state_precision(state_precision)
        check_chunk_bytes(chunk_bytes)
        check_max_grad_norm(max_grad_norm)
        check_delay_after(delay_after)
        super().__init__(params, defaults)
        self.chunk_bytes, self.num_threads, self.max_grad_norm = chunk_bytes, num_threads, max_grad_norm
        self.delay_after, self.speculate = delay_after, bool(speculate)
        self._speculation, self.memory_margin, self.memory_budget = SpeculationPolicy(), memory_margin, memory_budget
        self._split, self._groups_added = SplitState(self.param_groups, self.state_precision), False
        self._states.bind(self._split)  # its index tells parameters from other keys before ratio='auto' builds
        self.device = self._split.device
        self._scale = StepScale(self.device, self._split.mesh_group)
        self._attachment: Attachment | None = None
        self._taken_state: dict[int, dict[str, torch.Tensor]] | None = None  # see _take_state
        self.register_load_state_dict_post_hook(_put_taken_state, prepend=True)
        self.register_state_dict_post_hook(_plain_entries, prepend=True)
        self.sync_gradients, self.skipped_steps = True, 0  # skipped: fp16 steps with an inf/NaN gradient
        self.auto_decision, self._probe = None, IterationProbe(self.device) if self.auto_ratio else None
        if not self.auto_ratio:
            self._build()
        elif self._split.params:
            ops.load()  # 'auto' probes the kernel at the first step: build it now, outside any timed step

    def _build(self) -> None:
        self.split_summary = self._split.build(self.ratio, self.placement, self.chunk_bytes, self.num_threads)
        self.split_summary["ratio_requested"] = "auto" if self.auto_ratio else self.ratio
        self._states.bind(self._split)
        _put_taken_state(self)  # a state dict loaded before ratio='auto' built the state
        if self._attachment is not None:
            self._attachment.install()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim's; the new parameters join the split at the next step (the state so far is kept)."""
        super().add_param_group(param_group)
        self._groups_added = hasattr(self, "_split")  # torch's __init__ adds the first groups before the split

    def _rebuild_if_needed(self) -> bool:
        """A new split, keeping every stepped parameter's state, once groups were added or a frozen one unfrozen."""
        old = self._split
        if self.ratio is None or old.step_open or not (self._groups_added or old.needs_rebuild()):
            return False
        self.synchronize()
        self._split, self._groups_added = SplitState(self.param_groups, self.state_precision), False
        self._scale.mesh_group = self._split.mesh_group
        self._build()
        self._split.take_over(old)
        return True

    @property
    def attached(self) -> bool:
        """Whether ``attach()`` overlaps the CPU share with backward and the next forward."""
        return self._attachment is not None

    @property
    def released_grad_bytes(self) -> int:
        """Device gradient memory handed back during the last backward (attach with release_grads)."""
        return self._attachment.released_grad_bytes if self._attachment is not None else 0

    # ---------------------------------------------------------------- overlap
    def attach(self, model: torch.nn.Module, *, release_grads: bool = True, eager: bool | None = None) -> TwinFlowAdam:
        """Overlaps the CPU share with the model's backward and next forward (how: :mod:`twinflow.overlap`).

        Gradients leave for the host as backward finishes them (``release_grads``: the device memory of a
        gradient wholly owned by the CPU is handed back); the next forward waits, module by module, only for
        the weights it uses, also under ``torch.compile``. ``eager`` (default: on unless ``max_grad_norm`` is
        set or the model is fp16) lets the CPU step while backward still runs, so no gradient may change after
        backward: clip with ``max_grad_norm``. With gradient accumulation, run every backward but the last of a
        window inside ``with optimizer.no_sync():``; a forward between backward and ``step()`` needs
        ``eager=False``. Under DDP and FSDP2 gradients stream once reduced. Not supported: ``torch.amp.GradScaler``
        (fp16 gets its own overflow skipping).
        """
        if self._attachment is not None:
            raise RuntimeError("TwinFlowAdam.attach() was already called; call detach() first")
        self._attachment = Attachment(self, model, release_grads, eager)
        if self.ratio is None:
            self._probe.attach(model)
        else:
            self._attachment.install()
        speculation.warn_if_idle(self, final=False)
        return self

    def detach(self) -> None:
        """Removes the hooks of ``attach()``; steps are plain again."""
        self.synchronize()
        if self._attachment is not None:
            self._attachment.remove()
        self._attachment = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of backward passes inside accumulate on the GPU and are not streamed (DDP's ``no_sync``)."""
        previous, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = previous

    def weights_changed(self) -> None:
        """Call after writing weights through ``.data`` (``synchronize()`` first when attached): masters follow;
        a pending delayed update is dropped, not written over the new weights."""
        self._split.forget_written(drop_pending=True)

    def synchronize(self) -> None:
        """Waits until every weight of the last step is back on the device (the current stream sees it); a
        delayed update still pending is applied now."""
        self._split.settle()

    # ------------------------------------------------------------------- step
    def _step_args(self) -> StepArgs:
        self._split.absorb_edits()  # a step count written in place into opt.state counts from this step on
        return StepArgs.of(self.param_groups, [s + 1 for s in self._split.steps])  # checks the hyper-parameters

    def _open_step(self, args: StepArgs | None, speculative: bool = False) -> None:
        """A step's first gradient is about to go down (`args`: the worker may start at once)."""
        self._split.open(args, speculative)
        self._scale.forget_norms()
        if self._attachment is not None:
            self._attachment.open_step()

    def _end_step(self) -> None:
        self._scale.reset()
        if self._attachment is not None:
            self._attachment.end_step()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step on both sides. Plain: returns once every weight is back (device work in stream order).
        After ``attach()``: once the device step is queued; the next forward waits for the weights it uses."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        args = self._step_args()  # checks the hyper-parameters before anything moves
        speculation.warn_if_idle(self, final=True)
        if (self.ratio is None and self._choose_ratio() is None) or self._rebuild_if_needed():
            args = self._step_args()  # the state was built (a pending load sets its step counts) or rebuilt
        split = self._split
        pipeline = split.pipeline
        if pipeline is None:
            refresh_moved_masters(split)
        elif pipeline.phase != "open":
            self._open_step(None)
        streamed = self._attachment.streamed if self._attachment is not None else set()
        with_grad = split.with_grad(streamed)
        if self._attachment is not None:
            self._attachment.check_grads_untouched(with_grad)
        fp16 = any(split.params[i].dtype == torch.float16 for i in with_grad)
        if fp16 and self._scale.overflow(split.grads_on_device(streamed), bool(streamed)):
            log.warning("inf/NaN gradient in an fp16 model: step skipped on both sides")
            self.skipped_steps += 1
            if pipeline is not None:
                pipeline.discard()
            self._end_step()
            return loss
        if self.max_grad_norm is not None and not self._scale.clipped:
            self.last_grad_norm = self._scale.clip(self.max_grad_norm, 2.0, split.grads_on_device(streamed),
                                                   bool(streamed))  # fmt: skip
        if pipeline is not None:  # under eager overlap, the arguments the CPU share has been stepping with
            args = pipeline.seal(args, self._scale.for_cpu, split.delaying(self.delay_after))
        split.step_device(with_grad, args.groups, self._scale.coef)
        if pipeline is not None:
            if self._attachment is None:
                pipeline.finish()
            elif self._attachment.unwaited:
                pipeline.wait(self._attachment.unwaited)
        self._end_step()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips all gradients (both sides) by one global norm in the coming ``step()``, without a host
        synchronisation; returns the total norm, as ``torch.nn.utils.clip_grad_norm_`` does."""
        if self._attachment is not None:
            self._attachment.refuse_after_eager("clip_grad_norm_")
        streamed = self._attachment.streamed if self._attachment is not None else set()
        return self._scale.clip(max_norm, norm_type, self._split.grads_on_device(streamed), bool(streamed))

    def unscale_(self, inv_scale: float) -> None:
        """Loss scaling: every gradient of the coming step is multiplied by `inv_scale` (1 / loss scale).
        Call it before ``clip_grad_norm_`` (or a ``max_grad_norm`` step): clipping measures unscaled gradients."""
        if self._attachment is not None:
            self._attachment.refuse_after_eager("unscale_")
        self._scale.unscale(inv_scale)

    def _choose_ratio(self) -> None:
        """ratio="auto": measure, decide, build the state (first step only)."""
        a = self._attachment
        self.auto_decision = self._probe.decide(
            [x for x, p in zip(self._split.locals, self._split.params) if p.requires_grad],  # FSDP2: its shards
            upcast_elements=device_side.UPCAST_ELEMENTS, placement=self.placement, eager=a is not None and a.eager,
            release_grads=a is not None and a.release_grads, margin=self.memory_margin, budget=self.memory_budget,
            num_threads=self.num_threads, delayed=self.delay_after is not None, speculative=speculation.planned(self),
            state_precision=self.state_precision,
        )  # fmt: skip
        self.ratio, _ = self.auto_decision["ratio"], self._probe.detach()
        notice("%s", explain(self.auto_decision))  # the whole decision stays in self.auto_decision
        self._build()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim's; also forgets gradients already streamed to the host for a step not yet taken."""
        if self._split.step_open:
            self._split.pipeline.reset()
        self._end_step()  # a clipping coefficient of a step never taken must not reach the next one
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> StateMap:
        """Per-parameter state as torch.optim keeps it (``step``, ``exp_avg``, ``exp_avg_sq``, ``master``), read
        once the CPU share's last step has finished; it keeps what is written into it (:mod:`.state_map`)."""
        self._states.sync()
        return self._states

    @state.setter
    def state(self, value: dict) -> None:
        self.__dict__.setdefault("_states", StateMap())  # torch's __init__ assigns an empty defaultdict first
        self._states.replace(value)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's ``state_dict`` (its hooks run), once the CPU share's last step has finished; it loads
        under another ratio or placement and into ``torch.optim.AdamW`` (which ignores ``master``)."""
        self._split.check_settled()
        self._split.settle_state()
        self._split.absorb_edits()  # in-place writes to opt.state's copies, in the precision the state keeps
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's ``load_state_dict`` (its hooks run) of a TwinFlowAdam, CPUAdam or torch Adam(W) state
        dict, under any ratio or placement (with ratio='auto', before the first step: applied once it builds the
        state); everything is checked before anything changes."""
        self._split.check_settled(unbuilt_ok=True)
        self.synchronize()
        # Ours runs after every user pre-hook (they may rewrite the state dict); the tensors go straight into our
        # buffers instead of through torch's per-parameter cast, which would put the CPU share's state on the GPU.
        handle = self.register_load_state_dict_pre_hook(_take_state)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()

    def __getstate__(self) -> dict[str, Any]:
        """What a copy needs: settings, param groups and each stepped parameter's state (not the attachment)."""
        return _pickled(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        _unpickle(self, state)


_HYPER = ("lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction")
_SETTINGS = (
    "ratio", "placement", "chunk_bytes", "num_threads", "max_grad_norm", "delay_after", "speculate", "state_precision",
    "memory_margin", "memory_budget",
)  # fmt: skip


def _pickled(opt: TwinFlowAdam) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    if opt._split.built:  # ratio='auto' not decided yet: nothing stepped
        opt.synchronize()
        state = {i: {k: v.clone() for k, v in e.items()} for i, e in opt._split.export().items()}
    settings = {key: getattr(opt, key) for key in _SETTINGS}
    per_param, other = opt.state.extras()
    ours = {"settings": settings, "state": state, "skipped_steps": opt.skipped_steps, "extras": (per_param, other)}
    return {"defaults": opt.defaults, "param_groups": opt.param_groups, "twinflow": ours}


def _unpickle(opt: TwinFlowAdam, state: dict[str, Any]) -> None:
    ours = state.get("twinflow")
    if ours is None:  # torch's load_state_dict passes the loaded groups, and the entries beyond ours, this way
        loaded = state.pop("state", {})
        torch.optim.Optimizer.__setstate__(opt, state)
        align_group_flags(opt.param_groups, opt.defaults)
        opt._states.restore(loaded)
        return
    settings = {k: v for k, v in ours["settings"].items() if k != "auto_ratio"}  # pickled before 0.1.0's split
    settings["ratio"] = "auto" if settings["ratio"] is None else settings["ratio"]
    hyper = {k: state["defaults"][k] for k in _HYPER}
    TwinFlowAdam.__init__(opt, state["param_groups"], **hyper, **settings)
    opt.skipped_steps = ours["skipped_steps"]
    if ours["state"]:
        opt._split.load(ours["state"])
    per_param, other = ours.get("extras", ({}, {}))
    opt._states.restore({**other, **{opt._split.params[i]: entry for i, entry in per_param.items()}})


def _take_state(opt: TwinFlowAdam, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The last load_state_dict pre-hook: checks twinflow's entries, puts them into the buffers once torch has
    taken the param groups (a post-hook), and hands torch the rest (keys of the user's own, kept as torch keeps
    them)."""
    opt._taken_state = validated(opt._split, state_dict, opt.param_groups)
    rest = {k: ({n: v for n, v in e.items() if n not in ENTRY_KEYS} if isinstance(e, dict) else e)
            for k, e in state_dict["state"].items()}  # fmt: skip
    return {**state_dict, "state": rest}


def _put_taken_state(opt: TwinFlowAdam) -> None:
    """The first load_state_dict post-hook: the entries `_take_state` checked go into the buffers (kept for the
    build under ratio='auto' before the first step)."""
    if opt._taken_state is not None and opt._split.built:
        taken, opt._taken_state = opt._taken_state, None
        opt._split.load(taken)


def _plain_entries(opt: TwinFlowAdam, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The first state_dict post-hook: each parameter's entry as a plain dict (``torch.load(weights_only=True)``
    reads plain containers only), its tensors those ``opt.state`` holds."""
    state_dict["state"] = {k: dict(v) if isinstance(v, ParamState) else v for k, v in state_dict["state"].items()}
    return state_dict
