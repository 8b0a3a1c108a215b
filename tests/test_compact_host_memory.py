"""TwinFlowAdam's compact state in host memory: its build, state_dict(), load_state_dict() and a portable save and
load each take a bounded scratch beyond what the state keeps, never a float32 copy of the state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinflow.checkpoint.portable_sums import READ, THREADS
from twinflow.precision import compact

REPO = Path(__file__).resolve().parents[1]

MEASURED = r"""
import json, sys, torch
from pathlib import Path
from twinflow import TwinFlowAdam
from twinflow.checkpoint import load_portable, portable_load, portable_state, save_portable

def size(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def extra(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current resident size
    before = size("VmRSS")
    fn()
    return size("VmHWM") - max(before, size("VmRSS"))

directory, chunk, piece = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
portable_state.PIECE_BYTES = piece  # a save copies a tensor to write it in pieces of rows of at most this
portable_load.CHUNK = chunk // 4  # a load reads the state a chunk of float32 elements at a time (a larger one alone)
torch.manual_seed(0)
shapes = [(1024, 4096), (4096, 1024)] * 4
model = torch.nn.Sequential(*(torch.nn.Linear(*s, bias=False) for s in shapes)).to(torch.bfloat16)
made = []
peaks = {"build": extra(lambda: made.append(TwinFlowAdam(model.parameters(), ratio=0.6, chunk_bytes=chunk,
                                                        state_precision="int8_m24")))}
opt = made[0]
model(torch.randn(2, 1024, dtype=torch.bfloat16)).float().square().mean().backward()
opt.step()
opt.zero_grad()
weights = [p.detach().clone() for p in model.parameters()]
peaks["save"] = extra(lambda: save_portable(directory, "t", model=model, optimizer=opt))
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)  # the load has something to put back
peaks["load"] = extra(lambda: load_portable(directory, model=model, optimizer=opt))
same = all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
kept = []
peaks["state_dict"] = extra(lambda: kept.append(opt.state_dict()))  # what it returns stays: only scratch counts
peaks["load_state_dict"] = extra(lambda: opt.load_state_dict(kept[0]))
print(json.dumps({"peaks": peaks, "elements": sum(p.numel() for p in model.parameters()), "largest": 1024 * 4096,
                  "same": same}))
"""


def test_build_save_load_and_state_dict_stay_within_a_chunk_of_host_memory(tmp_path) -> None:
    """Peak resident memory above what is kept (before and after), in a fresh process whose allocator returns
    every block of 64 KiB or more to the system when freed, so the resident size follows what is alive."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    chunk = 16 << 20
    piece = chunk // 8
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    # no GPU in the child: a CUDA context would be counted as the save's (its model is on the host anyway)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    args = [sys.executable, "-c", MEASURED, str(tmp_path / "ckpt"), str(chunk), str(piece)]
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    peaks, elements, largest = result["peaks"], result["elements"], result["largest"]
    assert result["same"]  # the load put back the weights the save wrote
    assert 12 * elements >= 24 * chunk  # a float32 copy of the state (12 bytes a parameter): 24 chunks
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
    # The per-rank save streamed a record at a time (at most a chunk). The portable save holds two pieces of rows
    # (DCP's writer holds the one it writes while the next is read: 2 x 2 MiB here) and joins the device share's
    # 24-bit masters (weight and residual) a batch of COPY_ELEMENTS at a time: the build's scratch again. Measured:
    # 57 MiB on 2 cores (65 MiB with the default pieces of 64 MiB, each a whole 8 MiB tensor here), so the pieces
    # are made smaller than a chunk for the bound to be the build's.
    # The sums read each file at most portable_sums.READ bytes at a time, on THREADS threads at once.
    assert peaks["save"] <= chunk + scratch + (THREADS - 1) * READ, peaks
    # The portable load reads the state a batch of CHUNK float32 elements at a time, a parameter larger than that
    # alone: here one weight's state as saved (its codes, block scales and 24-bit master's two parts: 5 bytes an
    # element), and splits the device share's masters into weight and residual a batch of COPY_ELEMENTS at a time
    # (encoding's scratch, as load_state_dict's). Measured: 80 MiB on 2 cores. The bound stays below the whole state
    # as saved (5 bytes a parameter, 160 MiB here), which a load reading it at once would hold.
    bound = 5 * largest + 2 * scratch
    assert bound < 5 * elements
    assert peaks["load"] <= bound, peaks
