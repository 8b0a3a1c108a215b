"""The hub weights of a portable checkpoint saved on a GPU: ``python -m twinflow.convert DIR TAG --safetensors OUT``
run as a user runs it, timed, its peak host memory measured, and what ``from_pretrained`` loads from OUT compared
with what the optimizer kept.

    torchrun --standalone --nproc-per-node 1 benchmarks/portable_convert_check.py \
        --config benchmarks/configs/opt-2.7b-x1-int8_m24-r0.5.json --ckpt /tmp/ckc --model opt-2.7b

An OPT model under ``twinflow.initialize`` trains --steps steps and saves a portable checkpoint; the reference is
each parameter's float32 master as the optimizer's ``state_dict()`` gives it (where it keeps one; else the weight).
The converter runs in a child process (``python -m twinflow.convert``, with the model's config.json); its peak
resident memory is the child's ``VmHWM``. OUT is loaded with ``OPTForCausalLM.from_pretrained`` in float32:
every tensor is compared with the reference (bit for bit, and the largest difference), and the loaded model, cast
to bf16 on the GPU, takes the loss of one batch beside the engine's model. Writes JSON (--out, else $OUT).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
import twinflow  # noqa: E402
from benchmarks.bench_resume import batch, train  # noqa: E402
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow.models import build_opt  # noqa: E402

# the converter as `python -m twinflow.convert ARGS` runs it, then its own peak resident memory: VmHWM of its own
# address space (ru_maxrss would not do: Linux carries it over an exec, so a child started by this process, which
# holds the model and the references, would report this process's peak)
PEAK = """import runpy, sys
sys.argv = ["twinflow.convert", *sys.argv[1:]]
try:
    runpy.run_module("twinflow.convert", run_name="__main__")
    code = 0
except SystemExit as done:
    code = done.code
hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")]
print("PEAK_RSS_KIB", hwm[0], file=sys.stderr)
sys.exit(code)
"""


def references(engine, model: torch.nn.Module) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Parameter name -> its float32 master where the optimizer keeps one, else its weight in float32 (host)."""
    opt = engine.local_optimizer
    params = [p for group in opt.param_groups for p in group["params"]]
    name_of = {id(p): name for name, p in model.named_parameters()}
    state = opt.state_dict()["state"]
    out = {}
    for i, p in enumerate(params):
        master = state.get(i, {}).get("master")
        out[name_of[id(p)]] = (master if master is not None else p.detach()).float().cpu().reshape(p.shape)
    del state
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-125m")
    parser.add_argument("--config", required=True)
    parser.add_argument("--ckpt", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run of the script
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = build_opt(args.model, device, torch.bfloat16)
    engine, *_ = twinflow.initialize(model=model, config=config)
    ns = argparse.Namespace(global_batch=4, seq_len=args.seq_len)
    losses, _ = train(engine, range(args.steps), ns, 0, 1, device, model.config.vocab_size)
    start = time.perf_counter()
    engine.save_checkpoint(args.ckpt, "hub")
    save_s = time.perf_counter() - start
    ckpt_bytes = sum(f.stat().st_size for f in (args.ckpt / "hub").rglob("*") if f.is_file())
    hf_dir, out_dir = args.ckpt / "hf_config", args.ckpt / "safetensors"
    model.config.save_pretrained(hf_dir)
    reference = references(engine, model)

    command = ["python", "-m", "twinflow.convert", str(args.ckpt), "hub", "--safetensors", str(out_dir),
               "--hf-config", str(hf_dir)]  # fmt: skip
    start = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", PEAK, *command[3:]], capture_output=True, text=True)
    convert_s = time.perf_counter() - start
    peak_kib = int(child.stderr.rsplit("PEAK_RSS_KIB", 1)[-1].split()[0]) if "PEAK_RSS_KIB" in child.stderr else -1
    result = {"command": sys.argv, "model": args.model, "config": args.config, "machine": machine_info(),
              "losses": losses, "save_s": save_s, "checkpoint_bytes": ckpt_bytes, "convert_command": command,
              "convert_rc": child.returncode, "convert_output_tail": (child.stdout + child.stderr)[-3000:],
              "convert_s": convert_s, "convert_peak_rss_gib": peak_kib / 2**20}  # fmt: skip
    if child.returncode == 0:
        from transformers import OPTForCausalLM

        result["safetensors_bytes"] = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
        loaded = OPTForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32)
        named = dict(loaded.named_parameters())
        differ, worst = [], 0.0
        for name, ref in reference.items():
            got = named[name].detach()
            if got.shape != ref.shape or not torch.equal(got, ref):
                differ.append(name)
                if got.shape == ref.shape:
                    worst = max(worst, (got - ref).abs().max().item())
        result.update(tensors=len(reference), differ=len(differ), first_differing=differ[:10],
                      max_abs_difference=worst)  # fmt: skip
        tokens = batch(10_000, 0, 1, 4, args.seq_len, model.config.vocab_size).to(device)
        with torch.no_grad():
            model.eval()
            engine_loss = model(input_ids=tokens, labels=tokens).loss.float().item()
            hub = loaded.to(device, torch.bfloat16).eval()
            hub_loss = hub(input_ids=tokens, labels=tokens).loss.float().item()
        result.update(engine_loss=engine_loss, hub_loss=hub_loss,
                      loss_relative_difference=abs(hub_loss - engine_loss) / abs(engine_loss))  # fmt: skip
    path = write_json(result, f"portable_convert_check_{args.model}.json", args.out)
    keys = ("convert_rc", "convert_s", "convert_peak_rss_gib", "checkpoint_bytes", "safetensors_bytes", "tensors",
            "differ", "max_abs_difference", "engine_loss", "hub_loss")  # fmt: skip
    print(json.dumps({k: result.get(k) for k in keys}))
    print(f"wrote {path}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
