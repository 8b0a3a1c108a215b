"""Compact checkpoint shards: a TwinFlowAdam's 8-bit state written and read as it is kept, a record at a time.

For a TwinFlowAdam whose state is compact (``state_precision`` "int8" or "int8_m24", built),
:func:`twinflow.checkpoint.save_checkpoint` writes the rank's shard ``rank<r>.pt`` in this format rather than as
one ``torch.save`` of a dict: the optimizer's state is never decoded to float32, and neither it nor the model is
gathered in host memory. A shard is::

    MAGIC                  b"twinflow compact shard 1\\n"
    frame: the head        a dict, below
    frame: one record      for each entry of head["records"], in that order

A frame is its length n as two little-endian uint64, n and ~n (a damaged length is caught before it is used),
then n bytes: one ``torch.save`` of the frame's object, read with ``torch.load(weights_only=True)``. The head
holds ``version``; ``precision`` (the state's); ``record_elements`` (the most elements a record holds: a 32nd
of the optimizer's ``chunk_bytes``, in whole blocks); ``model``: ``[key, shape, dtype]`` per tensor of the
model's (local) state dict; ``params``: ``[shape, dtype, step]`` per parameter of the optimizer, in its order
(step None: no state); ``param_groups`` as ``state_dict()`` packs them; ``scheduler`` and ``extra``; ``layout``
(each parameter's names in the model and the model's dim-0 sharded tensors' whole shapes, for
:mod:`twinflow.checkpoint.consolidate`; absent before it was added); and
``records``, each one of

- ``["model", k, start, end]``: elements [start, end) of the k-th model tensor, flat: one tensor.
- ``["state", i, start, end, form]``: elements [start, end) of parameter i's state, `start` a multiple of
  :data:`twinflow.precision.compact.BLOCK`: a list of exp_avg's codes (int8) and block scales (uint8), exp_avg_sq's
  codes and block scales (uint8), then the master by `form`: "none" (a float32 parameter: its weight is its
  master), "fp32" (float32) or "m24" (24 bits as hi bfloat16 and lo uint8; the device's weight and residual
  byte are joined into it exactly, :func:`twinflow.precision.weight_master.join`).

All model records come before the state records, and a parameter's records cover it in order. Both sides start
their blocks at multiples of the block in the parameter, so a record is the parameter's own codes and scales
for its range, whichever side held them: a load at any ratio or placement slices records onto its sides and
copies them, never quantising again (bit for bit, masters of the same form included; a master of another form
is converted as ``load_state_dict`` converts it). The records' plan depends on the parameters and
``record_elements`` only, not on the ratio.

Memory: a save holds one record (at most 6 bytes an element of ``record_elements``: 3/16 of a chunk) and a
conversion batch's scratch (:func:`convert_elements`); a load one frame's bytes and its tensors (twice that).
:class:`CompactShard` reads and verifies a whole shard (its sha256, every frame against the head) before a
load changes anything, then reads it again to apply it, from the same open file. A TwinFlowAdam of another
(compact) precision takes the records too; any other optimizer (torch's AdamW, TwinFlowAdam in "fp32", or one
under ratio="auto" before its first step) gets :func:`decoded`, the float32 state
dict in memory.
Keys of the user's own in ``opt.state`` are not saved: TwinFlowAdam gives them only with its decoded state.
"""

from __future__ import annotations

import hashlib
import io
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from twinflow.checkpoint.checkpoint_files import DAMAGED, HASH_BLOCK, CheckpointError, hash_error, save_to_stream
from twinflow.optim.twin_flow_adam import TwinFlowAdam
from twinflow.precision import compact, weight_master
from twinflow.precision.compact import BLOCK, blocks
from twinflow.precision.state_owner import M24, RESIDUAL, WEIGHT, RawPart

MAGIC = b"twinflow compact shard 1\n"
VERSION = 1
_MASK = (1 << 64) - 1
CODE_DTYPES = (torch.int8, torch.uint8, torch.uint8, torch.uint8)  # exp_avg codes, scales; exp_avg_sq's
# The forms a record's master is written in (words of the file format, not state precisions)
FORM_NONE, FORM_FP32, FORM_M24 = "none", "fp32", "m24"
MASTER_DTYPES = {FORM_NONE: (), FORM_FP32: (torch.float32,), FORM_M24: (torch.bfloat16, torch.uint8)}


def convert_elements(device: torch.device) -> int:
    """Elements one conversion (24-bit masters joined or split, moments decoded) handles at once: its int64
    scratch is about 48 bytes an element, 3 MiB on the host; 48 MiB on a GPU, where fewer launches pay."""
    return 1 << 20 if device.type == "cuda" else 1 << 16


def record_elements(chunk_bytes: int) -> int:
    """The most elements a record holds: a 32nd of `chunk_bytes`, in whole blocks (decoded to float32, 12 bytes
    an element, a record takes 3/8 of a chunk)."""
    return max(BLOCK, chunk_bytes // 32 // BLOCK * BLOCK)


def writes_compact(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s state is saved and loaded in this format: a TwinFlowAdam with compact state built."""
    if not isinstance(optimizer, TwinFlowAdam):
        return False
    owner = optimizer.state_owner
    return owner.built and owner.precision.coded_moments


def is_compact(f: IO[bytes]) -> bool:
    """Whether the open shard `f` is in this format (its position is left at the start)."""
    f.seek(0)
    start = f.read(len(MAGIC))
    f.seek(0)
    return start == MAGIC


def dtype_named(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


# ---------------------------------------------------------------------------------------------------------------
# A parameter's state as its sides keep it: its raw parts, from the optimizer's state owner (TwinFlowAdam.state_owner)


def copy_codes(dst: list[torch.Tensor], d0: int, src: list[torch.Tensor], s0: int, n: int) -> None:
    """n elements' codes and their blocks' scales from `src` at s0 into `dst` at d0 (both at a block's start)."""
    for k in (0, 2):
        dst[k][d0 : d0 + n].copy_(src[k][s0 : s0 + n])
        dst[k + 1][d0 // BLOCK : d0 // BLOCK + blocks(n)].copy_(src[k + 1][s0 // BLOCK : s0 // BLOCK + blocks(n)])


def plan(parts: list[RawPart], dtype: torch.dtype, span: int) -> list[tuple[str, list[tuple[RawPart, int, int]]]]:
    """A parameter's records: (form, slices (part, a, b) of its parts), each of one form and at most `span`
    elements, cut at multiples of `span` (a multiple of the block) from where its form begins."""
    records: list[tuple[str, list[tuple[RawPart, int, int]]]] = []
    fill = span
    for part in parts:
        form, a = part.form(dtype), 0
        while a < part.end - part.start:
            if fill == span or records[-1][0] != form:
                records.append((form, []))
                fill = 0
            b = min(part.end - part.start, a + span - fill)
            records[-1][1].append((part, a, b))
            fill, a = fill + b - a, b
    return records


@torch.no_grad()
def read_record(form: str, slices: list[tuple[RawPart, int, int]]) -> list[torch.Tensor]:
    """One state record's tensors, in host memory (copies: a record saves its own elements only)."""
    n = sum(b - a for _, a, b in slices)
    out = [torch.empty(m, dtype=d) for m, d in zip((n, blocks(n), n, blocks(n)), CODE_DTYPES)]
    out += [torch.empty(n, dtype=d) for d in MASTER_DTYPES[form]]
    k = 0
    for part, a, b in slices:
        copy_codes(out, k, part.codes, a, b - a)
        if form != "none" and part.kind == RESIDUAL:
            step = convert_elements(part.weight.device)
            for x in range(a, b, step):
                y = min(b, x + step)
                residual = part.master[1][x:y]
                weight = part.master[0][x:y].to(residual.device)  # on the device while the state is offloaded
                for dst, value in zip(out[4:], weight_master.join(weight, residual)):
                    dst[k + x - a : k + y - a].copy_(value)
        elif form != "none":
            for dst, src in zip(out[4:], part.master):
                dst[k : k + b - a].copy_(src[a:b])
        k += b - a
    return out


@torch.no_grad()
def write_record(parts: list[RawPart], start: int, end: int, form: str, payload: list[torch.Tensor]) -> None:
    """Record [start, end) of `form` into the parts it overlaps: codes copied; masters copied, or converted
    where the part keeps another form."""
    for part in parts:
        lo, hi = max(start, part.start), min(end, part.end)
        if lo < hi:
            copy_codes(part.codes, lo - part.start, payload, lo - start, hi - lo)
            _write_master(part, lo - part.start, hi - part.start, form, payload[4:], lo - start)


def _write_master(part: RawPart, p0: int, p1: int, form: str, master: list[torch.Tensor], r0: int) -> None:
    if form == part.kind:  # a master of the same form (m24, or fp32): its bits
        for dst, src in zip(part.master, master):
            dst[p0:p1].copy_(src[r0 : r0 + p1 - p0])
        return
    if form == "none" and part.kind == WEIGHT:
        return
    step = convert_elements(part.weight.device)
    for x in range(p0, p1, step):
        y = min(p1, x + step)
        s = slice(r0 + x - p0, r0 + y - p0)
        device = part.master[0].device
        if form == "m24" and part.kind == RESIDUAL:
            hi, lo = (t[s].to(device) for t in master)
        else:
            value = (compact.decode_master(master[0][s], master[1][s]) if form == "m24"
                     else master[0][s] if form == FORM_FP32 else part.weight[x:y].float())  # fmt: skip
            if part.kind == M24:
                compact.Master24(part.master[0][x:y], part.master[1][x:y]).copy_(value)  # to the nearest, as a load
                continue
            if part.kind != RESIDUAL:  # a float32 master, or the weight itself
                part.master[0][x:y].copy_(value)
                continue
            hi, lo = compact.encode_master(value.to(device))
        weight, residual = weight_master.split(hi, lo)
        part.master[0][x:y].copy_(weight)
        part.master[1][x:y].copy_(residual)


# ---------------------------------------------------------------------------------------------------------------
# Writing


def _write_frame(f: IO[bytes], obj: Any) -> None:
    start = f.tell()
    f.write(bytes(16))
    save_to_stream(obj, f)  # straight into the file: no copy of the frame in memory
    end = f.tell()
    f.seek(start)
    f.write(struct.pack("<QQ", end - start - 16, (end - start - 16) ^ _MASK))
    f.seek(end)


def packed_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups as torch.optim's ``state_dict()`` packs them: parameters by index."""
    packed, first = [], 0
    for group in groups:
        packed.append({k: v for k, v in group.items() if k != "params"})
        packed[-1]["params"] = list(range(first, first + len(group["params"])))
        first += len(group["params"])
    return packed


def write(f: IO[bytes], *, model: dict[str, torch.Tensor], optimizer: TwinFlowAdam, scheduler: Any,
          extra: dict[str, Any], layout: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Writes a compact shard to `f` (a seekable file): `model` (the rank's tensors of the model's state dict),
    `optimizer`'s state as it is kept (no step under way), the scheduler's state dict, `extra` and `layout` (the
    parameters' names and the sharded tensors, for the converter)."""
    owner = optimizer.state_owner
    owner.check_settled()  # between backward and step(), commits and eager kernels may still write the state
    owner.settle_state()
    span = record_elements(optimizer.chunk_bytes)
    tensors = list(model.values())
    model_records = [["model", k, a, min(t.numel(), a + span)] for k, t in enumerate(tensors)
                     for a in range(0, t.numel(), span)]  # fmt: skip
    state_records, sources = [], []
    for i, p in enumerate(owner.locals):
        for form, slices in plan(owner.raw(i), p.dtype, span) if owner.holds(i) else ():
            first, last = slices[0][0].start + slices[0][1], slices[-1][0].start + slices[-1][2]
            state_records.append(["state", i, first, last, form])
            sources.append((form, slices))
    steps = [owner.steps[i] if owner.holds(i) else None for i in range(len(owner.locals))]
    head = {
        "version": VERSION, "precision": owner.precision.name, "record_elements": span,
        "model": [[key, list(t.shape), str(t.dtype).removeprefix("torch.")] for key, t in model.items()],
        "params": [[list(p.shape), str(p.dtype).removeprefix("torch."), s] for p, s in zip(owner.locals, steps)],
        "param_groups": packed_groups(optimizer.param_groups), "scheduler": scheduler, "extra": extra,
        "layout": layout, "records": model_records + state_records,
    }  # fmt: skip
    f.write(MAGIC)
    _write_frame(f, head)
    flat, current = None, -1
    for _, k, a, b in model_records:
        if k != current:  # a tensor that is not contiguous is copied whole, once
            flat, current = tensors[k].detach().reshape(-1), k
        _write_frame(f, flat[a:b].to("cpu", copy=True))
    for form, slices in sources:
        _write_frame(f, read_record(form, slices))


# ---------------------------------------------------------------------------------------------------------------
# Reading


class _Damage(ValueError):
    """What is wrong with a shard's structure."""


class CompactShard:
    """A compact shard, read and verified whole when made, one frame at a time: its sha256 against the recorded
    one (CheckpointError naming both), its head, and every record against the head. :meth:`frames` reads the
    records again; the file must stay open and unchanged in place between the two reads."""

    def __init__(self, f: IO[bytes], expected: dict[str, Any], tag: str, path: Path) -> None:
        self.f, self.size, self.where = f, expected["bytes"], f"checkpoint {tag!r}, shard {path}"
        digest, problem = hashlib.sha256(), None
        f.seek(0)
        try:
            if self._read(len(MAGIC), digest) != MAGIC:
                raise _Damage("it does not start as a compact shard")
            self.head = self._load(self._read_frame(digest), "its head")
            self._check_head()
            self.body = f.tell()
            self.offsets: list[int] = []  # where each record's frame starts, for :meth:`frame`
            for record in self.records:
                self.offsets.append(f.tell())
                self._check_record(record, self._load(self._read_frame(digest), f"record {record}"))
            tail = f.read(1)
            digest.update(tail)
            if tail:
                raise _Damage("it has bytes after its last record")
        except (OSError, MemoryError):
            raise
        except Exception as exc:  # whatever a damaged or foreign file makes fail; its hash is told first
            problem = exc
        for block in iter(lambda: f.read(HASH_BLOCK), b""):  # what a problem left unread
            digest.update(block)
        if digest.hexdigest() != expected["sha256"]:
            raise hash_error(tag, path, digest.hexdigest(), expected["sha256"], self.size)
        if problem is not None:
            what = str(problem) if isinstance(problem, _Damage) else f"{type(problem).__name__}: {problem}"[:300]
            raise CheckpointError(f"{self.where}: {what}. {DAMAGED}") from problem

    def _read(self, n: int, digest: Any) -> bytes:
        data = self.f.read(n)
        digest.update(data)
        if len(data) < n:
            raise _Damage(f"it ends {n - len(data)} bytes early")
        return data

    def _read_frame(self, digest: Any) -> bytes:
        at = self.f.tell()
        n, check = struct.unpack("<QQ", self._read(16, digest))
        if n ^ check != _MASK:
            raise _Damage(f"the frame length at byte {at} is damaged")
        if n > self.size - at - 16:
            raise _Damage(f"the frame at byte {at} runs {n - (self.size - at - 16)} bytes past the end")
        return self._read(n, digest)

    def _load(self, data: bytes, what: str) -> Any:
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise _Damage(f"{what} cannot be read with torch.load(weights_only=True) ({exc})"[:400]) from exc

    def _check_head(self) -> None:
        h = self.head
        if not isinstance(h, dict) or h.get("version") != VERSION:
            raise _Damage(f"its head is not a version-{VERSION} head")
        keys = ("precision", "record_elements", "model", "params", "param_groups", "scheduler", "extra", "records")
        if any(key not in h for key in keys) or not isinstance(h["extra"], dict):
            raise _Damage(f"its head lacks one of {list(keys)}, or its 'extra' is not a dict")
        self.model = [(str(key), torch.Size(shape), dtype_named(d)) for key, shape, d in h["model"]]
        self.params = [(torch.Size(shape), dtype_named(d), step) for shape, d, step in h["params"]]
        if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in h["param_groups"]):
            raise _Damage("its param groups are not dicts with 'params'")
        if any(step is not None and (not isinstance(step, int) or step < 0) for _, _, step in self.params):
            raise _Damage("a parameter's step count is not a whole number >= 0 or None")
        self.records: list[list] = h["records"]
        done: dict[tuple[str, int], int] = {}
        for n, record in enumerate(self.records):
            kind = record[0] if isinstance(record, list) and record else None
            if (
                kind not in ("model", "state")
                or len(record) != 4 + (kind == "state")
                or not all(isinstance(x, int) for x in record[1:4])
            ):
                raise _Damage(f"record {n} of its head, {record!r}, is not a model or state record")
            k, start, end = record[1:4]
            if not 0 <= k < len(self.params if kind == "state" else self.model):
                raise _Damage(f"record {record!r} names no tensor of its head")
            shape = self.params[k][0] if kind == "state" else self.model[k][1]
            if kind == "state":
                form, float32, step = record[4], self.params[k][1] == torch.float32, self.params[k][2]
                if step is None or form not in MASTER_DTYPES or (form == "none") != float32 or start % BLOCK:
                    raise _Damage(f"state record {record!r} does not fit its parameter in the head")
            elif n and self.records[n - 1][0] == "state":
                raise _Damage(f"model record {record!r} comes after a state record")
            if not 0 <= start < end <= shape.numel() or done.get((kind, k), 0) != start:
                raise _Damage(f"record {record!r} does not follow its tensor's last record, or runs past its end")
            done[(kind, k)] = end
        for k, (key, shape, _) in enumerate(self.model):
            if shape.numel() and done.get(("model", k)) != shape.numel():
                raise _Damage(f"its records do not cover the model's {key!r}")
        for i, (shape, _, step) in enumerate(self.params):
            if step is not None and shape.numel() and done.get(("state", i)) != shape.numel():
                raise _Damage(f"its records do not cover parameter {i}'s state")

    def _check_record(self, record: list, payload: Any) -> None:
        n = record[3] - record[2]
        if record[0] == "model":
            expected = [(self.model[record[1]][2], n)]
            payload = [payload]
        else:
            expected = list(zip(CODE_DTYPES, (n, blocks(n), n, blocks(n))))
            expected += [(d, n) for d in MASTER_DTYPES[record[4]]]
        if (
            not isinstance(payload, list)
            or len(payload) != len(expected)
            or not all(
                isinstance(t, torch.Tensor) and t.dtype == d and t.shape == (m,) for t, (d, m) in zip(payload, expected)
            )
        ):
            raise _Damage(f"record {record!r} does not hold what its head lists")

    @property
    def scheduler(self) -> Any:
        return self.head["scheduler"]

    @property
    def extra(self) -> dict[str, Any]:
        return self.head["extra"]

    def frame(self, n: int) -> Any:
        """Record n's object, read again from where the verification found it."""
        self.f.seek(self.offsets[n])
        size = struct.unpack("<QQ", self.f.read(16))[0]
        return torch.load(io.BytesIO(self.f.read(size)), map_location="cpu", weights_only=True)

    def frames(self, kinds: tuple[str, ...] = ("model", "state")) -> Iterator[tuple[list, Any]]:
        """Each record of `kinds` and its object, read again (in the file's order; others are skipped)."""
        self.f.seek(self.body)
        for record in self.records:
            n = struct.unpack("<QQ", self.f.read(16))[0]
            if record[0] not in kinds:
                self.f.seek(n, io.SEEK_CUR)
                continue
            yield record, torch.load(io.BytesIO(self.f.read(n)), map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------------------------------------------------
# Loading in place


def check_fits(shard: CompactShard, optimizer: TwinFlowAdam) -> None:
    """ValueError naming what of the saved optimizer state does not fit `optimizer` (nothing is changed)."""
    saved, ours = shard.head["param_groups"], optimizer.param_groups
    if len(saved) != len(ours):
        raise ValueError(f"the checkpoint has {len(saved)} param groups; this optimizer has {len(ours)}")
    for gi, (s, o) in enumerate(zip(saved, ours)):
        if len(s["params"]) != len(o["params"]):
            raise ValueError(f"param group {gi}: the checkpoint has {len(s['params'])} parameters, the optimizer "
                             f"has {len(o['params'])}")  # fmt: skip
    owner = optimizer.state_owner
    for i, (shape, _, step) in enumerate(shard.params):
        if step is not None and shape.numel() != owner.range(i)[1]:
            raise ValueError(f"state of parameter {i}: the checkpoint has {shape.numel()} elements, the parameter "
                             f"has {owner.range(i)[1]}")  # fmt: skip


@torch.no_grad()
def load_in_place(shard: CompactShard, model_state: dict[str, torch.Tensor], optimizer: TwinFlowAdam) -> None:
    """Loads the verified `shard` into the model's tensors `model_state` (checked against it) and `optimizer`
    (:func:`check_fits`), a record at a time: the model first, then each parameter's state into its sides."""
    owner = optimizer.state_owner
    owner.check_settled()
    optimizer.synchronize()
    owner.settle_state()
    parts: dict[int, list[RawPart]] = {}
    pending: dict[int, torch.Tensor] = {}  # a tensor that is not contiguous: gathered, then copied whole
    for record, payload in shard.frames():
        if record[0] == "state":
            i = record[1]
            write_record(parts.setdefault(i, owner.raw(i)), record[2], record[3], record[4], payload)
            continue
        k, target = record[1], model_state[shard.model[record[1]][0]]
        flat = (
            target.view(-1)
            if target.is_contiguous()
            else pending.setdefault(k, torch.empty(target.numel(), dtype=target.dtype))
        )
        flat[record[2] : record[3]].copy_(payload)
        if k in pending and record[3] == target.numel():
            target.copy_(pending.pop(k).view(target.shape))
    groups = []
    for ours, saved in zip(optimizer.param_groups, shard.head["param_groups"]):
        groups.append({**saved, "params": ours["params"]})  # torch.optim's load keeps the parameters so
        if "param_names" in ours and "param_names" not in saved:
            groups[-1]["param_names"] = ours["param_names"]
    optimizer.__setstate__({"state": {}, "param_groups": groups})  # as torch.optim's load_state_dict ends
    owner.loaded_raw({i: step for i, (_, _, step) in enumerate(shard.params) if step is not None})


def decode_record(record: list, payload: list[torch.Tensor]) -> Iterator[tuple[str, int, torch.Tensor]]:
    """A state record decoded to float32, a batch at a time: (key, first element in the parameter, values)."""
    _, _, start, end, form = record
    step = convert_elements(torch.device("cpu"))  # a multiple of the block
    for a in range(0, end - start, step):
        b = min(end - start, a + step)
        scales = slice(a // BLOCK, blocks(b))
        yield "exp_avg", start + a, compact.decode_exp_avg(payload[0][a:b], payload[1][scales])
        yield "exp_avg_sq", start + a, compact.decode_exp_avg_sq(payload[2][a:b], payload[3][scales])
        if form != "none":
            master = compact.decode_master(payload[4][a:b], payload[5][a:b]) if form == "m24" else payload[4][a:b]
            yield "master", start + a, master


def entry_skeleton(shard: CompactShard, i: int, make: Any = torch.zeros) -> dict[str, torch.Tensor]:
    """Parameter i's entry in torch.optim's layout (as TwinFlowAdam's ``state_dict()`` has it), its float32
    tensors made by ``make(shape, dtype=torch.float32)``."""
    shape, dtype, step = shard.params[i]
    keys = ("exp_avg", "exp_avg_sq") + (("master",) if dtype != torch.float32 else ())
    return {"step": torch.tensor(float(step))} | {key: make(shape, dtype=torch.float32) for key in keys}


def decoded(shard: CompactShard) -> dict[str, Any]:
    """The verified `shard` in the layout of other optimizers' shards, in memory: the model's tensors and a
    torch.optim state dict of float32 moments and masters (12 bytes a parameter: not bounded)."""
    model = {key: torch.empty(shape, dtype=dtype) for key, shape, dtype in shard.model}
    state = {i: entry_skeleton(shard, i) for i, (_, _, step) in enumerate(shard.params) if step is not None}
    flats = [t.view(-1) for t in model.values()]
    for record, payload in shard.frames():
        if record[0] == "model":
            flats[record[1]][record[2] : record[3]].copy_(payload)
            continue
        for key, at, values in decode_record(record, payload):
            state[record[1]][key].view(-1)[at : at + values.numel()].copy_(values)
    optimizer = {"state": state, "param_groups": shard.head["param_groups"]}
    return {"model": model, "optimizer": optimizer, "scheduler": shard.scheduler, "extra": shard.extra}
