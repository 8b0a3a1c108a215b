"""twinflow.initialize: the engine loop equals the hand-written one; resume; DDP and ZeRO-1 match one process."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import twinflow
from twinflow import TwinFlowAdam
from twinflow.schedulers import WarmupDecayLR

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 0.05,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 3, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
}  # fmt: skip


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.GELU(), torch.nn.Linear(32, 10))


def batches(n: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 10, generator=gen), torch.randn(size, 10, generator=gen)) for _ in range(n)]


def engine_losses(engine, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_engine_loop_equals_the_hand_written_loop() -> None:
    data = batches(16, 4)
    engine, opt, _, sched = twinflow.initialize(model=make_model(), config=CONFIG)
    assert isinstance(opt, TwinFlowAdam) and opt.ratio == 0.5 and opt.max_grad_norm == 0.05
    ours = engine_losses(engine, data)
    opt.synchronize()

    model = make_model()
    ref = TwinFlowAdam(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, ratio=0.5,
                       max_grad_norm=0.05)  # fmt: skip
    ref_sched = WarmupDecayLR(ref, total_num_steps=20, warmup_max_lr=3e-3, warmup_num_steps=3, warmup_type="linear")
    losses = []
    for i, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss / 4).backward()
        losses.append(loss.item())
        if (i + 1) % 4 == 0:
            ref.step()
            ref.zero_grad()
            ref_sched.step()
    assert ours == pytest.approx(losses, rel=1e-6)
    assert engine.global_steps == 4 and sched.get_last_lr() == pytest.approx(ref_sched.get_last_lr())
    for a, b in zip(engine.module.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_engine_checkpoint_resume_is_exact(tmp_path) -> None:
    data = batches(24, 4, seed=2)
    engine, *_ = twinflow.initialize(model=make_model(), config=CONFIG)
    engine_losses(engine, data[:8])
    engine.save_checkpoint(tmp_path, client_state={"epoch": 1})
    uninterrupted = engine_losses(engine, data[8:])

    fresh, *_ = twinflow.initialize(model=make_model(seed=3), config=CONFIG)
    path, client = fresh.load_checkpoint(tmp_path)
    assert client == {"epoch": 1} and path.name == "global_step2" and fresh.global_steps == 2
    assert engine_losses(fresh, data[8:]) == uninterrupted


def test_fp16_is_refused_by_name() -> None:
    with pytest.raises(twinflow.ConfigError, match="fp16 loss scaling is not built"):
        twinflow.initialize(model=make_model(), config={"train_batch_size": 4, "fp16": {"enabled": True}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather(params) -> list[torch.Tensor]:
    """Whole parameters: FSDP2's DTensors are gathered (every rank takes part)."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]


def _worker(rank: int, world: int, port: int, stage: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        config = CONFIG | {"zero_optimization": CONFIG["zero_optimization"] | {"stage": stage}}
        engine, opt, *_ = twinflow.initialize(model=make_model(), config=config)
        local = [p for g in engine.local_optimizer.param_groups for p in g["params"]]
        if stage == 1:  # each rank's TwinFlowAdam steps only its share
            assert type(opt).__name__ == "ZeroRedundancyOptimizer" and 0 < len(local) < 4
        else:
            assert opt is engine.local_optimizer and len(local) == 4
        if stage >= 2:  # FSDP2: TwinFlowAdam holds this rank's shards
            assert type(local[0]).__name__ == "DTensor" and opt.split_summary["cpu"]["elements"] > 0
        data = [(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]) for x, y in batches(12, 4, seed=5)]
        if stage == 3:  # also: a checkpoint saved by 2 ranks resumes on 2 ranks with the same losses
            engine_losses(engine, data[:8])
            engine.save_checkpoint(os.path.join(out, "ckpt"))
            tail = engine_losses(engine, data[8:])
            fresh, *_ = twinflow.initialize(model=make_model(seed=11), config=config)
            fresh.load_checkpoint(os.path.join(out, "ckpt"))
            assert engine_losses(fresh, data[8:]) == tail
        else:
            engine_losses(engine, data)
        params = _gather(engine.module.parameters())
        torch.save(params, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_processes_match_one(tmp_path, stage: int) -> None:
    """2 ranks x micro-batch 2 (gloo, CPU) against 1 process x micro-batch 4 over the same samples."""
    mp.spawn(_worker, args=(2, _free_port(), stage, str(tmp_path)), nprocs=2, join=True)
    single_config = CONFIG | {"train_micro_batch_size_per_gpu": 4}
    engine, *_ = twinflow.initialize(model=make_model(), config=single_config)
    engine_losses(engine, batches(12, 4, seed=5))
    engine.optimizer.synchronize()
    for rank in range(2):
        params = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for got, want in zip(params, engine.module.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
