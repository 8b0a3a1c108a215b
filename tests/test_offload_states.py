"""TwinFlowAdam.offload_states() / reload_states(): the device share's state, the gradients and the weights leave
for one reused host buffer and come back into the same tensors; training resumes bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam


def make(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 300), torch.nn.GELU(), torch.nn.Linear(300, 5)).to(torch.bfloat16)


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 33, generator=gen)
    return x.to(torch.bfloat16), x[:, :5] * 0.5


def bits(model: torch.nn.Module, opt: TwinFlowAdam) -> list[torch.Tensor]:
    out = [p.detach().view(torch.int16).clone() for p in model.parameters()]
    for entry in opt.state_dict()["state"].values():
        out += [entry[k].view(torch.int32).clone() for k in ("exp_avg", "exp_avg_sq", "master")]
    return out


def run(ratio: float, precision: str, attached: bool, cycle: bool, weights: bool, delay: bool = False):  # noqa: ANN201
    model = make()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio, state_precision=precision, max_grad_norm=1.0,
                       delay_after=0 if delay else None)  # fmt: skip
    if attached:
        opt.attach(model)
    gen, moved = torch.Generator().manual_seed(1), []
    for k in range(5):
        x, y = batch(gen)
        F.mse_loss(model(x).float(), y).backward()
        if cycle and not attached and k == 2:  # gradients present: they move too
            moved.append(opt.offload_states(weights=weights))
            opt.reload_states()
        opt.step()
        opt.zero_grad()
        if cycle and k in (1, 3):
            moved.append(opt.offload_states(weights=weights))
            assert opt.offload.offloaded == (moved[-1] > 0)
            opt.reload_states()
        elif k in (1, 3):
            opt.synchronize()  # what an offload does first: a pending delayed update lands
    opt.synchronize()
    return model, opt, moved


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("attached", [False, True])
def test_training_resumes_bit_for_bit_across_cycles(precision: str, ratio: float, attached: bool) -> None:
    straight_model, straight_opt, _ = run(ratio, precision, attached, cycle=False, weights=False)
    for weights in (False, True):
        model, opt, moved = run(ratio, precision, attached, cycle=True, weights=weights)
        assert all(a.equal(b) for a, b in zip(bits(straight_model, straight_opt), bits(model, opt), strict=True))
        if ratio < 1.0 or weights:
            assert min(moved) > 0
        assert opt.offload.allocations == (max(moved) > 0)  # one buffer, reused by every cycle


def test_a_pending_delayed_update_lands_before_the_offload() -> None:
    """The cycle equals synchronize() at the same points (the delayed update applied then), bit for bit."""
    straight_model, straight_opt, _ = run(0.5, "fp32", True, cycle=False, weights=False, delay=True)
    model, opt, _ = run(0.5, "fp32", True, cycle=True, weights=False, delay=True)
    assert all(a.equal(b) for a, b in zip(bits(straight_model, straight_opt), bits(model, opt), strict=True))


def test_the_memory_is_freed_and_given_back_into_the_same_tensors() -> None:
    model = make()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, state_precision="int8_m24")
    gen = torch.Generator().manual_seed(1)
    x, y = batch(gen)
    F.mse_loss(model(x).float(), y).backward()
    opt.step()
    F.mse_loss(model(x).float(), y).backward()  # gradients present
    owned = opt.coordinator.split.device_state.tensors()
    before = [t.clone() for t in owned]
    grads = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads]
    weight_values = [p.detach().clone() for p in model.parameters()]
    expected = sum(t.untyped_storage().nbytes() for t in owned + grads + list(model.parameters()))
    assert opt.offload_states(weights=True) == expected
    assert all(t.untyped_storage().nbytes() == 0 for t in owned + grads + list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # nothing outside reads a gradient that has no memory
    assert opt.offload_states() == 0  # a second offload moves nothing
    with pytest.raises(RuntimeError, match=r"step\(\) while the optimizer's device state is offloaded.*reload_states"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) while .*reload_states\(\) first"):
        opt.load_state_dict(opt.state_dict())
    assert opt.reload_states() == expected
    assert opt.reload_states() == 0  # nothing out: nothing to do
    assert all(a.equal(b) for a, b in zip(owned, before))
    assert all(p.grad is g and g.equal(v) for p, g, v in zip(model.parameters(), grads, grad_values))
    assert all(p.detach().equal(v) for p, v in zip(model.parameters(), weight_values))


def test_a_bad_include_is_named() -> None:
    opt = TwinFlowAdam(make().parameters(), ratio=0.5)
    with pytest.raises(ValueError, match=r"'weights' is not one of \('optimizer', 'grads'\)"):
        opt.offload_states(include=("optimizer", "weights"))
    assert not opt.offload.offloaded


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_on_the_gpu_the_memory_goes_back_to_the_driver_and_training_resumes_bit_for_bit(precision: str) -> None:
    def go(cycle: bool) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4))).cuda().to(torch.bfloat16)
        opt = TwinFlowAdam(model.parameters(), lr=1e-3, ratio=0.5, state_precision=precision, max_grad_norm=1.0)
        opt.attach(model)
        gen, freed = torch.Generator(device="cuda").manual_seed(1), []
        for k in range(4):
            x = torch.randn(16, 2048, device="cuda", generator=gen, dtype=torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            if k in (1, 2):
                if cycle:
                    torch.cuda.synchronize()
                    free_before = torch.cuda.mem_get_info()[0]
                    moved = opt.offload_states(weights=True)
                    free_after = torch.cuda.mem_get_info()[0]
                    assert opt.offload.buffer.is_pinned()  # registered with CUDA: the copies run asynchronously
                    freed.append((moved, free_after - free_before, opt.offload.allocations))
                    opt.reload_states()
                else:
                    opt.synchronize()
        opt.synchronize()
        return bits(model, opt), freed

    straight, _ = go(False)
    cycled, freed = go(True)
    assert all(a.equal(b) for a, b in zip(straight, cycled, strict=True))
    for moved, given_back, allocations in freed:
        assert moved > 0 and given_back >= 0.95 * moved, freed  # back to the driver: another process may use it
        assert allocations == 1


def trained(ratio: float, precision: str, steps: int = 3, device: str = "cpu") -> tuple[torch.nn.Module, TwinFlowAdam]:
    model = make().to(device)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=ratio, state_precision=precision)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = batch(gen)
        F.mse_loss(model(x.to(device)).float(), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def in_buffer(opt: TwinFlowAdam, t: torch.Tensor) -> bool:
    start = opt.offload.buffer.data_ptr()
    return start <= t.data_ptr() < start + opt.offload.buffer.numel()


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_state_dict_opt_state_and_checkpoints_are_read_while_offloaded(
    tmp_path, precision: str, ratio: float, weights: bool, device: str
) -> None:
    from twinflow.checkpoint import load_portable, save_portable

    model, opt = trained(ratio, precision, device=device)
    want = copy.deepcopy(opt.state_dict())
    save_portable(tmp_path, "here", model=model, optimizer=opt)
    host = opt.coordinator.split.host  # the CPU share's codes convert on the GPU, except while it is given away
    assert host is None or host.conversion_device.type == device
    assert opt.offload_states(weights=weights) > 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if device == "cuda" else 0
    got = opt.state_dict()  # no reload: read where the state is
    assert opt.offload.offloaded
    assert host is None or host.conversion_device.type == "cpu"
    if device == "cuda":  # nothing of the read lands in the GPU's memory while it is offloaded
        assert torch.cuda.max_memory_allocated() <= held + (1 << 20)
    for pid, entry in want["state"].items():
        for key, value in entry.items():
            assert got["state"][pid][key].cpu().equal(value.cpu()), (pid, key)
            assert not in_buffer(opt, got["state"][pid][key])  # a copy: the next offload overwrites the buffer
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].cpu().equal(want["state"][opt.coordinator.split.index[id(p)]]["exp_avg"].cpu())
    save_portable(tmp_path, "away", model=model, optimizer=opt)  # the weights read where they are, too
    assert opt.offload.offloaded
    here, away = (sum(f.stat().st_size for f in (tmp_path / tag).glob("*.distcp")) for tag in ("here", "away"))
    assert away <= here * 1.05  # each tensor's own bytes, not the whole buffer its host view lies in
    opt.reload_states()
    assert host is None or host.conversion_device.type == device
    for tag in ("here", "away"):  # both load into a fresh pair to the same model and state
        fresh = make(seed=7).to(device)
        fresh_opt = TwinFlowAdam(fresh.parameters(), lr=1e-2, ratio=ratio, state_precision=precision)
        load_portable(tmp_path, tag, model=fresh, optimizer=fresh_opt)
        assert all(a.equal(b) for a, b in zip(fresh.parameters(), model.parameters()))
        loaded = fresh_opt.state_dict()["state"]
        assert all(loaded[pid][k].cpu().equal(v.cpu()) for pid, e in want["state"].items() for k, v in e.items()), tag


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_portable_checkpoint_is_saved_while_offloaded_weights_too_without_moving_anything_back(
    tmp_path, precision: str, ratio: float, asynchronous: bool, device: str
) -> None:
    from twinflow.checkpoint import portable
    from twinflow.checkpoint.portable_load import load_portable

    if asynchronous and not portable.ASYNC_SAVE:
        pytest.skip("an asynchronous portable save needs torch >= 2.9")
    model, opt = trained(ratio, precision, device=device)
    want = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    assert opt.offload_states(weights=True) > 0
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # the weights have no memory now
    held = torch.cuda.memory_allocated() if device == "cuda" else 0
    saved = portable.save_portable(tmp_path, "away", model=model, optimizer=opt, asynchronous=asynchronous)
    if asynchronous:
        saved = saved.wait()
    assert opt.offload.offloaded
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    if device == "cuda":  # nothing came back to the GPU for the save (a placeholder's element at most)
        assert torch.cuda.memory_allocated() <= held + (1 << 20)
    opt.reload_states()
    assert all(a.equal(b) for a, b in zip(model.parameters(), weights))  # the save wrote nothing into them
    fresh = make(seed=7).to(device)
    fresh_opt = TwinFlowAdam(fresh.parameters(), lr=1e-2, ratio=ratio, state_precision=precision)
    for p in fresh.parameters():  # poisoned: only the load can make them right
        p.data.fill_(float("nan"))
    load_portable(tmp_path, "away", model=fresh, optimizer=fresh_opt)
    assert all(a.equal(b) for a, b in zip(fresh.parameters(), weights))
    loaded = fresh_opt.state_dict()["state"]
    assert all(loaded[i][k].cpu().equal(v.cpu()) for i, e in want["state"].items() for k, v in e.items())


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_an_in_place_write_to_opt_state_while_offloaded_lands_and_assignments_wait(tmp_path, precision) -> None:
    from twinflow.checkpoint import CheckpointError, load_portable, save_portable

    def edit(offloaded: bool) -> dict:
        model, opt = trained(0.5, precision)
        save_portable(tmp_path, "t", model=model, optimizer=opt)
        if offloaded:
            opt.offload_states(weights=True)
            before = copy.deepcopy(opt.state_dict())
            p = next(model.parameters())
            with pytest.raises(RuntimeError, match=r"opt.state\[p\] written for parameter 0 .*reload_states"):
                opt.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            with pytest.raises(CheckpointError, match=r"offloaded \(offload_states\(\)\); call reload_states"):
                load_portable(tmp_path, "t", model=model, optimizer=opt)
            after = opt.state_dict()
            assert all(after["state"][i][k].equal(v) for i, e in before["state"].items() for k, v in e.items())
        for p in model.parameters():
            opt.state[p]["exp_avg"].mul_(-2)  # a copy while offloaded: it lands in the buffer at the reload
        if offloaded:
            opt.reload_states()
        gen = torch.Generator().manual_seed(9)
        x, y = batch(gen)
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        return copy.deepcopy(opt.state_dict()["state"])

    straight, cycled = edit(False), edit(True)
    assert all(cycled[i][k].equal(v) for i, e in straight.items() for k, v in e.items())


@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["clipped", "unclipped"])
def test_an_offload_while_a_speculative_step_is_pending_resumes_bit_for_bit(clip: float) -> None:
    """Attached and speculating: gradients have landed and the CPU has stepped out of place before step(); the
    offload and reload in between change no bit of what step() then makes."""
    from tests.test_speculation import drain

    def go(cycle: bool) -> list[torch.Tensor]:
        model = make()
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.6, placement="last", max_grad_norm=clip,
                           speculate=True, chunk_bytes=1024).attach(model)  # fmt: skip
        opt.coordinator.speculation.off_after = 10**9  # speculates on every step, also while steps clip
        gen = torch.Generator().manual_seed(1)
        for k in range(3):
            x, y = batch(gen)
            F.mse_loss(model(x).float(), y).backward()
            drain(opt)  # every chunk stepped out of place; step() gives the verdict
            if cycle:
                assert opt.offload_states() > 0
                opt.reload_states()
            opt.step()
            opt.synchronize()  # the verdict has been given
            assert opt.coordinator.host.speculative.speculated_chunks == (k + 1) * opt.coordinator.host.chunk_count
            opt.zero_grad()
        opt.synchronize()
        return bits(model, opt)

    assert all(a.equal(b) for a, b in zip(go(False), go(True), strict=True))


def test_the_engine_takes_deepspeeds_names() -> None:
    import twinflow

    def go(cycle: bool, include: object) -> list[torch.Tensor]:
        model = make()
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "offload_ratio": 0.5,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
        engine, opt, *_ = twinflow.initialize(model=model, config=config)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = batch(gen)
            engine.backward(F.mse_loss(engine(x).float(), y))
            engine.step()
            if cycle:
                moved = engine.offload_states(include=include)
                weights_out = model[0].weight.untyped_storage().nbytes() == 0
                assert moved > 0 and weights_out == (include is None or "lp_params" in include)
                assert engine.reload_states() == moved
        engine.local_optimizer.synchronize()  # attached: the last step's weights are back before they are read
        return bits(model, engine.local_optimizer)

    straight = go(False, None)
    for include in (None, ["optim_states", "lp_grads"], ("hp_params", "lp_params", "contiguous_grad_buffer")):
        assert all(a.equal(b) for a, b in zip(straight, go(True, include), strict=True)), include
    engine, *_ = twinflow.initialize(model=make(), config={"train_micro_batch_size_per_gpu": 8, "offload_ratio": 0.5})
    with pytest.raises(ValueError, match=r"'activations' is not one of .*DeepSpeed's .*'optim_states'"):
        engine.offload_states(include=["optim_states", "activations"])
    with pytest.raises(ValueError, match=r"device='nvme'.*host memory only.*device=\"cpu\""):
        engine.offload_states(device="nvme")
    assert not engine.local_optimizer.offload.offloaded


def _ranks_worker(rank: int, port: int, how: str, out: str) -> None:
    import os

    from tests.test_ddp_attach import batches, make_model, wrap
    from twinflow.checkpoint import save_portable

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results = []
        for cycle in (False, True):
            model = make_model()
            net = wrap(model, how)
            opt = TwinFlowAdam(model.parameters(), lr=3e-3, ratio=0.5, max_grad_norm=1.0, chunk_bytes=512).attach(net)
            moved = []
            for k, (x, y) in enumerate(batches()):
                F.mse_loss(net(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
                if cycle and k == 1:  # reduced gradients present (DDP's bucket views, FSDP2's shards)
                    moved.append(opt.offload_states())
                    opt.reload_states()
                opt.step()
                opt.zero_grad()
                if cycle and k in (2, 4):
                    moved.append(opt.offload_states(weights=True))  # FSDP2: this rank's shards
                    opt.state_dict()  # read while offloaded
                    if k == 4:  # read where it is, the weights too (FSDP2: DTensors over the host buffer)
                        save_portable(os.path.join(out, "ckpt"), "away", model=model, optimizer=opt)
                    opt.reload_states()
                elif k in (2, 4):
                    opt.synchronize()
                    if k == 4:
                        save_portable(os.path.join(out, "ckpt"), "here", model=model, optimizer=opt)
            opt.synchronize()
            whole = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
            state = [t for e in opt.state_dict()["state"].values() for t in (e["exp_avg"], e["exp_avg_sq"])]
            results.append([t.clone() for t in whole + state] + [torch.tensor(moved or [0])])
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    os._exit(0)  # as tests/test_ddp_attach.py: gloo's teardown can abort now and then


@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_each_ranks_share_cycles_bit_for_bit_under_ddp_and_fsdp2(tmp_path, how: str) -> None:
    import torch.multiprocessing as mp

    from tests.test_ddp_attach import free_port, make_model
    from twinflow.checkpoint.portable_load import load_portable

    mp.spawn(_ranks_worker, args=(free_port(), how, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        straight, cycled = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert len(straight) == len(cycled) > 1
        differ = [k for k, (a, b) in enumerate(zip(straight[:-1], cycled[:-1], strict=True)) if not a.equal(b)]
        assert not differ, (how, rank, differ)
        assert (cycled[-1] > 0).all() and len(cycled[-1]) == 3
    loaded = []  # the portable saves, one while offloaded, read back by one process: the same state
    for tag in ("here", "away"):
        model = make_model(seed=3)
        opt = TwinFlowAdam(model.parameters(), lr=3e-3, ratio=0.5)
        load_portable(tmp_path / "ckpt", tag, model=model, optimizer=opt)
        loaded.append([p.detach().clone() for p in model.parameters()] + [
            t for e in opt.state_dict()["state"].values() for t in (e["exp_avg"], e["exp_avg_sq"])])  # fmt: skip
    assert len(loaded[0]) == 18 and all(a.equal(b) for a, b in zip(*loaded, strict=True))


def test_the_weights_stay_while_a_step_is_under_way() -> None:
    model = make()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1.0).attach(model)
    x, y = batch(torch.Generator().manual_seed(1))
    F.mse_loss(model(x).float(), y).backward()  # gradients streamed: the step is open
    with pytest.raises(RuntimeError, match=r"weights=True\) between backward and step\(\).*call step\(\) first"):
        opt.offload_states(weights=True)
    assert not opt.offload.offloaded and all(p.untyped_storage().nbytes() for p in model.parameters())
    assert opt.offload_states() > 0  # the state and the gradients may go
    opt.reload_states()
    opt.step()


def test_a_failed_offload_gives_everything_back() -> None:
    """A storage that cannot be freed (here a weight over numpy's memory) fails the offload part way: every
    storage keeps or gets back its memory and bytes, nothing counts as offloaded, and training goes on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 300), torch.nn.GELU(), torch.nn.Linear(300, 5))
    model[2].weight.data = torch.from_numpy(model[2].weight.detach().numpy().copy())  # not resizable
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
    x, y = batch(torch.Generator().manual_seed(1))
    F.mse_loss(model(x.float()), y).backward()
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="resiz"):
        opt.offload_states(weights=True)
    assert not opt.offload.offloaded and not opt.coordinator.split.offloaded
    assert all(p.untyped_storage().nbytes() for p in model.parameters())
    assert all(p.detach().equal(w) for p, w in zip(model.parameters(), weights))
    after = opt.state_dict()
    assert all(after["state"][i][k].equal(v) for i, e in before["state"].items() for k, v in e.items())
    opt.step()  # still trains


def test_zero_grad_while_offloaded_drops_the_gradients_or_refuses() -> None:
    def go(cycle: bool) -> list[torch.Tensor]:
        model, opt = trained(0.5, "fp32")
        x, y = batch(torch.Generator().manual_seed(4))
        F.mse_loss(model(x).float(), y).backward()
        if cycle:
            with_grads = opt.offload_states()
            with pytest.raises(RuntimeError, match=r"zero_grad\(set_to_none=False\) while the gradients are offloaded"):
                opt.zero_grad(set_to_none=False)
            opt.zero_grad()  # the gradients are dropped: not brought back
            assert all(p.grad is None for p in model.parameters())
            assert 0 < opt.reload_states() < with_grads
        else:
            opt.zero_grad()
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        return bits(model, opt)

    assert all(a.equal(b) for a, b in zip(go(False), go(True), strict=True))


def test_a_copy_taken_before_the_offload_and_written_while_offloaded_lands() -> None:
    def go(cycle: bool) -> list[torch.Tensor]:
        model, opt = trained(0.5, "int8_m24")
        copies = [opt.state[p]["exp_avg"] for p in model.parameters()]  # compact state: copies
        if cycle:
            opt.offload_states()
        for c in copies:
            c.mul_(0.5)
        if cycle:
            opt.reload_states()
        x, y = batch(torch.Generator().manual_seed(4))
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        return bits(model, opt)

    assert all(a.equal(b) for a, b in zip(go(False), go(True), strict=True))


def test_a_teardown_that_moves_the_module_while_offloaded_then_a_reload_resumes_bit_for_bit() -> None:
    """Lightning's teardown calls ``module.cpu()`` after a loop that ended offloaded: every gradient is read then. A
    gradient out of device memory is no parameter's meanwhile (a read of it would touch memory it does not have)."""

    def go(cycle: bool) -> list[torch.Tensor]:
        model, opt = trained(0.5, "fp32")
        x, y = batch(torch.Generator().manual_seed(6))
        F.mse_loss(model(x).float(), y).backward()
        grads = [p.grad for p in model.parameters()]
        if cycle:
            assert opt.offload_states() > 0
            model.cpu()  # Lightning's teardown; on a GPU it copies every parameter and gradient it finds
            assert all(p.grad is None for p in model.parameters())
            assert sum(float(p.grad.sum()) for p in model.parameters() if p.grad is not None) == 0.0
            opt.reload_states()
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        opt.step()
        return bits(model, opt)

    assert all(a.equal(b) for a, b in zip(go(False), go(True), strict=True))


def test_a_backward_while_offloaded_accumulates_as_without_the_offload() -> None:
    """Gradient accumulation across an offload: the second micro-batch's gradient adds to the first's."""

    def go(cycle: bool) -> list[torch.Tensor]:
        model, opt = trained(0.5, "fp32")
        x, y = batch(torch.Generator().manual_seed(7))
        F.mse_loss(model(x).float(), y).backward()
        if cycle:
            opt.offload_states()
        F.mse_loss(model(x).float(), 2 * y).backward()
        if cycle:
            opt.reload_states()
        return [p.grad.clone() for p in model.parameters()]

    assert all(a.equal(b) for a, b in zip(go(False), go(True), strict=True))
