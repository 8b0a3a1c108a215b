"""weights_first=True: a step that waits for the norm writes the CPU share's new weights first (the kernel's
peek) and commits the state behind them; training is bit for bit the single pass's.

The commits are held back (the worker's gate) until something waits for them (a read of the state) or the
chunk's next kernel runs them itself. A wait left out lets a read or a kernel see the state before the step;
gradients landing in the set a held commit still reads would change what it commits; either way the run ends
away from the reference.
"""

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam
from twinflow.host.weights_first import WeightsFirstMode


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
        if self.pending.keys() & (self.pending.keys() if chunks is None else chunks):
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
    return Run(
        bits(model, opt),
        sum("commit" in e for e in host.timeline),
        sum(bool(e.get("peek")) for e in host.timeline),
        host.chunk_count,
        host.weights_first.late_steps,
    )


class Run(NamedTuple):
    bits: list[torch.Tensor]
    commits: int  # commits that ran
    peeks: int  # chunks stepped weights first
    chunks: int  # chunks per step
    late_steps: int  # steps whose chunks had to run their last commits themselves


def same(a: Run, b: Run) -> bool:
    return all(x.equal(y) for x, y in zip(a.bits, b.bits, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ratio", [0.5, 1.0])
@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
def test_weights_first_is_the_single_pass_bit_for_bit(dtype, ratio: float, attached: bool, clip: float) -> None:
    want = run(False, attached, clip, ratio, dtype)
    got = run(True, attached, clip, ratio, dtype, held=True)
    # Step 1 peeks every chunk; its commits are held, so step 2's kernels run them (late), and from step 3 on
    # fewer chunks go weights first, the rest the single pass. Every peek is committed by the end.
    assert want.commits == want.peeks == 0
    assert got.commits == got.peeks and 2 * got.chunks <= got.peeks < 4 * got.chunks and got.late_steps >= 1
    assert same(want, got)


@pytest.mark.parametrize("precision", ["int8", "int8_m24"])
@pytest.mark.parametrize("ratio", [0.5, 1.0])
@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
def test_compact_weights_first_is_the_single_pass_bit_for_bit(precision: str, ratio: float, attached: bool,
                                                               clip: float) -> None:  # fmt: skip
    """8-bit moments (and 24-bit masters): the peek rounds the weights as the single pass does, the commit
    encodes the moments with the same noise."""
    want = run(False, attached, clip, ratio, torch.bfloat16, state_precision=precision)
    got = run(True, attached, clip, ratio, torch.bfloat16, held=True, state_precision=precision)
    assert got.commits == got.peeks >= 2 * got.chunks > 0
    assert same(want, got)


@pytest.mark.parametrize("attached", [False, True])
def test_the_next_gradients_do_not_wait_for_the_commits(attached: bool) -> None:
    """A step's commits held: the next step's gradients land in the other buffer set without waiting (the
    main thread never waits for a commit), and that step's kernels run the held commits first."""
    model = make(torch.float32)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, max_grad_norm=1e-3, chunk_bytes=2048,
                       weights_first=True)  # fmt: skip
    ref_model = make(torch.float32)
    ref = TwinFlowAdam(ref_model.parameters(), lr=1e-2, ratio=0.5, max_grad_norm=1e-3, chunk_bytes=2048)
    if attached:
        opt.attach(model)
        ref.attach(ref_model)
    host = opt.coordinator.host
    asked = hold_commits(host)
    gen = torch.Generator().manual_seed(3)
    for k in range(3):
        x = torch.randn(8, 24, generator=gen)
        for m, o in ((model, opt), (ref_model, ref)):
            F.mse_loss(m(x), x[:, :6]).backward()
            if o is opt and k > 0 and attached:  # downloads queued during backward, the commits still held
                assert not asked and host.weights_first.pending
            o.step()
            o.zero_grad()
        assert not asked  # step() did not wait for a commit either: the kernels ran them
        asked.clear()
    opt.synchronize()
    ref.synchronize()
    assert host.weights_first.late_steps >= 1 and host.weights_first.commit_s > 0  # the commits were timed
    assert all(a.equal(b) for a, b in zip(bits(model, opt), bits(ref_model, ref), strict=True))


@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speculation_redoes_new_weights_first_bit_for_bit(clip: float, dtype: torch.dtype) -> None:
    """Attached speculation: a step that clips is redone with the peek (from the state the chunk started from)
    and committed behind it; one that does not clip keeps its speculative chunks (no commit)."""
    options = dict(speculate=True, steps=6)
    want = run(False, True, clip, 0.5, dtype, **options)
    exact = run(False, True, clip, 0.5, dtype, steps=6)
    timeline: list[dict] = []
    got = run(True, True, clip, 0.5, dtype, held=True, timeline=timeline, **options)
    assert same(want, got) and same(exact, got)
    verdicts = [e for e in timeline if "verdict" in e and e["verdict"]]
    assert verdicts and all(e["redo"] == (clip < 1) for e in verdicts)
    for n, e in enumerate(timeline):  # each chunk a verdict redid is committed after it
        if "verdict" in e and e["redo"]:
            assert set(e["verdict"]) <= {c["commit"] for c in timeline[n + 1 :] if "commit" in c}


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_delayed_steps_are_unchanged_by_weights_first(precision: str) -> None:
    """delay_after=2: two exact steps (weights first), then delayed ones (the single pass, off the critical
    path), bit for bit as without weights first; the delayed step opens only once the commits have ended."""
    options = dict(delay_after=2, state_precision=precision, steps=5)
    want = run(False, True, 1e-3, 0.5, torch.bfloat16, **options)
    got = run(True, True, 1e-3, 0.5, torch.bfloat16, held=True, **options)
    assert got.commits == got.peeks >= got.chunks > 0
    assert same(want, got)


def test_weights_first_stands_aside_where_it_cannot_help() -> None:
    """Eager steps (attached without clipping) step the CPU share during backward: the single pass."""
    assert run(True, True, None, 0.5, torch.bfloat16).peeks == 0
    got = run(True, True, None, 0.5, torch.bfloat16, state_precision="int8")
    assert got.peeks == 0 and got.chunks > 0
    model = make(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1.0, weights_first=False)
    assert opt.coordinator.mode(False).name == "exact"
    opt.weights_first = True
    assert opt.coordinator.mode(False).name == "weights_first"


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
    """The GPU's streams: weights go up from one buffer set while the next gradients come down into it."""
    want = run(False, attached, clip, 0.5, torch.bfloat16, device="cuda", state_precision=precision)
    got = run(True, attached, clip, 0.5, torch.bfloat16, held=True, device="cuda", state_precision=precision)
    assert got.commits == got.peeks >= 2 * got.chunks > 0
    assert same(want, got)


@pytest.mark.cuda
@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
def test_speculation_on_the_gpu_redoes_new_weights_first_bit_for_bit(clip: float) -> None:
    want = run(False, True, clip, 0.5, torch.bfloat16, device="cuda", speculate=True, steps=6)
    timeline: list[dict] = []
    got = run(True, True, clip, 0.5, torch.bfloat16, held=True, device="cuda", speculate=True, steps=6,
              timeline=timeline)  # fmt: skip
    assert any(e.get("verdict") and e["redo"] == (clip < 1) for e in timeline)
    assert same(want, got)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_delayed_steps_on_the_gpu_are_unchanged_by_weights_first(precision: str) -> None:
    options = dict(delay_after=2, state_precision=precision, steps=5, device="cuda")
    want = run(False, True, 1e-3, 0.5, torch.bfloat16, **options)
    got = run(True, True, 1e-3, 0.5, torch.bfloat16, held=True, **options)
    assert got.commits == got.peeks >= got.chunks > 0
    assert same(want, got)


def test_the_weights_first_share_follows_the_measured_commits() -> None:
    """The policy on given measurements: commits a kernel had to run itself take that many chunks and one more
    off the share; idle time after the commits of at least two commits' time adds one; less holds; no
    measurement adds one. At none the step is exact."""
    model = make(torch.float32)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1.0, chunk_bytes=1024, weights_first=True)
    policy, chunks = opt.coordinator.host.weights_first, opt.coordinator.host.chunk_count
    assert chunks >= 16 and opt.coordinator.mode(False).name == "weights_first" and policy.first_chunks == chunks

    def after(inline: int = 0, slack: float | None = None, cost: float | None = None) -> tuple[str, int]:
        policy.inline, policy.slack, policy.commit_s = inline, slack, cost
        return opt.coordinator.mode(False).name, policy.first_chunks

    assert after(inline=3) == ("weights_first", chunks - 4) and policy.late_steps == 1
    assert after(slack=0.010, cost=0.002) == ("weights_first", chunks - 3)  # room: one more
    assert after(slack=0.003, cost=0.002) == ("weights_first", chunks - 3)  # less than two commits: held
    assert after(slack=10.0, cost=0.002) == ("weights_first", chunks - 2)  # one at a time, whatever the room
    assert after(inline=chunks) == ("exact", 0) and policy.late_steps == 2
    assert after() == ("weights_first", 1)  # nothing measured: one more


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


class Branchy(torch.nn.Module):
    """A body and a branch that some steps skip: the branch's parameters (the last ones, whole chunks of the CPU
    share) then have no gradient, and their chunks do not step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(24, 96), torch.nn.GELU(), torch.nn.Linear(96, 6))
        self.branch = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.GELU(), torch.nn.Linear(64, 6))
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.branch(x) if self.use_branch else self.body(x)


def test_a_commit_left_by_a_step_without_that_chunk_ends_before_its_set_takes_gradients() -> None:
    """Step 1 peeks the branch's chunks (commits held); step 2 skips the branch, so nothing runs those commits;
    step 3's gradients land in the set they still read unless the step's open waits for them."""

    def go(first: bool) -> tuple[list[torch.Tensor], int]:
        model = Branchy()
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, placement="last", max_grad_norm=1e-3,
                           chunk_bytes=2048, weights_first=first).attach(model)  # fmt: skip
        host = opt.coordinator.host
        asked = hold_commits(host)
        gen = torch.Generator().manual_seed(4)
        for k in range(4):
            model.use_branch = k != 1
            x = torch.randn(8, 24, generator=gen)
            F.mse_loss(model(x), x[:, :6]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            asked.clear()
        opt.synchronize()
        return bits(model, opt), host.weights_first.late_steps

    want, _ = go(False)
    got, late = go(True)
    assert late >= 1
    assert all(a.equal(b) for a, b in zip(want, got, strict=True))
