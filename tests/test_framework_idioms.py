"""What frameworks do to an optimizer's state, done to TwinFlowAdam as to torch's AdamW.

Lightning moves an optimizer between devices by iterating each state entry and assigning every key back
(``_optimizer_to_device``); accelerate's ``AcceleratedOptimizer`` moves the state dict and loads it back; users
copy entries, update them, iterate ``opt.state`` while moving entries. Each idiom runs between two steps of a
training loop; the run goes on exactly as without it (the values assigned are the state's own), and AdamW under
the same idiom trains alike.
"""

import copy

import pytest
import torch

from twinflow import TwinFlowAdam

STEPS, IDIOM_AFTER = 5, 2


def _lightning_to_device(opt: torch.optim.Optimizer, device: str) -> None:
    """lightning.fabric.utilities.optimizer._optimizer_to_device, as Lightning 2.x writes it."""
    for p, v in opt.state.items():
        if not isinstance(v, dict):
            opt.state[p] = v
            continue
        for key, val in v.items():
            if key != "step":
                v[key] = val.to(device) if isinstance(val, torch.Tensor) else val


def _entry_loop(opt: torch.optim.Optimizer, device: str) -> None:
    """The issue's loop: every parameter's entry iterated, each key re-assigned while iterating."""
    for group in opt.param_groups:
        for p in group["params"]:
            for key, val in opt.state[p].items():
                if key != "step":
                    opt.state[p][key] = val.to(device)


def _update(opt: torch.optim.Optimizer, device: str) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p].update({k: v.clone() for k, v in opt.state[p].items() if k != "step"})


def _moved_entries(opt: torch.optim.Optimizer, device: str) -> None:
    """opt.state iterated while each entry is replaced by a moved copy of itself."""
    for p, entry in opt.state.items():
        opt.state[p] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


def _accelerate(opt: torch.optim.Optimizer, device: str) -> torch.optim.Optimizer:
    """accelerate's AcceleratedOptimizer with device placement: the state dict moved to the device and loaded."""
    from accelerate import Accelerator

    return Accelerator(cpu=True).prepare_optimizer(opt)


IDIOMS = {"lightning_to_device": _lightning_to_device, "entry_loop": _entry_loop, "update": _update,
          "moved_entries": _moved_entries, "accelerate": _accelerate}  # fmt: skip


def _run(make_opt, idiom=None) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4))
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if idiom is not None and step == IDIOM_AFTER:
            opt = IDIOMS[idiom](opt, "cpu") or opt
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("idiom", list(IDIOMS))
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_a_frameworks_idiom_changes_nothing(idiom: str, ratio: float, precision: str) -> None:
    def twinflow(params):
        return TwinFlowAdam(params, lr=1e-2, weight_decay=0.0, ratio=ratio, state_precision=precision)

    untouched = _run(twinflow)
    touched = _run(twinflow, idiom)
    assert touched[0] == untouched[0]
    for a, b in zip(touched[1], untouched[1]):
        assert torch.equal(a, b)
    if precision == "fp32":  # and as AdamW does under the same idiom
        adamw = _run(lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0), idiom)
        assert touched[0] == pytest.approx(adamw[0], rel=1e-5)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_a_deep_copy_of_an_entry_is_a_plain_dict_apart_from_the_optimizer(ratio: float) -> None:
    model = torch.nn.Linear(8, 3)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    p = model.weight
    copied = copy.deepcopy(opt.state[p])
    assert type(copied) is dict and set(copied) == set(opt.state[p])
    for key, value in copied.items():
        assert torch.equal(value, opt.state[p][key])
    copied["exp_avg"].fill_(7.0)  # the copy is its own: the optimizer's state does not change
    assert not torch.equal(opt.state[p]["exp_avg"], copied["exp_avg"])


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_moving_the_state_while_it_is_offloaded_keeps_it_out_and_a_change_is_refused(ratio: float) -> None:
    """A framework's teardown moves the state after a loop that ended with offload_states(): the values written
    back are the state's own, so nothing changes and it stays out; a different value still waits for reload."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[model.weight].items() if isinstance(v, torch.Tensor)}
    opt.offload_states()
    _lightning_to_device(opt, "cpu")
    with pytest.raises(RuntimeError, match=r"offloaded \(offload_states\(\)\); call reload_states\(\) first"):
        opt.state[model.weight]["exp_avg"] = before["exp_avg"] + 1.0
    opt.reload_states()
    after = opt.state[model.weight]
    for key, value in before.items():
        assert torch.equal(after[key], value), key
