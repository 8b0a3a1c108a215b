"""TwinFlowAdam against torch.optim.AdamW wherever torch.optim's machinery touches an optimizer.

Adapted from PyTorch's own optimizer tests (test/test_optim.py and the AdamW
OptimizerInfo of torch/testing/_internal/common_optimizers.py): its inputs
(default, lr, weight decay, betas, eps, Adam's coupled decay), its error
inputs, state-dict round trips and hooks, ``add_param_group``,
``zero_grad``, deep copies and pickling, ``param_names``, and what
``torch.distributed.checkpoint`` and LR schedulers do to an optimizer. Each
case runs at ratio 0 (all on the "device"), 0.37 (a tensor cut in two, CPU
first or last) and 1 (all on the CPU); on a CPU-only machine the device side
runs on the CPU. References are torch.optim.AdamW/Adam on fp32 copies of the
same weights with the same gradients; weights are compared after a few steps
within 1e-6 relative. The regression tests for weights changed outside the
optimizer, an outside ``clip_grad_norm_`` and frozen parameters under
``attach()`` also run with bf16 parameters, on the CPU and on CUDA
(``-m cuda``), against AdamW on fp32 masters (``MasterAdamW``).
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam

# (ratio, placement): at ratios 0 and 1 the placement changes nothing, so it is exercised at 0.37 only.
SPLITS = [(0.0, "first"), (0.37, "first"), (0.37, "last"), (1.0, "first")]
SPLIT_IDS = ["r0", "r0.37-first", "r0.37-last", "r1"]
CPU_SPLITS = [(0.37, "first"), (0.37, "last"), (1.0, "first")]  # where something steps on the CPU side
CPU_SPLIT_IDS = ["r0.37-first", "r0.37-last", "r1"]
RTOL, ATOL = 1e-6, 1e-7  # fp32 weights after a few steps
# The regression tests for weights changed outside the optimizer, for an outside clip_grad_norm_ and for frozen
# parameters under attach() also run with bf16 parameters on CUDA (``-m cuda``), and on the CPU, where the same
# logic (fp32 masters on both sides, rounded write-back) is checked without a GPU.
DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.cuda),
]
# bf16 parameters are compared through their fp32 masters (state_dict()'s "master") against a reference's. Both
# step fp32 masters from the same bf16 gradients; they differ by fp32 rounding (~1e-7 relative a step) and, where
# a master lies next to a bf16 rounding boundary, by a weight one bf16 ulp apart whose next gradients differ a
# little. A bug is far larger: a stale master puts back weights of another model (differences ~0.1 and more), and
# an unclipped step moves the masters by more than this tolerance (each clipping test asserts that, too).
BF16_MASTER_RTOL, BF16_MASTER_ATOL = 1e-4, 1e-5


# ------------------------------------------------------------------ helpers
def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Sequential:
    """424 parameter elements in 8 tensors; ratio 0.37 cuts the second Linear's weight. The same weights (up to
    rounding to ``dtype``) on every device."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 12),
        torch.nn.LayerNorm(12),
        torch.nn.Linear(12, 4),
    )
    return model.to(device, dtype)


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with the same weights (for the reference optimizer)."""
    return copy.deepcopy(model)


def tf(params, ratio: float, placement: str, **kwargs) -> TwinFlowAdam:
    kwargs.setdefault("weight_decay", 0.01)
    return TwinFlowAdam(params, ratio=ratio, placement=placement, chunk_bytes=256, **kwargs)


def batches(n: int, seed: int = 1, scales: list[float] | None = None) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    gen = torch.Generator().manual_seed(seed)
    scales = scales or [1.0] * n
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen), scales[k]) for k in range(n)]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    p = next(model.parameters())
    return F.mse_loss(model(x.to(p.device, p.dtype)).float(), y.to(p.device)) * scale


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data,
    sched=None,
    after_backward: Callable[[int], None] | None = None,
) -> list[float]:
    losses = []
    for k, (x, y, scale) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y, scale)
        loss.backward()
        if after_backward is not None:
            after_backward(k)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    if isinstance(opt, TwinFlowAdam):
        opt.synchronize()
    return losses


def assert_weights_close(ours, ref, rtol: float = RTOL, atol: float = ATOL, msg: str = "") -> None:
    ours = list(ours.parameters()) if isinstance(ours, torch.nn.Module) else list(ours)
    ref = list(ref.parameters()) if isinstance(ref, torch.nn.Module) else list(ref)
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(
            a.detach().float(), b.detach().float(), rtol=rtol, atol=atol, msg=lambda m, i=i: f"{msg} param {i}: {m}"
        )


def set_grads(params, seed: int, dtype: torch.dtype | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        p.grad = g.to(p.device, dtype or p.dtype)


def names_of(model: torch.nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


class MasterAdamW:
    """The reference for bf16 parameters: torch.optim.AdamW on fp32 masters of the parameters, stepped from the
    parameters' gradients and written back rounded, as TwinFlowAdam does on both sides. With fp32 parameters it
    is torch.optim.AdamW, bit for bit. ``follow_weights()`` restarts the masters from the parameters (weights
    loaded from outside), keeping moments and step counts, as AdamW would with fp32 weights."""

    def __init__(self, params, **kwargs) -> None:
        kwargs.setdefault("weight_decay", 0.01)
        self.params = list(params)
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.adamw = torch.optim.AdamW(self.masters, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def follow_weights(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.copy_(p)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.adamw.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)


def masters_of(opt: TwinFlowAdam | MasterAdamW) -> list[torch.Tensor]:
    """What each parameter steps from, in fp32 on the CPU: a bf16 parameter's master (state_dict()'s "master"),
    which the parameter must equal rounded; an fp32 parameter (or one never stepped) itself."""
    if isinstance(opt, MasterAdamW):
        return [m.detach().cpu() for m in opt.masters]
    state = opt.state_dict()["state"]
    params = [p for group in opt.param_groups for p in group["params"]]
    masters = []
    for i, p in enumerate(params):
        master = state.get(i, {}).get("master")
        if master is None:
            masters.append(p.detach().float().cpu())
            continue
        assert torch.equal(p.detach().cpu(), master.cpu().to(p.dtype).view_as(p)), f"param {i} is not its master"
        masters.append(master.float().cpu().view_as(p))
    return masters


def assert_masters_close(ours: TwinFlowAdam | MasterAdamW, ref: MasterAdamW, msg: str = "") -> None:
    bf16 = any(p.dtype != torch.float32 for p in ref.params)
    tol = (BF16_MASTER_RTOL, BF16_MASTER_ATOL) if bf16 else (RTOL, ATOL)
    assert_weights_close(masters_of(ours), masters_of(ref), *tol, msg=msg)


# -------------------------------------------------- numerics: OptimizerInfo inputs
ADAMW_INPUTS = {
    "default": {"weight_decay": 0.01},  # AdamW's defaults, its weight decay spelled out
    "lr": {"lr": 0.01, "weight_decay": 0.0},
    "wd0.1": {"weight_decay": 0.1},
    "betas": {"betas": (0.8, 0.9), "weight_decay": 0.01},
    "beta1=0": {"betas": (0.0, 0.99), "weight_decay": 0.01},
    "eps": {"eps": 1e-3, "weight_decay": 0.01},
    "lr=0": {"lr": 0.0, "weight_decay": 0.1},
}


@pytest.mark.parametrize("kwargs", list(ADAMW_INPUTS.values()), ids=list(ADAMW_INPUTS))
@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_matches_adamw(ratio: float, placement: str, kwargs: dict) -> None:
    ours = make_model()
    ref = twin(ours)
    data = batches(5)
    assert train(ours, tf(ours.parameters(), ratio, placement, **kwargs), data) == pytest.approx(
        train(ref, torch.optim.AdamW(ref.parameters(), **kwargs), data), rel=1e-6
    )
    assert_weights_close(ours, ref)


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_adam_mode_matches_adam(ratio: float, placement: str) -> None:
    """adamw_mode=False is torch.optim.Adam's coupled (L2) weight decay."""
    assert_trains_like(
        lambda m: tf(m.parameters(), ratio, placement, weight_decay=0.1, adamw_mode=False),
        lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.1),
    )


def assert_trains_like(ours_opt, ref_opt, steps: int = 5) -> None:
    """The same model and batches under TwinFlowAdam (``ours_opt(model)``) and a torch optimizer: same weights."""
    ours = make_model()
    ref = twin(ours)
    data = batches(steps)
    train(ours, ours_opt(ours), data)
    train(ref, ref_opt(ref), data)
    assert_weights_close(ours, ref)


def param_groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": list(model[0].parameters()), "lr": 3e-3, "weight_decay": 0.1},
        {"params": list(model[2].parameters()) + list(model[3].parameters()), "betas": (0.8, 0.95), "eps": 1e-6},
        {"params": list(model[4].parameters()), "lr": 1e-2, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_param_groups_match_adamw(ratio: float, placement: str) -> None:
    assert_trains_like(
        lambda m: tf(param_groups(m), ratio, placement, lr=1e-3, weight_decay=0.01),
        lambda m: torch.optim.AdamW(param_groups(m), lr=1e-3, weight_decay=0.01),
    )


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_params_without_grad_are_skipped(ratio: float, placement: str) -> None:
    """A parameter without a gradient in a step is not stepped (no weight decay, no step count), as in AdamW."""
    ours = make_model()
    ref = twin(ours)
    data = batches(6)

    def drop(model):
        def hook(k: int) -> None:
            model[2].weight.grad = None  # cut by the 0.37 boundary: both sides skip it
            if k % 2:
                model[0].bias.grad = None
                model[4].weight.grad = None

        return hook

    opt = tf(ours.parameters(), ratio, placement, weight_decay=0.1)
    train(ours, opt, data, after_backward=drop(ours))
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.1)
    train(ref, ref_opt, data, after_backward=drop(ref))
    assert_weights_close(ours, ref)
    assert torch.equal(ours[2].weight, make_model()[2].weight), "a parameter that never had a gradient moved"
    sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for i in ref_sd["state"]:
        assert float(sd["state"][i]["step"]) == float(ref_sd["state"][i]["step"]), f"param {i}"


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_zero_sized_parameters(ratio: float, placement: str) -> None:
    """torch.optim allows empty parameters (an FSDP rank's empty shard is one); they are no-ops."""
    ours = make_model()
    ref = twin(ours)
    extra = [torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0, 4))]
    ref_extra = [torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0, 4))]
    opt = tf(list(ours.parameters())[:3] + extra + list(ours.parameters())[3:], ratio, placement)
    ref_opt = torch.optim.AdamW(list(ref.parameters())[:3] + ref_extra + list(ref.parameters())[3:], weight_decay=0.01)

    def grads_for(params):
        return lambda k: [p.__setattr__("grad", torch.zeros_like(p)) for p in params]

    data = batches(4)
    train(ours, opt, data, after_backward=grads_for(extra))
    train(ref, ref_opt, data, after_backward=grads_for(ref_extra))
    assert_weights_close(ours, ref)
    assert [p.shape for p in extra] == [torch.Size([0]), torch.Size([0, 4])]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=True))


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s)),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_lr_schedulers(ratio: float, placement: str, sched: str) -> None:
    """An LR scheduler changing param_groups' lr between steps reaches both sides."""
    ours = make_model()
    ref = twin(ours)
    data = batches(5)
    opt = tf(param_groups(ours), ratio, placement, lr=1e-2)
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=1e-2, weight_decay=0.01)
    train(ours, opt, data, SCHEDULERS[sched](opt))
    train(ref, ref_opt, data, SCHEDULERS[sched](ref_opt))
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert_weights_close(ours, ref)


@pytest.mark.parametrize(("ratio", "placement"), [(0.37, "first")], ids=["r0.37"])
def test_closure_and_step_hooks(ratio: float, placement: str) -> None:
    """step(closure) returns the closure's loss; optimizer step pre/post hooks run once per step."""
    ours = make_model()
    ref = twin(ours)
    opt = tf(ours.parameters(), ratio, placement)
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.01)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    for x, y, _ in batches(3):
        for model, o in ((ours, opt), (ref, ref_opt)):

            def closure(model=model, o=o, x=x, y=y):
                o.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                return loss

            returned = o.step(closure)
            assert isinstance(returned, torch.Tensor)
    opt.synchronize()
    assert calls == ["pre", "post"] * 3
    assert_weights_close(ours, ref)


def test_defaults_match_adamw() -> None:
    ours = inspect.signature(TwinFlowAdam).parameters
    ref = inspect.signature(torch.optim.AdamW).parameters
    for name in ("lr", "betas", "eps", "weight_decay"):
        assert ours[name].default == ref[name].default, name


# ------------------------------------------------------------------ error inputs
@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"lr": -1e-2}, r"(?i)learning rate|lr"),
        ({"eps": -1e-8}, r"(?i)eps"),
        ({"betas": (1.0, 0.0)}, r"(?i)beta.*index 0"),
        ({"betas": (-0.1, 0.999)}, r"(?i)beta.*index 0"),
        ({"betas": (0.9, 1.0)}, r"(?i)beta.*index 1"),
        ({"weight_decay": -1}, r"(?i)weight_decay"),
    ],
    ids=["lr<0", "eps<0", "beta1=1", "beta1<0", "beta2=1", "weight_decay<0"],
)
def test_invalid_hyperparameters(kwargs: dict, names: str) -> None:
    kwargs = {"weight_decay": 0.01} | kwargs
    with pytest.raises(ValueError, match=names):
        torch.optim.AdamW(make_model().parameters(), **kwargs)  # the reference raises too
    with pytest.raises(ValueError, match=names):
        TwinFlowAdam(make_model().parameters(), ratio=0.37, **kwargs)


def test_invalid_params_argument() -> None:
    """torch.optim's error inputs common to all optimizers."""
    a, b = torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(torch.randn(2, 2))
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        TwinFlowAdam(a, weight_decay=0.01)
    with pytest.raises(ValueError, match="empty parameter list"):
        TwinFlowAdam([], weight_decay=0.01)
    with pytest.raises(ValueError, match="more than one parameter group"):
        TwinFlowAdam([{"params": [a]}, {"params": [a]}], weight_decay=0.01)
    with pytest.raises(ValueError, match="with/without names"):
        TwinFlowAdam([("weight", a), b], weight_decay=0.01)


UNSUPPORTED_FLAGS = ["amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable"]


@pytest.mark.parametrize("flag", UNSUPPORTED_FLAGS)
def test_unsupported_flags_are_refused(flag: str) -> None:
    with pytest.raises((ValueError, TypeError), match=flag):
        TwinFlowAdam(make_model().parameters(), weight_decay=0.01, ratio=0.37, **{flag: True})


def test_adamw_default_flag_values_are_accepted() -> None:
    """Code written for AdamW often spells out its defaults (configs: ``amsgrad: false``); those are no-ops."""
    noop = {"amsgrad": False, "maximize": False, "foreach": None, "fused": None, "capturable": False}
    noop["differentiable"] = False
    ours = make_model()
    ref = twin(ours)
    train(ours, tf(ours.parameters(), 0.37, "first", **noop), batches(2))
    train(ref, torch.optim.AdamW(ref.parameters(), weight_decay=0.01, **noop), batches(2))
    assert_weights_close(ours, ref)


def test_non_contiguous_parameter_is_refused() -> None:
    p = torch.nn.Parameter(torch.randn(6, 4).t())
    assert not p.is_contiguous()
    with pytest.raises((ValueError, TypeError), match="contiguous"):
        TwinFlowAdam([p], weight_decay=0.01, ratio=0.37)


# ------------------------------------------------------------------ state dicts
def save_load(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_state_dict_round_trip(ratio: float, placement: str) -> None:
    """Save after 3 steps, load into a fresh optimizer over fresh copies, 3 more steps: the uninterrupted run."""
    data = batches(6)
    ours = make_model()
    opt = tf(param_groups(ours), ratio, placement)
    train(ours, opt, data[:3])
    sd = save_load(opt.state_dict())
    resumed = twin(ours)
    train(ours, opt, data[3:])

    # the fresh optimizer starts with other hyper-parameters: the state dict brings them back
    opt2 = tf(param_groups(resumed), ratio, placement, lr=0.5, weight_decay=0.0)
    opt2.load_state_dict(sd)
    train(resumed, opt2, data[3:])
    assert_weights_close(resumed, ours, rtol=0, atol=0)


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_state_dict_to_adamw_and_back(ratio: float, placement: str) -> None:
    data = batches(6)
    # TwinFlowAdam -> AdamW
    ours = make_model()
    opt = tf(param_groups(ours), ratio, placement)
    train(ours, opt, data[:3])
    other = twin(ours)
    ref_opt = torch.optim.AdamW(param_groups(other), lr=0.5, weight_decay=0.0)
    ref_opt.load_state_dict(save_load(opt.state_dict()))
    train(ours, opt, data[3:])
    train(other, ref_opt, data[3:])
    assert_weights_close(other, ours)
    # AdamW -> TwinFlowAdam
    ref = make_model()
    ref_opt = torch.optim.AdamW(param_groups(ref), weight_decay=0.01)
    train(ref, ref_opt, data[:3])
    mine = twin(ref)
    opt = tf(param_groups(mine), ratio, placement, lr=0.5, weight_decay=0.0)
    opt.load_state_dict(save_load(ref_opt.state_dict()))
    train(ref, ref_opt, data[3:])
    train(mine, opt, data[3:])
    assert_weights_close(mine, ref)


def test_state_dict_hooks() -> None:
    """torch.optim's four state-dict hooks run exactly once per call, in torch's order, with torch's effects."""
    events: list[str] = []

    def exercise(opt: torch.optim.Optimizer) -> tuple[dict, list[str]]:
        events.clear()

        def sd_pre(o):
            events.append("sd_pre")

        def sd_post(o, sd):
            events.append("sd_post")
            sd = dict(sd)
            sd["extra"] = "from post hook"
            return sd

        def load_pre(o, sd):
            events.append("load_pre")
            assert "extra" in sd
            sd = dict(sd)
            sd.pop("extra")
            sd["param_groups"] = [dict(g, lr=0.123) for g in sd["param_groups"]]
            return sd

        def load_post(o):
            events.append(("load_post", [g["lr"] for g in o.param_groups]))

        opt.register_state_dict_pre_hook(sd_pre)
        opt.register_state_dict_post_hook(sd_post)
        opt.register_load_state_dict_pre_hook(load_pre)
        opt.register_load_state_dict_post_hook(load_post)
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        return sd, list(events)

    ours, ref = make_model(), make_model()
    opt = tf(ours.parameters(), 0.37, "first")
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.01)
    train(ours, opt, batches(1))
    train(ref, ref_opt, batches(1))
    sd, seen = exercise(opt)
    ref_sd, ref_seen = exercise(ref_opt)
    assert ref_seen == ["sd_pre", "sd_post", "load_pre", ("load_post", [0.123])]
    assert seen == ref_seen
    assert sd.get("extra") == "from post hook"
    assert [g["lr"] for g in opt.param_groups] == [0.123]
    # the hooks fire once per call, not once per internal use
    events.clear()
    opt.state_dict()
    assert events == ["sd_pre", "sd_post"]


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_state_is_populated(ratio: float, placement: str) -> None:
    """opt.state[p] holds step, exp_avg and exp_avg_sq after a step, with AdamW's values."""
    ours = make_model()
    ref = twin(ours)
    opt = tf(ours.parameters(), ratio, placement)
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.01)
    data = batches(3)
    train(ours, opt, data)
    train(ref, ref_opt, data)
    assert len(opt.state) == len(ref_opt.state) == len(list(ours.parameters()))
    for i, (p, q) in enumerate(zip(ours.parameters(), ref.parameters())):
        assert p in opt.state, f"param {i} has no state"
        st, ref_st = opt.state[p], ref_opt.state[q]
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(st), f"param {i}: {sorted(st)}"
        assert float(st["step"]) == float(ref_st["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].shape == p.shape, f"param {i} {key}"
            torch.testing.assert_close(
                st[key], ref_st[key], rtol=1e-5, atol=1e-10, msg=lambda m, i=i, key=key: f"param {i} {key}: {m}"
            )


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_add_param_group(ratio: float, placement: str) -> None:
    ours = make_model()
    ref = twin(ours)
    opt = tf(list(ours[0].parameters()) + list(ours[2].parameters()), ratio, placement)
    ref_opt = torch.optim.AdamW(list(ref[0].parameters()) + list(ref[2].parameters()), weight_decay=0.01)
    opt.add_param_group({"params": list(ours[3].parameters()) + list(ours[4].parameters()), "lr": 5e-3})
    ref_opt.add_param_group({"params": list(ref[3].parameters()) + list(ref[4].parameters()), "lr": 5e-3})
    train(ours, opt, batches(4))
    train(ref, ref_opt, batches(4))
    assert not torch.equal(ours[4].weight, make_model()[4].weight), "the added parameters were not stepped"
    assert_weights_close(ours, ref)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none: bool) -> None:
    model = make_model()
    opt = tf(model.parameters(), 0.37, "first")
    loss_of(model, *batches(1)[0][:2]).backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))


# ------------------------------------------------------------------ copies
def _copy_continues(make_copy) -> Callable[[float, str], None]:
    def check(ratio: float, placement: str) -> None:
        model = make_model()
        opt = tf(param_groups(model), ratio, placement)
        train(model, opt, batches(2))
        opt_copy = make_copy(opt)
        copied = [p for g in opt_copy.param_groups for p in g["params"]]
        originals = [p for g in opt.param_groups for p in g["params"]]
        assert all(c is not o for c, o in zip(copied, originals))
        assert_weights_close(copied, originals, rtol=0, atol=0)
        before = [p.detach().clone() for p in originals]
        for k in range(3):  # the copy steps its own parameters ...
            set_grads(copied, 10 + k)
            opt_copy.step()
            opt_copy.zero_grad()
        opt_copy.synchronize()
        assert_weights_close(originals, before, rtol=0, atol=0, msg="the copy's steps changed the original:")
        assert not torch.equal(copied[0], before[0]), "the copy did not step"
        for k in range(3):  # ... exactly as the original continues
            set_grads(originals, 10 + k)
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        assert_weights_close(copied, originals, rtol=0, atol=0)

    return check


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_deepcopy_optimizer(ratio: float, placement: str) -> None:
    _copy_continues(copy.deepcopy)(ratio, placement)


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_pickle_optimizer(ratio: float, placement: str) -> None:
    _copy_continues(lambda opt: pickle.loads(pickle.dumps(opt)))(ratio, placement)


@pytest.mark.parametrize(("ratio", "placement"), CPU_SPLITS, ids=CPU_SPLIT_IDS)
def test_deepcopy_attached_model_forward(ratio: float, placement: str) -> None:
    """copy.deepcopy(model) after opt.attach(model) (EMA models, evaluation copies) works and runs forward."""
    model = make_model()
    opt = tf(model.parameters(), ratio, placement).attach(model)
    train(model, opt, batches(2))
    copied = copy.deepcopy(model)
    x = batches(1, seed=5)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(copied(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(("ratio", "placement"), CPU_SPLITS, ids=CPU_SPLIT_IDS)
def test_deepcopy_attached_model_leaves_training_alone(ratio: float, placement: str) -> None:
    """Training a deep copy of an attached model must not disturb the attached optimizer's next steps."""
    model = make_model()
    ref = twin(model)
    data = batches(4)
    opt = tf(model.parameters(), ratio, placement).attach(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.01)
    train(model, opt, data[:2])
    train(ref, ref_opt, data[:2])
    opt.zero_grad(set_to_none=True)
    copied = copy.deepcopy(model)
    loss_of(copied, *batches(1, seed=7)[0][:2]).backward()  # the copy's gradients are not the original's
    assert all(p.grad is None for p in model.parameters())
    train(model, opt, data[2:])
    train(ref, ref_opt, data[2:])
    assert_weights_close(model, ref)


# ------------------------------------------------------------------ weights changed outside the optimizer
# load_state_dict and p.copy_ under no_grad bump the version counter that tells TwinFlowAdam a weight changed
# outside it. p.data.copy_ goes around it: the user says so with opt.weights_changed() (README).
CHANGES = ["load_state_dict", "copy_", "data.copy_+weights_changed"]


def _change_weights(model: torch.nn.Module, new: torch.nn.Module, how: str, opt: object = None) -> None:
    if how == "load_state_dict":
        model.load_state_dict(new.state_dict())
    elif how == "copy_":
        with torch.no_grad():
            for p, q in zip(model.parameters(), new.parameters()):
                p.copy_(q)
    else:
        for p, q in zip(model.parameters(), new.parameters()):
            p.data.copy_(q.data)
        if isinstance(opt, TwinFlowAdam):
            opt.weights_changed()


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_weights_changed_outside_the_optimizer(
    device: str, dtype: torch.dtype, ratio: float, placement: str, how: str
) -> None:
    """Weights loaded into the model after the optimizer was built (before the first step and mid-run) are the
    weights the next step starts from, as with AdamW; the optimizer's own fp32 masters must not overwrite them.
    bf16: against AdamW on fp32 masters restarted from the loaded weights."""
    ours = make_model(dtype=dtype, device=device)
    ref = twin(ours)
    opt = tf(ours.parameters(), ratio, placement)
    ref_opt = MasterAdamW(ref.parameters())
    data = batches(4)
    for seed, part in ((1, data[:2]), (2, data[2:])):
        new = make_model(seed=seed, dtype=dtype, device=device)
        _change_weights(ours, new, how, opt)
        _change_weights(ref, new, how)
        ref_opt.follow_weights()
        train(ours, opt, part)
        train(ref, ref_opt, part)
    assert_masters_close(opt, ref_opt)


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_weights_changed_outside_the_optimizer_bf16(device: str, ratio: float, placement: str, how: str) -> None:
    """bf16 parameters, the same bf16 gradients on both sides (no forward): against AdamW on fp32 copies of the
    bf16 weights, whose weights are TwinFlowAdam's masters (fp32 tolerance) and, rounded, its weights."""
    ours = make_model(dtype=torch.bfloat16, device=device)
    ref = make_model(device=device)
    ref.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    opt = tf(ours.parameters(), ratio, placement)
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.01)

    def steps(seeds: range) -> None:
        for k in seeds:
            set_grads(ours.parameters(), k, torch.bfloat16)
            for p, q in zip(ours.parameters(), ref.parameters()):
                q.grad = p.grad.float()  # the same (bf16-rounded) gradients
            opt.step()
            ref_opt.step()
        opt.synchronize()

    for seed, seeds in ((1, range(0, 2)), (2, range(2, 4))):
        new = make_model(seed=seed, dtype=torch.bfloat16, device=device)
        _change_weights(ours, new, how, opt)
        _change_weights(ref, new.float(), how)
        steps(seeds)
    assert_weights_close(masters_of(opt), [q.cpu() for q in ref.parameters()], rtol=1e-5, atol=1e-6)
    assert_weights_close(ours, ref, rtol=1.6e-2, atol=1e-4)


# ------------------------------------------------------------------ param_names, repeated parameters
@pytest.mark.parametrize("direction", ["named->unnamed", "unnamed->named"])
def test_param_names_as_torch(direction: str) -> None:
    """A state dict moving between optimizers built with and without named_parameters() keeps (or not)
    ``param_names`` exactly as torch.optim.AdamW does."""
    results = {}
    for kind in ("ours", "ref"):
        src, dst = make_model(), make_model()

        def build(model, named, kind=kind):
            params = model.named_parameters() if named else model.parameters()
            if kind == "ours":
                return tf(params, 0.37, "first")
            return torch.optim.AdamW(params, weight_decay=0.01)

        named_src = direction == "named->unnamed"
        opt = build(src, named_src)
        train(src, opt, batches(1))
        sd = save_load(opt.state_dict())
        dst_opt = build(dst, not named_src)
        dst_opt.load_state_dict(sd)
        results[kind] = (
            sd["param_groups"][0].get("param_names"),
            dst_opt.param_groups[0].get("param_names"),
            dst_opt.state_dict()["param_groups"][0].get("param_names"),
        )
    assert results["ref"][1] == names_of(make_model())  # torch keeps the names either way
    assert results["ours"] == results["ref"]


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_repeated_parameter_in_a_group(ratio: float, placement: str) -> None:
    """torch.optim warns about a parameter repeated within a group ("in future, this will cause an error") and
    AdamW then steps it twice per step() (state step 2 per call). TwinFlowAdam must either refuse it with a
    ValueError naming the duplicate, or warn the same way and step it exactly as AdamW's default (for-loop)
    implementation on the CPU does. It must not silently do something else."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(30))
    rp, rq = torch.nn.Parameter(p.detach().clone()), torch.nn.Parameter(q.detach().clone())
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ref_opt = torch.optim.AdamW([rp, rq, rp], lr=1e-2, weight_decay=0.1, foreach=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt = tf([p, q, p], ratio, placement, lr=1e-2, weight_decay=0.1)
        except ValueError as e:
            assert "duplicate" in str(e)
            return
    assert any("duplicate" in str(w.message) for w in caught)
    for k in range(3):
        set_grads([p, q], k)
        rp.grad, rq.grad = p.grad.clone(), q.grad.clone()
        opt.step()
        ref_opt.step()
    opt.synchronize()
    assert float(ref_opt.state[rp]["step"]) == 6.0  # what torch does
    assert_weights_close([p, q], [rp, rq])


# ------------------------------------------------------------------ torch.distributed.checkpoint
@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
def test_distributed_checkpoint_state_dict(ratio: float, placement: str) -> None:
    """get_optimizer_state_dict reads the state without stepping (it steps an optimizer whose opt.state is empty,
    with lr=0 and zero gradients, to initialise it); set_optimizer_state_dict round trips. No process group is
    needed in one process."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    data = batches(4)
    model = make_model()
    opt = tf(model.parameters(), ratio, placement)
    train(model, opt, data[:2])
    opt.zero_grad(set_to_none=True)
    before = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    osd = get_optimizer_state_dict(model, opt)
    names = names_of(model)
    assert sorted(osd["state"]) == sorted(names)
    for i, name in enumerate(names):
        assert float(osd["state"][name]["step"]) == 2.0, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(osd["state"][name][key].reshape(-1), before["state"][i][key].reshape(-1)), name
    after = opt.state_dict()
    assert [float(after["state"][i]["step"]) for i in range(len(names))] == [2.0] * len(names)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), f"{k} changed while reading the state dict"

    resumed = make_model(seed=3)
    resumed.load_state_dict(weights)
    opt2 = tf(resumed.parameters(), ratio, placement, lr=0.5)
    set_optimizer_state_dict(resumed, opt2, copy.deepcopy(osd))
    train(model, opt, data[2:])
    train(resumed, opt2, data[2:])
    assert_weights_close(resumed, model, rtol=0, atol=0)


# ------------------------------------------------------------------ attach(): frozen parameters, clipping
@pytest.mark.parametrize(("ratio", "placement"), [(1.0, "first"), (0.5, "first"), (0.5, "last")])
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_frozen_parameters_under_attach(device: str, dtype: torch.dtype, ratio: float, placement: str) -> None:
    """LoRA-like: most parameters requires_grad=False; opt over model.parameters() and attach(model)."""

    def frozen(model):
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(("3.", "4.")))
        return model

    ours = frozen(make_model(dtype=dtype, device=device))
    ref = frozen(twin(ours))
    opt = tf(ours.parameters(), ratio, placement)
    opt.attach(ours)
    ref_opt = MasterAdamW(ref.parameters())
    data = batches(3)
    train(ours, opt, data)
    train(ref, ref_opt, data)
    assert_masters_close(opt, ref_opt)
    assert torch.equal(ours[0].weight, make_model(dtype=dtype, device=device)[0].weight)
    assert not torch.equal(ours[4].weight, make_model(dtype=dtype, device=device)[4].weight), "nothing trained"


CLIP_SCALES = [1.0, 30.0, 3.0, 100.0, 10.0]  # gradient norms vary across steps, so clipping changes Adam's result


def _clip(model: torch.nn.Module, norms: list[float]) -> Callable[[int], None]:
    return lambda k: norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))


def _adamw_clipped(data, device: str = "cpu", dtype: torch.dtype = torch.float32) -> MasterAdamW:
    """AdamW (on fp32 masters for bf16) with clip_grad_norm_ after each backward."""
    ref = make_model(dtype=dtype, device=device)
    ref_opt = MasterAdamW(ref.parameters())
    norms: list[float] = []
    train(ref, ref_opt, data, after_backward=_clip(ref, norms))
    assert sum(n > 1.0 for n in norms) >= 3, norms  # clipping is active
    unclipped = make_model(dtype=dtype, device=device)
    unclipped_opt = MasterAdamW(unclipped.parameters())
    train(unclipped, unclipped_opt, data)
    with pytest.raises(AssertionError):  # and matters beyond the tolerance that the comparisons allow
        assert_masters_close(unclipped_opt, ref_opt)
    return ref_opt


@pytest.mark.parametrize(("ratio", "placement"), SPLITS, ids=SPLIT_IDS)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_clip_grad_norm_without_attach(device: str, dtype: torch.dtype, ratio: float, placement: str) -> None:
    data = batches(5, scales=CLIP_SCALES)
    ref_opt = _adamw_clipped(data, device, dtype)
    ours = make_model(dtype=dtype, device=device)
    opt = tf(ours.parameters(), ratio, placement)
    train(ours, opt, data, after_backward=_clip(ours, []))
    assert_masters_close(opt, ref_opt)


@pytest.mark.parametrize(("ratio", "placement"), CPU_SPLITS, ids=CPU_SPLIT_IDS)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_clip_grad_norm_with_attach_matches_or_refuses(
    device: str, dtype: torch.dtype, ratio: float, placement: str
) -> None:
    """torch.nn.utils.clip_grad_norm_ after backward under attach(): either AdamW's result, or a clear
    RuntimeError (naming clipping) at the first step() -- never a silently different result."""
    data = batches(5, scales=CLIP_SCALES)
    ref_opt = _adamw_clipped(data, device, dtype)
    ours = make_model(dtype=dtype, device=device)
    opt = tf(ours.parameters(), ratio, placement).attach(ours)
    for k, (x, y, scale) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss_of(ours, x, y, scale).backward()
        try:
            torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
            opt.step()
        except RuntimeError as e:
            assert k == 0, f"refused only at step {k}: earlier steps went through"
            assert "clip" in str(e).lower(), str(e)
            return
    opt.synchronize()
    assert_masters_close(opt, ref_opt, msg="clip_grad_norm_ under attach() silently differs from AdamW:")
