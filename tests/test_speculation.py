"""speculate=True: under clipping the CPU steps as gradients land, and redoes the steps the norm clipped.

Against the same optimizer without speculation, bit for bit, whether or not
steps clip (a clipped step is rolled back from the kernel's backup of the
state and stepped again). ``drain`` lets the worker
finish every chunk that landed before ``step()`` gives the verdict, so each
test speculates on every chunk, whatever the timing.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.test_overlap import make
from twinflow import TwinFlowAdam

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def drain(opt: TwinFlowAdam) -> None:
    """Waits until the worker has run every chunk it may run before step() (under speculation: all that
    landed, stepped and held; without it, none)."""
    executor = opt.coordinator.host.executor
    with executor.condition:
        while executor.running is not None or any(job.kind == "chunk" for job in executor.queue):
            executor.condition.wait()


def train(model: torch.nn.Module, opt: TwinFlowAdam, steps: int, seed: int) -> None:
    """Steps with random batches; every landed chunk is stepped before step() gives the verdict."""
    device, dtype = model.inp.weight.device, model.inp.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=gen).to(device, dtype), torch.randn(8, 12, generator=gen).to(device, dtype)
        F.mse_loss(model(x).float(), y.float()).backward()
        drain(opt)
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def run(device: str, speculate: bool, max_norm: float, steps: int = 8, off_after: int | None = None,
        dtype: torch.dtype | None = None, betas: tuple[float, float] = (0.9, 0.999)):  # fmt: skip
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    model = make(device, dtype, seed=2)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, betas=betas, ratio=0.6, placement="last", chunk_bytes=1024,
                       max_grad_norm=max_norm, speculate=speculate).attach(model)  # fmt: skip
    if off_after is not None:
        opt.coordinator.speculation.off_after = off_after
    train(model, opt, steps, seed=7)
    return model, opt


@pytest.mark.parametrize("device", DEVICES)
def test_speculation_is_the_exact_step_bit_for_bit_when_nothing_clips(device: str) -> None:
    spec_model, spec = run(device, True, max_norm=1e9)
    model, opt = run(device, False, max_norm=1e9)
    host = spec.coordinator.host
    assert host.speculative.speculated_chunks == 8 * host.chunk_count and host.speculative.rollbacks == 0
    for p, q in zip(spec_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for a, b in zip(spec.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def assert_same_run(a: tuple[torch.nn.Module, TwinFlowAdam], b: tuple[torch.nn.Module, TwinFlowAdam]) -> None:
    """Weights, masters and moments bit for bit equal."""
    for p, q in zip(a[0].parameters(), b[0].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for x, y in zip(a[1].state_dict()["state"].values(), b[1].state_dict()["state"].values()):
        for key in x:
            torch.testing.assert_close(x[key], y[key], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_clipped_speculation_is_redone_bit_for_bit(device: str) -> None:
    spec = run(device, True, max_norm=0.05, off_after=10**9)  # clips every step, and speculates on each
    exact = run(device, False, max_norm=0.05)
    host = spec[1].coordinator.host
    assert host.speculative.rollbacks == 8 and host.speculative.speculated_chunks == 8 * host.chunk_count
    assert_same_run(spec, exact)
    unclipped, _ = run(device, False, max_norm=1e9)
    gap = max((p.float() - q.float()).abs().max() for p, q in zip(unclipped.parameters(), exact[0].parameters()))
    assert gap > 1e-3  # clipping changed the run: a redo that kept the speculative step would fail above


def test_speculation_stops_while_steps_clip_and_resumes_after() -> None:
    model, opt = run("cpu", True, max_norm=0.05, steps=6)  # every step clips
    host = opt.coordinator.host
    assert host.speculative.rollbacks == 2 and opt.coordinator.speculation.skipped == 4
    opt.max_grad_norm = 1e9  # clipping stops
    train(model, opt, 3, seed=8)
    # the first unclipped step runs exact (the last one clipped); then speculation is back
    assert opt.coordinator.speculation.skipped == 5 and host.speculative.speculated_chunks == 4 * host.chunk_count
    assert host.speculative.rollbacks == 2


@pytest.mark.parametrize("betas", [(0.0, 0.999), (0.9, 0.0)])
def test_clipped_speculation_with_a_zero_beta(betas: tuple[float, float]) -> None:
    assert_same_run(*(run("cpu", speculate, max_norm=0.05, steps=3, betas=betas) for speculate in (True, False)))


def test_clipped_speculation_when_the_decay_zeroes_the_master() -> None:
    # AdamW with lr * weight_decay = 1 multiplies the master by 0: a rollback that inverted the step could not
    # recover it; the backup can
    runs = []
    for speculate in (True, False):
        model = make("cpu", torch.float32, seed=2)
        opt = TwinFlowAdam(model.parameters(), lr=0.5, weight_decay=2.0, ratio=0.6, placement="last",
                           chunk_bytes=1024, max_grad_norm=0.05, speculate=speculate).attach(model)  # fmt: skip
        opt.coordinator.speculation.off_after = 10**9
        train(model, opt, 3, seed=7)
        runs.append((model, opt))
    assert runs[0][1].coordinator.host.speculative.rollbacks == 3
    assert_same_run(*runs)


def test_an_abandoned_step_does_not_count_as_clipped() -> None:
    model, opt = run("cpu", True, max_norm=0.05, steps=1)  # one clipped step
    F.mse_loss(model(torch.randn(8, 12)), torch.randn(8, 12)).backward()
    drain(opt)
    opt.zero_grad()  # abandoned: no multiplier is known for it
    F.mse_loss(model(torch.randn(8, 12)), torch.randn(8, 12)).backward()
    assert opt.coordinator.speculation.clipped_in_a_row == 1
    assert opt.coordinator.host.mode.name == "speculative"  # still speculating
    opt.step()


def test_zero_grad_before_step_undoes_the_speculative_updates() -> None:
    model, opt = run("cpu", True, max_norm=1e9, steps=2)
    before = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    F.mse_loss(model(torch.randn(8, 12)), torch.randn(8, 12)).backward()
    drain(opt)
    assert opt.coordinator.host.speculative.held  # stepped and held
    opt.zero_grad()
    after = opt.state_dict()["state"]
    for i, entry in before.items():
        for key, value in entry.items():
            torch.testing.assert_close(after[i][key], value, rtol=0, atol=0)
    x = torch.randn(8, 12)
    model(x)  # a forward before step() is fine: nothing speculative reached the weights


def test_state_read_between_speculative_steps_is_current() -> None:
    """A kept speculative step leaves the current state in the second set; every reader must see it, and a step
    after a read (which copies it back) must go on from it."""
    runs = []
    for speculate in (True, False):
        model = make("cpu", torch.float32, seed=2)
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, placement="last", chunk_bytes=1024,
                           max_grad_norm=1e9, speculate=speculate).attach(model)  # fmt: skip
        seen = []
        for seed in range(3):
            train_steps(model, opt, 1 + seed, seed)
            seen.append({i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()})
        train_steps(model, opt, 1, seed=10)  # no read after it: the state stays in the second set
        with torch.no_grad():  # weights written outside: the masters follow, moments stay
            model(torch.randn(8, 12))  # waits for the weights (synchronize() would also copy the state back)
            for p in model.parameters():
                p.mul_(0.5)
        train_steps(model, opt, 2, seed=11)
        opt.synchronize()  # the last step's weights may still be going up
        runs.append((model, opt, seen))
    assert runs[0][1].coordinator.host.speculative.speculated_chunks == 9 * runs[0][1].coordinator.host.chunk_count
    for a, b in zip(runs[0][2], runs[1][2]):
        for i in a:
            for key in a[i]:
                torch.testing.assert_close(a[i][key], b[i][key], rtol=0, atol=0)
    assert_same_run(runs[0][:2], runs[1][:2])


def train_steps(model: torch.nn.Module, opt: TwinFlowAdam, steps: int, seed: int) -> None:
    """`train` without its final synchronize()."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        F.mse_loss(model(torch.randn(8, 12, generator=gen)), torch.randn(8, 12, generator=gen)).backward()
        drain(opt)
        opt.step()
        opt.zero_grad()


@pytest.fixture
def lazy_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker applies the verdict on held chunks (keep or redo, then upload) only once the main thread waits
    for a chunk: a forward that read the weights without waiting would read the old ones on every run."""
    from twinflow.host.host_side import HostSide
    from twinflow.host.step_record import Phase

    original_open, original_wait = HostSide.open, HostSide.wait
    asked: dict[int, bool] = {}  # id(host) -> a chunk of the sealed step was waited for

    def open_(self, args=None, mode: str = "exact") -> None:
        original_open(self, args, mode)
        with self.executor.condition:
            key = id(self)
            asked[key] = False
            self.executor.gate = lambda job: job.kind != "verdict" or asked[key]

    def wait(self, chunk_ids: list[int]) -> None:
        if self.phase is Phase.SEALED and chunk_ids:
            with self.executor.condition:
                asked[id(self)] = True
                self.executor.condition.notify_all()
        original_wait(self, chunk_ids)

    monkeypatch.setattr(HostSide, "open", open_)
    monkeypatch.setattr(HostSide, "wait", wait)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_norm", [1e9, 0.05])
def test_the_next_forward_waits_for_the_verdicts_weights(device: str, max_norm: float, lazy_verdict: None) -> None:
    spec = run(device, True, max_norm=max_norm, off_after=10**9)
    exact = run(device, False, max_norm=max_norm)
    host = spec[1].coordinator.host
    assert host.speculative.speculated_chunks == 8 * host.chunk_count
    assert host.speculative.rollbacks == (0 if max_norm > 1 else 8)
    assert_same_run(spec, exact)


def test_a_worker_error_in_an_abandoned_speculative_step_is_raised_once_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """zero_grad() after a speculative chunk failed: the error is raised, the step is still abandoned (its
    speculative updates dropped), and the next iterations run as if it had been abandoned cleanly."""
    from twinflow.host.host_state import HostState

    runs = []
    for fail in (False, True):
        model = make("cpu", torch.float32, seed=2)
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, placement="last", chunk_bytes=1024,
                           max_grad_norm=1e9, speculate=True).attach(model)  # fmt: skip
        train_steps(model, opt, 1, seed=0)
        original = HostState.step

        def failing(self, *args, original=original, calls=[0], **kwargs):  # noqa: B006 (a counter of its own)
            calls[0] += 1
            if calls[0] == 1:
                raise ValueError("injected")
            return original(self, *args, **kwargs)

        if fail:
            monkeypatch.setattr(HostState, "step", failing)
        gen = torch.Generator().manual_seed(1)
        F.mse_loss(model(torch.randn(8, 12, generator=gen)), torch.randn(8, 12, generator=gen)).backward()
        drain(opt)
        if fail:
            with pytest.raises(RuntimeError, match="CPU worker failed"):
                opt.zero_grad()  # raises, and still abandons the step and clears the gradients
            assert all(p.grad is None for p in model.parameters())
            monkeypatch.setattr(HostState, "step", original)
        else:
            opt.zero_grad()
        train_steps(model, opt, 2, seed=3)
        opt.synchronize()
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)
