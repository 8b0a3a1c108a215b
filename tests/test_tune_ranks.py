"""ratio="auto" on several processes: every rank plans one ratio, the largest any rank chose."""

import os
import socket

import torch
import torch.multiprocessing as mp

import twinflow.plan
from twinflow.plan import Inputs, IterationProbe, agree, choose_ratio, predict_host, predict_peak, predict_time

GIB = 1 << 30


def _inputs() -> Inputs:
    return Inputs(elements=2_650_000_000, grad_bytes=2 * 2_650_000_000, state_bytes_per_element=12.0,
                  temp_bytes=GIB // 4, released_bytes_per_ratio=0, first_peak_bytes=13 * GIB, at_step_bytes=10 * GIB,
                  budget_bytes=50 * GIB, forward_s=0.05, backward_s=0.15, cpu_elements_per_s=4.3e9,
                  gpu_elements_per_s=80e9, pcie_bytes_per_s=54e9, host_bytes_per_element=14.0)  # fmt: skip


def test_agreeing_on_a_larger_ratio_predicts_at_that_ratio() -> None:
    x = _inputs()
    mine = choose_ratio(x, "last", overlap=True, eager=False)
    larger = round(mine["ratio"] + 0.17, 2)
    d = agree(mine, larger)
    assert (d["ratio"], d["ratio_over_ranks"], d["ratio_this_rank"]) == (larger, larger, mine["ratio"])
    assert d["predicted_peak_bytes"] == predict_peak(x, larger) < mine["predicted_peak_bytes"]
    assert d["predicted_host_bytes"] == predict_host(x, larger) > mine["predicted_host_bytes"]
    assert d["predicted_time_s"] == predict_time(x, larger, "last", True, False)
    same = agree(mine, mine["ratio"])
    assert same["ratio"] == mine["ratio"] and "ratio_this_rank" not in same


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # torch's Adam faster than the kernel: with room a rank takes ratio 0; rank 0 has no room (budget 0) and
        # must take ratio 1
        twinflow.plan.cpu_kernel_rate = lambda *a, **kw: 1e9
        twinflow.plan.device_adam_rate = lambda *a, **kw: 2e9
        params = list(torch.nn.Linear(8, 8).parameters())
        d = IterationProbe(torch.device("cpu")).decide(
            params, placement="first", eager=False, release_grads=False, margin=0.1, budget=0 if rank == 0 else 1000,
            num_threads=1,
        )  # fmt: skip
        torch.save({k: d.get(k) for k in ("ratio", "ratio_over_ranks", "ratio_this_rank")}, f"{out}/rank{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    os._exit(0)  # gloo's teardown can abort at interpreter exit on a loaded machine: leave without it


def test_the_ranks_plan_the_largest_ratio_any_chose(tmp_path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0 == {"ratio": 1.0, "ratio_over_ranks": 1.0, "ratio_this_rank": None}
    assert r1 == {"ratio": 1.0, "ratio_over_ranks": 1.0, "ratio_this_rank": 0.0}


def test_a_line_every_rank_would_write_alike_is_written_by_rank_0(monkeypatch, caplog) -> None:
    from twinflow.base.notice import notice_on_first_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    for rank in (1, 0):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda r=rank: r)
        with caplog.at_level("INFO", logger="twinflow.notice"):
            notice_on_first_rank("ratio='auto' chose %s", rank)
    assert [r.getMessage() for r in caplog.records] == ["ratio='auto' chose 0"]


def test_no_ratio_fitting_names_the_gpu_count_that_would() -> None:
    """OPT-30B-like shards of 4 ranks on 80 GB GPUs with a small host share: fp32 state fits neither memory at
    any ratio; the error estimates the GPU count (the model sharded wider) at which a ratio fits, and that count's
    ratios really fit the model's arithmetic."""
    import dataclasses

    import pytest

    from twinflow.plan import NoRatioFits

    x = dataclasses.replace(_inputs(), elements=7_500_000_000, grad_bytes=15_000_000_000, first_peak_bytes=40 * GIB,
                            at_step_bytes=32 * GIB, budget_bytes=70 * GIB, host_budget_bytes=40 * GIB,
                            world_size=4, sharded=True, state_precision="fp32")  # fmt: skip
    with pytest.raises(NoRatioFits) as error:
        choose_ratio(x, "last", overlap=True, eager=False)
    message = str(error.value)
    found = __import__("re").search(r"about (\d+) GPUs like this one would fit ratio (\S+) to (\S+) in", message)
    assert found, message
    gpus, low = int(found.group(1)), float(found.group(2))
    factor = gpus // 4
    assert gpus in (8, 16, 32)
    shrink = 1 - 1 / factor
    wider = dataclasses.replace(x, elements=x.elements // factor, grad_bytes=x.grad_bytes // factor,
                                first_peak_bytes=int(x.first_peak_bytes - shrink * 2 * x.grad_bytes),
                                at_step_bytes=int(x.at_step_bytes - shrink * 2 * x.grad_bytes),
                                host_budget_bytes=x.host_budget_bytes / factor)  # fmt: skip
    d = choose_ratio(wider, "last", overlap=True, eager=False)  # what the message promised
    assert d["ratio"] >= low and d["predicted_peak_bytes"] <= wider.budget_bytes
