"""Choosing the ratio from measurements taken on the spot (``ratio="auto"``).

Inputs, measured at the first ``step()`` of a ``TwinFlowAdam(ratio="auto")``:
the peak GPU memory of the first forward and backward (parameters, gradients
and activations, before any optimizer state exists), the memory the device
can still give, the forward and backward times of that iteration (when the
optimizer is attached to the model), and short probes of the CPU kernel's,
the GPU Adam's and PCIe's throughput.

Model, for ratio r over N parameters (C: CPU kernel time, G: GPU Adam time,
F and B: forward and backward time):

- memory: peak(r) = first-iteration peak + (1 - r) N x device state bytes
  (fp32 master and moments) + the upcast batch, less the CPU share's
  gradients when backward releases them (``attach(release_grads=True)``,
  placement "last", whose gradients arrive first);
  and at least what the first step itself needs (every gradient is still on
  the device then, with the new state beside it).
- time, plain steps: F + B + max(G, C).
- time, overlapped: F + B + G + max(k C, C - W), where W is the time the CPU
  has before the next forward needs its weights: eager and placement "last":
  B + G + (1 - r) F (its gradients come first in backward, its weights are
  needed last in forward); eager and "first": r B + G + r F; with clipping or
  fp16 (updates wait for the whole backward): G + (1 - r) F, or G + r F;
  with the delayed update (``delay_after``, attached or not): G + F + B (a
  step's CPU update runs through the device step and the next iteration);
  speculating under clipping (``speculate``, attached): the eager window,
  which holds while steps do not clip (once they keep clipping, speculation
  turns itself off and the clipping window applies).
  k = 0.25 is the part of the CPU's work that shows on the critical path even
  when it fits the window (the worker's threads and copies slow the thread
  that drives the GPU; on an H100 host, ratio 0.2 measured 0.251 s per step
  against 0.221 s at ratio 0, where a perfect overlap predicts no cost).

- host memory: host(r) = r N x (the CPU share's state bytes per element in
  its ``state_precision``: 12, 6.008 or 5.008; + its pinned staging, the
  parameter's bytes, twice with the delayed update or speculation; + 12
  for speculation's second state set). The host budget is what the host can
  still give when the first step begins (``MemAvailable``, or less under a
  cgroup limit), less ``margin`` of it, split evenly between the job's
  ranks on the host (torchrun's ``LOCAL_WORLD_SIZE``).

The choice: among ratios whose predicted peak fits the memory budget (what
the device can give, or a smaller ``budget`` in bytes, less ``margin`` of it)
and whose host memory fits the host budget, the fastest; where several are
predicted within 2% of the fastest, the smallest of them. (Measured on an
H100: where the model predicts the CPU's work fully hidden, the ratio at the
edge of that region was 30% slower than ratio 0, so the choice does not trade
predicted-free time for memory headroom.)
``python -m twinflow.tune`` runs this for an OPT model and prints the
decision and a table of predicted against measured step time.

When no ratio fits both budgets, ``ratio="auto"`` raises rather than guess
(a host out of memory kills the process): the error gives the ratios each
budget allows and what the compact state precisions would allow, which the
user may opt into; auto never changes the precision itself.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from twinflow import compact, ops
from twinflow.device_side import UPCAST_ELEMENTS

log = logging.getLogger(__name__)

_TIE = 0.02  # predicted times within 2% of the best count as equal
_INTERFERENCE = 0.25  # share of a hidden CPU step that still lengthens the step (module docstring)
_PROBE_ELEMENTS = 1 << 26  # 1 GiB of fp32 state: well past a 300 MiB L3, which would flatter the kernel


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
    budget_bytes: int  # what the device can give, less the margin
    forward_s: float
    backward_s: float
    cpu_elements_per_s: float
    gpu_elements_per_s: float
    pcie_bytes_per_s: float
    host_bytes_per_element: float = 0.0  # host memory per CPU-stepped element: state, staging (module docstring)
    host_budget_bytes: float = float("inf")  # what the host can give, less the margin
    state_precision: str = "fp32"


def predict_host(inputs: Inputs, ratio: float) -> float:
    """Host memory of the CPU share at `ratio`: its state and pinned staging."""
    return ratio * inputs.elements * inputs.host_bytes_per_element


def host_bytes_per_element(precision: str, staging_bytes: float, delayed: bool, speculative: bool) -> float:
    """The CPU share's host memory per element: state in `precision`, pinned staging of `staging_bytes` (the
    parameter's itemsize), twice under the delayed update or speculation, plus speculation's second state set."""
    speculative = speculative and precision == "fp32"  # compact state never speculates
    second_set = 12 if speculative else 0
    return compact.BYTES_PER_ELEMENT[precision] + staging_bytes * (2 if delayed or speculative else 1) + second_set


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cgroup_room(limit: str | None, usage: str | None, stat: str | None, inactive_key: str) -> float:
    """A cgroup's limit less its usage, page cache it can drop (inactive file pages) not counted as used."""
    if limit is None or usage is None or not limit.strip().isdigit():  # "max" (v2) or unreadable: no limit
        return float("inf")
    if int(limit) >= 1 << 60:  # cgroup v1 writes "no limit" as a huge number
        return float("inf")
    stats = dict(line.split() for line in (stat or "").splitlines() if len(line.split()) == 2)
    used = int(usage) - int(stats.get(inactive_key, 0))
    return float(max(0, int(limit) - used))


def host_available_bytes(root: str = "/") -> float:
    """What this process may still take of host memory: MemAvailable, or less under its cgroup's limit (v2: the
    group /proc/self/cgroup names, else the root group; v1: the memory controller's). inf where none can be read.
    `root`: prefixed to every path (tests)."""
    available = float("inf")
    for line in (_read(f"{root}proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    groups = [line.split(":", 2)[2] for line in (_read(f"{root}proc/self/cgroup") or "").splitlines()
              if line.startswith("0::")]  # fmt: skip
    for group in [g.strip().strip("/") for g in groups] + [""]:
        base = f"{root}sys/fs/cgroup/{group}/".replace("//", "/")
        if _read(base + "memory.max") is not None:
            room = _cgroup_room(_read(base + "memory.max"), _read(base + "memory.current"),
                                _read(base + "memory.stat"), "inactive_file")  # fmt: skip
            return min(available, room)
    v1 = f"{root}sys/fs/cgroup/memory/"
    room = _cgroup_room(_read(v1 + "memory.limit_in_bytes"), _read(v1 + "memory.usage_in_bytes"),
                        _read(v1 + "memory.stat"), "total_inactive_file")  # fmt: skip
    return min(available, room)


def local_ranks() -> int:
    """Processes of this job on this host (torchrun's LOCAL_WORLD_SIZE; 1 without it): they share its memory."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class NoRatioFits(ValueError):
    """ratio="auto" found no ratio within both the device's and the host's memory budgets."""


def predict_peak(inputs: Inputs, ratio: float) -> float:
    state = (1 - ratio) * inputs.elements * inputs.state_bytes_per_element + inputs.temp_bytes
    steady = inputs.first_peak_bytes + state - ratio * inputs.released_bytes_per_ratio
    first_step = inputs.at_step_bytes + state  # no gradient has been released before the split exists
    return max(steady, first_step)


def predict_time(
    inputs: Inputs, ratio: float, placement: str, overlap: bool, eager: bool, delayed: bool = False,
    speculative: bool = False,
) -> float:  # fmt: skip
    cpu = ratio * inputs.elements / inputs.cpu_elements_per_s
    if ratio > 0:
        # the first chunk's download cannot hide behind the kernel
        cpu += min(ratio * inputs.grad_bytes, 128 << 20) / inputs.pcie_bytes_per_s
    gpu = (1 - ratio) * inputs.elements / inputs.gpu_elements_per_s
    f, b = inputs.forward_s, inputs.backward_s
    if not overlap and not delayed:
        return f + b + max(gpu, cpu)
    if delayed:
        window = gpu + f + b
    elif eager or speculative:
        window = b + gpu + (1 - ratio) * f if placement == "last" else ratio * b + gpu + ratio * f
    else:
        window = gpu + (1 - ratio) * f if placement == "last" else gpu + ratio * f
    return f + b + gpu + max(_INTERFERENCE * cpu, cpu - window)


def choose_ratio(
    inputs: Inputs, placement: str, overlap: bool, eager: bool, grid: int = 100, delayed: bool = False,
    speculative: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The decision and what it rests on (see the module docstring for the rule)."""
    ratios = [k / grid for k in range(grid + 1)]
    table = [
        {
            "ratio": r,
            "time_s": predict_time(inputs, r, placement, overlap, eager, delayed, speculative),
            "peak_bytes": predict_peak(inputs, r),
            "host_bytes": predict_host(inputs, r),
        }
        for r in ratios
    ]
    on_host = [row for row in table if row["host_bytes"] <= inputs.host_budget_bytes]
    fits = [row for row in on_host if row["peak_bytes"] <= inputs.budget_bytes]
    if not fits and len(on_host) < len(table):
        raise NoRatioFits(_no_ratio_message(inputs, table, on_host, delayed, speculative))
    if not fits:
        log.warning("ratio='auto': even ratio 1 is predicted over the memory budget; choosing 1")
        best = table[-1]
        chosen = best
    else:
        best = min(fits, key=lambda row: row["time_s"])
        chosen = min((row for row in fits if row["time_s"] <= best["time_s"] * (1 + _TIE)), key=lambda r: r["ratio"])
    return {
        "ratio": chosen["ratio"],
        "predicted_time_s": chosen["time_s"],
        "predicted_peak_bytes": chosen["peak_bytes"],
        "predicted_host_bytes": chosen["host_bytes"],
        "fastest_fitting_ratio": best["ratio"],
        "placement": placement,
        "overlap": overlap,
        "eager": eager,
        "delayed": delayed,
        "speculative": speculative,
        "inputs": asdict(inputs),
    }


def _no_ratio_message(inputs: Inputs, table: list[dict], on_host: list[dict], delayed: bool,
                      speculative: bool) -> str:  # fmt: skip
    gib = 1 << 30
    on_device = [row["ratio"] for row in table if row["peak_bytes"] <= inputs.budget_bytes]
    need = f"at least {min(on_device):.2f}" if on_device else "more than 1 (none fits)"
    host_max = max((row["ratio"] for row in on_host), default=None)
    holds = f"at most {host_max:.2f}" if host_max is not None else "none, not even 0"
    staging = inputs.grad_bytes / max(inputs.elements, 1)
    options = []
    for precision in compact.PRECISIONS:
        if compact.BYTES_PER_ELEMENT[precision] < compact.BYTES_PER_ELEMENT[inputs.state_precision]:
            per = host_bytes_per_element(precision, staging, delayed, speculative)
            limit = inputs.host_budget_bytes / (inputs.elements * per)
            options.append(f"state_precision={precision!r} ({per:.1f} bytes: ratio up to {min(1.0, limit):.2f})")
    fix = ("; the CPU share's state can be made smaller (opt-in, not exact): " + ", ".join(options)) if options else ""
    return (
        f"ratio='auto': no ratio fits both memories. The device budget ({inputs.budget_bytes / gib:.1f} GiB) needs "
        f"ratio {need}; the host can still give {inputs.host_budget_bytes / gib:.1f} GiB after the margin, which at "
        f"{inputs.host_bytes_per_element:.1f} bytes per CPU-stepped parameter (state_precision="
        f"{inputs.state_precision!r}, pinned staging included) holds ratio {holds}. Free host or device memory, or "
        f"set memory_budget/memory_margin{fix}"
    )


def _timed(fn, repeats: int, cuda: bool) -> float:
    """Best of `repeats` after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_kernel_rate(num_threads: int | None, elements: int = _PROBE_ELEMENTS, state_precision: str = "fp32") -> float:
    """Elements per second of the CPU kernel (bf16 gradient in, bf16 weight out), on fresh host memory, with the
    state in `state_precision` ("fp32", "int8" or "int8_m24")."""
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(elements, generator=gen), torch.randn(elements, generator=gen).bfloat16()
    params, extra = [p], {}
    if state_precision == "fp32":
        moments, kernel = [torch.zeros(elements), torch.zeros(elements)], ops.adam_step_
    else:
        moments, kernel = compact.fresh(elements), ops.adam_step_q8_
        if state_precision == "int8_m24":
            params, extra = compact.kernel_masters([compact.Master24.empty(elements).copy_(p)])
    step = [0]

    def run() -> None:
        step[0] += 1
        kernel(params, [g], *([t] for t in moments), [step[0]], lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8,
               out_copies=[g], num_threads=num_threads, **extra)  # fmt: skip

    return elements / _timed(run, 3, cuda=False)


def gpu_adam_rate(device: torch.device, elements: int) -> float:
    """Elements per second of the device side's step (upcast, fused AdamW, copy back)."""
    if device.type != "cuda":
        return float("inf")
    w = torch.randn(elements, device=device, dtype=torch.bfloat16)
    master, m, v = w.float(), torch.zeros(elements, device=device), torch.zeros(elements, device=device)
    grad, step = torch.randn_like(w), torch.zeros((), device=device)

    def run() -> None:
        torch._fused_adamw_([master], [grad.float()], [m], [v], [], [step], lr=1e-5, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
        w.copy_(master)

    return elements / _timed(run, 3, cuda=True)


def pcie_rate(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Device-to-host bytes per second into pinned memory."""
    if device.type != "cuda":
        return float("inf")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return nbytes / _timed(lambda: dst.copy_(src, non_blocking=True), 3, cuda=True)


class IterationProbe:
    """Watches the first iteration for ``ratio="auto"``: its peak memory and, once attached, its times."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._handles: list[Any] = []
        self._marks: dict[str, float] = {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def attach(self, model: torch.nn.Module) -> None:
        """Times the forwards of `model` until the first step(); the backward ends at step()."""

        # The last forward before step() counts: a warm-up forward and backward
        # (then zero_grad) keeps one-time start-up costs out of the timings.
        def start(*_: Any) -> None:
            self._marks["forward_start"] = self._now()

        def end(*_: Any) -> None:
            self._marks["forward_end"] = self._now()

        self._handles = [model.register_forward_pre_hook(start), model.register_forward_hook(end)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def decide(
        self,
        params: list[torch.Tensor],
        *,
        placement: str,
        eager: bool,
        release_grads: bool,
        margin: float,
        budget: int | None,
        num_threads: int | None,
        upcast_elements: int = UPCAST_ELEMENTS,
        delayed: bool = False,
        speculative: bool = False,
        state_precision: str = "fp32",
    ) -> dict[str, Any]:
        step_start = self._now()
        overlap = "forward_end" in self._marks
        forward = self._marks["forward_end"] - self._marks["forward_start"] if overlap else 0.0
        backward = step_start - self._marks["forward_end"] if overlap else 0.0
        elements = sum(p.numel() for p in params)
        low = sum(p.numel() for p in params if p.dtype != torch.float32)
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            capacity = free + torch.cuda.memory_reserved(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            at_step = torch.cuda.memory_allocated(self.device)
            host_budget = host_available_bytes() * (1 - margin) / local_ranks()  # each rank its share
        else:  # both sides' state is in host memory then: the ratio does not change how much
            capacity, peak, at_step, host_budget = 1 << 62, 0, 0, float("inf")
        # The margin stays free below whichever limit applies (a 30 GiB budget plans for 27 GiB at margin 0.1).
        budget = int((capacity if budget is None else min(capacity, int(budget))) * (1 - margin))
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        inputs = Inputs(
            elements=elements,
            grad_bytes=grad_bytes,
            state_bytes_per_element=(12 * low + 8 * (elements - low)) / max(elements, 1),
            temp_bytes=min(low, upcast_elements) * 4,
            # With "first" the CPU share's gradients come last in backward, after the memory peak may have
            # passed: only "last" counts on their release.
            released_bytes_per_ratio=grad_bytes if release_grads and placement == "last" else 0,
            first_peak_bytes=peak,
            at_step_bytes=at_step,
            budget_bytes=budget,
            forward_s=forward,
            backward_s=backward,
            cpu_elements_per_s=cpu_kernel_rate(num_threads, state_precision=state_precision),
            gpu_elements_per_s=gpu_adam_rate(self.device, min(elements, 1 << 22) or 1),
            pcie_bytes_per_s=pcie_rate(self.device),
            host_bytes_per_element=host_bytes_per_element(
                state_precision, grad_bytes / max(elements, 1), delayed, speculative
            ),  # fmt: skip
            host_budget_bytes=host_budget,
            state_precision=state_precision,
        )
        decision = choose_ratio(inputs, placement, overlap, eager, delayed=delayed, speculative=speculative)
        decision["release_grads"], decision["state_precision"] = release_grads, state_precision
        return decision
