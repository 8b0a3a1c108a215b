"""A ``torch.save`` file written without its tensors' bytes, then filled in place: what lets a converter write
an OUT.pt larger than host memory (:mod:`.portable_adamw`).

:func:`write_skeleton` saves the object with ``torch.serialization.skip_data`` (its large tensors allocated with
``torch.empty``, never touched: address space, not memory), finds the file offset of each tensor's bytes
(:func:`storage_offsets`) and returns them; the caller then writes each tensor's values there with ``os.pwrite``,
a batch at a time. The zip records' CRC-32 fields stay those of the empty tensors: ``torch.load`` does not check
them (zip tools would).
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from twinflow.checkpoint.checkpoint_files import save_to_stream
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
