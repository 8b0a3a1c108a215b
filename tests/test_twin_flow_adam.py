"""TwinFlowAdam against torch.optim.AdamW, on the CPU (device side on the CPU too) and on CUDA."""

import io

import pytest
import torch

from twinflow import TwinFlowAdam

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def make_model(device: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 48),
        torch.nn.LayerNorm(48),
        torch.nn.GELU(),
        torch.nn.Linear(48, 24),
        torch.nn.Linear(24, 6),
    )
    return model.to(device=device, dtype=dtype)


def groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": list(model[0].parameters()) + list(model[1].parameters()), "lr": 3e-3, "weight_decay": 0.05},
        {"params": list(model[3].parameters()) + list(model[4].parameters()), "lr": 1e-3, "weight_decay": 0.0},
    ]


def run(model, opt, sched, steps: int, device: str, seed: int, clip: float | None = None) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 24, generator=gen).to(device, dtype)
        y = torch.randn(16, 6, generator=gen).to(device, dtype)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        if clip is not None:
            if isinstance(opt, TwinFlowAdam):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def assert_params_close(a: torch.nn.Module, b: torch.nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.float(), pb.float(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["first", "last"])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 1.0])
def test_matches_adamw(device: str, ratio: float, placement: str) -> None:
    """30 steps, two groups, LambdaLR, clipping, and a mid-run state_dict round trip to another ratio."""
    ours, ref = make_model(device), make_model(device)
    lam = lambda s: 1.0 / (1.0 + 0.1 * s)  # noqa: E731
    opt = TwinFlowAdam(groups(ours), ratio=ratio, placement=placement, chunk_bytes=1024)
    ref_opt = torch.optim.AdamW(groups(ref))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lam)
    assert run(ours, opt, sched, 15, device, 1, clip=0.5) == pytest.approx(
        run(ref, ref_opt, ref_sched, 15, device, 1, clip=0.5), rel=1e-5
    )

    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    other = TwinFlowAdam(groups(ours), lr=1.0, ratio=1.0 - ratio, placement="last", chunk_bytes=4096)
    sched2 = torch.optim.lr_scheduler.LambdaLR(other, lam)  # before load_state_dict, as torch.optim requires
    other.load_state_dict(torch.load(buf, weights_only=True))
    sched2.load_state_dict(sched.state_dict())
    assert run(ours, other, sched2, 15, device, 2) == pytest.approx(
        run(ref, ref_opt, ref_sched, 15, device, 2), rel=1e-5
    )
    assert_params_close(ours, ref)
    assert [g["lr"] for g in other.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups])


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_loads_into_adamw_and_back(device: str) -> None:
    ours, ref = make_model(device), make_model(device)
    opt = TwinFlowAdam(ours.parameters(), lr=2e-3, weight_decay=0.01, ratio=0.5, chunk_bytes=2048)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.01)
    none = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ref_none = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0)
    run(ours, opt, none, 5, device, 3)
    run(ref, ref_opt, ref_none, 5, device, 3)
    adamw = torch.optim.AdamW(ours.parameters(), lr=2e-3, weight_decay=0.01)
    adamw.load_state_dict(opt.state_dict())
    run(ours, adamw, torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1.0), 5, device, 4)
    run(ref, ref_opt, ref_none, 5, device, 4)
    back = TwinFlowAdam(ours.parameters(), ratio=0.3, placement="last", chunk_bytes=2048)
    back.load_state_dict(adamw.state_dict())
    run(ours, back, torch.optim.lr_scheduler.LambdaLR(back, lambda s: 1.0), 5, device, 5)
    run(ref, ref_opt, ref_none, 5, device, 5)
    assert_params_close(ours, ref)
    assert back.state_dict()["state"][0]["step"].item() == 15


def test_split_summary_and_no_host_state_at_ratio_zero() -> None:
    model = make_model("cpu")
    opt = TwinFlowAdam(model.parameters(), ratio=0.0)
    assert opt.split_summary["cpu"]["elements"] == 0 and opt.coordinator.split.host is None
    assert opt.coordinator.host.chunk_count == 0 and not opt.coordinator.host.chunks_of
    opt = TwinFlowAdam(model.parameters(), ratio=0.37)
    total = sum(p.numel() for p in model.parameters())
    assert opt.split_summary["cpu"]["elements"] == round(0.37 * total)
    assert opt.split_summary["ratio_achieved"] == pytest.approx(0.37, abs=1 / total)


def test_params_without_grad_are_skipped() -> None:
    model = make_model("cpu")
    model[0].weight.requires_grad_(False)
    before = model[0].weight.detach().clone()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=1024)
    run(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 3, "cpu", 6)
    assert torch.equal(model[0].weight, before)
    assert 0 not in opt.state_dict()["state"] and opt.state_dict()["state"][1]["step"].item() == 3


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"ratio": 1.5}, ValueError, r"ratio=1.5"),
        ({"ratio": "abc"}, TypeError, r"ratio='abc'"),
        ({"placement": "middle"}, ValueError, r"placement='middle'"),
        ({"lr": -1.0}, ValueError, "Invalid learning rate"),
        ({"chunk_bytes": 10}, ValueError, "chunk_bytes=10"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        TwinFlowAdam(make_model("cpu").parameters(), **kwargs)


def test_sparse_gradient_is_refused() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = TwinFlowAdam(emb.parameters(), ratio=0.5)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradient"):
        opt.step()


@pytest.mark.cuda
def test_parameters_on_several_devices_are_refused() -> None:
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, device="cuda"))
    with pytest.raises(ValueError, match="several devices"):
        TwinFlowAdam([a, b])


def test_fp16_overflow_skips_both_sides() -> None:
    model = make_model("cpu", torch.float16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=1024)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = opt.state_dict()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model[4].bias.grad[0] = float("inf")  # the last tensor: device side under placement "first"
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    after = opt.state_dict()
    for i, entry in state_before["state"].items():
        assert all(torch.equal(v, after["state"][i][k]) for k, v in entry.items())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_without_bias_correction_matches_cpu_adam(device: str, adamw_mode: bool) -> None:
    """Both sides without bias correction agree with CPUAdam (itself checked against a float64 reference)."""
    from twinflow import CPUAdam

    ours, ref = make_model(device), make_model("cpu")
    kw = dict(lr=2e-3, weight_decay=0.1, adamw_mode=adamw_mode, bias_correction=False)
    opt = TwinFlowAdam(ours.parameters(), ratio=0.5, chunk_bytes=1024, **kw)
    ref_opt = CPUAdam(ref.parameters(), **kw)
    gen = torch.Generator().manual_seed(7)
    for _ in range(10):
        for p, r in zip(ours.parameters(), ref.parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.grad, r.grad = g.to(device), g.clone()
        opt.step()
        ref_opt.step()
    assert_params_close(ours.cpu(), ref)


# ---------------------------------------------------------------- CUDA only
def bf16_params(n_tensors: int, size: int, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    sizes = [size + 37 * i for i in range(n_tensors)]  # odd sizes: pieces straddle chunk boundaries
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to("cuda", torch.bfloat16)) for n in sizes]


def assert_within_bf16_rounding(weights: torch.Tensor, master: torch.Tensor) -> None:
    """Every weight within one bf16 ulp (+1e-6) of the reference master, at most 0.1% not its exact rounding.

    Two fp32 masters that agree to ~1e-7 can still round to neighbouring bf16
    values; stale or misplaced data changes far more than 0.1% of elements.
    """
    rounded = master.bfloat16().float()
    ulp = torch.nextafter(
        master.abs().bfloat16(), torch.tensor(float("inf"), device=master.device, dtype=torch.bfloat16)
    )
    ulp = ulp.float() - master.abs().bfloat16().float()
    # fp32 rounding in Adam is absolute (~lr x 1e-7), so near zero the bound needs a floor;
    # a stale update (~lr = 1e-2) is still four orders of magnitude above it.
    assert ((weights - rounded).abs() <= ulp + 1e-6).all(), "a weight is more than one bf16 ulp from the reference"
    inexact = (weights != rounded).float().mean().item()
    assert inexact <= 1e-3, f"{inexact:.2%} of the weights differ from the reference's rounding"


def train_against_master_reference(chunk_bytes: int, steps: int, busy_gpu: bool, ratio: float = 0.6) -> None:
    """bf16 params stepped by TwinFlowAdam vs torch AdamW on fp32 masters fed the same bf16 gradients."""
    params = bf16_params(6, 200_000, seed=11)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = TwinFlowAdam(params, lr=1e-2, weight_decay=0.01, ratio=ratio, chunk_bytes=chunk_bytes)
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    gen = torch.Generator(device="cuda").manual_seed(12)
    for _ in range(steps):
        for p, m in zip(params, masters):
            if busy_gpu:
                torch.cuda._sleep(2_000_000)  # the gradients arrive late: a missing wait reads stale buffers
            g = torch.randn(p.shape, device="cuda", generator=gen).bfloat16()
            p.grad = g
            m.grad = g.float()
        opt.step()
        ref.step()
        # The next "forward": read the weights on the current stream right after step().
        seen = [p.detach().float().clone() for p in params]
        for s, m in zip(seen, masters):
            assert_within_bf16_rounding(s, m.detach())
    state = opt.state_dict()["state"]
    for i, m in enumerate(masters):
        torch.testing.assert_close(state[i]["master"].reshape(-1).cpu(), m.detach().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_bf16_model_matches_fp32_master_adamw() -> None:
    train_against_master_reference(chunk_bytes=1 << 20, steps=20, busy_gpu=False)


@pytest.mark.cuda
def test_race_many_chunks_busy_gpu() -> None:
    """Tiny chunks (hundreds of buffer swaps a step) while the GPU lags behind the host."""
    train_against_master_reference(chunk_bytes=16 << 10, steps=4, busy_gpu=True)


@pytest.mark.cuda
@pytest.mark.parametrize("removed", ["grad_ready", "final_wait"])
def test_race_test_catches_a_missing_synchronisation(monkeypatch: pytest.MonkeyPatch, removed: str) -> None:
    """The race test above must fail when one of the synchronisations is taken out."""
    from twinflow.base import transfer
    from twinflow.host import staging

    if removed == "grad_ready":
        original_init = staging.Staging.__init__

        def init_without_wait(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            for chunk in self.chunks:
                chunk.grad_ready = transfer.NoEvent()

        monkeypatch.setattr(staging.Staging, "__init__", init_without_wait)
    else:
        original_h2d = transfer.Streams.h2d

        def slow_upload_stream(self):
            with torch.cuda.stream(self.h2d_stream):
                torch.cuda._sleep(5_000_000)
            return original_h2d(self)

        monkeypatch.setattr(transfer.Streams, "h2d", slow_upload_stream)
        monkeypatch.setattr(transfer.Streams, "compute_waits", lambda self, event: None)
    with pytest.raises(AssertionError):
        train_against_master_reference(chunk_bytes=16 << 10, steps=4, busy_gpu=True)


@pytest.mark.cuda
def test_memory_is_flat_over_100_steps() -> None:
    import os

    params = bf16_params(4, 1_000_000, seed=13)
    opt = TwinFlowAdam(params, ratio=0.5, chunk_bytes=1 << 20)
    buffers = [c.buffer.data_ptr() for c in opt.coordinator.host.staging.chunks]
    readings = []
    for step in range(100):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step in (9, 99):
            torch.cuda.synchronize()
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            readings.append((torch.cuda.memory_allocated(), rss))
    assert readings[1][0] == readings[0][0], "device memory grew"
    assert readings[1][1] - readings[0][1] < 32 << 20, "host memory grew by more than 32 MiB"
    assert [c.buffer.data_ptr() for c in opt.coordinator.host.staging.chunks] == buffers
    cpu_grad_bytes = opt.split_summary["cpu"]["elements"] * 2
    assert cpu_grad_bytes <= opt.split_summary["pinned_bytes"] <= cpu_grad_bytes + 64 * len(buffers) * 4


def test_failed_pinned_allocation_says_how_much_and_what_to_lower(monkeypatch: pytest.MonkeyPatch) -> None:
    from twinflow.base import transfer

    real_empty = torch.empty

    def failing_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(transfer.torch, "empty", failing_empty)
    with pytest.raises(RuntimeError, match=r"128.0 MiB of pinned host memory.*lower the ratio"):
        transfer.pinned_buffers([32 << 20] * 4, True, "gradients")


def test_device_side_upcast_in_small_pieces_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 gradients are upcast at most _UPCAST_ELEMENTS at a time; cutting segments must not change a bit."""
    from twinflow.device import device_side

    results = []
    for limit in (1 << 26, 7):  # 7: every segment cut into many pieces, several batches per group
        monkeypatch.setattr(device_side, "UPCAST_ELEMENTS", limit)
        model = make_model("cpu", torch.bfloat16)
        opt = TwinFlowAdam(groups(model), ratio=0.3, placement="first", chunk_bytes=1024, max_grad_norm=0.5)
        run(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 6, "cpu", 8)
        results.append([p.detach().clone() for p in model.parameters()])
        assert opt.state_dict()["state"][len(results[-1]) - 1]["step"].item() == 6
    for a, b in zip(*results):
        assert torch.equal(a, b)


def stepped_once() -> TwinFlowAdam:
    """An optimizer of two parameters (the second cut by the ratio) after one step."""
    params = [torch.nn.Parameter(torch.randn(16, 4)), torch.nn.Parameter(torch.randn(9))]
    opt = TwinFlowAdam(params, lr=1e-3, ratio=0.5)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize("key", ["step", "exp_avg", "exp_avg_sq"])
def test_load_state_dict_names_the_parameter_and_the_missing_entry_before_changing_anything(key: str) -> None:
    opt = stepped_once()
    saved = opt.state_dict()
    del saved["state"][1][key]
    saved["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match=rf"parameter 1: no '{key}' entry"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 1e-3  # nothing changed


@pytest.mark.parametrize("step", ["3", [3], -1, 2.5, float("nan"), float("inf"), torch.tensor([1.0, 2.0])])
def test_load_state_dict_refuses_a_bad_step_count_before_changing_anything(step: object) -> None:
    opt = stepped_once()
    before = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    saved = opt.state_dict()
    saved["state"][0]["exp_avg"] = torch.full_like(saved["state"][0]["exp_avg"], 7.0)  # loaded before the bad one
    saved["state"][1]["step"] = step
    saved["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match="state of parameter 1: step is .*expected a whole number >= 0"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 1e-3
    for i, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, before[i][key]), (i, key)


def test_a_dropped_optimizer_is_freed_at_once_and_its_worker_ends() -> None:
    """Nothing of the optimizer's points back at it: dropping the last reference frees its state and pinned
    buffers and ends its worker thread, without waiting for a garbage collection."""
    import gc
    import threading
    import weakref

    def workers() -> int:
        return sum(t.name == "twinflow-cpu-adam" and t.is_alive() for t in threading.enumerate())

    gc.collect()
    gc.disable()
    try:
        before = workers()
        model = make_model("cpu")
        opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=1024)
        model(torch.randn(4, 24)).sum().backward()
        opt.step()
        assert workers() == before + 1
        ref = weakref.ref(opt)
        del opt
        assert ref() is None
        assert workers() == before
    finally:
        gc.enable()


def test_settings_changed_between_steps_take_effect_from_the_next_step() -> None:
    """As before the redesign, the settings are attributes a user may change between steps: a delay set after
    one exact step delays the next, exactly as an optimizer built with it."""
    runs = []
    for late in (True, False):
        model = make_model("cpu", seed=3)
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=1.0, chunk_bytes=1024,
                           delay_after=None if late else 1)  # fmt: skip
        gen = torch.Generator().manual_seed(5)
        for step in range(3):
            if late and step == 1:
                opt.delay_after = 1
            before = [p.detach().clone() for p in model.parameters()]
            model(torch.randn(4, 24, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
            assert moved == (step != 1), step  # delayed from step 1 on: step 2 applies step 1's update
        assert opt.delay_after == 1 and opt.coordinator.host.late_pending
        opt.synchronize()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="chunk_bytes=3"):
        opt.chunk_bytes = 3
    with pytest.raises(ValueError, match="delay_after=-1"):
        opt.delay_after = -1
    assert opt.chunk_bytes == 1024 and opt.delay_after == 1


@pytest.mark.parametrize("attach", [False, True])
def test_layout_settings_set_after_steps_take_effect_at_the_next_step(attach: bool) -> None:
    """``placement`` and ``chunk_bytes`` set after steps rebuild the split in them at the next step (the state
    kept): the summary says so, and the run goes on as one whose state was loaded into an optimizer built with
    them. ``num_threads`` and the speculation settings are read where they act, from the one ``Settings``."""

    def run(switch: bool) -> tuple[list[float], list[torch.Tensor], TwinFlowAdam]:
        model = make_model("cpu", seed=3)
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, chunk_bytes=1024)
        if attach:
            opt.attach(model)
        gen = torch.Generator().manual_seed(5)
        losses = []
        for step in range(5):
            if step == 2 and switch:
                opt.placement, opt.chunk_bytes, opt.num_threads = "last", 4096, 1
                assert opt.split_summary["placement"] == "first"  # not rebuilt before the step
            elif step == 2:  # the reference: the same state loaded into an optimizer built with the new settings
                state = opt.state_dict()
                if attach:
                    opt.detach()
                opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, placement="last", chunk_bytes=4096,
                                   num_threads=1)  # fmt: skip
                opt.load_state_dict(state)
                if attach:
                    opt.attach(model)
            loss = model(torch.randn(4, 24, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.synchronize()
        return losses, [p.detach().clone() for p in model.parameters()], opt

    switched, loaded = run(switch=True), run(switch=False)
    opt = switched[2]
    assert (opt.placement, opt.chunk_bytes, opt.num_threads) == ("last", 4096, 1)
    assert opt.split_summary["placement"] == "last"
    assert opt.split_summary["chunks"] == loaded[2].split_summary["chunks"]
    assert switched[0] == loaded[0]
    for a, b in zip(switched[1], loaded[1]):
        assert torch.equal(a, b)
    opt.max_grad_norm, opt.speculate = 1.0, True
    assert opt.coordinator.speculation.max_grad_norm == 1.0 and opt.coordinator.speculation.asked


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_another_default_dtype_leaves_the_cpu_state_float32(default: torch.dtype) -> None:
    """A script that changed torch's default dtype still gets float32 moments on the CPU side (the kernel takes
    nothing else), and the same step as AdamW."""
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default)
        p = torch.nn.Parameter(torch.randn(2000, dtype=torch.float32))
        q = torch.nn.Parameter(p.detach().clone())
        opt, ref = TwinFlowAdam([p], lr=1e-2, ratio=1.0), torch.optim.AdamW([q], lr=1e-2)
        for _ in range(3):
            p.grad = torch.randn(2000, dtype=torch.float32)
            q.grad = p.grad.clone()
            opt.step()
            ref.step()
    finally:
        torch.set_default_dtype(before)
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
