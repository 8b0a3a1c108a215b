"""Checkpoints that are either complete or absent, and that change nothing when they cannot be loaded.

Layout of ``save_checkpoint(directory, tag, ...)``::

    directory/
      latest                 the newest complete tag (written last, atomically)
      <tag>/rank<r>.pt       one shard per rank: model, optimizer, scheduler, extra state
      <tag>/meta.json        world size, twinflow version, each shard's size and sha256, caller metadata

Every file is written under a temporary name, flushed to disk (fsync) and
renamed into place, so a crash leaves either the old checkpoint or the new
one. ``meta.json`` is renamed last: a tag without it is incomplete. Loading
reads and verifies everything (the shard's size and hash, the world size,
the model's keys and shapes) before it touches the model, the optimizer or
the scheduler.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit; nothing was changed."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as this rank holds it: local shards of FSDP2's DTensors, plain tensors otherwise."""
    from twinflow.twin_flow_adam import _local

    return {key: _local(value) for key, value in model.state_dict().items()}


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_checkpoint(
    directory: str | Path,
    tag: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    extra: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Writes this rank's shard of checkpoint `tag`; rank 0 then writes its metadata and ``latest``.

    `extra` (saved in the shard) holds tensors and plain values such as the
    step count or RNG states; `meta` (saved as JSON) describes the run, e.g.
    the config and the ratio. With several ranks, call it on every rank.
    Returns the tag's folder.
    """
    from twinflow import __version__

    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"tag={tag!r}; expected a plain folder name")
    rank, world = rank_and_world()
    folder = Path(directory) / tag
    folder.mkdir(parents=True, exist_ok=True)
    shard = {
        "model": _local_state(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra": extra or {},
    }
    path = folder / f"rank{rank}.pt"
    _write_atomic(path, lambda f: torch.save(shard, f))
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        shards = {}
        for r in range(world):
            p = folder / f"rank{r}.pt"
            shards[p.name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        info = {"world_size": world, "twinflow_version": __version__, "shards": shards, "meta": meta or {}}
        _write_atomic(folder / "meta.json", lambda f: f.write(json.dumps(info, indent=2).encode()))
        _write_atomic(Path(directory) / "latest", lambda f: f.write(tag.encode()))
    if world > 1:
        torch.distributed.barrier()
    return folder


def read_meta(directory: str | Path, tag: str | None = None) -> tuple[str, dict[str, Any]]:
    """The tag (``latest`` when None) and its metadata; CheckpointError if it is missing or incomplete."""
    directory = Path(directory)
    if tag is None:
        latest = directory / "latest"
        if not latest.exists():
            raise CheckpointError(f"no checkpoint in {str(directory)!r}: {latest.name!r} not found")
        tag = latest.read_text().strip()
    meta_path = directory / tag / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(
            f"checkpoint {tag!r} in {str(directory)!r} is missing or incomplete (no meta.json): it was never "
            "finished; load another tag"
        )
    try:
        return tag, json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path}: corrupted metadata ({exc.msg})") from exc


@torch.no_grad()
def _copy_into(targets: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    """In place, into the tensors the model holds (state_dict values share their storage)."""
    for key, target in targets.items():
        target.copy_(values[key])


def load_checkpoint(
    directory: str | Path,
    tag: str | None = None,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores this rank's shard into `model`, `optimizer` and `scheduler`; returns (extra, meta).

    `meta` is the tag's metadata with ``tag`` added: the one loaded (``latest``
    resolved).

    Everything is read and verified first; on any problem CheckpointError is
    raised and nothing has changed. The optimizer may be built with another
    ratio or placement than the saved one (TwinFlowAdam's state dict is
    ratio-independent).
    """
    directory = Path(directory)
    tag, info = read_meta(directory, tag)
    rank, world = rank_and_world()
    if info.get("world_size") != world:
        raise CheckpointError(
            f"checkpoint {tag!r} was saved by {info.get('world_size')} ranks; this run has {world}: resume with "
            f"the same number of processes"
        )
    path = directory / tag / f"rank{rank}.pt"
    expected = info["shards"].get(path.name)
    if expected is None or not path.exists():
        raise CheckpointError(f"checkpoint {tag!r}: shard {path.name} is missing")
    data = path.read_bytes()  # read once: hashed, then loaded from memory
    if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(
            f"checkpoint {tag!r}: {path.name} is truncated or corrupted ({len(data)} bytes, {expected['bytes']} "
            "recorded, or a different hash); load another tag"
        )
    shard = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    current = _local_state(model)
    saved = shard["model"]
    if set(saved) != set(current):
        missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        raise CheckpointError(
            f"checkpoint {tag!r} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, value in saved.items():
        if value.shape != current[key].shape:
            raise CheckpointError(
                f"checkpoint {tag!r}: {key} has shape {tuple(value.shape)}, the model has {tuple(current[key].shape)}"
            )
    if (scheduler is None) != (shard["scheduler"] is None):
        raise CheckpointError(f"checkpoint {tag!r}: a scheduler was {'not ' if scheduler is not None else ''}saved")
    # The model first: an optimizer without a saved master (fp32 parameters) takes it from the weights. If the
    # optimizer then refuses its state (it checks before changing anything), the model gets its weights back.
    backup = {key: value.detach().clone() for key, value in current.items()}
    _copy_into(current, saved)
    try:
        optimizer.load_state_dict(shard["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        _copy_into(current, backup)
        raise CheckpointError(f"checkpoint {tag!r}: the optimizer state does not fit: {exc}") from exc
    if scheduler is not None:
        scheduler.load_state_dict(shard["scheduler"])
    return shard["extra"], info | {"tag": tag}
