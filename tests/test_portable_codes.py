"""Compact moments in a portable checkpoint as their codes and block scales (twinflow.checkpoint.portable_codes):
a quarter of the bytes of the decoded moments, the same state after a load, and a piece of a parameter decoded with
its own blocks' scales wherever it starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.checkpoint import CheckpointError, portable, portable_codes, portable_load, to_portable
from twinflow.checkpoint.convert_cli import main as convert_main
from twinflow.precision import compact


def _single(seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[torch.nn.Module, TwinFlowAdam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.GELU(), torch.nn.Linear(300, 4)).to(device, dtype)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
    opt.state_precision = "int8_m24"
    return model, opt


def _train(model: torch.nn.Module, opt: TwinFlowAdam, steps: int = 2, seed: int = 0) -> None:
    p = next(model.parameters())
    for i in range(steps):
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(seed + i)).to(p.device, p.dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.distcp"))


def _loaded(directory: Path, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, TwinFlowAdam]:
    model, opt = _single(1, dtype, device)
    _train(model, opt, 1, seed=50)  # built, with state of its own that the load replaces
    portable_load.load_portable(directory, model=model, optimizer=opt)
    return model, opt


ON_GPU = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a GPU")])  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_state_is_saved_as_kept_and_loads_as_the_decoded_one(tmp_path, monkeypatch, dtype, device) -> None:  # noqa: ANN001
    """The same run saved twice: as kept (now: codes and scales; a bfloat16 weight's 24-bit master as its hi and lo),
    and decoded to float32 (as before, forced here; a checkpoint of that layout must still load). Both loads give the
    saved state bit for bit, and train on alike."""
    model, opt = _single(0, dtype, device)
    _train(model, opt, 3)
    coded = portable.save_portable(tmp_path / "coded", "t", model=model, optimizer=opt)
    with monkeypatch.context() as m:
        m.setattr(portable_codes, "keeps_blocks", lambda p, parts: False)
        plain = portable.save_portable(tmp_path / "plain", "t", model=model, optimizer=opt)
    keys = torch.load(coded / portable.INFO, weights_only=True)["state_keys"]["0.weight"]
    masters = ["master.hi", "master.lo"] if dtype == torch.bfloat16 else []  # a float32 weight is its own master
    assert sorted(keys) == sorted(["exp_avg.codes", "exp_avg.scales", "exp_avg_sq.codes", "exp_avg_sq.scales",
                                   "step", *masters])  # fmt: skip
    plain_keys = torch.load(plain / portable.INFO, weights_only=True)["state_keys"]["0.weight"]
    assert sorted(plain_keys) == sorted(["exp_avg", "exp_avg_sq", "step"] + ["master"] * bool(masters))
    elements = sum(p.numel() for p in model.parameters())
    # the two moments: 8 bytes an element decoded, 2 as codes (and a byte per 256 elements each); a master 4 and 3;
    # and about 1.5 KiB of torch.save's framing for each of the 8 to 12 more files of this small model
    saved = _bytes(plain) - _bytes(coded)
    fewer = (6 + bool(masters)) * elements
    assert fewer - 20000 <= saved <= fewer, (saved, elements)
    state = opt.state_dict()["state"]
    for directory in (tmp_path / "coded", tmp_path / "plain"):
        other, other_opt = _loaded(directory, dtype, device)
        loaded = other_opt.state_dict()["state"]
        assert all(torch.equal(loaded[i][k], v) for i, entry in state.items() for k, v in entry.items()), directory
        assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))
    reference, reference_opt = _loaded(tmp_path / "coded", dtype, device)
    again, again_opt = _loaded(tmp_path / "plain", dtype, device)
    _train(reference, reference_opt, 2, seed=9)
    _train(again, again_opt, 2, seed=9)
    assert all(a.equal(b) for a, b in zip(reference.parameters(), again.parameters()))


@pytest.mark.parametrize("start, count", [(0, 1000), (700, 1200), (256, 2744), (2999, 1)])
def test_a_run_of_a_parameters_elements_decodes_with_its_own_blocks_scales(monkeypatch, start: int,
                                                                           count: int) -> None:  # fmt: skip
    """A process holding elements [start, start + count) of a parameter of 3000 (FSDP2's first-dimension shard):
    its codes decoded with the whole parameter's scales are its elements of the whole decoded."""
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(3000, generator=gen) * torch.logspace(-6, 0, 3000)
    v = torch.rand(3000, generator=gen) * torch.logspace(-12, -2, 3000)
    codes_m, scales_m, codes_v, scales_v = compact.encode(m, v)
    whole_m, whole_v = compact.decode_exp_avg(codes_m, scales_m), compact.decode_exp_avg_sq(codes_v, scales_v)
    piece = torch.empty(count)
    monkeypatch.setattr(portable_codes, "flat_start", lambda p: start)
    entry = {"exp_avg.codes": codes_m[start : start + count], "exp_avg.scales": scales_m,
             "exp_avg_sq.codes": codes_v[start : start + count], "exp_avg_sq.scales": scales_v,
             "step": torch.tensor(4.0)}  # fmt: skip
    out = portable_codes.decoded(piece, entry)
    assert sorted(out) == ["exp_avg", "exp_avg_sq", "step"]
    assert torch.equal(out["exp_avg"], whole_m[start : start + count])
    assert torch.equal(out["exp_avg_sq"], whole_v[start : start + count])


def test_a_piece_split_on_a_later_dimension_decodes_each_element_with_its_blocks_scale(monkeypatch) -> None:
    """Columns [20, 50) of a 40 x 64 parameter (not one run of elements): each element takes the scale of the
    block its flat index in the whole falls in."""
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(40, 64, generator=gen) * torch.logspace(-5, 0, 64)
    codes_m, scales_m, _, _ = compact.encode(m, m.square())
    whole = compact.decode_exp_avg(codes_m, scales_m).view(40, 64)
    p, piece = torch.empty(40, 64), torch.empty(40, 30)  # the parameter, and what this process holds of it
    monkeypatch.setattr(portable_codes, "local", lambda t: piece if t is p else t)
    monkeypatch.setattr(portable_codes, "held_box", lambda t: ([40, 30], [0, 20]))
    entry = {"exp_avg.codes": codes_m.view(40, 64)[:, 20:50].contiguous(), "exp_avg.scales": scales_m}
    assert portable_codes.flat_start(p) is None
    out = portable_codes.decoded(p, entry)
    assert out["exp_avg"].shape == (40, 30)
    assert torch.equal(out["exp_avg"], whole[:, 20:50])


class _Part:
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


def test_a_parameter_keeps_its_codes_where_its_parts_start_on_blocks() -> None:
    p = torch.empty(10, 100)
    assert portable_codes.keeps_blocks(p, [_Part(0, 1000)])
    assert portable_codes.keeps_blocks(p, [_Part(0, 512), _Part(512, 1000)])
    assert not portable_codes.keeps_blocks(p, [_Part(0, 500), _Part(500, 1000)])  # a part starts inside a block
    assert not portable_codes.keeps_blocks(p, [_Part(0, 512)])  # the parts do not cover it


@pytest.mark.parametrize("shape, box, expected", [
    ((8, 100), ([8, 100], [0, 0]), 0),
    ((8, 100), ([2, 100], [4, 0]), 400),
    ((8, 100), ([8, 50], [0, 50]), None),  # columns: not one run
    ((1, 8, 100), ([1, 2, 100], [0, 4, 0]), 400),
    ((3, 8, 100), ([3, 2, 100], [0, 4, 0]), None),
    ((8, 100), ([0, 100], [8, 0]), 0),  # holds none of it
])  # fmt: skip
def test_the_flat_start_of_what_a_process_holds(monkeypatch, shape, box, expected) -> None:  # noqa: ANN001
    monkeypatch.setattr(portable_codes, "held_box", lambda t: box)
    assert portable_codes.flat_start(torch.empty(shape)) == expected


def _fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise AssertionError("decoded where the codes fit as they are")


def test_a_built_optimizer_that_keeps_the_same_blocks_takes_the_codes_as_they_are(tmp_path, monkeypatch) -> None:
    """Same layout, same precision: the codes, scales and 24-bit masters are copied in (nothing is decoded), and
    the state is the saved one bit for bit."""
    model, opt = _single(0, torch.bfloat16)
    _train(model, opt, 3)
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    monkeypatch.setattr(portable_codes, "decoded", _fail)
    other, other_opt = _loaded(tmp_path / "ckpt", torch.bfloat16, "cpu")
    saved, loaded = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(loaded[i][k], v) for i, entry in saved.items() for k, v in entry.items())
    assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))


@pytest.mark.parametrize("precision", ["int8", "fp32"])
def test_codes_load_decoded_into_another_precision(tmp_path, precision: str) -> None:
    """Saved as int8_m24's codes, loaded where the state is kept otherwise (a float32 master; float32 moments): the
    moments and masters are the saved ones decoded, then kept in the new precision."""
    model, opt = _single(0, torch.bfloat16)
    _train(model, opt, 3)
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    other, other_opt = _single(1, torch.bfloat16)
    other_opt.state_precision = precision
    _train(other, other_opt, 1, seed=50)
    portable_load.load_portable(tmp_path / "ckpt", model=other, optimizer=other_opt)
    saved, loaded = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for i, entry in saved.items():
        assert torch.equal(loaded[i]["master"], entry["master"])  # a 24-bit master is a float32 exactly
        for key in ("exp_avg", "exp_avg_sq"):  # int8: encoded again to the nearest, the same codes
            assert torch.equal(loaded[i][key], entry[key]), (i, key)


def test_the_per_rank_reader_names_a_portable_checkpoint_and_the_way_forward(tmp_path) -> None:
    """The per-rank reader (--to-portable's) used to call a portable checkpoint "incomplete (no meta.json): it was
    never finished"; it names the format and what to do instead, and the converters take it as it is."""
    model, opt = _single(0)
    _train(model, opt, 1)
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="is a portable one.*load_portable.*--safetensors OUT") as refused:
        to_portable.to_portable(tmp_path / "ckpt", "t", tmp_path / "again")
    assert "never finished" not in str(refused.value) and not (tmp_path / "again").exists()
    assert convert_main([str(tmp_path / "ckpt"), "latest", str(tmp_path / "out.pt")]) == 0
    assert set(torch.load(tmp_path / "out.pt", weights_only=True)["state"]) == set(opt.state_dict()["state"])


def test_codes_beside_a_float32_master_where_a_master_is_not_kept_in_24_bits(tmp_path, monkeypatch) -> None:
    """Where some rank's master is not 24-bit (a float16 parameter's on the device), every rank saves the master in
    float32 beside the moments' codes; it loads to the same state (the 24-bit masters encoded again exactly)."""
    model, opt = _single(0, torch.bfloat16)
    _train(model, opt, 3)
    with monkeypatch.context() as m:
        m.setattr(portable_codes, "keeps_masters24", lambda parts: False)
        folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    keys = torch.load(folder / portable.INFO, weights_only=True)["state_keys"]["0.weight"]
    assert "master" in keys and "exp_avg.codes" in keys and "master.hi" not in keys
    other, other_opt = _loaded(tmp_path / "ckpt", torch.bfloat16, "cpu")
    saved, loaded = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(loaded[i][k], v) for i, entry in saved.items() for k, v in entry.items())
