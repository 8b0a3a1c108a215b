"""Trains an OPT model (published shapes) with twinflow from a DeepSpeed-style JSON config.

    python examples/train_opt.py --model opt-125m --steps 20 [--config examples/configs/twin_flow_bf16.json]
    torchrun --nproc-per-node 4 examples/train_opt.py --model opt-30b --config examples/configs/opt-30b.json

Random init is materialised directly on the device in the training dtype (no
fp32 detour through host memory), or --model-path loads local Hugging Face
weights. --data is a local text file, tokenised offline as UTF-8 bytes (ids
0-255, all inside OPT's vocabulary); without it, synthetic token sequences
with a structure to learn. Says on stderr when the model is being built and
how long that took, then shows a progress bar (loss, tokens/s, model TFLOP/s
per GPU or per CPU process, GPU and host memory) and prints a JSON summary at
the end; --summary FILE.json also writes it to FILE.json and the loss curve to
FILE.png (with matplotlib installed). On a CPU-only machine the smallest model
trains in fp32 for a few steps. A bad --config or --data file is reported in
one line before anything is built.
"""

import argparse
import io
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

import twinflow
from twinflow.models import OPT_SHAPES, build_opt

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional

    def tqdm(iterable, **_):
        return iterable


DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "offload_ratio": 0.4,
}


def read_text_ids(path: Path, seq: int) -> torch.Tensor:
    """A local text file's bytes as token ids; ValueError naming the file and the fix if it cannot be used."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"--data {path}: no such file: give a local text file, or leave --data out for synthetic "
                         "tokens") from None  # fmt: skip
    except IsADirectoryError:
        raise ValueError(f"--data {path}: is a directory: give a text file inside it") from None
    except OSError as exc:
        raise ValueError(f"--data {path}: cannot be read ({exc.strerror or exc}): check its permissions") from None
    if len(data) < seq:
        raise ValueError(f"--data {path}: {len(data)} bytes, need at least --seq-len = {seq}: give a longer file or "
                         "a smaller --seq-len")  # fmt: skip
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def text_batches(ids: torch.Tensor, batch: int, seq: int, seed: int):
    """Random windows of seq byte ids from a text's ids, for ever (the model shifts the labels itself)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, ids.numel() - seq + 1, (batch,), generator=gen)
        yield torch.stack([ids[s : s + seq] for s in starts.tolist()])


def synthetic_batches(vocab: int, batch: int, seq: int, seed: int):
    """Sequences where each token is the previous one plus a per-sequence stride (something to learn)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 8, (batch, 1), generator=gen)
        yield (start + stride * torch.arange(seq)) % vocab


def write_atomically(path: Path, data: bytes) -> None:
    """Writes `path` through a temporary file and a rename: a crash leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plot_losses(losses: list[float], title: str, path: Path) -> str:
    """Writes the loss curve to `path` as a PNG; the line to print about it (how to get it if matplotlib is
    missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            'loss plot skipped: matplotlib is not installed (pip install matplotlib, or pip install -e ".[examples]")'
        )
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses, marker="o" if len(losses) <= 50 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    write_atomically(path, buffer.getvalue())
    return f"loss curve written to {path}"


def format_rate(flops_per_second: float) -> str:
    """TFLOP/s to three significant figures: a CPU's 0.05 must not print as 0.0."""
    return f"{flops_per_second / 1e12:.3g}"


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def main() -> None:
    """Parses the flags, checks the config and data files, then builds the model and trains it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="DeepSpeed-style JSON (default: bf16 on a GPU, ratio 0.4)")
    parser.add_argument("--model", default="opt-125m", choices=sorted(OPT_SHAPES))
    parser.add_argument("--model-path", default=None, help="local Hugging Face weights instead of random init")
    parser.add_argument("--data", default=None, help="a local text file (default: synthetic tokens)")
    parser.add_argument("--steps", type=positive_int, default=20, help="optimizer steps")
    parser.add_argument("--seq-len", type=positive_int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--summary", default=None, help="also write the JSON summary here, and the loss curve beside it (.png)"
    )
    args = parser.parse_args()

    def fail(message: str) -> NoReturn:
        # One line, no traceback and no usage text: the message says what to change.
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    cuda = torch.cuda.is_available()
    # Both files are checked before any process group or model exists; the world size is torchrun's.
    distributed = "LOCAL_RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if distributed else 1
    if args.config:
        source = args.config
    else:
        source = DEFAULT_CONFIG | ({"bf16": {"enabled": True}} if cuda else {})
    try:
        config = twinflow.load_config(source, world_size=world_size)
    except twinflow.ConfigError as exc:
        # File problems already name the file; problems inside it do not.
        named = args.config is None or args.config in str(exc)
        fail(f"--config{'' if named else ' ' + args.config}: {exc}" if args.config else str(exc))
    try:
        text_ids = read_text_ids(Path(args.data), args.seq_len) if args.data else None
    except ValueError as exc:
        fail(str(exc))

    if distributed:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else torch.float32

    def say(message: str) -> None:
        # stderr, like the progress bar: stdout stays the JSON summary alone
        if rank == 0:
            print(message, file=sys.stderr, flush=True)

    torch.manual_seed(args.seed)
    build_start = time.perf_counter()
    say(f"building {args.model_path or args.model} ({'local weights' if args.model_path else 'random init'}, "
        f"{dtype} on {device}) ...")  # fmt: skip
    if args.model_path:
        from transformers import OPTForCausalLM

        model = OPTForCausalLM.from_pretrained(args.model_path, torch_dtype=dtype, local_files_only=True).to(device)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
    else:
        model = build_opt(args.model, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    say(f"built {args.model_path or args.model}: {params / 1e6:.1f}M parameters in "
        f"{time.perf_counter() - build_start:.1f} s")  # fmt: skip
    init_start = time.perf_counter()
    engine, optimizer, _, _ = twinflow.initialize(model=model, config=config)
    initialize_seconds = time.perf_counter() - init_start
    say(f"twinflow.initialize (ratio {config.ratio}) took {initialize_seconds:.1f} s; training (the first step "
        "is slower than the next: one-time allocations and warm-up, and the plan of ratio 'auto')")  # fmt: skip

    micro, accumulation = config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
    seed = args.seed + 1 + rank
    if text_ids is not None:
        data = text_batches(text_ids, micro, args.seq_len, seed)
    else:
        data = synthetic_batches(model.config.vocab_size, micro, args.seq_len, seed)
    tokens_per_step = micro * accumulation * args.seq_len
    # 6 N per token for forward and backward, plus 2 N for the recomputed forward (activation checkpointing)
    flops_per_step = 8 * params * tokens_per_step
    losses, times, reserved, start = [], [], [], time.perf_counter()
    bar = tqdm(range(args.steps), desc=args.model, unit="step", disable=rank != 0)
    for _ in bar:
        step_start = time.perf_counter()
        for _ in range(accumulation):
            tokens = next(data).to(device)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        elapsed = time.perf_counter() - step_start
        times.append(elapsed)
        if cuda:  # the allocator's reserve after each step: flat once warm, unless memory fragments
            reserved.append(torch.cuda.memory_reserved() / 2**30)
        if hasattr(bar, "set_postfix"):
            host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            shown = dict(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}",
                         tflops=format_rate(flops_per_step / elapsed))  # fmt: skip
            if cuda:  # no GPU figure on a CPU run (the summary says null there too)
                shown["gpu_gib"] = f"{torch.cuda.max_memory_allocated() / 2**30:.1f}"
            bar.set_postfix(**shown, host_gib=f"{host:.1f}")
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    summary = {
        "model": args.model_path or args.model,
        "parameters": params,
        "device": device,
        "dtype": str(dtype),
        "world_size": config.world_size,
        "ratio": engine.local_optimizer.ratio,  # the ratio "auto" planned at the first step, or the config's
        "ratio_requested": config.ratio,
        "initialize_seconds": initialize_seconds,
        "first_step_seconds": times[0],
        "steps": args.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds_per_step": seconds,
        "median_seconds_per_step_after_first": statistics.median(times[1:]) if len(times) > 1 else seconds,
        "losses": losses,
        "tokens_per_second_per_rank": tokens_per_step / seconds,
        "tflops_per_rank": flops_per_step / seconds / 1e12,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "reserved_gib_per_step": reserved or None,
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None,
    }
    if rank == 0:
        print(json.dumps(summary, indent=2))
        if args.summary:
            summary_path = Path(args.summary)
            write_atomically(summary_path, (json.dumps(summary, indent=2) + "\n").encode())
            plot_path = summary_path.with_suffix(".png")
            if plot_path == summary_path:  # --summary x.png: keep the JSON
                plot_path = summary_path.with_name(summary_path.name + ".png")
            title = f"{args.model_path or args.model}, ratio {summary['ratio']}, {dtype} on {device}"
            say(plot_losses(losses, title, plot_path))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
