"""The converter's consolidated weights for the hub: a checkpoint's model as safetensors that ``from_pretrained``
loads, each weight the optimizer's float32 master (bf16: rounded), sharded into files with an index, tied weights
once, FSDP2 shards merged; written a bounded piece at a time."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint_fixture import strip_layout
from twinflow import TwinFlowAdam
from twinflow.checkpoint import consolidate as consolidate_module
from twinflow.checkpoint import safetensors_out, save_checkpoint
from twinflow.checkpoint.consolidate import consolidate
from twinflow.checkpoint.convert_cli import main as convert_main
from twinflow.checkpoint.safetensors_out import hub_name, parse_size

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 14  # records of 512 elements: several a tensor


def tiny_opt():
    config = transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                                    vocab_size=100, max_position_embeddings=64, word_embed_proj_dim=32)  # fmt: skip
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(config).to(torch.bfloat16)


def trained(precision: str, steps: int = 3):
    model = tiny_opt()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, chunk_bytes=CHUNK, state_precision=precision)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 100, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def masters(model, opt) -> dict[str, torch.Tensor]:
    """Each parameter's float32 master by its first name, from the optimizer's own state dict."""
    state = opt.state_dict()["state"]
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    params = [p for g in opt.param_groups for p in g["params"]]
    return {names[id(p)]: state[i]["master"] for i, p in enumerate(params)}


def assert_loads_masters(out: Path, expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == dtype
    weights = dict(loaded.named_parameters())
    assert set(weights) == set(expected)
    for name, master in expected.items():
        want = master.to(dtype).view(weights[name].shape)
        assert weights[name].dtype == dtype and torch.equal(weights[name].detach(), want), name
    assert loaded.lm_head.weight is loaded.model.decoder.embed_tokens.weight  # tied again on load


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_weights_are_the_masters_and_from_pretrained_loads_them(tmp_path, precision: str, dtype: str,
                                                                    capsys) -> None:  # fmt: skip
    model, opt = trained(precision)
    expected = masters(model, opt)
    assert any(not torch.equal(m.bfloat16().float(), m) for m in expected.values())  # masters finer than weights
    save_checkpoint(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    model.config.save_pretrained(tmp_path / "hf")
    out = tmp_path / "hub"
    args = [str(tmp_path / "ckpt"), "latest", "--safetensors", str(out), "--hf-config", str(tmp_path / "hf")]
    assert convert_main(args + (["--dtype", "bf16"] if dtype == "bf16" else [])) == 0
    printed = capsys.readouterr()
    assert str(out) in printed.out
    assert f"writing {out}: " in printed.err and "GB/s" in printed.err  # the progress meter's closing line
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    saved = safetensors_torch.load_file(out / "model.safetensors")
    assert "lm_head.weight" not in saved and "model.decoder.embed_tokens.weight" in saved  # as save_pretrained
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert_loads_masters(out, expected, torch_dtype)


def test_a_small_max_shard_size_gives_several_files_and_an_index(tmp_path) -> None:
    model, opt = trained("int8_m24")
    save_checkpoint(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    model.config.save_pretrained(tmp_path / "hf")
    out = tmp_path / "hub"
    (out).mkdir()
    (out / "model.safetensors").write_bytes(b"stale")  # a conversion before, into one file: removed
    assert convert_main([str(tmp_path / "ckpt"), "t", str(tmp_path / "adamw.pt"), "--safetensors", str(out),
                         "--max-shard-size", "20KB", "--hf-config", str(tmp_path / "hf")]) == 0  # fmt: skip
    assert (tmp_path / "adamw.pt").is_file()  # the AdamW state dict too
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) >= 3 and not (out / "model.safetensors").exists()
    assert all(p.name.endswith(f"-of-{len(files):05d}.safetensors") for p in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in files}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in masters(model, opt).values())
    for p in files:  # each within the limit, unless one tensor alone is larger
        tensors = safetensors_torch.load_file(p)
        assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors.values()) <= 20_000
        assert all(index["weight_map"][name] == p.name for name in tensors)
    assert_loads_masters(out, masters(model, opt), torch.float32)


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_at_most_one_bounded_piece_is_in_memory_at_a_time(tmp_path, monkeypatch, precision: str) -> None:
    """Every byte goes out through write_piece, a flat piece at a time: a compact record's batch, or BATCH
    elements of a torch.save shard's tensor; never a whole tensor of the model."""
    model, opt = trained(precision, steps=1)
    save_checkpoint(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    pieces = []
    write = safetensors_out.write_piece

    def recorded(fd: int, at: int, values: torch.Tensor) -> None:
        pieces.append(values.numel())
        write(fd, at, values)

    monkeypatch.setattr(safetensors_out, "write_piece", recorded)
    monkeypatch.setattr(consolidate_module, "BATCH", 256)
    consolidate(tmp_path / "ckpt", "t", tmp_path / "hub")
    bound = 256 if precision == "fp32" else CHUNK // 32  # the compact shard's record_elements
    largest = max(p.numel() for p in model.parameters())
    assert max(pieces) <= bound < largest
    assert sum(pieces) == sum(t.numel() for k, t in model.state_dict().items() if k != "lm_head.weight")


def test_a_one_rank_checkpoint_saved_before_the_layout_pairs_parameters_in_order(tmp_path) -> None:
    model, opt = trained("fp32")
    save_checkpoint(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    strip_layout(tmp_path / "ckpt" / "t")
    model.config.save_pretrained(tmp_path / "hub")
    consolidate(tmp_path / "ckpt", "t", tmp_path / "hub")
    saved = safetensors_torch.load_file(tmp_path / "hub" / "model.safetensors")
    expected = masters(model, opt)
    assert all(torch.equal(saved[name], master) for name, master in expected.items())
    assert "lm_head.weight" not in saved  # its bytes are the embeddings': their tied duplicate
    assert_loads_masters(tmp_path / "hub", expected, torch.float32)


def test_sizes_names_and_refusals(tmp_path) -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert hub_name("module._orig_mod.model._fsdp_wrapped_module.layers.0.weight") == "model.layers.0.weight"
    model, opt = trained("fp32", steps=1)
    save_checkpoint(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    assert convert_main([str(tmp_path / "ckpt"), "t", "--safetensors", str(tmp_path / "o"), "--hf-config",
                         str(tmp_path)]) == 1  # fmt: skip
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        convert_main([str(tmp_path / "ckpt"), "t"])  # neither OUT.pt nor --safetensors


WORKER = r"""
import os, sys, torch, torch.distributed as dist, transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, os.environ["TESTS"])
from test_convert_safetensors import masters, trained_model
from twinflow import TwinFlowAdam
from twinflow.checkpoint import save_checkpoint

rank, world, out, precision = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[5]}", rank=rank, world_size=world)
model = trained_model()
mesh = init_device_mesh("cpu", (world,))
for layer in model.model.decoder.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, chunk_bytes=1 << 14, state_precision=precision)
gen = torch.Generator().manual_seed(1)
for _ in range(3):
    ids = torch.randint(0, 100, (2, 12), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
save_checkpoint(out + "/ckpt", "t", model=model, optimizer=opt)
shapes = {name: p.to_local().shape for name, p in model.named_parameters()}
mine = {name: m.reshape(shapes[name]) for name, m in masters(model, opt).items()}
every = [None] * world
dist.all_gather_object(every, mine)
whole = {name: torch.cat([pieces[name] for pieces in every]) for name in mine}
if rank == 0:
    torch.save(whole, out + "/masters.pt")
dist.destroy_process_group()
"""


def trained_model():
    return tiny_opt()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_fsdp2_shards_of_two_ranks_are_merged(tmp_path, precision: str) -> None:
    port = _free_port()
    env = {**os.environ, "TESTS": str(REPO / "tests"), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), "2", str(tmp_path), precision, str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    layout = torch.load(tmp_path / "ckpt" / "t" / "rank1.pt", weights_only=True) if precision == "fp32" else None
    if layout is not None:
        assert layout["layout"]["sharded"]["model.decoder.embed_tokens.weight"] == [100, 32]
    expected = torch.load(tmp_path / "masters.pt", weights_only=True)
    tiny_opt().config.save_pretrained(tmp_path / "hf")
    assert convert_main([str(tmp_path / "ckpt"), "t", "--safetensors", str(tmp_path / "hub"), "--hf-config",
                         str(tmp_path / "hf"), "--max-shard-size", "30KB"]) == 0  # fmt: skip
    assert_loads_masters(tmp_path / "hub", expected, torch.float32)
