"""Checkpoints that move: saved by N processes, resumed by M, on PyTorch's distributed checkpoint (DCP).

Layout of ``save_portable(directory, tag, ...)``::

    directory/
      latest                   the newest complete tag (written last, atomically)
      <tag>/.metadata          DCP's index of every tensor's pieces (written last by DCP)
      <tag>/__<r>_<i>.distcp   rank r's pieces, a file a piece (a tensor, or its rows)
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
  previous tags loadable, and the next save removes what it left, or puts it back (:func:`tidy`). A save that fails
  (a full disk, Ctrl-C) removes what it wrote before it raises; a step half done, or a folder it may not write, is
  refused before anything is.
- **Bounded memory at a synchronous save.** The optimizer's state, and a weight on a GPU, is read a piece of rows
  (64 MiB at most) at a time as DCP writes it, each to a file of its own (:mod:`.portable_state`): DCP's writer
  holds two such pieces, which with a batch's scratch stay under one chunk (256 MiB) of float32, whatever the
  model; the sums read 4 MiB a file at a time (:mod:`.portable_sums`). An
  asynchronous save copies the state to host memory first, into the copy the last one made where it fits, and
  keeps it for the next (:mod:`.portable_staging`: this rank's share of the checkpoint, until released).
- **While offloaded.** After ``offload_states()`` (reinforcement learning's phases) the state, and the weights
  it moved, are read in host memory where it put them; nothing comes back to the GPU for the save.
- **Checksums.** Each rank sums its share of the written files (:mod:`.portable_sums`) before the tag is put in
  place; the load (:mod:`.portable_load`) checks everything it will read before it changes anything, and then
  reads the state a batch at a time.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import pickle
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from twinflow.base.distributed import rank_and_world
from twinflow.base.notice import notice
from twinflow.checkpoint import portable_codes, portable_staging
from twinflow.checkpoint.checkpoint_files import PORTABLE_INFO as INFO
from twinflow.checkpoint.checkpoint_files import (
    PORTABLE_OLD,
    PORTABLE_SAVING,
    CheckpointError,
    is_portable,
    make_dirs,
    remove_created,
    remove_leftovers,
    save_to_stream,
    unwritable_error,
    write_atomic,
)
from twinflow.checkpoint.portable_checks import ENTRIES
from twinflow.checkpoint.portable_state import (
    MODEL,
    OPTIM,
    ReadWhenWritten,
    deferred,
    gathered,
    groups,
    host_tensor,
    model_tensors,
    names_of,
    optimizer_tensors,
    tied,
    with_each,
)
from twinflow.checkpoint.portable_sums import THREADS, write_sums
from twinflow.checkpoint.saved_values import check_extra, check_loadable, check_tag
from twinflow.version import __version__

try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover (torch >= 2.4 has it)
    dcp = CheckpointException = None

# DCP warns at every call made without torch.distributed, and at each per-rank read of a load (no_dist): one process
# saving or loading on its own is what twinflow asks of it, and the engine saves this format. Only that
# warning is left out, from twinflow's import on (a filter set around each call would not be thread-safe: the warning
# filters are the process's, and an asynchronous save writes on DCP's own thread).
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
    r"(save|load) in a single process",
    category=UserWarning,
)
# dcp.async_save takes a stager (the state is already in host memory) from torch 2.9 on; earlier ones would copy
# the state again and fail on FSDP2's DTensors: an asynchronous save there is refused before anything is written
ASYNC_SAVE = dcp is not None and "async_stager" in inspect.signature(dcp.async_save).parameters
SAVING, OLD = PORTABLE_SAVING, PORTABLE_OLD


def holds(directory: Path, tag: str | None) -> bool:
    """Whether `tag` (None or "latest": ``latest``'s) of `directory` is a checkpoint of this format (or its ``.old``
    copy: a process that died between a re-save's renames)."""
    tag = tag_named(directory, tag)
    return tag is not None and (is_portable(directory / tag) or is_portable(directory / (tag + OLD)))


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


def _agreed(run: Any) -> tuple[BaseException | None, dict[int, tuple[str, bytes | None]]]:
    """Runs `run` on this rank, then every rank learns how each rank's went: (this rank's failure, or None; each
    failing rank's, told as :func:`_told`)."""
    failed = None
    try:
        run()
    except BaseException as exc:  # noqa: BLE001 (the caller raises it, once every rank knows)
        failed = exc
    told = gathered({rank_and_world()[0]: None if failed is None else _told(failed)})
    return failed, {rank: why for rank, why in told.items() if why is not None}


def _told(exc: BaseException) -> tuple[str, bytes | None]:
    """A failure as another rank is told of it: described, and pickled where it comes back from its pickle (a
    failure that could not be pickled must not fail the gathering that tells it)."""
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001 (told by its description alone)
        pickled = None
    return f"{type(exc).__name__}: {exc}"[:300], pickled


def _of_rank(rank: int, failure: BaseException | tuple[str, bytes | None], final: Path, doing: str) -> BaseException:
    """What this rank raises for `rank`'s failure `doing` (an exception, or as :func:`_told`): that failure itself,
    with a note naming the rank, so that every rank raises the same type and a handler of it (``except OSError``)
    takes the failure on every rank alike (a rank going on alone waits for the others at its next collective);
    a CheckpointError describing it where it cannot be rebuilt or take a note (Python < 3.11)."""
    error, described = failure, f"{type(failure).__name__}: {failure}"
    if isinstance(failure, tuple):
        described, pickled = failure
        try:
            error = pickle.loads(pickled) if pickled is not None else None
        except Exception:  # noqa: BLE001 (described instead)
            error = None
    where = f"the save of {final} failed on rank {rank} {doing}"
    if not isinstance(error, BaseException) or not hasattr(error, "add_note"):
        return CheckpointError(f"{where} ({described}); the previous tags are as they were")
    error.add_note(f"{where}, raised here on rank {rank_and_world()[0]} too; the previous tags are as they were")
    return error


def _finish(saving: Path, final: Path, last_write: Any) -> None:
    """Every rank runs `last_write` (its sums; in the background, what waits for them), then the ranks agree: only
    once every rank's succeeded does rank 0 put the tag in place; a failure on any rank raises on every rank."""
    failed, others = _agreed(last_write)
    rank0 = rank_and_world()[0] == 0
    placed, place = _agreed(lambda: put_in_place(saving, final) if rank0 and not others else None)
    if placed is not None:
        raise placed
    if place:  # rank 0 could not: none waits for it alone
        raise _of_rank(0, place[0], final, "as it put the tag in place")
    if failed is not None:  # DCP's background write raises its CheckpointException: raised as what it wraps
        cause = _cause(failed, final)
        if cause is not failed:
            raise cause from failed
        raise failed
    if others:
        rank, why = min(others.items())
        raise _of_rank(rank, why, final, f"as it summed its files (nothing was put in place; {saving.name} is "
                                         "removed by the next save at the latest)")  # fmt: skip


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


def put_in_place(saving: Path, final: Path) -> None:
    """Rank 0: the written tag renamed into place, then ``latest``. A tag saved again: the old folder becomes
    ``<tag>.old`` first (a load finds it there if the process dies between the two renames), removed at the end."""
    old = final.with_name(final.name + OLD)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    try:
        saving.rename(final)
    except BaseException:  # Ctrl-C between the renames: the tag as it was (a process killed there: the load reads .old)
        if old.exists() and not final.exists():
            old.rename(final)
        raise
    write_atomic(final.parent / "latest", lambda f: f.write(final.name.encode()))
    shutil.rmtree(old, ignore_errors=True)


def _refusal(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any, meta: Any) -> Exception | None:
    """Why this rank cannot save (a ValueError: a key the optimizer's state cannot be saved under; a TypeError:
    `extra` or `meta` that twinflow.pt could not be read back with), or None."""
    why = portable_codes.refused_key(names_of(model), optimizer)
    if why is not None:
        return ValueError(why)
    if not ENTRIES["meta"][0](meta):  # the rule a load checks it by
        return TypeError(f"meta= is a {type(meta).__name__}; expected a dict of plain values, or None: pass "
                         f"meta={{'note': ...}}")  # fmt: skip
    try:
        if extra is not None:
            check_extra(extra)
        check_loadable(meta, "meta=")
    except TypeError as exc:
        return exc
    return None


def save_portable(directory: str | Path, tag: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: Any = None, extra: Any = None, meta: Any = None,
                  asynchronous: bool = False) -> Path | PendingSave:  # fmt: skip
    """Saves `tag` in the portable format (see the module); every rank calls it. Returns the tag's folder, or with
    `asynchronous` a :class:`PendingSave` as soon as the tensors are copied out (the files are written in the
    background; call its ``wait()`` before the next save or load, or the end of the run)."""
    if asynchronous and not ASYNC_SAVE:
        raise RuntimeError(f"an asynchronous save needs torch >= 2.9 (this is {torch.__version__}): save with "
                           "asynchronous=False, or upgrade torch")  # fmt: skip
    check_tag(tag)  # a plain folder name: not "latest", not hidden, no path
    start = time.perf_counter()
    rank, world = rank_and_world()
    directory = Path(directory)
    final, saving = directory / tag, directory / f"{tag}{SAVING}"
    wait_pending()  # this process's asynchronous saves end first (every rank has them)
    refused = gathered({rank: _refusal(model, optimizer, extra, meta)})
    if any(why is not None for why in refused.values()):  # every rank refuses, before anything is written
        raise next(refused[r] for r in sorted(refused) if refused[r] is not None)
    if callable(getattr(optimizer, "synchronize", None)):
        optimizer.synchronize()  # the model's weights hold every update taken, a delayed one included
    state = {MODEL: model_tensors(model, optimizer), OPTIM: optimizer_tensors(model, optimizer)}  # a step half done:
    keys = gathered({name: sorted(entry) for name, entry in state[OPTIM].items()})  # refused before anything is made
    hyper = groups(model, optimizer)  # every rank's parameters' names: every rank takes part
    keys = {name: [] for group in hyper for name in group["params"]} | keys  # no state yet: a load starts it afresh

    def write_info() -> None:  # rank 0, in the step every rank waits for
        info = {"format": 1, "twinflow_version": __version__, "world_size": world, "param_groups": hyper,
                "state_keys": keys, "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "extra": extra, "meta": meta, "sums": True, "tied": tied(model),
                "model_keys": list(state[MODEL])}  # fmt: skip
        write_atomic(saving / INFO, lambda f: save_to_stream(info, f))

    created = _make_room(directory, saving, write_info)
    try:
        if asynchronous:  # copied to host memory now, written by DCP's thread from here on
            written = _write_in_background(state, saving)
        else:
            # .metadata last, once every rank's pieces are written; the deferred state read as each piece is written
            planned = with_each(state, lambda deferred: deferred.placeholder)
            writer = dcp.FileSystemWriter(saving, single_file_per_rank=False)  # a file a piece: written, it goes
            progress = f"writing checkpoint {tag!r}" + " (rank 0's share)" * (world > 1)
            planner = ReadWhenWritten(deferred(state), progress)
            dcp.save(planned, checkpoint_id=saving, storage_writer=writer, planner=planner)
            planner.meter.close()
            _finish(saving, final, lambda: write_sums(saving, rank, world))  # the sums, once every rank's are written
    except BaseException as exc:  # a full disk, Ctrl-C: nothing of this save stays, the previous tags as they were
        if rank == 0:
            shutil.rmtree(saving, ignore_errors=True)
            remove_created(created)
        cause = _cause(exc, final)
        named = unwritable_error(cause, directory) if isinstance(cause, OSError) else None
        if named is not None:
            raise named from exc
        if cause is not exc:
            raise cause from exc
        raise
    if asynchronous:  # the write is DCP's thread's now: a failure from here on is raised by its wait()
        summed = _summing().submit(_then_sums, written, saving, rank, world)  # in the background as well
        _pending.append(PendingSave(summed, saving, final, start))
        return _pending[-1]
    notice("saved portable checkpoint %s (%d ranks) in %.1f s", final, world, time.perf_counter() - start)
    return final


def _cause(exc: BaseException, final: Path) -> BaseException:
    """DCP's CheckpointException (a BaseException, which ``except Exception`` misses) as the error it wraps: this
    rank's own (Ctrl-C stays a KeyboardInterrupt, a full disk an OSError), else the first failing rank's, noted
    as that rank's (:func:`_of_rank`)."""
    failures = exc.failures if CheckpointException is not None and isinstance(exc, CheckpointException) else None
    if not failures:
        return exc
    rank = rank_and_world()[0]
    if rank in failures:
        return failures[rank][0]
    first, (error, _) = min(failures.items(), key=lambda item: item[0])
    return _of_rank(first, error, final, "as it wrote its pieces")


def tidy(directory: Path) -> None:
    """Rank 0: what killed saves left in `directory` removed, or put back: their ``.saving`` folders and stray
    temporaries (of ``latest``: a writer that is gone), and a tag's ``.old`` copy (removed where the tag is in place;
    renamed back where the process died between a re-save's two renames, so the tag is itself again)."""
    remove_leftovers(directory)
    for left in directory.glob(f"*{SAVING}"):
        shutil.rmtree(left, ignore_errors=True)
    for old in directory.glob(f"*{OLD}"):
        tag = old.with_name(old.name[: -len(OLD)])
        if is_portable(tag):
            shutil.rmtree(old, ignore_errors=True)
        elif not tag.exists() and is_portable(old):
            old.rename(tag)


def _make_room(directory: Path, saving: Path, write_info: Any) -> list[Path]:
    """Rank 0 makes `directory` (and the parents it lacks) and `saving` in it, once what killed saves left there is
    tidied, and runs `write_info`; returns the folders made above `saving`. Every rank waits for it and raises
    what it met (a folder it may not write: named, with the fix); what it made is removed then."""
    created: list[Path] = []
    why = None
    if rank_and_world()[0] == 0:
        try:
            created = make_dirs(directory)
            tidy(directory)
            saving.mkdir()
            write_info()
        except BaseException as exc:  # noqa: BLE001 (raised below on every rank)
            shutil.rmtree(saving, ignore_errors=True)
            remove_created(created)  # a Ctrl-C too: it is raised below, on every rank, as any failure here
            why = (unwritable_error(exc, directory) if isinstance(exc, OSError) else None) or exc
    told = gathered({rank_and_world()[0]: None if why is None else _told(why)})  # every rank waits for the folder
    if why is not None:
        raise why
    if told.get(0) is not None:  # and raises what rank 0 met
        raise _of_rank(0, told[0], saving.with_name(saving.name[: -len(SAVING)]), "as it made the tag's folder")
    return created


def _write_in_background(state: dict[str, Any], saving: Path) -> Any:
    """The state copied to host memory now (the deferred read: new tensors already), handed to DCP's thread to write;
    returns DCP's future."""
    copy = _copies.stage(state)  # each tensor copied once, into what the last asynchronous save copied into
    writer = dcp.FileSystemWriter(saving, single_file_per_rank=False)
    return dcp.async_save(copy, checkpoint_id=saving, process_group=portable_staging.background_group(),
                          storage_writer=writer, async_stager=portable_staging.AlreadyStaged(),
                          planner=ReadWhenWritten({}))  # fmt: skip


def latest_tag(directory: Path) -> str | None:
    """The tag ``latest`` names in `directory`, if there is one."""
    latest = directory / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def tag_named(directory: Path, tag: str | None) -> str | None:
    """`tag`; for None or "latest", the tag ``latest`` names in `directory` (None where there is none)."""
    return latest_tag(directory) if tag in (None, "latest") else tag


def tag_of(directory: Path, tag: str | None) -> str:
    tag = tag_named(directory, tag)
    if tag is None:
        raise CheckpointError(f"no 'latest' in {directory}: name a tag, or save a checkpoint there first")
    return tag
