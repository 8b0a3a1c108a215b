"""CPUAdam as a torch.optim.Optimizer: groups, schedulers, state dicts, bad input."""

import io

import pytest
import torch

from twinflow import CPUAdam


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 5))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, sched=None, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 13, generator=gen)
        y = torch.randn(8, 5, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def assert_models_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def two_groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": list(model[0].parameters()), "lr": 2e-3, "weight_decay": 0.1},
        {"params": list(model[2].parameters()), "lr": 5e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_groups_and_scheduler_match_torch(adamw_mode: bool) -> None:
    ours, ref = make_model(), make_model()
    opt = CPUAdam(two_groups(ours), adamw_mode=adamw_mode)
    ref_opt = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(two_groups(ref))
    lam = lambda step: 1.0 / (1 + step)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lam)
    assert train(ours, opt, 25, sched) == pytest.approx(train(ref, ref_opt, 25, ref_sched), rel=1e-5)
    assert_models_close(ours, ref)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]


def test_state_dict_moves_between_cpu_adam_and_adamw() -> None:
    """CPUAdam -> AdamW -> CPUAdam in mid-run, through weights_only loading, equals AdamW throughout."""
    ours, ref = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    opt = CPUAdam(ours.parameters(), lr=3e-3, weight_decay=0.01)
    train(ours, opt, 10, seed=1)
    train(ref, ref_opt, 10, seed=1)

    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert set(loaded["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    as_adamw = torch.optim.AdamW(ours.parameters(), lr=3e-3, weight_decay=0.01)
    as_adamw.load_state_dict(loaded)
    train(ours, as_adamw, 5, seed=2)
    train(ref, ref_opt, 5, seed=2)

    back = CPUAdam(ours.parameters(), lr=1.0)  # the loaded groups replace these hyper-parameters
    back.load_state_dict(as_adamw.state_dict())
    assert back.param_groups[0]["lr"] == 3e-3 and back.param_groups[0]["adamw_mode"] is True
    train(ours, back, 5, seed=3)
    train(ref, ref_opt, 5, seed=3)
    assert_models_close(ours, ref)
    assert back.state[next(ours.parameters())]["step"].item() == 20


def test_zero_grad_and_params_without_grad() -> None:
    model = make_model()
    frozen = model[0].bias
    frozen.requires_grad_(False)
    before = frozen.clone()
    opt = CPUAdam(model.parameters())
    train(model, opt, 3)
    assert torch.equal(frozen, before) and frozen not in opt.state
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_closure_is_called_and_loss_returned() -> None:
    model = make_model()
    opt = CPUAdam(model.parameters())
    x = torch.randn(4, 13)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert opt.state[model[0].weight]["step"].item() == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"eps": -1e-8}, "Invalid epsilon"),
        ({"betas": (1.0, 0.999)}, "index 0"),
        ({"betas": (0.9, -0.5)}, "index 1"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"num_threads": 0}, "num_threads"),
    ],
)
def test_bad_hyperparameters(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CPUAdam(make_model().parameters(), **kwargs)


def test_bad_parameter_modifies_nothing() -> None:
    """A float64 parameter in the group: TypeError, and no weight, moment or step count changes."""
    good = torch.nn.Parameter(torch.randn(50))
    bad = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = CPUAdam([good, bad], lr=1e-2)
    good.grad = torch.randn(50)
    bad.grad = None
    opt.step()  # good now has state
    state_before = {k: v.clone() for k, v in opt.state[good].items()}
    weights_before = good.detach().clone()
    good.grad, bad.grad = torch.randn(50), torch.randn(5, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"params\[1\] has dtype Double"):
        opt.step()
    assert torch.equal(good, weights_before)
    assert all(torch.equal(opt.state[good][k], v) for k, v in state_before.items())
    assert bad not in opt.state


def test_sparse_gradients_are_refused() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = CPUAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
