"""Reading the compact shards of a per-rank checkpoint: twinflow 0.1.0 wrote them (``save_checkpoint(...,
portable=False)``, the engine's only format before the portable one) for a TwinFlowAdam whose state was compact
(``state_precision`` "int8" or "int8_m24"), its 8-bit state as kept, a record at a time. Only :mod:`.to_portable`
reads them now (through :mod:`.rank_shard`), to rewrite such a checkpoint in the portable
format. A shard is::

    MAGIC                  b"twinflow compact shard 1\\n"
    frame: the head        a dict, below
    frame: one record      for each entry of head["records"], in that order

A frame is its length n as two little-endian uint64, n and ~n (a damaged length is caught before it is used),
then n bytes: one ``torch.save`` of the frame's object, read with ``torch.load(weights_only=True)``. The head
holds ``version``; ``precision`` (the state's); ``record_elements`` (the most elements a record holds);
``model``: ``[key, shape, dtype]`` per tensor of the model's (local) state dict; ``params``: ``[shape, dtype,
step]`` per parameter of the optimizer, in its order (step None: no state); ``param_groups`` as ``state_dict()``
packs them; ``scheduler`` and ``extra``; ``layout`` (each parameter's names in the model and the model's dim-0
sharded tensors' whole shapes; absent before it was added); and ``records``, each one of

- ``["model", k, start, end]``: elements [start, end) of the k-th model tensor, flat: one tensor.
- ``["state", i, start, end, form]``: elements [start, end) of parameter i's state, `start` a multiple of
  :data:`twinflow.precision.compact.BLOCK`: a list of exp_avg's codes (int8) and block scales (uint8), exp_avg_sq's
  codes and block scales (uint8), then the master by `form`: "none" (a float32 parameter: its weight is its
  master), "fp32" (float32) or "m24" (24 bits as hi bfloat16 and lo uint8).

All model records come before the state records, and a parameter's records cover it in order.
:class:`CompactShard` reads and verifies a whole shard (its sha256, every frame against the head) when it is
made, then reads records again as asked, from the same open file.
"""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path
from typing import IO, Any

import torch

from twinflow.checkpoint.checkpoint_files import DAMAGED, HASH_BLOCK, CheckpointError, hash_error
from twinflow.precision.compact import BLOCK, blocks

MAGIC = b"twinflow compact shard 1\n"
VERSION = 1
_MASK = (1 << 64) - 1
CODE_DTYPES = (torch.int8, torch.uint8, torch.uint8, torch.uint8)  # exp_avg codes, scales; exp_avg_sq's
# The forms a record's master was written in, and its dtypes
MASTER_DTYPES = {"none": (), "fp32": (torch.float32,), "m24": (torch.bfloat16, torch.uint8)}


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
