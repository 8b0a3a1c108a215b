"""One rank's shard of a per-rank checkpoint (the format twinflow 0.1.0 wrote, one shard a rank beside a meta.json),
verified and read an element range of a tensor at a time, for :mod:`.to_portable`.

A compact shard (:mod:`.compact_checkpoint`) is verified whole when opened (its sha256, every frame against its
head) and its records read again as asked: by range, the frames last read are kept (:class:`FrameCache`, one for
all of a checkpoint's ranks). A torch.save shard is checked against its sha256 and memory-mapped.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import torch

from twinflow.checkpoint.checkpoint_files import DAMAGED, CheckpointError, hash_error, sha256_of, size_error
from twinflow.checkpoint.compact_checkpoint import CompactShard, is_compact
from twinflow.checkpoint.portable_codes import CODES, HI, LO, MOMENTS, SCALES, key_of
from twinflow.checkpoint.saved_values import weights_only_error
from twinflow.precision import compact
from twinflow.precision.compact import BLOCK, blocks

# A compact record's parts by the portable format's keys: each moment's codes and block scales, a 24-bit master's two
RAW = {key_of(m, w): 2 * n + (w == SCALES) for n, m in enumerate(MOMENTS) for w in (CODES, SCALES)} | {HI: 4, LO: 5}
CACHE_BYTES = 1 << 29  # frames kept for the next reads by range (a piece's keys read from the same ones), in all


def shard_file(directory: Path, tag: str, info: dict[str, Any], rank: int) -> tuple[Path, dict[str, Any]]:
    """Rank `rank`'s shard of checkpoint `tag` (its meta.json `info`) and its recorded size and sha256, its size
    checked; CheckpointError naming what is wrong."""
    path = directory / tag / f"rank{rank}.pt"
    expected = info["shards"].get(path.name)
    if expected is None:
        raise CheckpointError(
            f"checkpoint {tag!r} has no shard {path.name}, which a save by {info['world_size']} ranks writes; its "
            f"meta.json lists {sorted(info['shards'])}: the checkpoint is damaged; copy the shard back from where "
            "it was saved"
        )
    if not path.is_file():
        raise CheckpointError(f"checkpoint {tag!r}: shard {path} is missing (meta.json records it): copy it back")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise size_error(tag, path, size, expected["bytes"])
    return path, expected


class FrameCache:
    """The frames last read by range, by (shard, frame): the last two, and more up to :data:`CACHE_BYTES` in all."""

    def __init__(self) -> None:
        self.frames: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()
        self.nbytes = 0

    def get(self, key: tuple[int, int]) -> Any:
        if key in self.frames:
            self.frames.move_to_end(key)
        return self.frames.get(key)

    def put(self, key: tuple[int, int], frame: Any) -> Any:
        self.frames[key] = frame
        self.nbytes += _nbytes(frame)
        while len(self.frames) > 2 and self.nbytes > CACHE_BYTES:
            self.nbytes -= _nbytes(self.frames.popitem(last=False)[1])
        return frame


def _nbytes(frame: Any) -> int:
    return sum(t.nbytes for t in frame) if isinstance(frame, list) else frame.nbytes


class RankShard:
    """One rank's shard, verified: its model tensors (key, shape, dtype), its optimizer parameters' state (`state`:
    index -> {key: shape}; `steps`), those with a master, its parameters' names, its param groups (parameters by
    index), scheduler and extra state."""

    def __init__(self, directory: Path, tag: str, info: dict[str, Any], rank: int,
                 cache: FrameCache | None = None) -> None:  # fmt: skip
        path, expected = shard_file(directory, tag, info, rank)
        self.f = open(path, "rb")  # noqa: SIM115 (closed by close(), also where the shard is refused)
        self.where = f"checkpoint {tag!r}, shard {path}"
        try:
            self._read(path, expected, tag)
        except BaseException:
            self.close()
            raise
        self.kept_scales: dict[int, dict[str, torch.Tensor]] = {}  # the frames' of `scaled` params, by key
        self.scaled: set[int] = set()  # parameters whose records' scales are kept when read (:meth:`keep_scales`)
        self.cache = cache if cache is not None else FrameCache()  # frames read by range
        self.numel = {key: shape.numel() for key, shape, _ in self.model}
        self.index = {key: k for k, (key, _, _) in enumerate(self.model)}

    def _read(self, path: Path, expected: dict[str, Any], tag: str) -> None:
        """Verifies the shard and reads its index: what __init__ keeps of it (the class's docstring)."""
        if is_compact(self.f):
            self.shard: CompactShard | None = CompactShard(self.f, expected, tag, path)
            self.model = self.shard.model
            params = self.shard.params
            self.shapes: list[torch.Size | None] = [shape for shape, _, _ in params]
            layout = self.shard.head.get("layout")
            keys = ("exp_avg", "exp_avg_sq", "master")
            self.state = {i: {key: shape for key in keys[: 2 + (dtype != torch.float32)]}
                          for i, (shape, dtype, step) in enumerate(params) if step is not None}  # fmt: skip
            self.steps = {i: torch.tensor(float(step)) for i, (_, _, step) in enumerate(params) if step is not None}
            self.groups, self.scheduler, self.extra = (
                self.shard.head["param_groups"],
                self.shard.scheduler,
                self.shard.extra,
            )
            self.spans: dict[tuple[str, int], list[tuple[int, list]]] = {}  # a tensor's records: (frame, record)
            for n, record in enumerate(self.shard.records):
                self.spans.setdefault((record[0], record[1]), []).append((n, record))
        else:
            self.shard = None
            found = sha256_of(path)
            if found != expected["sha256"]:
                raise hash_error(tag, path, found, expected["sha256"], expected["bytes"])
            try:
                self.whole = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
            except MemoryError:
                raise
            except OSError as exc:  # a truncated shard cannot be mapped, nor one on a file system without mmap
                raise CheckpointError(f"{self.where}: it cannot be memory-mapped ({exc}): the shard is truncated or "
                                      "damaged, or its file system cannot map files; copy it to a local disk and "
                                      "convert it there") from exc  # fmt: skip
            except Exception as exc:  # a shard damaged before its meta.json recorded it: torch's error, named
                raise CheckpointError(f"{self.where}: it cannot be read with torch.load(weights_only=True) "
                                      f"({weights_only_error(exc)}). {DAMAGED}") from exc  # fmt: skip
            if not isinstance(self.whole, dict) or not isinstance(self.whole.get("model"), dict):
                raise CheckpointError(f"{self.where}: it holds no model state dict")
            self.model = [(key, t.shape, t.dtype) for key, t in self.whole["model"].items()]
            optimizer = self.whole.get("optimizer") or {}
            state = optimizer.get("state", {})
            count = sum(len(g["params"]) for g in optimizer.get("param_groups", []))
            layout = self.whole.get("layout")
            entries = {i: e for i, e in state.items()
                       if isinstance(e, dict) and any(isinstance(v, torch.Tensor) for v in e.values())}  # fmt: skip
            self.state = {i: {k: v.shape for k, v in e.items() if isinstance(v, torch.Tensor) and k != "step"}
                          for i, e in entries.items()}  # fmt: skip
            self.steps = {i: step.clone() if isinstance(step := e["step"], torch.Tensor) else torch.tensor(float(step))
                          for i, e in entries.items() if "step" in e}  # fmt: skip
            self.shapes = [None] * count
            for i, keys_shapes in self.state.items():  # a moment's shape (exp_avg's, else any with dimensions)
                shapes = [shape for k, shape in sorted(keys_shapes.items(), key=lambda kv: kv[0] != "exp_avg") if shape]
                if shapes and i < count:
                    self.shapes[i] = shapes[0]
            self.groups = optimizer.get("param_groups", [])
            self.scheduler, self.extra = self.whole.get("scheduler"), self.whole.get("extra")
        self.layout = layout if isinstance(layout, dict) else None

    def names(self) -> list[list[str]]:
        """Each optimizer parameter's names: from the layout, else (a checkpoint saved before the layout was
        recorded) paired with the model's floating tensors of its shape, in order; CheckpointError where that
        pairing is a guess (a shape with more such tensors than parameters: buffers, tied copies, or tensors
        without state)."""
        if self.layout is not None:
            return [list(names) for names in self.layout["params"]]
        queues: dict[torch.Size, list[str]] = {}
        for key, shape, dtype in self.model:
            if dtype.is_floating_point:
                queues.setdefault(shape, []).append(key)
        wanted = collections.Counter(shape for shape in self.shapes if shape is not None)
        guessed = sorted(str(list(shape)) for shape, n in wanted.items() if len(queues.get(shape, [])) != n)
        if guessed or None in self.shapes:
            raise CheckpointError(
                f"{self.where}: it was saved before twinflow recorded which model tensor each optimizer parameter is, "
                f"and the model's tensors of shape {guessed[0] if guessed else '(a parameter without state)'} do "
                "not pair with the parameters one to one: resume it with twinflow 0.1.0 on as many ranks and save it "
                "again (in the portable format, that version's default)"
            )
        taken = {shape: iter(keys) for shape, keys in queues.items()}
        return [[next(taken[shape])] if shape in taken else [] for shape in self.shapes]

    def values(self, kind: str, ref: int | str, key: str | None, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of a tensor, flat: model tensor `ref` (kind "model", its key; `key` None) in its dtype,
        or optimizer parameter `ref`'s state `key` (kind "state"): a moment or master in float32 (compact moments
        decoded with their blocks' scales, a 24-bit master decoded exactly), or, of a compact shard, a part as
        kept (:data:`RAW`; a moment's scales counted in blocks)."""
        if self.shard is None:
            whole = self.whole["model"][ref] if kind == "model" else self.whole["optimizer"]["state"][ref][key]
            values = whole.reshape(-1)[a:b]
            return values if kind == "model" else values.to(torch.float32)
        k = self.index[ref] if kind == "model" else ref
        in_blocks = key is not None and key.endswith(f".{SCALES}")
        pieces = []
        for n, record in self.spans.get((kind, k), []):
            start, end = (record[2] // BLOCK, blocks(record[3])) if in_blocks else (record[2], record[3])
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                pieces.append(self._decoded(n, record, key, lo - start, hi - start))
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]

    def forms(self, i: int) -> set[str]:
        """The forms of optimizer parameter i's master in its records (a compact shard's)."""
        return {record[4] for _, record in self.spans.get(("state", i), [])}

    def _decoded(self, n: int, record: list, key: str | None, x: int, y: int) -> torch.Tensor:
        """Elements [x, y) of record n (read once for the keys asked of it one after the other), `key` decoded."""
        if key in self.kept_scales.get(n, {}):  # a moment's scales, 1/256 of a record: kept, not read again
            return self.kept_scales[n][key][x:y]
        payload = self._frame(n)
        if record[0] == "model":
            return payload[x:y]
        if key in RAW:
            return payload[RAW[key]][x:y]
        if key == "master":
            return compact.decode_master(payload[4][x:y], payload[5][x:y]) if record[4] == "m24" else payload[4][x:y]
        x0 = x // BLOCK * BLOCK  # codes from their block's start, each with its block's scale
        codes, scales = (payload[0], payload[1]) if key == "exp_avg" else (payload[2], payload[3])
        decode = compact.decode_exp_avg if key == "exp_avg" else compact.decode_exp_avg_sq
        return decode(codes[x0:y], scales[x0 // BLOCK : blocks(y)])[x - x0 :]

    def keep_scales(self, i: int) -> None:
        """Keeps the block scales of optimizer parameter i's records as they are read (asked for after its codes)."""
        self.scaled.add(i)

    def forget_scales(self, i: int) -> None:
        """Lets go of the scales kept from optimizer parameter i's records (its state is written)."""
        for n, _ in self.spans.get(("state", i), []) if self.shard is not None else ():
            self.kept_scales.pop(n, None)

    def _frame(self, n: int) -> Any:
        """Frame n's object: from the frames kept (:class:`FrameCache`), else read."""
        payload = self.cache.get((id(self), n))
        if payload is None:
            payload = self.cache.put((id(self), n), self.shard.frame(n))
            record = self.shard.records[n]
            if record[0] == "state" and record[1] in self.scaled:
                self.kept_scales[n] = {key: payload[RAW[key]] for key in RAW if key.endswith(f".{SCALES}")}
        return payload

    def close(self) -> None:
        """Closes the shard and lets go of its mapping (a caller holding an error holds the reader, not the file)."""
        self.f.close()
        self.whole = self.shard = None
