"""Checkpoints that move: saved by N processes, resumed by M, on PyTorch's distributed checkpoint (DCP).

Layout of ``save_portable(directory, tag, ...)``::

    directory/
      latest                   the newest complete tag (written last, atomically)
      <tag>/.metadata          DCP's index of every tensor's pieces (written last by DCP)
      <tag>/__<r>_<i>.distcp   rank r's pieces, a file a tensor
      <tag>/twinflow.pt        what is not a tensor of the model or the optimizer: hyper-parameters per group,
                               the scheduler, the caller's extra state and meta, the saving world's size, the
                               tied parameters' names, the model's keys in order
      <tag>/twinflow.sums.<r>.json  rank r's share of the files' sizes and CRC-32s

Every tensor is saved as the logical tensor it is a piece of, named by the parameter's name in the model: the
model's weights as ``model.state_dict()`` gives them (FSDP2: DTensors), the optimizer's state of a parameter
(``step``, ``exp_avg``, ``exp_avg_sq``, ``master``, float32) as a tensor of the parameter's shape (a DTensor over
the parameter's mesh where it is one). DCP writes each rank's pieces and reads back whatever pieces a rank of
another world needs: a checkpoint of N ranks resumes on M, under DDP, ZeRO-1, FSDP2 or one process, at any ratio
and in any ``state_precision`` (:mod:`.portable_load` hands the state to the optimizer's state owner).

- **fp32 state is exact.** Compact state is saved as it is kept (:mod:`.portable_codes`: each moment's codes and
  block scales, a 24-bit master's two parts) where every rank's elements of a parameter start on a block, else
  decoded (float32). A load whose elements start on the saved blocks, in the same precision, copies them in; any
  other decodes and encodes them again to the nearest code: a block that is the same block after the load gets
  its codes and scale back bit for bit either way; a block cut otherwise is re-encoded, and its stochastic
  rounding's noise follows the elements' new indices.
- **Nothing half-written.** The tag is written under ``<tag>.saving`` and renamed into place by rank 0 once DCP
  has written its metadata on every rank's pieces, then ``latest`` is written: a save killed at any point leaves the
  previous tags loadable, and the next save removes what it left.
- **Bounded memory at a synchronous save.** The optimizer's state is read a tensor at a time as DCP writes it,
  each to a file of its own (:class:`_Deferred`): the peak follows the largest tensor, not the model. An
  asynchronous save copies the state to host memory first, into the copy the last one made where it fits, and
  keeps it for the next (:mod:`.portable_staging`: this rank's share of the checkpoint, until released).
- **Checksums.** Each rank sums its share of the written files (:mod:`.portable_sums`) before the tag is put in
  place; the load (:mod:`.portable_load`) checks everything it will read before it changes anything, and then
  reads the state a batch at a time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from twinflow.base.distributed import is_dtensor, local, rank_and_world
from twinflow.base.notice import notice
from twinflow.base.progress import NoProgress, shown
from twinflow.checkpoint import portable_codes, portable_staging
from twinflow.checkpoint.checkpoint_files import CheckpointError, save_to_stream, write_atomic
from twinflow.checkpoint.portable_codes import CODES, HI, LO, MOMENTS, SCALES
from twinflow.checkpoint.portable_sums import THREADS, write_sums
from twinflow.version import __version__

try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover (torch >= 2.4 has them)
    dcp = DTensor = None
    DefaultSavePlanner = object

# dcp.async_save takes a stager (the state is already in host memory) from torch 2.9 on; earlier ones would copy
# the state again and fail on FSDP2's DTensors: an asynchronous save there is refused before anything is written
ASYNC_SAVE = dcp is not None and "async_stager" in inspect.signature(dcp.async_save).parameters
INFO = "twinflow.pt"
SAVING, OLD = ".saving", ".old"
MODEL, OPTIM = "model", "optim"


def is_portable(folder: Path) -> bool:
    """Whether a tag folder holds a checkpoint of this format."""
    return (folder / INFO).is_file() and (folder / ".metadata").is_file()


def holds(directory: Path, tag: str | None) -> bool:
    """Whether `tag` (None: ``latest``'s) of `directory` is a checkpoint of this format (or its ``.old`` copy: a
    process that died between a re-save's renames)."""
    tag = tag if tag is not None else latest_tag(directory)
    return tag is not None and (is_portable(directory / tag) or is_portable(directory / (tag + OLD)))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def names_of(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's name in the model, by the parameter's identity."""
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def _logical(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Parameter `p`'s state tensor `value` (its local elements, on the host) as the logical tensor DCP saves: of
    `p`'s shape, a DTensor over `p`'s mesh where `p` is one (a 0-dimensional `value`, the step, stays itself)."""
    if value.dim() == 0 and p.dim() != 0:
        return value
    if is_dtensor(p):
        piece = value.reshape(local(p).shape)
        return DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())  # fmt: skip
    return value.reshape(p.shape)


def _host_state_tensor(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A state tensor of `p` as saved: host memory, float32 (a step count as it is), logical (:func:`_logical`)."""
    return _logical(p, v.detach().to("cpu", torch.float32) if v.dim() else v.detach().cpu())


def planned_tensor(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A logical tensor of `p`'s shape in `dtype` over no memory (one element, expanded), made where `p` is: a DTensor
    over a GPU mesh moves a host piece to its GPU, densely."""
    return _logical(p, torch.empty((), dtype=dtype, device=local(p).device).expand(local(p).shape))


def host_tensor(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty host tensor of `t`'s shape (and `dtype`, else t's): a DTensor with `t`'s placements where `t` is
    one, its piece in host memory, made like a placeholder over no memory (DTensor.from_local would move a host piece
    to the mesh's GPU; copying the placeholder to the host copied its piece densely from the GPU: 33 s of OPT-13B's)."""
    dtype = dtype or t.dtype
    if is_dtensor(t):
        return torch.empty_like(planned_tensor(t, dtype), device="cpu")
    return torch.empty(t.shape, dtype=dtype)


def gathered(mine: dict[str, Any]) -> dict[str, Any]:
    """The union over the ranks of each rank's `mine` (name -> value)."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(mine)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for rank_items in every for k, v in rank_items.items()}


def _optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's state by parameter name, as logical tensors (:func:`_logical`): where the optimizer keeps
    its state behind a state owner (TwinFlowAdam), a :class:`_Deferred` for each moment and master, read when DCP
    writes it; another optimizer's ``state_dict()`` as it is."""
    owner = getattr(optimizer, "state_owner", None)
    if owner is not None and owner.built:
        return _owner_tensors(model, optimizer, owner)
    names, out = names_of(model), {}
    state = optimizer.state_dict()["state"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in state.items():
        p = params[index]
        out[names[id(p)]] = {key: _host_state_tensor(p, v)
                             for key, v in entry.items() if isinstance(v, torch.Tensor)}  # fmt: skip
    return out


class _Deferred:
    """A parameter's moment, master or codes (`dtype`), read (`read(out=None)`: this process's elements, flat, in
    new host memory or into `out`) only when DCP writes it, never through ``opt.state`` (state_dict()'s decoded
    copies of compact state stayed there after the save, 12 bytes a parameter). With a file a tensor (DCP's writer
    keeps a file's tensors until the file ends), a save holds one such tensor at a time. Stands in the state dict
    as `placeholder`: a logical tensor of the right shape and dtype over no memory, from which DCP plans."""

    def __init__(self, p: torch.Tensor, dtype: torch.dtype, read: Any) -> None:
        self.p, self.read = p, read
        self.placeholder = planned_tensor(p, dtype)

    def local(self) -> torch.Tensor:
        """The elements this process holds, in the shape it holds them (what DCP writes of the logical tensor)."""
        return self.read().view(local(self.p).shape)

    def stage_into(self, copies: portable_staging.HostCopies, key: str) -> torch.Tensor:
        """The logical tensor, its piece read into the host copy `copies` keeps for `key` (an asynchronous save's)."""
        return copies.copy(key, self.p, self.placeholder.dtype, lambda out: self.read(out=out))


class _DeferredScales:
    """A moment's block scales (:class:`.portable_codes.BlockScales`), read when DCP writes them."""

    def __init__(self, p: torch.Tensor, read: Any) -> None:
        self.p, self.read = p, read
        self.placeholder = portable_codes.scales_piece(p)

    def local(self) -> torch.Tensor:
        return self.read()

    def stage_into(self, copies: portable_staging.HostCopies, key: str) -> portable_codes.BlockScales:
        return portable_codes.scales_piece(self.p, self.read())  # 1/256 of the moment's bytes: a new copy


def _owner_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, owner: Any) -> dict[str, dict[str, Any]]:
    """A TwinFlowAdam's state by parameter name: the steps as tensors, the moments and masters read when written
    (:class:`_Deferred`, without decoding it all first): compact moments as their codes and scales where every
    rank's elements of the parameter start on a block (:mod:`.portable_codes`), else decoded."""
    owner.check_settled()  # no step half done
    owner.settle_state()
    owner.absorb_edits()  # in-place writes to the copies opt.state handed out
    names, out = names_of(model), {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = [i for i in range(len(params)) if owner.holds(i)]
    coded = owner.precision.coded_moments
    # what keeps a parameter's state from being saved as kept, on any rank (every rank must save the same keys)
    unlike = set(gathered({(names[id(params[i])], why): False for i in held if coded
                           for why in _not_as_kept(params[i], owner.raw(i))}))  # fmt: skip
    unaligned, no24 = ({name for name, why in unlike if why == reason} for reason in ("blocks", "m24"))
    # keys of the user's own beside a parameter's state (opt.state's extras, read without syncing it) are saved too
    extras, _ = optimizer.state_extras()
    for i in held:
        p, name = params[i], names[id(params[i])]
        own = {k: _host_state_tensor(p, v)
               for k, v in extras.get(i, {}).items() if isinstance(v, torch.Tensor)}  # fmt: skip
        entry = {**own, "step": torch.tensor(float(owner.steps[i]))}
        as_kept = coded and name not in unaligned
        if as_kept:
            entry.update(_codes(p, owner, i))
        else:
            decoded = {m: functools.partial(_read_decoded, owner, i, m) for m in MOMENTS}
            entry.update({m: _Deferred(p, torch.float32, read) for m, read in decoded.items()})
        if owner.locals[i].dtype == torch.float32:
            pass  # the weight is its own master
        elif as_kept and name not in no24:
            for key, dtype in ((HI, torch.bfloat16), (LO, torch.uint8)):
                entry[key] = _Deferred(p, dtype, functools.partial(_read_masters24, owner, i, key))
        else:
            entry["master"] = _Deferred(p, torch.float32, functools.partial(_read_decoded, owner, i, "master"))
        out[name] = entry
    return out


def _not_as_kept(p: torch.Tensor, parts: list[Any]) -> list[str]:
    """Why this rank cannot save parameter `p`'s state (kept in `parts`) as kept: "blocks" (its elements do not start
    on blocks: moments decoded), "m24" (its masters are not all 24-bit: saved as float32)."""
    return [why for why, ok in (("blocks", portable_codes.keeps_blocks(p, parts)),
                                ("m24", portable_codes.keeps_masters24(parts))) if not ok]  # fmt: skip


def _read_decoded(owner: Any, i: int, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
    return owner.read(i, key, out)


def _read_codes(owner: Any, i: int, moment: str, what: str, out: torch.Tensor | None = None) -> torch.Tensor:
    return portable_codes.codes_of(owner.raw(i), moment, what, out)


def _read_masters24(owner: Any, i: int, what: str, out: torch.Tensor | None = None) -> torch.Tensor:
    return portable_codes.masters24_of(owner.raw(i), what, out)


def _codes(p: torch.Tensor, owner: Any, i: int) -> dict[str, Any]:
    """Parameter i's moments as their codes and block scales, read from the owner's parts when written."""
    out: dict[str, Any] = {}
    for moment, dtype in MOMENTS.items():
        read = functools.partial(_read_codes, owner, i, moment)
        out[portable_codes.key_of(moment, CODES)] = _Deferred(p, dtype, functools.partial(read, CODES))
        out[portable_codes.key_of(moment, SCALES)] = _DeferredScales(p, functools.partial(read, SCALES))
    return out


def _deferred(state: dict[str, dict[str, Any]]) -> dict[str, _Deferred | _DeferredScales]:
    """The :class:`_Deferred` of `state` by the key DCP gives it (its path joined by dots, as DCP flattens a nested
    state dict; :class:`_ReadWhenWritten` checks every one is planned)."""
    return {f"{OPTIM}.{name}.{key}": value for name, entry in state[OPTIM].items() for key, value in entry.items()
            if isinstance(value, _Deferred | _DeferredScales)}  # fmt: skip


def _with(state: dict[str, dict[str, Any]], each: Any) -> dict[str, dict[str, Any]]:
    """`state` with every :class:`_Deferred` replaced by each(it), the rest as they are."""
    return {MODEL: state[MODEL], OPTIM: {name: {k: each(v) if isinstance(v, _Deferred | _DeferredScales) else v
                                                for k, v in entry.items()}
                                         for name, entry in state[OPTIM].items()}}  # fmt: skip


class _ReadWhenWritten(DefaultSavePlanner):
    """DCP's default save planner, except that a :class:`_Deferred` is read when the writer asks for it, and the
    bytes this rank writes are counted as they are asked for (`progress`: shown on the first rank, past a size)."""

    def __init__(self, deferred: dict[str, _Deferred | _DeferredScales], progress: str | None = None) -> None:
        super().__init__()
        self.deferred = deferred
        self.progress, self.meter = progress, NoProgress()
        self.sizes: dict[str, int] = {}  # each key's bytes in this rank's plan

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        unplanned = set(self.deferred) - {item.index.fqn for item in plan.items}
        if unplanned:  # DCP named them otherwise: their placeholders (zeros) would be written instead
            raise RuntimeError(f"portable save: DCP planned no item for {sorted(unplanned)[:3]}; nothing was "
                               "written in place of the previous tag (a twinflow bug: please report it)")  # fmt: skip
        return plan

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)  # what this rank writes, once DCP has left out other ranks' copies
        for item, data in ((item, item.tensor_data) for item in plan.items if item.tensor_data is not None):
            count = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
            self.sizes[item.index.fqn] = self.sizes.get(item.index.fqn, 0) + count
        if self.progress is not None:
            self.meter = shown(sum(self.sizes.values()), self.progress, rank_and_world()[0] == 0)
        return plan

    def lookup_object(self, index: Any) -> Any:
        self.meter.update(self.sizes.pop(index.fqn, 0))  # asked for as it is written
        deferred = self.deferred.get(index.fqn)
        if deferred is not None:
            return deferred.local()
        scales = self.state_dict.get(index.fqn)  # an asynchronous save's copy of a moment's block scales
        return scales.data if isinstance(scales, portable_codes.BlockScales) else super().lookup_object(index)


def _tied(model: torch.nn.Module) -> dict[str, str]:
    """Each tied parameter's later names -> its first (an ``lm_head`` sharing the embeddings), for the converter."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {later: every[0] for every in names.values() for later in every[1:]}


def _groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups' hyper-parameters, each with its parameters' names (every rank's, under ZeRO-1)."""
    names = names_of(model)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]  # fmt: skip
    group_of = gathered({name: i for i, g in enumerate(groups) for name in g["params"]})
    for i, g in enumerate(groups):
        g["params"] = [name for name, gi in group_of.items() if gi == i]
    return groups


class PendingSave:
    """A portable save still being written in the background (``save_portable(..., asynchronous=True)``): the
    tensors were copied out when it began, so training goes on and changes nothing in it. :meth:`wait` ends it:
    once DCP's metadata has landed, rank 0 renames the tag into place and writes ``latest``."""

    def __init__(self, future: Any, saving: Path, final: Path, start: float) -> None:
        self.future, self.saving, self.final, self.start = future, saving, final, start

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> Path:
        """Blocks until the save has been written and put in place (every rank calls it, as they called the save:
        none returns before rank 0 has renamed the tag and written ``latest``); returns the tag's folder. A write
        that failed on any rank raises here on every rank, and the tag stays "<tag>.saving" (removed by the next
        save)."""
        try:
            _finish(self.saving, self.final, self.future.result)
        finally:  # still written (the wait was interrupted): still pending, its host copies not to be reused yet
            if self.future.done() and self in _pending:
                _pending.remove(self)
        notice("saved portable checkpoint %s in the background in %.1f s", self.final,
               time.perf_counter() - self.start)  # fmt: skip
        return self.final


def _finish(saving: Path, final: Path, last_write: Any) -> None:
    """Every rank runs `last_write` (its sums; in the background, what waits for them), then the ranks agree: only
    once every rank's succeeded does rank 0 put the tag in place; a failure on any rank raises on every rank."""
    failed: BaseException | None = None
    try:
        last_write()
    except BaseException as exc:  # noqa: BLE001 (raised below, once every rank has said how its write went)
        failed = exc
    failures = gathered({rank_and_world()[0]: None if failed is None else f"{type(failed).__name__}: {failed}"})
    others = {rank: why for rank, why in failures.items() if why is not None}
    if not others and rank_and_world()[0] == 0:
        _put_in_place(saving, final)
    _barrier()
    if failed is not None:
        raise failed
    if others:
        rank, why = min(others.items())
        raise CheckpointError(f"the save of {final} failed on rank {rank} ({why[:300]}); it stays {saving.name} "
                              "(removed by the next save) and the previous tags are as they were")  # fmt: skip


_pending: list[PendingSave] = []  # this process's asynchronous saves not yet waited for
_summer: list[concurrent.futures.ThreadPoolExecutor] = []  # the thread that sums what those saves wrote


def _summing() -> concurrent.futures.ThreadPoolExecutor:
    if not _summer:
        _summer.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="twinflow-sums"))
    return _summer[0]


def _then_sums(written: Any, saving: Path, rank: int, world: int) -> None:
    """Once DCP's background write has ended (its metadata landed), this rank's share of the files is summed."""
    written.result()
    write_sums(saving, rank, world)


def wait_pending() -> Path | None:
    """Waits for this process's asynchronous saves still being written (every rank calls it); returns the last
    one's folder (None: none was pending)."""
    last = None
    for pending in list(_pending):
        last = pending.wait()
    return last


_copies = portable_staging.HostCopies(host_tensor, THREADS)  # this process's asynchronous saves' copies


def kept_copy_bytes() -> int:
    """The host memory this process keeps for its next asynchronous save (the last one's copy of the state)."""
    return _copies.nbytes


def reused_copy_bytes() -> int:
    """The host bytes this process's last asynchronous save copied into copies kept from the one before."""
    return _copies.reused


def release_kept_copies() -> None:
    """Frees what :func:`kept_copy_bytes` counts (this process's pending saves must have been waited for)."""
    if _pending:
        raise RuntimeError(
            "release_kept_copies() while an asynchronous save is written from them: wait_pending() first"
        )
    _copies.release()


def _put_in_place(saving: Path, final: Path) -> None:
    """Rank 0: the written tag renamed into place, then ``latest``. A tag saved again: the old folder becomes
    ``<tag>.old`` first (a load finds it there if the process dies between the two renames), removed at the end."""
    old = final.with_name(final.name + OLD)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    saving.rename(final)
    write_atomic(final.parent / "latest", lambda f: f.write(final.name.encode()))
    shutil.rmtree(old, ignore_errors=True)


def save_portable(directory: str | Path, tag: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: Any = None, extra: Any = None, meta: Any = None,
                  asynchronous: bool = False) -> Path | PendingSave:  # fmt: skip
    """Saves `tag` in the portable format (see the module); every rank calls it. Returns the tag's folder, or with
    `asynchronous` a :class:`PendingSave` as soon as the tensors are copied out (the files are written in the
    background; call its ``wait()`` before the next save or load, or the end of the run)."""
    if getattr(getattr(optimizer, "offload", None), "offloaded", False):
        raise RuntimeError("save_portable() while the optimizer's state is offloaded: call reload_states() first")
    if asynchronous and not ASYNC_SAVE:
        raise RuntimeError(f"an asynchronous save needs torch >= 2.9 (this is {torch.__version__}): save with "
                           "asynchronous=False, or upgrade torch")  # fmt: skip
    start = time.perf_counter()
    rank, world = rank_and_world()
    directory = Path(directory)
    final, saving = directory / tag, directory / f"{tag}{SAVING}"
    wait_pending()  # this process's asynchronous saves end first (every rank has them)
    refused = gathered({rank: portable_codes.refused_key(names_of(model), optimizer)})
    if any(why is not None for why in refused.values()):  # every rank refuses, before anything is written
        raise ValueError(min((r, why) for r, why in refused.items() if why is not None)[1])
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for left in directory.glob(f"*{SAVING}"):  # what a killed save left
            shutil.rmtree(left, ignore_errors=True)
        saving.mkdir()
    _barrier()
    state = {MODEL: {k: v.detach() for k, v in model.state_dict().items()}, OPTIM: _optimizer_tensors(model, optimizer)}
    groups = _groups(model, optimizer)
    keys = gathered({name: sorted(entry) for name, entry in state[OPTIM].items()})
    if rank == 0:
        info = {"format": 1, "twinflow_version": __version__, "world_size": world, "param_groups": groups,
                "state_keys": keys, "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "extra": extra, "meta": meta, "sums": True, "tied": _tied(model),
                "model_keys": list(state[MODEL])}  # fmt: skip
        write_atomic(saving / INFO, lambda f: save_to_stream(info, f))
    if asynchronous:  # copied to host memory now (the deferred read: new tensors already), written by a thread
        copy = _copies.stage(state)  # each tensor copied once, into what the last asynchronous save copied into
        writer = dcp.FileSystemWriter(saving, single_file_per_rank=False)
        future = dcp.async_save(copy, checkpoint_id=saving, process_group=portable_staging.background_group(),
                                storage_writer=writer, async_stager=portable_staging.AlreadyStaged(),
                                planner=_ReadWhenWritten({}))  # fmt: skip
        summed = _summing().submit(_then_sums, future, saving, rank, world)  # in the background as well
        _pending.append(PendingSave(summed, saving, final, start))
        return _pending[-1]
    # .metadata last, once every rank's pieces are written; the deferred state read as each piece is written
    planned = _with(state, lambda deferred: deferred.placeholder)
    writer = dcp.FileSystemWriter(saving, single_file_per_rank=False)  # a file a tensor: its file ends, it goes
    planner = _ReadWhenWritten(_deferred(state), f"writing checkpoint {tag!r}" + " (rank 0's share)" * (world > 1))
    dcp.save(planned, checkpoint_id=saving, storage_writer=writer, planner=planner)
    planner.meter.close()
    _finish(saving, final, lambda: write_sums(saving, rank, world))  # its files' sums, once every rank's are written
    notice("saved portable checkpoint %s (%d ranks) in %.1f s", final, world, time.perf_counter() - start)
    return final


def latest_tag(directory: Path) -> str | None:
    """The tag ``latest`` names in `directory`, if there is one."""
    latest = directory / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def tag_of(directory: Path, tag: str | None) -> str:
    tag = tag if tag is not None else latest_tag(directory)
    if tag is None:
        raise CheckpointError(f"no 'latest' in {directory}: name a tag, or save a checkpoint there first")
    return tag
