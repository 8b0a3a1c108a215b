"""A portable checkpoint's model as consolidated safetensors that Hugging Face ``from_pretrained`` loads, streamed.

    python -m twinflow.convert CKPT_DIR TAG --safetensors OUT_DIR [--dtype bf16] [--max-shard-size 5GB]
        [--hf-config HF_DIR]

From a checkpoint saved by any number of ranks (a per-rank one: after ``--to-portable``):

- **The weights are the optimizer's masters** where the checkpoint keeps them (``master``: float32;
  ``master.hi`` and ``master.lo``: a 24-bit master, decoded exactly), else the model's tensors.
- **DCP merges the ranks**: each tensor is read as the logical tensor it was saved as, whatever the saving world's
  pieces, a batch of rows of :data:`.portable_load.CHUNK` elements at most (several small tensors in one batch),
  and written in place.
  The host holds one batch (and its float32 conversion), whatever the size of the model. A checkpoint saved
  asynchronously before its save wrote a file a tensor (one file a rank) is read by DCP's own reader, which loads
  each saved piece it reads from whole: there the bound is the largest piece, read again for each batch of it.
- **Checked first**: every file is checked against the save's checksums (:mod:`.portable_sums`) before anything
  is written; a missing, truncated or damaged file is refused, naming it.
- **Tied parameters** (an ``lm_head`` sharing the embeddings) are written once, under their first name, where the
  checkpoint records the ties (saved since this converter existed); an older one writes both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from twinflow.checkpoint.portable_codes import HI, LO, masters24_decoded
from twinflow.checkpoint.portable_load import Folder, Rows, RowsPlanner, row_batches
from twinflow.checkpoint.portable_state import MODEL, OPTIM
from twinflow.checkpoint.safetensors_out import (
    Out,
    checked_dtype,
    hub_names,
    parse_size,
    put_values,
    write_safetensors,
)


def _plan(metadata: Any, info: dict[str, Any], dtype: torch.dtype, tag: str) -> list[Out]:
    """The output's tensors in the model's state-dict order, each with its source: (kind, key), kind "model", "master"
    (float32) or "m24" (hi and lo), key the saved name."""
    tied = info.get("tied", {})
    masters = {}
    for name, keys in info["state_keys"].items():
        kind = "m24" if HI in keys else "master" if "master" in keys else None
        if kind is not None:
            masters[tied.get(name, name)] = (kind, name)
    saved = {fqn[len(MODEL) + 1 :]: md for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith(MODEL + ".") and hasattr(md, "size")}  # fmt: skip
    order = {key: n for n, key in enumerate(info.get("model_keys", []))}  # the model's (DCP's is by rank)
    saved = dict(sorted(saved.items(), key=lambda item: order.get(item[0], len(order))))
    outs = []
    for key, name in hub_names(list(saved), tied, tag):
        md, source = saved[key], masters.get(key, ("model", key))
        kind = md.properties.dtype
        outs.append(Out(name, list(md.size), dtype if kind.is_floating_point else kind, [source]))
    return outs


def _targets(out: Out, first: int, count: int) -> dict[str, Rows]:
    kind, key = out.sources[0]
    if kind == "model":  # read straight into the output's dtype
        return {f"{MODEL}.{key}": Rows(out.shape, first, count, out.dtype)}
    if kind == "master":
        return {f"{OPTIM}.{key}.master": Rows(out.shape, first, count, torch.float32)}
    return {f"{OPTIM}.{key}.{HI}": Rows(out.shape, first, count, torch.bfloat16),
            f"{OPTIM}.{key}.{LO}": Rows(out.shape, first, count, torch.uint8)}  # fmt: skip


def _values(out: Out, read: dict[str, Rows]) -> torch.Tensor:
    parts = [rows.data for rows in read.values()]
    return parts[0] if out.sources[0][0] != "m24" else masters24_decoded(*parts)


def _stream(at: Folder, outs: list[Out], fds: list[int], tick: Callable[[int], None]) -> None:
    """Reads each batch of pieces from the checkpoint (one DCP read a batch) and writes it in place."""
    for batch in row_batches(outs):
        targets = [_targets(out, first, count) for out, first, count in batch]
        at.read({k: v for t in targets for k, v in t.items()}, planner=RowsPlanner())
        for (out, first, _), read in zip(batch, targets, strict=True):
            per_row = math.prod(out.shape[1:]) if out.shape else 1
            put_values(fds, out, first * per_row, _values(out, read), tick)


def consolidate_portable(directory: str | Path, tag: str | None, out_dir: str | Path,
                         dtype: str | torch.dtype = "fp32", max_shard_size: str | int = "5GB",
                         hf_config: str | Path | None = None, progress: bool = False) -> list[Path]:  # fmt: skip
    """Writes portable checkpoint `tag`'s (None or "latest": the latest) model in `directory` to `out_dir` as
    safetensors (module docstring); CheckpointError naming what is wrong. Returns the files written."""
    dtype = checked_dtype(dtype, hf_config)
    max_bytes = parse_size(max_shard_size)
    at = Folder(Path(directory), tag)
    at.check_pieces(at.metadata.storage_data.values())  # every file, before anything is written
    outs = _plan(at.metadata, at.info, dtype, at.tag)

    def fill(fds: list[int], tick: Callable[[int], None]) -> None:
        _stream(at, outs, fds, tick)

    return write_safetensors(Path(out_dir), outs, max_bytes, fill, at.tag, dtype, hf_config, progress)
