"""twinflow: Adam with a configurable share of the optimizer step on the CPU."""

from twinflow.config import Config, ConfigError, load_config
from twinflow.cpu_adam import CPUAdam
from twinflow.engine import Engine, initialize
from twinflow.ops import BuildError
from twinflow.twin_flow_adam import TwinFlowAdam
from twinflow.version import __version__

__all__ = [
    "BuildError",
    "CPUAdam",
    "Config",
    "ConfigError",
    "Engine",
    "TwinFlowAdam",
    "__version__",
    "initialize",
    "load_config",
]
