"""ratio="auto": the choice from measured inputs (pure), and the optimizer deciding at its first step."""

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.tune import Inputs, choose_ratio, predict_peak, predict_time

GIB = 1 << 30


def inputs(**kw) -> Inputs:
    base = dict(
        elements=2_650_000_000,
        grad_bytes=2 * 2_650_000_000,
        state_bytes_per_element=12.0,
        temp_bytes=GIB // 4,
        released_bytes_per_ratio=2 * 2_650_000_000,
        first_peak_bytes=13 * GIB,
        at_step_bytes=10 * GIB,
        budget_bytes=70 * GIB,
        forward_s=0.05,
        backward_s=0.15,
        cpu_elements_per_s=4.3e9,
        gpu_elements_per_s=80e9,
        pcie_bytes_per_s=54e9,
    )
    return Inputs(**(base | kw))


@pytest.mark.parametrize("budget_gib", [16, 24, 30, 45, 70])
@pytest.mark.parametrize("placement", ["first", "last"])
@pytest.mark.parametrize("eager", [False, True])
def test_choice_fits_the_budget_and_is_fastest_among_fitting(budget_gib: int, placement: str, eager: bool) -> None:
    x = inputs(budget_bytes=budget_gib * GIB)
    d = choose_ratio(x, placement, overlap=True, eager=eager)
    assert predict_peak(x, d["ratio"]) <= x.budget_bytes
    fitting = [r / 100 for r in range(101) if predict_peak(x, r / 100) <= x.budget_bytes]
    best = min(predict_time(x, r, placement, True, eager) for r in fitting)
    assert d["predicted_time_s"] <= best * 1.02 + 1e-12
    # the smallest ratio among the near-fastest: no fitting ratio below it is as fast
    below = [r for r in fitting if r < d["ratio"]]
    assert all(predict_time(x, r, placement, True, eager) > best * 1.02 for r in below)


def test_tight_memory_forces_a_high_ratio_and_plenty_allows_a_low_one() -> None:
    tight = choose_ratio(inputs(budget_bytes=16 * GIB), "last", overlap=True, eager=True)
    roomy = choose_ratio(inputs(budget_bytes=200 * GIB), "last", overlap=True, eager=True)
    assert tight["ratio"] >= 0.7 and predict_peak(inputs(), tight["ratio"] - 0.01) > 16 * GIB
    assert roomy["ratio"] == 0.0


def test_nothing_fits_chooses_everything_on_the_cpu() -> None:
    d = choose_ratio(inputs(budget_bytes=GIB), "first", overlap=False, eager=False)
    assert d["ratio"] == 1.0


def test_eager_last_hides_more_cpu_work_than_first() -> None:
    x = inputs()
    assert predict_time(x, 0.4, "last", True, True) < predict_time(x, 0.4, "first", True, True)
    assert predict_time(x, 0.4, "last", True, True) < predict_time(x, 0.4, "last", True, False)


def test_released_gradients_lower_the_predicted_peak() -> None:
    kept = inputs(released_bytes_per_ratio=0)
    assert predict_peak(inputs(), 0.5) == predict_peak(kept, 0.5) - 0.5 * 2 * 2_650_000_000
    assert predict_peak(inputs(), 0.0) == predict_peak(kept, 0.0)


def test_first_step_peak_counts_when_gradients_are_still_on_the_device() -> None:
    x = inputs(first_peak_bytes=11 * GIB, at_step_bytes=10 * GIB)  # all bf16 gradients + params ~ 10 GiB
    state = 0.7 * x.elements * 12 + x.temp_bytes
    assert predict_peak(x, 0.3) == max(11 * GIB + state - 0.3 * x.released_bytes_per_ratio, 10 * GIB + state)
    assert predict_peak(x, 0.3) == 10 * GIB + state


def test_budget_caps_the_device_memory() -> None:
    from twinflow.tune import IterationProbe

    model = torch.nn.Linear(8, 8)
    d = IterationProbe(torch.device("cpu")).decide(
        list(model.parameters()), placement="first", eager=False, release_grads=False, margin=0.1, budget=0,
        num_threads=1,
    )  # fmt: skip
    assert d["inputs"]["budget_bytes"] == 0 and d["ratio"] == 1.0
    d = IterationProbe(torch.device("cpu")).decide(
        list(model.parameters()), placement="first", eager=False, release_grads=False, margin=0.1, budget=1000,
        num_threads=1,
    )  # fmt: skip
    assert d["inputs"]["budget_bytes"] == 900  # the margin is kept below an explicit budget too


def test_optimizer_decides_at_first_step_and_then_matches_adamw() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio="auto", chunk_bytes=1024).attach(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)  # the same defaults, weight decay 0.01 included
    with pytest.raises(RuntimeError, match="decided at the first step"):
        opt.state_dict()
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    d = opt.auto_decision
    assert d is not None and 0.0 <= opt.ratio <= 1.0 and opt.split_summary["ratio_requested"] == "auto"
    assert d["inputs"]["forward_s"] > 0 and d["inputs"]["cpu_elements_per_s"] > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
