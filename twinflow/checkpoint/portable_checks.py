"""What a portable load (:mod:`.portable_load`) checks of what it was given before it reads a tensor: the directory
holds the tag (else: the tags it holds), its ``twinflow.pt`` has every entry the load reads, of its kind, the
optimizer's param groups hold the parameters the saved ones held, with hyper-parameters of the kinds the
optimizer's are, and each saved step is a whole number. Each refusal names the entry, what it is, what was expected
and the fix; nothing has changed when it is raised."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from twinflow.checkpoint.checkpoint_files import META, CheckpointError, is_per_rank, is_portable, rewrite_command
from twinflow.checkpoint.checkpoint_files import PORTABLE_OLD as OLD
from twinflow.checkpoint.checkpoint_files import PORTABLE_SAVING as SAVING

DAMAGED = "(the file is damaged); nothing was changed: load another tag, or save it again"


def tags_hint(directory: Path) -> str:
    """The complete portable tags `directory` holds (oldest first), and how to load one: not the folder of a save
    killed before it was put in place (``<tag>.saving``); a ``<tag>.old`` only as its tag, where the process died
    between a re-save's renames (the load reads it there). Per-rank tags there are listed apart, with the command
    that rewrites one in the portable format."""
    portable, per_rank = {}, {}  # tag: when its index was written
    try:
        entries = list(directory.iterdir())
    except OSError:
        entries = []
    for p in entries:
        tag = p.name[: -len(OLD)] if p.name.endswith(OLD) else p.name
        try:
            if not p.name.endswith(SAVING) and is_portable(p) and (tag == p.name or not (directory / tag).exists()):
                portable[tag] = (p / ".metadata").stat().st_mtime
            elif is_per_rank(p):  # the command that rewrites it is named
                per_rank[p.name] = (p / META).stat().st_mtime
        except OSError:  # unreadable, or removed meanwhile: the hint lists what can be read
            continue
    tags, older = (sorted(found, key=lambda tag: (found[tag], tag)) for found in (portable, per_rank))
    hint = (
        f"pass tag= one of those {directory} holds, oldest first: {tags} (the newest: tag={tags[-1]!r})" if tags else ""
    )
    if not older:
        return hint or f"find the directory it was saved to: {directory} holds no complete portable checkpoint"
    rewrite = (f"rewrite in the portable format one of the per-rank checkpoints {'it also' if tags else directory} "
               f"holds (which this twinflow no longer loads), oldest first: {older}, and load OUT_DIR (the newest: "
               f"`{rewrite_command(directory, older[-1])}`)")  # fmt: skip
    return f"{hint}; or {rewrite}" if tags else rewrite


def _need(where: str, entries: dict, key: Any, ok: Any, expected: str) -> None:
    """Refuses `where`[`key`] (an entry of a twinflow.pt) unless `entries` has it and ok(it)."""
    if key not in entries or not ok(entries[key]):
        found = repr(entries[key])[:80] if key in entries else "missing"
        raise CheckpointError(f"{where}[{key!r}] is {found}; expected {expected} {DAMAGED}")


def _number(v: Any) -> bool:
    return isinstance(v, int | float | torch.Tensor) and not isinstance(v, bool)


def _names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(n, str) for n in v)


ENTRIES = {  # what a load reads of twinflow.pt: (whether a value fits, what was expected)
    "world_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an int >= 1 (the ranks)"),
    "param_groups": (lambda v: isinstance(v, list) and all(isinstance(g, dict) for g in v), "a list of dicts"),
    "state_keys": (lambda v: isinstance(v, dict), "a dict: each parameter's name -> its state's keys"),
    "scheduler": (lambda v: v is None or isinstance(v, dict), "the scheduler's state_dict(), or None"),
    "meta": (lambda v: v is None or isinstance(v, dict), "a dict, or None"),
    "extra": (lambda v: True, "the caller's extra state, or None"),
}


def check_info(path: Path, info: Any) -> None:
    """Refuses the twinflow.pt at `path` (read: `info`) where an entry a load reads is missing or of another kind."""
    info = info if isinstance(info, dict) else {}
    for key, (ok, expected) in ENTRIES.items():
        _need(str(path), info, key, ok, expected)
    for i, group in enumerate(info["param_groups"]):
        _need(f"{path}['param_groups'][{i}]", group, "params", _names, "a list of parameter names")
    for name in info["state_keys"]:
        _need(f"{path}['state_keys']", info["state_keys"], name, _names, "a list of the state's keys")


def _like(now: Any, saved: Any) -> bool:
    """Whether a saved hyper-parameter is of the kind of the optimizer's own `now`: a bool, a number, numbers; None
    where `now` is None or a bool (torch's flags are Optional[bool]: foreach=None saved, foreach=True now)."""
    if now is None or (saved is None and isinstance(now, bool)):
        return True
    if isinstance(now, tuple | list) and now and all(map(_number, now)):
        return isinstance(saved, tuple | list) and len(saved) == len(now) and all(map(_like, now, saved))
    return isinstance(saved, bool) if isinstance(now, bool) else not _number(now) or _number(saved)


def check_groups(path: Path, tag: str, groups: list[dict], saved: list[dict], held: dict[str, int]) -> None:
    """Refuses, naming it, a checkpoint whose param groups (`saved`, in the twinflow.pt at `path`) are not the
    optimizer's `groups` (`held`: every rank's parameters' names -> their group there), or whose hyper-parameters
    are not of the kinds the optimizer's are."""
    saved_in = {name: i for i, g in enumerate(saved) for name in g["params"]}
    if held != saved_in or len(groups) != len(saved):
        odd = next((n for n in sorted(held.keys() | saved_in.keys()) if held.get(n) != saved_in.get(n)), None)
        count = [list(held.values()).count(i) for i in range(len(groups))]
        raise CheckpointError(f"checkpoint {tag!r} was saved with param groups of {[len(g['params']) for g in saved]}"
                              f" parameters, this optimizer's hold {count} (the first that differs: {odd!r}, in "
                              f"group {saved_in.get(odd)} saved, {held.get(odd)} here); nothing was changed: build "
                              "the optimizer's param groups as saved, or load another checkpoint")  # fmt: skip
    for i, (now, then) in enumerate(zip(groups, saved, strict=True)):
        for key in sorted((now.keys() & then.keys() | now.keys() & {"lr"}) - {"params"}):  # an lr: saved too
            _need(f"{path}['param_groups'][{i}]", then, key, lambda v, n=now[key]: _like(n, v),
                  f"one of the kind of this optimizer's {now[key]!r}")  # fmt: skip


def check_step(tag: str, name: str, step: Any) -> None:
    """Refuses a saved step (read from DCP) of parameter `name` that is not a whole number >= 0 in a tensor."""
    count = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if not (isinstance(step, torch.Tensor) and _number(count) and math.isfinite(count) and count == int(count) >= 0):
        raise CheckpointError(f"checkpoint {tag!r}: the step of {name} is {count!r}; expected a whole number >= 0 in "
                              f"a tensor {DAMAGED}")  # fmt: skip
