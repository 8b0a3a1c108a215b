"""The optimizer's state over whole parameters, through the sides that keep their parts.

:class:`WholeParams` is the half of :class:`twinflow.step.split_state.SplitState` that makes the split a
:class:`twinflow.precision.state_owner.StateOwner` of its own: a parameter's elements [0, n), read, written and
handed out raw by asking each side (the CPU share's owner, the device's) for its range of them, in its precision.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from twinflow.precision.state_owner import RawPart, StateOwner


class WholeParams:
    """A :class:`StateOwner` over whole parameters, composed of the owners that hold their parts: what the split
    gives it is declared below (``sides(i)``: the owners holding part of parameter i; ``weight(i)``: the
    parameter as this process holds it, where it can be read now)."""

    locals: list[torch.Tensor]
    steps: list[int]
    has_state: list[bool]
    device_state: StateOwner | None

    def sides(self, i: int) -> list[StateOwner]:
        raise NotImplementedError

    def weight(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    @property
    def offloaded(self) -> bool:
        raise NotImplementedError

    def holds(self, i: int) -> bool:
        """Whether parameter i has state: it was stepped (or given state) and takes part in the split."""
        return self.has_state[i] and bool(self.sides(i))

    stepped = holds

    def range(self, i: int) -> tuple[int, int]:
        """All of parameter i's elements (as this process holds it)."""
        return 0, self.locals[i].numel()

    def view(self, i: int, key: str) -> torch.Tensor | None:
        """A live float32 view of parameter i's `key`, where one side keeps it whole in float32 (not while a
        stand-in serves the device state: ``opt.state`` then takes copies), else None."""
        sides = self.sides(i)
        return sides[0].view(i, key) if len(sides) == 1 and not self.offloaded else None

    def read(
        self, i: int, key: str, out: torch.Tensor | None = None, lo: int = 0, hi: int | None = None
    ) -> torch.Tensor:
        """Parameter i's `key` in float32, host memory (into `out` if given), or its elements [lo, hi): each side's
        share of them decoded straight into it."""
        hi = self.locals[i].numel() if hi is None else hi
        out = torch.empty(hi - lo, dtype=torch.float32) if out is None else out
        for side in self.sides(i):
            start, end = side.range(i)
            a, b = max(start, lo), min(end, hi)
            if a < b:
                side.read(i, key, out[a - lo : b - lo], a - start, b - start)
        return out

    def write(self, i: int, values: dict[str, torch.Tensor | None]) -> None:
        """Sets `values` (flat over parameter i; a moment None: fresh) on each side, in its precision."""
        for side in self.sides(i):
            start, end = side.range(i)
            side.write(i, {k: v[start:end] if v is not None else None for k, v in values.items()})

    def raw(self, i: int) -> list[RawPart]:
        """Parameter i's parts on both sides, as kept, in order: they cover it; each with its weight's elements."""
        flat = self.weight(i).view(-1)
        parts = [part if part.weight is not None else replace(part, weight=flat[part.start : part.end])
                 for side in self.sides(i) for part in side.raw(i)]  # fmt: skip
        return sorted(parts, key=lambda part: part.start)

    def set_step(self, i: int, steps: int) -> None:
        """Parameter i has taken `steps` steps: it has state; the device side counts them too."""
        self.steps[i], self.has_state[i] = steps, True
        if self.device_state is not None:
            self.device_state.set_step(i, steps)
