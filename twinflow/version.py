"""twinflow's version: one place, read by the package, its checkpoints and setup.py."""

__version__ = "0.2.0"
