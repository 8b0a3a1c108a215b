"""Checksums of a portable checkpoint's files (:mod:`twinflow.checkpoint.portable`).

Once DCP has written every rank's pieces and its ``.metadata``, each rank sums its share of the files the metadata
names (CRC-32 and size; the files it wrote, :func:`share`) into ``twinflow.sums.<rank>.json`` beside them. Then
the ranks agree that every write succeeded, and the tag is put in place. A load checks every file it is about to
read against them before it changes anything: a damaged byte, a truncated or missing file is refused, naming the
file. A tag saved before checksums existed (its ``twinflow.pt`` says none were written) is checked for sizes only.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import zlib
from pathlib import Path

from twinflow.base.distributed import rank_and_world
from twinflow.base.node import allowed_cpus
from twinflow.base.progress import NoProgress, shown
from twinflow.checkpoint.checkpoint_files import CheckpointError, write_atomic

SUMS = "twinflow.sums"
READ = 4 << 20  # bytes read at a time, into one buffer a file (no larger than it): THREADS such buffers at most
THREADS = max(1, min(8, len(allowed_cpus())))  # files summed at once (zlib and the reads let go of the interpreter)


def file_sum(path: Path) -> int:
    """The CRC-32 of the file at `path`, read `READ` bytes at a time (zlib releases the interpreter meanwhile)."""
    crc, block = 0, bytearray(max(1, min(READ, path.stat().st_size)))
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            crc = zlib.crc32(view[:n], crc)
    return crc


def file_sums(paths: list[Path], progress: str | None = None, first_rank: bool = False) -> list[int]:
    """The CRC-32 of each file of `paths`, ``THREADS`` files at a time; `progress`: what to call the work, shown
    in bytes on the `first_rank` (past a size)."""
    sizes = [path.stat().st_size for path in paths]
    meter = shown(sum(sizes), progress, first_rank) if progress else NoProgress()
    crcs = []
    threads = max(1, min(THREADS, len(paths)))
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="twinflow-sum") as pool:
        for size, crc in zip(sizes, pool.map(file_sum, paths), strict=True):
            crcs.append(crc)
            meter.update(size)
    meter.close()
    return crcs


def written_files(folder: Path) -> list[str]:
    """The files DCP's metadata in `folder` names (relative paths, sorted)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata()
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def share(files: list[str], rank: int, world: int) -> list[str]:
    """The files of `files` rank `rank` of `world` sums: those it wrote (DCP names them ``__<rank>_<n>``: they are
    in its page cache), and its turn of any named otherwise."""
    writer = {name: int(m.group(1)) if (m := re.match(r"__(\d+)_", name)) else None for name in files}
    others = [name for name in files if writer[name] is None or writer[name] >= world]
    return [name for name in files if writer[name] == rank] + others[rank::world]


def write_sums(folder: Path, rank: int, world: int) -> None:
    """Rank `rank` of `world` sums its share of the files in `folder` into ``twinflow.sums.<rank>.json``."""
    mine = share(written_files(folder), rank, world)
    crcs = file_sums([folder / name for name in mine])
    sums = {name: [(folder / name).stat().st_size, crc] for name, crc in zip(mine, crcs, strict=True)}
    write_atomic(folder / f"{SUMS}.{rank}.json", lambda f: f.write(json.dumps(sums).encode()))


def read_sums(folder: Path, world: int) -> dict[str, list[int]]:
    """Every file's [size, CRC-32], from the `world` sums files of a save by `world` ranks; one missing or
    unreadable is refused, naming it."""
    sums: dict[str, list[int]] = {}
    for rank in range(world):
        path = folder / f"{SUMS}.{rank}.json"
        try:
            sums.update(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path} cannot be read ({exc}): the checkpoint is incomplete or damaged; "
                                  "nothing was changed: load another tag, or save it again") from exc  # fmt: skip
    return sums


def check_files(folder: Path, needed: dict[str, int], sums: dict[str, list[int]] | None) -> None:
    """Refuses, naming the file, unless each file of `needed` (relative path -> the bytes a read needs from its
    start) is there and long enough, and, with `sums`, has the size and the CRC-32 the save wrote."""
    names = sorted(needed)
    sizes = {name: (folder / name).stat().st_size if (folder / name).is_file() else None for name in names}
    for name in names:
        size, why = sizes[name], None
        if size is None:
            why = "is missing"
        elif size < needed[name]:
            why = f"has {size} bytes; its pieces need {needed[name]} (truncated)"
        elif sums is not None and name not in sums:
            why = "has no checksum in the save's sums files"
        elif sums is not None and size != sums[name][0]:
            why = f"has {size} bytes; the save wrote {sums[name][0]}"
        if why is not None:
            raise CheckpointError(f"{folder / name} {why}; nothing was changed: load another tag, or save it again")
    if sums is None:
        return
    crcs = file_sums([folder / name for name in names], f"checking {folder}", rank_and_world()[0] == 0)
    for name, crc in zip(names, crcs, strict=True):
        if crc != sums[name][1]:
            raise CheckpointError(f"{folder / name} differs from what the save wrote (its CRC-32 does not match: a "
                                  "damaged byte); nothing was changed: load another tag, or save it again")  # fmt: skip
