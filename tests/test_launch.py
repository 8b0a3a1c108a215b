"""Launches as a cluster runs them: a job of two nodes on one host.

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
from pathlib import Path

import pytest
import torch

from tests.launch_worker import wait_for_exits

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
