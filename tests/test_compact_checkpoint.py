"""Compact checkpoints: the 8-bit state saved and loaded as it is kept, bit for bit at any ratio; the offline
converter gives the optimizer's own state dict; damage is refused before anything changes; host memory stays
within a chunk."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from twinflow.checkpoint.checkpoint_files import sha256_of
from twinflow.checkpoint.compact_checkpoint import MAGIC, CompactShard
from twinflow.checkpoint.convert_cli import main as convert_main
from twinflow.precision import compact

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "bf16-int8_m24": (torch.bfloat16, "int8_m24"),
    "bf16-int8": (torch.bfloat16, "int8"),
    "fp32-int8": (torch.float32, "int8"),
}


def build(case: str, ratio: float, placement: str = "first", seed: int = 0):
    """Parameters of 21000, 300, 9900 and 33 elements (not whole blocks); small chunks: several CPU pieces and
    state records a parameter, a parameter cut between the sides at either ratio."""
    dtype, precision = CASES[case]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(70, 300), torch.nn.GELU(), torch.nn.Linear(300, 33)).to(dtype)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio, placement=placement, chunk_bytes=1 << 14,
                       state_precision=precision)  # fmt: skip
    return model, opt


def train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(8, 70, generator=gen).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert set(a["state"]) == set(b["state"])
    for i, entry in a["state"].items():
        assert set(entry) == set(b["state"][i]), i
        for key, value in entry.items():
            other = b["state"][i][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (i, key)


def state_records(path: Path) -> tuple[list, list]:
    """The shard's head records and its state records' tensors (codes, scales, masters as kept)."""
    with open(path, "rb") as f:
        shard = CompactShard(f, {"bytes": path.stat().st_size, "sha256": sha256_of(path)}, "t", path)
        return shard.records, [payload for _, payload in shard.frames(("state",))]


@pytest.mark.parametrize("target", [(0.3, "first"), (0.7, "first"), (0.7, "last")], ids=lambda t: f"{t[0]}-{t[1]}")
@pytest.mark.parametrize("case", CASES)
def test_a_compact_checkpoint_round_trips_bit_for_bit_at_any_ratio(tmp_path, case: str, target) -> None:
    model, opt = build(case, 0.3)
    train(model, opt, 3, seed=1)
    save_checkpoint(tmp_path, "a", model=model, optimizer=opt)
    assert (tmp_path / "a" / "rank0.pt").read_bytes()[: len(MAGIC)] == MAGIC
    saved = opt.state_dict()

    model2, opt2 = build(case, *target, seed=5)
    train(model2, opt2, 1, seed=9)  # state of its own, all of it replaced
    load_checkpoint(tmp_path, model=model2, optimizer=opt2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert_same_state(saved, opt2.state_dict())
    save_checkpoint(tmp_path, "b", model=model2, optimizer=opt2)  # the codes as loaded, saved again
    records_a, tensors_a = state_records(tmp_path / "a" / "rank0.pt")
    records_b, tensors_b = state_records(tmp_path / "b" / "rank0.pt")
    assert records_a == records_b and len(tensors_a) > 8
    assert all(torch.equal(x, y) for a, b in zip(tensors_a, tensors_b) for x, y in zip(a, b, strict=True))

    train(model, opt, 2, seed=7)  # both sides take the same steps: resumed is uninterrupted, at any ratio
    train(model2, opt2, 2, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


@pytest.mark.parametrize("case", CASES)
def test_the_converter_writes_the_optimizers_own_state_dict(tmp_path, case: str, capsys) -> None:
    model, opt = build(case, 0.4)
    train(model, opt, 3, seed=2)
    save_checkpoint(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    out = tmp_path / "adamw.pt"
    assert convert_main([str(tmp_path / "ckpt"), "latest", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    converted = torch.load(out, weights_only=True)
    own = opt.state_dict()
    assert_same_state(own, converted)
    assert ("master" in converted["state"][0]) == (CASES[case][0] != torch.float32)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adamw.load_state_dict(converted)
    assert torch.equal(adamw.state[model[0].weight]["exp_avg_sq"], own["state"][0]["exp_avg_sq"])


def test_the_converter_copies_the_state_dict_of_another_optimizers_shard(tmp_path) -> None:
    model, opt = build("bf16-int8", 0.5)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, chunk_bytes=1 << 14)  # fp32: torch.optim's layout
    train(model, opt, 2, seed=6)
    save_checkpoint(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    assert convert_main([str(tmp_path / "ckpt"), "t", str(tmp_path / "out.pt")]) == 0
    assert_same_state(opt.state_dict(), torch.load(tmp_path / "out.pt", weights_only=True))


def test_a_compact_checkpoint_loads_into_torch_adamw_decoded(tmp_path) -> None:
    model, opt = build("bf16-int8_m24", 0.5)
    train(model, opt, 2, seed=3)
    save_checkpoint(tmp_path, "t", model=model, optimizer=opt)
    own = opt.state_dict()
    model2, _ = build("bf16-int8_m24", 0.5, seed=4)
    adamw = torch.optim.AdamW(model2.parameters(), lr=3e-3)
    load_checkpoint(tmp_path, model=model2, optimizer=adamw)
    assert adamw.param_groups[0]["lr"] == 1e-2
    for i, (p, q) in enumerate(zip(model2.parameters(), model.parameters())):
        assert torch.equal(adamw.state[p]["exp_avg"], own["state"][i]["exp_avg"]) and torch.equal(p, q)


def snapshot(model, opt) -> list:
    return [{k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()]


@pytest.mark.parametrize("damage", ["truncate", "flip", "frame_length", "optimizer"])
def test_a_damaged_shard_is_refused_and_changes_nothing(tmp_path, damage: str) -> None:
    model, opt = build("bf16-int8_m24", 0.3)
    train(model, opt, 2, seed=1)
    save_checkpoint(tmp_path, "t", model=model, optimizer=opt)
    shard = tmp_path / "t" / "rank0.pt"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        del data[len(data) * 2 // 3 :]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "frame_length":  # the head's length guard, meta.json rewritten to match: the structure tells
        data[len(MAGIC) + 8] ^= 1
        meta = json.loads((tmp_path / "t" / "meta.json").read_text())
        meta["shards"]["rank0.pt"]["sha256"] = hashlib.sha256(data).hexdigest()
        (tmp_path / "t" / "meta.json").write_text(json.dumps(meta))
    shard.write_bytes(bytes(data))
    target, target_opt = build("bf16-int8_m24", 0.7, seed=8)
    if damage == "optimizer":  # an intact shard, an optimizer with other param groups
        groups = [{"params": list(target[0].parameters())}, {"params": list(target[2].parameters())}]
        target_opt = TwinFlowAdam(groups, ratio=0.7, chunk_bytes=1 << 14, state_precision="int8_m24")
    train(target, target_opt, 1, seed=4)
    before = snapshot(target, target_opt)
    message = {"truncate": "truncated or corrupt", "flip": "corrupt or was replaced", "optimizer": "1 param groups",
               "frame_length": "frame length at byte 25 is damaged"}  # fmt: skip
    with pytest.raises(CheckpointError, match=message[damage]):
        load_checkpoint(tmp_path, model=target, optimizer=target_opt)
    after = snapshot(target, target_opt)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert_same_state(before[1], after[1])
    if damage != "optimizer":
        assert convert_main([str(tmp_path), "t", str(tmp_path / "out.pt")]) == 1  # the converter refuses it too
        assert not (tmp_path / "out.pt").exists() and not list(tmp_path.glob(".out.pt.tmp*"))


MEASURED = r"""
import json, sys, torch
from pathlib import Path
from twinflow import TwinFlowAdam
from twinflow.checkpoint import load_checkpoint, save_checkpoint
from twinflow.checkpoint.convert import convert

def size(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def extra(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current resident size
    before = size("VmRSS")
    fn()
    return size("VmHWM") - max(before, size("VmRSS"))

directory, chunk = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
shapes = [(1024, 4096), (4096, 1024)] * 2
model = torch.nn.Sequential(*(torch.nn.Linear(*s, bias=False) for s in shapes)).to(torch.bfloat16)
made = []
peaks = {"build": extra(lambda: made.append(TwinFlowAdam(model.parameters(), ratio=0.6, chunk_bytes=chunk,
                                                        state_precision="int8_m24")))}
opt = made[0]
model(torch.randn(2, 1024, dtype=torch.bfloat16)).float().square().mean().backward()
opt.step()
opt.zero_grad()
peaks["save"] = extra(lambda: save_checkpoint(directory, "t", model=model, optimizer=opt))
peaks["load"] = extra(lambda: load_checkpoint(directory, model=model, optimizer=opt))
peaks["convert"] = extra(lambda: convert(directory, "t", directory / "adamw.pt"))
kept = []
peaks["state_dict"] = extra(lambda: kept.append(opt.state_dict()))  # what it returns stays: only scratch counts
peaks["load_state_dict"] = extra(lambda: opt.load_state_dict(kept[0]))
print(json.dumps({"peaks": peaks, "elements": sum(p.numel() for p in model.parameters())}))
"""


def test_build_save_load_convert_and_state_dict_stay_within_a_chunk_of_host_memory(tmp_path) -> None:
    """Peak resident memory above what is kept (before and after), in a fresh process whose allocator returns
    every block of 64 KiB or more to the system when freed, so the resident size follows what is alive."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    chunk = 16 << 20
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", MEASURED, str(tmp_path), str(chunk)], env=env, capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    peaks, elements = result["peaks"], result["elements"]
    assert 12 * elements >= 12 * chunk  # a float32 copy of the state (12 bytes a parameter): 12 chunks
    for phase in ("save", "load", "convert"):
        assert peaks[phase] <= chunk, (phase, peaks)
    # The build encodes the 24-bit masters from the weights a batch of COPY_ELEMENTS at a time: a fixed scratch of
    # a few int64 tensors of a batch (about 48 bytes an element), whatever the model's size, and no copy of the state.
    scratch = 48 * compact.COPY_ELEMENTS
    assert peaks["build"] <= chunk + scratch, peaks
    # state_dict() decodes each side straight into the float32 entry it returns, a batch at a time: the same
    # bounded scratch beyond the entries themselves (a decoded copy of a side's share would be 4 bytes a parameter)
    assert peaks["state_dict"] <= chunk + scratch, peaks
    # load_state_dict encodes the CPU share's moments a batch of COPY_ELEMENTS at a time too (its int64 scratch
    # about 72 bytes an element); it encoded each piece whole before (4M elements here: 289 MB)
    assert peaks["load_state_dict"] <= chunk + 2 * scratch, peaks
    assert (tmp_path / "adamw.pt").stat().st_size >= 12 * elements
