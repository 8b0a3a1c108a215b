"""Checkpoints: atomic, verified shards per rank (``save_checkpoint``, ``load_checkpoint``), the portable format
another number of processes resumes from (``save_portable``, ``load_portable``, on PyTorch's distributed
checkpoint), the compact state streamed as it is kept, and conversion to torch's AdamW state dict
(``python -m twinflow.convert``)."""

from twinflow.checkpoint.any_format import read_meta
from twinflow.checkpoint.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from twinflow.checkpoint.portable import save_portable
from twinflow.checkpoint.portable_load import load_portable

__all__ = ["CheckpointError", "load_checkpoint", "load_portable", "read_meta", "save_checkpoint", "save_portable"]
