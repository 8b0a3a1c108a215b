"""Safetensors files that Hugging Face ``from_pretrained`` loads, written a piece at a time: the output's tensors
(:class:`Out`), split into files of at most ``--max-shard-size`` with ``model.safetensors.index.json`` as
``save_pretrained`` writes them, each file's header first, then every element written in place with ``os.pwrite``
by the reader of a checkpoint (:mod:`.portable_consolidate`), each file renamed into place once complete, the
index last; and the names, dtypes and sizes they take."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from twinflow.base.progress import ByteProgress
from twinflow.checkpoint.checkpoint_files import CheckpointError, rename_into_place, temp_path, write_atomic

INDEX = "model.safetensors.index.json"
WRAPPERS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
SAFE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL"}  # fmt: skip
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20,
         "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Bytes from ``5GB`` (10**9), ``500MiB`` (2**20), or a plain number; ValueError otherwise."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in UNITS or float(match.group(1)) * UNITS[unit] < 1:
        raise ValueError(f"{text!r} is not a size; expected e.g. 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * UNITS[unit])


def hub_name(key: str) -> str:
    """`key` less a leading ``module.`` (DDP, DataParallel) and the wrappers' segments (FSDP, torch.compile,
    activation checkpointing)."""
    while key.startswith("module."):
        key = key[len("module.") :]
    return ".".join(part for part in key.split(".") if part not in WRAPPERS)


def hub_names(keys: list[str], tied: Any, tag: str) -> list[tuple[str, str]]:
    """(key, :func:`hub_name`) of each of `keys` but the `tied` duplicates (written once, under their first name:
    save_pretrained drops them); CheckpointError where two keys give one name."""
    out, seen = [], {}
    for key in keys:
        if key in tied:
            continue
        name = hub_name(key)
        if name in seen:
            raise CheckpointError(f"checkpoint {tag!r}: {seen[name]!r} and {key!r} are both {name!r} once the "
                                  "wrappers' prefixes are stripped")  # fmt: skip
        seen[name] = key
        out.append((key, name))
    return out


def pwrite_all(fd: int, array: Any, offset: int) -> None:
    """Writes all of `array`'s bytes at `offset` of the open file `fd`."""
    view = memoryview(array).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@dataclass
class Out:
    """One tensor of the output: its name, shape and dtype, and where its elements come from (the reader's own
    description)."""

    name: str
    shape: list[int]
    dtype: torch.dtype
    sources: list[Any]
    file: int = 0
    offset: int = 0  # of its bytes in its file
    written: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _files(outs: list[Out], max_bytes: int) -> list[list[Out]]:
    """The tensors in files of at most `max_bytes` each (a larger tensor alone in its own), in order, as
    save_pretrained splits them."""
    files: list[list[Out]] = [[]]
    size = 0
    for out in outs:
        if files[-1] and size + out.nbytes > max_bytes:
            files.append([])
            size = 0
        out.file = len(files) - 1
        files[-1].append(out)
        size += out.nbytes
    return files


def _header(outs: list[Out]) -> bytes:
    """The safetensors header (its length, then JSON padded to 8 bytes); sets each tensor's offset."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for out in outs:
        entries[out.name] = {"dtype": SAFE[out.dtype], "shape": out.shape, "data_offsets": [at, at + out.nbytes]}
        out.offset = at
        at += out.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    for out in outs:
        out.offset += 8 + len(text)
    return len(text).to_bytes(8, "little") + text


def write_piece(fd: int, offset: int, values: torch.Tensor) -> None:
    """Writes `values` (a flat batch, already in the output's dtype) at `offset`: the one place bytes go out."""
    pwrite_all(fd, values.contiguous().view(torch.uint8).numpy(), offset)


def put_values(fds: list[int], out: Out, at: int, values: torch.Tensor, tick: Callable[[int], None]) -> None:
    """Writes `values` (flat, any dtype: converted to the output's) as `out`'s elements from `at` on."""
    values = values.reshape(-1).to(out.dtype)
    write_piece(fds[out.file], out.offset + at * out.dtype.itemsize, values)
    out.written += values.numel()
    tick(values.numel() * out.dtype.itemsize)


def _no_tick(_: int) -> None:
    pass


def _copy_config(source: Path, out_dir: Path, dtype: torch.dtype) -> list[Path]:
    """config.json from `source` (its dtype set to the one written) and generation_config.json if there."""
    config = json.loads((source / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    written = [out_dir / "config.json"]
    write_atomic(written[0], lambda f: f.write((json.dumps(config, indent=2, sort_keys=True) + "\n").encode()))
    generation = source / "generation_config.json"
    if generation.is_file():
        data = generation.read_bytes()
        written.append(out_dir / generation.name)
        write_atomic(written[-1], lambda f: f.write(data))
    return written


def checked_dtype(dtype: str | torch.dtype, hf_config: str | Path | None) -> torch.dtype:
    """The output's floating dtype from its name; ValueError or CheckpointError (no config.json) naming the fix."""
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype!r}; expected one of {sorted(DTYPES)}")
    if hf_config is not None and not (Path(hf_config) / "config.json").is_file():
        raise CheckpointError(f"--hf-config {hf_config}: no config.json there; pass the folder that "
                              "model.config.save_pretrained(folder) wrote")  # fmt: skip
    return dtype


def write_safetensors(out_dir: Path, outs: list[Out], max_bytes: int, fill: Callable[..., None], tag: str,
                      dtype: torch.dtype, hf_config: str | Path | None, progress: bool) -> list[Path]:  # fmt: skip
    """Writes `outs` to `out_dir` as safetensors files of at most `max_bytes` (an index where there are several):
    the headers first, then ``fill(fds, tick)`` writes every element (:func:`put_values`), then each file is
    renamed into place, the index last; `hf_config`'s config is copied. Returns the files written."""
    temps: list[Path] = []
    fds: list[int] = []
    try:
        files = _files(outs, max_bytes)
        names = (["model.safetensors"] if len(files) == 1
                 else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))])  # fmt: skip
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, group in zip(names, files):
            temps.append(temp_path(out_dir, name))
            fds.append(os.open(temps[-1], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644))
            head = _header(group)
            os.pwrite(fds[-1], head, 0)
            os.ftruncate(fds[-1], len(head) + sum(out.nbytes for out in group))
        meter = ByteProgress(sum(out.nbytes for out in outs), f"writing {out_dir}") if progress else None
        fill(fds, meter.update if meter is not None else _no_tick)
        if meter is not None:
            meter.close()
        for out in outs:
            if out.written != out.numel:
                raise CheckpointError(f"checkpoint {tag!r}: the shards gave {out.written} of {out.name!r}'s "
                                      f"{out.numel} elements; their records do not cover it")  # fmt: skip
        for fd in fds:
            os.fsync(fd)
            os.close(fd)
        fds.clear()
        written = []
        for tmp, name in zip(temps, names):
            rename_into_place(tmp, out_dir / name)
            written.append(out_dir / name)
        temps.clear()
        stale = [p for p in out_dir.glob("model*.safetensors") if p.name not in names]
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(out.nbytes for out in outs)},
                     "weight_map": {out.name: names[out.file] for out in outs}}  # fmt: skip
            write_atomic(out_dir / INDEX, lambda f: f.write((json.dumps(index, indent=2) + "\n").encode()))
            written.append(out_dir / INDEX)
        else:
            stale.append(out_dir / INDEX)
        for path in stale:  # a conversion before into another number of files: from_pretrained would mix them
            path.unlink(missing_ok=True)
        if hf_config is not None:
            written += _copy_config(Path(hf_config), out_dir, dtype)
        return written
    finally:
        for fd in fds:
            os.close(fd)
        for tmp in temps:
            tmp.unlink(missing_ok=True)
