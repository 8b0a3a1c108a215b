"""twinflow.initialize: the engine loop equals the hand-written one; resume; DDP and ZeRO-1 match one process."""

import logging
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

import twinflow
from tests.checkpoint_fixture import train as engine_losses  # the engine's loop, losses recorded
from twinflow import TwinFlowAdam
from twinflow.engine.schedulers import WarmupDecayLR

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


def test_fp16_with_sharded_optimizer_state_on_several_processes_is_refused() -> None:
    config = twinflow.load_config(
        {"train_batch_size": 4, "fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}, world_size=2
    )
    with pytest.raises(twinflow.ConfigError, match="fp16 with zero_optimization.stage = 1"):
        twinflow.initialize(model=make_model(), config=config)


FP16 = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 100}},
    "offload_ratio": 0.5,
}


def fp16_step(engine, x, y, blow_up: float = 1.0) -> float:
    loss = torch.nn.functional.mse_loss(engine(x.half()).float(), y) * blow_up
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_fp16_dynamic_loss_scale_follows_deepspeeds_rules() -> None:
    config = FP16 | {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2}}
    engine, opt, _, sched = twinflow.initialize(model=make_model(), config=config)
    assert next(engine.module.parameters()).dtype == torch.float16 and engine.loss_scaler.scale == 256
    data = batches(8, 4, seed=6)
    scales = []
    for x, y in data[:3]:
        fp16_step(engine, x, y)
        scales.append(engine.loss_scaler.scale)
    assert scales == [256, 256, 512]  # doubled after 3 clean steps
    opt.synchronize()  # the last step's CPU share may still be uploading: the weights before the skipped step
    before = [p.detach().clone() for p in engine.module.parameters()]
    lr = sched.get_last_lr()
    fp16_step(engine, *data[3], blow_up=1e6)  # overflows in fp16
    opt.synchronize()
    assert engine.skipped_steps == 1 and engine.loss_scaler.scale == 512  # hysteresis 2 absorbs the first
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert sched.get_last_lr() == lr  # a skipped step keeps the schedule
    fp16_step(engine, *data[4], blow_up=1e6)
    assert engine.skipped_steps == 2 and engine.loss_scaler.scale == 256  # the second halves the scale
    fp16_step(engine, *data[5])
    opt.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_fp16_static_loss_scale_is_undone_before_the_update() -> None:
    """A static scale of 1024: clipping measures the true gradients, and training follows the unscaled run.

    (Adam alone hardly notices a constant gradient factor, so the norms are what show a missing unscale.)
    """
    results, norms = [], []
    for scale in (1.0, 1024.0):
        engine, opt, *_ = twinflow.initialize(
            model=make_model(), config=FP16 | {"gradient_clipping": 0.5, "fp16": {"enabled": True, "loss_scale": scale}}
        )
        step_norms = []
        for x, y in batches(6, 4, seed=7):
            fp16_step(engine, x, y)
            step_norms.append(float(opt.last_grad_norm))
        opt.synchronize()
        norms.append(step_norms)
        results.append([p.detach().float().clone() for p in engine.module.parameters()])
    assert norms[1] == pytest.approx(norms[0], rel=1e-2)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


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
        # stages 0, 2, 3: gradients stream to the CPU share once reduced (DDP's buckets, FSDP2's shards)
        assert engine.local_optimizer.attached == (stage != 1)
        if stage >= 2:  # FSDP2: TwinFlowAdam holds this rank's shards
            assert type(local[0]).__name__ == "DTensor" and opt.split_summary["cpu"]["elements"] > 0
        data = [(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]) for x, y in batches(12, 4, seed=5)]
        if stage in (0, 3):  # also (attached): a checkpoint saved by 2 ranks resumes on 2 ranks with the same losses
            engine_losses(engine, data[:8])
            engine.save_checkpoint(os.path.join(out, "ckpt"))
            tail = engine_losses(engine, data[8:])
            fresh, *_ = twinflow.initialize(model=make_model(seed=11), config=config)
            fresh.load_checkpoint(os.path.join(out, "ckpt"))
            assert engine_losses(fresh, data[8:]) == tail
        else:
            engine_losses(engine, data)
        engine.local_optimizer.synchronize()  # attached (stage 0): the last CPU step may still be writing
        params = _gather(engine.module.parameters())
        torch.save(params, os.path.join(out, f"rank{rank}.pt"))
        torch.distributed.barrier()  # both ranks done before either tears gloo down (a lone exit can abort)
    finally:
        torch.distributed.destroy_process_group()
    # Done and saved. Interpreter shutdown can still abort in gloo's teardown ("terminate called without an
    # active exception", now and then on a 2-core machine), so leave without it.
    os._exit(0)


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


def _print_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "twinflow.notice" and r.getMessage().startswith("step=")
    ]


def test_steps_per_print_writes_deepspeeds_line_as_a_notice(monkeypatch, caplog) -> None:
    """Every 2nd step: step, skipped, the mean loss since the last line, lr, the clipped norm, samples/s."""
    import types

    clock = [0.0]
    monkeypatch.setattr("twinflow.engine.engine.time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    config = CONFIG | {"steps_per_print": 2, "gradient_accumulation_steps": 2,
                       "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}}  # fmt: skip
    engine, opt, _, sched = twinflow.initialize(model=make_model(), config=config)
    data = batches(8, 4, seed=9)
    losses, norms, lrs = [], [], []
    with caplog.at_level(logging.INFO, logger="twinflow.notice"):
        for step in range(1, 5):
            clock[0] = 0.25 * step * step  # steps end at 0.25, 1, 2.25, 4 "seconds"
            losses += engine_losses(engine, data[2 * step - 2 : 2 * step])
            norms.append(float(opt.last_grad_norm))
            lrs.append(sched.get_last_lr()[0])
    opt.synchronize()
    batch = config["train_micro_batch_size_per_gpu"] * 2
    assert (
        _print_lines(caplog)
        == [
            f"step=2, skipped=0, loss={sum(losses[:4]) / 4:.5g}, lr=[{lrs[1]:.6g}], grad_norm={norms[1]:.5g}, "
            f"samples/s={batch / (1.0 - 0.25):.2f}",  # counted from the end of the first step
            f"step=4, skipped=0, loss={sum(losses[4:]) / 4:.5g}, lr=[{lrs[3]:.6g}], grad_norm={norms[3]:.5g}, "
            f"samples/s={2 * batch / (4.0 - 1.0):.2f}",
        ]
    )
    assert lrs[1] != lrs[3] and norms[1] != norms[3]  # the line shows each step's own values


def test_steps_per_print_leaves_out_what_is_not_known(caplog) -> None:
    # no clipping: no norm was measured; the first line has no interval to count samples over
    config = FP16 | {"steps_per_print": 1, "gradient_clipping": 0.0}
    engine, *_ = twinflow.initialize(model=make_model(), config=config)
    with caplog.at_level(logging.INFO, logger="twinflow.notice"):
        engine_losses(engine, batches(1, 4, seed=3))
    engine.local_optimizer.synchronize()
    (line,) = _print_lines(caplog)
    assert line.startswith("step=1, skipped=0, loss=") and "grad_norm" not in line and "samples/s" not in line


def test_steps_per_print_is_seen_without_configuring_logging() -> None:
    """A script that configures no logging (the usual first run) gets the line on stderr, as DeepSpeed prints it."""
    script = (
        "import torch, twinflow\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 1)\n"
        "engine, *_ = twinflow.initialize(model=model, config={'train_micro_batch_size_per_gpu': 2, "
        "'steps_per_print': 2, 'gradient_clipping': 1.0, 'offload_ratio': 0.5})\n"
        "for _ in range(4):\n"
        "    engine.backward(model(torch.randn(2, 4)).pow(2).mean())\n"
        "    engine.step()\n"
        "engine.local_optimizer.synchronize()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in done.stderr.splitlines() if line.startswith("[twinflow] step=")]
    assert [line.split(",")[0] for line in lines] == ["[twinflow] step=2", "[twinflow] step=4"], done.stderr
    assert all(", loss=" in line and ", lr=[0.001]" in line and ", grad_norm=" in line for line in lines)
    assert done.stdout == ""  # a library's notice goes to stderr


def test_offload_ratio_auto_reaches_twinflow_adam_and_resolves_at_the_first_step() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "offload_ratio": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, opt, *_ = twinflow.initialize(model=make_model(), config=config)
    assert isinstance(opt, TwinFlowAdam) and opt.auto_ratio and opt.ratio is None and opt.auto_decision is None
    engine_losses(engine, batches(2, 4, seed=4))
    opt.synchronize()
    assert isinstance(opt.ratio, float) and 0.0 <= opt.ratio <= 1.0
    assert opt.auto_decision["ratio"] == opt.ratio and opt.split_summary["ratio_requested"] == "auto"


def test_offload_ratio_auto_checkpoints_record_the_chosen_ratio_to_resume_with(tmp_path) -> None:

    config = {"train_micro_batch_size_per_gpu": 4, "offload_ratio": "auto"}
    data = batches(6, 4, seed=8)
    engine, opt, *_ = twinflow.initialize(model=make_model(), config=config)
    engine_losses(engine, data[:3])
    folder = engine.save_checkpoint(tmp_path)
    uninterrupted = engine_losses(engine, data[3:])
    assert twinflow.checkpoint.read_meta(tmp_path)[0] == folder.name  # the engine's default: the portable format
    saved = twinflow.checkpoint.read_meta(tmp_path)[1]["meta"]
    assert saved["ratio"] == opt.ratio and saved["config"]["offload_ratio"] == "auto"

    # resumed as configured ("auto" again): the loaded state waits for the ratio the first step decides
    undecided, undecided_opt, *_ = twinflow.initialize(model=make_model(seed=3), config=config)
    undecided.load_checkpoint(tmp_path)
    assert undecided.global_steps == 3 and undecided_opt.ratio is None
    resumed = engine_losses(undecided, data[3:])
    assert undecided_opt.ratio is not None
    torch.testing.assert_close(resumed, uninterrupted, rtol=1e-5, atol=1e-6)  # the ratio decided may differ

    fresh, *_ = twinflow.initialize(model=make_model(seed=3), config=config | {"offload_ratio": saved["ratio"]})
    fresh.load_checkpoint(tmp_path)
    assert engine_losses(fresh, data[3:]) == uninterrupted


def test_a_per_rank_save_is_refused_before_anything_is_written(tmp_path) -> None:
    """The per-rank format (twinflow 0.1.0's ``portable=False``) is no longer written: the refusal says so and
    what to do, and neither the directory nor a pending save is touched."""
    engine, *_ = twinflow.initialize(model=make_model(), config={"train_micro_batch_size_per_gpu": 4})
    engine_losses(engine, batches(1, 4, seed=8))
    with pytest.raises(ValueError, match=r"portable=False\): the per-rank format .* no longer written; leave portable"):
        engine.save_checkpoint(tmp_path / "ckpt", portable=False)
    assert not (tmp_path / "ckpt").exists()
    assert engine.save_checkpoint(tmp_path / "ckpt").name == f"global_step{engine.global_steps}"
