"""A checkpoint that moves, measured: an OPT model saved by N ranks and resumed by M, under torchrun.

    # the run that saves: BEFORE steps, a timed save, then AFTER more steps (the uninterrupted run)
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_resume.py --model opt-13b \
        --config benchmarks/configs/opt-13b-x4-compact-auto.json --ckpt /tmp/ckpt --save --out save4.json
    # the runs that resume: a timed load, then the same AFTER steps, compared with the saving run's
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_resume.py --model opt-13b \
        --config benchmarks/configs/opt-13b-x4-compact-auto.json --ckpt /tmp/ckpt --load --reference save4.json \
        --out load2.json

Every step's global batch is the same whatever the world size (--global-batch sequences, each rank its slice, a
micro-batch of global / world and no accumulation), so runs of different world sizes train alike up to the order
of their sums; the loss is the ranks' mean. ``--asynchronous`` (with --save): after the uninterrupted steps, an
asynchronous save and --async-steps steps while it is written, timed against the uninterrupted steps;
``--async-only``: the save itself is asynchronous and the AFTER steps run while it is written (a machine whose
disk holds one checkpoint: OPT-13B's portable one is 169 GB on a 235 GB disk). The
config's ``offload_ratio`` ("auto": each world size plans its own) and ``offload_state_precision`` apply as
given. Writes JSON (--out, else $OUT, else benchmarks/results/): losses, step times, the save's or load's seconds
and the peak host memory during it (this rank's resident size and the machine's used memory, sampled every
20 ms), for every rank; a save's row on rank 0 also has the tag's bytes on disk (``checkpoint_bytes``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
import twinflow  # noqa: E402
from benchmarks.common import machine_info, proc_status_bytes, write_json  # noqa: E402
from twinflow.checkpoint import portable_load  # noqa: E402
from twinflow.models import build_opt  # noqa: E402

GIB = 2**30


def machine_used_bytes() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            info[name] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


class HostPeak:
    """The peak of this process's resident memory and of the machine's used memory while the block runs."""

    def __init__(self, every: float = 0.02) -> None:
        self.every, self.rank_peak, self.machine_peak = every, 0, 0
        self.done = threading.Event()

    def sample(self) -> None:
        self.rank_peak = max(self.rank_peak, proc_status_bytes("VmRSS"))
        self.machine_peak = max(self.machine_peak, machine_used_bytes())

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.sample()

    def __enter__(self) -> HostPeak:
        self.before_rank, self.before_machine = proc_status_bytes("VmRSS"), machine_used_bytes()
        self.sample()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
        self.done.set()
        self.thread.join()
        self.sample()

    def report(self) -> dict:
        return {"seconds": self.seconds, "rank_peak_gib": self.rank_peak / GIB,
                "rank_above_start_gib": (self.rank_peak - self.before_rank) / GIB,
                "machine_used_peak_gib": self.machine_peak / GIB,
                "machine_above_start_gib": (self.machine_peak - self.before_machine) / GIB}  # fmt: skip


@contextlib.contextmanager
def profiled(on: bool, row: dict, key: str) -> Iterator[None]:
    """With `on`, the block's 30 functions of most cumulative time and 15 of most own time (cProfile) as row[key]'s
    lines."""
    if not on:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        # Python 3.12's profiler sees every thread (the host-memory sampler's too): twinflow's own calls, and who
        # called the costliest of them, say where the block's time went
        stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
        stats.print_stats("twinflow/", 45)
        stats.print_callers("twinflow/.*(write|put_into|put_as_kept|__init__|_read)", 12)
        row[key] = text.getvalue().splitlines()


def batch(step: int, rank: int, world: int, global_batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Step `step`'s global batch (the same for every world size), this rank's slice of it."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=gen)
    stride = torch.randint(1, 8, (global_batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq)) % vocab
    share = global_batch // world
    return tokens[rank * share : (rank + 1) * share]


def train(engine, steps: range, args, rank: int, world: int, device: str, vocab: int) -> tuple[list, list]:  # noqa: ANN001
    """The steps' global losses (the ranks' mean) and seconds."""
    losses, seconds = [], []
    for step in steps:
        start = time.perf_counter()
        tokens = batch(step, rank, world, args.global_batch, args.seq_len, vocab).to(device)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        seconds.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}, {seconds[-1]:.3f} s", flush=True)
    return losses, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-125m")
    parser.add_argument("--config", required=True, help="DeepSpeed-style JSON; its micro-batch is set here")
    parser.add_argument("--ckpt", required=True, type=Path)
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--save", action="store_true")
    how.add_argument("--load", action="store_true")
    parser.add_argument("--tag", default="moved")
    parser.add_argument("--before", type=int, default=5, help="steps before the save")
    parser.add_argument("--after", type=int, default=5, help="steps after the save, or after the load")
    parser.add_argument("--asynchronous", action="store_true", help="--save: then an asynchronous save, timed")
    parser.add_argument("--async-steps", type=int, default=3)
    parser.add_argument("--async-only", action="store_true",
                        help="--save: the save is asynchronous, the AFTER steps run while it is written")  # fmt: skip
    parser.add_argument(
        "--async-saves",
        type=int,
        default=1,
        help="--async-only: that many asynchronous saves, each with AFTER steps while it is written",
    )
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--reference", type=Path, help="--load: the saving run's JSON, to compare the losses with")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--read-threads",
        type=int,
        default=None,
        help="--load: the threads the load copies mapped files on (default: the library's)",
    )
    parser.add_argument("--profile", action="store_true",
                        help="the 30 costliest calls of the load and of the first step after it (which builds "
                             "the state under ratio='auto'), or of the (last) asynchronous save call")  # fmt: skip
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.global_batch % world:
        parser.error(f"--global-batch {args.global_batch} is not a multiple of the world size {world}")
    config = json.loads(Path(args.config).read_text())
    config.update(train_micro_batch_size_per_gpu=args.global_batch // world, gradient_accumulation_steps=1)
    if "LOCAL_RANK" in os.environ:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    torch.manual_seed(0 if args.save else 1)  # resumed: other weights, every one must come from the load
    model = build_opt(args.model, device, dtype)
    vocab = model.config.vocab_size
    start = time.perf_counter()
    engine, *_ = twinflow.initialize(model=model, config=config)
    row: dict = {"rank": rank, "world_size": world, "initialize_s": time.perf_counter() - start}
    if args.save:
        before = train(engine, range(args.before), args, rank, world, device, vocab)
        row["losses_before"], row["seconds_before"] = before
        after = range(args.before, args.before + args.after)
        if args.async_only:  # --async-saves times over: the call, then the AFTER steps while it is written
            normal = statistics.median(row["seconds_before"][1:] or row["seconds_before"])
            for n in range(args.async_saves):
                again = f"_{n + 1}" if n else ""  # a later save's figures: the copies the one before kept
                last = n == args.async_saves - 1
                with HostPeak() as peak, profiled(args.profile and last, row, "async_save_call_profile"):
                    engine.save_checkpoint(args.ckpt, args.tag, asynchronous=True)
                row["async_save_call" + again] = peak.report()
                first = args.before + n * args.after
                with HostPeak() as peak:
                    losses, seconds = train(engine, range(first, first + args.after), args, rank, world, device, vocab)
                    engine.wait_checkpoint()
                if not n:
                    row["losses_after"], row["seconds_after"] = losses, seconds
                row["async_steps_and_wait" + again] = peak.report()
                row["async_step_over_normal" + again] = statistics.median(seconds) / normal
        else:
            with HostPeak() as peak:
                engine.save_checkpoint(args.ckpt, args.tag)
            row["save"] = peak.report()
            row["losses_after"], row["seconds_after"] = train(engine, after, args, rank, world, device, vocab)
        if rank == 0:  # what the synchronous (else the asynchronous) save left on disk
            row["checkpoint_bytes"] = sum(f.stat().st_size for f in (args.ckpt / args.tag).rglob("*") if f.is_file())
        if args.asynchronous and not args.async_only:
            with HostPeak() as peak, profiled(args.profile, row, "async_save_call_profile"):
                engine.save_checkpoint(args.ckpt, args.tag + "_async", asynchronous=True)
            row["async_save_call"] = peak.report()
            first = args.before + args.after
            with HostPeak() as peak:
                _, row["seconds_during_async_save"] = train(engine, range(first, first + args.async_steps), args,
                                                            rank, world, device, vocab)  # fmt: skip
                engine.wait_checkpoint()
            row["async_steps_and_wait"] = peak.report()
            normal = statistics.median(row["seconds_after"])
            row["async_step_over_normal"] = statistics.median(row["seconds_during_async_save"]) / normal
    else:
        if args.read_threads:
            portable_load.READ_THREADS = args.read_threads
        row["read_threads"] = portable_load.READ_THREADS
        with HostPeak() as peak, profiled(args.profile, row, "load_profile"):
            engine.load_checkpoint(args.ckpt, args.tag)
        row["load"] = peak.report()
        row["global_steps_loaded"] = engine.global_steps
        first = engine.global_steps
        # the first step builds the state under ratio="auto" and reads the loaded state then: profiled on its own
        with HostPeak() as peak, profiled(args.profile, row, "first_step_profile"):
            losses, seconds = train(engine, range(first, first + 1), args, rank, world, device, vocab)
        row["first_step"] = peak.report()
        more = train(engine, range(first + 1, first + args.after), args, rank, world, device, vocab)
        row["losses_after"], row["seconds_after"] = losses + more[0], seconds + more[1]
    row["ratio"] = engine.local_optimizer.ratio
    row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / GIB if cuda else None
    row["peak_host_gib"] = proc_status_bytes("VmHWM") / GIB
    rows: list = [None] * world
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(rows, row)
    else:
        rows = [row]
    if rank == 0:
        result = {"command": sys.argv, "model": args.model, "config": args.config, "world_size": world,
                  "machine": machine_info(), "rows": rows}  # fmt: skip
        if args.reference:
            saved = json.loads(args.reference.read_text())["rows"][0]["losses_after"]
            mine = rows[0]["losses_after"]
            result["relative_difference_to_reference"] = [abs(a - b) / abs(b) for a, b in zip(mine, saved)]
            result["within_1_percent"] = all(d <= 0.01 for d in result["relative_difference_to_reference"])
        path = write_json(result, f"bench_resume_{args.model}_{'save' if args.save else 'load'}{world}.json", args.out)
        keys = ("save", "load", "checkpoint_bytes", "async_step_over_normal", "losses_after", "ratio")
        print(json.dumps({k: rows[0].get(k) for k in keys}, default=str))
        if args.reference:
            print(json.dumps({"relative_difference_to_reference": result["relative_difference_to_reference"]}))
        print(f"wrote {path}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
