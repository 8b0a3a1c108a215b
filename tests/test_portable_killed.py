"""Portable saves (twinflow.checkpoint.portable) killed for real, with SIGKILL, at each point of the save.

The promise under test: the tag is written under ``<tag>.saving``, renamed into place once DCP's metadata and every
rank's sums are written, then ``latest`` is written atomically (a tag saved again: its old folder is ``<tag>.old``
meanwhile); a save killed at any point leaves the previous tags loadable, exactly as saved, and the next save
removes what the killed one left.

Run as a script, this file is the process that dies (nothing waits for a time: each process SIGKILLs itself from
inside the function it is in at that point, and the test waits for processes to exit):

    python tests/test_portable_killed.py one ROOT JOBS     forks a child per job (imports made once); each trains,
                                                           saves "a", trains on and is killed saving "b" or "a"
    torchrun --nproc-per-node 2 tests/test_portable_killed.py two DIR
                                                           2 ranks (gloo, FSDP2) save "a"; rank 1 is killed in the
                                                           middle of its pieces of "b"; torchrun stops rank 0
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_load, portable_state

ROOT = Path(__file__).resolve().parent.parent
PRECISIONS = ["fp32", "int8_m24"]
# Where the save is killed, in the order the save reaches them
POINTS = [
    "pieces",  # DCP is writing the pieces: the third tensor is asked for (two files written, the third opened)
    "sums",  # DCP's .metadata has landed in <tag>.saving; the sums are not written
    "before_rename",  # the sums are written; <tag>.saving not yet renamed (a re-save: the old tag is <tag>.old)
    "before_latest",  # <tag> is in place; latest not yet written
    "latest_temp",  # latest's temporary is written and flushed, not yet renamed over latest
    "after_latest",  # latest names <tag>; a re-save's <tag>.old is not yet removed
]
LANDED = {"before_latest", "latest_temp", "after_latest"}  # the new tag is complete in place


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str, pieces: int = 3) -> None:
    """From now on this process SIGKILLs itself at `point` of the next portable save (`pieces`: the tensor DCP
    asks for that it dies at): the function the save calls there is wrapped, in this process only."""
    if point == "pieces":
        resolve, asked = portable_state.ReadWhenWritten.resolve_data, []

        def resolve_then_die(self: Any, item: Any) -> Any:
            asked.append(item.index.fqn)
            if len(asked) == pieces:
                print(json.dumps({"killed_at": item.index.fqn}), flush=True)
                die()
            return resolve(self, item)

        portable_state.ReadWhenWritten.resolve_data = resolve_then_die
    elif point == "sums":
        portable.write_sums = lambda *args: die()
    elif point in ("before_rename", "before_latest"):  # the rename of <tag>.saving to <tag>
        rename = pathlib.Path.rename

        def rename_around(self: Path, target: Any) -> Any:
            moved = self.name.endswith(portable.SAVING)
            if moved and point == "before_rename":
                die()
            done = rename(self, target)
            if moved:
                die()
            return done

        pathlib.Path.rename = rename_around
    else:  # latest's temporary renamed over latest
        replace = os.replace

        def replace_around(src: Any, dst: Any) -> None:
            if Path(dst).name == "latest" and point == "latest_temp":
                die()
            replace(src, dst)
            if Path(dst).name == "latest":
                die()

        os.replace = replace_around


def build(precision: str, seed: int) -> tuple[torch.nn.Module, TwinFlowAdam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    return model, TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, state_precision=precision)


def train(model: torch.nn.Module, opt: TwinFlowAdam, steps: range) -> None:
    for step in steps:
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(100 + step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The weights and the optimizer's state_dict, copied (int8_m24: its state decoded, as state_dict gives it)."""
    if callable(getattr(opt, "synchronize", None)):
        opt.synchronize()  # what a save writes: every update taken
    weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
    state = opt.state_dict()
    return {"model": weights, "state": {i: {k: v.clone() for k, v in e.items()} for i, e in state["state"].items()},
            "groups": state["param_groups"]}  # fmt: skip


def assert_same(found: dict[str, Any], expected: dict[str, Any]) -> None:
    """Bit for bit: every weight, every state tensor, every hyper-parameter."""
    assert found["model"].keys() == expected["model"].keys()
    assert all(torch.equal(found["model"][k], v) for k, v in expected["model"].items())
    assert found["state"].keys() == expected["state"].keys()
    for i, entry in expected["state"].items():
        assert found["state"][i].keys() == entry.keys()
        assert all(torch.equal(found["state"][i][k], v) for k, v in entry.items()), (i, list(entry))
    assert found["groups"] == expected["groups"]


def one_job(folder: Path, precision: str, tag: str, point: str) -> None:
    """A child of the driver: saves "a" completely, trains on and is killed saving `tag` at `point`. What "a" and
    the killed save hold is written to A.pt and B.pt first."""
    model, opt = build(precision, 0)
    train(model, opt, range(2))
    portable.save_portable(folder / "ckpt", "a", model=model, optimizer=opt)
    torch.save(snapshot(model, opt), folder / "A.pt")
    train(model, opt, range(2, 3))
    torch.save(snapshot(model, opt), folder / "B.pt")
    arm(point)
    portable.save_portable(folder / "ckpt", tag, model=model, optimizer=opt)


def drive(root: Path, jobs: list[list[str]]) -> None:
    """The driver: imports once, then forks a child per job, as many at once as this process has CPUs; prints each
    job's exit code (-9: SIGKILL)."""
    torch.set_num_threads(1)  # no thread pool to inherit: the children fork from a process that only imported
    from twinflow.host import ops

    ops.load()
    codes: dict[str, int] = {}
    running: dict[int, str] = {}
    for job in [*jobs, None]:
        while running and (job is None or len(running) >= len(os.sched_getaffinity(0))):
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        if job is None:
            break
        name = "-".join(job)
        (root / name).mkdir()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                one_job(root / name, *job)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(3)  # not killed: the save never reached the point
        running[pid] = name
    print(json.dumps(codes), flush=True)


def two_ranks(directory: Path) -> None:
    """A rank under torchrun (see the module's docstring)."""
    from launch_worker import Net, config
    from launch_worker import train as train_engine

    import twinflow

    torch.distributed.init_process_group("gloo")
    rank, ckpt, cpu = torch.distributed.get_rank(), directory / "ckpt", torch.device("cpu")
    torch.manual_seed(0)
    engine, *_ = twinflow.initialize(model=Net(), config=config(3, "int8_m24"))
    train_engine(engine, range(3), cpu)
    engine.save_checkpoint(ckpt, "a")
    if rank == 0:  # a copy of "a" to compare with, made before the killed save begins
        shutil.copytree(ckpt / "a", directory / "reference" / "a")
        shutil.copy(ckpt / "latest", directory / "reference" / "latest")
    train_engine(engine, range(3, 5), cpu)
    torch.distributed.barrier()
    if rank == 1:
        arm("pieces")
    engine.save_checkpoint(ckpt, "b")
    sys.exit(f"rank {rank}: the save of b finished, and no rank was killed during it")


# --------------------------------------------------------------------------------------------- one process

JOBS = [[precision, tag, point] for precision in PRECISIONS for tag in ("b", "a") for point in POINTS]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per job, a folder with what the killed child left: ckpt/, and A.pt, B.pt (the states of "a" and of the
    killed save)."""
    root = tmp_path_factory.mktemp("killed")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "CUDA_VISIBLE_DEVICES": "",  # the children are forked: no CUDA there (DCP's writer asks for a stream on one)
    }
    child = subprocess.run([sys.executable, __file__, "one", str(root), json.dumps(JOBS)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=900)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    codes = json.loads(child.stdout.splitlines()[-1])
    assert codes == {"-".join(job): -signal.SIGKILL for job in JOBS}, child.stderr[-3000:]
    return root


def left_behind(directory: Path, tags: set[str]) -> tuple[set[str], set[str]]:
    """(names in `directory` beside the `tags` and latest, temporaries' pid and host elided; `tags` missing)."""
    names = {p.name for p in directory.iterdir()}
    extra = {re.sub(r"\.tmp\d+@.*$", ".tmp*", name) for name in names - tags - {"latest"}}
    return extra, tags - names


@pytest.mark.parametrize("next_save", ["new_tag", "same_tag"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("tag", ["b", "a"], ids=["new_tag_b", "tag_a_again"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_save_killed_at_any_point_leaves_the_saved_tags_exact_and_the_next_save_removes_what_it_left(
    killed: Path, tmp_path: Path, precision: str, tag: str, point: str, next_save: str
) -> None:
    source = killed / f"{precision}-{tag}-{point}"
    directory = tmp_path / "ckpt"
    shutil.copytree(source / "ckpt", directory)
    A, B = (torch.load(source / name, weights_only=True) for name in ("A.pt", "B.pt"))
    assert not torch.equal(A["model"]["0.weight"], B["model"]["0.weight"])  # the killed save held a newer state
    landed = point in LANDED
    holds = {"a": B if tag == "a" and landed else A} | ({"b": B} if tag == "b" and landed else {})
    latest = tag if point == "after_latest" else "a"

    # What the kill left: the save got exactly as far as `point`
    assert (directory / "latest").read_text() == latest
    saving = directory / f"{tag}{portable.SAVING}"
    assert saving.is_dir() == (not landed)
    if not landed:
        written = [p for p in saving.glob("__0_*.distcp") if p.stat().st_size]
        assert (saving / ".metadata").is_file() == (point != "pieces")
        assert (saving / "twinflow.sums.0.json").is_file() == (point == "before_rename")
        if point == "pieces":  # in the middle: some pieces written, not all
            assert 0 < len(written) < len(list((directory / "a").glob("__0_*.distcp")))
    old = tag == "a" and point in {"before_rename", *LANDED}
    assert (directory / f"a{portable.OLD}").is_dir() == old
    assert (directory / "a").is_dir() == (tag == "b" or point != "before_rename")
    assert (directory / "b").is_dir() == (tag == "b" and landed)
    temps = list(directory.glob(".latest.tmp*"))
    assert len(temps) == (point == "latest_temp") and all(t.read_text() == tag for t in temps)

    # latest loads, in a fresh process's model and optimizer: the previous tag, or the new one once it landed
    model, opt = build(precision, 9)
    assert not torch.equal(model.state_dict()["0.weight"], holds[latest]["model"]["0.weight"])
    portable_load.load_portable(directory, model=model, optimizer=opt)
    assert_same(snapshot(model, opt), holds[latest])

    # the next save succeeds, and every tag then loads as it was saved
    next_tag = tag if next_save == "same_tag" else "c"
    portable.save_portable(directory, next_tag, model=model, optimizer=opt)
    holds[next_tag] = holds[latest]
    assert (directory / "latest").read_text() == next_tag
    for name, expected in holds.items():
        other, other_opt = build(precision, 9)
        portable_load.load_portable(directory, name, model=other, optimizer=other_opt)
        assert_same(snapshot(other, other_opt), expected)
    # ... and nothing of the killed save is left: no <tag>.saving, <tag>.old or temporary
    assert left_behind(directory, set(holds)) == (set(), set())


# --------------------------------------------------------------------------------------------- two ranks


def test_a_rank_killed_in_its_pieces_stops_the_job_and_the_previous_tag_loads_exactly(tmp_path: Path) -> None:
    """2 ranks (torchrun, gloo, FSDP2, int8_m24) save "a", train on, save "b": rank 1 SIGKILLs itself while DCP
    writes its pieces. torchrun sees it die and stops rank 0 (the safety net's timeout is never the verdict); "a"
    is as it was, latest names it, and it loads on one process exactly as a copy of it made before the save; the
    next save removes b.saving."""
    from tests.launch_worker import Net

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              __file__, "two", str(tmp_path)], stdout=out, stderr=subprocess.STDOUT, env=env,
                             cwd=ROOT, timeout=600)  # fmt: skip
    text = log.read_text(errors="replace")
    assert run.returncode != 0 and "the save of b finished" not in text, text[-4000:]
    # rank 1 died by its own SIGKILL amid its pieces (only rank 1 is armed), as torchrun reports it
    assert '{"killed_at": ' in text and re.search(r"rank\s*:\s*1\b.*\n\s*exitcode\s*:\s*-9\b", text), text[-4000:]
    ckpt, reference = tmp_path / "ckpt", tmp_path / "reference"
    assert (ckpt / "latest").read_text() == "a" and not (ckpt / "b").exists()
    assert not (ckpt / f"b{portable.SAVING}" / ".metadata").exists()  # (rank 0 stopped before or after removing it)
    files = sorted(p.name for p in (reference / "a").iterdir())
    assert files == sorted(p.name for p in (ckpt / "a").iterdir())  # "a" byte for byte as it was before the save
    assert all((ckpt / "a" / name).read_bytes() == (reference / "a" / name).read_bytes() for name in files)

    def loaded(directory: Path, seed: int) -> tuple[torch.nn.Module, TwinFlowAdam, dict[str, Any]]:
        torch.manual_seed(seed)
        model = Net()
        opt = TwinFlowAdam(model.parameters(), lr=3e-3, ratio=0.5, state_precision="int8_m24")
        fresh = snapshot(model, opt)
        portable_load.load_portable(directory, model=model, optimizer=opt)
        found = snapshot(model, opt)
        assert not any(torch.equal(found["model"][k], v) for k, v in fresh["model"].items() if v.numel() > 1)
        return model, opt, found

    model, opt, found = loaded(ckpt, 7)
    assert_same(found, loaded(reference, 8)[2])
    assert found["state"] and all(e["step"].item() == 3 for e in found["state"].values())
    portable.save_portable(ckpt, "c", model=model, optimizer=opt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["a", "c", "latest"]
    assert_same(loaded(ckpt, 9)[2], found)


if __name__ == "__main__":
    if sys.argv[1] == "one":
        drive(Path(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        two_ranks(Path(sys.argv[2]))
