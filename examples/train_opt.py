"""Trains an OPT model (published shapes) with twinflow from a DeepSpeed-style JSON config.

    python examples/train_opt.py --model opt-125m --steps 20 [--config examples/configs/twin_flow_bf16.json]
    torchrun --nproc-per-node 4 examples/train_opt.py --model opt-30b --config examples/configs/opt-30b.json

Random init is materialised directly on the device in the training dtype (no
fp32 detour through host memory), or --model-path loads local Hugging Face
weights. --data is a local text file, tokenised offline as UTF-8 bytes (ids
0-255, all inside OPT's vocabulary); without it, synthetic token sequences
with a structure to learn. Shows a progress bar (loss, tokens/s, TFLOP/s per
GPU, GPU and host memory) and prints a JSON summary at the end. On a CPU-only
machine the smallest model trains in fp32 for a few steps.
"""

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

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


def text_batches(path: Path, batch: int, seq: int, seed: int):
    """Random windows of seq byte ids from a local text file, for ever (the model shifts the labels itself)."""
    ids = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    if ids.numel() < seq:
        raise SystemExit(f"--data {path}: {ids.numel()} bytes, need at least --seq-len = {seq}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="DeepSpeed-style JSON (default: bf16 on a GPU, ratio 0.4)")
    parser.add_argument("--model", default="opt-125m", choices=sorted(OPT_SHAPES))
    parser.add_argument("--model-path", default=None, help="local Hugging Face weights instead of random init")
    parser.add_argument("--data", default=None, help="a local text file (default: synthetic tokens)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary", default=None, help="also write the JSON summary here")
    args = parser.parse_args()

    if "LOCAL_RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    cuda = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    config = json.loads(Path(args.config).read_text()) if args.config else dict(DEFAULT_CONFIG)
    if not args.config and cuda:
        config["bf16"] = {"enabled": True}
    config = twinflow.load_config(config)
    dtype = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else torch.float32

    torch.manual_seed(args.seed)
    if args.model_path:
        from transformers import OPTForCausalLM

        model = OPTForCausalLM.from_pretrained(args.model_path, torch_dtype=dtype, local_files_only=True).to(device)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
    else:
        model = build_opt(args.model, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    engine, optimizer, _, _ = twinflow.initialize(model=model, config=config)

    micro, accumulation = config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
    seed = args.seed + 1 + rank
    if args.data:
        data = text_batches(Path(args.data), micro, args.seq_len, seed)
    else:
        data = synthetic_batches(model.config.vocab_size, micro, args.seq_len, seed)
    tokens_per_step = micro * accumulation * args.seq_len
    # 6 N per token for forward and backward, plus 2 N for the recomputed forward (activation checkpointing)
    flops_per_step = 8 * params * tokens_per_step
    losses, times, start = [], [], time.perf_counter()
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
        if hasattr(bar, "set_postfix"):
            gpu = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}",
                            tflops=f"{flops_per_step / elapsed / 1e12:.1f}", gpu_gib=f"{gpu:.1f}",
                            host_gib=f"{host:.1f}")  # fmt: skip
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    summary = {
        "model": args.model_path or args.model,
        "parameters": params,
        "device": device,
        "dtype": str(dtype),
        "world_size": config.world_size,
        "ratio": config.ratio,
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
    }
    if rank == 0:
        print(json.dumps(summary, indent=2))
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=2) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
