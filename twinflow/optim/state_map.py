"""``TwinFlowAdam.state``: torch.optim's per-parameter state mapping over twinflow's own buffers.

It keeps what is written into it, as torch.optim's ``defaultdict(dict)`` does:
extra keys of a parameter's entry, entries for keys that are not parameters
(a state-dict hook's ``optimizer.state["key"] = value``), across reads,
``state_dict()``/``load_state_dict()`` and copies. The keys twinflow owns
(``step``, ``exp_avg``, ``exp_avg_sq`` and, for bf16/fp16 parameters,
``master``) are the optimizer's own state: a view of its buffer where the
parameter's state is one tensor of float32, otherwise a copy whose in-place
writes reach the buffers before they are next used; assigning one writes it
into the buffers, after checking it against the parameter.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from twinflow.step.split_state import ENTRY_KEYS, SplitState


class ParamState(dict):
    """One parameter's entry of ``opt.state``: twinflow's keys write through to its buffers, others are kept."""

    def __init__(self, states: StateMap, param: torch.Tensor) -> None:
        super().__init__()
        self.states, self.param = states, param

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in ENTRY_KEYS:
            self.states.assign(self.param, key, value)
        else:
            super().__setitem__(key, value)

    def own(self, key: str, value: torch.Tensor | None) -> None:
        """The optimizer's own value of `key` (None: the parameter has none), set without writing it back."""
        if value is None:
            super().pop(key, None)
        else:
            super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        if key in ENTRY_KEYS and key in self:
            raise KeyError(
                f"opt.state[p][{key!r}] is TwinFlowAdam's own state of {self.states.describe(self.param)} and "
                "cannot be deleted alone; reset the parameter's whole state with `del opt.state[p]` (it starts "
                f"afresh at its next step), or write the value you want (opt.state[p][{key!r}].zero_())"
            )
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in ENTRY_KEYS and key in self:
            del self[key]  # raises, saying what to do instead
        return super().pop(key, *default)

    def popitem(self) -> tuple[Any, Any]:
        if not self:
            raise KeyError("popitem(): dictionary is empty")
        key = next(reversed(self))
        return key, self.pop(key)

    def update(self, other: Mapping | Iterable = (), /, **kwargs: Any) -> None:
        for key, value in dict(other, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Mapping | Iterable) -> ParamState:
        self.update(other)
        return self

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def clear(self) -> None:
        """Forgets every key: twinflow's state of the parameter starts afresh, as AdamW's empty entry does."""
        self.states.reset(self.param)

    def __reduce__(self) -> tuple:  # copies, pickles and torch.save see a plain dict
        return (dict, (dict(self),))

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return copy.deepcopy(dict(self), memo)


class StateMap(dict):
    """``opt.state``: parameter -> :class:`ParamState`, any other key -> what was stored under it."""

    def __init__(self) -> None:
        super().__init__()
        self.split: SplitState | None = None
        self.seen = -1  # the split's generation the entries were last taken at

    def bind(self, split: SplitState) -> None:
        """`split` now owns the state (built, or rebuilt with the parameters' state carried over)."""
        self.split, self.seen = split, -1

    def holds(self, key: Any) -> bool:
        """Whether `key` is one of the optimizer's parameters (its entry is a :class:`ParamState`)."""
        return isinstance(key, torch.Tensor) and self.split is not None and id(key) in self.split.index

    def __missing__(self, key: Any) -> dict:
        value = ParamState(self, key) if self.holds(key) else {}
        super().__setitem__(key, value)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        if not self.holds(key):
            super().__setitem__(key, value)
            return
        if not isinstance(value, Mapping):
            raise TypeError(
                f"opt.state[p] = {type(value).__name__} for {self.describe(key)}; expected a dict of its state "
                "(step, exp_avg, exp_avg_sq, any keys of your own)"
            )
        value = detached(value)  # it may hold views of the very buffers the reset clears
        self.reset(key)
        self[key].update(value)

    def __delitem__(self, key: Any) -> None:
        if self.holds(key):
            self.reset(key)
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self:
            return super().pop(key, *default)
        value = detached(self[key]) if isinstance(self[key], ParamState) else self[key]
        del self[key]
        return value

    def clear(self) -> None:
        for key in list(self):
            del self[key]

    def replace(self, value: Mapping) -> None:
        """``opt.state = value``: everything forgotten (parameters start afresh), then `value` written in."""
        if value is not self:
            self.clear()
            self.update(value)

    def update(self, other: Mapping | Iterable = (), /, **kwargs: Any) -> None:
        for key, value in {**dict(other), **kwargs}.items():
            self[key] = value

    def __reduce__(self) -> tuple:  # a copy is torch's own layout: a defaultdict of plain dicts
        return (defaultdict, (dict,), None, None, iter(dict(self).items()))

    # ------------------------------------------------------------ twinflow's keys
    def describe(self, param: torch.Tensor) -> str:
        """The parameter, as an error names it."""
        i = self.split.index[id(param)]
        return f"parameter {i} (shape {tuple(param.shape)}, {str(param.dtype).removeprefix('torch.')})"

    def sync(self) -> None:
        """Brings twinflow's keys up to date with the buffers (after a step, a load, a rebuild)."""
        split = self.split
        if split is None or not split.built or split.step_open:
            return
        split.settle_state()
        if split.generation == self.seen:
            return
        split.absorb_edits()  # in-place writes to the entries about to be replaced
        split.handed.clear()
        for i in range(len(split.params)):
            self.refresh(split, i)
        self.seen = split.generation

    def refresh(self, split: SplitState, i: int) -> None:
        """Parameter i's entry takes twinflow's current values (its own keys stay)."""
        p = split.params[i]
        if split.stepped(i):
            if isinstance(dict.get(self, p), ParamState):  # the old copies go before the new ones are made; the
                old = dict.get(self, p)  # keys stay, values None meanwhile: a caller may be iterating the entry
                for key in ENTRY_KEYS:
                    if key in old:
                        dict.__setitem__(old, key, None)
            entry = split.entry(i, handed=True)
            state = self[p]
            if not isinstance(state, ParamState):  # stored whole by torch or the user: kept, made ours
                state, kept = ParamState(self, p), state
                dict.update(state, {k: v for k, v in kept.items() if k not in ENTRY_KEYS})
                dict.__setitem__(self, p, state)
            for key in ENTRY_KEYS:
                state.own(key, entry.get(key))
        elif p in self:
            for key in ENTRY_KEYS:
                dict.pop(self[p], key, None)

    def written(self, split: SplitState, i: int, current: bool) -> None:
        """After twinflow's own write of parameter i: its entry only is taken again where the others were
        `current` (a loop of writes stays linear), else everything."""
        if current:
            self.refresh(split, i)
            self.seen = split.generation
        else:
            self.sync()

    def _writable(self, param: torch.Tensor) -> tuple[SplitState, int]:
        split = self.split
        if split is None or not split.built:
            raise RuntimeError(
                "TwinFlowAdam has no state yet (ratio='auto' builds it at the first step()); write opt.state "
                "after the first step, or give a ratio"
            )
        if split.offloaded:
            raise RuntimeError(f"opt.state[p] written for {self.describe(param)} while the optimizer's device "
                               "state is offloaded (offload_states()); call reload_states() first")  # fmt: skip
        split.check_settled()
        split.settle()
        split.absorb_edits()  # an earlier in-place write lands first; this one then goes over it
        return split, split.index[id(param)]

    def assign(self, param: torch.Tensor, key: str, value: Any) -> None:
        """``opt.state[param][key] = value`` for a key twinflow owns: checked, then written into the buffers."""
        if self.split is not None and self.split.offloaded and self.unchanged(param, key, value):
            return  # a framework moving the state writes back what it read: nothing changes, the state stays out
        split, i = self._writable(param)
        if key == "step":
            steps = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if isinstance(steps, bool) or not isinstance(steps, int | float) or steps < 0 or steps != int(steps):
                raise ValueError(
                    f"opt.state[p]['step'] = {value!r} for {self.describe(param)}; expected a whole number >= 0 "
                    "(a Python number or a one-element tensor)"
                )
            value = torch.tensor(float(steps))
        else:
            self.check_tensor(param, key, value)
        current = self.seen == split.generation
        split.put(i, {key: value}, (key,))
        self.written(split, i, current)

    def unchanged(self, param: torch.Tensor, key: str, value: Any) -> bool:
        """Whether `value` is what ``opt.state[param][key]`` holds now: equal values, on any device."""
        current = dict.get(dict.get(self, param, {}), key)
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            same = current.dtype == value.dtype and current.shape == value.shape
            return same and torch.equal(value.detach().to(current.device), current)
        return current is not None and not isinstance(value, torch.Tensor) and value == current

    def check_tensor(self, param: torch.Tensor, key: str, value: Any) -> None:
        """Raises, naming the parameter, the key and what is expected, unless `value` can be `param`'s `key`."""
        where = f"opt.state[p][{key!r}] for {self.describe(param)}"
        if key == "master" and param.dtype == torch.float32:
            raise KeyError(
                f"{where}: a float32 parameter is its own master; write the parameter itself instead "
                "(with torch.no_grad(): p.copy_(value))"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} = {type(value).__name__}; expected a tensor shaped like the parameter")
        if tuple(value.shape) != tuple(param.shape) or not value.is_floating_point():
            raise ValueError(
                f"{where}: got a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}; "
                f"expected a floating-point tensor of the parameter's shape {tuple(param.shape)} "
                "(e.g. torch.zeros_like(p, dtype=torch.float32))"
            )

    def reset(self, param: torch.Tensor) -> None:
        """Parameter `param` starts afresh (step 0, zero moments, master from the weight); its own keys go."""
        if not self.split.built:  # ratio='auto' before its first step: no state to reset, only the entry
            dict.__setitem__(self, param, ParamState(self, param))
            return
        split, i = self._writable(param)
        current = self.seen == split.generation
        split.put(i, None)
        dict.__setitem__(self, param, ParamState(self, param))
        self.written(split, i, current)

    # ------------------------------------------------------- state dicts and copies
    def extras(self) -> tuple[dict[int, dict[Any, Any]], dict[Any, Any]]:
        """What was written beyond twinflow's keys: (by parameter index, its own keys), (other key, value)."""
        per_param, other = {}, {}
        for key, value in self.items():
            if isinstance(value, ParamState):
                mine = {k: v for k, v in value.items() if k not in ENTRY_KEYS}
                if mine:
                    per_param[self.split.index[id(key)]] = mine
            else:
                other[key] = value
        return per_param, other

    def restore(self, state: Mapping[Any, Any]) -> None:
        """Replaces everything but twinflow's keys with `state` (torch's loaded state: parameter or other key ->
        value); twinflow's keys in it are ignored (they load into the buffers)."""
        dict.clear(self)  # as torch's load replaces its state: entries come back from the buffers at the next read
        self.seen = -1
        for key, value in state.items():
            if isinstance(self[key], ParamState):
                for k, v in value.items():
                    if k not in ENTRY_KEYS:
                        dict.__setitem__(self[key], k, v)
            else:
                dict.__setitem__(self, key, value)


def detached(entry: Mapping) -> dict:
    """A plain copy of an entry whose twinflow tensors no longer share memory with the optimizer's buffers."""
    return {k: v.clone() if k in ENTRY_KEYS and isinstance(v, torch.Tensor) else v for k, v in entry.items()}
