"""Checkpoints: atomic, verified shards per rank (``save_checkpoint``, ``load_checkpoint``), the compact state
streamed as it is kept, and conversion to torch's AdamW state dict (``python -m twinflow.convert``)."""

from twinflow.checkpoint.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "read_meta", "save_checkpoint"]
