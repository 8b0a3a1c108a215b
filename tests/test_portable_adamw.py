"""A portable checkpoint's optimizer state as torch.optim's layout (``python -m twinflow.convert DIR TAG OUT.pt``):
the whole model's state, whatever number of ranks saved it, compact moments decoded, written a batch of rows at a
time, checked first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import twinflow
from twinflow import TwinFlowAdam
from twinflow.checkpoint import CheckpointError, portable, portable_adamw, portable_load
from twinflow.checkpoint.convert_cli import main as convert_main

WORKER = Path(__file__).with_name("portable_worker.py")


def _single(seed: int, precision: str, dtype: torch.dtype) -> tuple[torch.nn.Module, TwinFlowAdam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.GELU(), torch.nn.Linear(300, 4)).to(dtype)
    opt = TwinFlowAdam([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}],
                       lr=1e-2, ratio=0.5, weight_decay=0.1)  # fmt: skip
    opt.state_precision = precision
    return model, opt


def _train(model: torch.nn.Module, opt: TwinFlowAdam, steps: int, seed: int = 0) -> None:
    p = next(model.parameters())
    for i in range(steps):
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(seed + i)).to(p.dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _same_state(written: dict, expected: dict) -> None:
    assert set(written["state"]) == set(expected["state"])
    for i, entry in expected["state"].items():
        assert list(written["state"][i]) == list(entry), i  # the keys, in torch.optim's order
        for key, value in entry.items():
            got = written["state"][i][key]
            assert got.dtype == value.dtype and got.shape == value.shape, (i, key)
            assert torch.equal(got, value), (i, key)
    assert written["param_groups"] == expected["param_groups"]


@pytest.mark.parametrize(
    "precision, dtype",
    [("fp32", torch.float32), ("int8_m24", torch.float32), ("int8_m24", torch.bfloat16), ("fp32", torch.bfloat16)],
    ids=["fp32", "int8_m24", "int8_m24-bf16", "fp32-bf16"],
)
def test_the_state_is_what_a_one_process_load_holds(tmp_path, monkeypatch, precision: str, dtype) -> None:  # noqa: ANN001
    """OUT.pt holds, bit for bit, what the saving optimizer's state_dict() holds (float32 state, codes decoded, a
    master where one is kept), read in batches of rows that start inside the codes' blocks (300 x 23 rows)."""
    model, opt = _single(0, precision, dtype)
    _train(model, opt, 3)
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    expected = opt.state_dict()
    assert any(("master" in e) == (dtype == torch.bfloat16) for e in expected["state"].values())
    reads = []
    load = portable_load.dcp.load
    monkeypatch.setattr(portable_load.dcp, "load", lambda sd, **kw: reads.append(len(sd)) or load(sd, **kw))
    monkeypatch.setattr(portable_load, "CHUNK", 7000)
    out = tmp_path / "adamw.pt"
    assert convert_main([str(tmp_path / "ckpt"), "latest", str(out)]) == 0
    written = torch.load(out, weights_only=True)
    _same_state(written, expected)
    assert len(reads) >= 2 * (300 * 300 // 7000)  # each moment of the 300 x 300 weight, a batch of rows at a time
    other, other_opt = _single(1, precision, dtype)
    _train(other, other_opt, 1, seed=50)
    portable_load.load_portable(tmp_path / "ckpt", "t", model=other, optimizer=other_opt)
    _same_state(written, other_opt.state_dict())  # what a one-process load of the checkpoint holds
    adamw = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    adamw.load_state_dict(written)  # torch's own optimizer takes it
    assert adamw.param_groups[1]["lr"] == 3e-3 and adamw.param_groups[0]["weight_decay"] == 0.1
    assert not list(tmp_path.glob(".adamw.pt.tmp*"))


@pytest.mark.parametrize("stage", [3, 0])
def test_two_ranks_pieces_merge_into_the_state_a_load_on_one_holds(tmp_path, stage: int) -> None:
    """Saved by two gloo ranks, `int8_m24`: OUT.pt is the state that one process holds after loading the checkpoint.
    Stage 3 (FSDP2): every tensor in two pieces, merged (their second pieces start inside a block, so the moments are
    saved decoded); stage 0 (DDP): whole parameters, the moments saved as codes and scales."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--world", "2", "--stage", str(stage),
                               "--rendezvous", str(tmp_path / "rdv"), "--out", str(out), "--save", str(ckpt),
                               "--precision", "int8_m24"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]  # fmt: skip
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    keys = torch.load(ckpt / "moved" / portable.INFO, weights_only=True)["state_keys"]
    assert any("exp_avg.codes" in k for k in keys.values()) == (stage == 0)
    portable_adamw.convert_portable(ckpt, "moved", tmp_path / "adamw.pt")
    written = torch.load(tmp_path / "adamw.pt", weights_only=True)
    sys.path.insert(0, str(WORKER.parent))
    import portable_worker  # the ranks' model and config

    torch.manual_seed(5)
    engine, *_ = twinflow.initialize(model=portable_worker.Net(), config=portable_worker.config(0, "int8_m24", 0.0))
    engine.load_checkpoint(ckpt)
    expected = engine.local_optimizer.state_dict()
    assert expected["state"] and all("exp_avg" in e for e in expected["state"].values())
    _same_state(written, expected)


def test_a_damaged_piece_leaves_nothing(tmp_path) -> None:
    model, opt = _single(0, "int8_m24", torch.float32)
    _train(model, opt, 2)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    piece = max(folder.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{piece.name} differs from what the save wrote"):
        portable_adamw.convert_portable(tmp_path / "ckpt", "t", tmp_path / "a.pt")
    assert not list(tmp_path.glob("*a.pt*"))


def test_torch_adamw_state_with_a_parameter_of_no_elements_and_a_key_of_its_own(tmp_path) -> None:
    """Another optimizer's state converts as it was (amsgrad's ``max_exp_avg_sq``, a parameter of no elements); a
    key that twinflow.pt lists and DCP's index lacks is refused, naming it, and nothing is written."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    model.empty = torch.nn.Parameter(torch.zeros(0, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    for i in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
        (model(x).square().mean() + torch.nn.functional.linear(x, model.empty).sum()).backward()
        opt.step()
        opt.zero_grad()
    assert opt.state[model.empty]["exp_avg"].numel() == 0
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    assert convert_main([str(tmp_path / "ckpt"), "t", str(tmp_path / "adamw.pt")]) == 0
    _same_state(torch.load(tmp_path / "adamw.pt", weights_only=True), opt.state_dict())
    info = torch.load(folder / portable.INFO, weights_only=True)
    info["state_keys"]["weight"] = [*info["state_keys"]["weight"], "lost"]
    torch.save(info, folder / portable.INFO)
    with pytest.raises(CheckpointError, match=r"lists 'lost' in the state of weight.*no optim\.weight\.lost"):
        portable_adamw.convert_portable(tmp_path / "ckpt", "t", tmp_path / "b.pt")
    assert not list(tmp_path.glob("*b.pt*"))
