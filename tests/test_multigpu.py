"""Several processes against one: every ZeRO stage, offload ratio and state precision trains as one process does
on the whole batch; ``offload_states()`` / ``reload_states()`` under FSDP2 and a checkpoint's resume change
nothing.

One harness, two backends:

- ``nccl``: one GPU a rank, a bf16 model; every stage (0: DDP, 1: ZeRO-1, 2 and 3: FSDP2) x ratio (0, 0.5, 1)
  x state precision (fp32, int8_m24), on 2 ranks and on min(4, GPUs) ranks. Marked ``multigpu`` (skipped below
  two GPUs): ``pytest -m multigpu tests/test_multigpu.py``.
- ``gloo``: the CPU, an fp32 model, 2 ranks, a subset (stages 0 and 3, ratio 0.5, both precisions): a normal
  CPU test.

Each (backend, world size) spawns its ranks once: the worker runs every plan of the matrix, one engine after
another in one process group, and rank 0 saves what each plan saw. The tests compare that with one process (the
test's own) over the same samples: rank r takes rows [r B/N, (r + 1) B/N) of each global micro-batch of B rows.
Every run clips (``gradient_clipping: 1.0``, and the first step's norm is well above it) and keeps the engine's
own choice of attaching the optimizer (all stages but 1).
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import twinflow

IN, OUT = 12, 8
ROWS = 8  # a global micro-batch: divides among 2 and 4 ranks
ACCUM, STEPS = 2, 6  # micro-batches an optimizer step; optimizer steps a run
SAVE_AT = 3  # resumed plans save after this optimizer step and resume from there
OFFLOAD_AFTER = (1, 3)  # offload plans move everything out and back after these steps ...
OFFLOAD_BETWEEN = 2  # ... and the state and the reduced gradients between this step's backward and step()
LR, CLIP = 1e-2, 1.0
PRECISIONS = ("fp32", "int8_m24")


@dataclass(frozen=True)
class Backend:
    """Where the ranks run and how closely they must follow one process (`loss_rtol`: per state precision)."""

    name: str  # torch.distributed's backend
    device: str
    bf16: bool
    width: int  # of the hidden layers: not a multiple of the ranks, so FSDP2's shards are uneven
    depth: int
    stages: tuple[int, ...]
    ratios: tuple[float, ...]
    first_rtol: float  # the losses before any update: the same forward over slices of the same rows
    loss_rtol: dict[str, float]
    update_rtol: dict[str, float]  # |final weights - one process's| / |one process's - initial weights|
    weight_tol: tuple[float, float] | None  # (rtol, atol) of each final weight where the state is fp32

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


# Tolerances, each a few times what was measured (in brackets: the largest seen over the matrix, on 4 H100s for
# NCCL) and far below what a wrong step gives: an optimizer that did nothing misses 100% of the update, and its
# last losses are 25-30% (NCCL) and 50-90% (gloo) above the trained ones; the tests check that margin too.
# - gloo, fp32 state: only the order of the gradient sums differs: test_engine.py's 1e-5 (losses [1e-7], final
#   weights [2e-7 of the update]).
# - NCCL, fp32 state: the ranks reduce bf16 gradients (DDP's buckets, FSDP2's reduce-scatter) in another order
#   than one process sums the whole batch, a few bf16 ulps of each gradient, which Adam's normalisation turns into
#   noise in the updates: test_engine_cuda.py's 2e-2 on the losses [1.1e-2], 10% of the update [2.5%]. Before any
#   update only the forward's order differs: 1e-3 [1.7e-4].
# - int8_m24 is not bit-identical across world sizes under FSDP2: a rank's 8-bit blocks (256 elements, one scale
#   each) and the stochastic rounding's noise (a hash of the element's index in the tensor stepped) start at its
#   shard's first element, so each moment is rounded differently, by up to a code step (3 mantissa bits), noise
#   that is unbiased per element and averages out over a loss. (DDP and ZeRO-1 step whole tensors: one process's
#   blocks.) gloo: 5e-3 on the losses [1.2e-3, as far as int8_m24 moves them from the fp32 state's run], 15% of
#   the update [2.7%]; NCCL, where the bf16 noise above comes on top: 3e-2 [1.25e-2] and 15% [4.9%].
GLOO = Backend("gloo", "cpu", False, width=61, depth=2, stages=(0, 3), ratios=(0.5,), first_rtol=1e-6,
               loss_rtol={"fp32": 1e-5, "int8_m24": 5e-3}, update_rtol={"fp32": 1e-5, "int8_m24": 0.15},
               weight_tol=(1e-5, 1e-6))  # fmt: skip
NCCL = Backend("nccl", "cuda", True, width=301, depth=3, stages=(0, 1, 2, 3), ratios=(0.0, 0.5, 1.0),
               first_rtol=1e-3, loss_rtol={"fp32": 2e-2, "int8_m24": 3e-2},
               update_rtol={"fp32": 0.1, "int8_m24": 0.15}, weight_tol=None)  # fmt: skip
BACKENDS = {b.name: b for b in (GLOO, NCCL)}
GPUS = torch.cuda.device_count()
# NCCL: 2 ranks and min(4, GPUs); below two GPUs the ids of a 4-GPU machine (collected, and skipped)
WORLDS = {"gloo": (2,), "nccl": tuple(sorted({2, min(4, GPUS)})) if GPUS >= 2 else (2, 4)}


@dataclass(frozen=True)
class Plan:
    """One training run of the worker: a configuration, and what happens in the middle of it."""

    stage: int
    ratio: float
    precision: str
    offload: bool = False  # offload_states()/reload_states() at OFFLOAD_AFTER and OFFLOAD_BETWEEN
    resume: bool = False  # save after step SAVE_AT; a fresh engine loads it and trains the rest again

    @property
    def name(self) -> str:
        return f"stage{self.stage}-ratio{self.ratio}-{self.precision}" + ("-offload" if self.offload else "")


def plans(backend: Backend) -> list[Plan]:
    """The matrix (each at ratio 0.5 also resumed from a checkpoint), and stage 3 again with offloads."""
    grid = [(s, r, p) for s in backend.stages for r in backend.ratios for p in PRECISIONS]
    return [Plan(s, r, p, resume=r == 0.5) for s, r, p in grid] + [
        Plan(3, r, p, offload=True) for r in backend.ratios for p in PRECISIONS
    ]


def config(backend: Backend, world: int, stage: int, ratio: float, precision: str, lr: float = LR) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS // world,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": backend.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": ratio}},
        "offload_state_precision": precision,
    }


class Net(torch.nn.Module):
    """Residual blocks (FSDP2 shards each one) between an input and an output layer: few operations a weight."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width)) for _ in range(depth)
        )
        self.out = torch.nn.Linear(width, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + F.gelu(block(h))
        return self.out(h)


def make_model(backend: Backend, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # made on the CPU: the same weights in every process, whatever the device
    return Net(backend.width, backend.depth).to(backend.device)


def batches(rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ACCUM x STEPS micro-batches of a task to learn (a fixed random map); this rank's rows of each."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(IN, OUT, generator=gen)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    out = []
    for _ in range(ACCUM * STEPS):
        x = torch.randn(ROWS, IN, generator=gen)
        out.append((x[rows], 3 * torch.tanh(x @ teacher)[rows]))  # large enough a gradient that clipping acts
    return out


def train(engine, backend: Backend, data, before_step=None, after_step=None) -> tuple[list, list]:  # noqa: ANN001
    """Each micro-batch's loss (tensors) and each step's clipped norm (None where the engine clipped: ZeRO-1).
    `before_step(k)` runs between the backward that closes step k (from 1) and ``step()``, `after_step(k)` after."""
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        loss = F.mse_loss(engine(x.to(backend.device, backend.dtype)).float(), y.to(backend.device))
        engine.backward(loss)
        boundary = (i + 1) % ACCUM == 0
        if boundary and before_step is not None:
            before_step(engine.global_steps + 1)
        engine.step()
        losses.append(loss.detach())
        if boundary:
            norm = engine.local_optimizer.last_grad_norm
            norms.append(None if norm is None else norm.detach().float().clone())
            if after_step is not None:
                after_step(engine.global_steps)
    return losses, norms


def whole_weights(engine) -> list[torch.Tensor]:  # noqa: ANN001
    """Every parameter whole (FSDP2's DTensors gathered: every rank takes part), as float32 on the CPU."""
    engine.local_optimizer.synchronize()  # attached: the last CPU step may still be writing its weights
    with torch.no_grad():
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in engine.module.parameters()]
        return [w.detach().float().cpu().clone() for w in whole]  # copies, also of float32 weights on the CPU


# ------------------------------------------------------------------------------------------ one process


@functools.cache
def one_process(backend_name: str, ratio: float, precision: str, lr: float = LR) -> dict:
    """The reference: one process, the whole batch (micro-batch ROWS), the same samples and configuration."""
    backend = BACKENDS[backend_name]
    engine, *_ = twinflow.initialize(model=make_model(backend), config=config(backend, 1, 0, ratio, precision, lr))
    initial = whole_weights(engine)  # as the engine holds them (bf16: rounded)
    losses, norms = train(engine, backend, batches())
    return {"losses": torch.stack(losses).float().cpu(), "norms": torch.stack(norms).cpu(),
            "weights": whole_weights(engine), "initial": initial}  # fmt: skip


# ------------------------------------------------------------------------------------------ the ranks


def run_plan(plan: Plan, backend: Backend, rank: int, world: int, out: Path) -> dict:
    """One plan on this rank; every rank returns the same (reduced) figures."""
    cfg = config(backend, world, plan.stage, plan.ratio, plan.precision)
    engine, *_ = twinflow.initialize(model=make_model(backend), config=cfg)
    data = batches(rank, world)
    ckpt, moved, saved = out / f"ckpt-{plan.name}", [], []

    def before(k: int) -> None:
        if plan.offload and k == OFFLOAD_BETWEEN:  # the state and the reduced gradients; the weights must stay
            moved.append(engine.offload_states(include=["optim_states", "lp_grads"]))
            engine.reload_states()

    def after(k: int) -> None:
        if plan.offload and k in OFFLOAD_AFTER:  # everything: the state, the gradients, this rank's shards
            moved.append(engine.offload_states())
            engine.reload_states()
        if plan.resume and k == SAVE_AT:
            engine.save_checkpoint(ckpt)
            saved.extend(whole_weights(engine) + state_tensors(engine))

    losses, norms = train(engine, backend, data, before, after)
    result = {
        "losses": mean_over_ranks(losses, world),
        "norms": None if norms[0] is None else torch.stack(norms).cpu(),
        "weights": whole_weights(engine),
        "attached": engine.local_optimizer.attached,
        "moved": moved,
        "elements": split_elements(engine, rank, world),
    }
    if plan.resume:
        fresh, *_ = twinflow.initialize(model=make_model(backend, seed=7), config=cfg)
        fresh.load_checkpoint(ckpt)
        result["resumed_from"] = fresh.global_steps
        loaded = whole_weights(fresh) + state_tensors(fresh)
        same = len(loaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(loaded, saved))
        result["loaded_exactly"] = every_rank(same, next(fresh.module.parameters()).device)
        result["resumed"] = mean_over_ranks(train(fresh, backend, data[SAVE_AT * ACCUM :])[0], world)
    return result


def mean_over_ranks(losses: list[torch.Tensor], world: int) -> torch.Tensor:
    """Each micro-batch's loss over the whole batch: the mean of the ranks' (equal-sized) slices' losses, summed
    in rank order (an all-reduce of more than two ranks may sum in an order that depends on the tensor's size)."""
    mine = torch.stack(losses).float()
    every = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(every, mine)
    return (torch.stack(every).sum(0) / world).cpu()


def state_tensors(engine) -> list[torch.Tensor]:  # noqa: ANN001
    """This rank's optimizer state (its share under ZeRO-1, its shards' under FSDP2) as torch.optim gives it."""
    state = engine.local_optimizer.state_dict()["state"]
    return [torch.as_tensor(state[i][k]).detach().cpu().clone() for i in sorted(state) for k in sorted(state[i])]


def every_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on every rank."""
    t = torch.tensor([int(flag)], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def split_elements(engine, rank: int, world: int) -> torch.Tensor:  # noqa: ANN001
    """(CPU-stepped, device-stepped) elements of each rank's optimizer, [world, 2]."""
    summary = engine.local_optimizer.split_summary
    device = next(engine.module.parameters()).device
    counts = torch.zeros(world, 2, dtype=torch.int64, device=device)
    counts[rank] = torch.tensor([summary["cpu"]["elements"], summary["device"]["elements"]])
    torch.distributed.all_reduce(counts)
    return counts.cpu()


def _worker(rank: int, backend_name: str, world: int, port: int, todo: list[Plan], out: str) -> None:
    backend = BACKENDS[backend_name]
    if backend.name == "nccl":
        torch.cuda.set_device(rank)  # before the group: NCCL's communicator binds this rank's GPU
    else:
        torch.set_num_threads(1)
    torch.distributed.init_process_group(
        backend.name, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(minutes=5),  # a rank stuck in a collective fails the run instead of hanging it
    )  # fmt: skip
    try:
        results = {plan.name: run_plan(plan, backend, rank, world, Path(out)) for plan in todo}
        if rank == 0:
            torch.save(results, os.path.join(out, "results.pt"))
        # every rank done before any tears the group down (a lone exit can abort the others)
        torch.distributed.barrier(device_ids=[rank] if backend.name == "nccl" else None)
    finally:
        torch.distributed.destroy_process_group()
    # Done and saved. Interpreter shutdown can still abort in gloo's teardown now and then (as in test_engine.py),
    # so leave without it.
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """`ranks(backend, world)`: every plan's figures from one spawn of `world` ranks (spawned once a module)."""
    done: dict[tuple[str, int], dict | BaseException] = {}

    def get(backend_name: str, world: int) -> dict:
        key = (backend_name, world)
        if key not in done:
            out = tmp_path_factory.mktemp(f"{backend_name}{world}")
            try:
                todo = plans(BACKENDS[backend_name])
                mp.spawn(_worker, args=(backend_name, world, free_port(), todo, str(out)), nprocs=world, join=True)
                done[key] = torch.load(out / "results.pt", weights_only=True)
            except Exception as exc:  # noqa: BLE001 (every test of this spawn reports it; none spawns again)
                done[key] = exc
        if isinstance(done[key], BaseException):
            raise RuntimeError(f"the {world} {backend_name} ranks failed") from done[key]
        return done[key]

    return get


# ------------------------------------------------------------------------------------------ the tests


def cases(with_ratio: bool, stages: tuple[int, ...] | None = None) -> list:
    """pytest params (backend, world, stage[, ratio], precision) over every backend's matrix."""
    out = []
    for backend in BACKENDS.values():
        marks = [pytest.mark.multigpu] if backend.name == "nccl" else []
        for world in WORLDS[backend.name]:
            for stage in stages or backend.stages:
                for ratio in backend.ratios if with_ratio else (0.5,):
                    for precision in PRECISIONS:
                        values = (backend.name, world, stage) + ((ratio,) if with_ratio else ()) + (precision,)
                        ident = f"{backend.name}{world}-stage{stage}" + (f"-ratio{ratio}" if with_ratio else "")
                        out.append(pytest.param(*values, marks=marks, id=f"{ident}-{precision}"))
    return out


@pytest.mark.parametrize(("backend_name", "world", "stage", "ratio", "precision"), cases(with_ratio=True))
def test_ranks_train_as_one_process(ranks, backend_name: str, world: int, stage: int, ratio: float,
                                    precision: str) -> None:  # fmt: skip
    backend = BACKENDS[backend_name]
    got = ranks(backend_name, world)[Plan(stage, ratio, precision).name]
    ref = one_process(backend_name, ratio, precision)
    frozen = one_process(backend_name, 0.5, "fp32", lr=0.0)  # the same batches, the weights never moving
    rtol = backend.loss_rtol[precision]
    moved = torch.cat([(w - w0).flatten() for w, w0 in zip(ref["weights"], ref["initial"], strict=True)]).norm()
    off = torch.cat([(g - w).flatten() for g, w in zip(got["weights"], ref["weights"], strict=True)]).norm()
    rel = (got["losses"] - ref["losses"]).abs() / ref["losses"]
    print(f"\n{backend_name}{world} stage {stage} ratio {ratio} {precision}: losses off by {rel[:ACCUM].max():.2e} "
          f"before any update, {rel.max():.2e} at most; weights off by {off / moved:.2e} of the update"
          f"\n one process {ref['losses'].tolist()}\n {world} ranks     {got['losses'].tolist()}")  # fmt: skip

    # the engine's own choices: attached but under ZeRO-1; the ratio split each rank's share
    assert got["attached"] == (stage != 1)
    cpu, dev = got["elements"].sum(0).tolist()
    assert (cpu > 0, dev > 0) == (ratio > 0, ratio < 1), got["elements"]
    assert ratio - 0.1 <= cpu / (cpu + dev) <= ratio + 0.1, got["elements"]

    # the comparison can fail: the reference learns, clips, and ends far from the frozen model's losses
    assert ref["norms"][0] > 2 * CLIP
    assert (ref["losses"][-ACCUM:] < 0.9 * frozen["losses"][-ACCUM:]).all(), (ref["losses"], frozen["losses"])
    assert (got["losses"][-ACCUM:] < 0.9 * frozen["losses"][-ACCUM:]).all(), (got["losses"], frozen["losses"])
    far = (frozen["losses"][-ACCUM:] - ref["losses"][-ACCUM:]) / ref["losses"][-ACCUM:]
    assert (far > 5 * rtol).all(), far  # a run that did not train fails the comparison below by far

    # before any update: the same forward over the same rows
    torch.testing.assert_close(got["losses"][:ACCUM], ref["losses"][:ACCUM], rtol=backend.first_rtol, atol=0)
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=rtol, atol=0)
    if got["norms"] is not None:  # one norm over every rank's shards (ZeRO-1: the engine clipped, not reported)
        torch.testing.assert_close(got["norms"], ref["norms"], rtol=rtol, atol=0)

    # the final weights: how far from one process's, against how far one process's moved
    assert off <= backend.update_rtol[precision] * moved, (float(off), float(moved))
    if backend.weight_tol is not None and precision == "fp32":
        rtol, atol = backend.weight_tol
        for a, b in zip(got["weights"], ref["weights"], strict=True):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("backend_name", "world", "stage", "ratio", "precision"),
                         cases(with_ratio=True, stages=(3,)))  # fmt: skip
def test_offload_and_reload_between_steps_under_fsdp2_change_nothing(
    ranks, backend_name: str, world: int, stage: int, ratio: float, precision: str
) -> None:
    runs = ranks(backend_name, world)
    plain, cycled = runs[Plan(stage, ratio, precision).name], runs[Plan(stage, ratio, precision, offload=True).name]
    assert len(cycled["moved"]) == len(OFFLOAD_AFTER) + 1 and min(cycled["moved"]) > 0, cycled["moved"]
    assert torch.equal(cycled["losses"], plain["losses"]), (cycled["losses"], plain["losses"])
    assert all(torch.equal(a, b) for a, b in zip(cycled["weights"], plain["weights"], strict=True))


@pytest.mark.parametrize(("backend_name", "world", "stage", "precision"), cases(with_ratio=False))
def test_a_checkpoint_saved_by_the_ranks_resumes_on_as_many(
    ranks, backend_name: str, world: int, stage: int, precision: str
) -> None:
    """A fresh engine (other initial weights) loads what the ranks saved after step SAVE_AT: every rank's weights
    and optimizer state bit for bit, and the rest of the run gives the uninterrupted run's losses.

    Exactly, except where DDP (stages 0 and 1) averages over more than two ranks: a fresh DDP's first backward
    reduces its gradients in buckets laid out by parameter order, and DDP rebuilds them in the order gradients
    became ready after a model's first backward, so the resumed run's first step sums each gradient in another
    order than the uninterrupted run's fourth (with two ranks a + b is the same either way). There the losses
    before that step are still exact, and the later ones follow within the summation noise."""
    backend = BACKENDS[backend_name]
    got = ranks(backend_name, world)[Plan(stage, 0.5, precision).name]
    assert got["resumed_from"] == SAVE_AT and got["loaded_exactly"]
    tail = got["losses"][SAVE_AT * ACCUM :]
    assert len(got["resumed"]) == len(tail) > ACCUM
    if stage <= 1 and world > 2:
        assert torch.equal(got["resumed"][:ACCUM], tail[:ACCUM]), (got["resumed"], tail)
        torch.testing.assert_close(got["resumed"], tail, rtol=backend.loss_rtol[precision], atol=0)
    else:
        assert torch.equal(got["resumed"], tail), (got["resumed"], tail)
