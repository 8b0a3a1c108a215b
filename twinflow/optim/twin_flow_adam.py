"""TwinFlowAdam: a fraction of the parameters steps on the CPU, the rest on the GPU, at once.

This file is the optimizer's face: torch.optim's interface. Each job lives in
its own file: the order of a step (coordinator.py), the split and all of the
state (split_state.py, with one owner per side: host_state.py and
device_side.py), the CPU side's steps (host_side.py and host_modes.py on the
worker of executor.py, with the kernel in ops.py), the step's gradient
multiplier (step_scale.py), the attach() hooks (overlap.py) and
torch.distributed (distributed.py).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from twinflow.base.hparams import ParamsT, adam_defaults, align_group_flags, check_adamw_flags
from twinflow.base.notice import notice_on_first_rank
from twinflow.base.partition import check_placement, check_ratio
from twinflow.device import device_side
from twinflow.host import ops
from twinflow.host.host_modes import check_delay_after
from twinflow.host.staging import check_chunk_bytes
from twinflow.optim import offload_states
from twinflow.optim.overlap import Attachment, resolve
from twinflow.optim.state_map import ParamState, StateMap
from twinflow.plan import IterationProbe, explain
from twinflow.precision.state_owner import OptimizerState
from twinflow.precision.state_precision import check_name as check_state_precision
from twinflow.step.coordinator import StepCoordinator
from twinflow.step.settings import Settings
from twinflow.step.split_state import ENTRY_KEYS, CheckedEntries, check_not_grouped, read_params, validated
from twinflow.step.step_scale import check_max_grad_norm

log = logging.getLogger(__name__)


def _setting(name: str, check: Callable[[Any], object] = lambda v: None, convert: Callable = lambda v: v) -> property:
    """A setting of the coordinator's, read and (checked) written through the optimizer: it may be changed between
    steps, as before; the coordinator re-resolves its plan from it."""

    def get(opt: TwinFlowAdam) -> Any:
        return getattr(opt.coordinator.settings, name)

    def put(opt: TwinFlowAdam, value: Any) -> None:
        check(value)
        opt.coordinator.update(**{name: convert(value)})

    return property(get, put, doc=f"The ``{name}`` the coming steps use (settable between steps).")


def _state_owner(opt: TwinFlowAdam) -> OptimizerState:
    """The optimizer's state, for code that reads or writes it as it is kept (a checkpoint): its one interface
    (:class:`twinflow.precision.state_owner.OptimizerState`), whatever the precision and the split."""
    return opt.coordinator.split


class TwinFlowAdam(torch.optim.Optimizer):
    """Adam/AdamW with `ratio` of the parameter elements stepped on the CPU, the rest on the GPU.

    A drop-in for ``torch.optim.AdamW``. The split is exact to the element, in parameter order:
    ``placement="first"`` gives the CPU the first ``ratio`` of the elements, ``"last"`` the last (a tensor at
    the boundary is cut in two); ``ratio="auto"`` chooses at the first ``step()`` from that iteration's measured
    memory and times (:mod:`twinflow.plan`). By default both sides keep fp32 masters and moments: the CPU's in host
    memory, stepped by twinflow's kernel on a worker thread, the device's stepped by torch's fused Adam; bf16/fp16
    parameters receive the rounded result. Plain ``step()`` returns once every weight is back; after
    ``attach(model)`` gradients leave during backward and the next forward waits only for the weights it uses.
    ``max_grad_norm`` clips by one global norm. ``delay_after=n`` (opt-in, not exact): after n exact steps, the
    CPU share's update of each step runs during the next iteration and reaches the weights at its ``step()``
    (one step stale: ZeRO-Offload's delayed parameter update; the CPU stays hidden when clipping). ``state``,
    ``state_dict()`` and ``load_state_dict()`` are torch.optim's (with a ``master`` entry for bf16/fp16
    parameters): state moves to and from ``torch.optim.AdamW`` and across ratios and placements;
    ``synchronize()`` and ``save_checkpoint`` apply a pending delayed update. ``speculate=True`` (attached,
    clipping): the CPU steps as gradients land, out of place, and again from the untouched state when the norm
    clips: bit for bit the exact step (:mod:`twinflow.step.speculation`). ``weights_first=True`` (exact): a step that
    waits for the norm (or a speculative redo) writes the new weights first and commits the state behind them.
    ``state_precision="int8"`` (not exact): 8-bit moments on both sides; "int8_m24": 24-bit masters too.
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
        weights_first: bool = False,
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
        check_chunk_bytes(chunk_bytes)
        check_max_grad_norm(max_grad_norm)
        check_delay_after(delay_after)
        settings = Settings(check_placement(placement), chunk_bytes, num_threads, max_grad_norm, delay_after,
                            check_state_precision(state_precision), bool(speculate), bool(weights_first))  # fmt: skip
        super().__init__(read_params(params), defaults)
        self.memory_margin, self.memory_budget = memory_margin, memory_budget
        # The coordinator reaches the optimizer only weakly: a dropped optimizer is freed (its worker closed) at once.
        this = weakref.ref(self)
        self.coordinator = StepCoordinator(lambda: this().param_groups, settings)
        self.coordinator.on_build.append(lambda: this().split_built())
        self.split_summary: dict[str, Any] | None = None
        self._states.bind(self.coordinator.split)  # its index tells parameters from other keys before 'auto' builds
        self.device, self.state_extras = self.coordinator.split.device, self._states.extras  # (opt.state unsynced)
        self.attachment: Attachment | None = None  # the hooks of attach()
        self.pending_state: Any = None  # loaded before ratio='auto' built: CheckedEntries, or a checkpoint's reader
        self.offload = offload_states.StateOffload()  # what offload_states() moved out, and its host buffer
        self.register_load_state_dict_post_hook(_put_taken_state, prepend=True)
        self.register_state_dict_post_hook(_plain_entries, prepend=True)
        self.auto_decision, self._probe = None, IterationProbe(self.device) if self.auto_ratio else None
        if not self.auto_ratio:
            self.coordinator.build(self.ratio)
        elif self.coordinator.split.params:
            ops.load()  # 'auto' probes the kernel at the first step: build it now, outside any timed step

    def split_built(self) -> None:
        """After every build of the split (at first, ratio='auto', a rebuild): the state map, load, hooks follow."""
        self.split_summary = self.coordinator.summary | {"ratio_requested": "auto" if self.auto_ratio else self.ratio}
        self._states.bind(self.coordinator.split)
        if self.attachment is not None:  # first: a pending state read from files may fail
            self.attachment.install()
        self.apply_pending_state()  # a state dict loaded before ratio='auto' built the state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim's (a parameter in two groups refused by name); it joins the split at the next step."""
        check_not_grouped(self.param_groups, param_group)
        super().add_param_group(param_group)
        if hasattr(self, "coordinator"):  # torch's __init__ adds the first groups before the coordinator exists
            self.coordinator.groups_added = True

    placement = _setting("placement", check_placement)
    chunk_bytes = _setting("chunk_bytes", check_chunk_bytes)
    num_threads = _setting("num_threads")
    max_grad_norm = _setting("max_grad_norm", check_max_grad_norm)
    delay_after = _setting("delay_after", check_delay_after)
    state_precision = _setting("state_precision", check_state_precision)
    speculate = _setting("speculate", convert=bool)
    weights_first = _setting("weights_first", convert=bool)
    state_owner = property(_state_owner)

    @property
    def attached(self) -> bool:
        """Whether ``attach()`` overlaps the CPU share with backward and the next forward."""
        return self.attachment is not None

    @property
    def released_grad_bytes(self) -> int:
        """Device gradient memory handed back during the last backward (attach with release_grads)."""
        return self.coordinator.notes.released_bytes(self.coordinator.split.locals)

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped for an inf/NaN gradient."""
        return self.coordinator.skipped_steps

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm the last ``max_grad_norm`` step measured."""
        return self.coordinator.last_grad_norm

    @property
    def sync_gradients(self) -> bool:
        """False inside ``no_sync()``: gradients accumulate on the device and are not streamed."""
        return self.coordinator.sync_gradients

    # ---------------------------------------------------------------- overlap
    def attach(self, model: torch.nn.Module, *, release_grads: bool = True, eager: bool | None = None) -> TwinFlowAdam:
        """Overlaps the CPU share with the model's backward and next forward (how: :mod:`twinflow.optim.overlap`).

        Gradients leave for the host as backward finishes them (``release_grads``: the device memory of a
        gradient wholly owned by the CPU is handed back); the next forward waits, module by module, only for
        the weights it uses, also under ``torch.compile``. ``eager`` (default: on unless ``max_grad_norm`` is
        set or the model is fp16) lets the CPU step while backward still runs, so no gradient may change after
        backward: clip with ``max_grad_norm``. With gradient accumulation, run every backward but the last of a
        window inside ``with optimizer.no_sync():``; a forward between backward and ``step()`` needs
        ``eager=False``. Under DDP and FSDP2 gradients stream once reduced. Not supported: ``torch.amp.GradScaler``
        (fp16 gets its own overflow skipping).
        """
        if self.attachment is not None:
            raise RuntimeError("TwinFlowAdam.attach() was already called; call detach() first")
        needs_all_grads = self.max_grad_norm is not None or self.delay_after is not None
        notes = resolve(self.coordinator.split, model, needs_all_grads, release_grads, eager)
        self.coordinator.attach(notes)
        self.attachment = Attachment(self.coordinator, model)
        if self.ratio is None:
            self._probe.attach(model)
        else:
            self.attachment.install()
        self.coordinator.speculation.warn_if_idle(final=False)
        return self

    def detach(self) -> None:
        """Removes the hooks of ``attach()``; steps are plain again."""
        self.coordinator.detach()
        if self.attachment is not None:
            self.attachment.remove()
        self.attachment = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of backward passes inside accumulate on the GPU and are not streamed (DDP's ``no_sync``)."""
        previous, self.coordinator.sync_gradients = self.coordinator.sync_gradients, False
        try:
            yield
        finally:
            self.coordinator.sync_gradients = previous

    def weights_changed(self) -> None:
        """Call after writing weights through ``.data`` (``synchronize()`` first when attached): masters follow;
        a pending delayed update is dropped, not written over the new weights."""
        self.coordinator.weights_changed()

    def synchronize(self) -> None:
        """Waits until every weight of the last step is back on the device (the current stream sees it); a
        delayed update still pending is applied now."""
        self.coordinator.synchronize()

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step on both sides. Plain: returns once every weight is back (device work in stream order).
        After ``attach()``: once the device step is queued; the next forward waits for the weights it uses."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        c = self.coordinator
        self.offload.check("step()")
        args = c.step_args()  # checks the hyper-parameters before anything moves
        c.speculation.warn_if_idle(final=True)
        if (self.ratio is None and self._choose_ratio() is None) or c.rebuild_if_needed():
            args = c.step_args()  # the state was built (a pending load sets its step counts) or rebuilt
        c.step(args)
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips all gradients (both sides) by one global norm in the coming ``step()``, without a host
        synchronisation; returns the total norm, as ``torch.nn.utils.clip_grad_norm_`` does."""
        self.coordinator.notes.refuse_after_eager("clip_grad_norm_")
        return self.coordinator.clip(max_norm, norm_type)

    def unscale_(self, inv_scale: float) -> None:
        """Loss scaling: every gradient of the coming step is multiplied by `inv_scale` (1 / loss scale).
        Call it before ``clip_grad_norm_`` (or a ``max_grad_norm`` step): clipping measures unscaled gradients."""
        self.coordinator.notes.refuse_after_eager("unscale_")
        self.coordinator.scale.unscale(inv_scale)

    def _choose_ratio(self) -> None:
        """ratio="auto": measure, decide, build the state (first step only)."""
        split, notes = self.coordinator.split, self.coordinator.notes
        self.auto_decision = self._probe.decide(
            [x for x, p in zip(split.locals, split.params) if p.requires_grad],  # FSDP2: its shards
            upcast_elements=device_side.UPCAST_ELEMENTS, placement=self.placement, eager=notes.eager,
            release_grads=notes.release_grads, margin=self.memory_margin, budget=self.memory_budget,
            num_threads=self.num_threads, delayed=self.delay_after is not None,
            speculative=self.coordinator.speculation.planned, state_precision=self.state_precision,
            weights_first=self.weights_first, sharded=split.mesh_group is not None,
        )  # fmt: skip
        self.ratio, _ = self.auto_decision["ratio"], self._probe.detach()
        notice_on_first_rank("%s", explain(self.auto_decision))  # the whole decision stays in self.auto_decision
        self.coordinator.build(self.ratio)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim's; also forgets gradients already streamed to the host for a step not yet taken."""
        offload_states.before_zero_grad(self, set_to_none)  # gradients offloaded: dropped, or a clear refusal
        try:
            self.coordinator.zero_grad()  # a clipping coefficient of a step never taken must not reach the next one
        finally:  # a worker's error is raised here, once the step is abandoned and the gradients cleared
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
        split = self.coordinator.split  # while offloaded, read where the state is (host memory)
        split.check_settled()
        split.settle_state()
        split.absorb_edits()  # in-place writes to opt.state's copies, in the precision the state keeps
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's ``load_state_dict`` (its hooks run) of a TwinFlowAdam, CPUAdam or torch Adam(W) state
        dict, under any ratio or placement (with ratio='auto', before the first step: applied once it builds the
        state); everything is checked before anything changes."""
        self.offload.check("load_state_dict()")
        self.coordinator.split.check_settled(unbuilt_ok=True)
        self.synchronize()
        # Ours runs after every user pre-hook (they may rewrite the state dict); the tensors go straight into our
        # buffers instead of through torch's per-parameter cast, which would put the CPU share's state on the GPU.
        handle = self.register_load_state_dict_pre_hook(_take_state)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()

    def take_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Checks twinflow's entries of `state_dict` and keeps them for :meth:`apply_pending_state`; returns the
        rest for torch (keys of the user's own, kept as torch keeps them)."""
        self.pending_state = validated(self.coordinator.split, state_dict, self.param_groups)
        return {**state_dict, "state": {k: _not_ours(e) for k, e in state_dict["state"].items()}}

    def apply_pending_state(self) -> None:
        """The entries :meth:`take_state` checked go into the buffers (kept for the build under ratio='auto')."""
        if self.pending_state is not None and self.coordinator.split.built:
            taken, self.pending_state = self.pending_state, None
            taken.put_into(self.coordinator.split)

    def __getstate__(self) -> dict[str, Any]:
        """What a copy needs: settings, param groups and each stepped parameter's state (not the attachment)."""
        return _pickled(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        entries = _restored(self, state)  # first: an unpickled optimizer has no state map before it
        self._states.restore(entries)

    def offload_states(self, include: Any = ("optimizer", "grads"), weights: bool = False) -> int:
        """Frees the device for another phase (an RL rollout): the device share's state and the gradients (and the
        weights, `weights=True`) move to one reused host buffer; returns the bytes (:mod:`.offload_states`)."""
        return offload_states.offload(self, include, weights)

    def reload_states(self) -> int:
        """Brings back what :meth:`offload_states` moved, into the same tensors; returns the bytes."""
        return offload_states.reload(self)


def _restored(opt: TwinFlowAdam, state: dict[str, Any]) -> dict[Any, Any]:
    """``__setstate__`` but for ``opt.state``'s own entries, which it returns: torch's load passes the loaded
    groups this way; a copy or an unpickling passes ours."""
    ours = state.get("twinflow")
    if ours is None:  # torch's load_state_dict passes the loaded groups, and the entries beyond ours, this way
        loaded = state.pop("state", {})
        torch.optim.Optimizer.__setstate__(opt, state)
        align_group_flags(opt.param_groups, opt.defaults)
        return loaded
    settings = {k: v for k, v in ours["settings"].items() if k != "auto_ratio"}  # pickled before 0.1.0's split
    settings["ratio"] = "auto" if settings["ratio"] is None else settings["ratio"]
    hyper = {k: state["defaults"][k] for k in _HYPER}
    TwinFlowAdam.__init__(opt, state["param_groups"], **hyper, **settings)
    opt.coordinator.skipped_steps = ours["skipped_steps"]
    split = opt.coordinator.split
    if ours["state"]:  # applied now where the state is built; under ratio='auto' still to decide, by its build
        opt.pending_state = CheckedEntries(ours["state"])
        opt.apply_pending_state()
    per_param, other = ours.get("extras", ({}, {}))
    return {**other, **{split.params[i]: entry for i, entry in per_param.items()}}


_HYPER = ("lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction")
_SETTINGS = (
    "ratio", "placement", "chunk_bytes", "num_threads", "max_grad_norm", "delay_after", "speculate", "weights_first",
    "state_precision", "memory_margin", "memory_budget",
)  # fmt: skip


def _pickled(opt: TwinFlowAdam) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    split = opt.coordinator.split
    if split.built:  # ratio='auto' not decided yet: nothing stepped
        split.check_settled()  # between backward and step() the CPU may still be writing the state
        opt.synchronize()
        state = {i: {k: v.clone() for k, v in e.items()} for i, e in split.export().items()}
    elif opt.pending_state is not None:  # loaded, waiting for that build: the copy holds it too
        state = opt.pending_state.copied()  # (the user's own keys travel in the extras below)
    settings = {key: getattr(opt, key) for key in _SETTINGS}
    ours = {"settings": settings, "state": state, "skipped_steps": opt.skipped_steps, "extras": opt.state.extras()}
    return {"defaults": opt.defaults, "param_groups": opt.param_groups, "twinflow": ours}


def _not_ours(entry: Any) -> Any:
    """A state dict entry without twinflow's keys (what torch keeps of it)."""
    return {n: v for n, v in entry.items() if n not in ENTRY_KEYS} if isinstance(entry, dict) else entry


def _take_state(opt: TwinFlowAdam, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The last load_state_dict pre-hook (see :meth:`TwinFlowAdam.take_state`)."""
    return opt.take_state(state_dict)


def _put_taken_state(opt: TwinFlowAdam) -> None:
    """The first load_state_dict post-hook: the checked entries go into the buffers, once torch has taken the
    param groups."""
    opt.apply_pending_state()


def _plain_entries(opt: TwinFlowAdam, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The first state_dict post-hook: each parameter's entry as a plain dict (``torch.load(weights_only=True)``
    reads plain containers only), its tensors those ``opt.state`` holds."""
    state_dict["state"] = {k: dict(v) if isinstance(v, ParamState) else v for k, v in state_dict["state"].items()}
    return state_dict
