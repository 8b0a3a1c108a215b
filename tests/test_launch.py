"""Launches as a cluster runs them: a rank killed in the middle of a checkpoint save, and a job of two nodes.

Every rank is a process of its own running tests/launch_worker.py (gloo on the CPU; with enough GPUs, the same
tests run again on NCCL, marked ``multigpu``). Nothing here waits for a time: the test waits for processes to
exit, and a rank that dies takes the others down with it (they would otherwise wait in a collective).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.launch_worker import wait_for_exits
from twinflow.checkpoint import read_meta

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "launch_worker.py"


def backends(gpus: int) -> list:
    """gloo on the CPU; NCCL where this host has `gpus` GPUs (marked multigpu)."""
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= gpus
    nccl = pytest.param("nccl", marks=[pytest.mark.multigpu,
                                       pytest.mark.skipif(not enough, reason=f"needs {gpus} CUDA GPUs")])  # fmt: skip
    return ["gloo", nccl]


def worker_env(**extra: str) -> dict[str, str]:
    """This environment for a worker: one intra-op thread (2 ranks on a small machine, and the same sums in
    every launch) unless the caller set OMP_NUM_THREADS."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env | extra


@pytest.fixture(scope="module")
def fork_server() -> Iterator[subprocess.Popen]:
    """tests/launch_worker.py's fork server: fresh ranks without each importing torch and twinflow again."""
    server = subprocess.Popen([sys.executable, str(WORKER), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=worker_env(), cwd=ROOT, text=True)  # fmt: skip
    yield server
    server.stdin.close()  # the server ends with its input
    server.wait()


def run_ranks(
    server: subprocess.Popen, tmp_path: Path, name: str, world: int, *argv: str
) -> tuple[list[int], list[str]]:
    """`world` fresh ranks of the worker's `argv`, run together until all have exited or one has failed (the
    rest are then killed); their exit codes (-9: SIGKILL) and their output."""
    logs = [tmp_path / f"{name}-rank{rank}.log" for rank in range(world)]
    argv = (*argv, "--rendezvous", str(tmp_path / f"rendezvous-{name}"))
    server.stdin.write(json.dumps({"world": world, "argv": argv, "logs": list(map(str, logs))}) + "\n")
    server.stdin.flush()
    answer = server.stdout.readline()
    assert answer, f"the fork server ended (exit code {server.wait()})"
    return json.loads(answer)["codes"], [log.read_text(errors="replace") for log in logs]


def files_under(directory: Path) -> set[str]:
    """Every file below `directory`, relative to it (hidden ones too)."""
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if not p.is_dir()}


def folders_under(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_dir()}


# (ZeRO stage, state precision, what the killed rank was writing: its shard, or rank 0's meta.json or latest)
CASES = [(3, "int8_m24", "shard"), (3, "fp32", "shard"), (0, "int8_m24", "shard"), (0, "fp32", "shard"),
         (3, "int8_m24", "meta"), (0, "fp32", "latest")]  # fmt: skip


@pytest.mark.parametrize("backend", backends(2))
@pytest.mark.parametrize(("stage", "precision", "kill"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_a_rank_killed_during_a_save_leaves_the_last_checkpoint(
    fork_server: subprocess.Popen, tmp_path: Path, backend: str, stage: int, precision: str, kill: str
) -> None:
    """2 ranks save A, train on, then save B; one rank SIGKILLs itself in the middle of writing its shard (or,
    rank 0, meta.json or latest). Fresh ranks resume from the latest, A, with the losses of the run that went
    on from A, and their save of C leaves the directory holding A and C (and B, had it been completed) and
    nothing else of B's save."""
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    kill_rank = 1 if kill == "shard" else 0
    flags = ["--checkpoint", str(ckpt), "--stage", str(stage), "--precision", precision, "--backend", backend]
    codes, logs = run_ranks(fork_server, tmp_path, "first", 2, "die-saving", "--out", str(first), *flags,
                            "--kill", kill, "--kill-rank", str(kill_rank))  # fmt: skip
    died = [json.loads(line) for line in logs[kill_rank].splitlines() if line.startswith('{"killed_writing"')]
    assert codes[kill_rank] == -signal.SIGKILL and len(died) == 1, logs[kill_rank][-3000:]
    assert all(code != 0 for code in codes), logs  # the other rank could not finish the save without it
    after_a = [json.loads((first / f"rank{r}.json").read_text())["losses_after_A"] for r in range(2)]

    # What the killed save left: A complete and latest; the killed rank's partly written temporary
    partial = Path(died[0]["killed_writing"])
    assert partial.is_file() and partial.stat().st_size == died[0]["bytes"] and partial.name.startswith(".")
    assert partial.parent == (ckpt / "B" if kill == "meta" else ckpt)
    assert (ckpt / "latest").read_text() == "A" and read_meta(ckpt)[0] == "A"
    assert files_under(ckpt / "A") == {"meta.json", "rank0.pt", "rank1.pt"}
    if kill == "shard":  # shards are staged beside the tag folders: B was never made
        assert not (ckpt / "B").exists()
    elif kill == "meta":  # both shards were in B when rank 0 died writing its meta.json
        assert "rank0.pt" in files_under(ckpt / "B") and "meta.json" not in files_under(ckpt / "B")
    else:  # B is complete, but latest was not yet renamed to name it
        assert read_meta(ckpt, "B")[1]["world_size"] == 2

    codes, logs = run_ranks(fork_server, tmp_path, "second", 2, "resume", "--out", str(second), *flags)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    resumed = [json.loads((second / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["loaded"] for r in resumed] == ["A", "A"] and [r["global_steps"] for r in resumed] == [3, 3]
    assert [r["losses"] for r in resumed] == after_a  # bit for bit: the state of A, loaded on every rank
    removed = "".join(line for log in logs for line in log.splitlines() if "removed what interrupted" in line)
    assert partial.name in removed and (kill != "meta" or "incomplete checkpoint 'B'" in removed), logs
    tags = ["A", "B", "C"] if kill == "latest" else ["A", "C"]
    kept = {f"{tag}/{name}" for tag in tags for name in ("meta.json", "rank0.pt", "rank1.pt")}
    assert files_under(ckpt) == kept | {"latest"}  # no temporary, no marker, nothing of an unfinished B
    assert folders_under(ckpt) == set(tags) and read_meta(ckpt)[0] == "C"


def read_log(out: Path) -> str:
    return (out / "torchrun.log").read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, *launch: str, backend: str, env: dict[str, str], local_ranks: int) -> subprocess.Popen:
    """``python -m torch.distributed.run`` with `launch`'s flags over the worker's ``train``, writing into `out`."""
    out.mkdir()
    with open(out / "torchrun.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *launch, str(WORKER), "train", "--out", str(out),
             "--steps", "4", "--expect-local-ranks", str(local_ranks), "--backend", backend],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip


@pytest.mark.parametrize("backend", backends(4))
def test_two_nodes_on_one_host_train_like_one_node(tmp_path: Path, backend: str) -> None:
    """torchrun --nnodes 2 (a node of 1 process each on the CPU; of 2 GPUs each on GPUs) against one
    --standalone launch of as many processes: the same ranks and samples, the same losses, and each process
    counts its own node's processes as its local ranks (the per-node budgets divide by them)."""
    per_node = 1 if backend == "gloo" else 2
    world = 2 * per_node
    gpus = [",".join(map(str, range(n * per_node, (n + 1) * per_node))) for n in range(2)]

    def env(node_gpus: str) -> dict[str, str]:
        return worker_env(**({"CUDA_VISIBLE_DEVICES": node_gpus} if backend == "nccl" else {}))

    port = str(free_port())
    launches = [torchrun(tmp_path / f"node{n}", "--nnodes", "2", "--nproc-per-node", str(per_node), "--node-rank",
                         str(n), "--master-addr", "127.0.0.1", "--master-port", port, backend=backend,
                         env=env(gpus[n]), local_ranks=per_node) for n in range(2)]  # fmt: skip
    if backend == "gloo":  # alongside: on the CPU they do not compete for devices
        launches.append(torchrun(tmp_path / "one", "--standalone", "--nproc-per-node", str(world), backend=backend,
                                 env=env(""), local_ranks=world))  # fmt: skip
    wait_for_exits([launch.pid for launch in launches], stop=signal.SIGTERM)  # torchrun stops its workers on it
    if backend == "nccl":
        launches.append(torchrun(tmp_path / "one", "--standalone", "--nproc-per-node", str(world), backend=backend,
                                 env=env(",".join(gpus)), local_ranks=world))  # fmt: skip
    codes = [launch.wait() for launch in launches]
    assert codes == [0, 0, 0], "\n".join(read_log(tmp_path / out) for out in ("node0", "node1", "one"))

    def reports(*outs: Path) -> dict[int, dict]:
        found = [json.loads(path.read_text()) for out in outs for path in sorted(out.glob("rank*.json"))]
        return {r["rank"]: r for r in found}

    two_nodes, one_node = reports(tmp_path / "node0", tmp_path / "node1"), reports(tmp_path / "one")
    assert sorted(two_nodes) == sorted(one_node) == list(range(world))
    for rank, report in two_nodes.items():  # node n holds ranks n * per_node ...: the same ranks as one node
        assert report["rank"] == report["node_rank"] * per_node + report["local_rank"]
        assert (tmp_path / f"node{report['node_rank']}" / f"rank{rank}.json").is_file()
        assert report["local_ranks"] == report["local_world_size"] == per_node
    assert [r["local_ranks"] for r in one_node.values()] == [world] * world
    tolerance = 1e-6 if backend == "gloo" else 1e-4
    for rank in range(world):
        want = one_node[rank]["losses"]
        assert len(want) == 8 and len(set(want)) == 8  # a real run: every micro-batch's loss differs
        assert two_nodes[rank]["losses"] == pytest.approx(want, rel=tolerance, abs=tolerance)
