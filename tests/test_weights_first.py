"""weights_first=True: a step that waits for the norm writes the CPU share's new weights first (the kernel's
peek) and commits the state behind them; training is bit for bit the single pass's.

The commits are held back (the worker's gate) until something waits for them: a read of the state, or the
next step's gradient for the same chunk. A wait left out lets a read see the state before the step, or the next
gradients overwrite the ones a commit still needs, and the run ends away from the reference.
"""

import pytest
import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam
from twinflow.host_modes import WeightsFirstMode


def make(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 96), torch.nn.GELU(), torch.nn.Linear(96, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, 6)).to(dtype)  # fmt: skip


def bits(model: torch.nn.Module, opt: TwinFlowAdam) -> list[torch.Tensor]:
    out = [p.detach().flatten().view(torch.uint8).cpu().clone() for p in model.parameters()]
    for entry in opt.state_dict()["state"].values():
        out += [entry[k].view(torch.int32).cpu().clone() for k in ("exp_avg", "exp_avg_sq", "master") if k in entry]
    return out


def hold_commits(host: object) -> list[bool]:
    """From now on a commit runs only once the main thread waits for commits (the returned list is not empty
    then; clear it to hold the next ones)."""
    asked: list[bool] = []
    wait = WeightsFirstMode.wait

    def waiting(self: WeightsFirstMode, chunks: set[int] | None = None) -> None:
        if self.pending & (self.pending if chunks is None else chunks):
            asked.append(True)
            self.host.executor.condition.notify_all()
        wait(self, chunks)

    host.weights_first.wait = waiting.__get__(host.weights_first)
    host.executor.gate = lambda job: job.kind != "commit" or bool(asked)
    return asked


def run(
    first: bool,
    attached: bool,
    clip: float | None,
    ratio: float,
    dtype: torch.dtype,
    held: bool = False,
    device: str = "cpu",
    steps: int = 4,
    timeline: list | None = None,
    **options,
):  # noqa: ANN201
    """`options`: more of TwinFlowAdam's arguments (state_precision, speculate, delay_after); `timeline`: gets
    the pipeline's."""
    model = make(dtype).to(device)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio, placement="last", max_grad_norm=clip,
                       chunk_bytes=2048, weights_first=first, **options)  # fmt: skip
    if attached:
        opt.attach(model)
    host = opt.coordinator.host
    speculating = options.get("speculate", False)
    if speculating:  # on every step, clipped or not
        opt.coordinator.speculation.off_after = 10**9
    host.timeline = [] if timeline is None else timeline
    asked = hold_commits(host) if held else []
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 24, generator=gen).to(device, dtype)
        F.mse_loss(model(x).float(), x[:, :6].float()).backward()
        if speculating:  # every landed chunk stepped (and held) before the verdict
            with host.executor.condition:
                host.executor.wait_until(lambda: host.executor.running is None
                                         and not any(job.kind == "chunk" for job in host.executor.queue))  # fmt: skip
        opt.step()
        opt.zero_grad()
        asked.clear()  # each step's commits held again
    opt.synchronize()
    commits = sum("commit" in e for e in host.timeline)
    return bits(model, opt), commits, host.chunk_count, host.weights_first.fallbacks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ratio", [0.5, 1.0])
@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
def test_weights_first_is_the_single_pass_bit_for_bit(dtype, ratio: float, attached: bool, clip: float) -> None:
    want, none, _, _ = run(False, attached, clip, ratio, dtype)
    got, commits, chunks, fallbacks = run(True, attached, clip, ratio, dtype, held=True)
    # steps 1 and 2 go weights first, every chunk committed behind its weights; step 2's gradients wait for step
    # 1's held commits, so steps 3 and 4 run the single pass (and step 3's gradients wait for step 2's commits)
    assert none == 0 and commits == 2 * chunks > 0 and fallbacks == 2
    assert all(a.equal(b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("precision", ["int8", "int8_m24"])
@pytest.mark.parametrize("ratio", [0.5, 1.0])
@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
def test_compact_weights_first_is_the_single_pass_bit_for_bit(precision: str, ratio: float, attached: bool,
                                                               clip: float) -> None:  # fmt: skip
    """8-bit moments (and 24-bit masters): the peek rounds the weights as the single pass does, the commit
    encodes the moments with the same noise."""
    want, none, _, _ = run(False, attached, clip, ratio, torch.bfloat16, state_precision=precision)
    got, commits, chunks, fallbacks = run(True, attached, clip, ratio, torch.bfloat16, held=True,
                                          state_precision=precision)  # fmt: skip
    assert none == 0 and commits == 2 * chunks > 0 and fallbacks == 2
    assert all(a.equal(b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speculation_redoes_new_weights_first_bit_for_bit(clip: float, dtype: torch.dtype) -> None:
    """Attached speculation: a step that clips is redone with the peek (from the state the chunk started from)
    and committed out of place behind it; one that does not clip keeps its speculative chunks (no commit)."""
    options = dict(speculate=True, steps=6)
    want, _, _, _ = run(False, True, clip, 0.5, dtype, **options)
    exact, _, _, _ = run(False, True, clip, 0.5, dtype, steps=6)
    timeline: list[dict] = []
    got, _, _, _ = run(True, True, clip, 0.5, dtype, held=True, timeline=timeline, **options)
    assert all(a.equal(b) for a, b in zip(want, got, strict=True))
    assert all(a.equal(b) for a, b in zip(exact, got, strict=True))
    verdicts = [e for e in timeline if "verdict" in e and e["verdict"]]
    assert verdicts and all(e["redo"] == (clip < 1) for e in verdicts)
    # each chunk a verdict redid is committed (after that verdict); kept ones are not
    for n, e in enumerate(timeline):
        if "verdict" in e and e["redo"]:
            later = {c["commit"] for c in timeline[n + 1 :] if "commit" in c}
            assert set(e["verdict"]) <= later
    if clip > 1:  # chunks stepped after the verdict go weights first too, so only the redo is checked above
        assert not any(e.get("redo") for e in timeline)


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_delayed_steps_are_unchanged_by_weights_first(precision: str) -> None:
    """delay_after=2: two exact steps (weights first), then delayed ones (the single pass, off the critical
    path), bit for bit as without weights first; the delayed step opens only once the commits have ended."""
    options = dict(delay_after=2, state_precision=precision, steps=5)
    want, _, _, _ = run(False, True, 1e-3, 0.5, torch.bfloat16, **options)
    got, commits, chunks, _ = run(True, True, 1e-3, 0.5, torch.bfloat16, held=True, **options)
    assert commits == 2 * chunks > 0
    assert all(a.equal(b) for a, b in zip(want, got, strict=True))


def test_weights_first_stands_aside_where_it_cannot_help() -> None:
    """Eager steps (attached without clipping) step the CPU share during backward: the single pass."""
    _, commits, _, _ = run(True, True, None, 0.5, torch.bfloat16)
    assert commits == 0
    _, commits, chunks, _ = run(True, True, None, 0.5, torch.bfloat16, state_precision="int8")
    assert commits == 0 and chunks > 0
    model = make(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1.0, weights_first=False)
    assert opt.coordinator.mode(False) == "exact"
    opt.weights_first = True
    assert opt.coordinator.mode(False) == "weights_first"


def test_the_config_key_reaches_the_optimizer() -> None:
    import twinflow

    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "offload_ratio": 0.5,
              "offload_weights_first": True}  # fmt: skip
    engine, opt, *_ = twinflow.initialize(model=make(torch.bfloat16), config=config)
    assert engine.local_optimizer.weights_first is True


@pytest.mark.cuda
@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_weights_first_on_the_gpu_is_the_single_pass_bit_for_bit(attached: bool, clip: float, precision: str) -> None:
    """The GPU's streams: weights go up from the second buffer set, gradients come down into the first."""
    want, _, _, _ = run(False, attached, clip, 0.5, torch.bfloat16, device="cuda", state_precision=precision)
    got, commits, chunks, fallbacks = run(True, attached, clip, 0.5, torch.bfloat16, held=True, device="cuda",
                                          state_precision=precision)  # fmt: skip
    assert commits == 2 * chunks > 0 and fallbacks == 2
    assert all(a.equal(b) for a, b in zip(want, got, strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
def test_speculation_on_the_gpu_redoes_new_weights_first_bit_for_bit(clip: float) -> None:
    want, _, _, _ = run(False, True, clip, 0.5, torch.bfloat16, device="cuda", speculate=True, steps=6)
    timeline: list[dict] = []
    got, _, _, _ = run(True, True, clip, 0.5, torch.bfloat16, held=True, device="cuda", speculate=True, steps=6,
                       timeline=timeline)  # fmt: skip
    assert any(e.get("verdict") and e["redo"] == (clip < 1) for e in timeline)
    assert all(a.equal(b) for a, b in zip(want, got, strict=True))


def test_after_a_stall_the_single_pass_runs_for_a_while_then_weights_first_again() -> None:
    """A gradient that waits for a commit means the commits do not keep up: the next RETRY steps run the single
    pass, then weights first is tried again."""
    model = make(torch.float32)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1.0, weights_first=True)
    policy = opt.coordinator.host.weights_first
    assert opt.coordinator.mode(False) == "weights_first"
    policy.stalled = True
    modes = [opt.coordinator.mode(False) for _ in range(WeightsFirstMode.RETRY + 1)]
    assert (
        modes == ["exact"] * WeightsFirstMode.RETRY + ["weights_first"] and policy.fallbacks == WeightsFirstMode.RETRY
    )


@pytest.mark.parametrize("attached", [False, True])
def test_weights_written_from_outside_win_over_a_commit_still_pending(attached: bool) -> None:
    """A step's commits held; the user then writes weights (weights_changed()): the next step takes its masters
    from those weights, as the single pass does, and no late commit writes over them."""

    def go(first: bool) -> list[torch.Tensor]:
        model = make(torch.float32)
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, max_grad_norm=1e-3, chunk_bytes=2048,
                           weights_first=first)  # fmt: skip
        if attached:
            opt.attach(model)
        asked = hold_commits(opt.coordinator.host)
        gen = torch.Generator().manual_seed(1)
        for k in range(3):
            x = torch.randn(8, 24, generator=gen)
            F.mse_loss(model(x), x[:, :6]).backward()
            opt.step()
            opt.zero_grad()
            asked.clear()
            if k == 0:
                if attached:  # the weights are back before they are overwritten (this also ends the commits)
                    opt.synchronize()
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
                opt.weights_changed()
        opt.synchronize()
        return bits(model, opt)

    assert all(a.equal(b) for a, b in zip(go(False), go(True), strict=True))
