"""A checkpoint's format, told apart in one place: the portable one (:mod:`.portable`), which twinflow writes and
loads, or one shard a rank (twinflow 0.1.0's), which :mod:`.to_portable` rewrites in the portable format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinflow.checkpoint import checkpoint_files
from twinflow.checkpoint.checkpoint_files import CheckpointError
from twinflow.checkpoint.portable import holds
from twinflow.checkpoint.portable_load import Folder, load_portable


def read_meta(directory: str | Path, tag: str | None = None) -> tuple[str, dict[str, Any]]:
    """The tag (``latest``'s when None) and what was saved beside its tensors, in either format, checked (a
    CheckpointError names the problem and the fix): ``meta`` (the caller's; the engine's holds its config and the
    ratio it ran at), ``world_size``, ``twinflow_version``, and the format's own entries."""
    tag = None if tag == "latest" else tag
    if holds(Path(directory), tag):
        folder = Folder(Path(directory), tag)
        return folder.tag, folder.info
    return checkpoint_files.read_meta(directory, tag)


def load_either(directory: str | Path, tag: str | None = None, **parts: Any) -> tuple[Any, Any]:
    """:func:`.portable_load.load_portable`; a per-rank checkpoint is refused (nothing changes), naming the command
    that rewrites it in the portable format."""
    tag = None if tag == "latest" else tag
    if not holds(Path(directory), tag):
        found, info = checkpoint_files.read_meta(directory, tag)  # a CheckpointError where there is no checkpoint
        raise CheckpointError(
            f"checkpoint {found!r} in {directory} is a per-rank one (one shard a rank, written by twinflow "
            f"{info.get('twinflow_version', '0.1.0')}), which this twinflow no longer loads: rewrite it in the "
            f"portable format with `python -m twinflow.convert {directory} {found} --to-portable OUT_DIR` and load "
            "OUT_DIR, on any number of processes"
        )
    return load_portable(directory, tag, **parts)
