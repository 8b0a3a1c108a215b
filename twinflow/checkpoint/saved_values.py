"""What a checkpoint keeps beside its tensors, checked before anything is written: the caller's ``extra`` and
``meta`` (read back with ``torch.load(weights_only=True)`` from the portable format's twinflow.pt), each refusal a
TypeError naming the entry and the fix; and the tag it is saved under (a ValueError)."""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from twinflow.checkpoint.checkpoint_files import PORTABLE_OLD, PORTABLE_SAVING, save_to_stream


def weights_only_error(exc: Exception) -> str:
    """The line of torch's (long) error that names what failed."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if "Unsupported global" in line or "WeightsUnpickler" in line]
    return f"{type(exc).__name__}: {(useful or lines or [''])[0][:300]}"


def _round_trip(value: Any) -> None:
    """Raises what torch.save, or torch.load(weights_only=True) reading it back, raises for `value`."""
    buffer = io.BytesIO()
    save_to_stream(value, buffer)
    torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)


def check_loadable(value: Any, name: str) -> None:
    """TypeError naming `name` (e.g. "meta=", "extra['rng']") unless `value` is saved and read back by
    ``torch.load(weights_only=True)``, as every checkpoint's non-tensor part is."""
    try:
        _round_trip(value)
    except (OSError, MemoryError):
        raise
    except Exception as exc:
        raise TypeError(
            f"{name} (a {type(value).__name__}) cannot be saved in a checkpoint that is read back with "
            f"torch.load(weights_only=True) ({weights_only_error(exc)}): pass tensors and plain values (numbers, "
            "strings, lists, tuples, dicts), e.g. obj.state_dict() instead of obj, or str(obj)"
        ) from exc


def check_extra(extra: Any) -> None:
    """TypeError naming the entry of `extra` that cannot be saved, or not loaded back by a load."""
    if not isinstance(extra, dict):
        raise TypeError(f"extra= is a {type(extra).__name__}; expected a dict (e.g. {{'step': 3}})")
    try:
        _round_trip(extra)  # in memory: extra holds counters and RNG states, small beside the shard
    except (OSError, MemoryError):
        raise
    except Exception as whole:
        for key, value in extra.items():
            check_loadable(value, f"extra[{key!r}]")
        raise TypeError(
            f"extra= cannot be saved ({weights_only_error(whole)}): pass tensors and plain values"
        ) from whole


def check_tag(tag: Any) -> None:
    """ValueError unless `tag` names a checkpoint's folder plainly (not ``latest``, not hidden, no path)."""
    plain = isinstance(tag, str) and tag and "/" not in tag and os.sep not in tag and not tag.startswith(".")
    if not plain or tag == "latest" or tag.endswith((PORTABLE_SAVING, PORTABLE_OLD)):
        raise ValueError(
            f"tag={tag!r}; expected a plain folder name (a non-empty string without '/', not starting with '.', "
            f"not 'latest', not ending in {PORTABLE_SAVING!r} or {PORTABLE_OLD!r}: a save's own folders), e.g. "
            "tag='step100'"
        )
