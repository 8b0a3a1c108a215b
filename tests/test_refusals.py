"""Inputs TwinFlowAdam cannot step are refused with errors that name the parameter and say what to do."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from twinflow import TwinFlowAdam


def test_a_float64_model_is_refused_by_name_with_the_fix() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()
    with pytest.raises(TypeError, match=r"parameter 0 '0\.weight' \(shape \(4, 4\).*float64.*model\.float\(\)"):
        TwinFlowAdam(model.named_parameters(), ratio=0.4)
    with pytest.raises(TypeError, match=r"parameter 0 \(shape \(4, 4\).*float64.*named_parameters\(\)"):
        TwinFlowAdam(model.parameters(), ratio=0.4)


def sparse_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_a_sparse_module_is_refused_at_attach_by_name(ratio: float) -> None:
    model = sparse_model()
    opt = TwinFlowAdam(model.parameters(), ratio=ratio, chunk_bytes=256)
    with pytest.raises(TypeError, match=r"module '0' \(sparse=True\) has a sparse gradient.*sparse=False"):
        opt.attach(model)
    assert not opt.attached
    model[0].sparse = False  # the fix the message gives: the same optimizer attaches and trains
    before = model[0].weight.detach().clone()
    opt.attach(model)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    opt.synchronize()
    assert not torch.equal(before, model[0].weight.detach())


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_sparse_gradient_is_refused_by_name(ratio: float) -> None:
    """Plain step(): refused before anything steps; attached (a module turned sparse after attach()): in backward,
    by the parameter's name, never a raw error from inside the hook."""
    model = sparse_model()
    opt = TwinFlowAdam(model.parameters(), ratio=ratio, chunk_bytes=256)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([1, 2, 3])).sum().backward()
    with pytest.raises(TypeError, match=r"parameter 0 has a sparse gradient.*sparse=False"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model[0].sparse = False
    opt.zero_grad()
    opt.attach(model, eager=False)
    model[0].sparse = True
    if ratio == 0.0:  # nothing streams: no hook runs in backward, and step() refuses as without attach()
        model(torch.tensor([1, 2, 3])).sum().backward()
        with pytest.raises(TypeError, match=r"parameter 0 has a sparse gradient.*sparse=False"):
            opt.step()
        return
    with pytest.raises(TypeError, match=r"parameter 0 \('0\.weight'\) has a sparse gradient.*zero_grad\(\)"):
        model(torch.tensor([1, 2, 3])).sum().backward()


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def one_step(model: torch.nn.Module, opt: TwinFlowAdam) -> None:
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.synchronize()


@pytest.mark.parametrize(
    ("kwargs", "attach", "reason"),
    [
        ({}, True, "max_grad_norm is not set"),
        ({"max_grad_norm": 1.0}, False, "not attached"),
        ({"max_grad_norm": 1.0, "state_precision": "int8"}, True, "state_precision='int8'"),
        ({"max_grad_norm": 1.0, "delay_after": 2}, True, "delay_after=2: only the first 2 steps"),
    ],
)
def test_speculate_that_can_do_nothing_says_why_once(kwargs: dict, attach: bool, reason: str) -> None:
    model = small_model()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=256, speculate=True, **kwargs)
    with pytest.warns(UserWarning, match=f"speculate=True has no effect here: .*{reason}"):
        if attach:
            opt.attach(model)
        one_step(model, opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        one_step(model, opt)
    assert not [w for w in seen if "speculate" in str(w.message)]


def test_speculate_where_it_acts_is_silent() -> None:
    model = small_model()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=256, speculate=True, max_grad_norm=1.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.attach(model)
        one_step(model, opt)
    assert not [w for w in seen if "speculate" in str(w.message)]


def test_ratio_auto_says_what_it_chose_and_why_in_one_readable_line(caplog: pytest.LogCaptureFixture) -> None:
    model = small_model()
    opt = TwinFlowAdam(model.parameters(), ratio="auto", chunk_bytes=256)
    with caplog.at_level("INFO", logger="twinflow.notice"):
        one_step(model, opt)
    lines = [r.getMessage() for r in caplog.records if r.name == "twinflow.notice" and "ratio='auto'" in r.message]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert f"chose {opt.ratio:.2f}" in lines[0] and "because" in lines[0]
    numbers = [float(n) for n in re.findall(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?", lines[0])]
    assert max(numbers) < 1e6, lines[0]  # GiB and Gparam/s, never a raw sentinel budget


def test_a_used_up_parameter_generator_is_named_as_such() -> None:
    model = torch.nn.Linear(4, 2)
    params = model.parameters()
    torch.optim.AdamW(params)  # reads the generator to its end
    with pytest.raises(ValueError, match="already used up: model.parameters\\(\\) is a generator, read once"):
        TwinFlowAdam(params)
    TwinFlowAdam(model.parameters())  # a fresh generator: fine


def test_a_parameter_in_two_groups_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    named = dict(model.named_parameters())
    groups = [{"params": [named["0.weight"], named["0.bias"]], "param_names": ["0.weight", "0.bias"]},
              {"params": [named["1.weight"], named["0.bias"]], "param_names": ["1.weight", "0.bias"]}]  # fmt: skip
    with pytest.raises(ValueError, match=r"parameter '0.bias' \(shape \(3,\), position 1 of param group 1\) is in "
                                         r"param group 0 already"):  # fmt: skip
        TwinFlowAdam(groups)
    opt = TwinFlowAdam([named["0.weight"]])
    with pytest.raises(ValueError, match=r"parameter \(shape \(3, 4\), position 0 of param group 1\) is in param "
                                         r"group 0 already"):  # fmt: skip
        opt.add_param_group({"params": (p for p in [named["0.weight"]])})  # a generator: read once, still named
