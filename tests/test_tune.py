"""ratio="auto": the choice from measured inputs (pure), the probes' arithmetic (injected timings), the sentence
that explains a choice, and the optimizer deciding at its first step."""

import os
import re
from dataclasses import asdict

import pytest
import torch

import twinflow.plan
from twinflow import TwinFlowAdam
from twinflow.host import ops
from twinflow.plan import (
    Inputs,
    NoRatioFits,
    choose_ratio,
    explain,
    host_available_bytes,
    host_bytes_per_element,
    local_ranks,
    predict_host,
    predict_peak,
    predict_time,
)
from twinflow.precision import state_precision

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


GRID = [k / 100 for k in range(101)]
# a slow CPU (the defaults: every ratio above what memory needs costs time) and a slow GPU (the fastest ratio lies
# inside (0, 1), and ratios just below it are predicted within 2% of it)
RATES = {"cpu-bound": {}, "gpu-bound": {"cpu_elements_per_s": 20e9, "gpu_elements_per_s": 10e9}}


def assert_is_the_choice(x: Inputs, d: dict, placement: str, overlap: bool, eager: bool, delayed: bool = False,
                         speculative: bool = False) -> None:  # fmt: skip
    """`d` is choose_ratio's rule applied by brute force over the ratios 0, 0.01, ..., 1 (twinflow.plan's docstring):
    the smallest of the fitting ratios predicted within 2% of the fastest fitting one; 1 when none fits."""
    r = d["ratio"]
    assert 0.0 <= r <= 1.0 and r in GRID, r
    times = {q: predict_time(x, q, placement, overlap, eager, delayed, speculative) for q in GRID}
    assert d["predicted_time_s"] == times[r] and d["predicted_peak_bytes"] == predict_peak(x, r)
    fitting = [q for q in GRID if (x.budget_bytes is None or predict_peak(x, q) <= x.budget_bytes)
               and predict_host(x, q) <= x.host_budget_bytes]  # fmt: skip
    if not fitting:
        assert r == 1.0
        return
    best = min(times[q] for q in fitting)
    assert r in fitting and times[r] <= best * 1.02, (r, times[r], best)
    assert [q for q in fitting if q < r and times[q] <= best * 1.02] == [], r  # no smaller near-fastest ratio
    assert d["fastest_fitting_ratio"] in fitting and times[d["fastest_fitting_ratio"]] == best


@pytest.mark.parametrize("budget_gib", [16, 24, 30, 45, 70])
@pytest.mark.parametrize("placement", ["first", "last"])
@pytest.mark.parametrize("overlap, eager", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rates", list(RATES))
def test_choice_fits_the_budget_and_is_fastest_among_fitting(
    budget_gib: int, placement: str, overlap: bool, eager: bool, rates: str
) -> None:
    x = inputs(budget_bytes=budget_gib * GIB, **RATES[rates])
    d = choose_ratio(x, placement, overlap=overlap, eager=eager)
    assert_is_the_choice(x, d, placement, overlap, eager)
    assert (d["placement"], d["overlap"], d["eager"], d["inputs"]) == (placement, overlap, eager, asdict(x))


def test_the_choice_is_neither_the_least_memory_nor_the_strictly_fastest() -> None:
    """The parametrized cases tell the rule apart from simpler ones: a slow GPU moves work to the CPU past what
    memory needs, and a near tie goes to the smaller ratio rather than to the fastest one."""
    x = inputs(budget_bytes=70 * GIB, **RATES["gpu-bound"])
    d = choose_ratio(x, "first", overlap=False, eager=False)
    assert predict_peak(x, 0.0) <= x.budget_bytes  # ratio 0 fits, yet costs time
    assert 0.0 < d["ratio"] < d["fastest_fitting_ratio"] < 1.0
    assert predict_time(x, d["ratio"], "first", False, False) > predict_time(x, d["fastest_fitting_ratio"], "first",
                                                                            False, False)  # fmt: skip


def test_tight_memory_forces_a_high_ratio_and_plenty_allows_a_low_one() -> None:
    x_tight, x_roomy = inputs(budget_bytes=16 * GIB), inputs(budget_bytes=200 * GIB)
    tight = choose_ratio(x_tight, "last", overlap=True, eager=True)
    roomy = choose_ratio(x_roomy, "last", overlap=True, eager=True)
    assert_is_the_choice(x_tight, tight, "last", True, True)
    assert_is_the_choice(x_roomy, roomy, "last", True, True)
    assert 0.7 <= tight["ratio"] <= 1.0 and predict_peak(x_tight, tight["ratio"]) <= 16 * GIB
    assert predict_peak(x_tight, tight["ratio"] - 0.01) > 16 * GIB  # the least that fits: more only costs time
    assert roomy["ratio"] == 0.0


def test_nothing_fits_chooses_everything_on_the_cpu() -> None:
    x = inputs(budget_bytes=GIB)
    assert predict_peak(x, 1.0) > x.budget_bytes
    d = choose_ratio(x, "first", overlap=False, eager=False)
    assert d["ratio"] == 1.0
    assert_is_the_choice(x, d, "first", False, False)


def test_eager_last_hides_more_cpu_work_than_first() -> None:
    x = inputs()
    assert predict_time(x, 0.4, "last", True, True) < predict_time(x, 0.4, "first", True, True)
    assert predict_time(x, 0.4, "last", True, True) < predict_time(x, 0.4, "last", True, False)


@pytest.mark.parametrize("budget_gib", [16, 30, 70])
@pytest.mark.parametrize("rates", list(RATES))
def test_delayed_choice_follows_the_rule(budget_gib: int, rates: str) -> None:
    x = inputs(budget_bytes=budget_gib * GIB, **RATES[rates])
    d = choose_ratio(x, "last", True, False, delayed=True)
    assert d["delayed"] is True
    assert_is_the_choice(x, d, "last", True, False, delayed=True)


@pytest.mark.parametrize("budget_gib", [16, 30, 70])
@pytest.mark.parametrize("rates", list(RATES))
def test_speculative_choice_follows_the_rule(budget_gib: int, rates: str) -> None:
    x = inputs(budget_bytes=budget_gib * GIB, **RATES[rates])
    d = choose_ratio(x, "last", True, False, speculative=True)
    assert d["speculative"] is True and d["delayed"] is False
    assert_is_the_choice(x, d, "last", True, False, speculative=True)


@pytest.mark.parametrize("placement", ["first", "last"])
def test_speculation_predicts_the_unclipped_overlap(placement: str) -> None:
    # while steps do not clip, the CPU starts as gradients land, as in eager mode; without it, clipping waits
    x = inputs()
    for r in (0.2, 0.4, 0.8):
        eager = predict_time(x, r, placement, True, True)
        assert predict_time(x, r, placement, True, False, speculative=True) == eager
        assert predict_time(x, r, placement, True, False) > eager


def test_the_delayed_update_hides_the_cpu_behind_the_next_iteration() -> None:
    x = inputs(cpu_elements_per_s=10e9)  # 0.4 of 2.65e9 elements: 106 ms of kernel, under F + B + G (220 ms)
    cpu = 0.4 * x.elements / x.cpu_elements_per_s + min(0.4 * x.grad_bytes, 128 << 20) / x.pcie_bytes_per_s
    gpu = 0.6 * x.elements / x.gpu_elements_per_s
    hidden = x.forward_s + x.backward_s + gpu + 0.25 * cpu
    assert predict_time(x, 0.4, "last", True, False, delayed=True) == pytest.approx(hidden)
    assert predict_time(x, 0.4, "last", True, False) > hidden  # clipping without the delay: part of it shows
    slow = inputs(cpu_elements_per_s=2e9)  # 530 ms of kernel, over F + B + G: the step is the CPU's time
    slow_cpu = (
        0.4 * slow.elements / slow.cpu_elements_per_s + min(0.4 * slow.grad_bytes, 128 << 20) / slow.pcie_bytes_per_s
    )
    assert predict_time(slow, 0.4, "last", True, False, delayed=True) == pytest.approx(slow_cpu)


def test_released_gradients_lower_the_predicted_peak() -> None:
    kept = inputs(released_bytes_per_ratio=0)
    assert predict_peak(inputs(), 0.5) == predict_peak(kept, 0.5) - 0.5 * 2 * 2_650_000_000
    assert predict_peak(inputs(), 0.0) == predict_peak(kept, 0.0)


def test_first_step_peak_counts_when_gradients_are_still_on_the_device() -> None:
    x = inputs(first_peak_bytes=11 * GIB, at_step_bytes=10 * GIB)  # all bf16 gradients + params ~ 10 GiB
    state = 0.7 * x.elements * 12 + x.temp_bytes
    assert predict_peak(x, 0.3) == max(11 * GIB + state - 0.3 * x.released_bytes_per_ratio, 10 * GIB + state)
    assert predict_peak(x, 0.3) == 10 * GIB + state


def fixed_rates(monkeypatch: pytest.MonkeyPatch, kernel: float, torch_adam: float) -> None:
    """The probes report these elements per second (the choice on a CPU follows the faster of the two)."""
    monkeypatch.setattr(twinflow.plan, "cpu_kernel_rate", lambda *a, **kw: kernel)
    monkeypatch.setattr(twinflow.plan, "device_adam_rate", lambda *a, **kw: torch_adam)


def test_budget_caps_the_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from twinflow.plan import IterationProbe

    fixed_rates(monkeypatch, kernel=1e9, torch_adam=2e9)  # torch's Adam faster: with room, ratio 0
    model = torch.nn.Linear(8, 8)
    params = list(model.parameters())
    for budget, budget_bytes, ratio in ((0, 0, 1.0), (1000, 900, 0.0)):  # the margin is kept below a budget too
        d = IterationProbe(torch.device("cpu")).decide(
            params, placement="first", eager=False, release_grads=False, margin=0.1, budget=budget, num_threads=1,
        )  # fmt: skip
        assert d["inputs"]["budget_bytes"] == budget_bytes and d["ratio"] == ratio
        # on the CPU both sides' state is host memory, which bounds it; fp32 state + staging for the CPU share
        assert 0 < d["inputs"]["host_budget_bytes"] < float("inf") and d["inputs"]["host_bytes_per_element"] == 16
        assert d["inputs"]["device_is_cpu"] is True
        assert_is_the_choice(Inputs(**d["inputs"]), d, "first", False, False)
    # 72 fp32 elements' device state (master and moments: 8 bytes each) fits in 900 bytes, and not in 500
    assert predict_peak(Inputs(**d["inputs"]), 0.0) == 576
    d = IterationProbe(torch.device("cpu")).decide(
        params, placement="first", eager=False, release_grads=False, margin=0.0, budget=500, num_threads=1,
    )  # fmt: skip
    assert 0.0 < d["ratio"] < 1.0 and d["ratio"] == 0.14  # 0.86 * 576 = 495.4 bytes fit, 0.87 * 576 do not
    assert_is_the_choice(Inputs(**d["inputs"]), d, "first", False, False)


@pytest.mark.parametrize(
    "attached, placement, kernel_faster",
    [(True, "first", False), (False, "last", False), (True, "last", True), (False, "first", True)],
)
def test_optimizer_decides_at_first_step_and_then_matches_adamw(attached: bool, placement: str, kernel_faster: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # rates 1e12 apart: the slow Adam would take 676 elements / 1e-3 per s = 6.8e5 s, so the choice does not
    # depend on the measured forward and backward, however loaded the machine is
    fixed_rates(monkeypatch, kernel=1e9 if kernel_faster else 1e-3, torch_adam=1e-3 if kernel_faster else 1e9)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio="auto", placement=placement, chunk_bytes=1024)
    if attached:
        opt.attach(model)
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
    assert d is not None and opt.split_summary["ratio_requested"] == "auto"
    assert 0.0 <= d["ratio"] <= 1.0 and opt.ratio == d["ratio"] == opt.split_summary["ratio_achieved"]
    assert (d["placement"], d["overlap"], d["eager"]) == (placement, attached, attached)
    assert_is_the_choice(Inputs(**d["inputs"]), d, placement, attached, attached)
    assert (d["inputs"]["forward_s"] > 0) == attached and d["inputs"]["cpu_elements_per_s"] > 0
    # Parameters on the CPU: the device side is torch's Adam on this same CPU, with no device memory limit; both
    # sides share the cores, so 'auto' puts everything where Adam steps faster, and the result is AdamW's.
    assert d["inputs"]["budget_bytes"] is None and d["inputs"]["device_is_cpu"] is True
    expected = 1.0 if kernel_faster else 0.0
    assert opt.ratio == expected and opt.split_summary["cpu"]["elements"] == expected * (16 * 32 + 32 + 32 * 4 + 4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("speculate, clip, expected", [(True, 1.0, True), (True, None, False), (False, 1.0, False)])
def test_auto_plans_for_speculation_only_where_it_runs(speculate: bool, clip: float | None, expected: bool) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = TwinFlowAdam(model.parameters(), ratio="auto", max_grad_norm=clip, speculate=speculate).attach(model)
    torch.nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
    opt.step()
    d = opt.auto_decision
    assert d["speculative"] is expected
    assert_is_the_choice(Inputs(**d["inputs"]), d, "last", True, d["eager"], speculative=expected)


def test_host_bytes_per_element_count_state_and_staging() -> None:
    assert host_bytes_per_element("fp32", 2, delayed=False, speculative=False) == 14
    assert host_bytes_per_element("int8", 2, delayed=False, speculative=False) == 8 + 2 / 256
    assert host_bytes_per_element("int8_m24", 2, delayed=True, speculative=False) == 9 + 2 / 256
    assert host_bytes_per_element("fp32", 4, delayed=False, speculative=True) == 12 + 8 + 12  # the second state set
    assert host_bytes_per_element("int8", 2, delayed=False, speculative=True) == 8 + 2 / 256  # never speculates


def fake_host(tmp_path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return f"{tmp_path}/"


MEMINFO = "MemTotal:       131072000 kB\nMemAvailable:   100000000 kB\n"


def test_host_memory_is_meminfo_or_the_cgroups_room(tmp_path) -> None:
    """MemAvailable alone; under a cgroup v2 limit (found through /proc/self/cgroup) its room, with droppable
    page cache not counted as used; a v2 group without a limit; cgroup v1; nothing readable at all."""
    assert host_available_bytes(fake_host(tmp_path / "a", {"proc/meminfo": MEMINFO})) == 100000000 * 1024
    v2 = {"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/job.slice/step_0\n",
          "sys/fs/cgroup/job.slice/step_0/memory.max": f"{40 * GIB}\n",
          "sys/fs/cgroup/job.slice/step_0/memory.current": f"{30 * GIB}\n",
          "sys/fs/cgroup/job.slice/step_0/memory.stat": f"anon {20 * GIB}\ninactive_file {8 * GIB}\n",
          "sys/fs/cgroup/memory.max": "max\n"}  # fmt: skip
    assert host_available_bytes(fake_host(tmp_path / "b", v2)) == 18 * GIB  # 40 - (30 - 8)
    unlimited = v2 | {"sys/fs/cgroup/job.slice/step_0/memory.max": "max\n"}
    assert host_available_bytes(fake_host(tmp_path / "c", unlimited)) == 100000000 * 1024
    v1 = {"proc/meminfo": MEMINFO, "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{16 * GIB}\n",
          "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{10 * GIB}\n",
          "sys/fs/cgroup/memory/memory.stat": f"total_inactive_file {GIB}\n"}  # fmt: skip
    assert host_available_bytes(fake_host(tmp_path / "d", v1)) == 7 * GIB
    assert host_available_bytes(f"{tmp_path}/nothing/") == float("inf")


def test_ranks_on_one_host_share_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_ranks() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_ranks() == 4


def test_auto_counts_only_trainable_parameters() -> None:
    """A frozen base (LoRA-like) takes no optimizer state: counting it would plan host and device memory for
    elements that never get any."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    model[0].requires_grad_(False)
    opt = TwinFlowAdam(model.parameters(), ratio="auto").attach(model)
    torch.nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
    opt.step()
    assert opt.auto_decision["inputs"]["elements"] == 64 * 4 + 4


@pytest.mark.parametrize("host_gib", [30, 40, 60])
@pytest.mark.parametrize("rates", list(RATES))
def test_host_memory_caps_the_ratio(host_gib: int, rates: str) -> None:
    """A CPU-bound run with plenty of device memory wants a low ratio anyway; a GPU-bound one wants a high ratio,
    which the host's memory cuts to what it holds."""
    x = inputs(budget_bytes=70 * GIB, host_bytes_per_element=14.0, host_budget_bytes=host_gib * GIB, **RATES[rates])
    d = choose_ratio(x, "last", overlap=True, eager=True)
    assert_is_the_choice(x, d, "last", True, True)
    assert d["predicted_host_bytes"] == predict_host(x, d["ratio"]) <= host_gib * GIB
    unlimited = choose_ratio(inputs(budget_bytes=70 * GIB, **RATES[rates]), "last", overlap=True, eager=True)
    if predict_host(x, unlimited["ratio"]) > host_gib * GIB:  # the host would not hold the unlimited choice
        assert d["ratio"] < unlimited["ratio"]
    else:
        assert d["ratio"] == unlimited["ratio"]


def test_no_ratio_in_both_memories_is_an_error_that_names_the_compact_precisions() -> None:
    """OPT-13B-like on an 80 GB GPU with a 125 GiB host: the GPU needs most of the model on the CPU, where fp32
    state does not fit; auto says so, with the ratios the 8-bit precisions would allow (their state smaller on
    both sides), and picks none of them."""
    x = inputs(elements=13_000_000_000, grad_bytes=26_000_000_000, released_bytes_per_ratio=0,
               first_peak_bytes=60 * GIB, at_step_bytes=55 * GIB, budget_bytes=72 * GIB,
               host_bytes_per_element=14.0, host_budget_bytes=88 * GIB,
               elements_by_dtype={"bfloat16": 13_000_000_000})  # fmt: skip
    with pytest.raises(NoRatioFits) as error:
        choose_ratio(x, "last", overlap=True, eager=True)
    message = str(error.value)
    # the device: (1 - r) 13e9 x 12 bytes of state on top of 60 GiB within 72 GiB; the host: 88 GiB / 13e9 / bytes
    assert "needs ratio at least 0.92" in message and "holds ratio at most 0.51" in message, message
    for precision in ("int8", "int8_m24"):
        device = state_precision.of(precision).device_bytes(torch.bfloat16)  # 6.0 and 3.0 (+ 2/256)
        host = host_bytes_per_element(precision, 2, False, False)  # 8.0 and 7.0
        other = inputs(**(asdict(x) | dict(state_bytes_per_element=device, host_bytes_per_element=host,
                                           state_precision=precision)))  # fmt: skip
        fits = [k / 100 for k in range(101) if predict_host(other, k / 100) <= other.host_budget_bytes
                and predict_peak(other, k / 100) <= other.budget_bytes]  # fmt: skip
        assert fits, precision
        assert (f"state_precision={precision!r} ({device:.1f} bytes of device state and {host:.1f} of host memory "
                f"a parameter: ratio {fits[0]:.2f} to {fits[-1]:.2f} fits)") in message, message  # fmt: skip
        d = choose_ratio(other, "last", overlap=True, eager=True)  # what the message promised
        assert fits[0] <= d["ratio"] <= fits[-1]
        assert_is_the_choice(other, d, "last", True, True)
    # int8's range starts higher than int8_m24's: its device state is twice as large
    assert re.search(r"'int8' \(6\.0 bytes.*ratio 0\.(\d\d) to.*'int8_m24' \(3\.0 bytes.*ratio 0\.(\d\d) to", message)


# ---------------------------------------------------------------- the device is the CPU


def cpu_inputs(**kw) -> Inputs:
    """A model on the CPU: the 'device side' is torch's Adam on the same cores, in host memory, with no limit."""
    base = dict(elements=125_000_000, grad_bytes=4 * 125_000_000, state_bytes_per_element=8.0, temp_bytes=0,
                released_bytes_per_ratio=0, first_peak_bytes=0, at_step_bytes=0, budget_bytes=None, forward_s=0.2,
                backward_s=0.6, cpu_elements_per_s=2.3e9, gpu_elements_per_s=1.0e9, pcie_bytes_per_s=float("inf"),
                host_bytes_per_element=16.0, host_budget_bytes=20 * GIB, device_is_cpu=True)  # fmt: skip
    return Inputs(**(base | kw))


@pytest.mark.parametrize("overlap, eager", [(False, False), (True, True)])
@pytest.mark.parametrize(
    "kernel, torch_adam, forward_s",
    [(2.3e9, 0.2e9, 0.2), (0.2e9, 2.3e9, 0.2), (2.3e9, 2.2e9, 0.2), (4e9, 1e9, 0.0), (1e9, 1e9, 0.5)],
)
def test_on_a_cpu_the_choice_is_the_predicted_fastest_of_all_or_nothing(
    kernel: float, torch_adam: float, forward_s: float, overlap: bool, eager: bool
) -> None:
    """Both Adams and the model share the same cores: a step is F + B + both sides' time. The choice is the ratio
    the fed measurements make fastest (1 where twinflow's kernel is faster by more than the tie, else 0), never a
    near-tie in between, whatever overlap attach() would give on a GPU."""
    x = cpu_inputs(cpu_elements_per_s=kernel, gpu_elements_per_s=torch_adam, forward_s=forward_s)
    d = choose_ratio(x, "last", overlap=overlap, eager=eager)
    serial = {r: x.forward_s + x.backward_s + (1 - r) * x.elements / torch_adam + r * x.elements / kernel for r in GRID}
    for r in GRID:  # nothing hides behind anything
        assert predict_time(x, r, "last", overlap, eager) == pytest.approx(serial[r])
    fastest = min(serial, key=serial.__getitem__)
    expected = fastest if serial[0.0] > serial[fastest] * 1.02 else 0.0
    assert d["ratio"] == expected and d["ratio"] in (0.0, 1.0) and d["binding"] == "time"


def test_a_cpu_whose_kernel_measured_faster_gets_ratio_1_where_a_free_device_side_gave_0() -> None:
    """The report this guards: ratio 1 measured fastest on a CPU, and auto still chose 0, because it took the
    device side's Adam as free (an infinite rate) and the CPU share's work as hidden behind the backward."""
    measured = cpu_inputs(cpu_elements_per_s=2.3e9, gpu_elements_per_s=0.3e9)
    assert choose_ratio(measured, "last", overlap=True, eager=True)["ratio"] == 1.0
    as_before = Inputs(**(asdict(measured) | dict(gpu_elements_per_s=float("inf"), device_is_cpu=False)))
    assert choose_ratio(as_before, "last", overlap=True, eager=True)["ratio"] == 0.0


def test_on_a_cpu_host_memory_holds_both_sides_state_and_can_keep_ratio_0() -> None:
    """At ratio 1 an fp32 model's state is 16 bytes a parameter (master, moments, staging) against torch's 8 at
    ratio 0: a faster kernel is not chosen where the host cannot hold its state."""
    x = cpu_inputs()
    assert predict_host(x, 0.0) == x.elements * 8 and predict_host(x, 1.0) == x.elements * 16
    tight = cpu_inputs(host_budget_bytes=x.elements * 12)
    d = choose_ratio(tight, "last", overlap=True, eager=True)
    assert d["ratio"] == 0.5 and d["binding"] == "host_memory"  # the most the host holds; faster than 0
    cut = choose_ratio(cpu_inputs(host_budget_bytes=x.elements * 8.5), "last", overlap=True, eager=True)
    assert cut["fastest_fitting_ratio"] == 0.06 and cut["ratio"] == 0.0  # 0.06 saves under 2%: the tie goes to 0
    assert cut["binding"] == "host_memory"
    with pytest.raises(NoRatioFits, match=r"does not fit this host's memory at any ratio") as error:
        choose_ratio(cpu_inputs(host_budget_bytes=x.elements * 7), "last", overlap=True, eager=True)
    assert "None" not in str(error.value) and "inf" not in str(error.value)


# ---------------------------------------------------------------- the probes' arithmetic, with injected timings


class FakeClock:
    """Time that passes only when the probed call runs: each call takes the next of `durations` seconds."""

    def __init__(self, durations: list[float]) -> None:
        self.now, self.durations, self.calls = 0.0, list(durations), []

    def __call__(self) -> float:
        return self.now

    def spend(self, **seen) -> None:
        self.calls.append(seen)
        self.now += self.durations.pop(0) if self.durations else 0.001


def test_timed_skips_the_warm_up_and_outlasts_a_burst_of_contention() -> None:
    # warm-up 10 s (a first-use compile, first touch), then 5 calls slowed by other processes, then the real speed
    clock = FakeClock([10.0] + [0.25] * 5 + [1 / 32] * 200)  # binary fractions: the sums are exact
    best = twinflow.plan.probes.timed(clock.spend, repeats=3, cuda=False, clock=clock, window_s=2.0, max_calls=100)
    assert best == 1 / 32  # a best-of-3 after the warm-up would have reported 0.25 s
    assert len(clock.calls) == 1 + 5 + 24  # 1.25 s of slow calls, then fast ones until 2 s of calls have passed
    clock = FakeClock([0.0] + [1e-6] * 500)
    twinflow.plan.probes.timed(clock.spend, repeats=3, cuda=False, clock=clock, window_s=2.0, max_calls=100)
    assert len(clock.calls) == 1 + 100  # short calls stop at max_calls
    clock = FakeClock([0.0] + [5.0] * 10)
    assert twinflow.plan.probes.timed(clock.spend, 3, False, clock, window_s=2.0) == 5.0 and len(clock.calls) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_probe_is_elements_over_seconds_of_one_call(monkeypatch: pytest.MonkeyPatch,
                                                               dtype: torch.dtype) -> None:  # fmt: skip
    """Parameters per second of one kernel call on all `tensors` (not per thread, not counting the build or the
    warm-up), the threads passed on, the staging (gradient in, weight out) in the parameters' dtype."""
    clock = FakeClock([30.0] + [0.5, 0.25, 0.4] + [0.25] * 10)

    def kernel(params, grads, exp_avgs, exp_avg_sqs, steps, *, out_copies, num_threads, **kw) -> None:
        assert out_copies is grads and {g.dtype for g in grads} == {dtype} and len(params) == 3 == len(steps)
        clock.spend(elements=sum(p.numel() for p in params), threads=num_threads)

    monkeypatch.setattr(ops, "adam_step_", kernel)
    rate = twinflow.plan.cpu_kernel_rate(2, 3000, dtype=dtype, tensors=3, clock=clock)
    assert rate == 3000 / 0.25  # 12,000 parameters a second: 1.2e-05 Gparam/s
    assert {c["elements"] for c in clock.calls} == {3000} and {c["threads"] for c in clock.calls} == {2}


def test_the_device_probe_times_torchs_adam_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the device side's Adam is measured (it was taken as infinitely fast), on the model's tensors."""
    clock = FakeClock([1.0, 0.125] + [0.5] * 10)

    def fused(masters, grads, exp_avgs, exp_avg_sqs, *a, **kw) -> None:
        assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in masters) and len(masters) == 4
        clock.spend(elements=sum(m.numel() for m in masters))

    monkeypatch.setattr(torch, "_fused_adamw_", fused)
    rate = twinflow.plan.device_adam_rate(torch.device("cpu"), 1 << 12, dtype=torch.float32, tensors=4, clock=clock)
    assert rate == (1 << 12) / 0.125 and {c["elements"] for c in clock.calls} == {1 << 12}
    assert twinflow.plan.device_adam_rate(torch.device("meta"), 1 << 12) == float("inf")  # nowhere to run it


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_device_probe_times_the_compact_step_where_a_gpu_runs_it(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under compact state a GPU's device side runs its own compact step, not fused AdamW: the probe times that
    step (every element of every tensor once a call). On the CPU fused AdamW stands in, as before."""
    from twinflow.device.device_compact import CompactDeviceState

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    clock, fused_calls = FakeClock([1.0, 0.125] + [0.5] * 10), []
    real_step = CompactDeviceState.step

    def step(self, states, *args) -> None:  # noqa: ANN001
        real_step(self, states, *args)
        clock.spend(elements=sum(st.seg.numel for st in states), tensors=len(states))

    def fused(masters, *args, **kwargs) -> None:  # noqa: ANN001
        fused_calls.append(len(masters))
        clock.spend(elements=sum(m.numel() for m in masters), tensors=len(masters))

    monkeypatch.setattr(CompactDeviceState, "step", step)
    monkeypatch.setattr(torch, "_fused_adamw_", fused)
    rate = twinflow.plan.device_adam_rate(torch.device(device), 3 * 4096, tensors=3, clock=clock,
                                          state_precision="int8_m24")  # fmt: skip
    assert rate == 3 * 4096 / 0.125
    assert {(c["elements"], c["tensors"]) for c in clock.calls} == {(3 * 4096, 3)}
    assert bool(fused_calls) == (device == "cpu")


def test_the_compact_probe_steps_the_state_as_the_device_side_does() -> None:
    """The probe's call moves every weight (a call that stepped nothing would time nothing), on the CPU here."""
    from twinflow.plan import probes

    weights = [(torch.randn(n) * 1e-4).bfloat16() for n in (300, 4096)]  # a step of lr 1e-5 shows in bfloat16
    before = [w.clone() for w in weights]
    run = probes.compact_device_step(weights, [torch.randn_like(w) for w in weights], "int8_m24")
    run()
    assert all((w != b).float().mean() > 0.9 for w, b in zip(weights, before))


def test_a_probe_steps_what_the_model_has_within_bounds() -> None:
    from twinflow.plan.probes import MIN_PROBE_ELEMENTS, PROBE_ELEMENTS, probe_elements

    assert probe_elements(72) == MIN_PROBE_ELEMENTS  # a call this small would time its fixed cost alone
    assert probe_elements(3_448_704) == 3_448_704
    assert probe_elements(1_300_000_000) == PROBE_ELEMENTS


# ---------------------------------------------------------------- explain(): one sentence a person can read


def gib_text(nbytes: float) -> str:
    """How the sentence writes an amount of memory: 0.1 GiB from 10 GiB up, else 0.01 GiB, else two digits."""
    gib = nbytes / GIB
    if gib >= 10 or gib >= 0.01 or gib <= 0:
        return f"{gib:.1f} GiB" if gib >= 10 else f"{gib:.2f} GiB"
    decimals = 2
    while round(gib, decimals) < 0.1 ** (decimals - 1) and decimals < 6:  # two significant digits
        decimals += 1
    return f"{gib:.{decimals}f} GiB"


def test_memory_reads_in_gib_with_two_significant_digits_when_small() -> None:
    assert [gib_text(b) for b in (40 * GIB, 1.5 * GIB, 0.0026 * GIB, 35_360, 0)] == [
        "40.0 GiB", "1.50 GiB", "0.0026 GiB", "0.000033 GiB", "0.00 GiB"]  # fmt: skip


def numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?", text)]


def assert_one_plain_sentence(text: str) -> None:
    assert "\n" not in text and text.endswith(".") and text.count(". ") == 0, text
    assert not re.search(r"\b(inf|nan|None)\b", text, re.IGNORECASE), text
    assert not re.search(r"\d e[+-]?\d|\de[+-]?\d", text), text  # no exponent notation


def machine_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


@pytest.mark.parametrize("kernel, torch_adam, ratio", [(1e9, 2e9, 0.0), (1e9, 1e3, 1.0)])
def test_explain_on_a_cpu_has_no_absurd_number(monkeypatch: pytest.MonkeyPatch, kernel: float, torch_adam: float,
                                               ratio: float) -> None:  # fmt: skip
    """The decision TwinFlowAdam(ratio="auto") takes on a CPU: no device budget (it was 2**62 bytes, shown as
    4e18), and a sentence whose every number is below this machine's memory in GiB."""
    fixed_rates(monkeypatch, kernel=kernel, torch_adam=torch_adam)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = TwinFlowAdam(model.parameters(), ratio="auto").attach(model)
    torch.nn.functional.mse_loss(model(torch.randn(8, 64)), torch.randn(8, 4)).backward()
    opt.step()
    d = opt.auto_decision
    assert d["ratio"] == ratio and d["inputs"]["budget_bytes"] is None
    text = explain(d)
    assert_one_plain_sentence(text)
    assert f"chose {ratio:.2f}" in text and "no device memory limit (the device is the CPU)" in text
    assert max(numbers(text)) <= machine_memory_gib(), text
    assert ("twinflow's kernel (1.00 Gparam/s) steps faster" in text) == (ratio == 1.0), text
    assert f"takes {gib_text(d['predicted_host_bytes'])} of host memory" in text


@pytest.mark.parametrize(
    "kw, binding, words",
    [
        (dict(budget_bytes=16 * GIB), "device_memory", "least share on the CPU"),
        (dict(budget_bytes=200 * GIB, gpu_elements_per_s=1e12), "time", "fastest step that fits"),
        (dict(budget_bytes=GIB), "nothing_fits", "even ratio 1"),
        (dict(budget_bytes=70 * GIB, host_bytes_per_element=14.0, host_budget_bytes=15 * GIB, **RATES["gpu-bound"]),
         "host_memory", "the host's memory"),
        (dict(budget_bytes=70 * GIB, **RATES["gpu-bound"]), "time", "smallest ratio predicted within 2%"),
    ],
)  # fmt: skip
def test_explain_names_what_bound_the_choice_in_words_and_gib(kw: dict, binding: str, words: str) -> None:
    x = inputs(**kw)
    d = choose_ratio(x, "first", overlap=False, eager=False)
    assert d["binding"] == binding
    text = explain(d)
    assert_one_plain_sentence(text)
    assert words in text and f"chose {d['ratio']:.2f}" in text, text
    assert gib_text(x.budget_bytes) in text and gib_text(d["predicted_peak_bytes"]) in text, text
    if binding == "host_memory":
        assert gib_text(x.host_budget_bytes) in text and f"at most ratio {d['fastest_fitting_ratio']:.2f}" in text


def test_weights_first_is_predicted_where_the_cpu_has_room_and_never_slower() -> None:
    from dataclasses import replace

    from twinflow.plan import PEEK_COMMIT

    def both(x: Inputs, r: float, **kw) -> tuple[float, float]:
        return predict_time(x, r, "first", True, False, **kw), predict_time(x, r, "first", True, False,
                                                                             weights_first=True, **kw)  # fmt: skip

    short, long = inputs(), inputs(forward_s=2.0, backward_s=4.0)
    for x in (short, long):
        for precision, (peek, _) in PEEK_COMMIT.items():  # each precision's own constants
            x = replace(x, state_precision=precision)
            for r in GRID:
                single, first = both(x, r)
                assert first <= single  # where the commits cannot keep up, the single pass runs
                cpu = r * x.elements / x.cpu_elements_per_s  # the kernel's part of the CPU's work
                assert first == single or first >= cpu  # the CPU's whole work (at least the single pass's) fits
                if r > 0:  # and the first chunk's download, which the peek does not shorten
                    cpu += min(r * x.grad_bytes, 128 << 20) / x.pcie_bytes_per_s
                assert first >= single - (1 - peek) * cpu - 1e-12  # the peek saves at most its share of the pass
    single, first = both(short, 1.0)
    # the whole model on a CPU that bounds the step: it still idles through forward and backward, and a share of
    # the chunks commits then
    assert first < single
    single, first = both(long, 0.5)
    assert first < single  # a long iteration: the peek's shorter critical path shows
    for kw in ({"delayed": True}, {"speculative": True}):
        assert both(long, 0.5, **kw)[0] == both(long, 0.5, **kw)[1]  # those schedules do not go weights first
    decision = choose_ratio(long, "first", True, False, weights_first=True)
    assert decision["weights_first"] is True and "chose" in explain(decision)
