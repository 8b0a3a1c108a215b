"""A synchronous portable save reads what it copies to write it (the optimizer's state, a weight on a GPU) a piece of
rows at a time (twinflow.checkpoint.portable_state.ReadWhenWritten): each piece is read from the state owner as it
is written, through ranged reads of every state owner and of the compact codes and 24-bit masters as kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_codes, portable_load, portable_state
from twinflow.checkpoint.portable_codes import CODES, HI, LO, SCALES
from twinflow.precision import compact

ROOT = Path(__file__).parent.parent


ON_GPU = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a GPU")])  # fmt: skip


def _trained(precision: str, dtype: torch.dtype, ratio: float, seed: int = 0, device: str = "cpu",
             **options: int) -> tuple[torch.nn.Module, TwinFlowAdam]:  # fmt: skip
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.GELU(), torch.nn.Linear(700, 5)).to(device, dtype)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio, state_precision=precision, **options)
    for i in range(3):
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(seed + i)).to(device, dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _ranges(n: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """Ranges of [0, n): the whole, empty ones, single elements at the ends, and random ones (across the sides'
    boundary and the blocks' edges)."""
    out = [(0, n), (0, 0), (n, n), (0, 1), (n - 1, n)]
    for _ in range(12):
        a, b = sorted(torch.randint(0, n + 1, (2,), generator=gen).tolist())
        out.append((a, b))
    return out


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize(
    "precision, dtype, ratio",
    [("fp32", torch.float32, 0.5), ("fp32", torch.bfloat16, 0.37), ("int8", torch.float32, 0.5),
     ("int8_m24", torch.bfloat16, 0.37), ("int8_m24", torch.bfloat16, 1.0), ("int8_m24", torch.float32, 0.0)],
)  # fmt: skip
@pytest.mark.parametrize("small", [False, True], ids=["default", "small_pieces_and_batches"])
def test_a_range_of_a_parameters_state_reads_as_that_range_of_the_whole(
    monkeypatch, precision: str, dtype: torch.dtype, ratio: float, device: str, small: bool
) -> None:
    """`small`: the host's pieces of 64 KiB (several a parameter) and the batches the compact state is decoded and
    joined in of 768 elements (three blocks), so that a range begins and ends inside pieces and batches; the whole
    each range is compared with is read with the default batches."""
    model, opt = _trained(precision, dtype, ratio, device=device)
    owner = opt.state_owner
    wholes = {(i, key): owner.read(i, key) for i in range(len(list(model.parameters())))
              for key in ("exp_avg", "exp_avg_sq", "master") if key != "master" or dtype != torch.float32}  # fmt: skip
    if small:
        spans = compact.spans
        monkeypatch.setattr(compact, "COPY_ELEMENTS", 768)
        monkeypatch.setattr(compact, "spans", lambda numel, size=768: spans(numel, size))
        model, opt = _trained(precision, dtype, ratio, device=device, chunk_bytes=64 << 10)
        owner = opt.state_owner
        assert all(torch.equal(owner.read(i, key), whole) for (i, key), whole in wholes.items())
    gen = torch.Generator().manual_seed(3)
    for i, p in enumerate(model.parameters()):
        keys = ["exp_avg", "exp_avg_sq"] + ["master"] * (dtype != torch.float32)
        for key in keys:
            whole = wholes[(i, key)]
            for a, b in _ranges(p.numel(), gen):
                got = owner.read(i, key, lo=a, hi=b)
                assert torch.equal(got, whole[a:b]), (i, key, a, b)
                into = torch.full((b - a,), float("nan"))  # poisoned: every element is written
                owner.read(i, key, into, a, b)
                assert torch.equal(into, whole[a:b]), (i, key, a, b)
        if not owner.precision.coded_moments:
            continue
        parts = owner.raw(i)
        kept = [(m, w) for m in ("exp_avg", "exp_avg_sq") for w in (CODES, SCALES)]
        for moment, what in kept:
            whole = portable_codes.codes_of(parts, moment, what)
            for a, b in _ranges(whole.numel(), gen):
                assert torch.equal(portable_codes.codes_of(parts, moment, what, lo=a, hi=b), whole[a:b])
        if portable_codes.keeps_masters24(parts):
            for what in (HI, LO):
                whole = portable_codes.masters24_of(parts, what)
                for a, b in _ranges(whole.numel(), gen):
                    assert torch.equal(portable_codes.masters24_of(parts, what, lo=a, hi=b), whole[a:b])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize(
    "precision, dtype", [("fp32", torch.float32), ("fp32", torch.bfloat16), ("int8_m24", torch.bfloat16)]
)
def test_a_tensor_larger_than_a_piece_is_written_in_pieces_of_rows_and_loads_bit_for_bit(
    tmp_path, monkeypatch, precision: str, dtype: torch.dtype, device: str
) -> None:
    """A piece of 4 KiB: the 700 x 300 weight's state goes in pieces of whole rows (3 or 13 rows a piece, the last
    shorter), each no larger than a piece; a 300-element row of float32 (1.2 KiB) fits. The weights are too where
    they are on a GPU; in host memory already, they are written as they are. The load gives back the state and
    weights of a save made whole, bit for bit."""
    model, opt = _trained(precision, dtype, 0.5, device=device)
    whole = portable.save_portable(tmp_path / "whole", "t", model=model, optimizer=opt)
    monkeypatch.setattr(portable_state, "PIECE_BYTES", 4096)
    pieces = portable.save_portable(tmp_path / "pieces", "t", model=model, optimizer=opt)
    meta = dcp.FileSystemReader(pieces).read_metadata().state_dict_metadata
    before = dcp.FileSystemReader(whole).read_metadata().state_dict_metadata
    split = 0
    for key, item in meta.items():
        if not hasattr(item, "chunks") or len(item.size) == 0:
            continue
        if key.startswith("model.") and device == "cpu":  # in host memory already: written as it is
            assert len(item.chunks) == 1, key
            continue
        row = item.properties.dtype.itemsize * int(torch.Size(item.size[1:]).numel())
        for chunk in item.chunks:
            assert chunk.sizes[0] == 1 or chunk.sizes.numel() * item.properties.dtype.itemsize <= 4096, key
        covered = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in item.chunks)
        assert covered[0][0] == 0 and covered[-1][1] == item.size[0]  # the rows, once each, in order
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), key
        split += len(item.chunks) > 1
        assert len(before[key].chunks) == 1 and row <= 4096
    assert split >= 3  # the large weight's state (and its scales stay one piece: they are small)
    state = opt.state_dict()["state"]
    for folder in (whole, pieces):
        other, other_opt = _trained(precision, dtype, 0.5, seed=7, device=device)
        portable_load.load_portable(folder.parent, model=other, optimizer=other_opt)
        loaded = other_opt.state_dict()["state"]
        assert all(torch.equal(loaded[i][k], v) for i, entry in state.items() for k, v in entry.items()), folder
        assert all(a.equal(b) for a, b in zip(model.parameters(), other.parameters()))


SAVE_MEMORY = r"""
import json, sys, torch
from pathlib import Path
from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_state, portable_sums

def size(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

precision, dtype, ratio, piece = sys.argv[2], getattr(torch, sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
portable_state.PIECE_BYTES = piece
torch.manual_seed(0)
model = torch.nn.Linear(2048, 8192, bias=False).to(dtype)  # 16.8M elements: 67 MB of float32 a moment
opt = TwinFlowAdam(model.parameters(), ratio=ratio, state_precision=precision)
model(torch.randn(2, 2048, dtype=dtype)).float().square().mean().backward()
opt.step()
opt.zero_grad()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the current resident size
before = size("VmRSS")
portable.save_portable(Path(sys.argv[1]), "t", model=model, optimizer=opt)
print(json.dumps({"peak": size("VmHWM") - before, "elements": model.weight.numel(),
                  "sum_threads": portable_sums.THREADS, "sum_read": portable_sums.READ}))
"""


@pytest.mark.parametrize("precision, dtype, ratio", [("fp32", "float32", 0.6), ("int8_m24", "bfloat16", 1.0)])
def test_a_save_holds_two_pieces_of_a_large_tensor_not_the_tensor(tmp_path, precision: str, dtype: str,
                                                                 ratio: float) -> None:  # fmt: skip
    """One 8192 x 2048 weight, its state read in pieces of 2 MiB: the save's peak above what the process held is
    two pieces, the sums' buffers and slack (16 MiB on two cores, 28 on eight), below the largest tensor it read
    whole before (a moment in float32: 67 MB; the 24-bit master's high part: 34 MB; the host keeps int8_m24's
    masters as their two parts, so nothing is joined). It peaked at 135 and 106 MB, of which 64 MiB a file summed
    at once was the sums' reads. Resident memory measured in a fresh process whose allocator gives blocks of 64
    KiB or more back to the system when they are freed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    # no GPU in the child (its model is on the host): where CUDA is available DCP's writer makes a CUDA stream, and
    # the context that starts took 130 MB of host memory on a GPU host, counted as the save's
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    piece = 2 << 20
    args = [str(tmp_path / "ckpt"), precision, dtype, str(ratio), str(piece)]
    run = subprocess.run([sys.executable, "-c", SAVE_MEMORY, *args], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    # and the sums' buffers, a file's on each thread, no larger than it: a piece, or the read of the weight's file
    # (in host memory already: written whole), then the framing and slack
    threads, read = result["sum_threads"], result["sum_read"]
    bound = 2 * piece + (threads - 1) * min(piece, read) + read + (6 << 20)
    largest = 4 * result["elements"] if precision == "fp32" else 2 * result["elements"]  # read whole before
    assert bound < largest
    assert result["peak"] <= bound, result
