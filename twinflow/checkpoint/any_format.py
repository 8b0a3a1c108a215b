"""A checkpoint's format, told apart in one place: the portable one (:mod:`.portable`), which twinflow writes and
loads, or one shard a rank (twinflow 0.1.0's), which :mod:`.to_portable` rewrites in the portable format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinflow.checkpoint import checkpoint_files
from twinflow.checkpoint.checkpoint_files import CheckpointError, rewrite_command
from twinflow.checkpoint.portable import holds, tag_named
from twinflow.checkpoint.portable_load import Folder, load_portable


def read_meta(directory: str | Path, tag: str | None = None) -> tuple[str, dict[str, Any]]:
    """The tag (``latest``'s when None) and what was saved beside its tensors, in either format, checked (a
    CheckpointError names the problem and the fix): ``meta`` (the caller's; the engine's holds its config and the
    ratio it ran at), ``world_size``, ``twinflow_version``, and the format's own entries."""
    found = per_rank(directory, tag)
    if found is not None:
        return found
    folder = Folder(Path(directory), tag)  # a portable one, or the portable messages
    return folder.tag, folder.info


def per_rank(directory: str | Path, tag: str | None) -> tuple[str, dict[str, Any]] | None:
    """The tag and meta.json (checked: a CheckpointError names what is wrong) of `tag` (None or "latest":
    ``latest``'s) of `directory` where its folder holds a per-rank checkpoint's meta.json; None otherwise (a portable
    checkpoint, or none: the portable load's messages say what is there)."""
    directory = Path(directory)
    if holds(directory, tag):
        return None
    name = tag_named(directory, tag)
    if not name or not checkpoint_files.is_per_rank(directory / name):
        return None
    return checkpoint_files.read_meta(directory, name)


def load_either(directory: str | Path, tag: str | None = None, **parts: Any) -> tuple[Any, Any]:
    """:func:`.portable_load.load_portable`; a per-rank checkpoint is refused (nothing changes), naming the command
    that rewrites it in the portable format."""
    found = per_rank(directory, tag)
    if found is not None:
        raise CheckpointError(
            f"checkpoint {found[0]!r} in {str(directory)!r} is a per-rank one (one shard a rank, written by twinflow "
            f"{found[1].get('twinflow_version', '0.1.0')}), which this twinflow no longer loads: rewrite it in the "
            f"portable format with `{rewrite_command(directory, found[0])}` and load OUT_DIR, on any number of "
            "processes"
        )
    return load_portable(directory, tag, **parts)
