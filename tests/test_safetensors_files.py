"""The safetensors files a portable checkpoint's model is written to (``python -m twinflow.convert DIR TAG
--safetensors OUT --max-shard-size SIZE``, twinflow.checkpoint.portable_consolidate): split as save_pretrained splits
them, ``model-<k>-of-<n>.safetensors`` and an index naming each tensor's file; what an earlier conversion into the
same folder left in another number of files is removed, so that from_pretrained does not mix the two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_consolidate

safetensors_torch = pytest.importorskip("safetensors.torch")
LIMIT = 20_000  # --max-shard-size 20KB


def saved(directory: Path) -> torch.nn.Module:
    """A float32 model (its weights are its masters) trained a step with TwinFlowAdam and saved as tag "t": weights
    of 16 kB, 40 kB (larger than a file may be: alone in its own) and 4 kB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 100), torch.nn.GELU(), torch.nn.Linear(100, 100),
                                torch.nn.Linear(100, 10))  # fmt: skip
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
    model(torch.randn(4, 40)).square().mean().backward()
    opt.step()
    portable.save_portable(directory, "t", model=model, optimizer=opt)
    return model


def header_names(path: Path) -> list[str]:
    """The tensors' names in a safetensors file's header, in its order."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return [name for name in header if name != "__metadata__"]


def test_a_small_max_shard_size_gives_numbered_files_an_index_and_removes_an_earlier_conversions_files(
    tmp_path: Path,
) -> None:
    model = saved(tmp_path / "ckpt")
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    out = tmp_path / "hub"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stale")  # a conversion before, into one file
    (out / "model-00002-of-00009.safetensors").write_bytes(b"stale")  # ... and one into nine
    (out / "README.md").write_text("not ours")
    written = portable_consolidate.consolidate_portable(tmp_path / "ckpt", "t", out, max_shard_size="20KB")

    files = sorted(out.glob("model-*.safetensors"))
    n = len(files)
    assert n >= 3 and [p.name for p in files] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert written == [*files, out / "model.safetensors.index.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in files), "README.md",
                                                           "model.safetensors.index.json"])  # fmt: skip
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights) and set(index["weight_map"].values()) == {p.name for p in files}
    assert index["metadata"]["total_size"] == sum(w.numel() * 4 for w in weights.values())
    in_order = []
    for p in files:
        tensors = safetensors_torch.load_file(p)
        assert all(index["weight_map"][name] == p.name for name in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= LIMIT or len(tensors) == 1, (p.name, size)  # a tensor larger than the limit: alone
        assert all(torch.equal(t, weights[name]) for name, t in tensors.items())
        in_order += header_names(p)
    assert in_order == list(weights)  # split in the model's order, as save_pretrained splits
    assert any(len(safetensors_torch.load_file(p)) == 1 and p.stat().st_size > LIMIT for p in files)

    again = portable_consolidate.consolidate_portable(tmp_path / "ckpt", "t", out)  # 5GB: one file now
    assert again == [out / "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]  # the split files and index
    assert header_names(out / "model.safetensors") == list(weights)
    loaded = safetensors_torch.load_file(out / "model.safetensors")
    assert all(torch.equal(loaded[name], w) for name, w in weights.items())
