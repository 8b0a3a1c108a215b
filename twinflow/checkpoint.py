"""Checkpoints that are either complete or absent, and that change nothing when they cannot be loaded.

Layout of ``save_checkpoint(directory, tag, ...)``::

    directory/
      latest                 the newest complete tag (written last, atomically)
      <tag>/rank<r>.pt       one shard per rank: model, optimizer, scheduler, extra state
      <tag>/meta.json        world size, twinflow version, each shard's size and sha256, caller metadata

Every file is written under a temporary name, flushed to disk (fsync) and
renamed into place, so a crash leaves either the old checkpoint or the new
one. ``meta.json`` is renamed last: a tag without it is incomplete. The
arguments are checked (``meta`` as JSON, ``extra`` as something
``torch.load(weights_only=True)`` reads back) and the shard is written to its
temporary before the tag folder is created, so a save that fails leaves
nothing new behind. Temporaries that a killed save left are removed at the
next save or load of the directory.

Loading reads and verifies everything (where the checkpoint is, meta.json's
structure, the shard's size and hash, the world size, the model's keys and
shapes, the optimizer state's entries) before it touches the model, the
optimizer or the scheduler.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from twinflow.cpu_adam import CPUAdam
from twinflow.distributed import local, rank_and_world
from twinflow.twin_flow_adam import TwinFlowAdam
from twinflow.version import __version__


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit; nothing was changed."""


_SHARD = re.compile(r"rank\d+\.pt")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Our temporaries: ".<target>.tmp<pid>@<host>", <target> being "latest", "meta.json" or "<tag>.rank<r>.pt" (a
# shard staged in the checkpoint directory before its tag folder exists). Earlier versions wrote
# ".rank<r>.pt.tmp<pid>" (and the others) without "@<host>": recognised too, so their leftovers are cleaned.
_TEMP = re.compile(
    r"\.(?P<target>latest|meta\.json|(?:.+\.)?rank\d+\.pt)\.tmp(?P<pid>\d+)(?:@(?P<host>[A-Za-z0-9._-]+))?"
)
_DAMAGED = (
    "The checkpoint is damaged or was not written by twinflow.checkpoint.save_checkpoint: load another tag, "
    "or save it again"
)


def _host() -> str:
    """This machine's name as it appears in temporaries' names (characters safe in a file name)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def _temp_path(folder: Path, target: str) -> Path:
    return folder / f".{target}.tmp{os.getpid()}@{_host()}"


def _pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (True when it cannot be told)."""
    if pid <= 0:  # os.kill(0 or -n) would address process groups: never call such a writer dead
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, under another user
        return True
    return True


def _remove_stale_temporaries(directory: Path) -> None:
    """Removes the temporaries that killed saves left in `directory` and its tag folders.

    A temporary goes only when its writer is certainly gone: its name must be
    one this module writes, it must name this host (names without a host,
    from older versions, are taken as this host's) and no process with its
    pid may exist here. So a rank never removes another rank's or another
    job's in-flight temporary, on this host (its writer is alive) or on
    another one sharing the file system (its pid cannot be checked from here,
    so it stays). A dead writer's pid reused by a new process keeps the file
    until a later call. Separate pid namespaces with the same host name (e.g.
    containers on the host network sharing a volume) would defeat the check.
    """
    host = _host()
    try:
        folders = [directory, *(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink())]
    except OSError:
        return
    for folder in folders:
        try:
            names = [p for p in folder.iterdir() if p.name.startswith(".")]
        except OSError:  # removed meanwhile, or unreadable: nothing of ours to clean there
            continue
        for p in names:
            m = _TEMP.fullmatch(p.name)
            if m is None or (m["host"] or host) != host or _pid_alive(int(m["pid"])):
                continue
            try:
                p.unlink(missing_ok=True)  # missing: another rank removed it first
            except OSError:  # cleaning is a courtesy: a leftover we may not remove must not fail the save
                pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(tmp: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Writes `tmp` through `write` and flushes it to disk; on any failure `tmp` is gone."""
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _rename_into_place(tmp: Path, path: Path) -> None:
    """Renames the flushed `tmp` to `path` and makes the rename durable; on failure `tmp` is gone."""
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    if tmp.parent != path.parent:
        _fsync_dir(tmp.parent)


def _write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    tmp = _temp_path(path.parent, path.name)
    _write_temp(tmp, write)
    _rename_into_place(tmp, path)


def _make_dirs(path: Path) -> list[Path]:
    """Creates `path` and its missing parents; returns the folders this call created, outermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    created = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:  # another rank made it: not ours to remove
            continue
        created.append(folder)
    return created


def _remove_created(paths: list[Path]) -> None:
    """Undoes a failed save: removes its new files, then its new folders if they are empty."""
    for p in reversed(paths):
        try:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()  # fails when not empty: another rank's shard keeps the folder
            else:
                p.unlink(missing_ok=True)
        except OSError:
            pass


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as this rank holds it: local shards of FSDP2's DTensors, plain tensors otherwise."""
    return {key: local(value) for key, value in model.state_dict().items()}


def _check_tag(tag: Any) -> None:
    if not isinstance(tag, str) or not tag or "/" in tag or os.sep in tag or tag.startswith(".") or tag == "latest":
        raise ValueError(
            f"tag={tag!r}; expected a plain folder name (a non-empty string without '/', not starting with '.', "
            "not 'latest'), e.g. tag='step100'"
        )


def _json_offender(value: Any, where: str) -> tuple[str, Any] | None:
    """The first place in `value` that JSON cannot hold, as (where, what), or None."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    if isinstance(value, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for key in value:
            if key is not None and not isinstance(key, (str, int, float, bool)):
                return f"the key {key!r} of {where}", key
        items = ((f"{where}[{key!r}]", v) for key, v in value.items())
    else:
        return where, value
    for place, item in items:
        found = _json_offender(item, place)
        if found is not None:
            return found
    return None


def _meta_json(meta: Any) -> str:
    """`meta` as JSON text; TypeError naming the first value JSON cannot hold."""
    if not isinstance(meta, dict):
        raise TypeError(f"meta= is a {type(meta).__name__}; expected a dict of JSON values (it becomes meta.json)")
    try:
        return json.dumps(meta)
    except (TypeError, ValueError, RecursionError) as exc:
        try:
            found = _json_offender(meta, "meta")
        except RecursionError:
            found = None
        if found is None:  # e.g. a dict that contains itself
            raise TypeError(f"meta= cannot be written as JSON ({exc}); pass a tree of plain values") from exc
        where, value = found
        raise TypeError(
            f"{where} is a {type(value).__name__}, which JSON cannot hold (meta= is saved as meta.json): pass "
            "str, int, float, bool, None, lists and dicts with string keys, e.g. str(value) or tensor.tolist()"
        ) from exc


def _weights_only_error(exc: Exception) -> str:
    """The line of torch's (long) error that names what failed."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if "Unsupported global" in line or "WeightsUnpickler" in line]
    return f"{type(exc).__name__}: {(useful or lines or [''])[0][:300]}"


def _round_trip(value: Any) -> None:
    """Raises what torch.save, or torch.load(weights_only=True) reading it back, raises for `value`."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)


def _check_extra(extra: Any) -> None:
    """TypeError naming the entry of `extra` that cannot be saved, or not loaded back by load_checkpoint."""
    if not isinstance(extra, dict):
        raise TypeError(f"extra= is a {type(extra).__name__}; expected a dict (e.g. {{'step': 3}})")
    try:
        _round_trip(extra)  # in memory: extra holds counters and RNG states, small beside the shard
    except (OSError, MemoryError):
        raise
    except Exception as whole:
        for key, value in extra.items():
            try:
                _round_trip(value)
            except (OSError, MemoryError):
                raise
            except Exception as exc:
                raise TypeError(
                    f"extra[{key!r}] (a {type(value).__name__}) cannot be saved in a checkpoint that "
                    f"load_checkpoint reads back with torch.load(weights_only=True) ({_weights_only_error(exc)}): "
                    "pass tensors and plain values (numbers, strings, lists, tuples, dicts), e.g. obj.state_dict() "
                    "instead of obj, or str(obj)"
                ) from exc
        raise TypeError(
            f"extra= cannot be saved ({_weights_only_error(whole)}): pass tensors and plain values"
        ) from whole


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
    file or folder. With several ranks, call it on every rank. Returns the
    tag's folder.
    """
    _check_tag(tag)
    meta = {} if meta is None else meta
    extra = {} if extra is None else extra
    _meta_json(meta)  # on every rank, before anything is written: all ranks refuse alike
    _check_extra(extra)
    rank, world = rank_and_world()
    directory = Path(directory)
    folder = directory / tag
    path = folder / f"rank{rank}.pt"
    created: list[Path] = []  # what this call made, removed again if it fails
    try:
        created += _make_dirs(directory)
        _remove_stale_temporaries(directory)
        if callable(getattr(optimizer, "synchronize", None)):
            optimizer.synchronize()  # the model's weights hold every update taken, a delayed one included
        shard = {
            "model": _local_state(model),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra": extra,
        }
        # Streamed to a temporary beside the tag folder (the same file system, so the rename stays atomic),
        # not into memory: the shard can be as large as the optimizer's whole state. The tag folder is made
        # only once the shard is on disk.
        tmp = _temp_path(directory, f"{tag}.{path.name}")
        _write_temp(tmp, lambda f: torch.save(shard, f))
        try:
            created += _make_dirs(folder)
            if not path.exists():
                created.append(path)
            _rename_into_place(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        if world > 1:
            torch.distributed.barrier()
        if rank == 0:
            shards = {}
            for r in range(world):
                p = folder / f"rank{r}.pt"
                shards[p.name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            info = {"world_size": world, "twinflow_version": __version__, "shards": shards, "meta": meta}
            meta_path = folder / "meta.json"
            if not meta_path.exists():
                created.append(meta_path)
            _write_atomic(meta_path, lambda f: f.write(json.dumps(info, indent=2).encode()))
            _write_atomic(directory / "latest", lambda f: f.write(tag.encode()))
        if world > 1:
            torch.distributed.barrier()
    except BaseException:
        _remove_created(created)
        raise
    return folder


def _tags(directory: Path) -> tuple[list[str], list[str]]:
    """The complete tags in `directory` (with meta.json, oldest first) and the incomplete ones (shards only)."""
    complete: list[tuple[float, str]] = []
    incomplete: list[str] = []
    try:
        folders = sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError:
        return [], []
    for p in folders:
        meta_path = p / "meta.json"
        try:
            if meta_path.is_file():
                complete.append((meta_path.stat().st_mtime, p.name))
            elif any(_SHARD.fullmatch(q.name) for q in p.iterdir()):
                incomplete.append(p.name)
        except OSError:  # removed meanwhile, or unreadable: the hint lists what can be read
            continue
    return [name for _, name in sorted(complete)], incomplete


def _tag_hint(directory: Path) -> str:
    """Which tags `directory` holds, and how to pick one."""
    complete, incomplete = _tags(directory)
    if complete:
        hint = f"complete checkpoints there, oldest first: {complete}; pass one as tag=, e.g. tag={complete[-1]!r}"
    else:
        hint = f"there is no complete checkpoint (tag folder with meta.json) in {str(directory)!r}"
    if incomplete:
        hint += f" (incomplete, never finished: {incomplete})"
    return hint


def _check_directory(directory: Path) -> None:
    """CheckpointError naming the mistake when `directory` is not a checkpoint directory, and the fix."""
    if not directory.exists():
        raise CheckpointError(
            f"{str(directory)!r} does not exist: pass the directory given to save_checkpoint (the folder that "
            "holds 'latest' and the tag folders)"
        )
    if not directory.is_dir():
        if _SHARD.fullmatch(directory.name) or directory.name == "meta.json":
            kind = "shard" if directory.name != "meta.json" else "metadata"
            raise CheckpointError(
                f"{str(directory)!r} is a {kind} file of checkpoint {directory.parent.name!r}; pass the checkpoint "
                f"directory {str(directory.parent.parent)!r} and tag={directory.parent.name!r}"
            )
        if directory.name == "latest":
            raise CheckpointError(f"{str(directory)!r} is the 'latest' file; pass its folder {str(directory.parent)!r}")
        raise CheckpointError(
            f"{str(directory)!r} is a file, not a checkpoint directory: pass the directory given to save_checkpoint"
        )
    looks_like_tag = (directory / "meta.json").is_file() or any(_SHARD.fullmatch(p.name) for p in directory.iterdir())
    if looks_like_tag and not (directory / "latest").exists():
        raise CheckpointError(
            f"{str(directory)!r} is a checkpoint tag folder; pass its parent {str(directory.parent)!r} as the "
            f"directory and tag={directory.name!r}"
        )


def _check_meta(meta_path: Path, info: Any) -> None:
    """CheckpointError naming the key of meta.json that is missing or bad, and what was expected."""

    def bad(key: str, expected: str, value: Any = None, missing: bool = False) -> CheckpointError:
        found = "missing" if missing else f"{value!r}"[:80]
        return CheckpointError(f"{meta_path}: {key} is {found}; expected {expected}. {_DAMAGED}")

    if not isinstance(info, dict):
        raise bad("the top level", "a JSON object with 'world_size' and 'shards'", info)
    ws_expected = "the number of ranks that saved it (an integer >= 1)"
    if "world_size" not in info:
        raise bad("'world_size'", ws_expected, missing=True)
    world = info["world_size"]
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise bad("'world_size'", ws_expected, world)
    shards_expected = (
        'an object mapping each shard file to its size and hash, {"rank0.pt": {"bytes": ..., "sha256": ...}}'
    )
    if "shards" not in info:
        raise bad("'shards'", shards_expected, missing=True)
    shards = info["shards"]
    if not isinstance(shards, dict) or not shards:
        raise bad("'shards'", shards_expected, shards)
    for name, entry in shards.items():
        where = f"'shards'[{name!r}]"
        if not _SHARD.fullmatch(name):
            raise bad(f"the key {name!r} of 'shards'", "a shard file name rank<r>.pt", name)
        if not isinstance(entry, dict):
            raise bad(where, 'an object {"bytes": ..., "sha256": ...}', entry)
        size = entry.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"{where}['bytes']", "the shard's size (an integer >= 0)", size, missing="bytes" not in entry)
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise bad(f"{where}['sha256']", "64 lowercase hex digits", digest, missing="sha256" not in entry)
    if not isinstance(info.get("meta", {}), dict):
        raise bad("'meta'", "an object (the caller's metadata)", info["meta"])


def read_meta(directory: str | Path, tag: str | None = None) -> tuple[str, dict[str, Any]]:
    """The tag (``latest`` when None) and its metadata, checked; CheckpointError naming the problem and the fix."""
    directory = Path(directory)
    _check_directory(directory)
    named_by = ""
    if tag is None:
        latest = directory / "latest"
        if not latest.is_file():
            complete, incomplete = _tags(directory)
            if not complete:
                raise CheckpointError(
                    f"no checkpoint in {str(directory)!r}: no 'latest' file and no complete tag folder (one with "
                    f"meta.json){f'; incomplete, never finished: {incomplete}' if incomplete else ''}: pass the "
                    "directory given to save_checkpoint"
                )
            raise CheckpointError(
                f"no 'latest' file in {str(directory)!r} (save_checkpoint writes it last); {_tag_hint(directory)}"
            )
        tag = latest.read_text().strip()
        if not tag:
            raise CheckpointError(f"{latest} is empty; {_tag_hint(directory)}")
        named_by = f"{latest} names {tag!r}, but "
    folder = directory / tag
    meta_path = folder / "meta.json"
    if not folder.is_dir():
        raise CheckpointError(f"{named_by}there is no checkpoint {tag!r} in {str(directory)!r}; {_tag_hint(directory)}")
    if not meta_path.is_file():
        raise CheckpointError(
            f"{named_by}checkpoint {tag!r} in {str(directory)!r} is incomplete (no meta.json): it was never "
            f"finished; load another tag: {_tag_hint(directory)}"
        )
    try:
        info = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON ({exc}). {_DAMAGED}") from exc
    _check_meta(meta_path, info)
    return tag, info


def _check_shard(shard: Any, where: str) -> None:
    """CheckpointError unless the loaded shard has the structure save_checkpoint writes."""
    keys = ("model", "optimizer", "scheduler", "extra")
    if not isinstance(shard, dict) or any(key not in shard for key in keys):
        found = sorted(shard) if isinstance(shard, dict) else type(shard).__name__
        raise CheckpointError(f"{where}: expected a dict with keys {list(keys)}, found {found}. {_DAMAGED}")
    if not isinstance(shard["model"], dict) or not all(isinstance(v, torch.Tensor) for v in shard["model"].values()):
        raise CheckpointError(f"{where}: 'model' is not a state dict of tensors. {_DAMAGED}")
    if not isinstance(shard["extra"], dict):
        raise CheckpointError(f"{where}: 'extra' is a {type(shard['extra']).__name__}, expected a dict. {_DAMAGED}")


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
    only at the next step.
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
    (TwinFlowAdam's state dict is ratio-independent).
    """
    directory = Path(directory)
    if directory.is_dir():
        _remove_stale_temporaries(directory)
    tag, info = read_meta(directory, tag)
    rank, world = rank_and_world()
    if info["world_size"] != world:
        raise CheckpointError(
            f"checkpoint {tag!r} was saved by {info['world_size']} ranks; this run has {world}: resume with "
            f"the same number of processes"
        )
    path = directory / tag / f"rank{rank}.pt"
    expected = info["shards"].get(path.name)
    if expected is None:
        raise CheckpointError(
            f"checkpoint {tag!r}: its meta.json lists no shard {path.name} (it lists {sorted(info['shards'])}). "
            f"{_DAMAGED}"
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {tag!r}: shard {path} is missing (meta.json records it): copy it back, or load another tag"
        )
    data = path.read_bytes()  # read once: hashed, then loaded from memory
    if len(data) != expected["bytes"]:
        raise CheckpointError(
            f"checkpoint {tag!r}: shard {path} is {len(data)} bytes, its meta.json records {expected['bytes']}: "
            "the shard is truncated or corrupt, or was replaced after saving; load another tag, or restore the shard"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected["sha256"]:
        raise CheckpointError(
            f"checkpoint {tag!r}: shard {path} has sha256 {digest}, its meta.json records {expected['sha256']} "
            f"(the size, {len(data)} bytes, matches): the shard is corrupt or was replaced after saving; load "
            "another tag, or restore the shard"
        )
    where = f"checkpoint {tag!r}, shard {path}"
    try:
        shard = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # its hash matched: written so, e.g. by another tool, not damaged on the way
        raise CheckpointError(
            f"{where} cannot be read with torch.load(weights_only=True) ({_weights_only_error(exc)}). {_DAMAGED}"
        ) from exc
    _check_shard(shard, where)
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
    _check_optimizer_state(optimizer, shard["optimizer"], where)
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
