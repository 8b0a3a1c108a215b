"""Where the CPU share's step is (a phase, its transitions in one table) and which chunks are where in it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from twinflow.base.hparams import check_group_flags, check_hyperparams


class Phase(enum.Enum):
    IDLE = "idle"  # no step in flight: every upload waited for
    OPEN = "open"  # gradients arriving
    SEALED = "sealed"  # every gradient known; chunks may still be stepping or uploading


class Way(enum.Enum):
    """The CPU share's strategy for one step (:mod:`twinflow.host.host_modes`, :mod:`twinflow.host.weights_first`)."""

    EXACT = "exact"
    WEIGHTS_FIRST = "weights_first"
    SPECULATIVE = "speculative"
    DELAYED = "delayed"


@dataclass(frozen=True)
class StepMode:
    """How the CPU share runs one step, decided once by the coordinator and handed to the CPU side as it is: the
    strategy, and whether speculation's redo of a clipped step writes the new weights first."""

    way: Way = Way.EXACT
    redo_weights_first: bool = False

    @property
    def name(self) -> str:
        """As people read it: "exact", "weights_first", "speculative", "speculative+weights_first" or "delayed"."""
        return self.way.value + ("+weights_first" if self.redo_weights_first else "")

    @property
    def second_sets(self) -> bool:
        """Whether the step reads or swaps the state's and the gradients' second sets (speculation, delay)."""
        return self.way in (Way.SPECULATIVE, Way.DELAYED)


EXACT = StepMode()


# Every move of the phase, and the phases it may start from.
TRANSITIONS = {
    "open": (Phase.IDLE,),
    "seal": (Phase.OPEN,),  # seal(), discard(), reset()
    "finish": (Phase.SEALED, Phase.IDLE),
}
_TARGET = {"open": Phase.OPEN, "seal": Phase.SEALED, "finish": Phase.IDLE}


@dataclass
class StepArgs:
    """What the kernel needs for one step, fixed when the step is released."""

    groups: list[dict]  # per param group: lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction
    steps: list[int]  # per parameter: its step count after this update
    scale: float | Callable[[], float] = 1.0  # gradient multiplier (clipping); a callable may block

    @classmethod
    def of(cls, param_groups: list[dict], steps: list[int]) -> StepArgs:
        """The step's arguments from torch.optim param groups (hyper-parameters checked, as plain numbers)."""
        groups = []
        for index, group in enumerate(param_groups):
            check_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            check_group_flags(index, group)
            beta1, beta2 = group["betas"]
            groups.append(
                dict(
                    lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["adamw_mode"]),
                    bias_correction=bool(group["bias_correction"]),
                )
            )  # fmt: skip
        return cls(groups=groups, steps=steps)

    def read_scale(self) -> float:
        """The multiplier (blocks until a callable one is known)."""
        return self.scale() if callable(self.scale) else float(self.scale)


class StepRecord:
    """One step's bookkeeping (guarded by the executor's condition): the phase, the parameters whose gradient
    is down, per chunk the gradients still missing, the chunks ready to step, done, and waited for."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.phase = Phase.IDLE
        self.down: set[int] = set()
        self.missing: list[int] = [0] * chunks
        self.ready: list[int] = []
        self.done: list[bool] = [True] * chunks
        self.waited: set[int] = set()
        self.args: StepArgs | None = None  # released: the worker may step with them
        self.scale: float | None = None  # the multiplier, once the worker has read it

    def move(self, transition: str) -> None:
        if self.phase not in TRANSITIONS[transition]:
            raise RuntimeError(f"TwinFlowAdam's CPU share cannot {transition} a step that is {self.phase.value}")
        self.phase = _TARGET[transition]

    def open(self, counts: list[int], args: StepArgs | None) -> None:
        """A new step: `counts[k]` parameters have gradients to land in chunk k; `args` released or None."""
        self.move("open")
        self.down, self.missing, self.ready = set(), list(counts), []
        self.done, self.waited = [False] * self.chunks, set()
        self.args, self.scale = args, None

    def landed(self, i: int, chunks_of_i: list[int]) -> list[int]:
        """Parameter i's gradient is down; returns the chunks that now have every gradient."""
        self.down.add(i)
        full = []
        for k in chunks_of_i:
            self.missing[k] -= 1
            if self.missing[k] == 0:
                full.append(k)
        return full

    def nothing_left(self) -> None:
        """No chunk has anything to step or upload (a discarded, reset or delayed step)."""
        self.ready, self.missing = [], [0] * self.chunks
        self.done = [True] * self.chunks
