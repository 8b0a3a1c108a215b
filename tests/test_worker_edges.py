"""The CPU worker's edges around weights first: reads between backward and step(), a failing commit, a
speculative step right after a delayed one, and waiting on a stopped worker."""

import copy

import pytest
import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam
from twinflow.checkpoint import save_portable
from twinflow.host.executor import CpuExecutor


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 96), torch.nn.GELU(), torch.nn.Linear(96, 6)).to(torch.bfloat16)


def backward(model: torch.nn.Module, gen: torch.Generator) -> None:
    x = torch.randn(8, 24, generator=gen).bfloat16()
    F.mse_loss(model(x).float(), x[:, :6].float()).backward()


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_saving_or_copying_between_backward_and_step_is_refused_and_writes_nothing(tmp_path, precision) -> None:
    """Weights first's commits of the last step, and eager kernels, may still write the state then: a save or
    a deepcopy would catch it half written."""
    model = make()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1e-3, chunk_bytes=2048, weights_first=True,
                       state_precision=precision).attach(model, eager=False)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    backward(model, gen)
    opt.step()
    opt.zero_grad()
    backward(model, gen)  # the next step is open
    with pytest.raises(RuntimeError, match="middle of a step"):
        save_portable(tmp_path, "t", model=model, optimizer=opt)
    assert not any(tmp_path.iterdir())  # nothing written, not even a folder
    with pytest.raises(RuntimeError, match="middle of a step"):
        copy.deepcopy(opt)
    opt.step()
    save_portable(tmp_path, "t", model=model, optimizer=opt)  # after step(): fine
    assert (tmp_path / "t").exists()


def test_a_failing_commit_is_raised_by_the_next_read_of_the_state() -> None:
    model = make()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1e-3, chunk_bytes=2048, weights_first=True)
    host = opt.coordinator.host
    kernel = host.kernel

    def failing(*args, **kwargs):  # the commits (no weight copies) fail
        if kwargs.get("outs", ...) is None:
            raise OSError("commit failed")
        return kernel(*args, **kwargs)

    host.kernel = failing
    backward(model, torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="CPU worker failed") as info:  # at step()'s wait, or at the read
        opt.step()
        opt.state_dict()
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.filterwarnings("ignore:speculate=True has no effect here")
def test_no_speculation_while_a_delayed_update_is_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    """delay_after=1, then the delay switched off: the step right after a delayed one does not speculate (its
    weights would go into the set the late update's weights still wait in), and the run equals the exact one
    switched the same way. A speculative step's verdict is sealed only once the worker has run the step's chunks:
    they then always speculate (a worker that fell behind on a loaded machine ran them with the verdict known, and
    nothing speculated)."""
    from twinflow.host.host_modes import SpeculativeMode

    original_seal = SpeculativeMode.seal

    def seal(self, args, scale):  # noqa: ANN001, ANN202
        executor = self.host.executor
        with executor.condition:
            executor.wait_until(lambda: executor.running is None and all(j.kind != "chunk" for j in executor.queue))
        return original_seal(self, args, scale)

    monkeypatch.setattr(SpeculativeMode, "seal", seal)

    def go(speculate: bool) -> tuple[list[torch.Tensor], int]:
        model = make()
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, max_grad_norm=1e-3, chunk_bytes=2048,
                           delay_after=1, speculate=speculate).attach(model)  # fmt: skip
        opt.coordinator.speculation.off_after = 10**9
        gen = torch.Generator().manual_seed(3)
        for k in range(6):
            if k == 3:
                opt.delay_after = None
            backward(model, gen)
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        out = [p.detach().view(torch.int16).clone() for p in model.parameters()]
        out += [v.view(torch.int32).clone() for e in opt.state_dict()["state"].values() for v in e.values()
                if v.dtype == torch.float32]  # fmt: skip
        return out, opt.coordinator.host.speculative.speculated_chunks

    want, _ = go(False)
    got, speculated = go(True)
    assert speculated > 0  # the later steps speculated
    assert all(a.equal(b) for a, b in zip(want, got, strict=True))


def test_waiting_on_a_stopped_worker_raises_instead_of_hanging() -> None:
    executor = CpuExecutor(torch.device("cpu"))
    executor.close()
    with executor.condition, pytest.raises(RuntimeError, match="stopped"):
        executor.wait_until(lambda: False)
