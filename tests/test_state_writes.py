"""``opt.state`` keeps what is written into it, and ``param_groups`` carry AdamW's keys, as torch.optim's do.

The hook tests and the deterministic state-dict test are adapted from PyTorch's
own (test/test_optim.py: ``test_state_dict_pre_hook``,
``test_load_state_dict_post_hook``, ``test_load_state_dict_pre_post_hook``,
``test_state_dict_deterministic``). The write tests do the same write into
TwinFlowAdam's and into torch.optim.AdamW's state between steps on identical
models fed the same gradients, and compare the weights afterwards: a write
that does not reach the optimizer leaves the weights far apart. They run at
ratio 0 (all on the device side), 0.37 (a tensor cut in two: its entry is a
copy), 0.4 and 1 (all on the CPU), plain and under ``attach()``; 8-bit state
is compared with a run given the same values through ``load_state_dict``.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

from tests.test_torch_optim_conformance import (
    assert_weights_close,
    batches,
    loss_of,
    make_model,
    save_load,
    tf,
    twin,
)
from twinflow import TwinFlowAdam
from twinflow.precision import compact

RATIOS = [pytest.param(0.0, id="r0"), pytest.param(0.37, id="r0.37"), pytest.param(0.4, id="r0.4"),
          pytest.param(1.0, id="r1")]  # fmt: skip
ADAMW_GROUP_KEYS = set(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).param_groups[0])


def run(model, opt, data, write=None, attached: bool = False) -> None:
    """Trains on `data`; `write(opt, model, k)` runs after step k (between steps, as a user's code would)."""
    for k, (x, y, scale) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss_of(model, x, y, scale).backward()
        opt.step()
        if isinstance(opt, TwinFlowAdam) and attached:
            opt.synchronize()
        if write is not None:
            write(opt, model, k)
    if isinstance(opt, TwinFlowAdam):
        opt.synchronize()


def pair(ratio: float, attached: bool = False, **kwargs):
    ours = make_model()
    ref = twin(ours)
    opt = tf(ours.parameters(), ratio, "first", **kwargs)
    if attached:
        opt.attach(ours)
    return ours, opt, ref, torch.optim.AdamW(ref.parameters(), weight_decay=0.01)


# ------------------------------------------------------------------ torch's hook tests
def _state_dict_pre_hook(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state["test"] = 1


def _state_dict_post_hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    if "test" in state_dict["state"]:
        state_dict["state"].pop("test")
        state_dict["ran_state_dict_pre_hook"] = True
    else:
        state_dict["ran_state_dict_pre_hook"] = False
    return state_dict


def _load_state_dict_pre_hook1(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_state_dict_pre_hook2(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    my_state_dict = copy.deepcopy(state_dict)  # a hook that returns a new state dict: that one is used
    my_state_dict["param_groups"][0]["lr"] = 0.003
    return my_state_dict


def _load_state_dict_post_hook(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("cls", ["twinflow", "adamw"])
def test_state_dict_pre_hook(ratio: float, cls: str) -> None:
    model = make_model()
    opt = tf(model.parameters(), ratio, "first") if cls == "twinflow" else torch.optim.AdamW(model.parameters())
    run(model, opt, batches(2))
    opt.register_state_dict_pre_hook(_state_dict_pre_hook)
    opt.register_state_dict_post_hook(_state_dict_post_hook)
    state_dict = opt.state_dict()
    assert state_dict["ran_state_dict_pre_hook"] is True
    assert opt.state["test"] == 1  # and it stays


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("cls", ["twinflow", "adamw"])
def test_load_state_dict_post_hook(ratio: float, cls: str) -> None:
    model = make_model()
    opt = tf(model.parameters(), ratio, "first") if cls == "twinflow" else torch.optim.AdamW(model.parameters())
    run(model, opt, batches(2))
    opt.register_load_state_dict_post_hook(_load_state_dict_post_hook)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"] is False
    assert opt.state["ran_load_state_dict_post_hook"] is True


@pytest.mark.parametrize("ratio", RATIOS)
def test_load_state_dict_pre_post_hook(ratio: float) -> None:
    model = make_model()
    opt = tf(model.parameters(), ratio, "first")
    run(model, opt, batches(2))
    opt.register_load_state_dict_pre_hook(_load_state_dict_pre_hook1)
    opt.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2)
    opt.register_load_state_dict_post_hook(_load_state_dict_post_hook)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"] is True
    assert opt.state["ran_load_state_dict_post_hook"] is True
    assert opt.param_groups[0]["lr"] == 0.003


@pytest.mark.parametrize("ratio", RATIOS)
def test_state_dict_deterministic(ratio: float) -> None:
    """Equal (not identical) parameters, one optimizer loaded from the other: equal steps, equal state dicts;
    repeated parameters have an identical representation."""
    model = make_model()
    opt = tf(model.parameters(), ratio, "first")
    data = batches(6)
    run(model, opt, data[:3])
    clone = twin(model)
    opt_c = tf(clone.parameters(), ratio, "first")
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for k in range(3, 6):
        run(model, opt, data[k : k + 1])
        run(clone, opt_c, data[k : k + 1])
        assert_weights_close(clone, model, rtol=0, atol=0)
    torch.testing.assert_close(opt.state_dict(), opt_c.state_dict(), rtol=0, atol=0)
    opt_c.param_groups.extend(opt_c.param_groups)
    assert opt.state_dict()["param_groups"][-1] == opt_c.state_dict()["param_groups"][-1]


@pytest.mark.parametrize("ratio", RATIOS)
def test_state_dict_saved_loaded_and_saved_again_is_the_same(ratio: float) -> None:
    model = make_model()
    opt = tf(model.parameters(), ratio, "first")
    run(model, opt, batches(2))
    first = opt.state_dict()
    opt.load_state_dict(save_load(first))
    again = opt.state_dict()
    assert again["param_groups"] == first["param_groups"]
    torch.testing.assert_close(again["state"], first["state"], rtol=0, atol=0)


# ------------------------------------------------------------------ AdamW's group keys
def test_param_groups_carry_adamw_keys_at_adamw_values() -> None:
    model = make_model()
    opt = tf(model.parameters(), 0.4, "first")
    ref = torch.optim.AdamW(twin(model).parameters())
    group, ref_group = opt.param_groups[0], ref.param_groups[0]
    assert ADAMW_GROUP_KEYS <= set(group), sorted(ADAMW_GROUP_KEYS - set(group))
    for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"):
        assert group[key] == ref_group[key], key
    adam = tf(model.parameters(), 0.4, "first", adamw_mode=False)
    assert adam.param_groups[0]["decoupled_weight_decay"] is False


def test_adamw_state_dict_loads_and_keeps_our_weight_decay_mode() -> None:
    model = make_model()
    ref = torch.optim.Adam(twin(model).parameters())  # decoupled_weight_decay=False in its groups
    opt = tf(model.parameters(), 0.4, "first")
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["adamw_mode"] is True and opt.param_groups[0]["decoupled_weight_decay"] is True
    run(model, opt, batches(1))


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("amsgrad", True, "param group 0: amsgrad=True"),
        ("fused", True, "param group 0: fused=True"),
        ("decoupled_weight_decay", False, "decoupled_weight_decay=False but adamw_mode=True"),
    ],
)
def test_group_flags_twinflow_cannot_honour_are_refused_at_the_step(key: str, value: bool, match: str) -> None:
    model = make_model()
    opt = tf(model.parameters(), 0.4, "first")
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][key] = value
    loss_of(model, *batches(1)[0]).backward()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "stepped before refusing"


# ------------------------------------------------------------------ user writes into opt.state
def zero_exp_avg(opt, model, k: int) -> None:
    if k == 1:
        for p in list(model.parameters())[1:4]:  # ratio 0.37 cuts the second Linear's weight (index 2)
            opt.state[p]["exp_avg"].zero_()


def assign_moments(opt, model, k: int) -> None:
    if k == 1:
        for j, p in enumerate(model.parameters()):
            gen = torch.Generator().manual_seed(j)
            opt.state[p]["exp_avg"] = torch.randn(p.shape, generator=gen) * 1e-3
            opt.state[p]["exp_avg_sq"] = torch.rand(p.shape, generator=gen) * 1e-5


def rewind_steps(opt, model, k: int) -> None:
    if k == 2:
        for p in model.parameters():
            opt.state[p]["step"] = torch.tensor(1.0)  # bias correction as if early: large steps
        p = list(model.parameters())[2]
        opt.state[p]["step"].fill_(7)  # in place, into the tensor the entry holds


def reset_one(opt, model, k: int) -> None:
    if k == 1:
        del opt.state[list(model.parameters())[2]]


WRITES = {"zero_in_place": zero_exp_avg, "assign": assign_moments, "step": rewind_steps, "reset": reset_one}


@pytest.mark.parametrize("attached", [False, True], ids=["plain", "attached"])
@pytest.mark.parametrize("how", sorted(WRITES))
@pytest.mark.parametrize("ratio", RATIOS)
def test_writes_into_state_reach_the_optimizer_as_in_adamw(ratio: float, how: str, attached: bool) -> None:
    ours, opt, ref, ref_opt = pair(ratio, attached)
    data = batches(5)
    run(ours, opt, data, WRITES[how], attached)
    run(ref, ref_opt, data, WRITES[how])
    assert_weights_close(ours, ref, msg=how)
    # the write made a real difference: without it the weights end elsewhere
    plain, plain_opt, *_ = pair(ratio)
    run(plain, plain_opt, data)
    assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(plain.parameters(), ours.parameters()))


@pytest.mark.parametrize("ratio", RATIOS)
def test_writes_survive_state_dict_load_deepcopy_and_pickle(ratio: float) -> None:
    ours, opt, ref, ref_opt = pair(ratio)
    data = batches(5)
    run(ours, opt, data[:2], assign_moments)
    run(ref, ref_opt, data[:2], assign_moments)
    p = next(iter(ours.parameters()))
    opt.state[p]["note"] = 7  # (torch's load casts a string into a generator's repr: AdamW's too)
    opt.state["global"] = {"epoch": 3}
    resumed = twin(ours)
    loaded = tf(resumed.parameters(), ratio, "first")
    loaded.load_state_dict(save_load(opt.state_dict()))
    first = next(iter(resumed.parameters()))
    assert loaded.state[first]["note"] == 7 and loaded.state["global"] == {"epoch": 3}
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        params = [q for g in other.param_groups for q in g["params"]]
        assert other.state[params[0]]["note"] == 7 and other.state["global"] == {"epoch": 3}
    run(resumed, loaded, data[2:])
    run(ref, ref_opt, data[2:])
    assert_weights_close(resumed, ref)
    assert opt.state[p]["note"] == 7  # still there after reads, steps and saves


def test_extra_keys_persist_across_steps_and_reads() -> None:
    model = make_model()
    opt = tf(model.parameters(), 0.37, "first")
    run(model, opt, batches(1))
    p = list(model.parameters())[2]  # cut in two: its entry's tensors are copies
    entry = opt.state[p]
    entry["ema"] = torch.ones(3)
    run(model, opt, batches(2, seed=5))
    assert opt.state[p] is entry and torch.equal(opt.state[p]["ema"], torch.ones(3))
    assert float(opt.state[p]["step"]) == 3.0
    assert "ema" in opt.state_dict()["state"][2]


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_whole_parameter_entries_are_views_of_the_buffers(ratio: float) -> None:
    model = make_model()
    opt = tf(model.parameters(), ratio, "first")
    run(model, opt, batches(2))
    p = next(iter(model.parameters()))
    held = opt.state[p]["exp_avg"]
    run(model, opt, batches(1, seed=9))
    assert torch.equal(held, opt.state_dict()["state"][0]["exp_avg"]), "the entry did not follow the step"


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("exp_avg", torch.zeros(3, 3), r"parameter 0 \(shape \(16, 8\), float32\).*shape \(3, 3\).*\(16, 8\)"),
        ("exp_avg_sq", torch.zeros(16, 8, dtype=torch.int32), r"'exp_avg_sq'.*int32.*floating-point"),
        ("exp_avg", [0.0], r"'exp_avg'.*list; expected a tensor"),
        ("step", -2, r"'step'.*-2.*whole number >= 0"),
        ("step", 1.5, r"'step'.*1.5.*whole number"),
        ("master", torch.zeros(16, 8), r"float32 parameter is its own master"),
    ],
)
def test_a_write_that_cannot_be_honoured_names_parameter_key_and_expectation(key, value, match) -> None:
    model = make_model()
    opt = tf(model.parameters(), 0.4, "first")
    run(model, opt, batches(1))
    p = next(iter(model.parameters()))
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    with pytest.raises((ValueError, TypeError, KeyError), match=match):
        opt.state[p][key] = value
    torch.testing.assert_close(opt.state_dict()["state"][0], before, rtol=0, atol=0)


def test_deleting_one_owned_key_is_refused_with_the_fix() -> None:
    model = make_model()
    opt = tf(model.parameters(), 0.4, "first")
    run(model, opt, batches(1))
    p = next(iter(model.parameters()))
    with pytest.raises(KeyError, match=r"del opt.state\[p\]"):
        del opt.state[p]["exp_avg"]


@pytest.mark.parametrize("precision", ["int8", "int8_m24"])
@pytest.mark.parametrize("ratio", [0.37, 1.0])
def test_compact_state_writes_match_a_load_of_the_same_values(precision: str, ratio: float) -> None:
    """8-bit moments and 24-bit masters are copies: an in-place write to a moment reaches the codes exactly as
    loading the written values through load_state_dict does, and one to a master reaches the master as
    assigning it does (the weight takes it at the next step, as after an in-place write to a float32 master)."""
    data = batches(5)
    a = make_model(dtype=torch.bfloat16)
    b = twin(a)
    opt_a = tf(a.parameters(), ratio, "first", state_precision=precision)
    opt_b = tf(b.parameters(), ratio, "first", state_precision=precision)
    run(a, opt_a, data[:2])
    run(b, opt_b, data[:2])
    for p in a.parameters():
        opt_a.state[p]["exp_avg"].mul_(0.5)
    sd = opt_b.state_dict()
    for entry in sd["state"].values():
        entry["exp_avg"] = entry["exp_avg"] * 0.5
    opt_b.load_state_dict(sd)
    run(a, opt_a, data[2:])
    run(b, opt_b, data[2:])
    assert_weights_close(a, b, rtol=0, atol=0)
    untouched = make_model(dtype=torch.bfloat16)
    opt_u = tf(untouched.parameters(), ratio, "first", state_precision=precision)
    run(untouched, opt_u, data)
    assert any(not torch.equal(x, y) for x, y in zip(untouched.parameters(), a.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        opt_a.state[p]["master"].add_(1e-3)
        opt_b.state[q]["master"] = opt_b.state[q]["master"] + 1e-3
    masters_a = [e["master"] for e in opt_a.state_dict()["state"].values()]
    masters_b = [e["master"] for e in opt_b.state_dict()["state"].values()]
    torch.testing.assert_close(masters_a, masters_b, rtol=0, atol=0)


def test_entries_read_before_ratio_auto_builds_its_state_are_kept() -> None:
    model = make_model()
    opt = TwinFlowAdam(model.parameters(), ratio="auto", chunk_bytes=256)
    p = next(iter(model.parameters()))
    opt.state[p]["note"] = 5  # before the first step: no state yet, the key is still kept
    assert len(opt.state[p]) == 1
    run(model, opt, batches(2))
    assert opt.state[p]["note"] == 5 and float(opt.state[p]["step"]) == 2.0
    fresh = make_model()
    q = next(iter(fresh.parameters()))
    with pytest.raises(RuntimeError, match="no state yet"):
        TwinFlowAdam(fresh.parameters(), ratio="auto").state[q]["exp_avg"] = torch.zeros_like(q)


def cut_param(model: torch.nn.Module) -> torch.Tensor:
    return list(model.parameters())[2]  # ratio 0.37 cuts it in two: its entry's tensors are copies


def test_a_copy_kept_across_a_step_is_stale_and_its_writes_are_dropped() -> None:
    """A copy held across a step no longer is the state; writing into it must not put its old values back."""
    data = batches(4)
    ours, opt, *_ = pair(0.37)
    plain, plain_opt, *_ = pair(0.37)
    run(ours, opt, data[:2])
    run(plain, plain_opt, data[:2])
    held = opt.state[cut_param(ours)]["exp_avg"]
    run(ours, opt, data[2:3])
    run(plain, plain_opt, data[2:3])
    held.mul_(0.5)
    assert not torch.equal(opt.state[cut_param(ours)]["exp_avg"], held)  # the entry is the new state
    run(ours, opt, data[3:])
    run(plain, plain_opt, data[3:])
    assert_weights_close(ours, plain, rtol=0, atol=0)


def test_an_in_place_write_then_an_assignment_keeps_the_assignment() -> None:
    ours, opt, ref, ref_opt = pair(0.37)
    run(ours, opt, batches(2))
    run(ref, ref_opt, batches(2))
    for o, m in ((opt, ours), (ref_opt, ref)):
        p = cut_param(m)
        o.state[p]["exp_avg_sq"].mul_(4)
        o.state[p]["exp_avg_sq"] = torch.full_like(p, 1e-6)
        o.state[p]["exp_avg"].mul_(2)
        del o.state[p]
    run(ours, opt, batches(2, seed=7))
    run(ref, ref_opt, batches(2, seed=7))
    assert_weights_close(ours, ref)


@pytest.mark.parametrize("ratio", RATIOS)
def test_state_moved_with_pop_and_put_back_is_kept(ratio: float) -> None:
    ours, opt, ref, ref_opt = pair(ratio)
    run(ours, opt, batches(2))
    run(ref, ref_opt, batches(2))
    for o, m in ((opt, ours), (ref_opt, ref)):
        params = list(m.parameters())
        o.state[params[0]] = o.state.pop(params[0])
        o.state[params[2]] = o.state[params[2]]
    run(ours, opt, batches(2, seed=7))
    run(ref, ref_opt, batches(2, seed=7))
    assert_weights_close(ours, ref)


@pytest.mark.parametrize("eager", [False, True], ids=["after-backward", "eager"])
def test_a_write_into_a_copy_during_an_attached_step_is_refused_and_dropped(eager: bool) -> None:
    data = batches(3)
    ours, opt, *_ = pair(0.37)
    opt.detach()
    opt.attach(ours, eager=eager)
    plain, plain_opt, *_ = pair(0.37)
    run(ours, opt, data[:1], attached=True)
    run(plain, plain_opt, data[:1])
    held = opt.state[cut_param(ours)]["exp_avg"]
    x, y, scale = data[1]
    opt.zero_grad(set_to_none=True)
    loss_of(ours, x, y, scale).backward()
    held.zero_()  # backward has streamed gradients: the CPU share may be stepping this state
    with pytest.raises(RuntimeError, match=r"\['exp_avg'\] of parameter 2 was written in place while a step"):
        opt.step()
    opt.step()  # the write was dropped: the step completes as if it had not been made
    opt.synchronize()
    run(plain, plain_opt, data[1:2])
    run(ours, opt, data[2:], attached=True)
    run(plain, plain_opt, data[2:])
    assert_weights_close(ours, plain, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_loop_of_writes_takes_each_entry_once(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from twinflow.step.split_state import SplitState

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(25)]).to(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=256, state_precision=precision)
    run(model, opt, [(torch.randn(2, 4), torch.randn(2, 4), 1.0)])
    calls = []
    original = SplitState.entry
    monkeypatch.setattr(SplitState, "entry", lambda self, i, handed=False: calls.append(i) or original(self, i, handed))
    params = list(model.parameters())
    for p in params:
        opt.state[p]["step"] = 3
        opt.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
    for p in params[:10]:
        del opt.state[p]
    assert len(calls) <= 5 * len(params), len(calls)  # one refresh per write (and a decode under 8 bits)


def test_a_step_count_of_zero_keeps_the_moments() -> None:
    ours, opt, ref, ref_opt = pair(0.4)
    run(ours, opt, batches(2))
    run(ref, ref_opt, batches(2))
    for o, m in ((opt, ours), (ref_opt, ref)):
        o.state[next(iter(m.parameters()))]["step"] = torch.tensor(0.0)
    assert set(opt.state_dict()["state"][0]) == set(ref_opt.state_dict()["state"][0])
    resumed = twin(ours)
    loaded = tf(resumed.parameters(), 0.4, "first")
    loaded.load_state_dict(save_load(opt.state_dict()))
    run(resumed, loaded, batches(2, seed=7))
    run(ref, ref_opt, batches(2, seed=7))
    assert_weights_close(resumed, ref)


def test_a_load_keeps_only_the_loaded_entries() -> None:
    ours, opt, ref, ref_opt = pair(0.4)
    run(ours, opt, batches(1))
    run(ref, ref_opt, batches(1))
    for o in (opt, ref_opt):
        sd = o.state_dict()
        del sd["state"][0]
        o.load_state_dict(sd)
    p, q = next(iter(ours.parameters())), next(iter(ref.parameters()))
    assert (p in opt.state, len(opt.state)) == (q in ref_opt.state, len(ref_opt.state))
    assert isinstance(copy.deepcopy(opt.state), type(copy.deepcopy(ref_opt.state)))


def test_a_state_dict_loaded_before_ratio_auto_decides_is_applied_when_it_builds() -> None:
    """A resume (HF Trainer loads the optimizer before the first step) under ratio='auto': the state waits for
    the split the first step decides, and training goes on as the uninterrupted run."""
    data = batches(6)
    ours = make_model()
    opt = tf(ours.parameters(), 0.4, "first")
    run(ours, opt, data[:3])
    sd = save_load(opt.state_dict())
    resumed = twin(ours)
    run(ours, opt, data[3:])
    auto = TwinFlowAdam(resumed.parameters(), ratio="auto", chunk_bytes=256, weight_decay=0.01)
    auto.load_state_dict(sd)
    run(resumed, auto, data[3:])
    assert auto.ratio is not None and float(auto.state[next(iter(resumed.parameters()))]["step"]) == 6.0
    assert_weights_close(resumed, ours)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_edited_copy_does_not_hide_an_outside_weight_write(precision: str) -> None:
    """An in-place write to an opt.state copy reaches the buffers at the next step; a weight written outside the
    optimizer in between must still be seen (its master follows, as for AdamW, whose parameter is the weight)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), lr=1e-3, ratio=0.5, state_precision=precision, weight_decay=0.0)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.zero_grad()
    w = model.weight
    opt.state[w]["exp_avg"].mul_(2)  # the weight is cut by the ratio: its moments are a copy
    with torch.no_grad():
        w.fill_(3.0)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    torch.testing.assert_close(w.float(), torch.full((8, 8), 3.0), rtol=0, atol=0.02)


def test_the_cpu_share_encodes_a_loaded_parameter_a_batch_at_a_time_with_the_bits_of_a_whole_encoding() -> None:
    """A parameter of more than two of the encoder's batches (and a tail that is no whole block): the moments
    load_state_dict encodes batch by batch are those of one encoding of the whole parameter."""
    n = 2 * compact.COPY_ELEMENTS + 3 * compact.BLOCK + 77
    p = torch.nn.Parameter(torch.randn(n))
    opt = TwinFlowAdam([p], ratio=1.0, state_precision="int8")
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)  # scales that differ from block to block
    v = torch.rand(n, generator=gen) * torch.logspace(-9, -1, n)
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}},
             "param_groups": opt.state_dict()["param_groups"]}  # fmt: skip
    opt.load_state_dict(state)
    codes_m, scales_m, codes_v, scales_v = compact.encode(m, v)
    got = opt.state_dict()["state"][0]
    assert torch.equal(got["exp_avg"], compact.decode_exp_avg(codes_m, scales_m))
    assert torch.equal(got["exp_avg_sq"], compact.decode_exp_avg_sq(codes_v, scales_v))


def test_a_load_encodes_with_the_kernels_threads_and_gives_torch_its_own_back(monkeypatch) -> None:
    """Under torchrun torch has one thread a rank: a load's encoding of the CPU share's moments runs with the
    kernel's share of the cores (here TWINFLOW_NUM_THREADS), and torch's own count comes back after it."""
    monkeypatch.setenv("TWINFLOW_NUM_THREADS", "3")
    seen: list[int] = []
    encode = compact.encode

    def counting(*args):  # noqa: ANN002, ANN202
        seen.append(torch.get_num_threads())
        return encode(*args)

    monkeypatch.setattr(compact, "encode", counting)
    p = torch.nn.Parameter(torch.randn(3 * compact.BLOCK))
    opt = TwinFlowAdam([p], ratio=1.0, state_precision="int8")
    state = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(p.numel()),
                           "exp_avg_sq": torch.rand(p.numel())}},
             "param_groups": opt.state_dict()["param_groups"]}  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen.clear()
        opt.load_state_dict(state)
        assert seen and set(seen) == {3}, seen
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
