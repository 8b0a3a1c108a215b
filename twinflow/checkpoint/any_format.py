"""A checkpoint in either format, told apart in one place: the portable one (:mod:`.portable`, the engine's
default) or one shard a rank (:mod:`.checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinflow.checkpoint import checkpoint_files
from twinflow.checkpoint.checkpoint import load_checkpoint
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
    """:func:`.portable_load.load_portable` or :func:`.checkpoint.load_checkpoint`, by the format of the tag."""
    load = load_portable if holds(Path(directory), tag) else load_checkpoint
    return load(directory, tag, **parts)
