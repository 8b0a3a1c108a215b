"""The ranks of tests/test_launch.py: a training process, and a server that forks ranks from one import.

    python tests/launch_worker.py train --out DIR --steps N --expect-local-ranks K      (a rank, under torchrun)
    python tests/launch_worker.py serve                                             (the fork server, below)

A rank trains a small residual MLP through ``twinflow.initialize`` (gloo on the CPU; --backend nccl: rank r
drives cuda:LOCAL_RANK) and writes ``rank<r>.json`` into --out. Every step's samples depend on the step and the
rank only, so launches of the same world size train alike. Its modes:

- ``train``: trains --steps steps; records its losses and its launch's ranks, after checking that twinflow's
  local ranks are this node's processes.
- ``die-saving``: trains, saves tag A, trains on (its losses recorded first), then saves tag B, during which
  rank --kill-rank SIGKILLs itself halfway through writing its shard (--kill shard) or, rank 0, meta.json
  (--kill meta) or ``latest`` (--kill latest, before its first byte): the function that writes the file is
  wrapped in that process, no timing involved.
- ``resume``: loads the checkpoint directory's latest, trains the steps that followed A and saves tag C.

``serve`` imports torch and twinflow once, then answers requests on stdin, one JSON line each: ``{"world":
n, "argv": [...], "logs": [a file per rank]}``. For each it forks (NCCL: spawns) n fresh ranks (RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE set; output to the rank's log) that run ``argv`` (with --rendezvous, a file
for ``init_process_group``), waits for them (:func:`wait_for_exits`) and answers ``{"codes": [...], "pids":
[...]}``: the exit codes, -9 for SIGKILL. Forking from a process that has only imported (no parallel region
yet) saves each rank the seconds of its imports; NCCL ranks are spawned instead, since the imports may have
touched CUDA, which a forked child cannot use again.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.fsdp  # noqa: F401 - imported before the fork server forks: each rank starts warm

import twinflow
from twinflow.checkpoint import checkpoint
from twinflow.host import ops
from twinflow.plan import host

WIDTH, DEPTH, MICRO, ACCUMULATION = 48, 3, 2, 2
STEPS_TO_A, STEPS_AFTER_A = 3, 3  # optimizer steps before tag A, and from A to the save of B


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


class DyingFile:
    """A file this process writes up to byte `limit`: the write that would pass it writes up to it, flushes,
    says on stdout which file it was, and SIGKILLs this process."""

    def __init__(self, f: IO[bytes], limit: int) -> None:
        self.f, self.limit = f, limit

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        room = self.limit - self.f.tell()
        if len(view) <= room:
            return self.f.write(view)
        self.f.write(view[: max(room, 0)])
        self.f.flush()
        print(json.dumps({"killed_writing": self.f.name, "bytes": self.limit}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    def __getattr__(self, name: str) -> Any:  # tell, seek, flush, fileno: the file's own
        return getattr(self.f, name)


def die_while_writing(kind: str, limit: int) -> None:
    """From now on this process dies `limit` bytes into the next shard (`kind` "shard"), meta.json ("meta") or
    ``latest`` ("latest") that twinflow.checkpoint.checkpoint writes: the functions it writes them with are wrapped, in
    this process only."""

    def dying(write: Callable[[IO[bytes]], object]) -> Callable[[IO[bytes]], object]:
        return lambda f: write(DyingFile(f, limit))

    if kind == "shard":
        write_temp = checkpoint.write_temp

        def write_temp_then_die(tmp: Path, write: Callable[[IO[bytes]], object]) -> None:
            write_temp(tmp, dying(write))

        checkpoint.write_temp = write_temp_then_die
    else:
        write_atomic, name = checkpoint.write_atomic, {"meta": "meta.json", "latest": "latest"}[kind]

        def write_atomic_then_die(path: Path, write: Callable[[IO[bytes]], object]) -> None:
            write_atomic(path, dying(write) if path.name == name else write)

        checkpoint.write_atomic = write_atomic_then_die


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train", "die-saving", "resume"])
    parser.add_argument("--out", type=Path, required=True, help="where rank<r>.json goes")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--rendezvous", default=None, help="a file for init_process_group (not under torchrun)")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=4, help="train: optimizer steps")
    parser.add_argument("--expect-local-ranks", type=int, default=None, help="train: this node's processes")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--kill", choices=["shard", "meta", "latest"], default="shard")
    parser.add_argument("--kill-rank", type=int, default=1)
    return parser.parse_args(argv)


def run(argv: list[str]) -> None:
    """One rank's job (see the module's docstring); leaves the process when done."""
    args = parse(argv)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if args.rendezvous:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.distributed.init_process_group(args.backend, init_method=f"file://{args.rendezvous}", rank=rank,
                                             world_size=world)  # fmt: skip
    else:
        torch.distributed.init_process_group(args.backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0 if args.mode != "resume" else 7)  # resumed: other weights, all must come from the load
    engine, *_ = twinflow.initialize(model=Net().to(device), config=config(args.stage, args.precision))
    report: dict[str, Any] = {"rank": rank, "world": world}

    if args.mode == "train":
        # per-node budgets (host memory, the kernel's cores) divide by the node's processes, not the world's
        report |= {"local_ranks": host.local_ranks(), "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
                   "local_rank": int(os.environ["LOCAL_RANK"]), "node_rank": int(os.environ["GROUP_RANK"])}  # fmt: skip
        if args.expect_local_ranks is not None and host.local_ranks() != args.expect_local_ranks:
            sys.exit(f"rank {rank}: twinflow counts {host.local_ranks()} local ranks, this node has "
                     f"{args.expect_local_ranks} processes")  # fmt: skip
        report["losses"] = train(engine, range(args.steps), device)
    elif args.mode == "die-saving":
        train(engine, range(STEPS_TO_A), device)
        engine.save_checkpoint(args.checkpoint, "A", portable=False)
        report["losses_after_A"] = train(engine, range(STEPS_TO_A, STEPS_TO_A + STEPS_AFTER_A), device)
        (args.out / f"rank{rank}.json").write_text(json.dumps(report))
        torch.distributed.barrier()  # every rank's report written before one dies (and the others are killed)
        if rank == args.kill_rank:  # its shard: halfway, by the size of its shard of A; meta.json: 64 bytes in
            shard = (args.checkpoint / "A" / f"rank{rank}.pt").stat().st_size
            die_while_writing(args.kill, {"shard": shard // 2, "meta": 64, "latest": 0}[args.kill])
        engine.save_checkpoint(args.checkpoint, "B", portable=False)
        sys.exit(f"rank {rank}: the save of B finished, and no rank was killed during it")
    else:
        folder, _ = engine.load_checkpoint(args.checkpoint)
        report |= {"loaded": folder.name, "global_steps": engine.global_steps}
        report["losses"] = train(engine, range(STEPS_TO_A, STEPS_TO_A + STEPS_AFTER_A), device)
        engine.save_checkpoint(args.checkpoint, "C", portable=False)

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


def spawn_rank(rank: int, world: int, log: str, argv: list[str]) -> int:
    """A fresh interpreter running rank `rank` of `world` (`argv`), its output in `log`; its pid. For NCCL: a
    process forked from one whose imports touched CUDA cannot use CUDA again."""
    env = os.environ | {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world)}  # fmt: skip
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    files = [(os.POSIX_SPAWN_OPEN, 1, log, flags, 0o644), (os.POSIX_SPAWN_DUP2, 1, 2),
             (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]  # fmt: skip
    return os.posix_spawn(sys.executable, [sys.executable, __file__, *argv], env, file_actions=files)


def fork_rank(rank: int, world: int, log: str, argv: list[str]) -> int:
    """A forked process running rank `rank` of `world` (`argv`), its output in `log`; its pid. NCCL ranks are
    spawned afresh instead (:func:`spawn_rank`)."""
    if "nccl" in argv:
        return spawn_rank(rank, world, log, argv)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        out, nothing = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), os.open(os.devnull, os.O_RDONLY)
        for fd, to in ((out, 1), (out, 2), (nothing, 0)):  # stdin: the server's requests are not the rank's
            os.dup2(fd, to)
        os.close(out)
        os.close(nothing)
        os.environ |= {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)}  # fmt: skip
        run(argv)
    except SystemExit as exc:
        print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # run() leaves with os._exit(0) where it succeeds


def serve() -> None:
    """The fork server: see the module's docstring."""
    ops.load()  # the kernel's library, loaded once
    for line in sys.stdin:
        request = json.loads(line)
        world, logs = request["world"], request["logs"]
        pids = [fork_rank(rank, world, logs[rank], request["argv"]) for rank in range(world)]
        stopped = wait_for_exits(pids)
        order = stopped + [pid for pid in pids if pid not in stopped]  # the stopped first: see wait_for_exits
        codes = {pid: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in order}
        print(json.dumps({"codes": [codes[pid] for pid in pids], "pids": pids}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        run(sys.argv[1:])
