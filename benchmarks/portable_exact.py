"""Whether a portable checkpoint's load gives the saved state back to the bit on a GPU, and whether the steps after
it are deterministic: an OPT model under ``twinflow.initialize`` with a config, in one process.

    torchrun --standalone --nproc-per-node 1 benchmarks/portable_exact.py \
        --config benchmarks/configs/opt-2.7b-x1-int8_m24-r0.5.json --ckpt /tmp/ckx --model opt-125m

Three engines: A (seed 0) trains --before steps, saves, trains --after more; C (seed 0) trains the same steps
without a save (A against C: whether training itself repeats to the bit); B (seed 1) loads A's checkpoint, its
weights and optimizer state compared with A's right after the save, tensor by tensor, then trains the --after
steps (B against A: whether a load continues the run). --asynchronous: A's save is asynchronous and A trains the
--after steps while it is written (B against A's state when the save began). Writes JSON (--out, else $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
import twinflow  # noqa: E402
from benchmarks.bench_resume import train  # noqa: E402
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow.base.distributed import local  # noqa: E402
from twinflow.models import build_opt  # noqa: E402


def engine_of(args: argparse.Namespace, config: dict, seed: int) -> tuple:
    torch.manual_seed(seed)
    model = build_opt(args.model, "cuda", torch.bfloat16)
    engine, *_ = twinflow.initialize(model=model, config=json.loads(json.dumps(config)))
    return engine, model


def snapshot(engine, model: torch.nn.Module) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The weights and the optimizer's state (as state_dict() gives it: decoded), each tensor on the host."""
    out = {f"w.{k}": local(v.detach()).cpu().clone() for k, v in model.state_dict().items()}
    for i, entry in engine.local_optimizer.state_dict()["state"].items():
        out.update({f"s.{i}.{k}": local(v).detach().cpu().clone() for k, v in entry.items()
                    if isinstance(v, torch.Tensor)})  # fmt: skip
    return out


def compared(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    differ = [k for k in a if k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    return {"tensors": len(a), "differ": len(differ), "first_differing": differ[:10],
            "missing_in_loaded": sorted(set(a) - set(b))[:10]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-125m")
    parser.add_argument("--config", required=True)
    parser.add_argument("--ckpt", required=True, type=Path)
    parser.add_argument("--before", type=int, default=3)
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--asynchronous", action="store_true",
                        help="A's save is asynchronous: B is compared with A's state when the save began")  # fmt: skip
    parser.add_argument("--skip-repeat", action="store_true", help="no engine C (whether training repeats)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    config.update(train_micro_batch_size_per_gpu=args.global_batch, gradient_accumulation_steps=1)
    if "LOCAL_RANK" in os.environ:
        torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(0)
    run = {"model": args.model, "config": args.config, "machine": machine_info()}
    a, model_a = engine_of(args, config, 0)
    vocab = model_a.config.vocab_size
    before, after = range(args.before), range(args.before, args.before + args.after)
    run["a_before"] = train(a, before, args, 0, 1, "cuda", vocab)[0]
    if args.asynchronous:  # the state when the save began; the AFTER steps change it while it is written
        saved = snapshot(a, model_a)
        a.save_checkpoint(args.ckpt, "x", asynchronous=True)
        run["a_after"] = train(a, after, args, 0, 1, "cuda", vocab)[0]
        a.wait_checkpoint()
    else:
        a.save_checkpoint(args.ckpt, "x")
        saved = snapshot(a, model_a)
        run["a_after"] = train(a, after, args, 0, 1, "cuda", vocab)[0]
    del a, model_a
    if not args.skip_repeat:
        c, model_c = engine_of(args, config, 0)
        run["c_before"] = train(c, before, args, 0, 1, "cuda", vocab)[0]
        run["c_after"] = train(c, after, args, 0, 1, "cuda", vocab)[0]
        del c, model_c
    b, model_b = engine_of(args, config, 1)
    train(b, range(100, 101), args, 0, 1, "cuda", vocab)  # built, with state of its own that the load replaces
    b.load_checkpoint(args.ckpt, "x")
    run["b_loaded_against_a_saved"] = compared(saved, snapshot(b, model_b))
    run["b_after"] = train(b, after, args, 0, 1, "cuda", vocab)[0]
    run["training_repeats"] = (None if args.skip_repeat else
                               run["a_after"] == run["c_after"] and run["a_before"] == run["c_before"])  # fmt: skip
    run["load_continues_exactly"] = run["b_after"] == run["a_after"]
    path = write_json(run, f"portable_exact_{args.model}.json", args.out)
    print(json.dumps({k: run[k] for k in ("b_loaded_against_a_saved", "training_repeats", "load_continues_exactly",
                                          "a_after", "b_after", "c_after") if k in run}))  # fmt: skip
    print(f"wrote {path}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
