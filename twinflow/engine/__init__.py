"""The DeepSpeed-shaped way in: the JSON config and its schema, DeepSpeed's LR schedules, and the engine."""

from twinflow.engine.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
