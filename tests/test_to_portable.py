"""A per-rank checkpoint rewritten in the portable format (twinflow.checkpoint.to_portable, ``python -m
twinflow.convert CKPT TAG --to-portable OUT``): it resumes the run that saved it exactly on as many processes, and
on another number of processes as a portable save does; a conversion that fails leaves nothing behind."""

from __future__ import annotations

import collections
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

import twinflow
from tests.checkpoint_fixture import BEFORE, PRECISIONS, batches, config, model, strip_layout, train
from tests.test_checkpoint_compat import FIXTURES
from tests.test_portable_checkpoint import _launch
from twinflow import TwinFlowAdam
from twinflow.checkpoint import (
    CheckpointError,
    compact_checkpoint,
    load_portable,
    portable,
    rank_shard,
    save_checkpoint,
    to_portable,
)
from twinflow.checkpoint.convert_cli import main as convert_main


def _engine(precision: str, seed: int):  # noqa: ANN202 (the engine)
    engine, *_ = twinflow.initialize(model=model(seed=seed), config=config(precision))
    return engine


def _state(engine) -> dict:  # noqa: ANN001
    """The optimizer's state and the model's weights, copied."""
    sd = engine.local_optimizer.state_dict()
    state = {(i, k): v.clone() if isinstance(v, torch.Tensor) else v
             for i, e in sd["state"].items() for k, v in e.items()}  # fmt: skip
    return state | {k: v.clone() for k, v in engine.module.state_dict().items()}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_converted_checkpoint_resumes_the_run_that_saved_it_exactly(tmp_path, monkeypatch, precision: str) -> None:
    """One process: the converted checkpoint loads the state and weights of the save bit for bit (compact state:
    decoded, then encoded again on the same blocks), and the resumed run goes on as the saving run did. Each tensor
    is written in pieces of a few rows (CHUNK made small), as a model too large for memory is."""
    monkeypatch.setattr(to_portable, "CHUNK", 100)
    data = batches()
    engine = _engine(precision, seed=0)
    train(engine, data[:BEFORE])
    engine.save_checkpoint(tmp_path / "ckpt", "a", portable=False)
    saved = _state(engine)
    continued = train(engine, data[BEFORE:])
    assert convert_main([str(tmp_path / "ckpt"), "a", "--to-portable", str(tmp_path / "out")]) == 0
    folder = tmp_path / "out" / "a"
    assert portable.holds(tmp_path / "out", None) and (tmp_path / "out" / "latest").read_text() == "a"
    pieces = dcp_pieces(folder)
    assert max(pieces.values()) > 1  # the 48 x 24 weights' state went in pieces of rows
    keys = torch.load(folder / "twinflow.pt", weights_only=True)["state_keys"]
    assert all(("exp_avg.codes" in k) == (precision != "fp32") for k in keys.values())  # compact: as kept
    resumed = _engine(precision, seed=3)
    path, _ = resumed.load_checkpoint(tmp_path / "out")
    assert path == folder and resumed.global_steps == engine.global_steps - len(data[BEFORE:]) // 2
    _equal(_state(resumed), saved)
    assert train(resumed, data[BEFORE:]) == continued


def _train_bf16(engine, data: list) -> list[float]:  # noqa: ANN001
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_24_bit_masters_go_as_kept_and_come_back_bit_for_bit(tmp_path) -> None:
    """bf16 weights with int8_m24 state: each master is written as its two parts (5 bytes a parameter with the
    codes, as a portable save writes it), and the resumed run goes on exactly."""
    data, train = batches(), _train_bf16
    settings = config("int8_m24") | {"bf16": {"enabled": True}}
    engine, *_ = twinflow.initialize(model=model(seed=0), config=settings)
    train(engine, data[:BEFORE])
    engine.save_checkpoint(tmp_path / "ckpt", "a", portable=False)
    saved = _state(engine)
    continued = train(engine, data[BEFORE:])
    to_portable.to_portable(tmp_path / "ckpt", "a", tmp_path / "out")
    keys = torch.load(tmp_path / "out" / "a" / "twinflow.pt", weights_only=True)["state_keys"]
    assert all({"master.hi", "master.lo", "exp_avg.codes", "exp_avg_sq.scales"} <= set(k) for k in keys.values())
    resumed, *_ = twinflow.initialize(model=model(seed=3), config=settings)
    resumed.load_checkpoint(tmp_path / "out")
    _equal(_state(resumed), saved)
    assert train(resumed, data[BEFORE:]) == continued


def test_the_converted_checkpoint_converts_to_the_same_adamw_state_and_hub_weights(tmp_path) -> None:
    """Its AdamW state dict and safetensors (the portable converters) hold what the per-rank converters give the
    source: the same float32 moments, 24-bit masters decoded exactly, the same weights."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    settings = config("int8_m24") | {"bf16": {"enabled": True}}
    engine, *_ = twinflow.initialize(model=model(seed=0), config=settings)
    _train_bf16(engine, batches()[:BEFORE])
    engine.save_checkpoint(tmp_path / "ckpt", "a", portable=False)
    to_portable.to_portable(tmp_path / "ckpt", "a", tmp_path / "out")
    for directory, name in ((tmp_path / "ckpt", "per_rank"), (tmp_path / "out", "portable")):
        args = [str(directory), "a", str(tmp_path / f"{name}.pt"), "--safetensors", str(tmp_path / name)]
        assert convert_main(args) == 0
    direct, converted = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("per_rank", "portable"))
    assert direct["param_groups"] == converted["param_groups"] and direct["state"].keys() == converted["state"].keys()
    for i, entry in direct["state"].items():
        assert entry.keys() == converted["state"][i].keys() and "master" in entry
        assert all(torch.equal(v, converted["state"][i][k]) for k, v in entry.items()), i
    weights = [safetensors_torch.load_file(tmp_path / n / "model.safetensors") for n in ("per_rank", "portable")]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(v, weights[1][k]) for k, v in weights[0].items())


def dcp_pieces(folder: Path) -> dict[str, int]:
    """How many pieces DCP's metadata in `folder` holds of each tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata()
    return {fqn: len(md.chunks) for fqn, md in metadata.state_dict_metadata.items() if hasattr(md, "chunks")}


@pytest.mark.parametrize("stage, precision", [(3, "fp32"), (3, "int8_m24"), (1, "fp32"), (0, "int8_m24")])
def test_a_converted_checkpoint_of_two_ranks_resumes_on_two_exactly_and_on_one(tmp_path, monkeypatch, stage: int,
                                                                              precision: str) -> None:  # fmt: skip
    """FSDP2 (stage 3: each rank's shard holds its rows), ZeRO-1 (each rank the state of its parameters), DDP:
    merged by the shards' layout. On two ranks the run continues bit for bit; on one as a portable save's does."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    first = _launch(tmp_path, "saved", 2, stage, precision, 0.5, "--save", str(ckpt), "--per-rank")
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
    assert again["after"] == first["after"]
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
    engine = _engine(precision, seed=1)
    path, _ = engine.load_checkpoint(tmp_path / "out")
    assert path.name == "converted" and (path / ".metadata").is_file() and engine.global_steps == BEFORE // 2
    assert train(engine, batches()[BEFORE:]) == pytest.approx(continued, rel=1e-4, abs=0)


def _saved(tmp_path: Path) -> Path:
    engine = _engine("int8_m24", seed=0)
    train(engine, batches()[:BEFORE])
    engine.save_checkpoint(tmp_path / "ckpt", "a", portable=False)
    return tmp_path / "ckpt"


def test_each_record_is_read_once_for_all_its_keys_and_no_scales_stay_kept(tmp_path, monkeypatch) -> None:
    """A parameter's keys are written a piece of rows after another, its scales last: each compact record is read
    from the shard once (not once a key), keeping no more than the two records a piece lies in, and the scales
    kept from the records are let go as each parameter is written (nothing grows with the model)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.GELU(), torch.nn.Linear(48, 24))
    opt = TwinFlowAdam(net.parameters(), ratio=0.5, state_precision="int8_m24", chunk_bytes=256)  # records of 256
    for _ in range(2):
        net(torch.randn(4, 48)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(tmp_path / "ckpt", "a", model=net, optimizer=opt)
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
    to_portable.to_portable(tmp_path / "ckpt", "a", tmp_path / "out")
    assert len(reads) > 12 and max(reads.values()) == 1 and kept == [0]  # 2304 + 1152 elements: 14 state records
    resumed = copy.deepcopy(net)
    again = TwinFlowAdam(resumed.parameters(), ratio=0.5, state_precision="int8_m24", chunk_bytes=256)
    load_portable(tmp_path / "out", model=resumed, optimizer=again)
    for saved, loaded in zip(opt.state_dict()["state"].values(), again.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_a_conversion_that_fails_leaves_the_output_as_it_was(tmp_path, monkeypatch) -> None:
    ckpt, out = _saved(tmp_path), tmp_path / "out"
    to_portable.to_portable(ckpt, "a", out, "before")

    def broken(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(to_portable, "write_sums", broken)  # the files and DCP's metadata written, the sums not
    with pytest.raises(OSError, match="disk full"):
        to_portable.to_portable(ckpt, "a", out, "after")
    assert sorted(p.name for p in out.iterdir()) == ["before", "latest"]
    assert (out / "latest").read_text() == "before"
    with pytest.raises(OSError, match="disk full"):  # into folders it makes: they go again
        to_portable.to_portable(ckpt, "a", tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()


def test_an_output_that_would_replace_its_source_or_an_odd_tag_is_refused_and_nothing_changes(tmp_path) -> None:
    """Putting the converted tag in place renames what is there and removes it: an OUT_DIR and tag that are the
    source's folder, or hold it (``runs/exp1`` for a source in ``runs/exp1/step2``), are refused, as are tags that
    are not plain names; a failed conversion removes the folders it made."""
    engine = _engine("fp32", seed=0)
    train(engine, batches()[:2])
    runs = tmp_path / "runs"
    for tag in ("step1", "step2"):
        engine.save_checkpoint(runs / "exp1", tag, portable=False)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    cases = [(runs, "exp1"), (runs / "exp1", "step2"), (runs / "exp1" / "step2", "x")]
    cases += [(runs / "new" / "deeper", tag) for tag in ("latest", "../escaped", ".hidden")]
    for out_dir, out_tag in cases:
        with pytest.raises(CheckpointError, match="source|plain folder name"):
            to_portable.to_portable(runs / "exp1", "step2", out_dir, out_tag)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_state_without_a_step_and_parameters_without_state_come_through(tmp_path) -> None:
    """SGD's momentum (no step) is converted as saved; a parameter that never had a gradient (no state) loads
    afresh, from the converted checkpoint and from a portable save alike, and the run goes on as it did."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        net[0](torch.randn(2, 8)).square().sum().backward()  # net[1] never gets a gradient
        opt.step()
        opt.zero_grad()
    save_checkpoint(tmp_path / "ckpt", "a", model=net, optimizer=opt)
    to_portable.to_portable(tmp_path / "ckpt", "a", tmp_path / "out")
    keys = torch.load(tmp_path / "out" / "a" / "twinflow.pt", weights_only=True)["state_keys"]
    assert keys == {"0.weight": ["momentum_buffer"], "0.bias": ["momentum_buffer"], "1.weight": [], "1.bias": []}
    again = copy.deepcopy(net)
    sgd = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    load_portable(tmp_path / "out", model=again, optimizer=sgd)
    saved, loaded = opt.state_dict()["state"], sgd.state_dict()["state"]
    assert saved.keys() == loaded.keys() == {0, 1}
    assert all(torch.equal(saved[i]["momentum_buffer"], loaded[i]["momentum_buffer"]) for i in saved)
    data = batches()
    engine = _engine_with_spare(0)
    train(engine, data[:BEFORE])
    engine.save_checkpoint(tmp_path / "e", "per_rank", portable=False)
    engine.save_checkpoint(tmp_path / "e", "portable")
    continued = train(engine, data[BEFORE:])
    to_portable.to_portable(tmp_path / "e", "per_rank", tmp_path / "e", "converted")
    for tag in ("portable", "converted"):
        resumed = _engine_with_spare(3)
        resumed.load_checkpoint(tmp_path / "e", tag)
        assert train(resumed, data[BEFORE:]) == continued, tag


class _Spare(torch.nn.Module):
    """The fixture's model, with a layer the forward never uses (its parameters never have state)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net, self.spare = model(seed), torch.nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _engine_with_spare(seed: int):  # noqa: ANN202
    engine, *_ = twinflow.initialize(model=_Spare(seed), config=config("int8_m24"))
    return engine


def test_a_layoutless_checkpoint_whose_tensors_do_not_pair_one_to_one_is_refused(tmp_path) -> None:
    """A checkpoint saved before the shards recorded their layout names its state by pairing the model's tensors
    with the parameters by shape: where a buffer has a parameter's shape (BatchNorm's running mean beside a bias),
    that pairing is a guess, and the conversion refuses rather than misname the state."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    save_checkpoint(tmp_path / "ckpt", "a", model=net, optimizer=opt)
    strip_layout(tmp_path / "ckpt" / "a")  # as written before the layout was recorded
    with pytest.raises(CheckpointError, match=r"shape \[8\] do not pair .* save it again"):
        to_portable.to_portable(tmp_path / "ckpt", "a", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_damaged_shard_is_refused_naming_it_and_nothing_is_written(tmp_path) -> None:
    ckpt, out = _saved(tmp_path), tmp_path / "out"
    shard = ckpt / "a" / "rank0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank0.pt"):
        to_portable.to_portable(ckpt, "a", out)
    assert not out.exists()


def test_the_cli_refuses_a_portable_source_and_an_output_over_its_source(tmp_path, capsys) -> None:
    ckpt = _saved(tmp_path)
    assert convert_main([str(ckpt), "a", "--to-portable", str(ckpt)]) == 1
    assert "its source" in capsys.readouterr().err
    assert (ckpt / "a" / "rank0.pt").is_file() and not list(ckpt.glob("*.saving"))
    assert convert_main([str(ckpt), "a", "--to-portable", str(ckpt), "--out-tag", "b"]) == 0
    assert (ckpt / "latest").read_text() == "b"
    assert convert_main([str(ckpt), "b", "--to-portable", str(tmp_path / "again")]) == 1
    assert "already portable" in capsys.readouterr().err
