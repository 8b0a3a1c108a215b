"""A rank of tests/test_portable_checkpoint.py: trains a small MLP through ``twinflow.initialize`` on gloo and saves
or resumes a portable checkpoint.

    python tests/portable_worker.py --rank R --world N --rendezvous FILE --out DIR --stage S --precision P \
        (--save CKPT | --load CKPT) [--ratio X]

Every optimizer step's global batch is the same whatever the world size (GLOBAL samples, each rank its slice),
so runs of different world sizes train alike up to the order of their sums. ``--save``: trains BEFORE steps,
saves the portable checkpoint, trains AFTER more (the uninterrupted run); ``--load``: loads it and trains the
AFTER steps. Rank 0 writes each step's global loss (the ranks' mean) to DIR/losses.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from launch_worker import WIDTH, Net  # the same residual MLP as the launch tests' ranks

import twinflow

GLOBAL = 4  # samples of a step's batch, whatever the world size
BEFORE, AFTER = 3, 3


def config(stage: int, precision: str, ratio: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_max_lr": 3e-3,
                                                           "warmup_num_steps": 2, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": ratio}},
        "offload_state_precision": precision,
    }  # fmt: skip


def train(engine, steps: range, rank: int, world: int, device: torch.device) -> list[float]:  # noqa: ANN001
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(500 + step)
        x, y = torch.randn(GLOBAL, WIDTH, generator=gen), torch.randn(GLOBAL, 8, generator=gen)
        share = GLOBAL // world
        x, y = x[rank * share : (rank + 1) * share].to(device), y[rank * share : (rank + 1) * share].to(device)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _sums_late(rank: int) -> None:
    """Rank 1 writes its sums only once rank 0 is waiting for the save to end (a marker file), and then once rank
    0 has written ``latest`` (or 2 s have passed): a save whose rank 0 puts the tag in place as soon as its own
    write has ended is caught in the act. Rank 0 leaves the marker."""
    from twinflow.checkpoint import portable

    if rank == 0:
        wait = portable.PendingSave.wait

        def marked(self: portable.PendingSave) -> Path:
            (self.final.parent / "rank0-waits").touch()
            return wait(self)

        portable.PendingSave.wait = marked
        return
    write = portable.write_sums

    def late(folder: Path, rank: int, world: int) -> None:
        while not (folder.parent / "rank0-waits").exists():
            time.sleep(0.05)
        deadline = time.monotonic() + 2
        while not (folder.parent / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        write(folder, rank, world)

    portable.write_sums = late


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--stage"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: rank r drives cuda:r")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--asynchronous", action="store_true", help="--save: written while training goes on")
    parser.add_argument("--warm-save", action="store_true",
                        help="--save: an asynchronous save after the first step as well (tag 'warm'): the next "
                        "asynchronous save copies into the host copies it kept")  # fmt: skip
    args = parser.parse_args()
    os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(args.rank),
                      LOCAL_WORLD_SIZE=str(args.world))  # fmt: skip
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(args.backend, init_method=f"file://{args.rendezvous}", rank=args.rank,
                                         world_size=args.world)  # fmt: skip
    if os.environ.get("PORTABLE_LATE_SUMS") and args.save:
        _sums_late(args.rank)
    torch.manual_seed(0 if args.save else 9)  # resumed: other weights, all must come from the load
    engine, *_ = twinflow.initialize(model=Net().to(device), config=config(args.stage, args.precision, args.ratio))
    report: dict = {}
    if args.save:
        first = 1 if args.warm_save else BEFORE
        report["before"] = train(engine, range(first), args.rank, args.world, device)
        if args.warm_save:
            engine.save_checkpoint(args.save, "warm", asynchronous=True)
            report["before"] += train(engine, range(first, BEFORE), args.rank, args.world, device)
        engine.save_checkpoint(args.save, "moved", asynchronous=args.asynchronous)
        if args.warm_save:
            from twinflow.checkpoint import portable

            report["reused"] = portable.reused_copy_bytes()
        if os.environ.get("PORTABLE_DEBUG"):
            sd = engine.local_optimizer.state_dict()
            for i, e in list(sd["state"].items())[:2]:
                print("rank", args.rank, i, {k: (tuple(v.shape), float(v.float().abs().sum())) for k, v in e.items()})
            print("rank", args.rank, "groups", [(g["lr"], g["params"]) for g in sd["param_groups"]])
        report["after"] = train(engine, range(BEFORE, BEFORE + AFTER), args.rank, args.world, device)
        engine.wait_checkpoint()
        if args.warm_save:  # the host copies kept for the next asynchronous save, and freed
            report["kept"] = portable.kept_copy_bytes()
            engine.wait_checkpoint(release_memory=True)
            report["kept_after_release"] = portable.kept_copy_bytes()
    else:
        engine.load_checkpoint(args.load)
        if os.environ.get("PORTABLE_DEBUG"):
            sd = engine.local_optimizer.state_dict()
            for i, e in list(sd["state"].items())[:2]:
                print("rank", args.rank, i, {k: (tuple(v.shape), float(v.float().abs().sum())) for k, v in e.items()})
            print("rank", args.rank, "groups", [(g["lr"], g["params"]) for g in sd["param_groups"]])
        report["global_steps"] = engine.global_steps
        report["after"] = train(engine, range(BEFORE, BEFORE + AFTER), args.rank, args.world, device)
    if args.rank == 0:
        (args.out / "losses.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
