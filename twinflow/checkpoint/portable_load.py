"""The load of a portable checkpoint (:mod:`twinflow.checkpoint.portable`), saved by any number of ranks.

In two phases, so that a refused load changes nothing and host memory stays bounded:

1. **Check** (every rank; if any refuses, every rank raises). The tag, ``twinflow.pt``'s entries and the param
   groups against the optimizer's (:mod:`.portable_checks`). DCP's planner plans this rank's reads over tensors
   of no memory: a key the model or the optimizer needs and the checkpoint lacks, or of another shape, is refused
   naming it. Every file those reads touch is checked against the checksums the save wrote
   (:mod:`.portable_sums`): a missing, truncated or damaged file is refused naming the file. For a TwinFlowAdam a
   parameter's saved state must be Adam's (``step``, ``exp_avg``, ``exp_avg_sq``) or have none of its keys
   (fresh); the steps and the user's own keys are read and checked. Nothing has changed yet.
2. **Read.** For a TwinFlowAdam: the optimizer takes the param groups (its own checks; it refuses before it
   changes anything), the weights are read in place, and the state is read ``CHUNK`` elements of parameters at a
   time (a parameter larger than that: alone), each batch handed to the optimizer's state owner and let go
   (:class:`StateReader`; under ``ratio="auto"`` before the first step, when that step builds the state). The
   host memory beyond the state itself is one such batch in float32: the larger of ``CHUNK`` and one parameter's
   state. Any other optimizer has its state read whole in float32 in the first phase and loaded by its own
   ``load_state_dict``, the weights put back if it refuses.

What the first phase cannot foresee is the storage failing under the second one's reads (the files were whole a
moment before): that error says the run is now partly loaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from twinflow.base.distributed import local, rank_and_world
from twinflow.base.notice import notice
from twinflow.checkpoint import portable_codes
from twinflow.checkpoint.checkpoint_files import CheckpointError
from twinflow.checkpoint.portable import INFO, OLD, dcp, is_portable, tag_of
from twinflow.checkpoint.portable_checks import check_groups, check_info, check_step, tags_hint
from twinflow.checkpoint.portable_codes import OWNED, moment_of
from twinflow.checkpoint.portable_state import MODEL, OPTIM, gathered, host_tensor, names_of, planned_tensor
from twinflow.checkpoint.portable_sums import THREADS, check_files, read_sums

try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType

    FileSystemReader = dcp.FileSystemReader
except (ImportError, AttributeError):  # pragma: no cover (torch >= 2.4 has them)
    LoadItemType, DefaultLoadPlanner, dcp = None, object, None
    FileSystemReader = object

CHUNK = 1 << 26  # float32 elements of state read at a time (256 MiB); a saved tensor's rows read at a time
READ_THREADS = THREADS  # threads a load copies mapped files on: as many as sum the files
ADAM = ("step", "exp_avg", "exp_avg_sq")  # what a parameter's state needs, where it has any of OWNED


class MappedReader(FileSystemReader):
    """DCP's file reader, except that a piece alone in its file (the save's layout: a file a piece) is mapped
    (``torch.load(mmap=True)``) and copied from the page cache or the disk into its target once, on `threads`
    threads (default ``READ_THREADS``). DCP's own reader reads one file after another, each piece into a new
    tensor first, then copies it (1.7x the time of this at one thread, 268M parameters). Any other piece (a file
    of many: an asynchronous save's before it wrote a file a tensor; a file of another size than DCP's index says:
    damaged) and a file that cannot be mapped go to DCP's reader, which reads or refuses them as before.
    `metadata`: DCP's index of the folder as read before (a load reads a batch at a time: unpickling it again for
    each took 5 s of a 40 s load of OPT-2.7B)."""

    def __init__(self, path: Path, metadata: Any = None, threads: int | None = None) -> None:
        super().__init__(path)
        self.metadata = metadata
        self.threads = max(1, threads or READ_THREADS)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.metadata if self.metadata is not None else super().read_metadata(*args, **kwargs)

    def read_data(self, plan: Any, planner: Any) -> Any:
        rest, copies = [], []
        with ThreadPoolExecutor(self.threads) as pool:  # the copies overlap with the mapping of the next files
            for item in plan.items:
                pair = self._mapped(item, planner)
                if pair is None:
                    rest.append(item)
                else:
                    target, source = pair
                    stream = torch.cuda.current_stream(target.device) if target.is_cuda else None
                    copies.append((item, target, pool.submit(_copy, target, source, stream)))
            for item, target, copy in copies:  # in the plan's order, each once its copy is done
                copy.result()  # a copy that failed raises here (targets may be partly written: the caller says so)
                planner.commit_tensor(item, target)  # (the planners here resolve to the state's own tensors)
        return super().read_data(dataclasses.replace(plan, items=rest), planner)

    def _mapped(self, item: Any, planner: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's target of `item` and the mapped piece of the file it copies, or None: DCP's reader's."""
        info = self.storage_data[item.storage_index]
        path = os.path.join(self.path, info.relative_path)
        if item.type != LoadItemType.TENSOR or info.offset != 0 or getattr(info, "transform_descriptors", None):
            return None
        try:
            if os.path.getsize(path) != info.length:
                return None
            tensor = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 (DCP's reader reads it, or names what is wrong)
            return None
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)  # the piece this rank's target takes, as DCP narrows it
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            return None
        return target, tensor


def _copy(target: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
    """`target.copy_(source)` on a reader's thread, on the caller's `stream` where the target is a GPU's (a thread's
    current stream is its own: the copy is then ordered before the caller's next work, as it was on its thread;
    None: no stream)."""
    with torch.cuda.stream(stream):
        target.copy_(source)


class Folder:
    """The tag folder a load reads, its ``twinflow.pt``, and DCP's reads from it."""

    def __init__(self, directory: Path, tag: str | None) -> None:
        if not directory.is_dir():
            raise CheckpointError(f"{directory} does not exist or is no folder: pass the one it was saved to")
        try:
            self.tag = tag_of(directory, tag)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; {tags_hint(directory)}") from exc
        folder = directory / self.tag
        if not folder.exists() and is_portable(directory / (self.tag + OLD)):  # died between a re-save's renames
            folder = directory / (self.tag + OLD)
        if not is_portable(folder):
            raise CheckpointError(f"{folder} holds no complete portable checkpoint ({INFO} and DCP's .metadata): "
                                  f"save it again, or {tags_hint(directory)}")  # fmt: skip
        self.folder = folder
        try:  # its twinflow.pt, and DCP's index, read once for every read
            self.info = torch.load(folder / INFO, weights_only=True)
            self.metadata = FileSystemReader(folder).read_metadata()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(f"{folder}: its {INFO} or DCP's .metadata cannot be read ({why}); nothing was "
                                  "changed: load another tag, or save it again") from exc  # fmt: skip
        check_info(folder / INFO, self.info)

    def refused(self, exc: BaseException, changed: bool = False) -> CheckpointError:
        """The error of a read that failed (the last line of DCP's message kept)."""
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = lines[-1][:300] if lines else type(exc).__name__
        outcome = ("the model and the optimizer are now partly loaded: load a checkpoint again before training"
                   if changed else "nothing was changed: load another tag, or save it again")  # fmt: skip
        return CheckpointError(f"checkpoint {self.tag!r} in {self.folder} cannot be read ({reason}); {outcome}")

    def check(self, planned: dict[str, Any]) -> None:
        """Phase 1: plans this rank's reads of `planned` (tensors of no memory), and checks every file they touch."""
        metadata = self.metadata
        planner = DefaultLoadPlanner()
        planner.set_up_planner(planned, metadata, is_coordinator=True)
        try:
            plan = planner.create_local_plan()
        except (RuntimeError, ValueError, KeyError) as exc:  # a key missing, or of another shape: DCP names it
            raise CheckpointError(f"checkpoint {self.tag!r} does not fit this run ({exc}); nothing was changed: "
                                  "build the model as it was saved, or load another checkpoint") from exc  # fmt: skip
        self.check_pieces(metadata.storage_data[item.storage_index] for item in plan.items)

    def check_pieces(self, pieces: Any) -> None:
        """Refuses, naming the file, unless every file the saved `pieces` (DCP's storage entries) lie in is there,
        long enough, and (where the save wrote them) of the sizes and CRC-32s it wrote."""
        needed: dict[str, int] = {}
        for info in pieces:
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        sums = read_sums(self.folder, self.info["world_size"]) if self.info.get("sums") else None
        check_files(self.folder, needed, sums)

    def read(self, target: dict[str, Any], changed: bool = False, planner: Any = None) -> None:
        """Reads this rank's pieces of `target` (each rank on its own: the plan needs no other rank), planned by
        `planner` (None: DCP's default; :class:`RowsPlanner` for :class:`Rows` targets)."""
        try:
            dcp.load(target, checkpoint_id=self.folder, storage_reader=MappedReader(self.folder, self.metadata),
                     planner=planner, no_dist=True)  # fmt: skip
        except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 (DCP's: a BaseException)
            raise self.refused(exc, changed) from exc


def _owned_entry(p: torch.Tensor, entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A read entry in the layout the optimizer takes: each tensor this process's elements, shaped as it holds `p`
    (a step stays a number)."""
    return {k: v if v.dim() == 0 and p.dim() != 0 else local(v).reshape(local(p).shape) for k, v in entry.items()}


def _batches(elements: list[int]) -> list[list[int]]:
    """The parameters' indices in runs of about ``CHUNK`` elements of state (a larger parameter alone)."""
    out: list[list[int]] = [[]]
    size = 0
    for index, count in enumerate(elements):
        if out[-1] and size + count > CHUNK:
            out.append([])
            size = 0
        out[-1].append(index)
        size += count
    return [batch for batch in out if batch]


def _target(params: list[torch.Tensor], keys: list[list[str]], names: dict[int, str], which: list[int],
            wanted: Any = lambda key: True, planned: bool = False) -> dict[str, Any]:  # fmt: skip
    """New host tensors (`planned`: of no memory) for the `wanted` saved state keys of the parameters `which`
    indexes (float32, codes in theirs: :func:`.portable_codes.target`; a step a number)."""
    make = planned_tensor if planned else host_tensor
    return {OPTIM: {names[id(params[i])]: {k: torch.zeros(()) if k == "step" else
                                           portable_codes.target(params[i], k, make, planned)
                                           for k in keys[i] if wanted(k)} for i in which}}  # fmt: skip


@dataclasses.dataclass
class _Checked:
    """What the first phase found, on this rank: the folder, the model's tensors, the optimizer's parameters (their
    names and saved keys, the param groups to load) and what it read: the user's keys and the steps (a TwinFlowAdam),
    or everything (any other optimizer)."""

    at: Folder
    model_now: dict[str, torch.Tensor]
    params: list[torch.Tensor]
    names: dict[int, str]
    keys: list[list[str]]
    groups: list[dict]
    read: dict[str, Any]


def _agreed(what: Any, outcome: str) -> Any:
    """what() on every rank (every rank calls the load); if it raised on any rank (a refusal, or another error: a
    file that rank may not read), every rank raises: that rank its error, the others a CheckpointError naming the
    first rank that failed and saying `outcome` (none is left waiting for the failed one at the gathering)."""
    result, failed = None, None
    try:
        result = what()
    except Exception as exc:  # noqa: BLE001 (raised below, once every rank knows)
        failed = exc
    told = None if failed is None else str(failed) if isinstance(failed, CheckpointError) else (
        f"{type(failed).__name__}: {failed}")  # fmt: skip
    refusals = {r: why for r, why in gathered({rank_and_world()[0]: told}).items() if why is not None}
    if failed is not None:
        raise failed
    if refusals:
        rank, why = min(refusals.items())
        raise CheckpointError(f"rank {rank} refused the load ({why[:400]}); {outcome}")
    return result


def _checked(directory: Path, tag: str | None, model: torch.nn.Module, optimizer: Any, streamed: bool) -> _Checked:
    """Phase 1 (changes nothing): the tag, every parameter's state, DCP's plan and the files it reads; then the
    small part read (a TwinFlowAdam: the user's keys and the steps, checked), or everything (another optimizer)."""
    names = names_of(model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # every rank's parameters' names -> their group (ZeRO-1: each rank's share); before anything that may raise
    held = gathered({names[id(p)]: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]})
    at = Folder(directory, tag)
    info = at.info
    saved_groups = info["param_groups"]
    saved_names = {name for g in saved_groups for name in g["params"]}
    missing = sorted({names[id(p)] for p in params} - (saved_names & set(info["state_keys"])))
    if missing:
        raise CheckpointError(f"checkpoint {at.tag!r} has no optimizer state for {missing[:3]} (of {len(missing)}): "
                              "the model differs from the saved one")  # fmt: skip
    check_groups(at.folder / INFO, at.tag, optimizer.param_groups, saved_groups, held)
    keys = [info["state_keys"][names[id(p)]] for p in params]
    for p, saved in zip(params, keys, strict=True):
        saved = {moment_of(k) for k in saved}  # noqa: PLW2901 (compact moments saved as codes and scales)
        lacking = [k for k in ADAM if k not in saved]
        if streamed and any(k in OWNED for k in saved) and lacking:
            raise CheckpointError(f"checkpoint {at.tag!r}: the state of {names[id(p)]} has {sorted(saved)}, no "
                                  f"{lacking[0]!r}; an Adam state needs {list(ADAM)} (was it saved by another "
                                  "optimizer?); nothing was changed")  # fmt: skip
    model_now = {k: v.detach() for k, v in model.state_dict().items()}
    everything = list(range(len(params)))
    at.check({MODEL: model_now, **_target(params, keys, names, everything, planned=True)})
    if streamed:
        read = _target(params, keys, names, everything, lambda k: k == "step" or moment_of(k) not in OWNED)
    else:
        read = {
            MODEL: {k: host_tensor(v) for k, v in model_now.items()},
            **_target(params, keys, names, everything),
        }
    if any(read[OPTIM].values()) or MODEL in read:
        at.read(read)
    for name, entry in read[OPTIM].items():
        if "step" in entry:
            check_step(at.tag, name, entry["step"])
    index_of = {id(p): i for i, p in enumerate(params)}
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": [index_of[id(p)] for p in g["params"]]}
              for g, saved in zip(optimizer.param_groups, saved_groups, strict=True)]  # fmt: skip
    return _Checked(at, model_now, params, names, keys, groups, read)


def load_portable(directory: str | Path, tag: str | None = None, *, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, scheduler: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """Loads a portable checkpoint saved by any number of ranks into this run (every rank calls it); returns the
    saved (extra, meta with the tag). Everything is checked, on every rank, before anything changes (see the
    module); a refusal on any rank raises on every rank."""
    start = time.perf_counter()
    streamed = hasattr(optimizer, "pending_state") and hasattr(optimizer, "state_owner")  # a TwinFlowAdam
    found = _agreed(lambda: _checked(Path(directory), tag, model, optimizer, streamed),
                    "nothing was changed on any rank")  # fmt: skip
    checked = time.perf_counter() - start
    weights = 0.0
    if streamed:
        weights = _streamed(found, optimizer)
    else:
        _whole(found, optimizer)
    info = found.at.info
    if scheduler is not None and info["scheduler"] is not None:
        scheduler.load_state_dict(info["scheduler"])
    moved = f" (saved by {info['world_size']} ranks)" if info["world_size"] != rank_and_world()[1] else ""
    notice("loaded portable checkpoint %s%s in %.1f s (its checks %.1f s, the weights %.1f s)", found.at.folder,
           moved, time.perf_counter() - start, checked, weights)  # fmt: skip
    return info["extra"], {**(info["meta"] or {}), "tag": found.at.tag}


class StateReader:
    """Parameter index -> its state entry from the checkpoint (None: it was saved with none: fresh), read a batch
    of ``CHUNK`` elements at a time as the indices are asked for in order (the batch before is let go first): what
    the optimizer's load takes, one parameter after another. The steps were read and checked before."""

    def __init__(self, found: _Checked) -> None:
        self.found = found
        self.moments = [[k for k in keys if moment_of(k) in OWNED and k != "step"] for keys in found.keys]
        self.batches = _batches([local(p).numel() * len({moment_of(k) for k in m})  # in float32, once decoded
                                 for p, m in zip(found.params, self.moments, strict=True)])  # fmt: skip
        self.batch_of = {i: b for b, batch in enumerate(self.batches) for i in batch}
        self.current: tuple[int, dict[int, dict[str, torch.Tensor]]] = (-1, {})

    def get(self, i: int, default: Any = None) -> dict[str, torch.Tensor] | None:
        """Parameter i's state in the optimizer's layout (compact moments decoded: :func:`.portable_codes.decoded`)."""
        if i not in self.batch_of:
            return default
        entry = self.saved(i)
        p = self.found.params[i]
        return None if entry is None else _owned_entry(p, portable_codes.decoded(p, entry))

    def saved(self, i: int) -> dict[str, torch.Tensor] | None:
        """Parameter i's state as saved (its step, and its moments and master as read: codes as codes)."""
        b = self.batch_of[i]
        if not self.moments[i]:
            return None
        if self.current[0] != b:
            self.current = (-1, {})  # the batch before goes first
            self.current = (b, self._read(self.batches[b]))
        entry = self.current[1][i]
        if i == self.batches[b][-1]:
            self.current = (-1, {})  # the batch's last parameter: nothing of it is asked for again
        return entry

    def copied(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's state, read and decoded (what a copy of the optimizer still waiting for it holds; a
        load copies each tensor into its own buffers)."""
        entries = ((i, self.get(i)) for i in range(len(self.found.params)))
        return {i: {k: v for k, v in e.items() if k in OWNED} for i, e in entries if e is not None}

    def put_into(self, owner: Any) -> None:
        """Writes the saved state into the built state owner `owner` (a load's, or the build's of a pending load
        under ratio="auto"): each parameter's codes, scales and 24-bit masters as they were saved where they fit its
        parts, else decoded and encoded again; the weights stay as the load read them."""
        found = self.found
        owner.check_settled()
        owner.settle_state()
        coded, steps = owner.precision.coded_moments, {}
        for i, p in enumerate(found.params):
            parts = owner.raw(i) if coded else None
            if parts == [] and self.moments[i]:  # it keeps none of it (ZeRO-1: another rank's): its step, no read
                steps[i] = int(found.read[OPTIM][found.names[id(p)]]["step"])
                continue
            entry = self.saved(i)
            if entry is not None and parts and portable_codes.fits_as_kept(p, parts, entry):
                portable_codes.put_as_kept(p, parts, entry)  # its bits: the same as decoded and encoded, sooner
            else:
                # the weight came from the checkpoint as it was: rounding the master again may differ at ties
                owner.put(i, None if entry is None else _owned_entry(p, portable_codes.decoded(p, entry)),
                          weights_follow=False)  # fmt: skip
            if entry is not None:
                steps[i] = int(entry["step"])
            entry = None  # let go before the next parameter's batch is read: one batch held, not two
        owner.loaded_raw(steps)  # the step counts and a load's bookkeeping; every other parameter starts afresh

    def _read(self, batch: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        f = self.found
        target = _target(f.params, self.moments, f.names, batch)
        if any(target[OPTIM].values()):
            f.at.read(target, changed=True)
        steps = f.read[OPTIM]
        return {j: {"step": steps[f.names[id(f.params[j])]]["step"], **entry}
                for j, entry in zip(batch, target[OPTIM].values(), strict=True) if self.moments[j]}  # fmt: skip


def _streamed(found: _Checked, optimizer: Any) -> float:
    """Phase 2 for a TwinFlowAdam: the groups (and the user's own keys), then the weights in place, then the state
    a batch at a time (:class:`StateReader`) through the state owner; under ratio="auto" before its first step,
    when that step builds the state (the files are read then). Returns the seconds the weights took."""
    own = {i: {k: v for k, v in entry.items() if k != "step"} for i, entry in enumerate(found.read[OPTIM].values())}
    state = {i: _owned_entry(found.params[i], entry) for i, entry in own.items() if entry}
    _agreed(lambda: _load_groups(found, optimizer, state), "this rank's optimizer took its groups and started afresh")
    start = time.perf_counter()
    found.at.read({MODEL: found.model_now}, changed=True)  # in place, into the model's own tensors
    weights = time.perf_counter() - start
    reader, owner = StateReader(found), optimizer.state_owner
    if not owner.built:
        optimizer.pending_state = reader  # its build takes the pending state, a parameter after another
        return weights
    reader.put_into(owner)
    return weights


def _load_groups(found: _Checked, optimizer: Any, state: dict[int, dict[str, torch.Tensor]]) -> None:
    try:  # its checks first: a refusal changes nothing
        optimizer.load_state_dict({"state": state, "param_groups": found.groups})  # every parameter starts afresh
    except Exception as exc:
        raise CheckpointError(f"checkpoint {found.at.tag!r}: the optimizer refused it ({exc}); nothing was "
                              "changed") from exc  # fmt: skip


def _whole(found: _Checked, optimizer: Any) -> None:
    """Phase 2 for any other optimizer (the first read everything into new host tensors): the weights, then the
    optimizer's own ``load_state_dict``, which checks everything before it changes anything (if it refuses, the
    weights go back)."""
    target, model_now = found.read, found.model_now
    state = {  # a parameter saved without state has no entry: it starts afresh
        i: _owned_entry(p, portable_codes.decoded(p, target[OPTIM][found.names[id(p)]]))
        for i, p in enumerate(found.params)
        if target[OPTIM][found.names[id(p)]]
    }  # fmt: skip (none: afresh)
    before = {key: local(now).to("cpu", copy=True) for key, now in model_now.items()}
    with torch.no_grad():
        for key, now in model_now.items():
            local(now).copy_(local(target[MODEL][key]))

    def load() -> None:
        try:
            _load_groups(found, optimizer, state)
        except CheckpointError:
            with torch.no_grad():
                for key, now in model_now.items():
                    local(now).copy_(before[key])
            raise

    _agreed(load, "this rank's model and optimizer were loaded")


class Rows:
    """Rows [first, first + count) of a saved tensor of shape `shape`, as a DCP read target: ``data`` (a new host
    tensor of those rows, in `dtype`) takes whatever saved pieces overlap them."""

    def __init__(self, shape: list[int], first: int, count: int, dtype: torch.dtype) -> None:
        self.shape, self.first = shape, first
        self.data = torch.empty([count, *shape[1:]] if shape else [], dtype=dtype)

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def __create_chunk_list__(self) -> list[Any]:
        offsets = [self.first] + [0] * (len(self.shape) - 1) if self.shape else []
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=self.data.shape)]


class RowsPlanner(DefaultLoadPlanner):
    """DCP's load planner over :class:`Rows` targets, by their saved (flat) names, as they are: DCP's set-up
    replaces what is not a tensor with None, a flattening would take names missing from the read for an older
    layout's, and DCP looks a piece's target up only in tensors."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: Any) -> torch.Tensor:
        return self.state_dict[index.fqn].data


def row_batches(outs: list[Any]) -> list[list[tuple[Any, int, int]]]:
    """(out, first row, rows) pieces of the tensors `outs` (each with its logical ``shape``) of at most ``CHUNK``
    elements (a longer row: alone), in batches of about ``CHUNK`` elements (never two pieces of one tensor)."""
    batches: list[list[tuple[Any, int, int]]] = [[]]
    size = 0
    for out in outs:
        rows = out.shape[0] if out.shape else 1
        per_row = max(1, math.prod(out.shape[1:])) if out.shape else 1
        step = max(1, CHUNK // per_row)
        for first in range(0, max(rows, 1), step):
            count = min(step, rows - first) if out.shape else 1
            if batches[-1] and size + count * per_row > CHUNK:
                batches.append([])
                size = 0
            batches[-1].append((out, first, count))
            size += count * per_row
    return [batch for batch in batches if batch]
