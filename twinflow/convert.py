"""``python -m twinflow.convert CKPT_DIR TAG OUT.pt``: see :mod:`twinflow.checkpoint.convert`."""

from twinflow.checkpoint.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
