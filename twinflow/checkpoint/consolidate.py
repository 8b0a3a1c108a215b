"""A checkpoint's model as consolidated safetensors that Hugging Face ``from_pretrained`` loads, streamed.

    python -m twinflow.convert CKPT_DIR TAG --safetensors OUT_DIR [--dtype bf16] [--max-shard-size 5GB]
        [--hf-config HF_DIR]

reads every rank's shard of checkpoint TAG (each verified as the AdamW conversion verifies rank 0's) and writes
the model's weights to OUT_DIR: ``model.safetensors``, or, past ``--max-shard-size``, ``model-00001-of-0000N
.safetensors``... with ``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {name:
file}}``), as ``save_pretrained`` writes them. Floating tensors are written as float32 (``--dtype bf16``:
bfloat16, rounded to the nearest even), others in their own dtype.

- **The weights are the optimizer's masters** where the checkpoint keeps them (the float32 master of a bfloat16 or
  float16 parameter; a compact "int8_m24" 24-bit master decoded exactly), else the model's tensors (a float32
  parameter, whose weight is its master; buffers; a parameter without state yet).
- **Names** are the model's state-dict keys as saved, less a leading ``module.`` and the wrappers' segments
  (``_fsdp_wrapped_module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``). A tied parameter (an ``lm_head``
  sharing the embeddings) is written once, under its first name, as ``save_pretrained`` drops the tied duplicate
  (``from_pretrained`` ties it again).
- **Ranks are merged**: a tensor that FSDP2 sharded on dim 0 (stages 2 and 3) is its ranks' pieces in rank order;
  under ZeRO-1 a parameter's master comes from the rank whose optimizer holds it; under DDP from rank 0. The
  shards' ``layout`` (written by :func:`twinflow.checkpoint.save_checkpoint` since it was added) names each
  optimizer parameter and the sharded tensors; a one-rank checkpoint without it pairs the optimizer's parameters
  with the model's floating tensors in order, by size, and takes a tensor left over whose bytes are a paired one's
  for its tied duplicate.
- ``--hf-config HF_DIR``: its ``config.json`` (its ``dtype`` set to the one written) and ``generation_config.json``
  are copied, so that ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` works directly.

Memory: the files' headers are written first (every shape is in the shards' heads), then each rank's shard is read
once, in order, and each piece written in place with ``os.pwrite``: a compact shard's record (one frame) decoded a
batch of 65536 elements at a time, a torch.save shard's tensors (memory-mapped) :data:`.rank_shard.BATCH` elements
at a time. No tensor is held whole, whatever the size of the model. Every file is written under a temporary name and
renamed into place once complete; the index last.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from twinflow.checkpoint.checkpoint_files import CheckpointError, read_meta
from twinflow.checkpoint.compact_checkpoint import convert_elements
from twinflow.checkpoint.rank_shard import BATCH, RankShard
from twinflow.checkpoint.safetensors_out import Out, checked_dtype, hub_names, parse_size, put_values, write_safetensors
from twinflow.precision import compact


def _plan(ranks: list[RankShard], dtype: torch.dtype, tag: str) -> list[Out]:
    """The output's tensors, in rank 0's state-dict order, and where each comes from."""
    if len(ranks) > 1 and any(rank.layout is None for rank in ranks):
        raise CheckpointError(
            f"checkpoint {tag!r} was saved by {len(ranks)} ranks before twinflow recorded the shards' layout: "
            "resume it and save it again with this version to consolidate its weights"
        )
    held: dict[str, dict[int, int]] = {}  # a parameter's first name -> {rank: its index there} where a master is
    tied: set[str] = set()
    for r, rank in enumerate(ranks):
        for i, names in enumerate(rank.names()):
            if names and i in rank.masters:
                held.setdefault(names[0], {})[r] = i
            tied.update(names[1:])
    sharded = (ranks[0].layout or {}).get("sharded", {})
    outs = []
    kinds = {key: (shape, kind) for key, shape, kind in ranks[0].model}
    for key, name in hub_names(list(kinds), tied, tag):
        shape, kind = kinds[key]
        out_dtype = dtype if kind.is_floating_point else kind
        if key in sharded:
            if sharded[key] is None:
                raise CheckpointError(f"checkpoint {tag!r}: {key!r} is a DTensor sharded other than on dim 0 by "
                                      "one mesh dimension, which this converter does not merge")  # fmt: skip
            sources, first = [], 0
            for r, rank in enumerate(ranks):
                if key not in rank.numel:
                    raise CheckpointError(f"{rank.where}: it has no {key!r}, which rank 0's shard has")
                i = held.get(key, {}).get(r)
                sources.append((r, "master", i, first) if i is not None else (r, "model", key, first))
                first += rank.numel[key]
            out = Out(name, list(sharded[key]), out_dtype, sources)
            if first != out.numel:
                raise CheckpointError(f"checkpoint {tag!r}: the ranks' pieces of {key!r} hold {first} elements, "
                                      f"its shape {out.shape} {out.numel}")  # fmt: skip
        else:
            holders = held.get(key, {})
            r = min(holders) if holders else 0
            source = (r, "master", holders[r], 0) if holders else (0, "model", key, 0)
            out = Out(name, list(shape), out_dtype, [source])
        for r, what, ref, _ in out.sources:
            n = ranks[r].masters[ref] if what == "master" else ranks[r].numel[key]
            if n != ranks[r].numel[key]:
                raise CheckpointError(f"{ranks[r].where}: the master of {key!r} has {n} elements, the tensor "
                                      f"{ranks[r].numel[key]}: its layout does not fit its model")  # fmt: skip
        outs.append(out)
    return outs


def _stream(r: int, rank: RankShard, outs: list[Out], fds: list[int], tick: Callable[[int], None]) -> None:
    """Writes every piece the output takes from rank `r`'s shard, reading it once, in order; `tick(bytes)` after
    each piece."""
    masters, models = {}, {}
    for out in outs:
        for source, what, ref, first in out.sources:
            if source == r:
                (masters if what == "master" else models)[ref] = (out, first)
    if rank.shard is None:  # torch.save's layout, memory-mapped: a batch of each tensor at a time
        state = (rank.whole.get("optimizer") or {}).get("state", {})
        tensors = [(rank.whole["model"][key], hit) for key, hit in models.items()]
        tensors += [(state[i]["master"], hit) for i, hit in masters.items()]
        for tensor, (out, first) in tensors:
            flat = tensor.reshape(-1)
            for a in range(0, flat.numel(), BATCH):
                put_values(fds, out, first + a, flat[a : a + BATCH], tick)
        return
    kinds = ("model", "state") if masters else ("model",)
    step = convert_elements(torch.device("cpu"))
    for record, payload in rank.shard.frames(kinds):
        if record[0] == "model":
            hit = models.get(rank.model[record[1]][0])
            if hit is not None:
                put_values(fds, hit[0], hit[1] + record[2], payload, tick)
            continue
        _, i, start, end, form = record
        hit = masters.get(i)
        if hit is None:
            continue
        for a in range(0, end - start, step):
            b = min(end - start, a + step)
            values = compact.decode_master(payload[4][a:b], payload[5][a:b]) if form == "m24" else payload[4][a:b]
            put_values(fds, hit[0], hit[1] + start + a, values, tick)


def consolidate(directory: str | Path, tag: str | None, out_dir: str | Path, dtype: str | torch.dtype = "fp32",
                max_shard_size: str | int = "5GB", hf_config: str | Path | None = None,
                progress: bool = False) -> list[Path]:  # fmt: skip
    """Writes checkpoint `tag`'s (None or "latest": the latest) model in `directory` to `out_dir` as safetensors
    (module docstring); CheckpointError naming what is wrong. Returns the files written. `progress`: the bytes
    written so far on stderr (a bar on a terminal, else a line every tenth)."""
    dtype = checked_dtype(dtype, hf_config)
    max_bytes = parse_size(max_shard_size)
    directory, out_dir = Path(directory), Path(out_dir)
    tag, info = read_meta(directory, None if tag == "latest" else tag)
    ranks: list[RankShard] = []
    try:
        for r in range(info["world_size"]):
            ranks.append(RankShard(directory, tag, info, r))
        outs = _plan(ranks, dtype, tag)

        def fill(fds: list[int], tick: Callable[[int], None]) -> None:
            for r, rank in enumerate(ranks):
                _stream(r, rank, outs, fds, tick)

        return write_safetensors(out_dir, outs, max_bytes, fill, tag, dtype, hf_config, progress)
    finally:
        for rank in ranks:
            rank.close()
