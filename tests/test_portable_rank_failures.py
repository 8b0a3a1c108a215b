"""A portable save of two real ranks (gloo) where one rank alone fails: every rank raises, none waits for ever in
the next collective, and the previous tag loads as it was saved. The single-process tests of
test_portable_save_failures.py stand in for the other ranks; here they are processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

RANK = r"""
import errno, json, sys, threading
from pathlib import Path
import torch
import torch.distributed as dist
from tests.test_portable_save_failures import make as made, train
from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_load, portable_state

rank, rendezvous, ckpt, what, failing = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)

model = made(0)
opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
train(model, opt, 1, 2)
portable.save_portable(ckpt, "old", model=model, optimizer=opt)
weights = [p.detach().clone() for p in model.parameters()]
state = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
train(model, opt, 2, 2)
class Unpicklable(OSError):  # a failure that cannot be told to another rank as itself: it holds a lock
    def __init__(self, *args):
        super().__init__(*args)
        self.lock = threading.Lock()

full = (Unpicklable if what == "unpicklable" else OSError)(errno.ENOSPC, "No space left on device")
what = "twinflow.pt" if what == "unpicklable" else what
if rank == failing and what in ("twinflow.pt", "latest"):
    real = portable.write_atomic
    def write_atomic(path, write):
        if path.name == what:
            raise full
        return real(path, write)
    portable.write_atomic = write_atomic
if what == "pieces":  # every rank's state in pieces of rows (ranks must cut alike): the failure comes part way
    portable_state.PIECE_BYTES = 512
if rank == failing and what == "pieces":
    real, asked = portable_state.ReadWhenWritten.resolve_data, []
    def resolve_data(planner, item):
        asked.append(item)
        if len(asked) == 3:
            raise full
        return real(planner, item)
    portable_state.ReadWhenWritten.resolve_data = resolve_data
outcome = {"rank": rank}
try:
    portable.save_portable(ckpt, "new", model=model, optimizer=opt)
    outcome["raised"] = None
except BaseException as exc:
    outcome["raised"], outcome["message"] = type(exc).__name__, str(exc)
    outcome["notes"] = getattr(exc, "__notes__", [])
dist.barrier()
other = made(5)
other_opt = TwinFlowAdam(other.parameters(), lr=1e-2, ratio=0.5)
portable_load.load_portable(ckpt, None, model=other, optimizer=other_opt)
got = other_opt.state_dict()["state"]
outcome["latest"] = (ckpt / "latest").read_text()
outcome["loads_as_saved"] = all(p.detach().equal(w) for p, w in zip(other.parameters(), weights)) and all(
    got[i][k].equal(v) for i, entry in state.items() for k, v in entry.items())
outcome["left"] = sorted(p.name for p in ckpt.iterdir())
print(json.dumps(outcome), flush=True)
dist.destroy_process_group()
"""


def _two_ranks(script: str, *args: str) -> list[dict]:
    """`script` run as ranks 0 and 1 (each given its rank, then `args`), on the host alone: each rank's JSON line.
    A rank still running after 180 s fails the test (a rank left waiting for another at a collective)."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]  # fmt: skip
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads(log.strip().splitlines()[-1]) for log in logs]


@pytest.mark.parametrize("failing", [0, 1], ids=["rank0", "rank1"])
@pytest.mark.parametrize("what", ["twinflow.pt", "pieces", "latest", "unpicklable"])
def test_one_rank_that_cannot_write_fails_the_save_on_every_rank_and_the_previous_tag_loads(
    tmp_path: Path, what: str, failing: int
) -> None:
    """twinflow.pt and latest are rank 0's alone (rank 1 has none to fail); its pieces, any rank's. A rank that
    waited for the failed one would hang in the next collective: the test would time out instead of passing.
    `unpicklable`: rank 0's twinflow.pt fails with an error that cannot be pickled; the other rank is told of it
    by its description and raises a CheckpointError."""
    if what != "pieces" and failing == 1:
        pytest.skip("twinflow.pt and latest are written by rank 0 only")
    outcomes = _two_ranks(RANK, str(tmp_path / "rendezvous"), str(tmp_path / "ckpt"), what, str(failing))
    for outcome in outcomes:
        # every rank raised, the same type: a handler of it takes the failure on each rank alike (a rank going on
        # alone would wait for the others at its next collective)
        assert "No space left on device" in outcome["message"], outcome
        if outcome["rank"] == failing:
            assert outcome["raised"] == ("Unpicklable" if what == "unpicklable" else "OSError"), outcome
        elif what == "unpicklable":  # told by its description alone
            assert outcome["raised"] == "CheckpointError" and "failed on rank 0" in outcome["message"], outcome
        else:  # the failing rank's own error, with a note naming that rank
            assert outcome["raised"] == "OSError", outcome
            assert any(f"failed on rank {failing}" in note for note in outcome["notes"]), outcome
        assert outcome["latest"] == "old" and outcome["loads_as_saved"], outcome
    if what == "latest":  # the tag was in place when latest failed: complete, loadable by its name
        assert outcomes[0]["left"] == ["latest", "new", "old"]
    else:
        assert outcomes[0]["left"] == ["latest", "old"]  # nothing of the failed save


LOAD_RANK = r"""
import json, sys
from pathlib import Path
import torch.distributed as dist
from tests.test_portable_save_failures import make, train
from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_load

rank, rendezvous, ckpt, failing = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
model = make(0)
opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
train(model, opt, 1, 2)
portable.save_portable(ckpt, "t", model=model, optimizer=opt)
other = make(5)
other_opt = TwinFlowAdam(other.parameters(), lr=1e-2, ratio=0.5)
train(other, other_opt, 3, 1)
before = [p.detach().clone() for p in other.parameters()]
if rank == failing:  # this rank alone cannot read what the load checks first (not a CheckpointError)
    def unreadable(path, info):
        raise PermissionError(13, "Permission denied", str(path))
    portable_load.check_info = unreadable
outcome = {"rank": rank}
try:
    portable_load.load_portable(ckpt, None, model=other, optimizer=other_opt)
    outcome["raised"] = None
except BaseException as exc:
    outcome["raised"], outcome["message"] = type(exc).__name__, str(exc)
outcome["unchanged"] = all(p.detach().equal(b) for p, b in zip(other.parameters(), before))
print(json.dumps(outcome), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("failing", [0, 1], ids=["rank0", "rank1"])
def test_one_rank_that_cannot_read_what_a_load_checks_fails_the_load_on_every_rank(tmp_path: Path,
                                                                                  failing: int) -> None:  # fmt: skip
    """A load's checks gather every rank's refusal before anything changes; an error other than a refusal (a file
    this rank may not read) was raised on its rank alone, and the other was left at the gathering: here until the
    failed rank's process ended and gloo raised a lost connection (a RuntimeError); a failed rank that went on
    would have left it waiting. Now every rank raises, the others naming the failed rank."""
    for outcome in _two_ranks(LOAD_RANK, str(tmp_path / "rendezvous"), str(tmp_path / "ckpt"), str(failing)):
        assert outcome["unchanged"], outcome  # nothing changed on either rank
        if outcome["rank"] == failing:
            assert outcome["raised"] == "PermissionError", outcome
        else:
            assert outcome["raised"] == "CheckpointError", outcome
            assert f"rank {failing} refused the load (PermissionError" in outcome["message"], outcome
