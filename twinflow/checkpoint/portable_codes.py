"""Compact moments in a portable checkpoint as they are kept, not decoded to float32.

A parameter's 8-bit moments (:mod:`twinflow.precision.compact`) are saved as two tensors each:

- ``<moment>.codes``: a byte an element, a tensor of the parameter's shape (a DTensor over its mesh where it is
  one), which DCP reshards like any other;
- ``<moment>.scales``: the byte of scale of each block of ``BLOCK`` elements of the parameter, counted over its
  logical (flat) elements: a flat tensor of ``ceil(numel / BLOCK)`` bytes, each process writing its blocks
  (:class:`BlockScales`).

That needs every process's elements of the parameter to be one run starting on a block (one process; DDP and
ZeRO-1, which hold parameters whole; FSDP2 where a shard's first element falls on a multiple of ``BLOCK``) and the
owner's parts of it to start on blocks. Where any process's do not, that parameter's moments are saved decoded
(float32), as all were before: a load takes either. A 24-bit master (``int8_m24``; the device's form, the weight
and a residual byte, joined) is saved as its two parts, :data:`HI` and :data:`LO`, tensors of the parameter's
shape, where its moments are saved as codes; a float32 master as it is.

A load reads a parameter's codes as its process now holds it and the whole of its (small) scales, and decodes
each element with its block's scale (:func:`decoded`): the same float32 values a decoded save holds, so what the
load then encodes is what it encoded from those (the same codes where the blocks are the same blocks; a 24-bit
master is a float32 exactly). Saved this way, ``int8_m24`` state takes 5 bytes an element instead of 12.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from twinflow.base.distributed import is_dtensor, local
from twinflow.precision import compact, weight_master
from twinflow.precision.compact import BLOCK
from twinflow.precision.state_owner import FP32, M24, RESIDUAL, WEIGHT

try:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover (torch >= 2.4 has them; a DTensor is never met without them)
    pass

MOMENTS = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}  # each moment's codes' dtype
CODES, SCALES = "codes", "scales"
HI, LO = "master.hi", "master.lo"  # a 24-bit master's top 16 bits (bfloat16) and next 8 (uint8)
_DECODE = {"exp_avg": compact.decode_exp_avg, "exp_avg_sq": compact.decode_exp_avg_sq}


OWNED = ("step", "exp_avg", "exp_avg_sq", "master")  # the keys the optimizer's state owner keeps


def user_key_refusal(name: str, entry: dict[Any, Any]) -> str | None:
    """Why a key of the user's own in parameter `name`'s state `entry` cannot be saved (None: every one can): a load
    would read a tensor under ``<owned key>.<anything>`` (``exp_avg.codes``, ``master.hi``: the format's own) as part
    of the state. What is not a tensor is not saved."""
    for key, value in entry.items():
        if isinstance(key, str) and isinstance(value, torch.Tensor) and key not in OWNED and moment_of(key) in OWNED:
            return (f"the optimizer state of {name} has the key {key!r}: keys named '<key>.<anything>' for "
                    f"{list(OWNED)} are the portable checkpoint's own (codes, block scales, 24-bit masters); rename "
                    f"it (e.g. {key.replace('.', '_')!r}) and save again")  # fmt: skip
    return None


def refused_key(names: dict[int, str], optimizer: torch.optim.Optimizer) -> str | None:
    """Why this rank's optimizer state cannot be saved (:func:`user_key_refusal`), or None; `names`: each
    parameter's name by its identity."""
    if hasattr(optimizer, "state_extras"):  # a TwinFlowAdam: its extras, read without syncing opt.state
        params = [p for group in optimizer.param_groups for p in group["params"]]
        entries = {names[id(params[i])]: entry for i, entry in optimizer.state_extras()[0].items()}
    else:
        entries = {names.get(id(p), "a parameter"): entry for p, entry in optimizer.state.items()}
    return next((why for name, entry in entries.items() if (why := user_key_refusal(name, entry))), None)


def key_of(moment: str, what: str) -> str:
    """The saved key of a moment's `what` (:data:`CODES` or :data:`SCALES`)."""
    return f"{moment}.{what}"


def moment_of(key: str) -> str:
    """The state key a saved key holds (``exp_avg.codes`` -> ``exp_avg``; a plain key: itself)."""
    return key.split(".", 1)[0]


def held_box(p: torch.Tensor) -> tuple[list[int], list[int]]:
    """The shape of what this process holds of `p` and its offset in `p`, by dimension."""
    if is_dtensor(p):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return list(shape), list(offset)
    return list(p.shape), [0] * p.dim()


def _strides(shape: list[int]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def flat_start(p: torch.Tensor) -> int | None:
    """The flat index in `p` of the first element this process holds, where what it holds is one run of
    consecutive elements (a piece split on its first dimension), else None."""
    shape, offset = held_box(p)
    if math.prod(shape) == 0:
        return 0
    split = [d for d in range(len(shape)) if shape[d] != p.shape[d]]  # the dimensions it holds part of
    if len(split) > 1 or (split and any(p.shape[d] != 1 for d in range(split[0]))):
        return None
    return sum(o * s for o, s in zip(offset, _strides(list(p.shape)), strict=True))


def keeps_blocks(p: torch.Tensor, parts: list[Any]) -> bool:
    """Whether this process's elements of `p`, kept in `parts` (the state owner's, in order), can be saved as
    codes and scales: one run starting on a block, each part starting on one of its blocks."""
    start, at = flat_start(p), 0
    if start is None or start % BLOCK:
        return False
    for part in parts:
        if part.start != at or part.start % BLOCK:
            return False
        at = part.end
    return at == local(p).numel()


def keeps_masters24(parts: list[Any]) -> bool:
    """Whether the owner's `parts` keep 24-bit masters (as hi and lo, or as the weight and a residual byte)."""
    return bool(parts) and all(part.kind in (M24, RESIDUAL) for part in parts)


def _flat(
    pieces: Any, numel: int, dtype: torch.dtype, out: torch.Tensor | None, lo: int, hi: int | None
) -> torch.Tensor:
    """Elements [lo, hi) (hi None: to the end) of the `pieces` one after another, `numel` in all, in flat host
    memory (`out`, else new): each piece is ``(n, get)``, `get(a, b)` its elements [a, b) (on any device), asked for
    only where it overlaps and copied once into its place."""
    hi = numel if hi is None else hi
    out, at = torch.empty(hi - lo, dtype=dtype) if out is None else out, 0
    for n, get in pieces:
        a, b = max(at, lo), min(at + n, hi)
        if a < b:
            out[a - lo : b - lo].copy_(get(a - at, b - at).detach().reshape(-1))
        at += n
    if at != numel or out.numel() != hi - lo or not 0 <= lo <= hi <= numel:
        raise RuntimeError(f"{at} elements in pieces of {numel}, [{lo}, {hi}) of them into {out.numel()}: a "
                           "twinflow bug, please report it")  # fmt: skip
    return out


def _whole(t: torch.Tensor) -> tuple[int, Any]:
    """A tensor as a piece of :func:`_flat`."""
    return t.numel(), lambda a, b: t.reshape(-1)[a:b]


def masters24_of(parts: list[Any], what: str, out: torch.Tensor | None = None, lo: int = 0,
                 hi: int | None = None) -> torch.Tensor:  # fmt: skip
    """This process's 24-bit masters' :data:`HI` or :data:`LO` (flat, in `out`, else new host memory), or their
    elements [lo, hi), from the owner's `parts` (the weight and its residual joined a batch at a time on the
    residual's device, where asked for: the int64 scratch stays bounded; while offload_states() keeps the residual
    in host memory and the weight on its GPU, each batch of the weight comes to the host)."""
    low = what == LO

    def joined(weight: torch.Tensor, residual: torch.Tensor, a: int) -> Any:
        return lambda x, y: weight_master.join(weight[a + x : a + y].to(residual.device), residual[a + x : a + y])[low]

    def pieces() -> Any:
        for part in parts:
            if part.kind == M24:
                yield _whole(part.master[low])
                continue
            weight, residual = part.master
            for a, b in compact.spans(weight.numel()):
                yield b - a, joined(weight, residual, a)

    numel = sum(part.master[0].numel() for part in parts)
    return _flat(pieces(), numel, torch.uint8 if low else torch.bfloat16, out, lo, hi)


def codes_of(parts: list[Any], moment: str, what: str, out: torch.Tensor | None = None, lo: int = 0,
             hi: int | None = None) -> torch.Tensor:  # fmt: skip
    """This process's codes (flat) or block scales of `moment`, or their elements [lo, hi), in `out` (else new host
    memory), from the owner's `parts`."""
    which = list(MOMENTS).index(moment) * 2 + (what == SCALES)
    pieces = [part.codes[which] for part in parts]
    dtype = torch.uint8 if what == SCALES else MOMENTS[moment]
    return _flat([_whole(piece) for piece in pieces], sum(piece.numel() for piece in pieces), dtype, out, lo, hi)


class BlockScales:
    """This process's piece of a moment's flat block scales, for DCP: blocks [first, first + count) of `total`
    (``data``: its bytes, None while it is only planned). DCP takes it as a tensor of its own layout."""

    def __init__(self, total: int, first: int, count: int, data: torch.Tensor | None = None) -> None:
        self.total, self.first, self.count, self.data = total, first, count, data

    def size(self) -> torch.Size:
        return torch.Size([self.total])

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        if not self.count:
            return []
        offsets = torch.Size([self.first])
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size([self.count])),
                                                      properties=TensorProperties(dtype=torch.uint8),
                                                      size=self.size()))]  # fmt: skip


def scales_piece(p: torch.Tensor, data: torch.Tensor | None = None) -> BlockScales:
    """The :class:`BlockScales` of this process's elements of `p` (they start on a block: :func:`keeps_blocks`)."""
    start, n = flat_start(p) or 0, local(p).numel()
    return BlockScales(compact.blocks(p.numel()), start // BLOCK, compact.blocks(n), data)


def target(p: torch.Tensor, key: str, make: Any, planned: bool) -> torch.Tensor:
    """What a load reads saved `key` of `p` into: codes in their dtype and a moment or master in float32 as
    ``make(p, dtype)`` makes them (this process's elements), the scales whole (host memory; `planned`: over no
    memory, as `make` makes them then)."""
    moment, _, what = key.partition(".")
    if what == SCALES:
        n = compact.blocks(p.numel())
        return torch.empty((), dtype=torch.uint8).expand(n) if planned else torch.empty(n, dtype=torch.uint8)
    dtype = {HI: torch.bfloat16, LO: torch.uint8}.get(key, MOMENTS.get(moment) if what == CODES else torch.float32)
    return make(p.detach(), dtype)


def _logical_index(p: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """The flat indices in `p` of this process's elements [a, b) (counted flat over what it holds)."""
    start = flat_start(p)
    if start is not None:
        return torch.arange(start + a, start + b)
    shape, offset = held_box(p)
    index = torch.unravel_index(torch.arange(a, b), shape)
    return sum((i + o) * s for i, o, s in zip(index, offset, _strides(list(p.shape)), strict=True))


def masters24_decoded(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """24-bit masters' :data:`HI` and :data:`LO` (any shape) as float32 (flat), a batch at a time (bounded scratch)."""
    hi, lo = hi.reshape(-1), lo.reshape(-1)
    master = torch.empty(hi.numel(), dtype=torch.float32)
    for a, b in compact.spans(hi.numel()):
        master[a:b] = compact.decode_master(hi[a:b], lo[a:b])
    return master


def _decoded(moment: str, codes: torch.Tensor, scales: torch.Tensor, index_of: Any) -> torch.Tensor:
    """A moment's float32 values (flat) from `codes` and the whole parameter's block `scales`, a batch at a time
    (bounded scratch); ``index_of(a, b)``: the parameter's flat indices of codes [a, b)."""
    codes = codes.reshape(-1)
    values = torch.empty(codes.numel(), dtype=torch.float32)
    for a, b in compact.spans(codes.numel()):
        values[a:b] = _DECODE[moment](codes[a:b], scales, index_of(a, b) // BLOCK)
    return values


def decoded_run(moment: str, codes: torch.Tensor, scales: torch.Tensor, first: int) -> torch.Tensor:
    """:func:`_decoded` of `codes`, the parameter's flat elements [first, first + codes.numel())."""
    return _decoded(moment, codes, scales, lambda a, b: torch.arange(first + a, first + b))


def decoded(p: torch.Tensor, entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`entry` (read: this process's elements of `p`) with each moment saved as codes and scales decoded to
    float32, a batch of elements at a time (its scratch bounded), in this process's layout of `p`."""
    coded = {key_of(moment, what) for moment in MOMENTS for what in (CODES, SCALES)} | {HI, LO}
    out = {k: v for k, v in entry.items() if k not in coded}
    if HI in entry:
        out["master"] = masters24_decoded(local(entry[HI]), local(entry[LO])).reshape(local(p).shape)
    for moment in _DECODE:
        if key_of(moment, CODES) in entry:
            codes, scales = local(entry[key_of(moment, CODES)]), entry[key_of(moment, SCALES)]
            values = _decoded(moment, codes, scales, lambda a, b: _logical_index(p, a, b))
            out[moment] = values.reshape(local(p).shape)
    return out


def _master_fits(entry: dict[str, torch.Tensor], parts: list[Any]) -> bool:
    """Whether the saved master of `entry` goes into `parts`' masters as its bits: 24-bit into 24-bit (either
    form), float32 into float32, none where the weight is the master."""
    if HI in entry:
        return all(part.kind in (M24, RESIDUAL) for part in parts)
    if "master" in entry:
        return all(part.kind == FP32 for part in parts)
    return all(part.kind == WEIGHT for part in parts)


def fits_as_kept(p: torch.Tensor, parts: list[Any], entry: dict[str, torch.Tensor]) -> bool:
    """Whether `entry` (a read of parameter `p`'s saved state) can be written into the owner's `parts` as its
    bits, without decoding: its moments saved as codes, this process's elements and each part starting on a block
    of the saved ones (so every block is a saved block), and its master of the form the parts keep."""
    if not parts or any(key_of(moment, CODES) not in entry for moment in MOMENTS):
        return False
    return keeps_blocks(p, parts) and _master_fits(entry, parts)


@torch.no_grad()
def put_as_kept(p: torch.Tensor, parts: list[Any], entry: dict[str, torch.Tensor]) -> None:
    """Writes `entry` into the owner's `parts` (live views) as its bits (:func:`fits_as_kept`): each part's codes,
    its blocks' scales, its masters (the device's form split from hi and lo, a batch at a time on its device). The
    weights are not written: the load reads them from the model's own tensors."""
    first = (flat_start(p) or 0) // BLOCK
    flat = {k: local(v).reshape(-1) if k not in (key_of(m, SCALES) for m in MOMENTS) else v for k, v in entry.items()}
    for part in parts:
        a, b = part.start, part.end
        blocks = slice(first + a // BLOCK, first + a // BLOCK + compact.blocks(b - a))
        for n, moment in enumerate(MOMENTS):
            part.codes[2 * n].copy_(flat[key_of(moment, CODES)][a:b])
            part.codes[2 * n + 1].copy_(flat[key_of(moment, SCALES)][blocks])
        if part.kind == M24:
            part.master[0].copy_(flat[HI][a:b])
            part.master[1].copy_(flat[LO][a:b])
        elif part.kind == RESIDUAL:
            weight, residual = part.master
            for x, y in compact.spans(b - a):
                hi, lo = (flat[k][a + x : a + y].to(weight.device) for k in (HI, LO))
                w, r = weight_master.split(hi, lo)
                weight[x:y].copy_(w)
                residual[x:y].copy_(r)
        elif part.kind == FP32:
            part.master[0].copy_(flat["master"][a:b])
