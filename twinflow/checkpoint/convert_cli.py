"""The command line of ``python -m twinflow.convert`` (see :mod:`twinflow.checkpoint.portable_adamw` for OUT.pt,
:mod:`twinflow.checkpoint.portable_consolidate` for --safetensors, :mod:`twinflow.checkpoint.to_portable` for
--to-portable): which converter a checkpoint goes to, by its format."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from twinflow.checkpoint.any_format import per_rank, rewrite_command
from twinflow.checkpoint.checkpoint_files import CheckpointError, format_bytes
from twinflow.checkpoint.portable import holds
from twinflow.checkpoint.portable_adamw import convert_portable
from twinflow.checkpoint.portable_consolidate import consolidate_portable
from twinflow.checkpoint.safetensors_out import parse_size
from twinflow.checkpoint.to_portable import to_portable


def _convert(args: argparse.Namespace) -> int:
    """OUT.pt and --safetensors DIR of a portable checkpoint, as asked."""
    if args.out is not None:
        out = convert_portable(args.directory, args.tag, args.out)
        print(f"wrote {out} ({format_bytes(out.stat().st_size)})")
    if args.safetensors is not None:
        written = consolidate_portable(args.directory, args.tag, args.safetensors, args.dtype, args.max_shard_size,
                                       args.hf_config, progress=True)  # fmt: skip
        size = sum(path.stat().st_size for path in written)
        print(f"wrote {len(written)} files to {args.safetensors} ({format_bytes(size)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m twinflow.convert",
        description="Writes a twinflow checkpoint's optimizer state as a torch.optim state dict (float32 "
        "exp_avg, exp_avg_sq, step; master for bf16/fp16 parameters) to OUT.pt, and/or (--safetensors DIR) the "
        "model's consolidated weights as safetensors that Hugging Face from_pretrained loads: the optimizer's "
        "float32 masters where it keeps them, merged across ranks (FSDP2 shards, ZeRO-1). Both are streamed with "
        "bounded memory. A per-rank checkpoint (twinflow 0.1.0's) is first rewritten with --to-portable.",
    )
    parser.add_argument("directory", help="the checkpoint directory (the one given to save_checkpoint)")
    parser.add_argument("tag", help="the checkpoint's tag, or 'latest'")
    parser.add_argument("out", nargs="?", help="the optimizer state file to write (read it with torch.load); "
                        "optional with --safetensors")  # fmt: skip
    parser.add_argument("--safetensors", metavar="DIR", help="also write the model's weights to DIR: "
                        "model.safetensors, or several files and model.safetensors.index.json")  # fmt: skip
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                        help="the floating weights' dtype in --safetensors (default fp32)")  # fmt: skip
    parser.add_argument("--max-shard-size", default=None, help="the largest safetensors file, e.g. 5GB, "
                        "500MB, 2GiB (default 5GB; a larger tensor gets a file of its own)")  # fmt: skip
    parser.add_argument("--hf-config", metavar="HF_DIR", help="a folder with the model's config.json (e.g. "
                        "from model.config.save_pretrained): copied into --safetensors DIR, so that "
                        "AutoModelForCausalLM.from_pretrained(DIR) works directly")  # fmt: skip
    parser.add_argument("--to-portable", metavar="OUT_DIR", help="a per-rank checkpoint (twinflow 0.1.0's): "
                        "rewrite it in the portable format in OUT_DIR (a checkpoint directory), which any number "
                        "of processes resumes from")  # fmt: skip
    parser.add_argument("--out-tag", help="--to-portable: the converted checkpoint's tag (default: TAG's)")
    args = parser.parse_args(argv)
    given = (args.out, args.safetensors, args.dtype, args.max_shard_size, args.hf_config)
    if args.to_portable is not None and any(value is not None for value in given):
        parser.error("--to-portable goes alone: convert the portable checkpoint it writes to OUT.pt or --safetensors")
    args.dtype, args.max_shard_size = args.dtype or "fp32", args.max_shard_size or "5GB"
    if args.out_tag is not None and args.to_portable is None:
        parser.error("--out-tag goes with --to-portable OUT_DIR")
    if args.out is None and args.safetensors is None and args.to_portable is None:
        parser.error("give OUT.pt, --safetensors DIR (or both), or --to-portable OUT_DIR")
    if args.hf_config is not None and args.safetensors is None:
        parser.error("--hf-config goes with --safetensors DIR")
    try:
        parse_size(args.max_shard_size)
    except ValueError as exc:
        parser.error(f"--max-shard-size: {exc}")
    try:
        if args.to_portable is not None:
            if holds(Path(args.directory), args.tag):
                print(f"error: {args.directory} {args.tag} is already portable: load it as it is", file=sys.stderr)
                return 1
            folder = to_portable(args.directory, args.tag, args.to_portable, args.out_tag, progress=True)
            print(f"wrote {folder}: a portable checkpoint, which any number of processes resumes from")
            return 0
        found = per_rank(args.directory, args.tag)
        if found is not None:
            print(f"error: {args.directory} {found[0]} is a per-rank checkpoint (twinflow 0.1.0's): rewrite it in the "
                  f"portable format first, `{rewrite_command(args.directory, found[0])}`, then convert OUT_DIR",
                  file=sys.stderr)  # fmt: skip
            return 1
        return _convert(args)
    except (CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
