"""Engine checkpoints saved by N processes and resumed by M (twinflow.checkpoint.portable, on PyTorch's distributed
checkpoint), on the CPU with gloo: the resumed run's losses against the saving run continued."""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.base import progress
from twinflow.checkpoint import CheckpointError, portable, portable_load, portable_state, portable_sums
from twinflow.precision import compact

WORKER = Path(__file__).with_name("portable_worker.py")


def _launch(tmp: Path, name: str, world: int, stage: int, precision: str, ratio: float, *how: str,
            backend: str = "gloo") -> dict:  # fmt: skip
    out = tmp / name
    out.mkdir()
    rendezvous = tmp / f"{name}.rendezvous"
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--world", str(world), "--stage",
                               str(stage), "--rendezvous", str(rendezvous), "--out", str(out), "--precision",
                               precision, "--ratio", str(ratio), "--backend", backend, *how],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads((out / "losses.json").read_text())


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_a_checkpoint_of_n_processes_resumes_on_m(tmp_path, saved: int, resumed: int, stage: int,
                                                  precision: str) -> None:  # fmt: skip
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", saved, stage, precision, 0.5, "--save", str(ckpt))
    again = _launch(tmp_path, "resumed", resumed, stage, precision, 0.5, "--load", str(ckpt))
    assert again["global_steps"] == len(first["before"])
    # the same global batches: the same run up to the order of the sums (and, compact, the rounding noise's indices)
    tolerance = 1e-4 if precision == "fp32" else 2e-2
    assert again["after"] == pytest.approx(first["after"], rel=tolerance)


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_on_the_same_world_size_the_state_comes_back_bit_for_bit(tmp_path, precision: str) -> None:
    """Two ranks to two under FSDP2: every block is the same block after the load, so the compact codes, scales and
    24-bit masters come back exactly (decoded, then encoded to the nearest), and the run continues bit for bit."""
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", 2, 3, precision, 0.5, "--save", str(ckpt))
    again = _launch(tmp_path, "resumed", 2, 3, precision, 0.5, "--load", str(ckpt))
    assert again["after"] == first["after"]


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_an_asynchronous_save_of_two_ranks_resumes_on_one(tmp_path, precision: str) -> None:
    """The engine's asynchronous save (written while the three next steps train) resumes as the synchronous one;
    an asynchronous save two steps before it (FSDP2: DTensors) left the host copies it copies into."""
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", 2, 3, precision, 0.5, "--save", str(ckpt), "--asynchronous", "--warm-save")
    assert (ckpt / "warm").is_dir() and (ckpt / "latest").read_text() == "moved"
    assert first["reused"] == first["kept"] > 0  # the second save copied into every copy the first kept
    assert first["kept_after_release"] == 0  # engine.wait_checkpoint(release_memory=True)
    again = _launch(tmp_path, "resumed", 1, 3, precision, 0.5, "--load", str(ckpt))
    assert again["after"] == pytest.approx(first["after"], rel=1e-4 if precision == "fp32" else 2e-2)


def test_an_asynchronous_save_is_put_in_place_only_once_every_ranks_sums_are_written(tmp_path, monkeypatch) -> None:
    """Rank 1 writes its sums only once rank 0 waits for the save and has written `latest` (or 2 s later): a save
    whose rank 0 put the tag in place when its own write ended published a tag without rank 1's sums, which no load
    accepts, and rank 1's write then failed."""
    monkeypatch.setenv("PORTABLE_LATE_SUMS", "1")
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", 2, 3, "fp32", 0.5, "--save", str(ckpt), "--asynchronous")
    monkeypatch.delenv("PORTABLE_LATE_SUMS")
    again = _launch(tmp_path, "resumed", 1, 3, "fp32", 0.5, "--load", str(ckpt))
    assert again["after"] == pytest.approx(first["after"], rel=1e-4)


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)])
def test_under_zero_1_each_ranks_share_of_the_state_comes_together(tmp_path, saved: int, resumed: int) -> None:
    """ZeRO-1: each rank's optimizer holds some parameters' state; the saved hyper-parameters are the ones the
    scheduler set after the last step (ZeRO-1's groups hand them to the local optimizer only at the next step)."""
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", saved, 1, "fp32", 0.5, "--save", str(ckpt))
    again = _launch(tmp_path, "resumed", resumed, 1, "fp32", 0.5, "--load", str(ckpt))
    assert again["after"] == pytest.approx(first["after"], rel=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_under_zero_1_a_resume_on_as_many_ranks_is_exact(tmp_path, precision: str) -> None:
    """int8_m24: each rank copies in the codes of the parameters it keeps, and reads nothing of the others'."""
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", 2, 1, precision, 0.5, "--save", str(ckpt))
    again = _launch(tmp_path, "resumed", 2, 1, precision, 0.5, "--load", str(ckpt))
    assert again["after"] == first["after"]


def test_a_resume_at_another_ratio_and_precision(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", 2, 3, "fp32", 0.5, "--save", str(ckpt))
    again = _launch(tmp_path, "resumed", 1, 0, "fp32", 0.25, "--load", str(ckpt))
    assert again["after"] == pytest.approx(first["after"], rel=1e-4)


def _single(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, TwinFlowAdam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.GELU(), torch.nn.Linear(300, 4)).to(dtype)
    return model, TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)


def _train(model: torch.nn.Module, opt: TwinFlowAdam, steps: int = 2) -> None:
    for i in range(steps):
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(i)).to(next(model.parameters()).dtype)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _refused_and_nothing_changed(directory: Path, match: str) -> None:
    other, other_opt = _single(1)
    _train(other, other_opt, 1)  # built: the load that reads the state a batch at a time
    before = [p.detach().clone() for p in other.parameters()]
    state = other_opt.state_dict()["state"]
    with pytest.raises(CheckpointError, match=match):
        portable_load.load_portable(directory, model=other, optimizer=other_opt)
    assert all(p.detach().equal(b) for p, b in zip(other.parameters(), before))
    after = other_opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i, entry in state.items() for k, v in entry.items())


def test_a_truncated_piece_is_refused_naming_the_file_and_nothing_changes(tmp_path) -> None:
    model, opt = _single(0)
    _train(model, opt)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    piece = max(folder.glob("*.distcp"), key=lambda f: f.stat().st_size)
    piece.write_bytes(piece.read_bytes()[: piece.stat().st_size // 2])
    _refused_and_nothing_changed(tmp_path / "ckpt", rf"{piece.name} has \d+ bytes; .*truncated.*nothing was changed")


def test_a_damaged_byte_is_refused_naming_the_file_and_nothing_changes(tmp_path) -> None:
    """A byte changed in the middle of a piece (its size unchanged) used to load silently: the load checks every
    file it reads against the CRC-32 the save wrote."""
    model, opt = _single(0)
    _train(model, opt)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    piece = max(folder.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0x40
    piece.write_bytes(bytes(data))
    _refused_and_nothing_changed(tmp_path / "ckpt", rf"{piece.name} differs from what the save wrote.*CRC-32")


def test_a_missing_piece_or_sums_file_is_refused_and_nothing_changes(tmp_path) -> None:
    model, opt = _single(0)
    _train(model, opt)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    piece = next(folder.glob("*.distcp"))
    kept = piece.read_bytes()
    piece.unlink()
    _refused_and_nothing_changed(tmp_path / "ckpt", rf"{piece.name} is missing; nothing was changed")
    piece.write_bytes(kept)
    next(folder.glob(f"{portable_sums.SUMS}.*")).unlink()
    _refused_and_nothing_changed(tmp_path / "ckpt", r"sums.0.json cannot be read.*nothing was changed")


def test_a_damaged_index_is_refused_naming_it_and_a_sound_one_is_read_once(tmp_path, monkeypatch) -> None:
    """DCP's .metadata: unreadable, the load refuses naming it; readable, it is unpickled once, however many
    batches the state is read in."""
    model, opt = _single(0)
    _train(model, opt)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    reads = []
    read_metadata = portable_load.FileSystemReader.read_metadata
    monkeypatch.setattr(portable_load.FileSystemReader, "read_metadata",
                        lambda self, *a, **k: reads.append(1) or read_metadata(self, *a, **k))  # fmt: skip
    monkeypatch.setattr(portable_load, "CHUNK", 4 * 300)  # four batches of state
    other, other_opt = _single(1)
    _train(other, other_opt, 1)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert len(reads) == 1
    assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))
    index = folder / ".metadata"
    index.write_bytes(index.read_bytes()[:40])
    _refused_and_nothing_changed(tmp_path / "ckpt", r"\.metadata cannot be read.*nothing was changed")


def test_the_state_of_another_optimizer_is_refused_or_starts_afresh_and_nothing_changes(tmp_path) -> None:
    """A load hands each parameter's state to the optimizer's state owner: state without Adam's keys (Adagrad's
    `sum` and `step`) is refused naming the parameter and the key, as torch-style loads refuse it; state with none
    of the keys TwinFlowAdam keeps (SGD's momentum) starts afresh, the user's keys kept as torch keeps them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.GELU(), torch.nn.Linear(300, 4))
    adagrad = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    _train(model, adagrad)
    portable.save_portable(tmp_path / "adagrad", "t", model=model, optimizer=adagrad)
    _refused_and_nothing_changed(tmp_path / "adagrad", r"the state of 0.weight has \['step', 'sum'\], no 'exp_avg'")
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    _train(model, sgd)
    portable.save_portable(tmp_path / "sgd", "t", model=model, optimizer=sgd)
    other, other_opt = _single(1)
    _train(other, other_opt, 1)
    portable_load.load_portable(tmp_path / "sgd", model=other, optimizer=other_opt)
    assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))
    state = other_opt.state_dict()["state"]
    assert all(entry.get("step", 0) == 0 for entry in state.values())
    assert torch.equal(
        other_opt.state[other[0].weight]["momentum_buffer"], sgd.state[model[0].weight]["momentum_buffer"]
    )


def test_a_portable_checkpoint_saved_before_checksums_still_loads(tmp_path) -> None:
    model, opt = _single(0)
    _train(model, opt)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    info = torch.load(folder / portable.INFO, weights_only=True)
    del info["sums"]
    torch.save(info, folder / portable.INFO)
    for sums in folder.glob(f"{portable_sums.SUMS}.*"):
        sums.unlink()
    other, other_opt = _single(1)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))


@pytest.mark.parametrize("threads", [1, 4])
def test_the_mapped_reader_reads_what_dcps_reader_reads_on_any_thread_count(tmp_path, monkeypatch,
                                                                           threads: int) -> None:  # fmt: skip
    """Every tensor of a checkpoint (weights, fp32 and compact state, steps) read by the load's reader, its files
    copied on `threads` threads into poisoned targets (NaN; bytes 0xFF), holds the bits DCP's own reader reads;
    each piece the plan asks for is committed once, and none is left to DCP's reader."""
    model, opt = _single(0)
    opt.state_precision = "int8_m24"
    _train(model, opt, 2)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    metadata = portable.dcp.FileSystemReader(folder).read_metadata()

    def targets() -> dict:
        return {key: torch.full(meta.size, -1, dtype=torch.int8).view(meta.properties.dtype)
                if meta.properties.dtype.itemsize == 1 else
                torch.full(meta.size, float("nan"), dtype=meta.properties.dtype)
                for key, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")}  # fmt: skip

    expected, got = targets(), targets()
    portable.dcp.load(expected, checkpoint_id=folder, storage_reader=portable.dcp.FileSystemReader(folder),
                      no_dist=True)  # fmt: skip
    committed = collections.Counter()
    commit = portable_load.DefaultLoadPlanner.commit_tensor

    def counted(self, read_item, tensor):  # noqa: ANN001, ANN202
        committed[read_item.dest_index.fqn] += 1
        return commit(self, read_item, tensor)

    left: list[int] = []  # the pieces each read leaves to DCP's own reader
    dcp_read = portable_load.FileSystemReader.read_data

    def leaves(self, plan, planner):  # noqa: ANN001, ANN202
        left.append(len(plan.items))
        return dcp_read(self, plan, planner)

    monkeypatch.setattr(portable_load.DefaultLoadPlanner, "commit_tensor", counted)
    monkeypatch.setattr(portable_load.FileSystemReader, "read_data", leaves)
    reader = portable_load.MappedReader(folder, metadata, threads=threads)
    portable.dcp.load(got, checkpoint_id=folder, storage_reader=reader, no_dist=True)
    assert left == [0], left  # every piece went through the mapped, threaded copies
    assert reader.threads == threads and len(expected) > 10 and set(committed.values()) == {1}
    assert set(committed) == set(expected)
    for key, tensor in expected.items():
        assert tensor.view(-1).view(torch.uint8).equal(got[key].view(-1).view(torch.uint8)), key


class _Meter:
    """Records what a progress meter is told."""

    def __init__(self, total: int, what: str, first_rank: bool) -> None:
        self.total, self.what, self.first_rank, self.updates, self.closed = total, what, first_rank, [], 0

    def update(self, n: int) -> None:
        self.updates.append(n)

    def close(self) -> None:
        self.closed += 1


def test_one_process_saves_and_loads_without_dcps_warning_that_it_is_alone(tmp_path) -> None:
    """DCP warns at each call made without torch.distributed (and at each of a load's per-rank reads, ``no_dist``):
    the engine's default checkpoint would print it at every save. Only that warning is left out (a process of its
    own, with Python's default warning filters: a user's own warning still shows)."""
    script = f"""
import warnings
from tests.test_portable_checkpoint import _single, _train
from twinflow.checkpoint import portable, portable_load
model, opt = _single(0)
_train(model, opt, 1)
for tag, asynchronous in (("sync", False), ("async", portable.ASYNC_SAVE)):
    other, other_opt = _single(1)
    portable.save_portable({str(tmp_path)!r}, tag, model=model, optimizer=opt, asynchronous=asynchronous)
    portable.wait_pending()
    portable_load.load_portable({str(tmp_path)!r}, tag, model=other, optimizer=other_opt)
    assert all(a.equal(b) for a, b in zip(other.parameters(), model.parameters(), strict=True))
warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
print("done")
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-3000:]
    assert "torch.distributed is" not in run.stderr, run.stderr[-3000:]
    assert "a warning of the user's own" in run.stderr


def test_a_save_and_a_loads_checks_count_every_byte_they_write_and_read(tmp_path, monkeypatch, capsys) -> None:
    """The save's meter is given the bytes of every tensor DCP's index holds and is told each of them as it is
    written, then closed once; the load's check of the files is told every file's size. Past the size where it
    shows (made 0 here), a meter prints tenths and a total on the first rank's stderr; below it, nothing."""
    model, opt = _single(0)
    opt.state_precision = "int8_m24"
    _train(model, opt, 2)
    meters: list[_Meter] = []

    def recorded(total: int, what: str, first_rank: bool) -> _Meter:
        meters.append(_Meter(total, what, first_rank))
        return meters[-1]

    monkeypatch.setattr(portable_state, "shown", recorded)
    monkeypatch.setattr(portable_sums, "shown", recorded)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    metadata = portable.dcp.FileSystemReader(folder).read_metadata()
    tensors = sum(math.prod(m.size) * m.properties.dtype.itemsize
                  for m in metadata.state_dict_metadata.values() if hasattr(m, "size"))  # fmt: skip
    (save,) = meters
    assert save.what == "writing checkpoint 't'" and save.first_rank and save.closed == 1
    assert save.total == tensors == sum(save.updates) and len(save.updates) > 10
    other, other_opt = _single(1)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    check = meters[1]
    files = sorted(folder.glob("*.distcp"))
    assert check.what.startswith("checking ") and check.closed == 1 and check.first_rank
    assert check.total == sum(f.stat().st_size for f in files) == sum(check.updates)
    assert len(check.updates) == len(files)
    monkeypatch.undo()
    capsys.readouterr()
    portable.save_portable(tmp_path / "quiet", "t", model=model, optimizer=opt)
    assert "writing checkpoint" not in capsys.readouterr().err  # far below a GiB: nothing shown
    monkeypatch.setattr(progress, "SHOWN_FROM", 0)
    portable.save_portable(tmp_path / "shown", "t", model=model, optimizer=opt)
    err = capsys.readouterr().err
    assert "writing checkpoint 't': 50% (" in err and "writing checkpoint 't': 0.00 GB in" in err, err


def _state_reads(monkeypatch) -> list[int]:  # noqa: ANN001
    """The elements of optimizer state each of the load's reads asks for (filled as it reads), with batches of
    4 x 300 elements: the biases' batch, each 300 x 300 weight's state alone."""
    reads: list[int] = []
    read_data = portable_load.MappedReader.read_data

    def counted(self, plan, planner):  # noqa: ANN001, ANN202
        reads.append(sum(math.prod(item.lengths) for item in plan.items if item.dest_index.fqn.startswith("optim.")))
        return read_data(self, plan, planner)

    monkeypatch.setattr(portable_load.MappedReader, "read_data", counted)
    monkeypatch.setattr(portable_load, "CHUNK", 4 * 300)
    return reads


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_a_load_reads_the_state_a_batch_at_a_time_into_the_same_state(tmp_path, monkeypatch, precision: str) -> None:
    """A built TwinFlowAdam takes its state from the checkpoint CHUNK elements at a time: no read of the state
    asks for more than a batch (or one parameter's state, where that is larger), and the state that results is the
    one saved (bit for bit: the same blocks)."""
    model, opt = _single(0)
    opt.state_precision = precision
    _train(model, opt, 3)
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    other, other_opt = _single(1)
    other_opt.state_precision = precision
    _train(other, other_opt, 1)
    reads = _state_reads(monkeypatch)  # the biases' batch; each 300 x 300 weight alone
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    largest = 3 * 300 * 300  # a weight's two moments and master
    assert len([r for r in reads if r]) >= 3
    assert max(reads) <= largest
    saved, loaded = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(loaded[i][k], v) for i, entry in saved.items() for k, v in entry.items())
    assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))
    _train(model, opt)
    _train(other, other_opt)
    assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))


def test_a_pending_delayed_update_lands_before_the_save_and_the_resumed_run_goes_on_exactly(tmp_path) -> None:
    """With ``delay_after`` the CPU share's last update may still be pending at the save; the saved weights must
    hold it (as the per-rank save's do), or the resumed run is one update behind."""

    def make(seed: int) -> tuple[torch.nn.Module, TwinFlowAdam]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        return model, TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, delay_after=1)

    def train(model: torch.nn.Module, opt: TwinFlowAdam, xs: list[torch.Tensor]) -> list[float]:
        losses = []
        for x in xs:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    data = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(10)]
    model, opt = make(0)
    train(model, opt, data[:5])
    portable.save_portable(tmp_path, "t", model=model, optimizer=opt)
    straight = train(model, opt, data[5:])
    other, other_opt = make(1)
    portable_load.load_portable(tmp_path, "t", model=other, optimizer=other_opt)
    assert train(other, other_opt, data[5:]) == straight
    opt.synchronize()
    other_opt.synchronize()
    assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters(), strict=True))


def test_extra_or_meta_the_load_could_not_read_is_refused_before_anything_is_written(tmp_path) -> None:
    """twinflow.pt is read back with ``torch.load(weights_only=True)``: what it could not read is refused at the save
    (naming the entry), not written to fail at the load."""
    model, opt = _single(0)
    _train(model, opt, 1)
    portable.save_portable(tmp_path, "good", model=model, optimizer=opt, extra={"epoch": 1})

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"extra\['rng'\] \(a Opaque\) cannot be saved.*weights_only"):
        portable.save_portable(tmp_path, "bad", model=model, optimizer=opt, extra={"epoch": 2, "rng": Opaque()})
    with pytest.raises(TypeError, match=r"meta= \(a dict\) cannot be saved.*weights_only"):
        portable.save_portable(tmp_path, "bad", model=model, optimizer=opt, meta={"obj": Opaque()})
    for meta in ("a note", [1, 2], 3.5):  # read back fine, but a load takes a dict or None: refused at the save too
        with pytest.raises(TypeError, match=rf"meta= is a {type(meta).__name__}; expected a dict .*or None"):
            portable.save_portable(tmp_path, "bad", model=model, optimizer=opt, meta=meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "latest"]  # nothing of "bad" was written
    assert (tmp_path / "latest").read_text() == "good"


def test_an_optimizer_with_an_attribute_named_offload_of_its_own_saves(tmp_path) -> None:
    """Only TwinFlowAdam's offload (its host buffer) is read from; another optimizer's ``offload`` is not touched."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.offload = True  # a flag of the user's own
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    portable.save_portable(tmp_path, "t", model=model, optimizer=opt)
    other = torch.nn.Linear(8, 4)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    portable_load.load_portable(tmp_path, "t", model=other, optimizer=other_opt)
    assert other.weight.equal(model.weight)


def test_a_killed_save_leaves_the_previous_tag_and_the_next_save_cleans_up(tmp_path) -> None:
    model, opt = _single(0)
    _train(model, opt)
    portable.save_portable(tmp_path / "ckpt", "a", model=model, optimizer=opt)
    expected = [p.detach().clone() for p in model.parameters()]
    left = tmp_path / "ckpt" / f"b{portable.SAVING}"  # what a save of "b" killed halfway leaves
    left.mkdir()
    (left / "__0_0.distcp").write_bytes(b"half")
    other, other_opt = _single(1)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)  # latest: still "a"
    assert all(p.detach().equal(e) for p, e in zip(other.parameters(), expected))
    _train(model, opt, 1)
    portable.save_portable(tmp_path / "ckpt", "c", model=model, optimizer=opt)
    assert not left.exists() and (tmp_path / "ckpt" / "latest").read_text() == "c"
    # the resumed optimizer continues as the saved one: the same next step, bit for bit
    _train(other, other_opt, 1)
    assert all(p.detach().equal(q.detach()) for p, q in zip(other.parameters(), model.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_an_asynchronous_save_holds_the_state_of_when_it_began(tmp_path, precision: str) -> None:
    """Training goes on while the files are written: what is saved is the state when the save began (compact: its
    codes and scales), and the tag appears (with ``latest``) only once the save has finished."""
    model, opt = _single(0)
    reference, reference_opt = _single(0)
    other, other_opt = _single(1)
    for o in (opt, reference_opt, other_opt):
        o.state_precision = precision
    _train(model, opt)
    _train(reference, reference_opt)
    pending = portable.save_portable(tmp_path / "ckpt", "a", model=model, optimizer=opt, asynchronous=True)
    _train(model, opt, 2)  # while it is written: weights and state change in place
    assert not (tmp_path / "ckpt" / "a").exists() and not (tmp_path / "ckpt" / "latest").exists()
    folder = pending.wait()
    assert folder == tmp_path / "ckpt" / "a" and (tmp_path / "ckpt" / "latest").read_text() == "a"
    pieces = torch.distributed.checkpoint.FileSystemReader(folder).read_metadata().storage_data.values()
    assert len({piece.relative_path for piece in pieces}) == len(pieces) > 8  # a file a tensor: a load maps them
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert all(p.detach().equal(q.detach()) for p, q in zip(other.parameters(), reference.parameters()))
    _train(other, other_opt, 1)
    _train(reference, reference_opt, 1)
    assert all(p.detach().equal(q.detach()) for p, q in zip(other.parameters(), reference.parameters()))


# bf16 weights with int8_m24 set after construction: the loading optimizer's state is still float32 (the precision
# applies at its next step), so the load decodes; it rounded each weight again from its master, to the nearest even,
# where training rounds ties away from zero: 0.2% of the weights came back a bf16 step off. They are now the
# checkpoint's.
@pytest.mark.parametrize(
    "precision, dtype",
    [("fp32", torch.float32), ("int8_m24", torch.float32), ("fp32", torch.bfloat16), ("int8_m24", torch.bfloat16)],
    ids=["fp32", "int8_m24", "fp32-bf16-weights", "int8_m24-bf16-weights"],
)
def test_asynchronous_saves_one_after_another_copy_into_the_same_host_memory(tmp_path, precision: str,
                                                                              dtype: torch.dtype) -> None:  # fmt: skip
    """The second asynchronous save copies into the host copies the first kept, once the first is written: each
    tag holds the state of when its save began, bit for bit, and what is kept is the checkpoint's size once (bf16
    weights: with float32 masters, or 24-bit ones in int8_m24)."""
    model, opt = _single(0, dtype)
    reference, reference_opt = _single(0, dtype)
    for o in (opt, reference_opt):
        o.state_precision = precision
    _train(model, opt)
    _train(reference, reference_opt)
    at_first = [p.detach().clone() for p in model.parameters()]
    portable.release_kept_copies()  # what another test of this process left
    portable.save_portable(tmp_path / "ckpt", "a", model=model, optimizer=opt, asynchronous=True)
    kept = portable.kept_copy_bytes()
    assert portable.reused_copy_bytes() == 0
    _train(model, opt, 2)  # while "a" is written
    _train(reference, reference_opt, 2)
    pending = portable.save_portable(tmp_path / "ckpt", "b", model=model, optimizer=opt, asynchronous=True)
    assert portable.kept_copy_bytes() == kept == portable.reused_copy_bytes()  # the same copies, every one
    _train(model, opt, 2)  # while "b" is written, into what "a" was written from
    with pytest.raises(RuntimeError, match="wait_pending"):
        portable.release_kept_copies()  # "b" is still written from them
    pending.wait()
    files = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "b").iterdir() if f.suffix == ".distcp")
    assert 0.9 * files < kept <= files
    first, first_opt = _single(1, dtype)
    first_opt.state_precision = precision
    portable_load.load_portable(tmp_path / "ckpt", "a", model=first, optimizer=first_opt)
    assert all(p.detach().equal(e) for p, e in zip(first.parameters(), at_first))
    second, second_opt = _single(1, dtype)
    second_opt.state_precision = precision
    portable_load.load_portable(tmp_path / "ckpt", "b", model=second, optimizer=second_opt)
    assert all(p.detach().equal(q.detach()) for p, q in zip(second.parameters(), reference.parameters()))
    _train(second, second_opt, 1)
    _train(reference, reference_opt, 1)
    assert all(p.detach().equal(q.detach()) for p, q in zip(second.parameters(), reference.parameters()))
    portable.release_kept_copies()
    assert portable.kept_copy_bytes() == 0


def test_an_asynchronous_save_of_other_tensors_replaces_the_kept_copies(tmp_path) -> None:
    """A save of another model (other names, other shapes) frees the copies it has no use for and keeps its own."""
    model, opt = _single(0)
    _train(model, opt)
    portable.save_portable(tmp_path / "ckpt", "a", model=model, optimizer=opt, asynchronous=True).wait()
    torch.manual_seed(3)
    layers = {"a": torch.nn.Linear(300, 200), "b": torch.nn.Linear(200, 5)}
    other = torch.nn.Sequential(collections.OrderedDict(layers))  # other names: no key of the first save
    other_opt = TwinFlowAdam(other.parameters(), lr=1e-2, ratio=0.5)
    _train(other, other_opt)
    expected = [p.detach().clone() for p in other.parameters()]
    portable.save_portable(tmp_path / "other", "b", model=other, optimizer=other_opt, asynchronous=True).wait()
    assert portable.reused_copy_bytes() == 0
    # the second model's weights and two moments in float32, its steps: nothing of the first one's
    assert portable.kept_copy_bytes() == sum(3 * p.numel() * 4 + 4 for p in other.parameters())
    _train(other, other_opt, 1)
    again = torch.nn.Sequential(collections.OrderedDict(a=torch.nn.Linear(300, 200), b=torch.nn.Linear(200, 5)))
    portable_load.load_portable(tmp_path / "other", model=again, optimizer=TwinFlowAdam(again.parameters(), ratio=0.5))
    assert all(p.detach().equal(e) for p, e in zip(again.parameters(), expected))


def test_an_asynchronous_save_after_the_process_group_was_made_again(tmp_path) -> None:
    """A process group destroyed and made again (an elastic restart, a test fixture): the next asynchronous save
    writes through a background group of the new one, not the dead group of the first."""
    import torch.distributed as dist

    model, opt = _single(0)
    _train(model, opt)
    try:
        for attempt in range(2):
            store = dist.FileStore(str(tmp_path / f"store{attempt}"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            portable.save_portable(tmp_path / "ckpt", f"t{attempt}", model=model, optimizer=opt,
                                   asynchronous=True).wait()  # fmt: skip
            dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    for tag in ("t0", "t1"):
        other, other_opt = _single(1)
        portable_load.load_portable(tmp_path / "ckpt", tag, model=other, optimizer=other_opt)
        assert all(p.detach().equal(q.detach()) for p, q in zip(other.parameters(), model.parameters()))


def test_an_asynchronous_save_where_torch_cannot_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    model, opt = _single(0)
    _train(model, opt)
    monkeypatch.setattr(portable, "ASYNC_SAVE", False)  # as on torch < 2.9, whose async_save takes no stager
    with pytest.raises(RuntimeError, match=r"torch >= 2\.9 .*asynchronous=False"):
        portable.save_portable(tmp_path / "ckpt", "a", model=model, optimizer=opt, asynchronous=True)
    assert not (tmp_path / "ckpt").exists()
    portable.save_portable(tmp_path / "ckpt", "a", model=model, optimizer=opt)  # the synchronous save still works
    assert (tmp_path / "ckpt" / "latest").read_text() == "a"


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_a_synchronous_save_of_a_model_on_the_gpu_copies_its_weights_to_no_page_locked_memory(
    tmp_path, precision: str
) -> None:
    """DCP's writer copies a GPU tensor to the host with non_blocking=True, into new page-locked memory that the
    caching host allocator keeps: every weight went through it, 1.1 GiB a rank of OPT-13B's save stayed pinned."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048)).cuda()
    opt = TwinFlowAdam(model.parameters(), lr=1e-3, ratio=0.5, state_precision=precision)
    for _ in range(2):
        model(torch.randn(8, 2048, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    weights = [p.detach().cpu() for p in model.parameters()]
    torch.cuda.synchronize()
    handed_out = torch.cuda.host_memory_stats().get("active_bytes.allocated", 0)
    portable.save_portable(tmp_path, "t", model=model, optimizer=opt)
    pinned = torch.cuda.host_memory_stats().get("active_bytes.allocated", 0) - handed_out
    assert pinned < (1 << 20), f"{pinned} bytes of page-locked memory handed out during the save"
    for p in model.parameters():  # poisoned: the saved weights must come back from the files
        p.data.fill_(float("nan"))
    portable_load.load_portable(tmp_path, "t", model=model, optimizer=opt)
    assert all(p.detach().cpu().equal(w) for p, w in zip(model.parameters(), weights))


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_on_gpus_an_asynchronous_save_of_two_ranks_resumes_on_one(tmp_path, precision: str) -> None:
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", 2, 3, precision, 0.5, "--save", str(ckpt), "--asynchronous", "--warm-save",
                    backend="nccl")  # fmt: skip
    assert first["reused"] == first["kept"] > 0  # the second save copied into the first's CUDA-side copies
    again = _launch(tmp_path, "resumed1", 1, 3, precision, 0.5, "--load", str(ckpt), backend="nccl")
    assert again["after"] == pytest.approx(first["after"], rel=1e-4 if precision == "fp32" else 2e-2)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_on_gpus_a_checkpoint_of_four_ranks_resumes_on_two_and_on_one(tmp_path, precision: str) -> None:
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", 4, 3, precision, 0.5, "--save", str(ckpt), backend="nccl")
    tolerance = 1e-4 if precision == "fp32" else 2e-2
    for world in (2, 1):
        again = _launch(tmp_path, f"resumed{world}", world, 3, precision, 0.5, "--load", str(ckpt), backend="nccl")
        assert again["after"] == pytest.approx(first["after"], rel=tolerance)


def test_a_tag_saved_again_replaces_it_and_a_death_between_the_renames_keeps_it_loadable(tmp_path) -> None:
    model, opt = _single(0)
    _train(model, opt)
    portable.save_portable(tmp_path / "ckpt", "a", model=model, optimizer=opt, asynchronous=True)
    _train(model, opt, 1)
    portable.save_portable(tmp_path / "ckpt", "a", model=model, optimizer=opt)  # waits for the pending save first
    expected = [p.detach().clone() for p in model.parameters()]
    folder = tmp_path / "ckpt" / "a"
    folder.rename(folder.with_name("a" + portable.OLD))  # as a process killed between the two renames leaves it
    other, other_opt = _single(1)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert all(p.detach().equal(e) for p, e in zip(other.parameters(), expected))


def test_a_resume_in_another_precision(tmp_path) -> None:
    """Saved with 8-bit moments and 24-bit masters on two ranks, resumed with fp32 state on one: the decoded state
    goes on in float32, so the run agrees to the 8-bit rounding's noise."""
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "saved", 2, 3, "int8_m24", 0.5, "--save", str(ckpt))
    again = _launch(tmp_path, "resumed", 1, 0, "fp32", 0.5, "--load", str(ckpt))
    assert again["after"] == pytest.approx(first["after"], rel=2e-2)
    assert again["after"] != first["after"]  # not the same run: the precision changed


MEMORY_PRELUDE = r"""
import json, sys, torch
from pathlib import Path
from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_load

def size(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def built(seed):
    torch.manual_seed(seed)
    shapes = [(1024, 4096), (4096, 1024)] * 4
    model = torch.nn.Sequential(*(torch.nn.Linear(*s, bias=False) for s in shapes)).to(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.6, state_precision="int8_m24")
    model(torch.randn(2, 1024, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt
"""

SAVE_MEMORY = (
    MEMORY_PRELUDE
    + r"""
model, opt = built(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the current resident size
before = size("VmRSS")
portable.save_portable(Path(sys.argv[1]), "t", model=model, optimizer=opt)
print(json.dumps({"peak": size("VmHWM") - before, "kept": size("VmRSS") - before,
                  "elements": sum(p.numel() for p in model.parameters()), "largest": 1024 * 4096}))
"""
)


def _measured(script: str, ckpt: Path) -> dict:
    """`script`'s JSON, run in a fresh process whose allocator gives blocks of 64 KiB or more back to the system
    when they are freed (skipped where Linux's /proc/self/clear_refs cannot restart the peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(WORKER.parent.parent)}
    run = subprocess.run([sys.executable, "-c", script, str(ckpt)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_a_portable_save_of_compact_state_decodes_a_tensor_at_a_time_and_keeps_nothing(tmp_path) -> None:
    """The save reads each moment (its codes and scales) and master through the state owner as it is written, to a
    file of its own. It used to take them from state_dict(): the whole state decoded to float32 at once (12 bytes a
    parameter), which DCP's one file per rank held until the end and opt.state kept after the save, until it was
    next read.
    Resident memory measured in a fresh process whose allocator gives blocks of 64 KiB or more back to the system
    when they are freed."""
    result = _measured(SAVE_MEMORY, tmp_path / "ckpt")
    decoded = 12 * result["elements"]  # the state in float32: masters and both moments (403 MB)
    # one tensor in float32 as it is decoded and as it is written, and the decoding's fixed scratch
    bound = 3 * 4 * result["largest"] + 48 * compact.COPY_ELEMENTS + (16 << 20)
    assert bound < decoded // 3
    assert result["peak"] <= bound, result
    assert result["kept"] < 4 * result["largest"], result


def _saved_and_an_auto_ratio(tmp_path: Path) -> tuple[torch.nn.Module, TwinFlowAdam, torch.nn.Module, TwinFlowAdam]:
    """A model and optimizer trained 3 steps and saved as tag "t" in tmp_path/ckpt, and another model (other weights)
    with a TwinFlowAdam under ratio="auto", not built yet."""
    model, opt = _single(0)
    _train(model, opt, 3)
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.GELU(), torch.nn.Linear(300, 4))
    other_opt = TwinFlowAdam(other.parameters(), lr=1e-2, ratio="auto")
    return model, opt, other, other_opt


def test_under_an_auto_ratio_the_state_is_read_when_the_first_step_builds_it(tmp_path, monkeypatch) -> None:
    """ratio="auto" builds the state at the first step: the load checks everything and reads the weights then, and
    the state only when that step builds it, a batch at a time; the run goes on as the saved one."""
    model, opt, other, other_opt = _saved_and_an_auto_ratio(tmp_path)
    reads = _state_reads(monkeypatch)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert sum(reads) == 4  # the steps only (a number a parameter, checked first): no moment before the build
    reads.clear()
    assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))
    _train(model, opt)
    _train(other, other_opt)
    assert len([r for r in reads if r]) >= 3 and max(reads) <= 3 * 300 * 300
    for a, b in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert other_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"] == 5


LOAD_MEMORY = (
    MEMORY_PRELUDE
    + r"""
model, opt = built(0)
portable.save_portable(Path(sys.argv[1]), "t", model=model, optimizer=opt)
saved = opt.state_dict()["state"]
model, opt = built(1)
portable_load.CHUNK = 1 << 22  # a batch: one weight's state
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the current resident size
before = size("VmRSS")
portable_load.load_portable(Path(sys.argv[1]), model=model, optimizer=opt)
peak = size("VmHWM") - before
same = all(torch.equal(opt.state_dict()["state"][i][k], v) for i, e in saved.items() for k, v in e.items())
print(json.dumps({"peak": peak, "same": same, "elements": sum(p.numel() for p in model.parameters()),
                  "largest": 1024 * 4096}))
"""
)


def test_a_load_of_compact_state_holds_one_batch_in_float32_not_the_state(tmp_path) -> None:
    """The load used to read the rank's whole state in float32 (12 bytes a parameter), DCP's buffers of the
    weights and a copy of them to put back (17-18 bytes a parameter in all, measured). A built TwinFlowAdam now
    takes it a batch at a time: the peak follows one batch (here one weight's state), not the model. Resident
    memory in a fresh process, as for the save."""
    result = _measured(LOAD_MEMORY, tmp_path / "ckpt")
    assert result["same"]
    decoded = 12 * result["elements"]  # the state in float32: masters and both moments (403 MB)
    # a weight's state in float32, its file mapped as it is copied, the encoding's fixed scratch
    bound = 3 * 4 * result["largest"] + 4 * result["largest"] + 48 * compact.COPY_ELEMENTS + (16 << 20)
    assert bound < decoded // 2
    assert result["peak"] <= bound, result


def test_an_edit_to_a_copy_opt_state_handed_out_is_saved() -> None:
    """Compact state is handed out by opt.state as float32 copies; an in-place write to one reaches the state
    before a portable save reads it, as before state_dict()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.GELU(), torch.nn.Linear(300, 4))
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, state_precision="int8_m24")
    _train(model, opt)
    first = model[0].weight
    opt.state[first]["exp_avg"].zero_()
    with tempfile.TemporaryDirectory() as tmp:
        portable.save_portable(Path(tmp), "t", model=model, optimizer=opt)
        other, other_opt = _single(1)
        other_opt.state_precision = "int8_m24"
        portable_load.load_portable(Path(tmp), model=other, optimizer=other_opt)
    loaded = other_opt.state_dict()["state"]
    assert loaded[0]["exp_avg"].abs().max() == 0
    assert loaded[2]["exp_avg"].abs().max() > 0  # the others kept theirs


def test_a_tensor_of_the_users_own_beside_a_parameters_state_is_saved_and_comes_back(tmp_path) -> None:
    """opt.state[p]["ema"] = ... (the user guide's example) travels with the state, as state_dict() carries it."""
    model, opt = _single(0)
    _train(model, opt)
    weight = model[0].weight
    ema = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
    opt.state[weight]["ema"] = ema.clone()
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    other, other_opt = _single(1)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert torch.equal(other_opt.state[other[0].weight]["ema"], ema)
    assert "ema" not in other_opt.state[other[2].weight]


@pytest.mark.parametrize("how", ["load_portable", "load_state_dict"])
def test_a_copy_made_before_an_auto_ratio_builds_keeps_the_loaded_state(tmp_path, how: str) -> None:
    """A load under ratio="auto" waits for the first step's build; a deepcopy of the model and optimizer made
    meanwhile (a framework's EMA or evaluation copy) holds the loaded state too, and steps as the saved run."""
    model, opt, other, other_opt = _saved_and_an_auto_ratio(tmp_path)
    if how == "load_portable":
        portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    else:
        other.load_state_dict(model.state_dict())
        # a state dict of its own (as torch.load gives one): a live optimizer's state_dict() hands out its device
        # share's tensors themselves, as torch.optim's do, and the pending state would follow them as it trains
        saved = copy.deepcopy(opt.state_dict())
        saved["state"][0]["note"] = "a key of the user's own, not a tensor"  # torch keeps it; the copy too
        other_opt.load_state_dict(saved)
    twin = copy.deepcopy({"model": other, "opt": other_opt})
    _train(model, opt)
    for m, o in ((other, other_opt), (twin["model"], twin["opt"])):
        _train(m, o)
        for a, b in zip(model.parameters(), m.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert o.state_dict()["state"][0]["step"] == 5


@pytest.mark.parametrize("key", ["exp_avg.codes", "master.hi", "step.note"])
def test_a_key_of_the_users_own_that_a_load_would_read_as_state_is_refused_by_name(tmp_path, key: str) -> None:
    """A key of the user's own in opt.state is saved beside the state; one named as the format's parts are
    (``exp_avg.codes``, ``master.hi``) would be read back as state: the save refuses it, naming it, and no tag
    appears."""
    model, opt = _single(0)
    _train(model, opt)
    first = next(iter(model.parameters()))
    opt.state[first][key] = torch.ones_like(first)
    with pytest.raises(ValueError, match=f"has the key '{key}'.*rename it"):
        portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
    opt.state[first]["my_note"] = torch.full_like(first, 3.0)
    opt.state[first]["master.comment"] = "not a tensor: not saved, so not refused"
    del opt.state[first][key]
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)  # any other key of its own is saved
    other, other_opt = _single(1)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert other_opt.state[next(iter(other.parameters()))]["my_note"].equal(torch.full_like(first, 3.0))


def test_another_optimizers_key_named_as_the_formats_parts_is_refused_too(tmp_path) -> None:
    """The same refusal for an optimizer other than TwinFlowAdam (its state saved from its state_dict)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.state[model.weight]["exp_avg.mine"] = torch.zeros_like(model.weight)
    with pytest.raises(ValueError, match="weight has the key 'exp_avg.mine'"):
        portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    assert not (tmp_path / "ckpt").exists()
