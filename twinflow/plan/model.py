"""The cost model ``ratio="auto"`` plans with: what a ratio is predicted to cost in time, device memory and host
memory, from measured :class:`Inputs` (:mod:`twinflow.plan`'s docstring gives the model in words)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinflow.precision import state_precision as precisions

_INTERFERENCE = 0.25  # share of a hidden CPU step that still lengthens the step (module docstring)
# weights first: the peek's and the commit's time against the single pass's, per state precision
# (benchmarks/bench_peek.py --precision P on an H100 host; BENCHMARKS.md)
PEEK_COMMIT = {"fp32": (0.68, 0.88), "int8": (0.57, 0.88), "int8_m24": (0.70, 0.88)}
_FRACTIONS = [k / 16 for k in range(1, 17)]  # shares of the CPU's chunks that may go weights first


@dataclass
class Inputs:
    """What the choice is made from; every field measured except the counts."""

    elements: int  # parameters
    grad_bytes: int  # bytes of all gradients (the parameters' dtype)
    state_bytes_per_element: float  # device-side optimizer state per element (master + moments)
    temp_bytes: int  # the device step's upcast batch
    released_bytes_per_ratio: int  # gradient bytes backward hands back per unit of ratio (0 when not released)
    first_peak_bytes: int  # peak GPU memory of the first forward + backward
    at_step_bytes: int  # GPU memory in use when the first step() begins (parameters and every gradient)
    budget_bytes: int | None  # what the device can give, less the margin; None: no limit (the device is the CPU)
    forward_s: float
    backward_s: float
    cpu_elements_per_s: float
    gpu_elements_per_s: float  # the device side's Adam, measured where it runs (this CPU when the device is the CPU)
    pcie_bytes_per_s: float
    host_bytes_per_element: float = 0.0  # host memory per CPU-stepped element: state, staging (module docstring)
    host_budget_bytes: float = float("inf")  # what the host can give, less the margin
    state_precision: str = "fp32"
    device_is_cpu: bool = False  # the device side steps on this CPU too, in host memory, on the same cores
    elements_by_dtype: dict[str, int] | None = None  # parameters per dtype name: other precisions' device bytes
    world_size: int = 1  # processes of the job
    sharded: bool = False  # the parameters are shards (FSDP2): more processes each hold less of the model


def predict_host(inputs: Inputs, ratio: float) -> float:
    """Host memory of the CPU share at `ratio` (its state and pinned staging); where the device is the CPU, of
    the device side's state too."""
    cpu_share = ratio * inputs.elements * inputs.host_bytes_per_element
    if inputs.device_is_cpu:
        return cpu_share + (1 - ratio) * inputs.elements * inputs.state_bytes_per_element + inputs.temp_bytes
    return cpu_share


def host_bytes_per_element(precision: str, staging_bytes: float, delayed: bool, speculative: bool) -> float:
    """The CPU share's host memory per element: state in `precision`, pinned staging of `staging_bytes` (the
    parameter's itemsize), twice under the delayed update or speculation, plus speculation's second state set."""
    state = precisions.of(precision)
    speculative = speculative and state.exact  # compact state never speculates
    second_set = 12 if speculative else 0
    return state.host_bytes + staging_bytes * (2 if delayed or speculative else 1) + second_set


def device_bytes(by_dtype: dict[torch.dtype, int], precision: str) -> float:
    """The device side's state bytes per element in `precision`, averaged over the parameters' dtypes."""
    total = sum(by_dtype.values())
    state = precisions.of(precision)
    return sum(n * state.device_bytes(d) for d, n in by_dtype.items()) / max(total, 1)


def predict_peak(inputs: Inputs, ratio: float) -> float:
    """Peak device memory at `ratio` (the module docstring's model)."""
    state = (1 - ratio) * inputs.elements * inputs.state_bytes_per_element + inputs.temp_bytes
    steady = inputs.first_peak_bytes + state - ratio * inputs.released_bytes_per_ratio
    first_step = inputs.at_step_bytes + state  # no gradient has been released before the split exists
    return max(steady, first_step)


def predict_time(
    inputs: Inputs, ratio: float, placement: str, overlap: bool, eager: bool, delayed: bool = False,
    speculative: bool = False, weights_first: bool = False,
) -> float:  # fmt: skip
    cpu = ratio * inputs.elements / inputs.cpu_elements_per_s
    if ratio > 0:
        # the first chunk's download cannot hide behind the kernel
        cpu += min(ratio * inputs.grad_bytes, 128 << 20) / inputs.pcie_bytes_per_s
    gpu = (1 - ratio) * inputs.elements / inputs.gpu_elements_per_s
    f, b = inputs.forward_s, inputs.backward_s
    if inputs.device_is_cpu:  # one set of cores runs both sides and the model: nothing hides behind anything
        return f + b + gpu + cpu
    if delayed:
        window = gpu + f + b
    elif eager or speculative:
        window = b + gpu + (1 - ratio) * f if placement == "last" else ratio * b + gpu + ratio * f
    else:
        window = gpu + (1 - ratio) * f if placement == "last" else gpu + ratio * f

    def with_cpu(critical: float) -> float:  # the step, with `critical` seconds of CPU work after the norm
        if not overlap and not delayed:
            return f + b + max(gpu, critical)
        return f + b + gpu + max(_INTERFERENCE * critical, critical - window)

    single = with_cpu(cpu)
    if not weights_first or delayed or eager or speculative:
        return single
    # weights first for a fraction f of the CPU share (the chunks the next forward needs first; the runtime adapts
    # it): the critical path after the norm shrinks by (1 - P) f C, the CPU's work per step grows by (P + M - 1) f C
    # and must fit in the step
    peek, commit = PEEK_COMMIT[inputs.state_precision]
    return min(single, *(max(with_cpu((1 - (1 - peek) * f) * cpu), (1 + (peek + commit - 1) * f) * cpu)
                         for f in _FRACTIONS))  # fmt: skip


def fits_device(inputs: Inputs, peak_bytes: float) -> bool:
    """Whether a predicted device peak is within the budget (always, where the device has no limit)."""
    return inputs.budget_bytes is None or peak_bytes <= inputs.budget_bytes
