"""A per-rank checkpoint rewritten in the portable format (twinflow.checkpoint.to_portable, ``python -m
twinflow.convert CKPT TAG --to-portable OUT``): it resumes the run that saved it exactly on as many processes, and
on another number of processes as a portable save does; a conversion that fails leaves nothing behind. The per-rank
checkpoints are the ones 9bd2b3e wrote (tests/per_rank_fixture.py), with the state they saved and the losses of the
run continued after the save."""

from __future__ import annotations

import collections
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.checkpoint_fixture import BEFORE, PRECISIONS, batches, train
from tests.per_rank_fixture import (
    BF16,
    NAME,
    TWO_RANKS,
    Spare,
    batchnorm_net,
    chunked_net,
    chunked_optimizer,
    engine,
    schedule,
    sgd,
    sgd_net,
    state,
    two_ranks,
)
from tests.per_rank_fixture import train_bf16 as _train_bf16
from tests.test_checkpoint_compat import FIXTURES
from tests.test_portable_checkpoint import _launch
from twinflow.checkpoint import CheckpointError, compact_checkpoint, load_portable, portable, rank_shard, to_portable
from twinflow.checkpoint.convert_cli import main as convert_main

WRITTEN = Path(__file__).with_name("data") / NAME


@pytest.fixture
def fixture(tmp_path: Path) -> Callable[[str], Path]:
    """``fixture(name)``: a copy of the written fixture `name` in tmp_path (a conversion or load may write beside
    the source; the fixture stays as written)."""

    def copy(name: str) -> Path:
        return Path(shutil.copytree(WRITTEN / name, tmp_path / name))

    return copy


def _record(folder: Path) -> dict:
    return json.loads((folder / "record.json").read_text())


def _saved(folder: Path) -> dict:
    """The state the run had when it saved, as ``state`` copied it."""
    return torch.load(folder / "state.pt", weights_only=True)


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def _same(a: dict, b: dict) -> bool:
    equal = [torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items() if k in b]
    return a.keys() == b.keys() and all(equal)


def _computes_as_written(written: Path, made, train_fn=train) -> bool:  # noqa: ANN001
    """Whether `made` (the fixture's engine, as made before its run), trained here as the fixture's run was before
    its save, comes to the saved state bit for bit: this machine then sums and rounds as the one that wrote it."""
    train_fn(made, batches()[:BEFORE])
    return _same(state(made), _saved(written))


def _goes_on_as_recorded(losses: list[float], recorded: list[float], exact: bool) -> None:
    """Bit for bit where this machine computes as the one that wrote the fixture; elsewhere (another kernel path or
    BLAS: CI runs the lower kernel paths, torch's capped to theirs) the same state goes on through other sums and
    roundings: 1e-4 (a state loaded wrongly is off by a percent; the state itself is compared bit for bit)."""
    if exact:
        assert losses == recorded
    else:
        assert losses == pytest.approx(recorded, rel=1e-4, abs=0)


def _resumed_as_saved(resumed, written: Path) -> None:  # noqa: ANN001
    """The state and weights, step count, hyper-parameters and scheduler of the save, bit for bit."""
    record = _record(written)
    assert resumed.global_steps == record["global_steps"] and schedule(resumed) == record["schedule"]
    _equal(state(resumed), _saved(written))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_converted_checkpoint_resumes_the_run_that_saved_it_exactly(fixture, monkeypatch, precision: str) -> None:
    """One process: the converted checkpoint loads the state and weights of the save bit for bit (compact state:
    decoded, then encoded again on the same blocks), and the resumed run goes on as the saving run did. Each tensor
    is written in pieces of a few rows (CHUNK made small), as a model too large for memory is."""
    monkeypatch.setattr(to_portable, "CHUNK", 100)
    written = fixture(precision)
    record, out = _record(written), written.parent / "out"
    assert convert_main([str(written / "ckpt"), "a", "--to-portable", str(out)]) == 0
    folder = out / "a"
    assert portable.holds(out, None) and (out / "latest").read_text() == "a"
    pieces = dcp_pieces(folder)
    assert max(pieces.values()) > 1  # the 48 x 24 weights' state went in pieces of rows
    keys = torch.load(folder / "twinflow.pt", weights_only=True)["state_keys"]
    assert all(("exp_avg.codes" in k) == (precision != "fp32") for k in keys.values())  # compact: as kept
    resumed = engine(precision, seed=3)
    path, _ = resumed.load_checkpoint(out)
    assert path == folder
    _resumed_as_saved(resumed, written)
    exact = _computes_as_written(written, engine(precision, seed=0))
    _goes_on_as_recorded(train(resumed, batches()[BEFORE:]), record["continued"], exact)


def test_24_bit_masters_go_as_kept_and_come_back_bit_for_bit(fixture) -> None:
    """bf16 weights with int8_m24 state: each master is written as its two parts (5 bytes a parameter with the
    codes, as a portable save writes it), and the resumed run goes on exactly."""
    written = fixture(BF16)
    out = written.parent / "out"
    to_portable.to_portable(written / "ckpt", "a", out)
    keys = torch.load(out / "a" / "twinflow.pt", weights_only=True)["state_keys"]
    assert all({"master.hi", "master.lo", "exp_avg.codes", "exp_avg_sq.scales"} <= set(k) for k in keys.values())
    resumed = engine("int8_m24", seed=3, bf16=True)
    resumed.load_checkpoint(out)
    _resumed_as_saved(resumed, written)
    exact = _computes_as_written(written, engine("int8_m24", seed=0, bf16=True), _train_bf16)
    _goes_on_as_recorded(_train_bf16(resumed, batches()[BEFORE:]), _record(written)["continued"], exact)


def test_the_converted_checkpoint_converts_to_the_same_adamw_state_and_hub_weights(fixture) -> None:
    """Its AdamW state dict and safetensors (the portable converters) hold what the per-rank converters gave the
    source when it was written: the same float32 moments, 24-bit masters decoded exactly, the same weights."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    written = fixture(BF16)
    out = written.parent / "out"
    to_portable.to_portable(written / "ckpt", "a", out)
    args = [str(out), "a", str(out.parent / "portable.pt"), "--safetensors", str(out.parent / "portable")]
    assert convert_main(args) == 0
    direct = torch.load(written / "adamw.pt", weights_only=True)
    converted = torch.load(out.parent / "portable.pt", weights_only=True)
    assert direct["param_groups"] == converted["param_groups"] and direct["state"].keys() == converted["state"].keys()
    for i, entry in direct["state"].items():
        assert entry.keys() == converted["state"][i].keys() and "master" in entry
        assert all(torch.equal(v, converted["state"][i][k]) for k, v in entry.items()), i
    paths = (written / "hub" / "model.safetensors", out.parent / "portable" / "model.safetensors")
    weights = [safetensors_torch.load_file(path) for path in paths]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(v, weights[1][k]) for k, v in weights[0].items())


def _dcp_values(folder: Path, tmp_path: Path) -> dict:
    """Every value DCP holds of portable checkpoint `folder` (its tensors and the rest), read whole, by flattened
    key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / f"{folder.parent.name}_{folder.name}_whole.pt"
    dcp_to_torch_save(folder, whole)
    flat: dict = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    walk("", torch.load(whole, weights_only=True))
    return flat


def _near(a: dict, b: dict, rel: float) -> None:
    """The same keys; each float tensor within `rel` of the largest magnitude of b's, each byte tensor (compact
    codes and scales) within one code, each other value equal."""
    assert a.keys() == b.keys()
    for key, value in a.items():
        if not isinstance(value, torch.Tensor):
            assert value == b[key], key
        elif value.dtype == torch.uint8:
            assert (value.int() - b[key].int()).abs().max() <= 1, key
        else:
            gap, scale = (value.double() - b[key].double()).abs().max(), b[key].double().abs().max()
            assert gap <= rel * scale, (key, float(gap), float(scale))


def dcp_pieces(folder: Path) -> dict[str, int]:
    """How many pieces DCP's metadata in `folder` holds of each tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata()
    return {fqn: len(md.chunks) for fqn, md in metadata.state_dict_metadata.items() if hasattr(md, "chunks")}


@pytest.mark.parametrize("stage, precision", TWO_RANKS)
def test_a_converted_checkpoint_of_two_ranks_resumes_on_two_exactly_and_on_one(fixture, monkeypatch, stage: int,
                                                                              precision: str) -> None:  # fmt: skip
    """FSDP2 (stage 3: each rank's shard holds its rows), ZeRO-1 (each rank the state of its parameters), DDP:
    merged by the shards' layout. On two ranks the run continues bit for bit; on one as a portable save's does."""
    written = fixture(two_ranks(stage, precision))
    tmp_path, first = written.parent, _record(written)
    ckpt, out = written / "ckpt", tmp_path / "out"
    assert (ckpt / "moved" / "rank1.pt").is_file()
    kept, close = [], rank_shard.RankShard.close

    def closing(self) -> None:  # noqa: ANN001
        kept.append(len(self.kept_scales))
        close(self)

    monkeypatch.setattr(rank_shard.RankShard, "close", closing)
    assert convert_main([str(ckpt), "moved", "--to-portable", str(out)]) == 0
    assert kept == [0, 0]  # no block scales kept past their parameter, decoded or as kept
    keys = torch.load(out / "moved" / "twinflow.pt", weights_only=True)["state_keys"]
    # compact moments go as kept where every rank's piece starts on a block: whole parameters (DDP, ZeRO-1), not
    # FSDP2's rows of this 48-wide model (rank 1's start 1152 elements in, half a block)
    assert any("exp_avg.codes" in k for k in keys.values()) == (precision == "int8_m24" and stage != 3)
    again = _launch(tmp_path, "two", 2, stage, precision, 0.5, "--load", str(out))
    assert again["global_steps"] == len(first["before"])
    # bit for bit where this machine trains as the one that wrote the fixture did: its own run gives every recorded
    # loss and saves the state converted, bit for bit (equal losses before the save alone are no test of that: on
    # an AMD EPYC's BLAS they were equal with state 1e-7 apart). Else near this machine's own state (a state
    # converted wrongly is off by far more than the sums' order gives), and the losses within 1e-4.
    here = _launch(tmp_path, "here", 2, stage, precision, 0.5, "--save", str(tmp_path / "here_ckpt"))
    converted, own = (_dcp_values(folder / "moved", tmp_path) for folder in (out, tmp_path / "here_ckpt"))
    _near(converted, own, 1e-4 if precision == "fp32" else 2e-2)  # whatever the machine: this machine's own state
    if here["before"] + here["after"] == first["before"] + first["after"] and _same(converted, own):
        assert again["after"] == first["after"]
    else:
        _goes_on_as_recorded(again["after"], first["after"], exact=False)
    alone = _launch(tmp_path, "one", 1, stage, precision, 0.5, "--load", str(out))
    assert alone["after"] == pytest.approx(first["after"], rel=1e-4 if precision == "fp32" else 2e-2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_old_per_rank_checkpoint_converted_resumes_the_run_that_wrote_it(tmp_path, precision: str) -> None:
    """The per-rank checkpoint 1111190 wrote (before the shards recorded their layout) converts, and resumes."""
    written = FIXTURES["per-rank"]
    continued = json.loads((written / "continued.json").read_text())["continued"][precision]
    folder = tmp_path / "old"
    shutil.copytree(written / precision, folder)
    to_portable.to_portable(folder, "latest", tmp_path / "out", "converted")
    resumed = engine(precision, seed=1)
    path, _ = resumed.load_checkpoint(tmp_path / "out")
    assert path.name == "converted" and (path / ".metadata").is_file() and resumed.global_steps == BEFORE // 2
    assert train(resumed, batches()[BEFORE:]) == pytest.approx(continued, rel=1e-4, abs=0)


def test_each_record_is_read_once_for_all_its_keys_and_no_scales_stay_kept(fixture, monkeypatch) -> None:
    """A parameter's keys are written a piece of rows after another, its scales last: each compact record is read
    from the shard once (not once a key), keeping no more than the two records a piece lies in, and the scales
    kept from the records are let go as each parameter is written (nothing grows with the model)."""
    written = fixture("chunked")  # TwinFlowAdam's int8_m24 state in records of 256 bytes
    monkeypatch.setattr(to_portable, "CHUNK", 100)  # pieces of two rows, smaller than a record
    monkeypatch.setattr(rank_shard, "CACHE_BYTES", 0)  # only the two records a piece lies in kept
    reads, kept = collections.Counter(), []
    frame, close = compact_checkpoint.CompactShard.frame, rank_shard.RankShard.close

    def counted(self, n: int):  # noqa: ANN001, ANN202
        reads[n] += 1
        return frame(self, n)

    def closing(self) -> None:  # noqa: ANN001
        kept.append(len(self.kept_scales))
        close(self)

    monkeypatch.setattr(compact_checkpoint.CompactShard, "frame", counted)
    monkeypatch.setattr(rank_shard.RankShard, "close", closing)
    to_portable.to_portable(written / "ckpt", "a", written.parent / "out")
    assert len(reads) > 12 and max(reads.values()) == 1 and kept == [0]  # 2304 + 1152 elements: 14 state records
    resumed = chunked_net()
    again = chunked_optimizer(resumed)
    load_portable(written.parent / "out", model=resumed, optimizer=again)
    saved = torch.load(written / "optimizer.pt", weights_only=True)["state"]
    assert saved.keys() == again.state_dict()["state"].keys()
    for entry, loaded in zip(saved.values(), again.state_dict()["state"].values(), strict=True):
        assert entry.keys() == loaded.keys() and all(torch.equal(entry[k], loaded[k]) for k in entry)


def test_a_conversion_that_fails_leaves_the_output_as_it_was(fixture, monkeypatch) -> None:
    written = fixture("int8_m24")
    ckpt, out = written / "ckpt", written.parent / "out"
    to_portable.to_portable(ckpt, "a", out, "before")

    def broken(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(to_portable, "write_sums", broken)  # the files and DCP's metadata written, the sums not
    with pytest.raises(OSError, match="disk full"):
        to_portable.to_portable(ckpt, "a", out, "after")
    assert sorted(p.name for p in out.iterdir()) == ["before", "latest"]
    assert (out / "latest").read_text() == "before"
    with pytest.raises(OSError, match="disk full"):  # into folders it makes: they go again
        to_portable.to_portable(ckpt, "a", written.parent / "new" / "deeper")
    assert not (written.parent / "new").exists()


def test_an_output_that_would_replace_its_source_or_an_odd_tag_is_refused_and_nothing_changes(fixture) -> None:
    """Putting the converted tag in place renames what is there and removes it: an OUT_DIR and tag that are the
    source's folder, or hold it (``runs/exp1`` for a source in ``runs/exp1/step2``), are refused, as are tags that
    are not plain names; a failed conversion removes the folders it made."""
    runs = fixture("runs")  # runs/exp1 with tags step1 and step2
    tmp_path = runs.parent
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert {"runs/exp1/step1/rank0.pt", "runs/exp1/step2/rank0.pt"} <= set(before)
    cases = [(runs, "exp1"), (runs / "exp1", "step2"), (runs / "exp1" / "step2", "x")]
    cases += [(runs / "new" / "deeper", tag) for tag in ("latest", "../escaped", ".hidden")]
    for out_dir, out_tag in cases:
        with pytest.raises(CheckpointError, match="source|plain folder name"):
            to_portable.to_portable(runs / "exp1", "step2", out_dir, out_tag)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_state_without_a_step_and_parameters_without_state_come_through(fixture) -> None:
    """SGD's momentum (no step) is converted as saved; a parameter that never had a gradient (no state) loads
    afresh from the converted checkpoint (of SGD, and of the engine), and the run goes on as it did."""
    written = fixture("sgd")  # the second layer never got a gradient
    to_portable.to_portable(written / "ckpt", "a", written.parent / "out")
    keys = torch.load(written.parent / "out" / "a" / "twinflow.pt", weights_only=True)["state_keys"]
    assert keys == {"0.weight": ["momentum_buffer"], "0.bias": ["momentum_buffer"], "1.weight": [], "1.bias": []}
    again = sgd_net()
    optimizer = sgd(again)
    load_portable(written.parent / "out", model=again, optimizer=optimizer)
    saved, loaded = torch.load(written / "optimizer.pt", weights_only=True)["state"], optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() == {0, 1}
    assert all(torch.equal(saved[i]["momentum_buffer"], loaded[i]["momentum_buffer"]) for i in saved)
    written = fixture("spare")  # the engine of a model with a layer the forward never uses, tag per_rank
    to_portable.to_portable(written / "ckpt", "per_rank", written / "ckpt", "converted")
    resumed = engine("int8_m24", seed=3, module=Spare(3))
    path, _ = resumed.load_checkpoint(written / "ckpt", "converted")
    assert path.name == "converted"
    _resumed_as_saved(resumed, written)
    exact = _computes_as_written(written, engine("int8_m24", seed=0, module=Spare(0)))
    _goes_on_as_recorded(train(resumed, batches()[BEFORE:]), _record(written)["continued"], exact)


def test_a_layoutless_checkpoint_whose_tensors_do_not_pair_one_to_one_is_refused(fixture) -> None:
    """A checkpoint saved before the shards recorded their layout names its state by pairing the model's tensors
    with the parameters by shape: where a buffer has a parameter's shape (BatchNorm's running mean beside a bias),
    that pairing is a guess, and the conversion refuses rather than misname the state."""
    written = fixture("batchnorm")  # AdamW on Linear, BatchNorm1d, Linear; its shard's layout taken out
    assert "layout" not in torch.load(written / "ckpt" / "a" / "rank0.pt", weights_only=True)
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in batchnorm_net().modules())
    with pytest.raises(CheckpointError, match=r"shape \[8\] do not pair .* save it again"):
        to_portable.to_portable(written / "ckpt", "a", written.parent / "out")
    assert not (written.parent / "out").exists()


def test_a_damaged_shard_is_refused_naming_it_and_nothing_is_written(fixture) -> None:
    written = fixture("int8_m24")
    ckpt, out = written / "ckpt", written.parent / "out"
    shard = ckpt / "a" / "rank0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank0.pt"):
        to_portable.to_portable(ckpt, "a", out)
    assert not out.exists()


def test_the_cli_refuses_a_portable_source_and_an_output_over_its_source(fixture, capsys) -> None:
    written = fixture("int8_m24")
    ckpt = written / "ckpt"
    assert convert_main([str(ckpt), "a", "--to-portable", str(ckpt)]) == 1
    assert "its source" in capsys.readouterr().err
    assert (ckpt / "a" / "rank0.pt").is_file() and not list(ckpt.glob("*.saving"))
    assert convert_main([str(ckpt), "a", "--to-portable", str(ckpt), "--out-tag", "b"]) == 0
    assert (ckpt / "latest").read_text() == "b"
    assert convert_main([str(ckpt), "b", "--to-portable", str(written.parent / "again")]) == 1
    assert "already portable" in capsys.readouterr().err
