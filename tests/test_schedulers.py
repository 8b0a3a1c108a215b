"""DeepSpeed's schedules, value for value (numbers worked out from DeepSpeed's definitions by hand)."""

import math

import pytest
import torch

from twinflow import TwinFlowAdam, load_config
from twinflow.engine.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def lrs_after(sched: torch.optim.lr_scheduler.LRScheduler, steps: list[int]) -> dict[int, list[float]]:
    """The learning rates after k scheduler steps, for each k in `steps` (k = 0: as constructed)."""
    seen, k = {}, 0
    for target in sorted(steps):
        while k < target:
            sched.optimizer.step()
            sched.step()
            k += 1
        seen[target] = [g["lr"] for g in sched.optimizer.param_groups]
    return seen


def optimizer(lrs=(2.0, 2.0)) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(3)) for _ in lrs]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])


def test_warmup_lr_log_and_linear() -> None:
    got = lrs_after(WarmupLR(optimizer(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10), [0, 1, 2, 10, 11])
    expected = {0: 0.1, 1: 0.1, 2: 0.1 + math.log(2) / math.log(10), 10: 1.1, 11: 1.1}
    for k, lr in expected.items():
        assert got[k] == pytest.approx([lr, lr], rel=1e-12), k
    got = lrs_after(WarmupLR(optimizer(), 0.1, 1.1, 4, "linear"), [3])
    assert got[3] == pytest.approx([0.6, 0.6])


def test_warmup_decay_lr() -> None:
    sched = WarmupDecayLR(optimizer(), total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4,
                          warmup_type="linear")  # fmt: skip
    got = lrs_after(sched, [3, 6, 25])
    assert got[3] == pytest.approx([0.5, 0.5]) and got[6] == pytest.approx([15 / 16] * 2) and got[25] == [0.0, 0.0]


def test_warmup_cosine_lr_scales_each_groups_lr() -> None:
    sched = WarmupCosineLR(optimizer((2.0, 4.0)), total_num_steps=12, warmup_min_ratio=0.5, warmup_num_steps=2,
                           cos_min_ratio=0.1, warmup_type="linear")  # fmt: skip
    got = lrs_after(sched, [0, 1, 2, 3, 12])
    ratio3 = 0.1 + 0.9 * (1 + math.cos(math.pi / 10)) / 2
    for k, ratio in {0: 0.0, 1: 0.5, 2: 0.75, 3: ratio3, 12: 0.1}.items():
        assert got[k] == pytest.approx([2.0 * ratio, 4.0 * ratio], rel=1e-12), k


def test_built_from_a_config_drives_twinflow_and_resumes() -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 50, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"}}})  # fmt: skip
    model = torch.nn.Linear(4, 4)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=256)
    sched = build_scheduler(config.scheduler, opt)
    assert isinstance(sched, WarmupDecayLR) and sched.total_num_steps == 50
    for _ in range(7):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * (50 - 6) / 45)
    again = build_scheduler(config.scheduler, TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=256))
    again.load_state_dict(sched.state_dict())
    again.optimizer.step()
    again.step()
    sched.optimizer.step()
    sched.step()
    assert again.get_last_lr() == pytest.approx(sched.get_last_lr())
