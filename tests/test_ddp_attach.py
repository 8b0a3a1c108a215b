"""attach() on several processes: the CPU share streams once reduced, under DDP (its averaged buckets, from a
communication hook) and FSDP2 (its reduce-scattered shards, from the post-accumulate-grad hooks FSDP2 runs).

Two ranks on the CPU (gloo), each with half of every batch, against one
process with the whole batch and torch.optim.AdamW (clipped by
clip_grad_norm_ where TwinFlowAdam clips with max_grad_norm). A single-rank
group in this process runs the race test: the CPU side steps a chunk only
once the next forward waits for it (``lazy_cpu_side``), so a module that
does not wait reads its old weights and the run ends away from AdamW.
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.test_speculation import drain
from twinflow import TwinFlowAdam

LR, WD, STEPS = 3e-3, 0.01, 6


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 48), torch.nn.GELU(), torch.nn.Linear(48, 24), torch.nn.GELU(),
                               torch.nn.Linear(24, 10))  # fmt: skip


def batches(seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 10, generator=gen), 3 * torch.randn(4, 10, generator=gen)) for _ in range(STEPS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(clip: float | None) -> list[torch.Tensor]:
    """One process, the whole batch: AdamW, clipped over the whole model as TwinFlowAdam's max_grad_norm."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for x, y in batches():
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """The user's own distributed model: DDP (small buckets: several), or FSDP2 on each Linear and the root."""
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _worker(
    rank: int, port: int, how: str, ratio: float, placement: str, clip: float | None, out: str,
    delay: int | None = None, speculate: bool = False,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = make_model()
        net = wrap(model, how)
        opt = TwinFlowAdam(model.parameters(), lr=LR, weight_decay=WD, ratio=ratio, placement=placement,
                           max_grad_norm=clip, chunk_bytes=512, delay_after=delay,
                           speculate=speculate).attach(net)  # fmt: skip
        assert opt.attached and opt.split_summary["chunks"] > 1
        for x, y in batches():
            F.mse_loss(net(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
            # the CPU share went down during backward, once reduced, not at step()
            assert opt.coordinator.split.step_open and opt.coordinator.notes.streamed
            # FSDP2's reduced shards of wholly CPU-stepped parameters are handed back; DDP's buckets hold them all
            assert (opt.released_grad_bytes > 0) == (how == "fsdp2")
            if speculate:
                drain(opt)  # every landed chunk is stepped before the norm is known
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        if speculate:  # steps were taken before the norm was known, and checked against it
            assert opt.coordinator.host.speculative.speculated_chunks > 0
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
        torch.save([p.detach().clone() for p in whole], os.path.join(out, f"rank{rank}.pt"))
        torch.distributed.barrier()  # both ranks done before either tears gloo down (a lone exit can abort)
    finally:
        torch.distributed.destroy_process_group()
    # Done and saved. Interpreter shutdown can still abort in gloo's teardown ("terminate called without an
    # active exception", now and then on a 2-core machine), so leave without it.
    os._exit(0)


@pytest.mark.parametrize("clip", [1.0, None], ids=["clip1", "eager"])
@pytest.mark.parametrize(("ratio", "placement"), [(0.4, "first"), (0.4, "last"), (1.0, "first")])
@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_two_ranks_attached_match_one_process(tmp_path, how: str, ratio: float, placement: str, clip) -> None:
    mp.spawn(_worker, args=(free_port(), how, ratio, placement, clip, str(tmp_path)), nprocs=2, join=True)
    want = reference(clip)
    moved = [w - p for w, p in zip(want, make_model().parameters())]
    assert all(m.abs().max() > 1e-3 for m in moved)  # the run trains: a step left out would show
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def one_process_delayed(clip: float, ratio: float, placement: str, delay: int) -> list[torch.Tensor]:
    """One process, the whole batch, TwinFlowAdam with the same delay (its recurrence: tests/test_delayed.py)."""
    model = make_model()
    opt = TwinFlowAdam(model.parameters(), lr=LR, weight_decay=WD, ratio=ratio, placement=placement,
                       max_grad_norm=clip, chunk_bytes=512, delay_after=delay)  # fmt: skip
    for x, y in batches():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", [1.0, 1e9], ids=["clipping", "unclipped"])
@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_two_ranks_speculative_match_one_process(tmp_path, how: str, clip: float) -> None:
    args = (free_port(), how, 0.6, "last", clip, str(tmp_path), None, True)
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    want = reference(clip)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


# Which elements are delayed must match: DDP splits whole parameters as one process does, while FSDP2 splits
# each rank's shards (at ratio 0.6 another set of elements); at ratio 1 every element is delayed everywhere.
@pytest.mark.parametrize(("how", "ratio"), [("ddp", 0.6), ("fsdp2", 1.0)])
def test_two_ranks_delayed_match_one_process_delayed(tmp_path, how: str, ratio: float) -> None:
    placement, clip, delay = "last", 0.5, 1
    mp.spawn(_worker, args=(free_port(), how, ratio, placement, clip, str(tmp_path), delay), nprocs=2, join=True)
    want = one_process_delayed(clip, ratio, placement, delay)
    exact = reference(clip)
    assert max((w - e).abs().max() for w, e in zip(want, exact)) > 5e-4  # the delay shows, beyond the tolerance
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def single_rank_group(request: pytest.FixtureRequest) -> str:
    """A one-process group in this process (gloo on the CPU, NCCL on one GPU); yields the device."""
    backend = "nccl" if request.param == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                         world_size=1)  # fmt: skip
    yield request.param
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("placement", ["first", "last"])
@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_attached_forward_waits_for_its_weights(single_rank_group, lazy_cpu_side, how: str, placement: str) -> None:
    device = single_rank_group
    model = make_model().to(device)
    ref = copy.deepcopy(model)
    ddp = wrap(model, how)
    opt = TwinFlowAdam(model.parameters(), lr=LR, weight_decay=WD, ratio=0.6, placement=placement,
                       chunk_bytes=1024).attach(ddp)  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for x, y in batches():
        for net, o in ((ddp, opt), (ref, ref_opt)):
            F.mse_loss(net(x.to(device)), y.to(device)).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_attach_under_several_processes_needs_the_ddp_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    opt = TwinFlowAdam(make_model().parameters(), ratio=0.5)
    with pytest.raises(RuntimeError, match="DistributedDataParallel model itself.*fully_shard"):
        opt.attach(make_model())


def test_unused_parameter_search_is_refused_under_attach(single_rank_group) -> None:
    """With find_unused_parameters=True DDP reduces zeros for unused parameters; attached, they would be stepped."""
    model = make_model().to(single_rank_group)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = TwinFlowAdam(model.parameters(), lr=LR, ratio=1.0)
    with pytest.raises(ValueError, match="find_unused_parameters=True"):
        opt.attach(ddp)
    assert not opt.attached


def test_static_graph_is_refused_under_attach(single_rank_group) -> None:
    model = make_model().to(single_rank_group)
    ddp = torch.nn.parallel.DistributedDataParallel(model, static_graph=True)
    with pytest.raises(ValueError, match="static_graph=True"):
        TwinFlowAdam(model.parameters(), lr=LR, ratio=1.0).attach(ddp)


@pytest.mark.parametrize("max_norm", [1e-3, float("inf")], ids=["clips", "times-one"])
@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_outside_clip_is_refused_or_exact(single_rank_group, how: str, max_norm: float) -> None:
    """clip_grad_norm_ after backward (its foreach multiply leaves DTensor versions alone): a clip is refused;
    a multiplication by one (max_norm=inf, Hugging Face Trainer's logged norm) changes nothing and steps."""
    model = make_model().to(single_rank_group)
    net = wrap(model, how)
    opt = TwinFlowAdam(model.parameters(), lr=LR, ratio=0.4, placement="last", max_grad_norm=1.0).attach(net)
    x, y = (t.to(single_rank_group) for t in batches()[0])
    (100 * F.mse_loss(net(x), y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if max_norm < float("inf"):
        with pytest.raises(RuntimeError, match="changed after backward"):
            opt.step()
    else:
        opt.step()
        opt.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("placement", ["first", "last"])
def test_fsdp2_post_optim_event_still_waits_for_the_cpu_share(lazy_cpu_side, placement: str) -> None:
    """With set_post_optim_event FSDP2's all-gathers wait on the user's event instead of the current stream:
    the CPU share's uploads must still come before them."""
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                         world_size=1)  # fmt: skip
    try:
        model = make_model().to("cuda")
        ref = copy.deepcopy(model)
        net = wrap(model, "fsdp2")
        opt = TwinFlowAdam(model.parameters(), lr=LR, weight_decay=WD, ratio=0.6, placement=placement,
                           chunk_bytes=1024).attach(net)  # fmt: skip
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
        for x, y in batches():
            x, y = x.cuda(), y.cuda()
            F.mse_loss(net(x), y).backward()
            opt.step()
            net.set_post_optim_event(torch.cuda.current_stream().record_event())  # as FSDP2's docs suggest
            opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        opt.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    finally:
        torch.distributed.destroy_process_group()


def test_the_clipping_norm_does_not_depend_on_the_order_gradients_arrive_in() -> None:
    """Under DDP the buckets' reductions may finish in either order: the total norm must come out the same, to
    the bit, whatever the order the streamed gradients' norms were noted in."""
    from twinflow.step.step_scale import StepScale

    gen = torch.Generator().manual_seed(3)
    sizes, spreads = torch.randint(1, 500, (64,), generator=gen), torch.rand(64, generator=gen) * 100
    grads = [torch.randn(int(n), generator=gen) * float(s) for n, s in zip(sizes, spreads)]
    noted, totals = [], []
    for order in (range(64), reversed(range(64))):
        scale = StepScale(torch.device("cpu"), None)
        for i in order:
            scale.add_norm(i, grads[i])
        noted.append(scale.norms([], 2.0, streamed=True))  # what the total is reduced from, in its order
        totals.append(scale.clip(1.0, 2.0, [], streamed=True))
    assert all(a.equal(b) for a, b in zip(*noted, strict=True))  # the parameters' order both times
    assert noted[0][0].equal(torch.linalg.vector_norm(grads[0]))
    assert totals[0].equal(totals[1])
