"""The host copies an asynchronous portable save writes from (:mod:`twinflow.checkpoint.portable_staging`): a new
copy's pages are touched before anything is copied into it, on the file threads, and a kept copy is reused."""

from __future__ import annotations

import pytest
import torch

from twinflow.checkpoint import portable_staging


def _poisoned(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a new host tensor may hold before it is written: here NaN everywhere."""
    return torch.full(like.shape, float("nan"), dtype=dtype)


def test_a_new_copy_is_zero_filled_before_it_is_filled() -> None:
    copies = portable_staging.HostCopies(_poisoned, 2)
    like = torch.randn(1000)
    copies.begin({"w"})
    out = copies.copy("w", like, torch.float32, lambda flat: flat[:600].copy_(like[:600]))
    copies.end()
    assert out.data_ptr() != like.data_ptr()
    assert torch.equal(out[:600], like[:600])
    assert torch.equal(out[600:], torch.zeros(400))  # touched (zeroed) before the fill: no NaN of the new memory


def test_the_fills_run_on_the_file_threads_and_a_kept_copy_is_reused() -> None:
    seen: list[int] = []

    class Read:  # a value that is read into the copy when it is saved (as the optimizer's deferred state is)
        def __init__(self, source: torch.Tensor) -> None:
            self.source = source

        def stage_into(self, copies: portable_staging.HostCopies, key: str) -> torch.Tensor:
            def fill(flat: torch.Tensor) -> None:
                seen.append(torch.get_num_threads())
                flat.copy_(self.source.view(-1))

            return copies.copy(key, self.source, self.source.dtype, fill)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copies = portable_staging.HostCopies(_poisoned, 2)
        weight, moment = torch.randn(8, 16), torch.randn(300)
        first = copies.stage({"model": {"w": weight}, "optim": {"m": Read(moment)}})
        assert torch.get_num_threads() == 1  # put back after the staging
    finally:
        torch.set_num_threads(before)
    assert seen == [2]
    assert torch.equal(first["model"]["w"], weight) and torch.equal(first["optim"]["m"], moment)
    assert copies.nbytes == weight.nbytes + moment.nbytes and copies.reused == 0
    weight.add_(1.0)
    moment.mul_(-2.0)
    again = copies.stage({"model": {"w": weight}, "optim": {"m": Read(moment)}})
    assert again["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # the same host memory
    assert again["optim"]["m"].data_ptr() == first["optim"]["m"].data_ptr()
    assert copies.reused == weight.nbytes + moment.nbytes
    assert torch.equal(again["model"]["w"], weight) and torch.equal(again["optim"]["m"], moment)


def test_a_host_tensor_of_a_dtensor_is_made_without_reading_its_piece(tmp_path) -> None:
    """The host copy of a DTensor is made like a placeholder over no memory, never by copying the piece (from a
    GPU: densely, into new pages, 33 s of OPT-13B's first asynchronous save). A piece over no memory at all (meta)
    shows it: reading it would raise."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from twinflow.checkpoint.portable_state import host_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        piece = torch.empty(6, 4, device="meta")
        p = DTensor.from_local(piece, mesh, [Shard(0)], run_check=False, shape=(6, 4), stride=(4, 1))
        with pytest.raises(NotImplementedError):
            piece.to("cpu")  # what a copy of the piece would do
        out = host_tensor(p, torch.bfloat16)
        assert isinstance(out, DTensor) and out.placements == p.placements and out.device_mesh is mesh
        assert out.shape == p.shape and out.dtype == torch.bfloat16
        assert out.to_local().device.type == "cpu" and out.to_local().shape == (6, 4)
        assert out.to_local().is_contiguous() and out.to_local().stride() == (4, 1)  # a piece of its own, dense
    finally:
        dist.destroy_process_group()
