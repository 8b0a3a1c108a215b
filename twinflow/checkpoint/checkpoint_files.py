"""The files of a checkpoint directory: atomic writes, the temporaries interrupted writes leave behind, and the
meta.json of a per-rank checkpoint (twinflow 0.1.0's format, read by :mod:`.to_portable`).

A file is written under a temporary name ``.<target>.tmp<pid>@<host>``, flushed to disk and renamed into place;
the temporaries of writers that are gone are removed by the next save of the directory, which says so in one
notice.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shlex
import socket
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from twinflow.base.notice import notice


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit; nothing was changed."""


SHARD_NAME = re.compile(r"rank\d+\.pt")
META = "meta.json"  # a per-rank checkpoint's index, written once every shard is in place
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Our temporaries: ".<target>.tmp<pid>@<host>", <target> being "latest"; twinflow 0.1.0's per-rank saves also left
# "meta.json" and "<tag>.rank<r>.pt" (a shard staged before its tag folder existed), and earlier versions
# ".rank<r>.pt.tmp<pid>" (and the others) without "@<host>": recognised too, so their leftovers are cleaned.
_TEMP = re.compile(
    r"\.(?P<target>latest|meta\.json|(?:.+\.)?rank\d+\.pt)\.tmp(?P<pid>\d+)(?:@(?P<host>[A-Za-z0-9._-]+))?"
)
DAMAGED = (
    "The checkpoint is damaged or was not written by twinflow: convert another tag, or copy it again from where it "
    "was saved"
)
HASH_BLOCK = 1 << 20  # bytes a hash reads at once


def _host() -> str:
    """This machine's name as it appears in temporaries' names (characters safe in a file name)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def temp_path(folder: Path, target: str) -> Path:
    """The temporary under which this process writes `target` in `folder`."""
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


def _writer_gone(match: re.Match[str]) -> bool:
    """Whether the process named by a temporary's name has certainly stopped writing it.

    Only on this host (names without a host, from older versions, are taken as this host's): another host's
    pid cannot be checked from here. A dead writer's pid reused by a new process keeps the file until a later
    call; separate pid namespaces with the same host name (containers sharing a volume) defeat the check.
    """
    if (match["host"] or _host()) != _host():
        return False
    return int(match["pid"]) != os.getpid() and not _pid_alive(int(match["pid"]))


def format_bytes(n: int) -> str:
    """`n` bytes for people: ``"512 bytes"``, ``"631.2 MB"`` (powers of 1000)."""
    if n < 1000:
        return f"{n} bytes"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 999.95 or unit == "TB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _unlink(path: Path) -> bool:
    """Removes `path`; whether it was removed here (cleaning is a courtesy: a failure must not fail the caller)."""
    try:
        path.unlink()
    except OSError:  # missing: another rank removed it first; or not ours to remove
        return False
    return True


def _remove_temporaries(folder: Path, names: list[str]) -> list[str]:
    """Removes the temporaries among `names` (in `folder`) whose writers are gone; describes each removed."""
    removed = []
    for name in names:
        m = _TEMP.fullmatch(name)
        if m is not None and _writer_gone(m):
            size = _size(folder / name)
            if _unlink(folder / name):
                removed.append(f"temporary {str(folder / name)!r} ({format_bytes(size)})")
    return removed


def remove_leftovers(directory: Path) -> None:
    """Removes the temporaries that saves which did not finish left in `directory` and its tag folders.

    A file goes only when its writer is certainly gone (see the module's docstring), so a rank
    never removes what another rank or job is writing. One notice lists what was removed.
    """
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    removed = _remove_temporaries(directory, [p.name for p in entries if p.name.startswith(".")])
    folders = [p for p in entries if p.is_dir() and not p.is_symlink()]
    for folder in folders:
        try:
            names = [p.name for p in folder.iterdir()]
        except OSError:  # removed meanwhile, or unreadable: nothing of ours to clean there
            continue
        removed += _remove_temporaries(folder, [n for n in names if n.startswith(".")])
    if removed:
        notice("removed what interrupted checkpoint saves left in %s: %s", directory, "; ".join(removed))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temp(tmp: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Writes `tmp` through `write` and flushes it to disk; on any failure `tmp` is gone."""
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rename_into_place(tmp: Path, path: Path) -> None:
    """Renames the flushed `tmp` to `path` and makes the rename durable; on failure `tmp` is gone."""
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    if tmp.parent != path.parent:
        _fsync_dir(tmp.parent)


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Writes `path` through `write` under a temporary name, then renames it into place."""
    tmp = temp_path(path.parent, path.name)
    write_temp(tmp, write)
    rename_into_place(tmp, path)


def save_to_stream(obj: Any, f: IO[bytes]) -> None:
    """``torch.save(obj, f)``, raising what the stream raised instead of torch's error about it.

    torch's writer turns an exception raised by ``f.write`` (a KeyboardInterrupt from Ctrl-C, an OSError such
    as a full disk) into ``RuntimeError: [enforce fail at inline_container.cc]``, which ``except
    KeyboardInterrupt`` does not catch; the original is found in that error's context and raised again.
    """
    try:
        torch.save(obj, f)
        return
    except Exception as exc:
        origin = exc.__cause__ or exc.__context__
        while origin is not None and not isinstance(origin, (OSError, KeyboardInterrupt)):
            origin = origin.__cause__ or origin.__context__
        if origin is None or isinstance(exc, OSError):
            raise
    raise origin  # outside the except block: not chained to torch's error


def make_dirs(path: Path) -> list[Path]:
    """Creates `path` and its missing parents; returns the folders this call created, outermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    created: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:  # another rank made it: not ours to remove
                continue
            created.append(folder)
    except BaseException:  # a full disk, a Ctrl-C part way: the folders made so far go again
        remove_created(created)
        raise
    return created


def remove_created(paths: list[Path]) -> None:
    """Undoes a failed save: removes its new files, then its new folders if they are empty."""
    for p in reversed(paths):
        try:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()  # fails when not empty: another rank's shard keeps the folder
            else:
                p.unlink(missing_ok=True)
        except OSError:
            pass


_NOT_WRITABLE = {errno.EACCES: "is not writable", errno.EPERM: "is not writable", errno.EROFS: "is read-only"}


def unwritable_error(exc: OSError, directory: Path) -> OSError | None:
    """For an OSError saying a folder may not be written (EACCES, EPERM, EROFS), one that names the checkpoint
    directory the caller gave, the folder that refused and the fix, rather than a temporary's name; else None."""
    if exc.errno not in _NOT_WRITABLE:
        return None
    given = Path(os.path.abspath(directory))
    named = isinstance(exc.filename, (str, bytes, os.PathLike))
    refused = Path(os.path.abspath(os.fsdecode(exc.filename))).parent if named else given
    what = f"{_NOT_WRITABLE[exc.errno]} ({exc.strerror or os.strerror(exc.errno)})"
    if exc.errno == errno.EROFS:
        fix = "pass a directory on a writable file system"
    else:
        fix = f"make it writable for this user (e.g. chmod u+rwx {str(refused)!r}) or pass a directory you can write to"
    if refused == given:
        message = f"the checkpoint directory {str(directory)!r} {what}: {fix}"
    elif given.is_relative_to(refused):
        message = f"cannot create the checkpoint directory {str(directory)!r}: {str(refused)!r} {what}: {fix}"
    else:
        message = f"{str(refused)!r} in the checkpoint directory {str(directory)!r} {what}: {fix}"
    return OSError(exc.errno, message)  # PermissionError for EACCES and EPERM


def size_error(tag: str, path: Path, found: int, recorded: int) -> CheckpointError:
    """The refusal of shard `path` of checkpoint `tag` whose size is not the one its meta.json records."""
    return CheckpointError(
        f"checkpoint {tag!r}: shard {path} is {found} bytes, its meta.json records {recorded}: the shard is "
        "truncated or corrupt, or was replaced after saving; convert another tag, or restore the shard"
    )


def hash_error(tag: str, path: Path, found: str, recorded: str, size: int) -> CheckpointError:
    """The refusal of shard `path` of checkpoint `tag` (of the recorded `size`) whose sha256 is not the recorded."""
    return CheckpointError(
        f"checkpoint {tag!r}: shard {path} has sha256 {found}, its meta.json records {recorded} (the size, {size} "
        "bytes, matches): the shard is corrupt or was replaced after saving; convert another tag, or restore the shard"
    )


def sha256_of(path: Path) -> str:
    """The hex sha256 of the file at `path`, read in blocks (of HASH_BLOCK bytes: little memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


PORTABLE_INFO = "twinflow.pt"  # a portable checkpoint's non-tensor part, beside DCP's .metadata (:mod:`.portable`)
# The folder a portable save writes a tag into, and the one its tag's previous folder waits in while it is renamed
PORTABLE_SAVING, PORTABLE_OLD = ".saving", ".old"


def rewrite_command(directory: str | Path, tag: str) -> str:
    """The command that rewrites per-rank checkpoint `tag` of `directory` in the portable format; a tag named as a
    portable save's own folders are (``x.old``: a per-rank ``x`` that a portable save of ``x`` replaced, killed
    between its renames) is written as ``x``."""
    command = f"python -m twinflow.convert {shlex.quote(str(directory))} {shlex.quote(tag)} --to-portable OUT_DIR"
    for suffix in (PORTABLE_SAVING, PORTABLE_OLD):
        if tag.endswith(suffix) and len(tag) > len(suffix):
            return f"{command} --out-tag {shlex.quote(tag[: -len(suffix)])}"
    return command


def is_per_rank(folder: Path) -> bool:
    """Whether a tag folder holds a complete per-rank checkpoint (its meta.json, written last)."""
    return (folder / META).is_file()


def is_portable(folder: Path) -> bool:
    """Whether a tag folder holds a complete checkpoint of the portable format (:mod:`.portable`)."""
    return (folder / PORTABLE_INFO).is_file() and (folder / ".metadata").is_file()


def _tags(directory: Path) -> tuple[list[str], list[str]]:
    """The complete tags in `directory` (with meta.json, or portable; oldest first) and the incomplete ones (shards
    only)."""
    complete: list[tuple[float, str]] = []
    incomplete: list[str] = []
    try:
        folders = sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError:
        return [], []
    for p in folders:
        meta_path = p / META
        try:
            index = meta_path if meta_path.is_file() else p / ".metadata"  # per-rank, else portable (DCP's)
            if index is meta_path or is_portable(p):
                complete.append((index.stat().st_mtime, p.name))
            elif any(SHARD_NAME.fullmatch(q.name) for q in p.iterdir()):
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
        hint = f"there is no complete checkpoint (a tag folder with meta.json, or a portable one) in {str(directory)!r}"
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
        if SHARD_NAME.fullmatch(directory.name) or directory.name == META:
            kind = "shard" if directory.name != META else "metadata"
            raise CheckpointError(
                f"{str(directory)!r} is a {kind} file of checkpoint {directory.parent.name!r}; pass the checkpoint "
                f"directory {str(directory.parent.parent)!r} and tag={directory.parent.name!r}"
            )
        if directory.name == "latest":
            raise CheckpointError(f"{str(directory)!r} is the 'latest' file; pass its folder {str(directory.parent)!r}")
        raise CheckpointError(
            f"{str(directory)!r} is a file, not a checkpoint directory: pass the directory given to save_checkpoint"
        )
    looks_like_tag = is_per_rank(directory) or any(SHARD_NAME.fullmatch(p.name) for p in directory.iterdir())
    if looks_like_tag and not (directory / "latest").exists():
        raise CheckpointError(
            f"{str(directory)!r} is a checkpoint tag folder; pass its parent {str(directory.parent)!r} as the "
            f"directory and tag={directory.name!r}"
        )


def _check_meta(meta_path: Path, info: Any) -> None:
    """CheckpointError naming the key of meta.json that is missing or bad, and what was expected."""

    def bad(key: str, expected: str, value: Any = None, missing: bool = False) -> CheckpointError:
        found = "missing" if missing else f"{value!r}"[:80]
        return CheckpointError(f"{meta_path}: {key} is {found}; expected {expected}. {DAMAGED}")

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
        if not SHARD_NAME.fullmatch(name):
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
    """The tag (``latest``'s when None or "latest") and its metadata, checked; CheckpointError naming the problem and
    the fix."""
    directory = Path(directory)
    _check_directory(directory)
    named_by = ""
    if tag in (None, "latest"):
        latest = directory / "latest"
        if not latest.is_file():
            complete, incomplete = _tags(directory)
            if not complete:
                raise CheckpointError(
                    f"no checkpoint in {str(directory)!r}: no 'latest' file and no complete tag folder (one with "
                    f"meta.json){f'; incomplete, never finished: {incomplete}' if incomplete else ''}: pass the "
                    "directory the per-rank checkpoint was saved to"
                )
            raise CheckpointError(
                f"no 'latest' file in {str(directory)!r} (a save writes it last); {_tag_hint(directory)}"
            )
        tag = latest.read_text().strip()
        if not tag:
            raise CheckpointError(f"{latest} is empty; {_tag_hint(directory)}")
        named_by = f"{latest} names {tag!r}, but "
    folder = directory / tag
    meta_path = folder / META
    if not folder.is_dir():
        raise CheckpointError(f"{named_by}there is no checkpoint {tag!r} in {str(directory)!r}; {_tag_hint(directory)}")
    if not meta_path.is_file() and is_portable(folder):
        raise CheckpointError(
            f"checkpoint {tag!r} in {str(directory)!r} is a portable one (the format twinflow saves, on PyTorch's "
            "distributed checkpoint); this reads the per-rank format only. Load it with "
            "engine.load_checkpoint, on any number of processes, or twinflow.checkpoint.load_portable; for the hub, "
            "python -m twinflow.convert DIR TAG --safetensors OUT"
        )
    if not meta_path.is_file():
        raise CheckpointError(
            f"{named_by}checkpoint {tag!r} in {str(directory)!r} is incomplete (no meta.json): it was never "
            f"finished; convert another tag: {_tag_hint(directory)}"
        )
    try:
        info = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON ({exc}). {DAMAGED}") from exc
    _check_meta(meta_path, info)
    return tag, info
