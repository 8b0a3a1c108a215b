"""A portable load (twinflow.checkpoint.portable_load) that is refused raises a CheckpointError naming what is at
fault, what was expected and the fix, and changes nothing: not a weight's bit, not the optimizer's state (steps
included) nor its param groups' hyper-parameters: where the checkpoint is, a model or param groups of another
structure, a damaged twinflow.pt, a load while the state is offloaded; and the one notice a save and a load end
with."""

from __future__ import annotations

import copy
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

import twinflow
from twinflow import TwinFlowAdam
from twinflow.checkpoint import CheckpointError, portable, portable_load

PRECISIONS = ["fp32", "int8_m24"]


def _model(seed: int, width: int = 300) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(300, width), torch.nn.GELU(), torch.nn.Linear(width, 4))


def _optimizer(params, precision: str, lr: float = 1e-2) -> TwinFlowAdam:  # noqa: ANN001
    return TwinFlowAdam(params, lr=lr, ratio=0.5, state_precision=precision)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2, seed: int = 0) -> None:
    for i in range(steps):
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(seed + i))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _saved(directory: Path, precision: str = "fp32", *tags: str) -> tuple[torch.nn.Module, TwinFlowAdam]:
    """A model and its TwinFlowAdam trained two steps, saved under each of `tags` (default "t"; the last: latest)."""
    model = _model(0)
    opt = _optimizer(model.parameters(), precision)
    _train(model, opt)
    for tag in tags or ("t",):
        portable.save_portable(directory, tag, model=model, optimizer=opt)
    return model, opt


def _target(precision: str = "fp32", width: int = 300) -> tuple[torch.nn.Module, TwinFlowAdam]:
    """Another model (seed, and lr: a param group taken from the checkpoint would show) stepped once: its state
    built, as a load into a running optimizer finds it."""
    model = _model(7, width)
    opt = _optimizer(model.parameters(), precision, lr=3e-3)
    _train(model, opt, 1, seed=5)
    return model, opt


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple:
    """Every weight's and state tensor's bits (steps included), and the param groups without their parameters."""
    state = opt.state_dict()
    return (
        [_bits(p) for p in model.parameters()],
        {i: {k: _bits(v) if torch.is_tensor(v) else v for k, v in e.items()} for i, e in state["state"].items()},
        [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
    )


def _assert_unchanged(before: tuple, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    after = _snapshot(model, opt)
    assert len(before[0]) == len(after[0]) and all(a.equal(b) for a, b in zip(before[0], after[0]))
    assert before[1].keys() == after[1].keys() and before[1]  # stepped: there is state to compare
    for i, entry in before[1].items():
        assert entry.keys() == after[1][i].keys()
        assert all(v.equal(after[1][i][k]) if isinstance(v, torch.Tensor) else v == after[1][i][k]
                   for k, v in entry.items()), i  # fmt: skip
    assert before[2] == after[2]


def _refused(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, match: str,
             tag: str | None = None) -> str:  # fmt: skip
    """Loads `tag` of `directory`: refused (CheckpointError matching `match`), nothing changed. Its message."""
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match) as caught:
        portable_load.load_portable(directory, tag, model=model, optimizer=opt)
    _assert_unchanged(before, model, opt)
    return str(caught.value)


def _loaded(model: torch.nn.Module, saved: torch.nn.Module) -> bool:
    return all(a.equal(b) for a, b in zip(model.parameters(), saved.parameters()))


# ------------------------------------------------------------- 1: where the checkpoint is


def test_without_latest_the_tags_there_are_listed_and_one_of_them_loads(tmp_path) -> None:
    saved, _ = _saved(tmp_path, "fp32", "a", "b")
    (tmp_path / "latest").unlink()
    model, opt = _target()
    why = _refused(tmp_path, model, opt, r"no 'latest' in .*: name a tag")
    assert str(tmp_path) in why and "oldest first: ['a', 'b']" in why and "tag='b'" in why
    portable_load.load_portable(tmp_path, "b", model=model, optimizer=opt)  # the fix it names works
    assert _loaded(model, saved)


def test_a_missing_tag_lists_the_tags_there(tmp_path) -> None:
    _saved(tmp_path, "fp32", "a")
    model, opt = _target()
    why = _refused(tmp_path, model, opt, r"x holds no complete portable checkpoint", tag="x")
    assert str(tmp_path / "x") in why and "pass tag= one of those" in why and "['a']" in why


def test_the_tags_listed_are_those_a_load_reads_not_what_a_killed_save_left(tmp_path) -> None:
    _saved(tmp_path, "fp32", "a")
    _saved(tmp_path, "fp32", "b")
    shutil.copytree(tmp_path / "b", tmp_path / "c.saving")  # killed after its metadata, before it was put in place
    shutil.copytree(tmp_path / "a", tmp_path / "a.old")  # killed after a re-save of "a" landed: "a" is the tag
    (tmp_path / "b").rename(tmp_path / "b.old")  # killed between a re-save's renames: "b" loads from there
    model, opt = _target()
    why = _refused(tmp_path, model, opt, r"x holds no complete portable checkpoint", tag="x")
    assert "['a', 'b']" in why and "saving" not in why and ".old" not in why


def test_a_missing_directory_is_named(tmp_path) -> None:
    model, opt = _target()
    for tag in (None, "t"):
        why = _refused(tmp_path / "nope", model, opt, "does not exist or is no folder: pass the one it was saved", tag)
        assert why.startswith(str(tmp_path / "nope"))
    why = _refused(tmp_path, model, opt, r"no 'latest'")  # a folder without checkpoints says so
    assert f"{tmp_path} holds no complete portable checkpoint" in why


# ------------------------------------------------------------- 2, 3: a model or param groups of another structure


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_parameter_of_another_shape_is_refused_naming_it_and_both_shapes(tmp_path, precision: str) -> None:
    _saved(tmp_path, precision)
    model, opt = _target(precision, width=200)  # Linear(300, 200) where Linear(300, 300) was saved
    why = _refused(tmp_path, model, opt, r"checkpoint 't' does not fit this run")
    assert "0.weight" in why and "[300, 300]" in why and "[200, 300]" in why
    assert "build the model as it was saved, or load another checkpoint" in why


def _grouped(how: str, precision: str, seed: int) -> tuple[torch.nn.Module, TwinFlowAdam]:
    """A model whose optimizer groups its parameters `how`, stepped once (seed 0: twice, and saved as "t")."""
    model = _model(seed)
    first, last = list(model[0].parameters()), list(model[2].parameters())
    params = {
        "one": list(model.parameters()),
        "two": [{"params": first}, {"params": last, "lr": 1e-3}],
        "fewer": first,
        "swapped": [{"params": last, "lr": 1e-3}, {"params": first}],
    }[how]
    opt = _optimizer(params, precision, lr=3e-3)
    _train(model, opt, 1 if seed else 2, seed=seed)
    return model, opt


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    ("saved", "loaded", "counts"),
    [("one", "two", r"\[4\] parameters, this optimizer's hold \[2, 2\]"),
     ("one", "fewer", r"\[4\] parameters, this optimizer's hold \[2\]"),
     ("two", "swapped", r"\[2, 2\] parameters, this optimizer's hold \[2, 2\]")],
)  # fmt: skip
def test_param_groups_unlike_the_saved_ones_are_refused(tmp_path, precision: str, saved: str, loaded: str,
                                                        counts: str) -> None:  # fmt: skip
    """Two groups where one was saved, half the parameters, or the saved groups in the other order used to load,
    each group taking the hyper-parameters of its first parameter's saved group (a scheduler's per-group state
    would then follow the groups' order)."""
    saving, saving_opt = _grouped(saved, precision, 0)
    portable.save_portable(tmp_path, "t", model=saving, optimizer=saving_opt)
    model, opt = _grouped(loaded, precision, 7)
    why = _refused(tmp_path, model, opt, rf"was saved with param groups of {counts} \(the first that differs: ")
    assert "build the optimizer's param groups as saved" in why


def test_more_parameters_than_were_saved_are_refused_naming_them(tmp_path) -> None:
    model = _model(0)
    opt = _optimizer(model[0].parameters(), "fp32")
    _train(model, opt)
    portable.save_portable(tmp_path, "t", model=model, optimizer=opt)
    target, target_opt = _target()
    _refused(tmp_path, target, target_opt, r"has no optimizer state for \['2.bias', '2.weight'\]")


# ------------------------------------------------------------- 4: a damaged twinflow.pt


DAMAGES = {  # a change to twinflow.pt: what the refusal names
    "lr_str": (lambda i: i["param_groups"][0].update(lr="0.01"), r"\]\[0\]\['lr'\] is '0.01'; expected one of"),
    "no_lr": (lambda i: i["param_groups"][0].pop("lr"), r"\['param_groups'\]\[0\]\['lr'\] is missing"),
    "betas_float": (lambda i: i["param_groups"][0].update(betas=0.9), r"\['betas'\] is 0.9; .* \(0.9, 0.999\)"),
    "weight_decay_none": (lambda i: i["param_groups"][0].update(weight_decay=None), r"\['weight_decay'\] is None"),
    "amsgrad_str": (lambda i: i["param_groups"][0].update(amsgrad="no"), r"\['amsgrad'\] is 'no'.*False"),
    "no_params": (lambda i: i["param_groups"][0].pop("params"), r"\['params'\] is missing; expected a list"),
    "params_str": (lambda i: i["param_groups"][0].update(params="0.weight"), r"\['params'\] is '0.weight'"),
    "groups_dict": (lambda i: i.update(param_groups={}), r"\['param_groups'\] is \{\}; expected a list of dicts"),
    "no_state_keys": (lambda i: i.pop("state_keys"), r"\['state_keys'\] is missing"),
    "state_keys_str": (lambda i: i["state_keys"].update({"0.bias": "x"}), r"\['0.bias'\] is 'x'; expected a list"),
    "world_size_str": (lambda i: i.update(world_size="1"), r"\['world_size'\] is '1'; expected an int >= 1"),
    "no_scheduler": (lambda i: i.pop("scheduler"), r"\['scheduler'\] is missing"),
    "meta_list": (lambda i: i.update(meta=[1]), r"\['meta'\] is \[1\]; expected a dict, or None"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_twinflow_pt_entry_is_refused_naming_it(tmp_path, damage: str) -> None:
    """Most of these used to load, and the next step failed or trained with another lr (a missing one: the
    default); the others raised a KeyError or an AttributeError, or named the wrong cause."""
    change, named = DAMAGES[damage]
    _saved(tmp_path, "fp32")
    path = tmp_path / "t" / portable.INFO
    info = torch.load(path, weights_only=True)
    change(info)
    torch.save(info, path)
    model, opt = _target()
    why = _refused(tmp_path, model, opt, named)
    assert why.startswith(f"{path}[") and why.endswith("(the file is damaged); nothing was changed: load another tag, "
                                                       "or save it again")  # fmt: skip


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("step", "shown"), [("3", "'3'"), (2.5, "2.5"), (-1.0, "-1.0"), (float("nan"), "nan")])
def test_a_damaged_step_is_refused_naming_the_parameter(tmp_path, monkeypatch, precision: str, step, shown) -> None:
    """A step saved as a string (DCP keeps it as an object) used to raise AttributeError: 'str' object has no
    attribute 'item'."""
    tensors = portable.optimizer_tensors

    def damaged(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        out = tensors(model, opt)
        out["0.bias"]["step"] = step if isinstance(step, str) else torch.tensor(step)
        return out

    monkeypatch.setattr(portable, "optimizer_tensors", damaged)
    _saved(tmp_path, precision)
    monkeypatch.undo()
    model, opt = _target(precision)
    why = _refused(tmp_path, model, opt, rf"checkpoint 't': the step of 0.bias is {re.escape(shown)}; expected a "
                                         "whole number >= 0")  # fmt: skip
    assert "nothing was changed: load another tag" in why


# ------------------------------------------------------------- 5: while the state is offloaded


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("weights", [False, True])
def test_a_load_while_the_state_is_offloaded_is_refused_until_reload_states(tmp_path, precision: str,
                                                                           weights: bool) -> None:  # fmt: skip
    saved, _ = _saved(tmp_path, precision)
    model, opt = _target(precision)
    before = _snapshot(model, opt)
    assert opt.offload_states(weights=weights) > 0 and opt.offload.offloaded
    with pytest.raises(CheckpointError, match=r"offloaded \(offload_states\(\)\); call reload_states\(\) first"):
        portable_load.load_portable(tmp_path, model=model, optimizer=opt)
    assert opt.offload.offloaded  # still out: the refusal brought nothing back
    opt.reload_states()
    _assert_unchanged(before, model, opt)
    portable_load.load_portable(tmp_path, model=model, optimizer=opt)  # the fix it names works
    assert _loaded(model, saved)


# ------------------------------------------------------------- 6: one notice each


def _notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "twinflow.notice"]


def test_a_portable_save_and_load_each_end_with_one_notice_of_the_path(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="twinflow.notice")
    model = _model(0)
    opt = _optimizer(model.parameters(), "fp32")
    _train(model, opt)  # (a first step may build the kernel: a notice of its own)
    target, target_opt = _target()
    caplog.clear()
    folder = portable.save_portable(tmp_path, "t", model=model, optimizer=opt)
    (line,) = _notices(caplog)
    assert line.startswith(f"saved portable checkpoint {folder} ")
    caplog.clear()
    portable_load.load_portable(tmp_path, model=target, optimizer=target_opt)
    (line,) = _notices(caplog)
    assert line.startswith(f"loaded portable checkpoint {folder} ")
    caplog.clear()
    _refused(tmp_path, *_target(width=200), "does not fit")
    assert _notices(caplog) == []  # a refused load tells of no load


# ------------------------------------------------------------- 7: through the engine


def _engine(width: int, precision: str, groups: bool = False):  # noqa: ANN202
    model = _model(0 if width == 300 else 7, width)
    params = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}] if groups else None
    config = {"train_micro_batch_size_per_gpu": 4, "offload_ratio": 0.5, "offload_state_precision": precision,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
    engine, *_ = twinflow.initialize(model=model, config=config, model_parameters=params)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(4, 300, generator=gen)
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("shape", r"saved torch.Size\(\[300, 300\]\) and current: torch.Size\(\[200, 300\]\) for model.0.weight"),
        ("groups", r"param groups of \[4\] parameters, this optimizer's hold \[2, 2\]"),
    ],
    ids=["shape", "groups"],
)
def test_the_engines_load_checkpoint_is_refused_and_changes_nothing(tmp_path, precision: str, how: str,
                                                                    named: str) -> None:  # fmt: skip
    saving = _engine(300, precision)
    folder = saving.save_checkpoint(tmp_path, client_state={"epoch": 1})
    assert portable.is_portable(folder)  # the engine's default format
    engine = _engine(200 if how == "shape" else 300, precision, groups=how == "groups")
    engine.local_optimizer.synchronize()
    before = _snapshot(engine.module, engine.local_optimizer)
    steps = (engine.global_steps, engine.micro_steps)
    with pytest.raises(CheckpointError, match=named):
        engine.load_checkpoint(tmp_path)
    _assert_unchanged(before, engine.module, engine.local_optimizer)
    assert (engine.global_steps, engine.micro_steps) == steps


@pytest.mark.parametrize("flags", [{"foreach": False}, {"foreach": True}, {"fused": False}])
def test_a_flag_saved_as_none_loads_where_the_optimizer_sets_it(tmp_path, flags: dict) -> None:
    """torch's foreach and fused are Optional[bool]: saved None (its default), set here (HF Trainer's fused AdamW)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    portable.save_portable(tmp_path, "t", model=model, optimizer=opt)
    other = torch.nn.Linear(6, 3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=3e-3, **flags)
    portable_load.load_portable(tmp_path, "t", model=other, optimizer=other_opt)
    assert other.weight.equal(model.weight) and other_opt.param_groups[0]["lr"] == 1e-2
    assert other_opt.state[other.weight]["exp_avg"].equal(opt.state[model.weight]["exp_avg"])
