"""TwinFlowAdam's parameters, their split between the CPU and the device, and all of their optimizer state.

One ``SplitState`` is built per plan (at construction, or at the first step
under ``ratio="auto"``) and rebuilt when the parameters change (a group
added, a frozen parameter unfrozen). It owns every parameter's step count
and, through one owner per side, the masters and moments: the CPU share's
(:class:`twinflow.host.host_state.HostState`, in its precision) and the device's
(:class:`twinflow.device.device_side.DeviceState`). It turns them into torch.optim's
per-parameter layout and back; nobody else reads those tensors.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from twinflow.base import distributed, node
from twinflow.base.partition import split
from twinflow.device import device_side
from twinflow.device.device_compact import CompactDeviceState
from twinflow.host import ops
from twinflow.host.host_side import NO_HOST, HostSide, NoHost
from twinflow.host.host_state import HostState
from twinflow.host.staging import Piece, plan_pieces
from twinflow.host.step_record import Phase
from twinflow.precision import state_precision as precisions
from twinflow.precision import weight_master
from twinflow.precision.state_owner import StateOwner
from twinflow.precision.state_precision import StatePrecision
from twinflow.step.whole_params import WholeParams

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENTRY_KEYS = ("step", "exp_avg", "exp_avg_sq", "master")  # a parameter's state in torch.optim's layout


class WeightVersions:
    """Per parameter, its version counter right after the optimizer last wrote its weights (either side, any
    thread): a higher count means someone else wrote them since."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weights = weights
        self.lock = threading.Lock()
        self.seen = [w._version for w in weights]

    def note(self, i: int) -> None:
        with self.lock:
            self.seen[i] = max(self.seen[i], self.weights[i]._version)

    def moved(self) -> set[int]:
        return {i for i, w in enumerate(self.weights) if w._version > self.seen[i]}

    def forget(self) -> None:
        """Every weight counts as changed outside the optimizer."""
        with self.lock:
            self.seen = [-1] * len(self.weights)


class SplitState(WholeParams):
    """The parameters of `param_groups`, numbered in order; after ``build()``, their split and all of their
    state: step counts here, masters and moments in one owner per side (``host``: the CPU's, ``device``). The
    optimizer's :class:`twinflow.precision.state_owner.OptimizerState` (over whole parameters: :class:`WholeParams`)."""

    def __init__(self, param_groups: list[dict[str, Any]], precision: StatePrecision | str = "fp32") -> None:
        self.precision = precisions.of(precision)  # of both sides' state, resolved once (twinflow.precision)
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
        self.versions = WeightVersions(self.locals)
        self.host: HostState | None = None  # the CPU share's masters and moments (None: no CPU share)
        self.device_state: device_side.DeviceState | CompactDeviceState | None = None  # None until build()
        self.away: device_side.DeviceState | CompactDeviceState | None = None  # the owner, while a stand-in serves
        self.writer: HostSide | NoHost = NO_HOST  # what steps the CPU share's state: settled before it is read
        self.planned: set[int] = set()
        self.fully_cpu: set[int] = set()
        self.layout: tuple[str, int] | None = None  # (placement, chunk_bytes) the split was built with

    @property
    def built(self) -> bool:
        return self.device_state is not None

    @property
    def step_open(self) -> bool:
        """Gradients of a step were streamed to the host and ``step()`` has not run yet."""
        return self.writer.phase is Phase.OPEN

    def build(self, ratio: float, placement: str, chunk_bytes: int) -> list[Piece]:
        """Splits the trainable parameters and creates their state (fresh); returns the CPU share's pieces."""
        # Frozen parameters take no part (no state, no hooks): with LoRA most of the model is frozen.
        self.planned = {i for i, p in enumerate(self.params) if p.requires_grad}
        self.layout = (placement, chunk_bytes)
        numels = [p.numel() if i in self.planned else 0 for i, p in enumerate(self.locals)]
        # compact state: every cut at a block's start, so an element's block is the same on either side
        align = self.precision.align
        segments = [seg for seg in split(numels, ratio, placement, align) if seg.numel]
        cpu = [seg for seg in segments if seg.on_cpu]
        self.versions = WeightVersions(self.locals)
        pieces = plan_pieces(cpu, [p.element_size() for p in self.locals], chunk_bytes, align)
        # the host state filled with this rank's share of the cores (torchrun leaves torch one thread a rank)
        with torch.no_grad(), node.torch_threads(ops.default_num_threads() if pieces else 1):
            # the codes convert where the weights are: on the GPU, not in the host's threads
            self.host = HostState(pieces, self.precision, self.device) if pieces else None
            for seg in cpu if self.host is not None else []:  # the masters from the weights; the moments fresh
                self.host.write(seg.index, {"master": self.locals[seg.index].view(-1)[seg.start : seg.end]})
        with torch.no_grad():
            on_device = [seg for seg in segments if not seg.on_cpu]
            self.device_state = (
                CompactDeviceState(on_device, self.locals, self.precision)
                if self.precision.coded_moments
                else device_side.DeviceState(on_device, self.locals)
            )
        # Parameters wholly on the CPU: their device gradient may be released once it is down.
        self.fully_cpu = {i for i in self.planned if self.host is not None and self.host.holds(i)
                          and not self.device_state.holds(i)}  # fmt: skip
        return pieces

    @property
    def offloaded(self) -> bool:
        """Whether a stand-in over host memory serves the device state (``offload_states()``)."""
        return self.away is not None

    def weight(self, i: int) -> torch.Tensor:
        """Parameter i as this process holds it, where it can be read now (host memory while offloaded)."""
        return self.device_state.weights[i]  # the stand-in's are host views where the weights moved

    def stand_in(self, mirror: device_side.DeviceState | CompactDeviceState) -> None:
        """``offload_states()``: `mirror`, the device state over host views of the moved bytes, serves reads and
        in-place writes until :meth:`come_back`; ``opt.state`` takes its entries again (copies, not views)."""
        self.away, self.device_state = self.device_state, mirror
        if self.host is not None:  # the GPU's memory is given away: the host codes convert on the host meanwhile
            self.host.convert_on(None)
        self.generation += 1  # copies handed out before stay tracked: a write to one lands in the stand-in

    def come_back(self) -> None:
        """``reload_states()``, once the bytes are back: the owner serves again, with the step counts (a write
        to ``opt.state[p]["step"]`` while offloaded reached the stand-in's); copies handed out stay tracked."""
        if self.away is None:
            return
        self.device_state, self.away = self.away, None
        if self.host is not None:
            self.host.convert_on(self.device)
        for i in range(len(self.params)):
            self.device_state.set_step(i, self.steps[i])
        self.generation += 1

    def sides(self, i: int) -> list[StateOwner]:
        """The state owners holding part of parameter i (none for a frozen one)."""
        return [s for s in (self.host, self.device_state) if s is not None and s.holds(i)]

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
        """After a rebuild: every parameter `old` stepped keeps its state here."""
        kept = {old.params[i]: entry for i, entry in old.export().items()}
        self.load({self.index[id(p)]: entry for p, entry in kept.items()})

    def settle(self) -> None:
        """Every update taken so far, a delayed one included, is in the weights (no step half done)."""
        if not self.step_open:
            self.writer.settle()

    def settle_state(self) -> None:
        """Every update taken so far is in the masters and moments (a delayed one's weights may be pending)."""
        self.writer.quiesce()

    def counted(self, with_grad: list[int]) -> None:
        """A step of `with_grad` was taken: their counts move on; copies handed out before it are stale."""
        for i in with_grad:
            self.steps[i] += 1
            self.has_state[i] = True
        self.generation += 1
        self.handed.clear()  # a later write to a copy taken before this step must not land

    # ------------------------------------------------ torch.optim's layout
    def entry(self, i: int, handed: bool = False) -> dict[str, torch.Tensor]:
        """Parameter i's state in torch.optim's layout (+ ``master`` for low precision).

        Views of the live buffers where the parameter is on one side whole and that side keeps float32; a
        copy otherwise. `handed` (``opt.state``): the copies are remembered, so that an in-place write to one
        reaches the buffers before they are next used (:meth:`absorb_edits`).
        """
        p = self.locals[i]
        entry, copies = {"step": torch.tensor(float(self.steps[i]))}, ["step"]
        for key in ("exp_avg", "exp_avg_sq") + (("master",) if p.dtype != torch.float32 else ()):
            live = self.view(i, key)
            if live is not None:
                entry[key] = live.view(p.shape)
                continue
            entry[key] = self.read(i, key).view(p.shape)  # each side decoded straight into it
            copies.append(key)
        if handed:
            self.handed.update({(i, key): (entry[key], entry[key]._version) for key in copies})
        return entry

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
            self.set_step(i, flat.pop("step"))
        self.has_state[i] = entry is not None
        followed = weights_follow and entry is not None and "master" in keys and "master" in entry
        if followed:
            # before the sides' writes: where the weight holds the master (compact device state), the side's
            # write sets it again, rounded its own way
            master = entry["master"].reshape(-1)
            m24 = self.precision.weight_is_master(p.dtype)  # the weight a 24-bit master has
            if m24 and p.is_contiguous():
                weight_master.write_weight(p, master)
            else:
                p.copy_((weight_master.weight_of(master.float()) if m24 else master).view(p.shape))
        self.write(i, flat)
        if followed or entry is None:
            # our own writes (a side that keeps the master in the weight writes it), noted after them; only where
            # the masters now follow the weights (taken from them, or set with them), or an outside write before
            # them would hide
            self.versions.note(i)
        self.generation += 1

    @torch.no_grad()
    def loaded_raw(self, steps: dict[int, int]) -> None:
        """After a checkpoint wrote the state of the parameters `steps` names in the form their sides keep it
        (:meth:`raw`): their step counts, and a load's bookkeeping (the weights written count as the optimizer's
        own); every other parameter starts afresh, as in :meth:`load`."""
        self.handed.clear()
        for i in range(len(self.params)):
            if i not in steps:
                self.put(i, None)
                continue
            self.set_step(i, steps[i])
            self.versions.note(i)
        self.generation += 1

    @torch.no_grad()
    def refresh_masters(self, moved: set[int]) -> None:
        """Masters follow weights changed outside the optimizer (``model.load_state_dict``, PEFT, EMA swaps);
        the moments stay, as in torch.optim.AdamW. Call while no kernel steps them."""
        if self.host is not None:
            self.host.settle(moved)  # the masters written below are the current ones
        self.generation += bool(moved)
        for i in moved:
            flat = self.locals[i].view(-1)
            for side in self.sides(i):
                start, end = side.range(i)
                side.write(i, {"master": flat[start:end]})
            self.versions.note(i)


class CheckedEntries:
    """A state dict's entries by parameter index (checked: :func:`validated`; or a copied optimizer's), until the
    built state takes them. A loaded state waiting for its owner has these two methods; a portable checkpoint's
    reader is the other kind."""

    def __init__(self, entries: dict[int, dict[str, Any]]) -> None:
        self.entries = entries

    def put_into(self, owner: SplitState) -> None:
        """Sets the built `owner`'s state from the entries (every other parameter's fresh), its weights from a
        master."""
        owner.load(self.entries)

    def copied(self) -> dict[int, dict[str, torch.Tensor]]:
        """New tensors of each entry's Adam state (what a copy of the optimizer still waiting for them holds)."""
        return {i: {k: torch.as_tensor(v).clone() for k, v in e.items() if k in ENTRY_KEYS}
                for i, e in self.entries.items()}  # fmt: skip


def validated(split: SplitState, state_dict: dict[str, Any], param_groups: list[dict]) -> CheckedEntries:
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
        needed = ["step", "exp_avg", "exp_avg_sq"]
        missing = [key for key in needed if key not in entry]
        if missing:
            raise ValueError(
                f"state of parameter {i}: no {missing[0]!r} entry (parameter index {pid} of the state dict has no "
                f"{missing[0]!r}; an Adam state needs {needed}, found {sorted(entry)}): the state dict is incomplete "
                "or not from an Adam-family optimizer"
            )
        step = entry["step"]
        count = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        whole = isinstance(count, int | float) and not isinstance(count, bool) and math.isfinite(count)
        if not (whole and count >= 0 and count == int(count)):
            raise ValueError(f"state of parameter {i}: step is {step!r}; expected a whole number >= 0 (a Python "
                             "number or a one-element tensor)")  # fmt: skip
        for key in ("exp_avg", "exp_avg_sq") + (("master",) if "master" in entry else ()):
            if not isinstance(entry[key], torch.Tensor):
                raise TypeError(f"state of parameter {i}: {key} is a {type(entry[key]).__name__}; expected a tensor")
            if entry[key].numel() != split.locals[i].numel():
                raise ValueError(f"state of parameter {i}: {key} has {entry[key].numel()} elements, expected "
                                 f"{split.locals[i].numel()}")  # fmt: skip
        loaded[i] = entry
    return CheckedEntries(loaded)


def summary(split: SplitState, ratio: float, placement: str, pinned_bytes: int, chunks: int) -> dict[str, Any]:
    """The split's figures: elements and state bytes a side, the ratio achieved, pinned bytes, chunks."""
    cpu_elements = sum(pc.numel for pc in split.host.pieces) if split.host is not None else 0
    states = split.device_state.states
    cpu = {
        "tensors": len(split.host.span) if split.host is not None else 0,
        "elements": cpu_elements,
        "state_bytes": split.host.state_bytes if split.host is not None else 0,
        "state_precision": split.precision.name,
    }
    dev_elements = sum(st.seg.numel for st in states)
    dev = {"tensors": len(states), "elements": dev_elements, "state_bytes": split.device_state.state_bytes,
           "state_precision": split.precision.name}  # fmt: skip
    total = cpu["elements"] + dev["elements"]
    return {
        "ratio_requested": ratio,
        "ratio_achieved": cpu["elements"] / total if total else 0.0,
        "placement": placement,
        "cpu": cpu,
        "device": dev | {"device": str(split.device)},
        "pinned_bytes": pinned_bytes,
        "chunks": chunks,
    }


def sparse_gradient_message(what: str) -> str:
    """The refusal of a sparse gradient (`what`: the parameter or module that has one), with the fix."""
    return (
        f"{what} has a sparse gradient; TwinFlowAdam needs dense gradients: build the module with sparse=False "
        "(nn.Embedding(..., sparse=False)), or step that parameter with an optimizer for sparse gradients "
        "(torch.optim.SparseAdam)"
    )


def read_params(params: Any) -> Any:
    """An optimizer's `params` as given, an iterator read into a list: one already used up (model.parameters()
    is a generator, read once) is named as such, where torch would say only 'empty parameter list'."""
    if isinstance(params, list | tuple) or iter(params) is not params:
        return params
    params = list(params)
    if not params:
        raise ValueError(
            "TwinFlowAdam got an empty parameter list from an iterator that was already used up: "
            "model.parameters() is a generator, read once (an earlier optimizer or a list() may have "
            "consumed it); call model.parameters() again, or keep params = list(model.parameters())"
        )
    return params


def check_not_grouped(groups: list[dict[str, Any]], group: dict[str, Any]) -> None:
    """Raises, naming the parameter, where `group` (about to be added after `groups`) holds one an earlier group
    holds (torch's own message names none). Its ``params`` become a list here, as torch would make them (a
    generator must be read once); a set is left for torch to refuse."""
    params = group["params"]
    if isinstance(params, set):
        return
    params = group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
    earlier = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    for k, p in enumerate(params):
        if id(p) in earlier:
            names = group.get("param_names")
            name = f" {names[k]!r}" if names and k < len(names) else ""
            raise ValueError(
                f"parameter{name} (shape {tuple(p.shape)}, position {k} of param group {len(groups)}) is in param "
                f"group {earlier[id(p)]} already: each parameter may be in one group only (torch: 'some parameters "
                "appear in more than one parameter group'); leave it out of one of them"
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
