"""twinflow: Adam with a configurable share of the optimizer step on the CPU."""

from twinflow.engine.config import Config, ConfigError, load_config
from twinflow.engine.engine import Engine, initialize
from twinflow.host.ops import BuildError
from twinflow.optim.cpu_adam import CPUAdam
from twinflow.optim.twin_flow_adam import TwinFlowAdam
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
