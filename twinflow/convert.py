"""``python -m twinflow.convert CKPT_DIR TAG [OUT.pt] [--safetensors DIR ...]``: see :mod:`twinflow.checkpoint.convert`
(the optimizer state as a torch.optim state dict) and :mod:`twinflow.checkpoint.consolidate` (the model's weights
as safetensors for ``from_pretrained``)."""

from twinflow.checkpoint.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
