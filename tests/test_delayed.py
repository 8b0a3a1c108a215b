"""delay_after: the CPU share's update of step t reaches the weights at step t+1 (one step stale).

Checked against the delayed recurrence written out in float64: every master
steps with its own step's (clipped) gradient, as AdamW; the CPU share's
visible weights are the masters of one step earlier once ``delay_after``
exact steps have run, the device share's are the current masters. The
reference steps with the very fp32 gradients the optimizer was handed (a
float64 backward of its own would differ from them by the BLAS's summation
order, and Adam turns a near-zero gradient of the other sign into a full
step), so a gap is the optimizer's doing: rounding of fp32 against float64
arithmetic stays far below ``TOL`` while a missing, doubled or misplaced
update moves a weight by about ``LR``.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from tests.test_overlap import Net, make
from twinflow import TwinFlowAdam

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
LR, WD = 1e-2, 0.01
TOL = 2e-5  # fp32 against float64 Adam on the same gradients: a few ulps of weights near 1 (under 1e-6 seen)


def cpu_masks(opt: TwinFlowAdam) -> list[torch.Tensor]:
    """Per parameter, which of its elements the CPU steps."""
    masks = []
    split = opt.coordinator.split
    for i, p in enumerate(split.params):
        mask = torch.zeros(p.numel(), dtype=torch.bool)
        if split.host is not None and split.host.holds(i):
            start, end = split.host.range(i)
            mask[start:end] = True
        masks.append(mask.view(p.shape))
    return masks


class GradientTap:
    """Copies each parameter's final gradient as backward finishes it: what the optimizer is handed.

    Its hooks must be registered before ``attach()``'s, which run after them and may release the gradient.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.grads: dict[int, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._note, i))

    def _note(self, i: int, p: torch.Tensor) -> None:
        if p is self.params[i]:  # a deep copy of the model may carry the hook along
            self.grads[i] = p.grad.detach().to("cpu", torch.float64, copy=True)

    def take(self) -> list[torch.Tensor]:
        """The last backward's gradients, in parameter order; each is handed out once."""
        missing = [i for i in range(len(self.params)) if i not in self.grads]
        assert not missing, f"no gradient reached parameters {missing} in this backward"
        return [self.grads.pop(i) for i in range(len(self.params))]


class DelayedReference:
    """The delayed recurrence in float64 (delay_after=None: the exact one), stepped with given gradients."""

    def __init__(self, model: Net, masks: list[torch.Tensor], delay_after: int | None, max_norm: float | None):
        self.model = copy.deepcopy(model).to("cpu", torch.float64)
        self.masters = [p.detach().clone() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=LR, weight_decay=WD, foreach=False)
        self.masks, self.delay_after, self.max_norm = masks, delay_after, max_norm
        self.steps = 0

    def step(self, grads: list[torch.Tensor]) -> None:
        grads = [g.double() for g in grads]
        coef = 1.0
        if self.max_norm is not None:
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coef = min(1.0, self.max_norm / (float(total) + 1e-6))
        before = [m.clone() for m in self.masters]
        for m, g in zip(self.masters, grads):
            m.grad = g * coef
        self.opt.step()
        delayed = self.delay_after is not None and self.steps >= self.delay_after
        self.steps += 1
        with torch.no_grad():
            for p, m, old, mask in zip(self.model.parameters(), self.masters, before, self.masks):
                p.copy_(torch.where(mask, old, m) if delayed else m)

    def flush(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)


def batches(steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=gen), torch.randn(8, 12, generator=gen)) for _ in range(steps)]


def max_gap(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    return max((p.detach().double().cpu() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attached", [False, True], ids=["plain", "attached"])
@pytest.mark.parametrize("max_norm", [None, 0.05], ids=["unclipped", "clipped"])
@pytest.mark.parametrize(("ratio", "placement"), [(0.5, "first"), (0.5, "last"), (1.0, "first")])
def test_delayed_steps_follow_the_float64_recurrence(
    device: str, attached: bool, max_norm: float | None, ratio: float, placement: str, lazy_cpu_side: None
) -> None:
    # lazy_cpu_side: each late job runs only when the next step waits for it, after that step's gradients
    # have landed, so a late job that read the buffers the next downloads fill would fail every run.
    model = make(device, torch.float32, seed=1)
    tap = GradientTap(model)
    opt = TwinFlowAdam(model.parameters(), lr=LR, weight_decay=WD, ratio=ratio, placement=placement,
                       chunk_bytes=1024, max_grad_norm=max_norm, delay_after=2)  # fmt: skip
    if attached:
        opt.attach(model)
    masks = cpu_masks(opt)
    ref = DelayedReference(model, masks, delay_after=2, max_norm=max_norm)
    exact = DelayedReference(model, masks, delay_after=None, max_norm=max_norm)
    for x, y in batches(8, seed=3):
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        grads = tap.take()
        ref.step(grads)
        exact.step(grads)
        if attached:  # the weights as the next forward sees them
            opt.coordinator.wait(list(range(opt.coordinator.host.chunk_count)))
        assert max_gap(model, ref.model) < TOL
    assert max_gap(model, exact.model) > 1e-3  # the delay shows: the check above could fail
    assert opt.coordinator.host.delayed.late_jobs == 6
    opt.synchronize()  # applies the pending update: every weight is its master
    ref.flush()
    assert max_gap(model, ref.model) < TOL


def test_state_dict_applies_the_pending_update_and_resumes_exactly() -> None:
    model = make("cpu", torch.float32, seed=1)
    tap = GradientTap(model)
    opt = TwinFlowAdam(model.parameters(), lr=LR, ratio=0.5, chunk_bytes=1024, max_grad_norm=0.05, delay_after=1)
    ref = DelayedReference(model, cpu_masks(opt), delay_after=1, max_norm=0.05)
    data = batches(6, seed=4)
    for x, y in data[:3]:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ref.step(tap.take())
    opt.synchronize()  # as save_checkpoint does: the pending update goes into the weights
    saved = opt.state_dict()
    ref.flush()
    assert max_gap(model, ref.model) < TOL  # the pending update is in the weights
    resumed_model = copy.deepcopy(model)
    resumed = TwinFlowAdam(resumed_model.parameters(), lr=LR, ratio=0.5, chunk_bytes=1024, max_grad_norm=0.05,
                           delay_after=1)  # fmt: skip
    resumed.load_state_dict(saved)
    for x, y in data[3:]:
        for m, o in ((model, opt), (resumed_model, resumed)):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
        ref.step(tap.take())  # the original model's: the resumed one must match it bit for bit
    assert max_gap(model, ref.model) < TOL
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_weights_loaded_into_the_model_win_over_a_pending_update(lazy_cpu_side: None) -> None:
    model = make("cpu", torch.float32, seed=1)
    opt = TwinFlowAdam(model.parameters(), lr=LR, ratio=1.0, chunk_bytes=1024, delay_after=0)
    x, y = batches(1, seed=5)[0]
    F.mse_loss(model(x), y).backward()
    opt.step()  # its update is pending
    opt.zero_grad()
    loaded = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    F.mse_loss(model(x), y).backward()  # the step's first gradient refreshes the moved masters
    opt.step()  # uploads nothing: the pending update of the old weights was dropped
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), loaded[name], rtol=0, atol=0)


def test_reading_the_state_between_forward_and_backward_leaves_the_weights_alone() -> None:
    model = make("cpu", torch.float32, seed=1)
    opt = TwinFlowAdam(model.parameters(), lr=LR, ratio=1.0, chunk_bytes=1024, delay_after=0).attach(model)
    for i, (x, y) in enumerate(batches(3, seed=8)):
        loss = F.mse_loss(model(x), y)
        assert len(opt.state) == (len(list(model.parameters())) if i else 0)  # waits for the kernel, uploads nothing
        opt.state_dict()
        loss.backward()  # an upload here would have changed weights this backward saved
        opt.step()
        opt.zero_grad()
    assert opt.coordinator.host.late_pending


def test_weights_changed_keeps_the_new_weights_over_a_pending_update() -> None:
    model = make("cpu", torch.float32, seed=1)
    opt = TwinFlowAdam(model.parameters(), lr=LR, ratio=0.5, chunk_bytes=1024, delay_after=0)
    for x, y in batches(2, seed=9):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for p in model.parameters():
        p.data.fill_(0.5)
    opt.weights_changed()
    opt.synchronize()
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    assert all(bool((e["master"] == 0.5).all()) for e in opt.state_dict()["state"].values() if "master" in e)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_delay_after_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"delay_after={bad!r}.*int >= 0"):
        TwinFlowAdam(make("cpu", torch.float32).parameters(), delay_after=bad)


def test_eager_attach_is_refused_with_a_delay() -> None:
    model = make("cpu", torch.float32)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, delay_after=0)
    with pytest.raises(ValueError, match="eager=True cannot be combined with max_grad_norm, delay_after"):
        opt.attach(model, eager=True)
    assert opt.attach(model).coordinator.notes.eager is False  # the default under a delay


def test_auto_ratio_plans_for_the_delay() -> None:
    model = make("cpu", torch.float32)
    opt = TwinFlowAdam(model.parameters(), ratio="auto", chunk_bytes=1024, max_grad_norm=1.0, delay_after=1)
    opt.attach(model)
    for x, y in batches(3, seed=6):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert opt.auto_decision["delayed"] is True and opt.auto_decision["eager"] is False
