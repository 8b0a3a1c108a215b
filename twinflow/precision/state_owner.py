"""The one interface of the optimizer state's owners: whoever keeps masters and moments, in its precision.

The CPU share's state (:class:`twinflow.host.host_state.HostState`), the device's (fp32:
:class:`twinflow.device.device_side.DeviceState`; compact: :class:`twinflow.device.device_compact.CompactDeviceState`)
and the split that combines them over whole parameters (:class:`twinflow.step.split_state.SplitState`) are each a
:class:`StateOwner`. A caller asks an owner for a parameter's elements in float32 (``read``, ``view``, ``write``)
or as they are kept (``raw``: codes, block scales and the master's form), never for its precision's name or the
tensors behind it. The optimizer hands its state out as an :class:`OptimizerState`
(``TwinFlowAdam.state_owner``): the checkpoint reads and writes the state through it only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from twinflow.precision.state_precision import StatePrecision

# The kinds of master a raw part keeps (RawPart.kind)
M24, FP32, RESIDUAL, WEIGHT = "m24", "fp32", "residual", "weight"


@dataclass
class RawPart:
    """Elements [start, end) of a parameter as an owner keeps them (compact state): live views of the moments'
    codes and block scales (exp_avg's int8 codes and uint8 scales, then exp_avg_sq's, counted from `start`), the
    master's tensors by `kind` ("m24": hi and lo; "fp32": a float32 master; "residual": the weight and its
    residual byte; "weight": the weight is the master), and the weight's elements (None where the owner does not
    hold the weights: the split that combines the owners fills them in)."""

    start: int
    end: int
    codes: list[torch.Tensor]
    kind: str
    master: tuple[torch.Tensor, ...]
    weight: torch.Tensor | None = None

    def form(self, dtype: torch.dtype) -> str:
        """The form its masters are saved in (a float32 parameter's: none, its weight holds them)."""
        return "none" if dtype == torch.float32 else M24 if self.kind in (M24, RESIDUAL) else FP32


@runtime_checkable
class StateOwner(Protocol):
    """Keeps (part of) the parameters' masters and moments, by parameter index, in its own precision.

    Keys are ``exp_avg``, ``exp_avg_sq`` and ``master``; values are flat over the elements :meth:`range` gives.
    """

    @property
    def precision(self) -> StatePrecision:
        """The precision the state is kept in (as built: a setting changed since applies at a rebuild)."""
        ...

    def holds(self, i: int) -> bool:
        """Whether it keeps state of parameter i."""
        ...

    def range(self, i: int) -> tuple[int, int]:
        """The elements [start, end) of parameter i it keeps."""
        ...

    def view(self, i: int, key: str) -> torch.Tensor | None:
        """A live float32 view of parameter i's `key`, where one is kept, else None."""
        ...

    def read(
        self, i: int, key: str, out: torch.Tensor | None = None, lo: int = 0, hi: int | None = None
    ) -> torch.Tensor:
        """Parameter i's `key` in float32 (into `out` if given, flat, host memory): the elements it keeps, or those
        [lo, hi) of them (counted from the first it keeps)."""
        ...

    def write(self, i: int, values: dict[str, torch.Tensor | None]) -> None:
        """Sets `values` of parameter i (a moment None: fresh) in the precision kept."""
        ...

    def raw(self, i: int) -> list[RawPart]:
        """Parameter i's state as it is kept, in order (compact state only: fp32 state has no codes), for a
        checkpoint to copy out or in unchanged."""
        ...

    def set_step(self, i: int, steps: int) -> None:
        """Parameter i has taken `steps` steps (an owner that counts none ignores it)."""
        ...


@runtime_checkable
class OptimizerState(StateOwner, Protocol):
    """The optimizer's whole state: a :class:`StateOwner` over whole parameters (it holds a parameter once it
    has state, over all of its elements), with the parameters as this process holds them, their step counts,
    and what a reader or writer of the raw state must do around it."""

    @property
    def built(self) -> bool:
        """Whether the state exists (ratio='auto' builds it at the first step)."""
        ...

    @property
    def locals(self) -> list[torch.Tensor]:
        """The parameters, in order, as this process holds them (a DTensor's local shard)."""
        ...

    @property
    def steps(self) -> list[int]:
        """Each parameter's step count."""
        ...

    def check_settled(self, unbuilt_ok: bool = False) -> None:
        """Raises unless the state exists and no step is half done."""
        ...

    def settle_state(self) -> None:
        """Every update taken so far is in the masters and moments."""
        ...

    def absorb_edits(self) -> None:
        """In-place writes to the copies ``opt.state`` handed out reach the state (before it is read whole)."""
        ...

    def put(self, i: int, entry: dict[str, torch.Tensor] | None, *, weights_follow: bool = True) -> None:
        """Sets parameter i's state from `entry` in torch.optim's layout (``step``, ``exp_avg``, ``exp_avg_sq``,
        ``master`` where kept; None: fresh), as a load does; a master written also sets the weight
        (`weights_follow`: False where the weight was set exactly already, as a checkpoint's)."""
        ...

    def loaded_raw(self, steps: dict[int, int]) -> None:
        """After the raw state of the parameters `steps` names was written: their step counts; others start
        afresh."""
        ...
