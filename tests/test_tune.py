"""ratio="auto": the choice from measured inputs (pure), and the optimizer deciding at its first step."""

from dataclasses import asdict

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.tune import (
    Inputs,
    NoRatioFits,
    choose_ratio,
    host_available_bytes,
    host_bytes_per_element,
    local_ranks,
    predict_host,
    predict_peak,
    predict_time,
)

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
    """`d` is choose_ratio's rule applied by brute force over the ratios 0, 0.01, ..., 1 (twinflow.tune's docstring):
    the smallest of the fitting ratios predicted within 2% of the fastest fitting one; 1 when none fits."""
    r = d["ratio"]
    assert 0.0 <= r <= 1.0 and r in GRID, r
    times = {q: predict_time(x, q, placement, overlap, eager, delayed, speculative) for q in GRID}
    assert d["predicted_time_s"] == times[r] and d["predicted_peak_bytes"] == predict_peak(x, r)
    fitting = [q for q in GRID if predict_peak(x, q) <= x.budget_bytes and predict_host(x, q) <= x.host_budget_bytes]
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


def test_budget_caps_the_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import twinflow.tune
    from twinflow.tune import IterationProbe

    probe = twinflow.tune.cpu_kernel_rate  # still measured, on 64 Ki elements rather than 1 GiB of state
    monkeypatch.setattr(twinflow.tune, "cpu_kernel_rate", lambda num_threads, **kw: probe(num_threads, 1 << 16, **kw))

    model = torch.nn.Linear(8, 8)
    params = list(model.parameters())
    for budget, budget_bytes, ratio in ((0, 0, 1.0), (1000, 900, 0.0)):  # the margin is kept below a budget too
        d = IterationProbe(torch.device("cpu")).decide(
            params, placement="first", eager=False, release_grads=False, margin=0.1, budget=budget, num_threads=1,
        )  # fmt: skip
        assert d["inputs"]["budget_bytes"] == budget_bytes and d["ratio"] == ratio
        # on the CPU both sides' state is host memory: the host does not bound the ratio; fp32 state + staging
        assert d["inputs"]["host_budget_bytes"] == float("inf") and d["inputs"]["host_bytes_per_element"] == 16
        assert_is_the_choice(Inputs(**d["inputs"]), d, "first", False, False)
    # 72 fp32 elements' device state (master and moments: 8 bytes each) fits in 900 bytes, and not in 500
    assert predict_peak(Inputs(**d["inputs"]), 0.0) == 576
    d = IterationProbe(torch.device("cpu")).decide(
        params, placement="first", eager=False, release_grads=False, margin=0.0, budget=500, num_threads=1,
    )  # fmt: skip
    assert 0.0 < d["ratio"] < 1.0 and d["ratio"] == 0.14  # 0.86 * 576 = 495.4 bytes fit, 0.87 * 576 do not
    assert_is_the_choice(Inputs(**d["inputs"]), d, "first", False, False)


@pytest.mark.parametrize("attached, placement", [(True, "first"), (False, "last")])
def test_optimizer_decides_at_first_step_and_then_matches_adamw(attached: bool, placement: str) -> None:
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
    # Parameters on the CPU: no GPU to offload from, so the device side (here the CPU) is free and fastest.
    # Every ratio fits the unbounded budget, and any CPU share only adds kernel time: 'auto' picks 0.
    assert d["inputs"]["gpu_elements_per_s"] == float("inf") and d["inputs"]["budget_bytes"] > 1 << 60
    assert opt.ratio == 0.0 and opt.split_summary["cpu"]["elements"] == 0
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
    state does not fit; auto says so, with the ratios the 8-bit precisions would hold, and picks none of them."""
    x = inputs(elements=13_000_000_000, grad_bytes=26_000_000_000, released_bytes_per_ratio=0,
               first_peak_bytes=60 * GIB, at_step_bytes=55 * GIB, budget_bytes=72 * GIB,
               host_bytes_per_element=14.0, host_budget_bytes=88 * GIB)  # fmt: skip
    with pytest.raises(NoRatioFits) as error:
        choose_ratio(x, "last", overlap=True, eager=True)
    message = str(error.value)
    # the device: (1 - r) 13e9 x 12 bytes of state on top of 60 GiB within 72 GiB; the host: 88 GiB / 13e9 / bytes
    assert "needs ratio at least 0.92" in message and "holds ratio at most 0.51" in message, message
    assert "state_precision='int8' (8.0 bytes: ratio up to 0.91)" in message  # 8 + 2/256: still short of 0.92
    assert "state_precision='int8_m24' (7.0 bytes: ratio up to 1.00)" in message
    m24 = inputs(**(asdict(x) | dict(host_bytes_per_element=host_bytes_per_element("int8_m24", 2, False, False),
                                     state_precision="int8_m24")))  # fmt: skip
    d = choose_ratio(m24, "last", overlap=True, eager=True)  # what the message promised
    assert d["ratio"] >= 0.92
    assert_is_the_choice(m24, d, "last", True, True)
    int8 = inputs(**(asdict(x) | dict(host_bytes_per_element=host_bytes_per_element("int8", 2, False, False),
                                      state_precision="int8")))  # fmt: skip
    with pytest.raises(NoRatioFits, match=r"int8_m24.*ratio up to 1\.00"):
        choose_ratio(int8, "last", overlap=True, eager=True)
