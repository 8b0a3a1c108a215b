"""speculate=True: under clipping the CPU steps as gradients land, and redoes the steps the norm clipped.

Against the same optimizer without speculation: bit for bit where no step
clips; where every step clips, within what undoing from the kept gradient
can give back (not round-off: twinflow.speculation says why). ``drain`` lets the worker
finish every chunk that landed before ``step()`` gives the verdict, so each
test speculates on every chunk, whatever the timing.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.test_overlap import make
from twinflow import TwinFlowAdam, ops
from twinflow.speculation import undo_adam_

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def drain(opt: TwinFlowAdam) -> None:
    """Waits until the worker has run every chunk it may run before step() (under speculation: all that
    landed, stepped and held; without it, none)."""
    pipeline = opt._split.pipeline
    with pipeline._cond:
        while pipeline._running is not None or (pipeline._ready and pipeline._args is not None):
            pipeline._cond.wait()


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
        opt._speculation.off_after = off_after
    train(model, opt, steps, seed=7)
    return model, opt


@pytest.mark.parametrize("device", DEVICES)
def test_speculation_is_the_exact_step_bit_for_bit_when_nothing_clips(device: str) -> None:
    spec_model, spec = run(device, True, max_norm=1e9)
    model, opt = run(device, False, max_norm=1e9)
    pipeline = spec._split.pipeline
    assert pipeline.speculated_chunks == 8 * len(pipeline.chunks) and pipeline.rollbacks == 0
    for p, q in zip(spec_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for a, b in zip(spec.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_clipped_speculation_is_redone_close_to_the_exact_step(device: str) -> None:
    # fp32 on both devices: in a bf16 model a master a few ulp off can flip a weight's rounding, and from there
    # the two runs part as any two bf16 runs with other round-off do (7e-4 after these 8 steps on an H200)
    spec_model, spec = run(device, True, max_norm=0.05, off_after=10**9, dtype=torch.float32)  # clips every step
    model, _ = run(device, False, max_norm=0.05, dtype=torch.float32)
    pipeline = spec._split.pipeline
    assert pipeline.rollbacks == 8 and pipeline.speculated_chunks == 8 * len(pipeline.chunks)
    for p, q in zip(spec_model.parameters(), model.parameters()):
        # Not round-off: a moment comes back to an ulp of its speculative value, which with multipliers of
        # 0.01-0.05 (norms of 1-5 clipped to 0.05) is 1/c^2 ulp of the redone one (twinflow.speculation).
        # Measured on the CPU: 4.5e-6 after 8 steps at lr 1e-2, against 1e-3 and more that clipping moves.
        torch.testing.assert_close(p, q, rtol=0, atol=2e-5)
    unclipped, _ = run(device, False, max_norm=1e9, dtype=torch.float32)
    gap = max((p.float() - q.float()).abs().max() for p, q in zip(unclipped.parameters(), model.parameters()))
    assert gap > 1e-3  # clipping changed the run: a redo that kept the speculative step would fail above


def test_speculation_stops_while_steps_clip_and_resumes_after() -> None:
    model, opt = run("cpu", True, max_norm=0.05, steps=6)  # every step clips
    pipeline = opt._split.pipeline
    assert pipeline.rollbacks == 2 and opt._speculation.skipped == 4
    opt.max_grad_norm = 1e9  # clipping stops
    train(model, opt, 3, seed=8)
    # the first unclipped step runs exact (the last one clipped); then speculation is back
    assert opt._speculation.skipped == 5 and pipeline.speculated_chunks == 4 * len(pipeline.chunks)
    assert pipeline.rollbacks == 2


@pytest.mark.parametrize("betas", [(0.0, 0.999), (0.9, 0.0)])
def test_speculation_undoes_a_zero_beta(betas: tuple[float, float]) -> None:
    # A zero beta keeps nothing of the old moment: the undo cannot divide by it
    models = [run("cpu", speculate, max_norm=0.05, steps=3, betas=betas)[0] for speculate in (True, False)]
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.isfinite(p).all()  # the undo divided by the zero beta: NaN
        if betas[1] != 0.0:  # with beta2 = 0 an update divides by |g| + eps: round-off is amplified without bound
            torch.testing.assert_close(p, q, rtol=0, atol=1e-4)  # the redo bound of the test above, over 3 steps


def test_an_abandoned_step_does_not_count_as_clipped() -> None:
    model, opt = run("cpu", True, max_norm=0.05, steps=1)  # one clipped step
    F.mse_loss(model(torch.randn(8, 12)), torch.randn(8, 12)).backward()
    drain(opt)
    opt.zero_grad()  # abandoned: no multiplier is known for it
    F.mse_loss(model(torch.randn(8, 12)), torch.randn(8, 12)).backward()
    assert opt._speculation.clipped_in_a_row == 1 and opt._split.pipeline._spec  # still speculating
    opt.step()


def test_zero_grad_before_step_undoes_the_speculative_updates() -> None:
    model, opt = run("cpu", True, max_norm=1e9, steps=2)
    before = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    F.mse_loss(model(torch.randn(8, 12)), torch.randn(8, 12)).backward()
    drain(opt)
    assert opt._split.pipeline._spec_held  # stepped and held
    opt.zero_grad()
    after = opt.state_dict()["state"]
    for i, entry in before.items():
        for key, value in entry.items():
            torch.testing.assert_close(after[i][key], value, rtol=1e-5, atol=1e-7)
    x = torch.randn(8, 12)
    model(x)  # a forward before step() is fine: nothing speculative reached the weights


def test_undo_recovers_the_state_to_about_an_ulp_of_the_new_terms() -> None:
    torch.manual_seed(0)
    for adamw in (True, False):
        n = 4096
        p, m, v, g = torch.randn(n), torch.randn(n) * 0.01, torch.rand(n) * 1e-4, torch.randn(n).bfloat16()
        p0, m0, v0 = p.clone(), m.clone(), v.clone()
        group = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=adamw,
                     bias_correction=True)  # fmt: skip
        ops.adam_step_([p], [g], [m], [v], [5], **{k: v for k, v in group.items()})
        m_new, v_new = m.clone(), v.clone()
        undo_adam_(p, m, v, g, 5, group)
        ulp = torch.finfo(torch.float32).eps
        assert ((p - p0).abs() <= 4 * ulp * p0.abs() + 1e-12).all()
        gf = g.float() + (0.0 if adamw else 0.01 * p0)
        # about an ulp of the largest term of the new moment (the new value, or the gradient's part)
        assert ((m - m0).abs() <= 4 * ulp * (m_new.abs() + 0.1 * gf.abs()) / 0.9).all()
        assert ((v - v0).abs() <= 4 * ulp * (v_new.abs() + 1e-3 * gf * gf) / 0.999).all()
        assert not torch.equal(m, m_new)  # it did undo
