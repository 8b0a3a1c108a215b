"""A portable checkpoint's model as safetensors (``python -m twinflow.convert DIR TAG --safetensors OUT``): the
optimizer's masters where it keeps them, the ranks' pieces merged, read a batch at a time, checked first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import twinflow
from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_consolidate, portable_load
from twinflow.checkpoint.convert_cli import main as convert_main
from twinflow.checkpoint.safetensors_out import hub_name, parse_size

safetensors_torch = pytest.importorskip("safetensors.torch")
WORKER = Path(__file__).with_name("portable_worker.py")


def _single(seed: int) -> tuple[torch.nn.Module, TwinFlowAdam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.GELU(), torch.nn.Linear(300, 4)).bfloat16()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
    opt.state_precision = "int8_m24"
    for i in range(2):
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(i)).bfloat16()
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _masters(model: torch.nn.Module, opt: TwinFlowAdam) -> dict[str, torch.Tensor]:
    state = opt.state_dict()["state"]
    names = [name for name, _ in model.named_parameters()]
    return {names[i]: entry["master"].view(p.shape) for (i, entry), p in zip(state.items(), model.parameters())}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_weights_are_the_24_bit_masters_whatever_the_batch(tmp_path, monkeypatch, dtype: str) -> None:
    """Every weight is its master (24-bit, decoded exactly; --dtype bf16: rounded to the nearest even), read in
    batches of rows (small here: a 300 x 300 weight in several reads, the small tensors together)."""
    model, opt = _single(0)
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    expected = _masters(model, opt)
    assert any(not torch.equal(m.bfloat16().float(), m) for m in expected.values())  # masters finer than weights
    reads = []
    load = portable_load.dcp.load
    monkeypatch.setattr(portable_load.dcp, "load", lambda sd, **kw: reads.append(len(sd)) or load(sd, **kw))
    monkeypatch.setattr(portable_load, "CHUNK", 7000)
    assert convert_main([str(tmp_path / "ckpt"), "latest", "--safetensors", str(tmp_path / "hub"),
                         "--dtype", dtype]) == 0  # fmt: skip
    written = safetensors_torch.load_file(tmp_path / "hub" / "model.safetensors")
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    assert set(written) == set(expected)
    for name, master in expected.items():
        assert written[name].dtype == want and torch.equal(written[name], master.to(want)), name
    assert len(reads) >= 300 * 300 // 7000 and max(reads) <= 2 * 4  # batches; a read's targets: hi and lo each


def test_the_pieces_of_two_ranks_merge_into_what_a_load_on_one_gives(tmp_path) -> None:
    """Saved by two gloo ranks under FSDP2 (every tensor in two pieces), converted, and loaded by one process:
    the safetensors hold that process's weights exactly."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--world", "2", "--stage", "3",
                               "--rendezvous", str(tmp_path / "rdv"), "--out", str(out), "--save", str(ckpt)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]  # fmt: skip
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    assert convert_main([str(ckpt), "moved", "--safetensors", str(tmp_path / "hub")]) == 0
    sys.path.insert(0, str(WORKER.parent))
    import portable_worker  # the ranks' model and config

    torch.manual_seed(5)
    engine, *_ = twinflow.initialize(model=portable_worker.Net(), config=portable_worker.config(0, "fp32", 0.5))
    engine.load_checkpoint(ckpt)
    written = safetensors_torch.load_file(tmp_path / "hub" / "model.safetensors")
    weights = {k: v for k, v in engine.module.state_dict().items()}
    assert set(written) == set(weights)
    assert all(torch.equal(written[k], v) for k, v in weights.items())


def test_several_files_an_index_and_a_damaged_piece_refused(tmp_path) -> None:
    model, opt = _single(0)
    folder = portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    written = portable_consolidate.consolidate_portable(tmp_path / "ckpt", "t", tmp_path / "hub",
                                                        max_shard_size="100KB")  # fmt: skip
    assert (tmp_path / "hub" / "model.safetensors.index.json") in written and len(written) >= 3
    piece = max(folder.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(portable.CheckpointError, match=f"{piece.name} differs from what the save wrote"):
        portable_consolidate.consolidate_portable(tmp_path / "ckpt", "t", tmp_path / "hub2")
    assert not (tmp_path / "hub2").exists()


def test_sizes_names_and_refusals(tmp_path) -> None:
    """--max-shard-size's units, the hub's names of a wrapped model's keys, and a command line that is refused
    before anything is written."""
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert hub_name("module._orig_mod.model._fsdp_wrapped_module.layers.0.weight") == "model.layers.0.weight"
    model, opt = _single(0)
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    assert convert_main([str(tmp_path / "ckpt"), "t", "--safetensors", str(tmp_path / "o"), "--hf-config",
                         str(tmp_path)]) == 1  # no config.json there  # fmt: skip
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        convert_main([str(tmp_path / "ckpt"), "t"])  # neither OUT.pt nor --safetensors


def test_a_tied_lm_head_is_written_once_and_from_pretrained_ties_it_again(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    shape = {"hidden_size": 16, "num_hidden_layers": 2, "ffn_dim": 32, "num_attention_heads": 2}
    config = transformers.OPTConfig(vocab_size=100, max_position_embeddings=32, word_embed_proj_dim=16, **shape)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config).bfloat16()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
    opt.state_precision = "int8_m24"
    ids = torch.randint(0, 100, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    model.config.save_pretrained(tmp_path / "cfg")
    assert convert_main([str(tmp_path / "ckpt"), "t", "--safetensors", str(tmp_path / "hub"), "--hf-config",
                         str(tmp_path / "cfg")]) == 0  # fmt: skip
    written = safetensors_torch.load_file(tmp_path / "hub" / "model.safetensors")
    assert "lm_head.weight" not in written and "model.decoder.embed_tokens.weight" in written
    with open(tmp_path / "hub" / "model.safetensors", "rb") as f:  # the header's order: the model's
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert [k for k in header if k != "__metadata__"] == [k for k in model.state_dict() if k != "lm_head.weight"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hub")
    state = opt.state_dict()["state"]
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    params = [p for g in opt.param_groups for p in g["params"]]
    weights = dict(loaded.named_parameters())
    for i, p in enumerate(params):
        assert torch.equal(weights[first[id(p)]].detach(), state[i]["master"].view(p.shape)), first[id(p)]
    assert loaded.lm_head.weight is loaded.model.decoder.embed_tokens.weight
