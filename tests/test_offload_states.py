"""TwinFlowAdam.offload_states() / reload_states(): the device share's state, the gradients and the weights leave
for one reused host buffer and come back into the same tensors; training resumes bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam


def make(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 300), torch.nn.GELU(), torch.nn.Linear(300, 5)).to(torch.bfloat16)


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 33, generator=gen)
    return x.to(torch.bfloat16), x[:, :5] * 0.5


def bits(model: torch.nn.Module, opt: TwinFlowAdam) -> list[torch.Tensor]:
    out = [p.detach().view(torch.int16).clone() for p in model.parameters()]
    for entry in opt.state_dict()["state"].values():
        out += [entry[k].view(torch.int32).clone() for k in ("exp_avg", "exp_avg_sq", "master")]
    return out


def run(ratio: float, precision: str, attached: bool, cycle: bool, weights: bool, delay: bool = False):  # noqa: ANN201
    model = make()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio, state_precision=precision, max_grad_norm=1.0,
                       delay_after=0 if delay else None)  # fmt: skip
    if attached:
        opt.attach(model)
    gen, moved = torch.Generator().manual_seed(1), []
    for k in range(5):
        x, y = batch(gen)
        F.mse_loss(model(x).float(), y).backward()
        if cycle and not attached and k == 2:  # gradients present: they move too
            moved.append(opt.offload_states(weights=weights))
            opt.reload_states()
        opt.step()
        opt.zero_grad()
        if cycle and k in (1, 3):
            moved.append(opt.offload_states(weights=weights))
            assert opt.offload.offloaded == (moved[-1] > 0)
            opt.reload_states()
        elif k in (1, 3):
            opt.synchronize()  # what an offload does first: a pending delayed update lands
    opt.synchronize()
    return model, opt, moved


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("attached", [False, True])
def test_training_resumes_bit_for_bit_across_cycles(precision: str, ratio: float, attached: bool) -> None:
    straight_model, straight_opt, _ = run(ratio, precision, attached, cycle=False, weights=False)
    for weights in (False, True):
        model, opt, moved = run(ratio, precision, attached, cycle=True, weights=weights)
        assert all(a.equal(b) for a, b in zip(bits(straight_model, straight_opt), bits(model, opt), strict=True))
        if ratio < 1.0 or weights:
            assert min(moved) > 0
        assert opt.offload.allocations == (max(moved) > 0)  # one buffer, reused by every cycle


def test_a_pending_delayed_update_lands_before_the_offload() -> None:
    """The cycle equals synchronize() at the same points (the delayed update applied then), bit for bit."""
    straight_model, straight_opt, _ = run(0.5, "fp32", True, cycle=False, weights=False, delay=True)
    model, opt, _ = run(0.5, "fp32", True, cycle=True, weights=False, delay=True)
    assert all(a.equal(b) for a, b in zip(bits(straight_model, straight_opt), bits(model, opt), strict=True))


def test_the_memory_is_freed_and_given_back_into_the_same_tensors() -> None:
    model = make()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, state_precision="int8_m24")
    gen = torch.Generator().manual_seed(1)
    x, y = batch(gen)
    F.mse_loss(model(x).float(), y).backward()
    opt.step()
    F.mse_loss(model(x).float(), y).backward()  # gradients present
    owned = opt.coordinator.split.device_state.tensors()
    before = [t.clone() for t in owned]
    grads = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads]
    weight_values = [p.detach().clone() for p in model.parameters()]
    expected = sum(t.untyped_storage().nbytes() for t in owned + grads + list(model.parameters()))
    assert opt.offload_states(weights=True) == expected
    assert all(t.untyped_storage().nbytes() == 0 for t in owned + grads + list(model.parameters()))
    assert opt.offload_states() == 0  # a second offload moves nothing
    with pytest.raises(RuntimeError, match=r"step\(\) while the optimizer's device state is offloaded.*reload_states"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"state_dict\(\) while .*reload_states\(\) first"):
        opt.state_dict()
    assert opt.reload_states() == expected
    assert opt.reload_states() == 0  # nothing out: nothing to do
    assert all(a.equal(b) for a, b in zip(owned, before))
    assert all(p.grad is g and g.equal(v) for p, g, v in zip(model.parameters(), grads, grad_values))
    assert all(p.detach().equal(v) for p, v in zip(model.parameters(), weight_values))


def test_a_bad_include_is_named() -> None:
    opt = TwinFlowAdam(make().parameters(), ratio=0.5)
    with pytest.raises(ValueError, match=r"'weights' is not one of \('optimizer', 'grads'\)"):
        opt.offload_states(include=("optimizer", "weights"))
    assert not opt.offload.offloaded


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_on_the_gpu_the_memory_goes_back_to_the_driver_and_training_resumes_bit_for_bit(precision: str) -> None:
    def go(cycle: bool) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4))).cuda().to(torch.bfloat16)
        opt = TwinFlowAdam(model.parameters(), lr=1e-3, ratio=0.5, state_precision=precision, max_grad_norm=1.0)
        opt.attach(model)
        gen, freed = torch.Generator(device="cuda").manual_seed(1), []
        for k in range(4):
            x = torch.randn(16, 2048, device="cuda", generator=gen, dtype=torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            if k in (1, 2):
                if cycle:
                    torch.cuda.synchronize()
                    free_before = torch.cuda.mem_get_info()[0]
                    moved = opt.offload_states(weights=True)
                    free_after = torch.cuda.mem_get_info()[0]
                    freed.append((moved, free_after - free_before, opt.offload.allocations))
                    opt.reload_states()
                else:
                    opt.synchronize()
        opt.synchronize()
        return bits(model, opt), freed

    straight, _ = go(False)
    cycled, freed = go(True)
    assert all(a.equal(b) for a, b in zip(straight, cycled, strict=True))
    for moved, given_back, allocations in freed:
        assert moved > 0 and given_back >= 0.95 * moved, freed  # back to the driver: another process may use it
        assert allocations == 1
