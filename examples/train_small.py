"""Trains a small transformer language model on synthetic tokens with TwinFlowAdam.

    python examples/train_small.py --steps 60 --ratio 0.4

Runs on a GPU when there is one (bf16 weights, fp32 masters), else on the CPU
(fp32; the "GPU side" then also runs on the CPU). Prints the model's size, then
the split once the optimizer is set up (the first run compiles the CPU kernel,
with a line saying so), a progress bar with the loss, and a JSON summary at the
end.
"""

import argparse
import json
import time

import torch

from twinflow import TwinFlowAdam

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional

    def tqdm(iterable, **_):
        return iterable


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def synthetic_batch(gen: torch.Generator, batch: int, seq: int, vocab: int, device: str) -> torch.Tensor:
    """Token sequences with structure to learn: each token is the previous one plus a fixed stride."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    return ((start + stride * torch.arange(seq + 1)) % vocab).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ratio", type=float, default=0.4)
    parser.add_argument("--placement", choices=["first", "last"], default="first")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--plain", action="store_true", help="no overlap: step() does all the CPU work itself")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    vocab = 512
    model = TinyLM(vocab, args.dim, args.layers, 4, args.seq).to(device=device, dtype=dtype)
    # Said before the optimizer exists: its first construction may compile the CPU kernel (it says so).
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params on {device} ({dtype}); "
        f"setting up TwinFlowAdam (ratio {args.ratio}) ...",
        flush=True,
    )
    setup_start = time.perf_counter()
    opt = TwinFlowAdam(
        model.parameters(), lr=args.lr, weight_decay=0.01, ratio=args.ratio, placement=args.placement, max_grad_norm=1.0
    )
    if not args.plain:
        opt.attach(model)  # stream gradients in backward; the next forward waits only for what it uses
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    split = opt.split_summary
    print(
        f"TwinFlowAdam ready in {time.perf_counter() - setup_start:.1f} s: CPU steps {split['cpu']['elements']:,} "
        f"elements in {split['cpu']['tensors']} tensors (ratio {split['ratio_achieved']:.3f}), "
        f"device steps {split['device']['elements']:,}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(1)
    losses, start = [], time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for _ in bar:
        tokens = synthetic_batch(gen, args.batch, args.seq, vocab, device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()  # clips by one global norm first (max_grad_norm)
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    opt.synchronize()
    elapsed = time.perf_counter() - start
    summary = {
        "device": device,
        "steps": args.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds_per_step": elapsed / args.steps,
        "split": split,
        "overlap": not args.plain,
        "released_grad_bytes": opt.released_grad_bytes,
    }
    print(json.dumps(summary, indent=2))
    if losses[-1] >= losses[0]:
        raise SystemExit(f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
