"""Two GPUs (NCCL): stages 0, 1 and 3 train a small transformer like one GPU does; a checkpoint resumes.

Needs two CUDA devices; skipped otherwise (carries the cuda marker).
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import twinflow

pytestmark = pytest.mark.cuda

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu", "ratio": 0.4}},
}
VOCAB, SEQ, STEPS = 256, 64, 8


class TinyLM(torch.nn.Module):
    def __init__(self, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def data(rank: int, ranks: int) -> list[torch.Tensor]:
    """Micro-batches of 4 sequences, split between the ranks (rank r takes rows [2r, 2r + 2))."""
    gen = torch.Generator().manual_seed(1)

    def sequences() -> torch.Tensor:  # something to learn: each token is the previous one plus a stride
        start = torch.randint(0, VOCAB, (4, 1), generator=gen)
        stride = torch.randint(1, 4, (4, 1), generator=gen)
        return (start + stride * torch.arange(SEQ + 1)) % VOCAB

    batches = [sequences() for _ in range(STEPS * 2)]
    if ranks == 1:
        return batches
    return [b[rank * 2 : rank * 2 + 2] for b in batches]


def run(engine, batches, device) -> list[float]:
    losses = []
    for tokens in batches:
        tokens = tokens.to(device)
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return losses


def _worker(rank: int, port: int, stage: int, out: str) -> None:
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = TinyLM().cuda()
        config = CONFIG | {"zero_optimization": CONFIG["zero_optimization"] | {"stage": stage}}
        engine, *_ = twinflow.initialize(model=model, config=config)
        batches = data(rank, 2)
        if stage == 3:
            first = run(engine, batches[:8], "cuda")
            engine.save_checkpoint(os.path.join(out, "ckpt"))
            second = run(engine, batches[8:], "cuda")
            torch.manual_seed(7)
            fresh, *_ = twinflow.initialize(model=TinyLM().cuda(), config=config)
            fresh.load_checkpoint(os.path.join(out, "ckpt"))
            resumed = run(fresh, batches[8:], "cuda")
            losses = first + second
            torch.save({"resumed": torch.stack(resumed).cpu(), "uninterrupted": torch.stack(second).cpu()},
                       os.path.join(out, f"resume{rank}.pt"))  # fmt: skip
        else:
            losses = run(engine, batches, "cuda")
        # the loss of the whole micro-batch: the mean over both ranks' halves
        mean = torch.stack(losses)
        torch.distributed.all_reduce(mean)
        torch.save((mean / 2).cpu(), os.path.join(out, f"losses{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_two_gpus_match_one(tmp_path, stage: int) -> None:
    mp.spawn(_worker, args=(_free_port(), stage, str(tmp_path)), nprocs=2, join=True)
    torch.manual_seed(0)
    engine, *_ = twinflow.initialize(model=TinyLM().cuda(), config=CONFIG | {"train_micro_batch_size_per_gpu": 4})
    single = torch.stack(run(engine, data(0, 1), "cuda")).cpu()
    engine.optimizer.synchronize()
    two = torch.load(tmp_path / "losses0.pt", weights_only=True)
    print(f"stage {stage}: one GPU {single.tolist()}\n          two GPUs {two.tolist()}")
    assert single[-1] < 0.9 * single[0]  # it learns
    torch.testing.assert_close(two, single, rtol=2e-2, atol=0)  # bf16 compute, same samples
    if stage == 3:
        for rank in range(2):
            r = torch.load(tmp_path / f"resume{rank}.pt", weights_only=True)
            torch.testing.assert_close(r["resumed"], r["uninterrupted"], rtol=1e-3, atol=0)
