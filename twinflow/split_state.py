"""TwinFlowAdam's parameters, their split between the CPU and the device, and all of their optimizer state.

One ``SplitState`` is built per plan (at construction, or at the first step
under ``ratio="auto"``) and rebuilt when the parameters change (a group
added, a frozen parameter unfrozen). It owns every parameter's step count,
the CPU side's fp32 masters and moments (three flat host buffers, one slice
per segment, stepped by a ``HostPipeline``) and the device side's, and it
turns them into torch.optim's per-parameter layout and back.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from twinflow import compact, device_side, distributed
from twinflow.partition import SegmentState, split
from twinflow.pipeline import HostPipeline, HostSegment, StepArgs

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENTRY_KEYS = ("step", "exp_avg", "exp_avg_sq", "master")  # a parameter's state in torch.optim's layout


class SplitState:
    """The parameters of `param_groups`, numbered in order; after ``build()``, their split and state."""

    def __init__(self, param_groups: list[dict[str, Any]], precision: str = "fp32") -> None:
        self.precision = precision  # of the CPU share's state: "fp32", "int8" or "int8_m24" (twinflow.compact)
        self.params: list[torch.Tensor] = []
        self.group_of: list[int] = []
        self.index: dict[int, int] = {}  # id(parameter) -> its number
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if id(p) in self.index:
                    raise ValueError(
                        f"parameter {self.index[id(p)]} (shape {tuple(p.shape)}) is a duplicate: it appears "
                        "twice in the param groups; list each parameter once (torch.optim would step it twice)"
                    )
                self.index[id(p)] = len(self.params)
                self.params.append(p)
                self.group_of.append(gi)
        # What this process holds of each parameter (a DTensor's local shard under FSDP2): all math uses these.
        self.locals = [distributed.local(p.detach()) for p in self.params]
        self.mesh_group = distributed.mesh_group(self.params)
        self.device = self.locals[0].device if self.params else torch.device("cpu")
        devices = sorted({str(p.device) for p in self.params})
        if len(devices) > 1:
            raise ValueError(
                f"TwinFlowAdam got parameters on several devices {devices}; it steps the parameters of one "
                "device: build one optimizer per device (or per rank with DDP/FSDP)"
            )
        self.names = [n for g in param_groups for n in g.get("param_names", [None] * len(g["params"]))]
        check_params(self.locals, self.names, self.group_of)
        self.steps = [0] * len(self.params)
        self.has_state = [False] * len(self.params)  # stepped, or given state (a step count of 0 keeps it)
        self.generation = 0  # counts changes of the state's values, except in place through views (opt.state)
        self.handed: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}  # copies given to opt.state: their version
        self.segments_of: list[list[SegmentState]] | None = None  # per parameter; None until build()
        self.pipeline: HostPipeline | None = None

    @property
    def built(self) -> bool:
        return self.segments_of is not None

    @property
    def step_open(self) -> bool:
        """Gradients of a step were streamed to the host and ``step()`` has not run yet."""
        return self.pipeline is not None and self.pipeline.phase == "open"

    def build(self, ratio: float, placement: str, chunk_bytes: int, num_threads: int | None) -> dict[str, Any]:
        """Splits the trainable parameters and creates their state (fresh); returns the split's summary."""
        # Frozen parameters take no part (no state, no hooks): with LoRA most of the model is frozen.
        self.planned = {i for i, p in enumerate(self.params) if p.requires_grad}
        numels = [p.numel() if i in self.planned else 0 for i, p in enumerate(self.locals)]
        segments = split(numels, ratio, placement)
        # Per parameter, its version counter right after the optimizer last wrote it (see refresh_moved_masters).
        self.written = [p._version for p in self.locals]
        self.segments_of = [[] for _ in self.params]
        self.cpu: list[SegmentState] = []
        self.dev: list[SegmentState] = []
        cpu_total = sum(seg.numel for seg in segments if seg.on_cpu)
        # int8: the moments live in the pipeline's pieces, 8-bit (twinflow.compact); the masters stay float32, or
        # (int8_m24) take 24 bits
        if self.precision == "int8_m24":
            host = [compact.Master24.empty(cpu_total)]
        else:
            host = [torch.empty(cpu_total, dtype=torch.float32) for _ in range(3 if self.precision == "fp32" else 1)]
        offset = 0
        with torch.no_grad():
            for seg in segments:
                flat = self.locals[seg.index].view(-1)[seg.start : seg.end]
                if seg.on_cpu:
                    master, exp_avg, exp_avg_sq = [h[offset : offset + seg.numel] for h in host] + [None] * (
                        3 - len(host))  # fmt: skip
                    offset += seg.numel
                    master.copy_(flat)
                    if exp_avg is not None:
                        exp_avg.zero_()
                        exp_avg_sq.zero_()
                    self.cpu.append(SegmentState(seg, master, exp_avg, exp_avg_sq))
                else:
                    self.dev.append(device_side.new_state(seg, flat))
                self.segments_of[seg.index].append(self.cpu[-1] if seg.on_cpu else self.dev[-1])
        # Parameters wholly on the CPU: their device gradient may be released once it is down.
        self.fully_cpu = {i for i, sts in enumerate(self.segments_of) if sts and all(s.seg.on_cpu for s in sts)}
        if self.cpu:
            host_segments = [HostSegment(s.seg.index, s.seg.start, s.seg.end, s.master, s.exp_avg, s.exp_avg_sq)
                             for s in self.cpu]  # fmt: skip
            self.pipeline = HostPipeline(self.locals, self.group_of, host_segments, chunk_bytes, self.device,
                                         num_threads, self.precision)  # fmt: skip
            weakref.finalize(self, self.pipeline.close)
        summary_ = summary(self, ratio, placement)
        log.info("TwinFlowAdam split: %s", summary_)
        return summary_

    def check_settled(self, unbuilt_ok: bool = False) -> None:
        """Raises unless the state exists (`unbuilt_ok`: a load before ratio='auto' builds it waits for the
        build) and no step is half done (before a save or a load)."""
        if not self.built and not unbuilt_ok:
            raise RuntimeError("ratio='auto' is decided at the first step(); there is no state before it")
        if self.step_open:
            raise RuntimeError(
                "TwinFlowAdam's state is in the middle of a step (gradients streamed, step() not called yet); "
                "call step() first, then save or load"
            )

    def delaying(self, delay_after: int | None) -> bool:
        """Whether the coming step's CPU update is delayed: after `delay_after` exact steps."""
        return delay_after is not None and max(self.steps, default=0) >= delay_after

    def needs_rebuild(self) -> bool:
        """A parameter frozen when the split was made now takes gradients."""
        return any(p.requires_grad and i not in self.planned for i, p in enumerate(self.params))

    def take_over(self, old: SplitState) -> None:
        """After a rebuild: every parameter `old` stepped keeps its state here; `old` is closed."""
        kept = {old.params[i]: entry for i, entry in old.export().items()}
        old.close()
        self.load({self.index[id(p)]: entry for p, entry in kept.items()})

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    # ------------------------------------------------------------------- a step
    def open(self, args: StepArgs | None, speculative: bool = False) -> None:
        """A step's first gradient is about to go down (`args`: the worker may start at once)."""
        self.pipeline.open(args, speculative)  # waits for the last step's writes: the masters are settled
        self.absorb_edits(during_step=True)  # before any gradient lands: the worker has not started on this step
        refresh_moved_masters(self)

    def with_grad(self, streamed: set[int]) -> list[int]:
        """The parameters this step updates: those with a gradient, and those whose gradient already streamed.

        Refuses (before anything is stepped) a gradient on a parameter frozen when the split was made, and
        sparse gradients; then sends down the CPU share's gradients not streamed yet.
        """
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None or i in streamed]
        unplanned = [i for i in with_grad if i not in self.planned]
        if unplanned:  # only reachable under attach(): a frozen parameter was unfrozen during this iteration
            raise RuntimeError(
                f"parameter {unplanned[0]} has a gradient but was frozen when TwinFlowAdam split the parameters; "
                "unfreeze parameters before the forward pass (the split is rebuilt there)"
            )
        for i in with_grad:
            g = self.params[i].grad
            if g is not None and g.is_sparse:
                if self.pipeline is not None:
                    self.pipeline.reset()
                name = f" ({self.names[i]!r})" if self.names[i] else ""
                raise TypeError(sparse_gradient_message(f"parameter {i}{name}"))
        if self.pipeline is not None:
            for i in with_grad:
                if i in self.pipeline.pieces_of and not self.pipeline.downloaded(i):
                    self.pipeline.download(i, distributed.local(self.params[i].grad))
        return with_grad

    def grads_on_device(self, streamed: set[int]) -> list[torch.Tensor]:
        """The gradients still on the device: every one but those streamed to the host in backward."""
        grads = [p.grad for i, p in enumerate(self.params) if i not in streamed]
        return [distributed.local(g) for g in grads if g is not None]

    def step_device(self, with_grad: list[int], groups: list[dict[str, Any]], scale: torch.Tensor | None) -> None:
        """Launches the device side's step of `with_grad`, and counts the step of each."""
        has_grad = set(with_grad)
        stepped = [st for st in self.dev if st.seg.index in has_grad]
        device_side.step(stepped, groups, self.group_of, self.locals,
                         lambda i: distributed.local(self.params[i].grad), scale)  # fmt: skip
        for st in stepped:
            self.written[st.seg.index] = self.locals[st.seg.index]._version
        for i in with_grad:
            self.steps[i] += 1
            self.has_state[i] = True
        self.generation += 1
        self.handed.clear()  # copies taken before this step are stale: a later write to one must not land

    def settle(self) -> None:
        """Every update taken so far, a delayed one included, is in the weights (no step half done)."""
        if self.pipeline is not None and not self.step_open:
            self.pipeline.settle()

    def settle_state(self) -> None:
        """Every update taken so far is in the masters and moments (a delayed one's weights may be pending)."""
        if self.pipeline is not None:
            self.pipeline.settle_state()

    def forget_written(self, drop_pending: bool = False) -> None:
        """Every weight counts as changed outside the optimizer: the next refresh copies them all
        (`drop_pending`: a delayed update not applied yet is dropped, not written over the new weights)."""
        if drop_pending and self.pipeline is not None and not self.step_open:
            self.pipeline.finish()
            self.pipeline.drop_late_for(set(self.pipeline.pieces_of), "were changed (weights_changed())")
        self.written = [-1] * len(self.params)
        if self.pipeline is not None:
            self.pipeline.written_version.clear()

    # ------------------------------------------------ torch.optim's layout
    def entry(self, i: int, handed: bool = False) -> dict[str, torch.Tensor]:
        """Parameter i's state in torch.optim's layout (+ ``master`` for low precision).

        Views of the live buffers where the parameter is on one side whole; a copy for the one cut in two, for
        8-bit moments and 24-bit masters. `handed` (``opt.state``): the copies are remembered, so that an
        in-place write to one reaches the buffers before they are next used (:meth:`absorb_edits`).
        """
        p, states = self.locals[i], self.segments_of[i]
        entry, copies = {"step": torch.tensor(float(self.steps[i]))}, ["step"]
        for key in ("exp_avg", "exp_avg_sq") + (("master",) if p.dtype != torch.float32 else ()):
            if len(states) == 1 and isinstance(getattr(states[0], key), torch.Tensor):
                entry[key] = getattr(states[0], key).view(p.shape)
                continue
            full = torch.empty(p.numel(), dtype=torch.float32)
            for st in states:
                value = getattr(st, key)  # None: 8-bit moments, decoded from the pipeline's pieces
                if value is None:
                    value = self.pipeline.moment(i, key)
                elif isinstance(value, compact.Master24):
                    value = value.float()
                full[st.seg.start : st.seg.end] = value
            entry[key] = full.view(p.shape)
            copies.append(key)
        if handed:
            self.handed.update({(i, key): (entry[key], entry[key]._version) for key in copies})
        return entry

    def stepped(self, i: int) -> bool:
        """Whether parameter i has state: it was stepped (or given state) and takes part in the split."""
        return self.has_state[i] and bool(self.segments_of[i])

    def export(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every stepped parameter's entry, by index."""
        self.absorb_edits()
        return {i: self.entry(i) for i in range(len(self.params)) if self.stepped(i)}

    def absorb_edits(self, during_step: bool = False) -> None:
        """In-place writes to the copies ``opt.state`` was given reach the buffers (a view's writes already did).

        Refused once a step has taken gradients (`during_step`: its opening, before any has landed): the CPU
        share may be stepping those buffers. The write is dropped and the error says when to write instead.
        """
        for (i, key), (copy, version) in list(self.handed.items()):
            if copy._version == version:
                continue
            if self.step_open and not during_step:
                del self.handed[(i, key)]
                raise RuntimeError(
                    f"opt.state[p][{key!r}] of parameter {i} was written in place while a step was under way "
                    "(after backward's first gradient, before step()); the write is dropped: the CPU share may "
                    "already be stepping that state. Write opt.state before backward, or after step() (when "
                    "attached, after opt.synchronize())"
                )
            self.handed[(i, key)] = (copy, copy._version)
            self.put(i, {key: copy}, (key,), weights_follow=False)

    @torch.no_grad()
    def load(self, loaded: dict[int, dict[str, torch.Tensor]]) -> None:
        """Sets every parameter's state from `loaded` (by index; absent: fresh), and its weights from a master."""
        self.handed.clear()  # copies of the state being replaced
        for i in range(len(self.params)):
            self.put(i, loaded.get(i))

    @torch.no_grad()
    def put(
        self, i: int, entry: dict[str, Any] | None, keys: tuple[str, ...] = ENTRY_KEYS, weights_follow: bool = True
    ) -> None:
        """Writes `keys` of parameter i's state from `entry` (None: fresh, the master from the weight); a master
        written also sets the weight, rounded to its dtype (`weights_follow`; otherwise at the next step, as for
        an in-place write to a master that is a view)."""
        p = self.locals[i]
        if entry is None:
            flat: dict[str, Any] = {"step": 0, "exp_avg": None, "exp_avg_sq": None, "master": p.reshape(-1)}
        else:
            flat = {k: entry[k].reshape(-1) for k in keys if k in entry and k != "step"}
            if "master" in keys and "master" not in flat:
                flat["master"] = p.reshape(-1)
            if "step" in keys:
                flat["step"] = int(entry["step"])
        if "step" in flat:
            self.steps[i] = flat["step"]
        self.has_state[i] = entry is not None
        both = None  # 8-bit moments encode together: the one not written is kept as it is
        if any(st.exp_avg is None for st in self.segments_of[i]) and ("exp_avg" in flat or "exp_avg_sq" in flat):
            kept = self.entry(i) if "exp_avg" not in flat or "exp_avg_sq" not in flat else {}
            both = [flat[k] if k in flat else kept[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")]
        for st in self.segments_of[i]:
            s, e = st.seg.start, st.seg.end
            if st.exp_avg is None and both is not None:
                self.pipeline.set_moments(i, *both)
            for key in ("exp_avg", "exp_avg_sq") if st.exp_avg is not None else ():
                if key in flat:
                    target = getattr(st, key)
                    target.copy_(flat[key][s:e]) if flat[key] is not None else target.zero_()
            if "master" in flat and st.master.data_ptr() != p.data_ptr() + s * p.element_size():
                st.master.copy_(flat["master"][s:e])
            if "step" in flat and st.device_step is not None:
                st.device_step.fill_(self.steps[i])
        if weights_follow and entry is not None and "master" in keys and "master" in entry:
            p.copy_(entry["master"].view(p.shape))
        self.written[i] = p._version
        self.generation += 1


def validated(
    split: SplitState, state_dict: dict[str, Any], param_groups: list[dict]
) -> dict[int, dict[str, torch.Tensor]]:
    """The state dict's per-parameter entries by our index, checked (raises before anything changes)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError(f"state dict has {len(groups)} param groups; this optimizer has {len(param_groups)}")
    for gi, (saved, ours) in enumerate(zip(groups, param_groups)):
        if len(saved["params"]) != len(ours["params"]):
            raise ValueError(
                f"param group {gi}: state dict has {len(saved['params'])} parameters, optimizer has "
                f"{len(ours['params'])}"
            )
    ours = [split.index[id(p)] for group in param_groups for p in group["params"]]
    id_to_index = dict(zip((pid for g in groups for pid in g["params"]), ours))
    loaded: dict[int, dict[str, torch.Tensor]] = {}
    for pid, entry in state_dict["state"].items():
        if not isinstance(entry, dict) or not any(key in entry for key in ENTRY_KEYS):
            continue  # not Adam state (a key of the user's own, or an entry with only such keys): torch keeps it
        if pid not in id_to_index:
            raise ValueError(f"state dict has state for parameter {pid!r}, which none of its param groups lists")
        i = id_to_index[pid]
        missing = [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in entry]
        if missing:
            raise ValueError(
                f"state of parameter {i}: no {missing[0]!r} entry (an Adam state has step, exp_avg and "
                "exp_avg_sq); the state dict is incomplete or not from an Adam-family optimizer"
            )
        for key in ("exp_avg", "exp_avg_sq") + (("master",) if "master" in entry else ()):
            if not isinstance(entry[key], torch.Tensor):
                raise TypeError(f"state of parameter {i}: {key} is a {type(entry[key]).__name__}; expected a tensor")
            if entry[key].numel() != split.locals[i].numel():
                raise ValueError(f"state of parameter {i}: {key} has {entry[key].numel()} elements, expected "
                                 f"{split.locals[i].numel()}")  # fmt: skip
        loaded[i] = entry
    return loaded


def summary(split: SplitState, ratio: float, placement: str) -> dict[str, Any]:
    """The split's figures: elements and state bytes a side, the ratio achieved, pinned bytes, chunks."""

    def side(states: list[SegmentState]) -> dict[str, int]:
        elements = sum(st.seg.numel for st in states)  # state: fp32 master, exp_avg, exp_avg_sq
        return {"tensors": len({st.seg.index for st in states}), "elements": elements, "state_bytes": 12 * elements}

    cpu, dev = side(split.cpu), side(split.dev)
    cpu["state_precision"] = split.precision
    if split.pipeline is not None:
        cpu["state_bytes"] = split.pipeline.state_bytes
    total = cpu["elements"] + dev["elements"]
    return {
        "ratio_requested": ratio,
        "ratio_achieved": cpu["elements"] / total if total else 0.0,
        "placement": placement,
        "cpu": cpu,
        "device": dev | {"device": str(split.device)},
        "pinned_bytes": split.pipeline.pinned_bytes if split.pipeline else 0,
        "chunks": len(split.pipeline.chunks) if split.pipeline else 0,
    }


def sparse_gradient_message(what: str) -> str:
    """The refusal of a sparse gradient (`what`: the parameter or module that has one), with the fix."""
    return (
        f"{what} has a sparse gradient; TwinFlowAdam needs dense gradients: build the module with sparse=False "
        "(nn.Embedding(..., sparse=False)), or step that parameter with an optimizer for sparse gradients "
        "(torch.optim.SparseAdam)"
    )


def check_params(locals_: list[torch.Tensor], names: list[str | None], group_of: list[int]) -> None:
    """Raises, naming the first parameter twinflow cannot step (its dtype, or not contiguous), with the fix."""
    for i, p in enumerate(locals_):
        if p.dtype not in _DTYPES:
            name = f" {names[i]!r}" if names[i] else ""
            raise TypeError(
                f"parameter {i}{name} (shape {tuple(p.shape)}, param group {group_of[i]}) has dtype "
                f"{str(p.dtype).removeprefix('torch.')}; TwinFlowAdam steps float32, bfloat16 or float16 "
                "parameters: convert the model first (model.float() or model.to(torch.bfloat16))"
                + ("" if name else "; pass model.named_parameters() to see parameters named in errors")
            )
        if not p.is_contiguous():
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not contiguous")


@torch.no_grad()
def refresh_moved_masters(split: SplitState) -> None:
    """Masters follow weights changed outside the optimizer (``model.load_state_dict``, PEFT, EMA swaps).

    A parameter's version counter moves with every in-place write; after its own writes the optimizer notes
    the count, so a higher one means someone else wrote. Its moments stay, as in torch.optim.AdamW.
    """
    written = split.pipeline.written_version if split.pipeline is not None else {}
    moved = {i for i, p in enumerate(split.locals) if p._version > max(split.written[i], written.get(i, -1))}
    if moved and split.pipeline is not None:
        split.pipeline.drop_late_for(moved)  # a delayed update must not overwrite the new weights
        split.pipeline.unflip(moved)  # the masters written below are the current ones
    split.generation += bool(moved)
    for i in moved:
        p = split.locals[i]
        flat = p.view(-1)
        for st in split.segments_of[i]:
            piece = flat[st.seg.start : st.seg.end]
            if st.master.data_ptr() != piece.data_ptr():  # an fp32 device-side master is the weight
                st.master.copy_(piece)
        split.written[i] = p._version
