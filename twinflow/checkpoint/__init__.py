"""Checkpoints in the portable format, which another number of processes resumes from (``save_portable``,
``load_portable``, on PyTorch's distributed checkpoint), the compact state streamed as it is kept; conversion to
torch's AdamW state dict and to safetensors for the hub, and of twinflow 0.1.0's per-rank checkpoints to the
portable format (``python -m twinflow.convert``)."""

from twinflow.checkpoint.any_format import read_meta
from twinflow.checkpoint.checkpoint_files import CheckpointError
from twinflow.checkpoint.portable import save_portable
from twinflow.checkpoint.portable_load import load_portable

__all__ = ["CheckpointError", "load_portable", "read_meta", "save_portable"]
