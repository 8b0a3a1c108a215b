"""What a portable save writes (:mod:`.portable`): the model's and the optimizer's state as the logical tensors DCP
saves, each named by its parameter's name, and DCP's save planner that reads the optimizer's state (and weights
``offload_states()`` moved to host memory) only when the writer asks for it.

- A tensor is saved as the logical tensor it is a piece of (FSDP2: a DTensor over the parameter's mesh).
- TwinFlowAdam's moments and masters are :class:`_Deferred`: a placeholder over no memory that DCP plans from, read
  (this process's elements, flat) when its piece is written, each to a file of its own, a large one in pieces of
  rows (:class:`ReadWhenWritten`): the peak of a synchronous save is two such pieces, not the model. Compact
  moments go as their codes and block scales where every rank's elements of a parameter start on a block
  (:mod:`.portable_codes`), else decoded.
- While ``offload_states()`` has the state in host memory, the optimizer's state owner reads it there, and the
  weights it moved are read from its host buffer (:func:`model_tensors`): the model's own tensors have no memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from twinflow.base.distributed import is_dtensor, local, rank_and_world
from twinflow.base.progress import NoProgress, shown
from twinflow.checkpoint import portable_codes, portable_staging
from twinflow.checkpoint.portable_codes import CODES, HI, LO, MOMENTS, SCALES
from twinflow.optim.offload_states import where_now

try:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover (torch >= 2.4 has them)
    DTensor = None
    DefaultSavePlanner = object

MODEL, OPTIM = "model", "optim"
PIECE_BYTES = 64 << 20  # at most this much of a tensor copied to be written at a time (see ReadWhenWritten)


def names_of(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's name in the model, by the parameter's identity."""
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def _logical(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Parameter `p`'s state tensor `value` (its local elements, on the host) as the logical tensor DCP saves: of
    `p`'s shape, a DTensor over `p`'s mesh where `p` is one (a 0-dimensional `value`, the step, stays itself)."""
    if value.dim() == 0 and p.dim() != 0:
        return value
    if is_dtensor(p):
        piece = value.reshape(local(p).shape)
        return DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())  # fmt: skip
    return value.reshape(p.shape)


def _host_state_tensor(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A state tensor of `p` as saved: host memory, float32 (a step count as it is), logical (:func:`_logical`)."""
    return _logical(p, v.detach().to("cpu", torch.float32) if v.dim() else v.detach().cpu())


def planned_tensor(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A logical tensor of `p`'s shape in `dtype` over no memory (one element, expanded), made where `p` is: a DTensor
    over a GPU mesh moves a host piece to its GPU, densely."""
    return _logical(p, torch.empty((), dtype=dtype, device=local(p).device).expand(local(p).shape))


def host_tensor(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty host tensor of `t`'s shape (and `dtype`, else t's): a DTensor with `t`'s placements where `t` is
    one, its piece in host memory, made like a placeholder over no memory (DTensor.from_local would move a host piece
    to the mesh's GPU; copying the placeholder to the host copied its piece densely from the GPU: 33 s of OPT-13B's)."""
    dtype = dtype or t.dtype
    if is_dtensor(t):
        return torch.empty_like(planned_tensor(t, dtype), device="cpu")
    return torch.empty(t.shape, dtype=dtype)


def gathered(mine: dict[str, Any]) -> dict[str, Any]:
    """The union over the ranks of each rank's `mine` (name -> value)."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(mine)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for rank_items in every for k, v in rank_items.items()}


def model_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``model.state_dict()``, each tensor whose memory ``offload_states(weights=True)`` moved to the optimizer's
    host buffer read there when DCP writes it (:class:`_Deferred`): the model's own tensor has no memory now."""
    view, out = where_now(optimizer), {}
    for key, t in model.state_dict().items():
        piece = local(t).detach()
        where = view(piece)
        out[key] = t.detach() if where is piece else _Deferred(t, t.dtype, functools.partial(_read_view, where))
    return out


def _read_view(view: torch.Tensor, out: torch.Tensor | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """The elements of `view` flat (or [lo, hi) of them): into `out` where given, else as they are (contiguous) or
    copied."""
    flat = view.reshape(-1)[lo:hi]
    return flat if out is None else out.copy_(flat)


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's state by parameter name, as logical tensors (:func:`_logical`): where the optimizer keeps
    its state behind a state owner (TwinFlowAdam), a :class:`_Deferred` for each moment and master, read when DCP
    writes it; another optimizer's ``state_dict()`` as it is."""
    owner = getattr(optimizer, "state_owner", None)
    if owner is not None and owner.built:
        return _owner_tensors(model, optimizer, owner)
    names, out = names_of(model), {}
    state = optimizer.state_dict()["state"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in state.items():
        p = params[index]
        out[names[id(p)]] = {key: _host_state_tensor(p, v)
                             for key, v in entry.items() if isinstance(v, torch.Tensor)}  # fmt: skip
    return out


class _Deferred:
    """A parameter's moment, master or codes (`dtype`), read (`read(out=None, lo=0, hi=None)`: this process's
    elements, or [lo, hi) of them, flat, in new host memory or into `out`) only when DCP writes it, never through
    ``opt.state`` (state_dict()'s decoded copies of compact state stayed there after the save, 12 bytes a
    parameter); a piece of rows at a time where it is large (:class:`ReadWhenWritten`). Stands in the state dict as
    `placeholder`: a logical tensor of the right shape and dtype over no memory, from which DCP plans."""

    def __init__(self, p: torch.Tensor, dtype: torch.dtype, read: Any) -> None:
        self.p, self.read = p, read
        self.placeholder = planned_tensor(p, dtype)

    def local(self) -> torch.Tensor:
        """The elements this process holds, in the shape it holds them (what DCP writes of the logical tensor)."""
        return self.read().view(local(self.p).shape)

    def stage_into(self, copies: portable_staging.HostCopies, key: str) -> torch.Tensor:
        """The logical tensor, its piece read into the host copy `copies` keeps for `key` (an asynchronous save's)."""
        return copies.copy(key, self.p, self.placeholder.dtype, lambda out: self.read(out=out))


class _DeferredScales:
    """A moment's block scales (:class:`.portable_codes.BlockScales`), read when DCP writes them."""

    def __init__(self, p: torch.Tensor, read: Any) -> None:
        self.p, self.read = p, read
        self.placeholder = portable_codes.scales_piece(p)

    def local(self) -> torch.Tensor:
        return self.read()

    def stage_into(self, copies: portable_staging.HostCopies, key: str) -> portable_codes.BlockScales:
        return portable_codes.scales_piece(self.p, self.read())  # 1/256 of the moment's bytes: a new copy


def _owner_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, owner: Any) -> dict[str, dict[str, Any]]:
    """A TwinFlowAdam's state by parameter name: the steps as tensors, the moments and masters read when written
    (:class:`_Deferred`, without decoding it all first): compact moments as their codes and scales where every
    rank's elements of the parameter start on a block (:mod:`.portable_codes`), else decoded."""
    owner.check_settled()  # no step half done
    owner.settle_state()
    owner.absorb_edits()  # in-place writes to the copies opt.state handed out
    names, out = names_of(model), {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = [i for i in range(len(params)) if owner.holds(i)]
    coded = owner.precision.coded_moments
    # what keeps a parameter's state from being saved as kept, on any rank (every rank must save the same keys)
    unlike = set(gathered({(names[id(params[i])], why): False for i in held if coded
                           for why in _not_as_kept(params[i], owner.raw(i))}))  # fmt: skip
    unaligned, no24 = ({name for name, why in unlike if why == reason} for reason in ("blocks", "m24"))
    # keys of the user's own beside a parameter's state (opt.state's extras, read without syncing it) are saved too
    extras, _ = optimizer.state_extras()
    for i in held:
        p, name = params[i], names[id(params[i])]
        own = {k: _host_state_tensor(p, v)
               for k, v in extras.get(i, {}).items() if isinstance(v, torch.Tensor)}  # fmt: skip
        entry = {**own, "step": torch.tensor(float(owner.steps[i]))}
        as_kept = coded and name not in unaligned
        if as_kept:
            entry.update(_codes(p, owner, i))
        else:
            decoded = {m: functools.partial(_read_decoded, owner, i, m) for m in MOMENTS}
            entry.update({m: _Deferred(p, torch.float32, read) for m, read in decoded.items()})
        if owner.locals[i].dtype == torch.float32:
            pass  # the weight is its own master
        elif as_kept and name not in no24:
            for key, dtype in ((HI, torch.bfloat16), (LO, torch.uint8)):
                entry[key] = _Deferred(p, dtype, functools.partial(_read_masters24, owner, i, key))
        else:
            entry["master"] = _Deferred(p, torch.float32, functools.partial(_read_decoded, owner, i, "master"))
        out[name] = entry
    return out


def _not_as_kept(p: torch.Tensor, parts: list[Any]) -> list[str]:
    """Why this rank cannot save parameter `p`'s state (kept in `parts`) as kept: "blocks" (its elements do not start
    on blocks: moments decoded), "m24" (its masters are not all 24-bit: saved as float32)."""
    return [why for why, ok in (("blocks", portable_codes.keeps_blocks(p, parts)),
                                ("m24", portable_codes.keeps_masters24(parts))) if not ok]  # fmt: skip


def _read_decoded(owner: Any, i: int, key: str, out: Any = None, lo: int = 0, hi: Any = None) -> torch.Tensor:
    return owner.read(i, key, out, lo, hi)


def _read_codes(owner: Any, i: int, moment: str, what: str, out: Any = None, lo: int = 0, hi: Any = None) -> Any:
    return portable_codes.codes_of(owner.raw(i), moment, what, out, lo, hi)


def _read_masters24(owner: Any, i: int, what: str, out: Any = None, lo: int = 0, hi: Any = None) -> torch.Tensor:
    return portable_codes.masters24_of(owner.raw(i), what, out, lo, hi)


def _codes(p: torch.Tensor, owner: Any, i: int) -> dict[str, Any]:
    """Parameter i's moments as their codes and block scales, read from the owner's parts when written."""
    out: dict[str, Any] = {}
    for moment, dtype in MOMENTS.items():
        read = functools.partial(_read_codes, owner, i, moment)
        out[portable_codes.key_of(moment, CODES)] = _Deferred(p, dtype, functools.partial(read, CODES))
        out[portable_codes.key_of(moment, SCALES)] = _DeferredScales(p, functools.partial(read, SCALES))
    return out


def deferred(state: dict[str, dict[str, Any]]) -> dict[str, _Deferred | _DeferredScales]:
    """The :class:`_Deferred` of `state` by the key DCP gives it (its path joined by dots, as DCP flattens a nested
    state dict; :class:`ReadWhenWritten` checks every one is planned)."""
    model = {f"{MODEL}.{key}": value for key, value in state[MODEL].items() if isinstance(value, _Deferred)}
    return model | {f"{OPTIM}.{name}.{key}": value for name, entry in state[OPTIM].items()
                    for key, value in entry.items() if isinstance(value, _Deferred | _DeferredScales)}  # fmt: skip


def with_each(state: dict[str, dict[str, Any]], each: Any) -> dict[str, dict[str, Any]]:
    """`state` with every :class:`_Deferred` replaced by each(it), the rest as they are."""

    def swapped(entry: dict[str, Any]) -> dict[str, Any]:
        return {k: each(v) if isinstance(v, _Deferred | _DeferredScales) else v for k, v in entry.items()}

    return {MODEL: swapped(state[MODEL]), OPTIM: {name: swapped(entry) for name, entry in state[OPTIM].items()}}


class ReadWhenWritten(DefaultSavePlanner):
    """DCP's default save planner, except that a :class:`_Deferred` is read when the writer asks for it, and the
    bytes this rank writes are counted as they are asked for (`progress`: shown on the first rank, past a size).

    What the save copies to host memory to write it (a :class:`_Deferred`, a tensor on a GPU) is written in pieces
    of whole rows of at most :data:`PIECE_BYTES` (one row at least), each read when it is written: DCP's writer
    holds the piece it writes while it reads the next, so a save holds two such pieces (128 MiB) and the scratch of
    decoding or joining a batch (:data:`twinflow.precision.compact.COPY_ELEMENTS`: about 48 MiB) beyond the state,
    under one chunk of float32 (256 MiB) whatever the model (OPT-13B on two H200s: 0.19-0.21 GiB a rank in all;
    0.26-0.27 with pieces of 96 MiB). A tensor whose one row is larger than a piece goes a row at a time; one
    already in host memory (an asynchronous save's copy, another optimizer's state) is written as it is."""

    def __init__(self, deferred: dict[str, _Deferred | _DeferredScales], progress: str | None = None) -> None:
        super().__init__()
        self.deferred = deferred
        self.progress, self.meter = progress, NoProgress()
        self.sizes: dict[tuple, int] = {}  # each item's bytes in this rank's plan, by (key, offsets)
        self.rows: dict[tuple, int] = {}  # a piece's first row of this rank's tensor, by (key, offsets)

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        unplanned = set(self.deferred) - {item.index.fqn for item in plan.items}
        if unplanned:  # DCP named them otherwise: their placeholders (zeros) would be written instead
            raise RuntimeError(f"portable save: DCP planned no item for {sorted(unplanned)[:3]}; nothing was "
                               "written in place of the previous tag (a twinflow bug: please report it)")  # fmt: skip
        self.plan = dataclasses.replace(plan, items=[piece for item in plan.items for piece in self._pieces(item)])
        return self.plan

    def _pieces(self, item: Any) -> list[Any]:
        """`item` as its pieces of rows, where it is copied to be written (see the class) and larger than a piece."""
        fqn, data = item.index.fqn, item.tensor_data
        found = self.state_dict.get(fqn)
        copied = fqn in self.deferred or (isinstance(found, torch.Tensor) and local(found).device.type != "cpu")
        if data is None or not copied or len(data.chunk.sizes) == 0:
            return [item]
        sizes, offsets = list(data.chunk.sizes), list(data.chunk.offsets)
        row = math.prod(sizes[1:])
        per = max(1, PIECE_BYTES // max(1, row * data.properties.dtype.itemsize))
        if sizes[0] <= per:
            return [item]
        pieces = []
        for r in range(0, sizes[0], per):
            n = min(per, sizes[0] - r)
            at = torch.Size([offsets[0] + r, *offsets[1:]])
            chunk = ChunkStorageMetadata(offsets=at, sizes=torch.Size([n, *sizes[1:]]))
            self.rows[(fqn, tuple(at))] = r
            pieces.append(WriteItem(index=MetadataIndex(fqn, at), type=WriteItemType.SHARD,
                                    tensor_data=TensorWriteData(chunk=chunk, properties=data.properties,
                                                                size=data.size)))  # fmt: skip
        return pieces

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)  # what this rank writes, once DCP has left out other ranks' copies
        for item, data in ((item, item.tensor_data) for item in plan.items if item.tensor_data is not None):
            self.sizes[_key(item.index)] = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
        if self.progress is not None:
            self.meter = shown(sum(self.sizes.values()), self.progress, rank_and_world()[0] == 0)
        return plan

    def resolve_data(self, write_item: Any) -> Any:
        key = _key(write_item.index)
        self.meter.update(self.sizes.pop(key, 0))  # asked for as it is written
        first = self.rows.get(key)
        if first is None:
            return super().resolve_data(write_item)
        sizes, deferred = write_item.tensor_data.chunk.sizes, self.deferred.get(key[0])
        if deferred is not None:  # its elements [lo, hi) of this rank's, flat
            lo = first * math.prod(sizes[1:])
            return deferred.read(lo=lo, hi=lo + math.prod(sizes)).view(sizes)
        return local(self.state_dict[key[0]]).detach().narrow(0, first, sizes[0]).cpu().contiguous()  # its rows

    def lookup_object(self, index: Any) -> Any:
        deferred = self.deferred.get(index.fqn)
        if deferred is not None:
            return deferred.local()
        scales = self.state_dict.get(index.fqn)  # an asynchronous save's copy of a moment's block scales
        if isinstance(scales, portable_codes.BlockScales):
            return scales.data
        found = super().lookup_object(index)
        # DCP's writer copies a tensor on a GPU to the host with non_blocking=True: into new page-locked memory, a
        # block rounded up to a power of two that the caching host allocator keeps for the rest of the run (each
        # weight of a model on the GPU passed through it, OPT-13B's embeddings' piece too). Copied here instead, to
        # ordinary memory, let go once written.
        return found.cpu() if isinstance(found, torch.Tensor) and found.device.type != "cpu" else found


def _key(index: Any) -> tuple:
    """A write item's identity: its key and offsets (a tensor written in pieces has one item a piece)."""
    return index.fqn, tuple(index.offset or ())


def tied(model: torch.nn.Module) -> dict[str, str]:
    """Each tied parameter's later names -> its first (an ``lm_head`` sharing the embeddings), for the converter."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {later: every[0] for every in names.values() for later in every[1:]}


def groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups' hyper-parameters, each with its parameters' names (every rank's, under ZeRO-1)."""
    names = names_of(model)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]  # fmt: skip
    group_of = gathered({name: i for i, g in enumerate(groups) for name in g["params"]})
    for i, g in enumerate(groups):
        g["params"] = [name for name, gi in group_of.items() if gi == i]
    return groups
