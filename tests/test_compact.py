"""TwinFlowAdam(state_precision="int8" / "int8_m24"): 8-bit CPU-side moments (and 24-bit masters), through the
optimizer, its state dicts and configs."""

import copy

import pytest
import torch
import torch.nn.functional as F

import twinflow
from twinflow import TwinFlowAdam
from twinflow.host import ops
from twinflow.precision import compact


def make(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.GELU(), torch.nn.Linear(300, 8))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=gen).to(dtype), torch.randn(32, 8, generator=gen)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if isinstance(opt, TwinFlowAdam):
        opt.synchronize()
    return losses


COMPACT = ["int8", "int8_m24"]


@pytest.mark.parametrize("precision", COMPACT)
def test_cpu_side_steps_are_the_kernels_bit_for_bit(precision: str) -> None:
    """Ratio 1, one chunk: each parameter is one piece, so the optimizer's state must be exactly what calling the
    8-bit kernel on each parameter gives (the plumbing: codes kept, steps counted, index bases, hyper-parameters;
    with 24-bit masters, the masters and the weights written from them)."""
    model, direct = make(), make()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=1.0, state_precision=precision, weight_decay=0.1)
    params = list(direct.parameters())
    state = [compact.fresh(p.numel()) for p in params]
    m24 = [compact.Master24.empty(p.numel()).copy_(p.detach()) for p in params] if precision == "int8_m24" else None
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
        for m in (model, direct):
            F.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            grads = [p.grad.view(-1) for p in params]
            flat = [p.view(-1) for p in params]
            masters, extra = compact.kernel_masters(m24 or flat)
            ops.adam_step_q8_(masters, grads, *zip(*state), [step] * len(params), lr=1e-2, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.1, **extra, **({"out_copies": flat} if m24 else {}))  # fmt: skip
        direct.zero_grad()
    opt.synchronize()
    for i, (p, q) in enumerate(zip(model.parameters(), direct.parameters())):
        assert torch.equal(p, q)
        if m24:  # the float32 weights are the 24-bit masters, whose low 8 bits are zero
            assert torch.equal(p.view(-1), m24[i].float()) and not (p.view(-1).view(torch.int32) & 0xFF).any()
    for i, entry in opt.state_dict()["state"].items():
        assert torch.equal(entry["exp_avg"].view(-1), compact.decode_exp_avg(state[i][0], state[i][1]))
        assert torch.equal(entry["exp_avg_sq"].view(-1), compact.decode_exp_avg_sq(state[i][2], state[i][3]))


@pytest.mark.parametrize("precision", COMPACT)
@pytest.mark.parametrize("ratio, placement", [(0.6, "last"), (0.6, "first"), (1.0, "first")])
def test_trains_like_adamw_and_its_state_dict_is_adamws(ratio: float, placement: str, precision: str) -> None:
    model, ref = make(), make()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio, placement=placement, chunk_bytes=4096,
                       state_precision=precision)  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = train(model, opt, 100), train(ref, ref_opt, 100)
    assert abs(sum(losses[-20:]) - sum(ref_losses[-20:])) / sum(ref_losses[-20:]) < 0.01
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert opt.split_summary["cpu"]["elements"] > 0
    for i in theirs:
        for key in ("exp_avg", "exp_avg_sq"):
            rel = ((ours[i][key] - theirs[i][key]).norm() / theirs[i][key].norm()).item()
            # decoded 8-bit moments: AdamW's, up to the stochastic rounding's noise (about 0.2 here after 100 steps;
            # fp32 moments match exactly), which the losses above do not feel; a wrong scale would be off by far more
            assert rel < 0.35, (i, key, rel)
    # the state dict is torch.optim's: AdamW loads it and goes on
    again = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    again.load_state_dict(opt.state_dict())
    assert int(again.state_dict()["state"][0]["step"]) == 100


@pytest.mark.parametrize("precision", COMPACT)
def test_state_moves_between_precisions_and_from_adamw(precision: str) -> None:
    model = make()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, adamw, 20)
    saved = copy.deepcopy(adamw.state_dict())
    q8 = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, chunk_bytes=4096, state_precision=precision)
    q8.load_state_dict(saved)
    loaded = q8.state_dict()["state"]
    rels = [((loaded[i][key] - entry[key]).norm() / entry[key].norm()).item()
            for i, entry in saved["state"].items() for key in ("exp_avg", "exp_avg_sq")]  # fmt: skip
    # the CPU side's, encoded to the nearest code: within half a step of 3 mantissa bits, 1/16 of the value
    assert max(rels) < 1 / 16 and sum(r > 0 for r in rels) >= 2
    fp32 = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.3, state_precision="fp32")
    fp32.load_state_dict(q8.state_dict())
    for i, entry in fp32.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], loaded[i][key])
    losses = train(model, q8, 30, seed=2)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("precision, per_element", [("int8", 6), ("int8_m24", 5)])
def test_host_state_bytes_a_parameter(precision: str, per_element: int) -> None:
    model = make()
    opt = TwinFlowAdam(model.parameters(), ratio=1.0, state_precision=precision)
    train(model, opt, 1)
    cpu = opt.split_summary["cpu"]
    assert cpu["state_precision"] == precision
    blocks = sum(compact.blocks(p.numel()) for p in model.parameters())  # one piece each at the default chunk size
    assert cpu["state_bytes"] == per_element * cpu["elements"] + 2 * blocks
    assert cpu["state_bytes"] / cpu["elements"] < per_element + 0.01
    fp32 = TwinFlowAdam(make().parameters(), ratio=1.0)
    assert fp32.split_summary["cpu"]["state_bytes"] == 12 * cpu["elements"]


@pytest.mark.parametrize("precision", COMPACT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_copy_goes_on_exactly(precision: str, dtype: torch.dtype) -> None:
    """deepcopy decodes and re-encodes the state: a grid value comes back as its own code (and a 24-bit master as
    itself), so the copy trains bit for bit like the original."""
    model = make().to(dtype)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, chunk_bytes=4096, state_precision=precision)
    train(model, opt, 5)
    twin_model, twin = copy.deepcopy((model, opt))
    assert twin.state_precision == precision
    train(model, opt, 3, seed=5)
    train(twin_model, twin, 3, seed=5)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(opt.state_dict()["state"].values(), twin.state_dict()["state"].values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key], b[key])


@pytest.mark.parametrize("precision", COMPACT)
def test_speculation_is_off_and_the_delay_works_with_8_bit_moments(precision: str) -> None:
    model = make()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, placement="last", chunk_bytes=4096,
                       max_grad_norm=1e9, speculate=True, state_precision=precision).attach(model)  # fmt: skip
    losses = train(model, opt, 30)
    assert opt.coordinator.host.speculative.speculated_chunks == 0 and losses[-1] < losses[0]
    delayed = make()
    opt = TwinFlowAdam(delayed.parameters(), lr=1e-2, ratio=0.6, placement="last", chunk_bytes=4096,
                       max_grad_norm=1.0, delay_after=2, state_precision=precision).attach(delayed)  # fmt: skip
    losses = train(delayed, opt, 30)
    assert opt.coordinator.host.delayed.late_jobs > 0 and losses[-1] < losses[0]


def test_config_key_and_bad_values() -> None:
    base = {"train_micro_batch_size_per_gpu": 2, "offload_ratio": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
    for precision in COMPACT:
        config = twinflow.load_config(base | {"offload_state_precision": precision}, world_size=1)
        assert config.offload_state_precision == precision
    with pytest.raises(twinflow.ConfigError, match="offload_state_precision"):
        twinflow.load_config(base | {"offload_state_precision": "int4"}, world_size=1)
    with pytest.raises(ValueError, match=r"state_precision='bf16'; expected 'fp32' .*, 'int8' .* or 'int8_m24'"):
        TwinFlowAdam(make().parameters(), state_precision="bf16")
    model = make()
    engine, *_ = twinflow.initialize(model=model, config=base | {"offload_state_precision": "int8_m24"})
    assert engine.local_optimizer.state_precision == "int8_m24"
    assert engine.local_optimizer.split_summary["cpu"]["state_precision"] == "int8_m24"


@pytest.mark.cuda
@pytest.mark.parametrize("attach", [False, True])
def test_on_cuda_with_bf16_weights_it_trains_like_the_fp32_state(attach: bool) -> None:
    losses = {}
    for precision in ("fp32", *COMPACT):
        model = make().cuda().bfloat16()
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, placement="last", chunk_bytes=4096,
                           max_grad_norm=1.0, state_precision=precision)  # fmt: skip
        if attach:
            opt.attach(model)
        gen = torch.Generator().manual_seed(1)
        run = []
        for _ in range(100):
            x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
            loss = F.mse_loss(model(x.cuda().bfloat16()).float(), y.cuda())
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        opt.synchronize()
        losses[precision] = sum(run[-20:]) / 20
        assert opt.split_summary["cpu"]["state_precision"] == precision and opt.split_summary["cpu"]["elements"] > 0
    for precision in COMPACT:
        assert abs(losses[precision] - losses["fp32"]) / losses["fp32"] < 0.02, losses


@pytest.mark.parametrize("precision", COMPACT)
def test_masters_follow_weights_written_from_outside(precision: str) -> None:
    """model.load_state_dict between steps: the next step starts from the new weights (24-bit masters: rounded to
    the nearest of them), not from the masters' old values. Ratio 1: every element has a CPU master."""
    model = make()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=1.0, chunk_bytes=4096, state_precision=precision)
    train(model, opt, 3)
    new = make(seed=7).state_dict()
    model.load_state_dict(new)
    for group in opt.param_groups:
        group["lr"] = 0.0  # the step changes nothing but what the masters hold
    train(model, opt, 1)
    assert opt.split_summary["cpu"]["elements"] > 0
    for name, p in model.named_parameters():
        expected = new[name]
        if precision == "int8_m24":
            expected = compact.decode_master(*compact.encode_master(expected)).view(p.shape)
        assert torch.equal(p.detach(), expected), name
        assert not torch.equal(expected, make().state_dict()[name])  # not the old weights either


@pytest.mark.parametrize("attach", [False, True])
@pytest.mark.parametrize("precision", ["int8", "int8_m24"])
def test_state_precision_set_after_steps_converts_the_state_at_the_next_step(attach: bool, precision: str) -> None:
    """Set after two fp32 steps, a state precision takes full effect at the next step: the state is converted
    (as a state dict loaded into an optimizer made with that precision converts it: the same bits after), the
    split and the speculation policy say so, and it is never reported while the state is still the old one."""

    def run(switch: bool) -> tuple[list[float], list[torch.Tensor], TwinFlowAdam]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
        if attach:
            opt.attach(model)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for step in range(5):
            if step == 2:
                if switch:
                    opt.state_precision = precision
                    assert opt.split_summary["cpu"]["state_precision"] == "fp32"  # not converted before the step
                else:  # the reference: the same state loaded into an optimizer made in `precision`
                    state = opt.state_dict()
                    if attach:
                        opt.detach()
                    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, state_precision=precision)
                    opt.load_state_dict(state)
                    if attach:
                        opt.attach(model)
            loss = model(torch.randn(8, 64, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if attach:
            opt.synchronize()
        return losses, [p.detach().clone() for p in model.parameters()], opt

    switched, loaded = run(switch=True), run(switch=False)
    opt = switched[2]
    assert opt.state_precision == precision
    assert opt.split_summary["cpu"]["state_precision"] == opt.split_summary["device"]["state_precision"] == precision
    assert opt.coordinator.speculation.precision.name == precision
    assert switched[0] == loaded[0]
    for a, b in zip(switched[1], loaded[1]):
        assert torch.equal(a, b)
