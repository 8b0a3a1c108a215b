"""attach(): gradients streamed in backward, CPU steps overlapped, per-module waits in the next forward.

The overlapped path must give the losses of the plain path of TwinFlowAdam
(same seed, fp32 masters), with and without clipping, accumulation and
activation checkpointing, on the CPU (the "device" side on the CPU too, the
worker thread writing the model's weights) and on CUDA.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from twinflow import TwinFlowAdam
from twinflow.base.partition import Segment
from twinflow.host.staging import plan_chunks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    """Input projection, residual blocks, and an output projection tied to the input's weight."""

    def __init__(self, din: int = 12, dim: int = 32, depth: int = 4, ckpt: str = "none") -> None:
        super().__init__()
        self.inp = torch.nn.Linear(din, dim, bias=False)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(dim)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.ckpt == "none":
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        return F.linear(self.norm(h), self.inp.weight.t())  # tied: used again outside its module


def make(device: str, dtype: torch.dtype, ckpt: str = "none", seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(ckpt=ckpt).to(device=device, dtype=dtype)


def train(
    model: Net, opt: TwinFlowAdam, steps: int, seed: int, accumulate: int = 1, clip_method: bool = False
) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    device, dtype = model.inp.weight.device, model.inp.weight.dtype
    losses = []
    for _ in range(steps):
        total = 0.0
        for micro in range(accumulate):
            x = torch.randn(8, 12, generator=gen).to(device, dtype)
            y = torch.randn(8, 12, generator=gen).to(device, dtype)
            loss = F.mse_loss(model(x).float(), y.float()) / accumulate
            if micro + 1 < accumulate:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.item()
        if clip_method:
            opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    opt.synchronize()
    return losses


def pair(device, dtype, ratio, placement, ckpt="none", **kw) -> tuple[Net, TwinFlowAdam, Net, TwinFlowAdam]:
    plain, over = make(device, dtype, ckpt), make(device, dtype, ckpt)
    kw = dict(lr=3e-3, weight_decay=0.01, ratio=ratio, placement=placement, chunk_bytes=1024) | kw
    opt_plain = TwinFlowAdam(plain.parameters(), **kw)
    opt_over = TwinFlowAdam(over.parameters(), **kw).attach(over)
    return plain, opt_plain, over, opt_over


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, exact: bool) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(pa, pb), name
        else:
            torch.testing.assert_close(pa.float(), pb.float(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["first", "last"])
@pytest.mark.parametrize("ratio", [0.4, 1.0])
@pytest.mark.parametrize("ckpt", ["none", "reentrant", "non_reentrant"])
def test_eager_overlap_gives_the_plain_losses(device: str, ratio: float, placement: str, ckpt: str) -> None:
    """50 steps, fp32 masters (bf16 weights on CUDA): the same losses and weights, bit for bit."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    plain, opt_plain, over, opt_over = pair(device, dtype, ratio, placement, ckpt)
    assert opt_over.coordinator.notes.eager
    assert train(over, opt_over, 50, seed=1) == train(plain, opt_plain, 50, seed=1)
    assert_same_weights(over, plain, exact=True)
    assert opt_over.released_grad_bytes > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip_method", [False, True])
def test_clipped_overlap_matches_plain(device: str, clip_method: bool) -> None:
    """Clipping waits for the global norm (max_grad_norm, or clip_grad_norm_ once the CPU waits for it)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kw = {} if clip_method else {"max_grad_norm": 0.05}
    plain, opt_plain, over, opt_over = pair(device, dtype, 0.5, "last", **kw)
    if clip_method:  # the CPU must not step before the norm: eager off
        opt_over.detach()
        opt_over.attach(over, eager=False)
    assert not opt_over.coordinator.notes.eager
    losses_over = train(over, opt_over, 30, seed=2, clip_method=clip_method)
    losses_plain = train(plain, opt_plain, 30, seed=2, clip_method=clip_method)
    assert losses_over == pytest.approx(losses_plain, rel=1e-5)
    assert_same_weights(over, plain, exact=False)
    # the clip really acted: an unclipped run ends elsewhere
    free = make(device, dtype)
    train(free, TwinFlowAdam(free.parameters(), lr=3e-3, weight_decay=0.01, ratio=0.5), 30, seed=2)
    assert not torch.allclose(free.inp.weight.float(), over.inp.weight.float(), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulation_streams_only_the_closing_micro_step(device: str) -> None:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    plain, opt_plain, over, opt_over = pair(device, dtype, 0.6, "first")
    assert train(over, opt_over, 10, seed=3, accumulate=4) == train(plain, opt_plain, 10, seed=3, accumulate=4)
    assert_same_weights(over, plain, exact=True)


def test_forward_between_eager_backward_and_step_is_refused(lazy_cpu_side: None) -> None:
    # The CPU steps while backward runs; a forward before step() would read weights it is writing.
    model = make("cpu", torch.float32)
    opt = TwinFlowAdam(model.parameters(), ratio=1.0, chunk_bytes=1024).attach(model)
    x = torch.randn(4, 12)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"before step\(\).*no_sync.*eager=False"):
        model(x)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"before step\(\)"):
        model(x)
    opt.step()
    model(x).sum().backward()  # after step() the next step goes on as usual
    opt.step()


def test_second_backward_without_no_sync_is_refused() -> None:
    # Not eager: the forward between is allowed (the CPU waits for step()); the second gradient is refused.
    model = make("cpu", torch.float32)
    _opt = TwinFlowAdam(model.parameters(), ratio=1.0, chunk_bytes=1024).attach(model, eager=False)
    x = torch.randn(4, 12)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"twice in one step.*no_sync"):
        model(x).sum().backward()


def test_clip_after_eager_backward_is_refused_with_the_fix() -> None:
    model = make("cpu", torch.float32)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=1024).attach(model)
    model(torch.randn(4, 12)).sum().backward()
    with pytest.raises(RuntimeError, match="max_grad_norm="):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="eager=True cannot be combined"):
        TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1.0).attach(make("cpu", torch.float32), eager=True)


def test_released_gradients_are_gone_and_counted() -> None:
    model = make("cpu", torch.float32)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, placement="first", chunk_bytes=1024).attach(model)
    model(torch.randn(4, 12)).sum().backward()
    fully_cpu = opt.coordinator.split.fully_cpu
    params = list(model.parameters())
    assert fully_cpu and all(params[i].grad is None for i in fully_cpu)
    assert all(p.grad is not None for i, p in enumerate(params) if i not in fully_cpu)
    assert opt.released_grad_bytes == sum(params[i].numel() * 4 for i in fully_cpu)
    opt.step()
    opt.synchronize()


def test_plan_chunks_covers_every_element_once() -> None:
    gen = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, 300, (20,), generator=gen).tolist()
    segs = [Segment(i, 0, n, on_cpu=True) for i, n in enumerate(sizes)]
    itemsizes = [2 if i % 3 else 4 for i in range(len(sizes))]
    plans = plan_chunks(segs, itemsizes, 256)
    seen = {i: [] for i in range(len(sizes))}
    for plan in plans:
        end = 0
        for pos, a, b, offset in plan:
            assert offset >= end and offset % 64 == 0 and offset + (b - a) * itemsizes[pos] <= 256
            end = offset + (b - a) * itemsizes[pos]
            seen[pos].append((a, b))
    for i, n in enumerate(sizes):
        assert [x for r in seen[i] for x in r] == [0] + [x for r in seen[i][:-1] for x in (r[1], r[1])] + [n]


# ---------------------------------------------------------------- CUDA only
class Elementwise(torch.nn.Module):
    """Little arithmetic per byte: each layer scales and shifts a large vector, so forward outruns the CPU."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Scale(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Scale(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(width))
        self.b = torch.nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w + self.b


def race(ratio: float, placement: str) -> None:
    """Plain and overlapped runs of the same steps must see the same forward outputs and end equal.

    The overlapped run goes step after step with nothing in between, so its
    next forward is queued while the CPU is still stepping.
    """
    torch.manual_seed(5)
    reference = Elementwise(1 << 18, 8).cuda().bfloat16()
    outputs = {}
    for mode in ("plain", "overlapped"):
        model = Elementwise(1 << 18, 8).cuda().bfloat16()
        model.load_state_dict(reference.state_dict())
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio, placement=placement, chunk_bytes=64 << 10)
        if mode == "overlapped":
            opt.attach(model)
        gen = torch.Generator(device="cuda").manual_seed(6)
        seen = []
        for _ in range(6):
            x = torch.randn(2, 1 << 18, device="cuda", generator=gen).bfloat16()
            out = model(x)
            seen.append(out.float().clone())
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        outputs[mode] = (seen, [p.detach().clone() for p in model.parameters()])
    for step, (a, b) in enumerate(zip(outputs["plain"][0], outputs["overlapped"][0])):
        assert torch.equal(a, b), f"step {step}: the overlapped forward read other weights than the plain one"
    for a, b in zip(outputs["plain"][1], outputs["overlapped"][1]):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("placement", ["first", "last"])
def test_race_forward_waits_for_uploaded_weights(placement: str) -> None:
    race(0.75, placement)


@pytest.mark.cuda
def test_race_test_fails_without_the_forward_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from twinflow.optim import overlap

    monkeypatch.setattr(overlap.WaitFor, "__call__", lambda self, module, args: None)
    # Either the forward reads stale weights, or autograd sees a saved weight overwritten under it.
    with pytest.raises((AssertionError, RuntimeError), match="read other weights|modified by an inplace"):
        race(0.75, "first")


@pytest.mark.cuda
def test_released_gradients_lower_gpu_memory() -> None:
    torch.manual_seed(7)
    model = Elementwise(1 << 20, 8).cuda().bfloat16()
    opt = TwinFlowAdam(model.parameters(), ratio=1.0, chunk_bytes=1 << 20).attach(model)
    x = torch.randn(1, 1 << 20, device="cuda").bfloat16()
    model(x).float().sum().backward()
    torch.cuda.synchronize()
    # Every gradient but one goes: the witness stays so that an outside clip after backward is caught.
    kept = [p for p in model.parameters() if p.grad is not None]
    assert len(kept) == 1
    assert opt.released_grad_bytes == sum(p.numel() * 2 for p in model.parameters()) - kept[0].numel() * 2
    opt.step()
    opt.synchronize()


# ------------------------------------------------------- review findings
class Indirect(torch.nn.Module):
    """Parameters read without their owner's forward: MHA's out_proj, a ParameterList."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.scales = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(16))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0] * self.scales[0]


def test_parameters_read_without_their_owners_forward_are_waited_for(lazy_cpu_side: None) -> None:
    # the CPU side steps a chunk only when waited for: a parameter read without a wait reads its old value
    outputs = []
    for attach in (False, True):
        torch.manual_seed(0)
        model = Indirect()
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=1.0, chunk_bytes=256)
        if attach:
            opt.attach(model)
        gen, seen = torch.Generator().manual_seed(1), []
        for _ in range(4):
            out = model(torch.randn(2, 5, 16, generator=gen))
            seen.append(out.detach().clone())
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        outputs.append(seen)
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_skipped_step_does_not_leak_its_clipping_coefficient() -> None:
    """clip_grad_norm_, then zero_grad without a step: the next step clips by its own norm only."""
    results = []
    for skip_first in (False, True):
        model = make("cpu", torch.float32)
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, chunk_bytes=1024)
        gen = torch.Generator().manual_seed(3)
        if skip_first:
            model(100 * torch.randn(4, 12, generator=gen)).sum().backward()
            opt.clip_grad_norm_(1e-3)
            opt.zero_grad()
        else:
            torch.randn(4, 12, generator=gen)
        model(torch.randn(4, 12, generator=gen)).sum().backward()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_state_dict_between_backward_and_step_is_refused() -> None:
    model = make("cpu", torch.float32)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, chunk_bytes=1024).attach(model)
    model(torch.randn(4, 12)).sum().backward()
    with pytest.raises(RuntimeError, match="call step\\(\\) first"):
        opt.state_dict()
    opt.step()
    assert opt.state_dict()["state"]


def test_eager_step_uses_one_set_of_hyperparameters_for_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    """lr changed after an eager backward: both sides use the values read at backward (and say so)."""
    plain, opt_plain, over, opt_over = pair("cpu", torch.float32, 0.5, "last")
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(4))
    for model, opt in ((plain, opt_plain), (over, opt_over)):
        model(x).square().mean().backward()
        if opt is opt_over:
            for group in opt.param_groups:
                group["lr"] = 0.5  # too late: the CPU share may already be stepping
        with caplog.at_level("WARNING", logger="twinflow.optim.twin_flow_adam"):
            opt.step()
        opt.synchronize()
    assert "changed between backward and step()" in caplog.text
    assert_same_weights(over, plain, exact=True)


@pytest.mark.cuda
def test_in_place_gradient_writes_wait_for_pending_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """zero_grad(set_to_none=False) right after step(): the zeroing must not overtake a queued copy."""
    from twinflow.base import transfer

    original = transfer.Streams.after_compute

    def late_downloads(self):
        original(self)
        with torch.cuda.stream(self.d2h_stream):
            torch.cuda._sleep(3_000_000)  # every download starts late

    monkeypatch.setattr(transfer.Streams, "after_compute", late_downloads)
    results = []
    for attach in (False, True):
        torch.manual_seed(0)
        model = Net().cuda()
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, chunk_bytes=1024)
        if attach:
            opt.attach(model, release_grads=False)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            model(torch.randn(8, 12, device="cuda", generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        opt.synchronize()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
