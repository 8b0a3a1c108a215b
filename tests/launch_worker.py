"""The ranks of tests/test_launch.py: a training process, under torchrun.

    python tests/launch_worker.py train --out DIR --steps N --expect-local-ranks K

A rank trains a small residual MLP through ``twinflow.initialize`` (gloo on the CPU; --backend nccl: rank r
drives cuda:LOCAL_RANK) for --steps steps and writes ``rank<r>.json`` into --out: its losses and its launch's
ranks, after checking that twinflow's local ranks are this node's processes. Every step's samples depend on the
step and the rank only, so launches of the same world size train alike. :func:`wait_for_exits` is the tests'
wait for the launches.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
from pathlib import Path
from typing import Any

import torch

import twinflow
from twinflow.plan import host

WIDTH, DEPTH, MICRO, ACCUMULATION = 48, 3, 2, 2


class Net(torch.nn.Module):
    """Residual MLP blocks in a ModuleList (FSDP2 shards each), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()) for _ in range(DEPTH)
        )
        self.head = torch.nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def config(stage: int, precision: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_max_lr": 3e-3,
                                                           "warmup_num_steps": 3, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        "offload_state_precision": precision,
    }  # fmt: skip


def micro_batches(step: int, rank: int, world: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Optimizer step `step`'s micro-batches for `rank`: its slices of the step's global batch."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ACCUMULATION, world, MICRO, WIDTH, generator=gen)
    y = torch.randn(ACCUMULATION, world, MICRO, 8, generator=gen)
    return [(x[m, rank].to(device), y[m, rank].to(device)) for m in range(ACCUMULATION)]


def train(engine: Any, steps: range, device: torch.device) -> list[float]:
    """Trains optimizer steps `steps`; every micro-batch's loss on this rank."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in steps:
        for x, y in micro_batches(step, rank, world, device):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train"])
    parser.add_argument("--out", type=Path, required=True, help="where rank<r>.json goes")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=4, help="train: optimizer steps")
    parser.add_argument("--expect-local-ranks", type=int, default=None, help="train: this node's processes")
    return parser.parse_args(argv)


def run(argv: list[str]) -> None:
    """One rank's job (see the module's docstring); leaves the process when done."""
    args = parse(argv)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(args.backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    engine, *_ = twinflow.initialize(model=Net().to(device), config=config(args.stage, args.precision))
    report: dict[str, Any] = {"rank": rank, "world": world}
    # per-node budgets (host memory, the kernel's cores) divide by the node's processes, not the world's
    report |= {"local_ranks": host.local_ranks(), "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
               "local_rank": int(os.environ["LOCAL_RANK"]), "node_rank": int(os.environ["GROUP_RANK"])}  # fmt: skip
    if args.expect_local_ranks is not None and host.local_ranks() != args.expect_local_ranks:
        sys.exit(f"rank {rank}: twinflow counts {host.local_ranks()} local ranks, this node has "
                 f"{args.expect_local_ranks} processes")  # fmt: skip
    report["losses"] = train(engine, range(args.steps), device)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()  # every rank done before any tears the group down (a lone exit can abort)
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter shutdown can abort in gloo's teardown now and then on a small machine: leave without it.
    os._exit(0)


def exited_cleanly(pidfd: int) -> bool:
    """Whether the exited process of `pidfd` returned 0 (it is left unreaped)."""
    info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT)
    return info.si_code == os.CLD_EXITED and info.si_status == 0


def wait_for_exits(pids: list[int], stop: int = signal.SIGKILL) -> list[int]:
    """Waits until the child processes `pids` have all exited, or one has failed: then sends `stop` to those
    still running (they would wait for it in a collective) and returns them. Reaps none: that is the caller's.

    Waits on each process's pidfd: a dead rank is seen at once, with no poll interval and no timeout. Reaping
    the stopped ones first keeps a failed process's pid taken until every survivor is gone, so a survivor that
    cleans up after the failure takes it for alive, however late the signal reaches the survivor.
    """
    fds = {os.pidfd_open(pid): pid for pid in pids}
    try:
        running = set(fds)
        while running:
            ready, _, _ = select.select(sorted(running), [], [])
            running -= set(ready)
            if not all(exited_cleanly(fd) for fd in ready):
                for fd in running:
                    signal.pidfd_send_signal(fd, stop)
                return [fds[fd] for fd in sorted(running)]
        return []
    finally:
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    run(sys.argv[1:])
