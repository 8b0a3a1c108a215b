"""A checkpoint's optimizer state in torch.optim's layout (decoded in memory, or streamed to a file), and its
model's consolidated weights for the hub.

    python -m twinflow.convert CKPT_DIR TAG OUT.pt [--rank R]
    python -m twinflow.convert CKPT_DIR TAG [OUT.pt] --safetensors DIR [--dtype bf16] [--max-shard-size 5GB]
        [--hf-config HF_DIR]

``--safetensors DIR`` writes the model's weights (the optimizer's float32 masters where it keeps them, merged
across ranks) as safetensors that Hugging Face ``from_pretrained`` loads, streamed with bounded memory: see
:mod:`twinflow.checkpoint.consolidate`. The rest of this docstring is about OUT.pt.

reads rank R's shard (default 0) of checkpoint TAG (``latest``: the tag the ``latest`` file names) in CKPT_DIR,
verifies it as :func:`twinflow.checkpoint.checkpoint.load_checkpoint` does (its size and sha256 against meta.json, every
record against the shard's head), and writes to OUT.pt the state dict that ``optimizer.state_dict()`` of the
TwinFlowAdam that saved it returned at the save: per parameter index ``step`` (a float32 scalar tensor),
``exp_avg`` and ``exp_avg_sq`` (float32, the parameter's shape) and, for a bfloat16 or float16 parameter,
``master`` (float32); and ``param_groups``. ``torch.optim.AdamW.load_state_dict`` takes it (and ignores
``master``). OUT.pt is written under a temporary name beside it, flushed to disk and renamed into place.

Memory: OUT.pt is first written without its tensors' bytes (``torch.serialization.skip_data``: its float32
tensors are allocated, never touched, so they take address space, not memory); the file offset of each
tensor's bytes is then found (:func:`storage_offsets`), and each record of the shard is decoded a batch of
65536 elements at a time and written in place with ``os.pwrite``. So the peak extra host memory is one frame
of the shard (its bytes and its tensors: at most 2 x 6 bytes x ``record_elements``, 3/8 of the saving
optimizer's ``chunk_bytes``) and one batch's decoding (about 3 MiB), whatever the size of the model. The zip
records' CRC-32 fields of OUT.pt stay those of the empty tensors: ``torch.load`` does not check them (zip
tools would). The shard of another optimizer (any but a compact TwinFlowAdam) holds torch.optim's layout
already: its ``optimizer`` entry is copied through a memory map of the shard, without this bound.

:func:`decoded` gives the same in memory (12 bytes a parameter, not bounded): what load_checkpoint hands an
optimizer that does not take the compact records.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from twinflow.checkpoint.checkpoint_files import (
    CheckpointError,
    hash_error,
    read_meta,
    rename_into_place,
    save_to_stream,
    sha256_of,
    temp_path,
    write_temp,
)
from twinflow.checkpoint.compact_checkpoint import CompactShard, decode_record, entry_skeleton, is_compact
from twinflow.checkpoint.rank_shard import shard_file
from twinflow.checkpoint.safetensors_out import pwrite_all


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in `obj` (dicts, lists and tuples of them), in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_of(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_of(value)


def storage_offsets(path: Path, obj: Any) -> list[tuple[torch.Tensor, int]]:
    """Each tensor of `obj` that has bytes, just saved to `path`, with the file offset of its storage's bytes.

    The file is loaded memory-mapped (nothing is read): each storage then lies at its zip record's offset from
    one base address. Sorted by address and by offset, storages and records pair up; every distance and size is
    checked, so a torch that maps its files otherwise is refused (RuntimeError), never written to wrong places.
    """
    loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    ours, theirs = list(tensors_of(obj)), list(tensors_of(loaded))
    if len(ours) != len(theirs):
        raise RuntimeError(f"{path}: {len(theirs)} tensors read back, {len(ours)} saved")
    pairs = [(t, u.untyped_storage()) for t, u in zip(ours, theirs) if t.untyped_storage().nbytes()]
    records = []
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            folder, _, name = info.filename.rpartition("/")
            if folder.rpartition("/")[2] == "data" and name.isdigit() and info.file_size:
                f.seek(info.header_offset)
                local = f.read(30)
                if local[:4] != b"PK\x03\x04":
                    raise RuntimeError(f"{path}: no zip header at byte {info.header_offset}")
                names, extra = struct.unpack("<HH", local[26:30])
                records.append((info.header_offset + 30 + names + extra, info.file_size))
    storages = sorted({s.data_ptr(): s.nbytes() for _, s in pairs}.items())
    records.sort()
    if len(storages) != len(records) or any(
        p - storages[0][0] != o - records[0][0] or size != length for (p, size), (o, length) in zip(storages, records)
    ):
        raise RuntimeError(
            f"{path}: this torch's memory-mapped load does not place storages at their records' offsets; "
            "convert with a torch version that does (2.1 and later)"
        )
    base = storages[0][0] - records[0][0] if storages else 0
    return [(t, s.data_ptr() - base) for t, s in pairs]


def write_skeleton(f: IO[bytes], path: Path, skeleton: Any, placeholders: dict[int, Any]) -> dict[Any, int]:
    """Writes `skeleton` to `f` (the file at `path`) without the bytes of its tensors in `placeholders` (by id: made
    with torch.empty, never touched) and with every other tensor's bytes; returns the file offset of each
    placeholder's bytes, by its value in `placeholders`."""
    with torch.serialization.skip_data():
        save_to_stream(skeleton, f)
    f.flush()
    where = {}
    for t, offset in storage_offsets(path, skeleton):
        if id(t) in placeholders:
            where[placeholders[id(t)]] = offset
        else:  # the step counts, and any tensor in the param groups: their bytes, whole
            pwrite_all(f.fileno(), torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy(), offset)
    return where


def write_state_dict(f: IO[bytes], path: Path, shard: CompactShard) -> None:
    """Writes the verified `shard`'s optimizer state, in torch.optim's layout, to `f` (the file at `path`): the
    skeleton first, then each record decoded in place (module docstring)."""
    state, placeholders = {}, {}
    for i, (_, _, step) in enumerate(shard.params):
        if step is not None:
            state[i] = entry_skeleton(shard, i, torch.empty)  # address space only: never touched
            placeholders.update({id(t): (i, key) for key, t in state[i].items() if key != "step"})
    where = write_skeleton(f, path, {"state": state, "param_groups": shard.head["param_groups"]}, placeholders)
    del state
    for record, payload in shard.frames(("state",)):
        for key, at, values in decode_record(record, payload):
            pwrite_all(f.fileno(), values.contiguous().numpy(), where[(record[1], key)] + 4 * at)


def convert(directory: str | Path, tag: str | None, out: str | Path, rank: int = 0) -> Path:
    """Writes rank `rank`'s optimizer state of checkpoint `tag` (None or "latest": the latest) in `directory`
    to `out`, in torch.optim's layout (module docstring); CheckpointError naming what is wrong. Returns `out`."""
    directory, out = Path(directory), Path(out)
    tag, info = read_meta(directory, None if tag == "latest" else tag)
    path, expected = shard_file(directory, tag, info, rank)
    size = expected["bytes"]
    tmp = temp_path(out.parent, out.name)
    with open(path, "rb") as f:
        if is_compact(f):
            shard = CompactShard(f, expected, tag, path)
            write_temp(tmp, lambda g: write_state_dict(g, tmp, shard))
        else:
            found = sha256_of(path)
            if found != expected["sha256"]:
                raise hash_error(tag, path, found, expected["sha256"], size)
            whole = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
            if not isinstance(whole, dict) or not isinstance(whole.get("optimizer"), dict):
                raise CheckpointError(f"checkpoint {tag!r}, shard {path}: it holds no optimizer state dict")
            write_temp(tmp, lambda g: save_to_stream(whole["optimizer"], g))
    rename_into_place(tmp, out)
    return out
