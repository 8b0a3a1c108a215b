"""A per-rank checkpoint (one shard a rank, which twinflow 0.1.0 wrote: :mod:`.rank_shard`) rewritten in the
portable format (:mod:`.portable`), which any number of processes resumes from.

    python -m twinflow.convert CKPT_DIR TAG --to-portable OUT_DIR [--out-tag NEW]

reads every rank's shard of TAG (each verified as a load verifies it) and writes tag NEW (default: TAG) to OUT_DIR
as a portable save of the same run would have written it: the model's tensors as ``model.state_dict()`` gives them,
each optimizer parameter's state by its name, the param groups, the scheduler's state, rank 0's extra state and
the caller's meta; ``latest`` in OUT_DIR then names NEW. The engine's ``load_checkpoint`` (and
:func:`twinflow.checkpoint.load_portable`) resumes it on any number of processes, at any ratio and precision.

- **Ranks are merged** by the layout the shards record: a tensor FSDP2 sharded on dim 0
  is its ranks' pieces in rank order; under ZeRO-1 a parameter's state comes from the rank whose optimizer holds
  it; under DDP from rank 0.
- **Compact state is written as kept** (:mod:`.portable_codes`: each moment's codes and block scales, a 24-bit
  master's two parts) where every rank's piece of a parameter starts on a block (one process, DDP, ZeRO-1, FSDP2
  where a shard starts on a multiple of ``BLOCK``), else decoded to float32 (a 24-bit master exactly): a load
  encodes it again to the nearest code, and a block that is the same block after the load gets its codes and
  scale back bit for bit. fp32 state is exact.
- **Bounded memory**: each tensor is written in pieces of whole rows of at most :data:`.portable_load.CHUNK`
  elements (DCP saves a tensor as its pieces), each read from the shards when DCP writes it; a compact shard's
  records are read by their offsets, a parameter's keys a piece after another, so that each record is read once.
  The host holds one piece, the records it lies in (:data:`.rank_shard.CACHE_BYTES` at most) and the block scales
  of the parameter being written (a 256th of its elements a moment), whatever the size of the model.
- **Nothing half-written**: NEW is written under ``NEW.saving`` and renamed into place once its files, DCP's
  metadata and their checksums are written; a conversion that fails or is killed leaves OUT_DIR's tags as they
  were. The source checkpoint is only read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from twinflow.base.notice import notice
from twinflow.base.progress import NoProgress, shown
from twinflow.checkpoint.checkpoint_files import PORTABLE_INFO, CheckpointError, read_meta, save_to_stream, write_atomic
from twinflow.checkpoint.portable import OLD, SAVING, dcp, put_in_place
from twinflow.checkpoint.portable_codes import CODES, HI, LO, MOMENTS, SCALES, key_of
from twinflow.checkpoint.portable_load import CHUNK
from twinflow.checkpoint.portable_state import MODEL, OPTIM
from twinflow.checkpoint.portable_sums import write_sums
from twinflow.checkpoint.rank_shard import FrameCache, RankShard
from twinflow.checkpoint.saved_values import check_tag
from twinflow.precision.compact import BLOCK, blocks
from twinflow.version import __version__

try:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
except ImportError:  # pragma: no cover (torch >= 2.4 has them)
    DefaultSavePlanner = object


LAST_SCALES = "." + key_of(list(MOMENTS)[-1], SCALES)  # the key a parameter's state is written with last


@dataclasses.dataclass
class Logical:
    """A tensor of the output: its shape and dtype, and its pieces, each ``(rank, kind, ref, key, first, numel)``:
    `numel` elements from element `first` on (flat), read from rank `rank`'s model tensor `ref` (kind "model") or
    its optimizer parameter `ref`'s state `key` (kind "state")."""

    shape: list[int]
    dtype: torch.dtype
    pieces: list[tuple[int, str, Any, str | None, int, int]]

    def read(self, ranks: list[RankShard], a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the tensor, flat."""
        out = torch.empty(b - a, dtype=self.dtype)
        for r, kind, ref, key, first, numel in self.pieces:
            lo, hi = max(a, first), min(b, first + numel)
            if lo < hi:
                out[lo - a : hi - a].copy_(ranks[r].values(kind, ref, key, lo - first, hi - first))
        return out


def _pieces(ranks: list[RankShard], key: str, sharded: dict[str, Any], source: Any) -> list[tuple]:
    """The pieces of model key `key`'s tensor (or of the state of the parameter it names): every rank's in rank
    order where FSDP2 sharded it (`source(r)`: that rank's (kind, ref, key), None where it has none), else the first
    holder's."""
    out, first = [], 0
    for r in range(len(ranks)) if key in sharded else [min(source.holders)]:
        found, mine = source(r), ranks[r].numel.get(key)
        if found is None and mine == 0:
            continue  # an empty piece: FSDP2 gave this rank none of the tensor
        if found is None:
            raise CheckpointError(f"{ranks[r].where}: it has no piece of {key!r}, which another rank's shard has")
        numel = math.prod(source.shape(r))
        if key in sharded and numel != mine:
            raise CheckpointError(f"{ranks[r].where}: its piece of {key!r} has {mine} elements, its state "
                                  f"{numel}: its layout does not fit its model")  # fmt: skip
        out.append((r, *found, first, numel))
        first += numel
    return out


class _Model:
    """Where each model tensor's elements are: rank 0's, or every rank's piece where FSDP2 sharded it."""

    holders = (0,)

    def __init__(self, ranks: list[RankShard], key: str) -> None:
        self.ranks, self.key = ranks, key

    def __call__(self, r: int) -> tuple[str, str, None] | None:
        return ("model", self.key, None) if self.key in self.ranks[r].numel else None

    def shape(self, r: int) -> list[int]:
        return list(self.ranks[r].model[self.ranks[r].index[self.key]][1])


class _State:
    """Where one state key of one parameter is: the ranks holding its state, each at its own optimizer index."""

    def __init__(self, ranks: list[RankShard], index: dict[int, int], key: str) -> None:
        self.ranks, self.index, self.key = ranks, index, key
        self.holders = sorted(index)

    def __call__(self, r: int) -> tuple[str, int, str] | None:
        i = self.index.get(r)
        return ("state", i, self.key) if i is not None and self.key in self.ranks[r].state[i] else None

    def shape(self, r: int) -> list[int]:
        return list(self.ranks[r].state[self.index[r]][self.key])


def plan(ranks: list[RankShard], tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The output's tensors, nested as a portable save's state dict (``{"model": {key: t}, "optim": {name: {key:
    t}}}``, each t a :class:`Logical` or a step's tensor), and its ``twinflow.pt`` entries but the caller's meta;
    CheckpointError naming what does not fit."""
    if len(ranks) > 1 and any(rank.layout is None for rank in ranks):
        raise CheckpointError(f"checkpoint {tag!r} was saved by {len(ranks)} ranks before twinflow recorded the "
                              "shards' layout: resume it with twinflow 0.1.0 on as many ranks and save it again "
                              "(in the portable format, that version's default)")  # fmt: skip
    sharded = (ranks[0].layout or {}).get("sharded", {})
    odd = sorted(key for key, shape in sharded.items() if shape is None)
    if odd:
        raise CheckpointError(f"checkpoint {tag!r}: {odd[0]!r} is a DTensor sharded other than on dim 0 by one mesh "
                              "dimension, which this converter does not merge")  # fmt: skip
    out: dict[str, Any] = {MODEL: {}, OPTIM: {}}
    for key, shape, dtype in ranks[0].model:
        whole = list(sharded.get(key) or shape)
        out[MODEL][key] = Logical(whole, dtype, _pieces(ranks, key, sharded, _Model(ranks, key)))
    holders: dict[str, dict[int, int]] = {}  # a parameter's name (its last, as a portable save names it) -> rank: i
    every = [rank.names() for rank in ranks]
    first_of = {n[-1]: n[0] for names in every for n in names if n}  # its model key (the sharded tensors' name)
    for r, names in enumerate(every):
        for i, n in enumerate(names):
            if n and i in ranks[r].state:
                holders.setdefault(n[-1], {})[r] = i
    state_keys: dict[str, list[str]] = {}
    for name, index in holders.items():
        first, r0 = first_of[name], min(index)
        entry = {}
        for key in sorted(ranks[r0].state[index[r0]]):
            pieces = _pieces(ranks, first, sharded, _State(ranks, index, key))
            whole = list(sharded.get(first) or ranks[r0].state[index[r0]][key])
            held = sum(piece[-1] for piece in pieces)
            if held != math.prod(whole):
                raise CheckpointError(f"checkpoint {tag!r}: the ranks' pieces of {name!r}'s {key!r} hold {held} "
                                      f"elements, its shape {whole} {math.prod(whole)}")  # fmt: skip
            entry[key] = Logical(whole, torch.float32, pieces)
        compact = all(ranks[r].shard is not None for r in index)
        if compact and all(p[4] % BLOCK == 0 for p in entry["exp_avg"].pieces):
            entry = _as_kept(entry, set().union(*(ranks[r].forms(i) for r, i in index.items())) == {"m24"})
            for r, i in index.items():
                ranks[r].keep_scales(i)
        if index[r0] in ranks[r0].steps:
            entry["step"] = ranks[r0].steps[index[r0]]
        out[OPTIM][name] = entry
        state_keys[name] = sorted(entry)
    groups = []
    for g, group in enumerate(ranks[0].groups):
        names: list[str] = []
        for r, rank in enumerate(ranks):
            names += [every[r][i][-1] for i in rank.groups[g]["params"] if every[r][i]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(dict.fromkeys(names))})
    for name in (name for group in groups for name in group["params"]):
        state_keys.setdefault(name, [])  # a parameter without state yet: a load starts it afresh
    tied = {later: n[0] for names in every for n in names for later in n[1:]}
    info = {"format": 1, "twinflow_version": __version__, "world_size": 1, "param_groups": groups,
            "state_keys": state_keys, "scheduler": ranks[0].scheduler, "extra": ranks[0].extra, "sums": True,
            "tied": tied, "model_keys": [key for key, _, _ in ranks[0].model]}  # fmt: skip
    return out, info


def _as_kept(entry: dict[str, Logical], m24: bool) -> dict[str, Logical]:
    """A compact parameter's state (its moments and master decoded, in `entry`) as kept instead: each moment's
    codes and block scales, and a master that is 24-bit on every rank (`m24`) as its two parts; every piece
    starts on a block, so the scales of each piece are its blocks of the whole."""

    def parts(t: Logical, key: str, dtype: torch.dtype, scales: bool = False) -> Logical:
        if scales:
            pieces = [(r, kind, i, key, first // BLOCK, blocks(n)) for r, kind, i, _, first, n in t.pieces]
            return Logical([blocks(math.prod(t.shape))], dtype, pieces)
        return Logical(t.shape, dtype, [(r, kind, i, key, first, n) for r, kind, i, _, first, n in t.pieces])

    out = {}
    for moment, dtype in MOMENTS.items():
        out[key_of(moment, CODES)] = parts(entry[moment], key_of(moment, CODES), dtype)
        out[key_of(moment, SCALES)] = parts(entry[moment], key_of(moment, SCALES), torch.uint8, scales=True)
    if "master" in entry and m24:
        out |= {HI: parts(entry["master"], HI, torch.bfloat16), LO: parts(entry["master"], LO, torch.uint8)}
    elif "master" in entry:
        out["master"] = entry["master"]
    return out


def _rows(shape: list[int]) -> list[tuple[list[int], list[int]]]:
    """A tensor of `shape` cut into pieces of whole rows of at most ``CHUNK`` elements (one row at least): each
    piece's offsets and sizes."""
    if not shape or shape[0] == 0:
        return [([0] * len(shape), list(shape))]
    per = max(1, CHUNK // max(1, math.prod(shape[1:])))
    return [([a] + [0] * (len(shape) - 1), [min(per, shape[0] - a), *shape[1:]]) for a in range(0, shape[0], per)]


class _Planner(DefaultSavePlanner):
    """DCP's default save planner over placeholders, with each :class:`Logical` written as its pieces of rows, each
    read from the shards when DCP writes it."""

    def __init__(self, ranks: list[RankShard], logical: dict[str, tuple[tuple, Logical]], progress: bool) -> None:
        super().__init__()
        self.ranks, self.order = ranks, {fqn: order for fqn, (order, _) in logical.items()}
        self.logical = {fqn: t for fqn, (_, t) in logical.items()}
        total = sum(math.prod(t.shape) * t.dtype.itemsize for t in self.logical.values())
        self.meter = shown(total, "converting to the portable format", True) if progress else NoProgress()

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            if item.index.fqn not in self.logical:
                items.append(((2,), item))  # the steps, after the rest
                continue
            for offsets, sizes in _rows(self.logical[item.index.fqn].shape):
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                data = TensorWriteData(chunk=chunk, properties=item.tensor_data.properties, size=item.tensor_data.size)
                index = MetadataIndex(item.index.fqn, torch.Size(offsets))
                item_of_rows = WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data)
                items.append(((*self.order[item.index.fqn], offsets[0] if offsets else 0), item_of_rows))
        self.plan = dataclasses.replace(plan, items=[item for _, item in sorted(items, key=lambda pair: pair[0])])
        return self.plan

    def resolve_data(self, write_item: Any) -> Any:
        tensor = self.logical.get(write_item.index.fqn)
        if tensor is None:
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        row = math.prod(tensor.shape[1:]) if tensor.shape else 1
        a = chunk.offsets[0] * row if tensor.shape else 0
        values = tensor.read(self.ranks, a, a + math.prod(chunk.sizes)).view(chunk.sizes)
        self.meter.update(values.numel() * values.element_size())
        if write_item.index.fqn.endswith(LAST_SCALES) and a + values.numel() == math.prod(tensor.shape):
            for r, _, i, *_ in tensor.pieces:  # the parameter's last piece written: its records' scales let go
                self.ranks[r].forget_scales(i)
        return values


def _flat(state: dict[str, Any]) -> dict[str, tuple[tuple, Logical]]:
    """Each :class:`Logical` of the nested `state` by DCP's key (its path joined by dots, as DCP flattens it), with
    where its pieces go in the write (:meth:`_Planner.create_local_plan`): the model's first; then each parameter's
    state, its keys' pieces of the same rows one after another (the records a piece lies in are read once for all
    of its keys), its moments' block scales last (kept from those reads)."""
    out = {f"{MODEL}.{key}": ((0, n, 0), t) for n, (key, t) in enumerate(state[MODEL].items())}
    for n, (name, entry) in enumerate(state[OPTIM].items()):
        out |= {f"{OPTIM}.{name}.{key}": ((1, n, key.endswith(f".{SCALES}")), t)
                for key, t in entry.items() if isinstance(t, Logical)}  # fmt: skip
    return out


def _placeholders(state: dict[str, Any]) -> dict[str, Any]:
    """The nested `state` with each :class:`Logical` a tensor of its shape over no memory (the planner reads it)."""

    def placeholder(t: Any) -> Any:
        return torch.empty((), dtype=t.dtype).expand(t.shape) if isinstance(t, Logical) else t

    return {MODEL: {k: placeholder(t) for k, t in state[MODEL].items()},
            OPTIM: {name: {k: placeholder(t) for k, t in e.items()} for name, e in state[OPTIM].items()}}  # fmt: skip


def to_portable(directory: str | Path, tag: str | None, out_dir: str | Path, out_tag: str | None = None,
                progress: bool = False) -> Path:  # fmt: skip
    """Writes per-rank checkpoint `tag` (None or "latest": the latest) of `directory` to `out_dir` as portable tag
    `out_tag` (default: the same tag) (module docstring); returns its folder. CheckpointError names what is wrong;
    nothing is left of a conversion that fails."""
    directory, out_dir = Path(directory), Path(out_dir)
    tag, info = read_meta(directory, tag)
    out_tag = tag if out_tag is None else out_tag
    try:
        check_tag(out_tag)
    except ValueError as exc:
        raise CheckpointError(f"the converted checkpoint's {exc}") from exc
    final, saving = out_dir / out_tag, out_dir / f"{out_tag}{SAVING}"
    source, target = (directory / tag).resolve(), final.resolve()
    touched = [target, saving.resolve(), target.with_name(target.name + OLD)]  # what putting it in place replaces
    if any(path == source or path in source.parents or source in path.parents for path in touched):
        raise CheckpointError(f"the converted checkpoint {final} would replace or lie inside {directory / tag}, its "
                              "source: give another OUT_DIR or --out-tag")  # fmt: skip
    ranks: list[RankShard] = []
    created = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # made here: removed again on a failure
    try:
        cache = FrameCache()  # one budget for every rank's frames
        for r in range(info["world_size"]):
            ranks.append(RankShard(directory, tag, info, r, cache))
        state, entries = plan(ranks, tag)
        entries.update(meta=info.get("meta"), converted_from={"tag": tag, "world_size": info["world_size"]})
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(saving, ignore_errors=True)  # what a killed conversion to this tag left
        saving.mkdir()
        try:
            write_atomic(saving / PORTABLE_INFO, lambda f: save_to_stream(entries, f))
            planner = _Planner(ranks, _flat(state), progress)
            writer = dcp.FileSystemWriter(saving, single_file_per_rank=False)
            dcp.save(_placeholders(state), checkpoint_id=saving, storage_writer=writer, planner=planner, no_dist=True)
            planner.meter.close()
            write_sums(saving, 0, 1)
            put_in_place(saving, final)
        except BaseException:
            shutil.rmtree(saving, ignore_errors=True)
            raise
    except BaseException:
        for folder in created:  # deepest first; only if empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        for rank in ranks:
            rank.close()
    notice("converted checkpoint %r (%d ranks) to the portable %s", tag, info["world_size"], final)
    return final
