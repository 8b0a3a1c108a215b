"""A portable checkpoint's optimizer state in torch.optim's layout (OUT.pt), the whole model's, streamed.

    python -m twinflow.convert CKPT_DIR TAG OUT.pt        (TAG saved by any number of ranks)

writes what ``state_dict()`` of one process's optimizer over the whole model holds once TAG is loaded into it:
per parameter index (the saved param groups' order: a one-process optimizer's own) ``step`` (a float32 scalar
tensor), ``exp_avg`` and ``exp_avg_sq`` (float32, the parameter's shape: compact moments decoded with their
blocks' scales, the float32 a load decodes), ``master`` where the checkpoint keeps one (float32, or a 24-bit
master decoded exactly) and each tensor key of the user's own, as saved; and ``param_groups``, their params as
those indexes. A parameter without state has no entry, as in torch.optim. ``torch.optim.AdamW.load_state_dict``
takes it (and ignores ``master``).

Memory and checks as :mod:`.portable_consolidate`: every file is checked against the save's checksums before
anything is written; OUT.pt is written first without its tensors' bytes (address space only, :mod:`.skeleton_file`),
then each tensor is read as the logical tensor it was saved as, whatever the saving world's pieces, a batch of rows
of at most :data:`.portable_load.CHUNK` elements at a time, decoded and written in place. OUT.pt is written under a
temporary name beside it, flushed and renamed into place once complete.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import IO, Any

import torch

from twinflow.checkpoint.checkpoint_files import CheckpointError, rename_into_place, temp_path, write_temp
from twinflow.checkpoint.portable import INFO
from twinflow.checkpoint.portable_codes import (
    CODES,
    HI,
    LO,
    MOMENTS,
    OWNED,
    SCALES,
    decoded_run,
    key_of,
    masters24_decoded,
    moment_of,
)
from twinflow.checkpoint.portable_load import Folder, Rows, RowsPlanner, row_batches
from twinflow.checkpoint.portable_state import OPTIM
from twinflow.checkpoint.safetensors_out import pwrite_all
from twinflow.checkpoint.skeleton_file import write_skeleton
from twinflow.precision import compact


@dataclasses.dataclass
class _Out:
    """One tensor of OUT.pt: parameter `index`'s `key`, read from saved parameter `name` as `how` says ("plain": the
    saved tensor of that key; "codes": a moment's codes and scales; "m24": a 24-bit master's two parts)."""

    index: int
    name: str
    key: str
    shape: list[int]
    how: str
    dtype: torch.dtype


def _outs_of(at: Folder, index: int, name: str, keys: set[str]) -> list[_Out]:
    """Parameter `index`'s tensors in OUT.pt, in torch.optim's order, from its saved `keys`."""

    def saved(key: str) -> Any:  # the saved tensor's metadata
        found = at.metadata.state_dict_metadata.get(f"{OPTIM}.{name}.{key}")
        if found is None:
            raise CheckpointError(f"checkpoint {at.tag!r} in {at.folder}: its {INFO} lists {key!r} in the state of "
                                  f"{name}, and DCP's .metadata has no {OPTIM}.{name}.{key}: the folder is damaged "
                                  "or mixed; save it again")  # fmt: skip
        return found

    outs = []
    for moment in MOMENTS:
        if moment in keys:
            outs.append(_Out(index, name, moment, list(saved(moment).size), "plain", torch.float32))
        elif key_of(moment, CODES) in keys:
            shape = list(saved(key_of(moment, CODES)).size)
            outs.append(_Out(index, name, moment, shape, "codes", torch.float32))
    if "master" in keys:
        outs.append(_Out(index, name, "master", list(saved("master").size), "plain", torch.float32))
    elif HI in keys:
        outs.append(_Out(index, name, "master", list(saved(HI).size), "m24", torch.float32))
    for key in sorted(k for k in keys if k != "step" and moment_of(k) not in OWNED):  # the user's own
        meta = saved(key)
        outs.append(_Out(index, name, key, list(meta.size), "plain", meta.properties.dtype))
    return outs


def _plan(at: Folder) -> tuple[dict[str, Any], list[_Out]]:
    """OUT.pt's skeleton (each entry's step read; its moments, masters and user keys not yet there) and the tensors
    to write into it, in order."""
    groups, outs, state, steps, index = [], [], {}, {}, 0
    for group in at.info["param_groups"]:
        numbered = []
        for name in group["params"]:
            keys = set(at.info["state_keys"].get(name, ()))
            if keys:  # a parameter without state has no entry
                state[index] = {}
                if "step" in keys:
                    steps[f"{OPTIM}.{name}.step"] = Rows([], 0, 1, torch.float32)
                    state[index]["step"] = steps[f"{OPTIM}.{name}.step"].data  # filled by the read below
                outs += _outs_of(at, index, name, keys)
            numbered.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbered})
    if steps:
        at.read(steps, planner=RowsPlanner())
    return {"state": state, "param_groups": groups}, outs


def _targets(out: _Out, first: int, count: int) -> dict[str, Rows]:
    """What rows [first, first + count) of `out` are read from, by saved name."""
    at = f"{OPTIM}.{out.name}."
    if out.how == "plain":
        return {at + out.key: Rows(out.shape, first, count, out.dtype)}
    if out.how == "m24":
        return {at + HI: Rows(out.shape, first, count, torch.bfloat16),
                at + LO: Rows(out.shape, first, count, torch.uint8)}  # fmt: skip
    n = compact.blocks(math.prod(out.shape))
    return {at + key_of(out.key, CODES): Rows(out.shape, first, count, MOMENTS[out.key]),
            at + key_of(out.key, SCALES): Rows([n], 0, n, torch.uint8)}  # fmt: skip


def _values(out: _Out, read: dict[str, Rows], first_element: int) -> torch.Tensor:
    parts = [rows.data for rows in read.values()]
    if out.how == "plain":
        return parts[0].reshape(-1)
    if out.how == "m24":
        return masters24_decoded(*parts)
    return decoded_run(out.key, parts[0], parts[1], first_element)


def _write(f: IO[bytes], path: Path, at: Folder) -> None:
    """Writes OUT.pt to `f` (the file at `path`): the skeleton, then each tensor a batch of rows at a time."""
    skeleton, outs = _plan(at)
    placeholders = {}
    for out in outs:
        made = skeleton["state"][out.index][out.key] = torch.empty(out.shape, dtype=out.dtype)  # never touched
        placeholders[id(made)] = (out.index, out.key)
    where = write_skeleton(f, path, skeleton, placeholders)
    del skeleton
    for batch in row_batches([out for out in outs if math.prod(out.shape)]):  # one of no elements: nothing to write
        targets = [_targets(out, first, count) for out, first, count in batch]
        at.read({k: v for t in targets for k, v in t.items()}, planner=RowsPlanner())
        for (out, first, _), read in zip(batch, targets, strict=True):
            start = first * (math.prod(out.shape[1:]) if out.shape else 1)
            values = _values(out, read, start)
            pwrite_all(f.fileno(), values.contiguous().view(torch.uint8).numpy(),
                       where[(out.index, out.key)] + start * out.dtype.itemsize)  # fmt: skip


def convert_portable(directory: str | Path, tag: str | None, out: str | Path) -> Path:
    """Writes portable checkpoint `tag`'s (None or "latest": the latest) optimizer state in `directory` to `out`,
    in torch.optim's layout (module docstring); CheckpointError naming what is wrong. Returns `out`."""
    at = Folder(Path(directory), tag)
    at.check_pieces(at.metadata.storage_data.values())  # every file, before anything is written
    out = Path(out)
    tmp = temp_path(out.parent, out.name)
    write_temp(tmp, lambda f: _write(f, tmp, at))
    rename_into_place(tmp, out)
    return out
