"""``python -m twinflow.convert CKPT_DIR TAG [OUT.pt] [--safetensors DIR ...]``: see :mod:`twinflow.checkpoint.convert`
(the optimizer state as a torch.optim state dict) and :mod:`twinflow.checkpoint.consolidate` (the model's weights
as safetensors for ``from_pretrained``); a portable checkpoint's: :mod:`twinflow.checkpoint.portable_adamw` and
:mod:`twinflow.checkpoint.portable_consolidate`."""

from twinflow.checkpoint.convert_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
