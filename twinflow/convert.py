"""``python -m twinflow.convert CKPT_DIR TAG [OUT.pt] [--safetensors DIR ...] [--to-portable OUT_DIR]``: see
:mod:`twinflow.checkpoint.portable_adamw` (the optimizer state as a torch.optim state dict),
:mod:`twinflow.checkpoint.portable_consolidate` (the model's weights as safetensors for ``from_pretrained``) and
:mod:`twinflow.checkpoint.to_portable` (a per-rank checkpoint of twinflow 0.1.0 rewritten in the portable format)."""

from twinflow.checkpoint.convert_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
