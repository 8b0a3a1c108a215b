"""Training and rollouts on the same GPU: the optimizer's state leaves for host memory during each rollout.

    python examples/rl_colocate.py --iterations 4
    python examples/rl_colocate.py --iterations 4 --dim 4096 --layers 8   # on a GPU: a few GiB of state to move

Reinforcement-learning trainers colocate the policy's training and its rollouts (generation) on the same GPUs.
Each iteration here:

1. a rollout: the policy samples continuations of random prompts, and a toy reward scores them (the share of
   even tokens);
2. a training step: REINFORCE on those samples, with TwinFlowAdam (the CPU steps ``--ratio`` of the
   parameters, the GPU the rest);
3. ``opt.offload_states()``: the GPU share's masters and moments and the gradients move to one pinned host
   buffer, and their memory goes back to the driver;
4. the rollout engine's memory (a KV cache, say) stands in as one allocation larger than the GPU had free
   before the offload: it fits only because the offload freed the memory (the first iteration shows the same
   allocation failing without it);
5. the allocation is freed and ``opt.reload_states()`` brings the state back into the same tensors.

The run is repeated without the offload: the losses must be identical, bit for bit. A JSON summary ends the
output (losses, bytes moved, GB/s each way, memory given back). On a CPU the cycle runs as well (the host
buffer is not pinned and there is no allocation to make); the losses are compared all the same.
"""

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional

    def tqdm(iterable, **_):
        return iterable


class WindowLM(torch.nn.Module):
    """A small language model over the last `window` tokens (linear layers only: deterministic on a GPU)."""

    def __init__(self, vocab: int, dim: int, layers: int, window: int) -> None:
        super().__init__()
        self.window = window
        self.embed = torch.nn.Embedding(vocab, dim // window)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim // window * window if k == 0 else dim, dim)
                                          for k in range(layers))  # fmt: skip
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after each window of `tokens` (batch, length >= window)."""
        x = self.embed(tokens.unfold(1, self.window, 1)).flatten(-2)  # (batch, positions, window * width)
        for block in self.blocks:
            x = F.gelu(block(x))
        return self.head(x).float()


@torch.no_grad()
def rollout(model: WindowLM, prompts: torch.Tensor, new: int, gen: torch.Generator) -> torch.Tensor:
    """The prompts with `new` sampled tokens each."""
    tokens = prompts
    for _ in range(new):
        logits = model(tokens[:, -model.window :])[:, -1]
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        tokens = torch.cat([tokens, nxt], 1)
    return tokens


def run(args: argparse.Namespace, device: torch.device, offload: bool) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = WindowLM(args.vocab, args.dim, args.layers, args.window).to(device, dtype)
    opt = TwinFlowAdam(model.parameters(), lr=args.lr, ratio=args.ratio, max_grad_norm=1.0).attach(model)
    gen = torch.Generator(device=device).manual_seed(1)
    losses, cycles, proof = [], [], None
    steps = range(args.iterations)
    for it in tqdm(steps, desc="offload" if offload else "straight", disable=not sys.stderr.isatty()):
        prompts = torch.randint(0, args.vocab, (args.batch, args.window), device=device, generator=gen)
        tokens = rollout(model, prompts, args.new_tokens, gen)
        reward = (tokens[:, args.window :] % 2 == 0).float().mean(1)
        logp = torch.log_softmax(model(tokens[:, :-1]), -1)  # position j predicts token j + window
        picked = logp.gather(-1, tokens[:, args.window :, None]).squeeze(-1).sum(1)
        loss = -((reward - reward.mean()) * picked).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if offload:  # the gradients are still there: they move too
            cycles.append(cycle(opt, device, prove=it == 0))
            proof = proof if proof is not None else cycles[-1].pop("failed_before_offload", None)
        opt.zero_grad()
    return {"losses": losses, "cycles": cycles, "allocation_failed_without_offload": proof}


def cycle(opt: TwinFlowAdam, device: torch.device, prove: bool) -> dict:
    """One offload, the rollout engine's allocation, its release and the reload, with their figures."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    sync()
    if cuda:
        torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0] if cuda else 0
    failed = None
    if cuda and prove:  # a smaller allocation than the rollout's below, before the offload: it must not fit
        try:
            torch.empty(free_before + (1 << 20), dtype=torch.uint8, device=device)
            failed = False
        except torch.OutOfMemoryError:
            failed = True
    start = time.perf_counter()
    moved = opt.offload_states()
    sync()
    out_s = time.perf_counter() - start
    free_after = torch.cuda.mem_get_info()[0] if cuda else 0
    figures = {"bytes": moved, "offload_s": out_s, "offload_GBps": moved / out_s / 1e9,
               "given_back_bytes": free_after - free_before}  # fmt: skip
    if cuda:
        engine = torch.empty(free_before + max(1 << 20, min(1 << 30, moved // 2)), dtype=torch.uint8, device=device)
        engine.fill_(1)  # the rollout engine's memory, in use
        figures["rollout_allocation_bytes"] = engine.numel()
        del engine
        torch.cuda.empty_cache()
    start = time.perf_counter()
    back = opt.reload_states()
    sync()
    in_s = time.perf_counter() - start
    assert back == moved
    figures |= {"reload_s": in_s, "reload_GBps": back / in_s / 1e9}
    if failed is not None:
        figures["failed_before_offload"] = failed
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.5, help="share of the parameters stepped on the CPU")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.dim % args.window:
        parser.error(f"--dim {args.dim} must be a multiple of --window {args.window}")
    device = torch.device(args.device)
    straight = run(args, device, offload=False)
    cycled = run(args, device, offload=True)
    identical = straight["losses"] == cycled["losses"]
    summary = {"device": str(device), "identical_losses": identical, **cycled}
    summary["straight_losses"] = straight["losses"]
    print(json.dumps(summary, indent=2))
    if not identical:
        sys.exit("the losses with the offload differ from those without it")
    if cycled["allocation_failed_without_offload"] is False:
        sys.exit("the rollout's allocation fit without the offload: it does not show the memory freed")


if __name__ == "__main__":
    main()
