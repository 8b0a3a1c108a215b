"""Checkpoints that are either complete or absent, and that change nothing when they cannot be loaded.

Layout of ``save_checkpoint(directory, tag, ...)``::

    directory/
      latest                 the newest complete tag (written last, atomically)
      <tag>/rank<r>.pt       one shard per rank: model, optimizer, scheduler, extra state, layout (names)
      <tag>/meta.json        world size, twinflow version, each shard's size and sha256, caller metadata

Every file is written under a temporary name, flushed to disk (fsync) and renamed into place, so a crash leaves
either the old checkpoint or the new one. ``meta.json`` is renamed last: a tag without it is incomplete. The
arguments are checked (``meta`` as JSON, ``extra`` as something
``torch.load(weights_only=True)`` reads back) and the shard is written to its
temporary before the tag folder is created, so a save that fails leaves
nothing new behind; a KeyboardInterrupt (Ctrl-C) during a save cleans up and
propagates as KeyboardInterrupt. What a killed save left (temporaries, a tag
folder without meta.json) is removed at the next save or load of the
directory, with a notice saying what was removed (:mod:`twinflow.checkpoint.checkpoint_files`
holds this file layer). Saving a tag again replaces it in place: its
meta.json goes first, so an interrupted re-save leaves an incomplete tag
(removed later), never one whose meta.json describes other shards.

A TwinFlowAdam with compact state (``state_precision`` "int8", "int8_m24")
has its shard in :mod:`twinflow.checkpoint.compact_checkpoint`'s format: its state as
kept, written and loaded a record at a time (bit for bit, at any ratio).

Loading reads and verifies everything (where the checkpoint is, meta.json's
structure, the shard's size and hash, the world size, the model's keys and
shapes, the optimizer state's entries) before it touches the model, the
optimizer or the scheduler. A save and a load each end with one notice
giving the path, the size and the seconds taken.
"""

from __future__ import annotations

import functools
import io
import json
import time
from pathlib import Path
from typing import Any

import torch

from twinflow.base.distributed import local, rank_and_world
from twinflow.base.notice import notice
from twinflow.checkpoint import compact_checkpoint, rank_shard
from twinflow.checkpoint.checkpoint_files import (
    DAMAGED,
    CheckpointError,
    finish_saving,
    format_bytes,
    make_dirs,
    mark_saving,
    read_meta,
    read_verified,
    remove_created,
    remove_leftovers,
    rename_into_place,
    save_to_stream,
    sha256_of,
    size_error,
    temp_path,
    unwritable_error,
    write_atomic,
    write_temp,
)
from twinflow.checkpoint.portable import remove_portable
from twinflow.checkpoint.saved_values import check_extra, check_tag, meta_json, weights_only_error
from twinflow.optim.cpu_adam import CPUAdam
from twinflow.optim.offload_states import where_now
from twinflow.optim.twin_flow_adam import TwinFlowAdam
from twinflow.version import __version__

__all__ = ["CheckpointError", "load_checkpoint", "read_meta", "save_checkpoint"]


def _local_state(model: torch.nn.Module, optimizer: Any = None) -> dict[str, torch.Tensor]:
    """The model's state as this rank holds it (FSDP2: local shards), read where ``offload_states`` moved it."""
    view = where_now(optimizer)
    return {key: v if (v := view(x)) is x else v.clone() for key, t in model.state_dict().items() for x in [local(t)]}


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
    the config and the ratio. Both are checked before anything is written
    (TypeError naming the offending entry); a save that fails leaves no new
    file or folder; a folder it may not write raises an OSError
    (PermissionError, or read-only) naming the directory given and the fix;
    Ctrl-C propagates as KeyboardInterrupt. With several ranks, call it on
    every rank. Returns the tag's folder.
    """
    check_tag(tag)
    meta = {} if meta is None else meta
    extra = {} if extra is None else extra
    meta_json(meta)  # on every rank, before anything is written: all ranks refuse alike
    check_extra(extra)
    rank, world = rank_and_world()
    start = time.monotonic()
    directory = Path(directory)
    folder = directory / tag
    path = folder / f"rank{rank}.pt"
    created: list[Path] = []  # what this call made, removed again if it fails
    marker: Path | None = None  # while set, the tag folder is being written
    try:
        try:
            created += make_dirs(directory)
            remove_leftovers(directory)
            if callable(getattr(optimizer, "synchronize", None)):
                optimizer.synchronize()  # the model's weights hold every update taken, a delayed one included
            shard = {
                "model": _local_state(model, optimizer),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "extra": extra,
                "layout": rank_shard.layout(model, optimizer),
            }
            if compact_checkpoint.writes_compact(optimizer):  # its state as it is kept, a record at a time
                write = functools.partial(compact_checkpoint.write, optimizer=optimizer, **shard)
            else:
                write = functools.partial(save_to_stream, shard | {"optimizer": optimizer.state_dict()})
            # Streamed to a temporary beside the tag folder (the same file system, so the rename stays atomic),
            # not into memory: the shard can be as large as the optimizer's whole state. The tag folder is made
            # only once the shard is on disk.
            tmp = temp_path(directory, f"{tag}.{path.name}")
            write_temp(tmp, write)
            try:
                if world > 1:
                    torch.distributed.barrier()  # every rank has cleaned up before any rank writes into the tag
                created += make_dirs(folder)
                marker = mark_saving(folder)
                (folder / "meta.json").unlink(missing_ok=True)  # a re-saved tag: it would describe the old shards
                remove_portable(folder)  # a tag saved portable before: a load would find that one first
                if not path.exists():
                    created.append(path)
                rename_into_place(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            if world > 1:
                torch.distributed.barrier()
                created = [c for c in created if c != path]  # every shard in place: meta.json decides the tag
            if rank == 0:
                paths = [folder / f"rank{r}.pt" for r in range(world)]
                shards = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in paths}
                info = {"world_size": world, "twinflow_version": __version__, "shards": shards, "meta": meta}
                meta_path = folder / "meta.json"
                created.append(meta_path)
                write_atomic(meta_path, lambda f: f.write(json.dumps(info, indent=2).encode()))
                write_atomic(directory / "latest", lambda f: f.write(tag.encode()))
            if world > 1:
                torch.distributed.barrier()
        except OSError as exc:
            error = unwritable_error(exc, directory)
            if error is None:
                raise
            raise error from exc
    except BaseException:
        if marker is not None:  # the tag folder, incomplete once its meta.json is gone, goes with the last writer
            finish_saving(marker, remove=False)
            remove_leftovers(directory)
        remove_created(created)
        raise
    if marker is not None:
        finish_saving(marker, remove=True)
    if rank == 0:
        size = sum(entry["bytes"] for entry in shards.values())
        count = f"{world} shards, " if world > 1 else ""
        notice("saved checkpoint %r to %s (%s%s, %.1f s)", tag, folder, count, format_bytes(size),
               time.monotonic() - start)  # fmt: skip
    return folder


def _check_shard(shard: Any, where: str) -> None:
    """CheckpointError unless the loaded shard has the structure save_checkpoint writes."""
    keys = ("model", "optimizer", "scheduler", "extra")
    if not isinstance(shard, dict) or any(key not in shard for key in keys):
        found = sorted(shard) if isinstance(shard, dict) else type(shard).__name__
        raise CheckpointError(f"{where}: expected a dict with keys {list(keys)}, found {found}. {DAMAGED}")
    if not isinstance(shard["model"], dict) or not all(isinstance(v, torch.Tensor) for v in shard["model"].values()):
        raise CheckpointError(f"{where}: 'model' is not a state dict of tensors. {DAMAGED}")
    if not isinstance(shard["extra"], dict):
        raise CheckpointError(f"{where}: 'extra' is a {type(shard['extra']).__name__}, expected a dict. {DAMAGED}")


def _required_state_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[str, ...]:
    """The keys every per-parameter state entry of `optimizer` needs (none known: no check)."""
    # One torch.optim layout for the Adam family; amsgrad (torch's Adam/AdamW) adds its running maximum.
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, CPUAdam, TwinFlowAdam)):
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    return ()


def _check_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Any, where: str) -> None:
    """CheckpointError naming the parameter index and key when the saved optimizer state lacks an entry.

    Runs before the optimizer sees the state: some optimizers (torch's among
    them) would change their groups before failing on a missing key, or fail
    only at the next step. TwinFlowAdam's own ``load_state_dict`` also checks
    before changing anything, but as torch does it takes an entry without
    Adam's keys for state of the user's own (a fresh parameter); in a
    checkpoint such an entry is damage.
    """
    fix = (
        "The checkpoint is damaged or was saved with another optimizer: load another tag, or build the optimizer "
        "it was saved with"
    )
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        raise CheckpointError(f"{where}: the optimizer state has no 'state' dict (a torch.optim state dict). {fix}")
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointError(
            f"{where}: the optimizer state's 'param_groups' is not a list of groups with 'params'. {fix}"
        )
    group_of = {pid: gi for gi, g in enumerate(groups) for pid in g["params"]}
    params: dict[Any, torch.Tensor] = {}  # saved index -> this optimizer's parameter, where the groups line up
    if len(groups) == len(optimizer.param_groups):
        for saved, ours in zip(groups, optimizer.param_groups):
            if len(saved["params"]) == len(ours["params"]):
                params.update(zip(saved["params"], ours["params"]))
    name = type(optimizer).__name__
    for pid, entry in state_dict["state"].items():
        if pid not in group_of:
            raise CheckpointError(
                f"{where}: the optimizer state has an entry for parameter index {pid!r}, which no param group "
                f"lists. {fix}"
            )
        gi = group_of[pid]
        if not isinstance(entry, dict):
            raise CheckpointError(
                f"{where}: the optimizer state of parameter index {pid} (param group {gi}) is a "
                f"{type(entry).__name__}, expected a dict. {fix}"
            )
        needed = _required_state_keys(optimizer, groups[gi])
        for key in needed:
            if key not in entry:
                raise CheckpointError(
                    f"{where}: the optimizer state of parameter index {pid} (param group {gi}) has no {key!r}; "
                    f"{name} needs {list(needed)} for every parameter with state, found {sorted(entry)}. {fix}"
                )
            value = entry[key]
            if key == "step":
                ok = isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)
                if not ok:
                    raise CheckpointError(
                        f"{where}: the optimizer state of parameter index {pid}: 'step' is {type(value).__name__}, "
                        f"expected a number or a one-element tensor. {fix}"
                    )
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"{where}: the optimizer state of parameter index {pid}: {key!r} is a "
                    f"{type(value).__name__}, expected a tensor. {fix}"
                )
            p = params.get(pid)
            if p is not None and local(value).numel() != local(p).numel():
                raise CheckpointError(
                    f"{where}: the optimizer state of parameter index {pid}: {key!r} has {local(value).numel()} "
                    f"elements, the parameter has {local(p).numel()}: it was saved for another model or parameter "
                    "order; build the model and optimizer as when it was saved"
                )


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

    `directory` is the one given to save_checkpoint; `meta` is the tag's
    metadata with ``tag`` added: the one loaded (``latest`` resolved).

    Everything is read and verified first; on any problem CheckpointError is
    raised, naming it and the fix, and nothing has changed. The optimizer may
    be built with another ratio or placement than the saved one
    (TwinFlowAdam's state dict is ratio-independent); a compact shard loads
    into any optimizer (decoded in memory unless it is a compact TwinFlowAdam).
    """
    if isinstance(optimizer, TwinFlowAdam):
        optimizer.offload.check("load_checkpoint()")  # before anything changes
    start = time.monotonic()
    directory = Path(directory)
    if directory.is_dir():
        remove_leftovers(directory)
    tag, info = read_meta(directory, tag)
    rank, world = rank_and_world()
    if info["world_size"] != world:
        raise CheckpointError(
            f"checkpoint {tag!r} was saved by {info['world_size']} ranks; this run has {world}: resume with "
            f"the same number of processes (a per-rank checkpoint), or rewrite it in the portable format, which "
            f"any number resumes: python -m twinflow.convert {directory} {tag} --to-portable OUT_DIR"
        )
    path = directory / tag / f"rank{rank}.pt"
    expected = info["shards"].get(path.name)
    if expected is None:
        raise CheckpointError(
            f"checkpoint {tag!r}: its meta.json lists no shard {path.name} (it lists {sorted(info['shards'])}). "
            f"{DAMAGED}"
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {tag!r}: shard {path} is missing (meta.json records it): copy it back, or load another tag"
        )
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise size_error(tag, path, size, expected["bytes"])
    where = f"checkpoint {tag!r}, shard {path}"
    with open(path, "rb") as f:
        if compact_checkpoint.is_compact(f):
            compact = compact_checkpoint.CompactShard(f, expected, tag, path)  # read and verified, a frame at a time
            if compact_checkpoint.writes_compact(optimizer):
                extra = _load_compact(tag, compact, model, optimizer, scheduler)
            else:  # any other optimizer (or TwinFlowAdam before ratio='auto' built): decoded, in memory
                extra = _load_shard(tag, compact_checkpoint.decoded(compact), where, model, optimizer, scheduler)
        else:
            data = read_verified(f, tag, path, expected)  # read once: hashed, then loaded from memory
            try:
                shard = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as exc:  # its hash matched: written so, e.g. by another tool, not damaged on the way
                raise CheckpointError(
                    f"{where} cannot be read with torch.load(weights_only=True) ({weights_only_error(exc)}). {DAMAGED}"
                ) from exc
            extra = _load_shard(tag, shard, where, model, optimizer, scheduler)
    if rank == 0:
        count = f"rank 0's of {world} shards, " if world > 1 else ""
        notice("loaded checkpoint %r from %s (%s%s, %.1f s)", tag, path, count, format_bytes(size),
               time.monotonic() - start)  # fmt: skip
    return extra, info | {"tag": tag}


def _check_fits(tag: str, saved: dict[str, torch.Size], current: dict[str, torch.Tensor], saved_scheduler: bool,
                scheduler: Any | None) -> None:  # fmt: skip
    """CheckpointError unless the saved model's keys and shapes are the model's, and a scheduler saved if given."""
    if set(saved) != set(current):
        missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        raise CheckpointError(
            f"checkpoint {tag!r} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, shape in saved.items():
        if shape != current[key].shape:
            raise CheckpointError(
                f"checkpoint {tag!r}: {key} has shape {tuple(shape)}, the model has {tuple(current[key].shape)}"
            )
    if (scheduler is None) == saved_scheduler:
        raise CheckpointError(f"checkpoint {tag!r}: a scheduler was {'not ' if scheduler is not None else ''}saved")


def _not_fitting(tag: str, exc: Exception) -> CheckpointError:
    return CheckpointError(f"checkpoint {tag!r}: the optimizer state does not fit: {exc}. The checkpoint is damaged or "
                           "was saved with another optimizer or model: load another tag, or build the model and "
                           "optimizer it was saved with")  # fmt: skip


def _load_shard(tag: str, shard: Any, where: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Any | None) -> dict[str, Any]:  # fmt: skip
    """Checks the loaded `shard` against the model, optimizer and scheduler, loads it into them; its extra."""
    _check_shard(shard, where)
    current = _local_state(model)
    _check_fits(tag, {key: value.shape for key, value in shard["model"].items()}, current,
                shard["scheduler"] is not None, scheduler)  # fmt: skip
    _check_optimizer_state(optimizer, shard["optimizer"], where)
    # The model first: an optimizer without a saved master (fp32 parameters) takes it from the weights. If the
    # optimizer then refuses its state (it checks before changing anything), the model gets its weights back.
    backup = {key: value.detach().clone() for key, value in current.items()}
    _copy_into(current, shard["model"])
    try:
        optimizer.load_state_dict(shard["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        _copy_into(current, backup)
        raise _not_fitting(tag, exc) from exc
    if scheduler is not None:
        scheduler.load_state_dict(shard["scheduler"])
    return shard["extra"]


def _load_compact(tag: str, shard: compact_checkpoint.CompactShard, model: torch.nn.Module, optimizer: TwinFlowAdam,
                  scheduler: Any | None) -> dict[str, Any]:  # fmt: skip
    """Checks the verified compact `shard` against the model, optimizer and scheduler, then loads it into them a
    record at a time, the optimizer's state as it is kept (no whole copy of the model or the state); its extra."""
    current = _local_state(model)
    _check_fits(tag, {key: shape for key, shape, _ in shard.model}, current, shard.scheduler is not None, scheduler)
    try:
        compact_checkpoint.check_fits(shard, optimizer)
    except ValueError as exc:
        raise _not_fitting(tag, exc) from exc
    compact_checkpoint.load_in_place(shard, current, optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(shard.scheduler)
    return shard.extra
