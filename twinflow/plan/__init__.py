"""Choosing the ratio from measurements taken on the spot (``ratio="auto"``).

Inputs, measured at the first ``step()`` of a ``TwinFlowAdam(ratio="auto")``:
the peak GPU memory of the first forward and backward (parameters, gradients
and activations, before any optimizer state exists), the memory the device
can still give, the forward and backward times of that iteration (when the
optimizer is attached to the model), and short probes of the CPU kernel's,
the GPU Adam's and PCIe's throughput.

Model, for ratio r over N parameters (C: CPU kernel time, G: GPU Adam time,
F and B: forward and backward time; its arithmetic is :mod:`twinflow.plan.model`):

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
  With ``weights_first`` (not eager, delayed or speculative), a share f of
  the CPU's chunks (those the next forward needs first) peeks and commits,
  the rest take the single pass: the CPU's work after the norm is
  (1 - (1 - P) f) C, and its whole work per step, (1 + (P + M - 1) f) C,
  must fit in the step (P and M, the peek's and the commit's time against
  the single pass, per state precision: PEEK_COMMIT). The best f of a grid,
  or the single pass where none is faster (the runtime adapts f).
  k = 0.25 is the part of the CPU's work that shows on the critical path even
  when it fits the window (the worker's threads and copies slow the thread
  that drives the GPU; on an H100 host, ratio 0.2 measured 0.251 s per step
  against 0.221 s at ratio 0, where a perfect overlap predicts no cost).

- time, the device is the CPU (a model on the CPU: the "device side" is
  torch's fused Adam on this CPU, in the same host memory): F + B + G + C,
  with G measured on the CPU. One set of cores runs everything, so neither
  side hides behind the other or behind the forward and backward; the ratio
  only chooses which Adam steps faster here: the fastest fitting ratio, or the
  smallest fitting one where it is within 2% (never a near-tie in between).

- host memory: host(r) = r N x (the CPU share's state bytes per element in
  its ``state_precision``: 12, 6.008 or 5.008; + its pinned staging, the
  parameter's bytes, twice with the delayed update or speculation; + 12
  for speculation's second state set). The host budget is what the host can
  still give when the first step begins (``MemAvailable``, or less under a
  cgroup limit), less ``margin`` of it, split evenly between the job's
  ranks on the host (torchrun's ``LOCAL_WORLD_SIZE``). When the device is the
  CPU, the device side's state is host memory too: host(r) adds (1 - r) N x
  its bytes and the upcast batch, and there is no device memory limit
  (``budget_bytes`` None) unless ``budget`` is given.

The choice: among ratios whose predicted peak fits the memory budget (what
the device can give, or a smaller ``budget`` in bytes, less ``margin`` of it)
and whose host memory fits the host budget, the fastest; where several are
predicted within 2% of the fastest, the smallest of them. (Measured on an
H100: where the model predicts the CPU's work fully hidden, the ratio at the
edge of that region was 30% slower than ratio 0, so the choice does not trade
predicted-free time for memory headroom.)
The decision also names what bound it (``binding``: "time", "device_memory",
"host_memory" or "nothing_fits"); :func:`explain` says it in one sentence.
``python -m twinflow.plan`` runs this for an OPT model and prints the
decision and a table of predicted against measured step time.

The probes (:mod:`twinflow.plan.probes`) report the fastest call of a window
of calls after an untimed warm-up.

When no ratio fits both budgets, ``ratio="auto"`` raises rather than guess
(a host out of memory kills the process): the error gives the ratios each
budget allows, what the compact state precisions would allow, which the
user may opt into (auto never changes the precision itself), and about how
many GPUs, the model sharded over them, would fit.
On several processes the ranks probe the CPU kernel together (they share the
node's memory bandwidth, so the rate is what each gets while all step) and
plan one ratio, the largest any rank chose (:func:`agree`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, replace
from typing import Any

import torch

from twinflow.base import distributed
from twinflow.device.device_compact import BATCH
from twinflow.device.device_side import UPCAST_ELEMENTS
from twinflow.plan.host import host_available_bytes, local_ranks
from twinflow.plan.model import (  # the cost model; its names are this package's too
    PEEK_COMMIT,  # noqa: F401
    Inputs,
    device_bytes,
    fits_device,
    host_bytes_per_element,
    predict_host,
    predict_peak,
    predict_time,
)
from twinflow.plan.probes import cpu_kernel_rate, device_adam_rate, pcie_rate, probe_elements
from twinflow.precision import state_precision as precisions

log = logging.getLogger(__name__)

_TIE = 0.02  # predicted times within 2% of the best count as equal


class NoRatioFits(ValueError):
    """ratio="auto" found no ratio within both the device's and the host's memory budgets."""


def choose_ratio(
    inputs: Inputs, placement: str, overlap: bool, eager: bool, grid: int = 100, delayed: bool = False,
    speculative: bool = False, weights_first: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The decision and what it rests on (see the module docstring for the rule and ``binding``)."""
    ratios = [k / grid for k in range(grid + 1)]
    table = [
        {
            "ratio": r,
            "time_s": predict_time(inputs, r, placement, overlap, eager, delayed, speculative, weights_first),
            "peak_bytes": predict_peak(inputs, r),
            "host_bytes": predict_host(inputs, r),
        }
        for r in ratios
    ]
    on_host = [row for row in table if row["host_bytes"] <= inputs.host_budget_bytes]
    fits = [row for row in on_host if _on_device(inputs, row)]
    if not fits and len(on_host) < len(table):
        raise NoRatioFits(_no_ratio_message(inputs, table, on_host, delayed, speculative))
    if not fits:
        log.warning("ratio='auto': even ratio 1 is predicted over the memory budget; choosing 1")
        best = table[-1]
        chosen = best
    else:
        best = min(fits, key=lambda row: row["time_s"])
        chosen = min((row for row in fits if row["time_s"] <= best["time_s"] * (1 + _TIE)), key=lambda r: r["ratio"])
        if inputs.device_is_cpu and chosen is not fits[0]:  # time is linear in the ratio: a ratio in between is
            chosen = best  # never the fastest, only nearly; the tie goes to the smallest ratio that fits
    return {
        "binding": _binding(inputs, table, table.index(chosen), table.index(best), bool(fits)),
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
        "weights_first": weights_first,
        "inputs": asdict(inputs),
    }


def agree(decision: dict[str, Any], ratio: float) -> dict[str, Any]:
    """`decision` at `ratio`, the largest any rank of a multi-process job chose: each rank steps its own shard and
    the step waits for the slowest, so all take one ratio, the one that keeps every rank's device within its
    budget (ranks of one node see nearly the same memory; each planned its host share of the node)."""
    if ratio == decision["ratio"]:
        return decision | {"ratio_over_ranks": ratio}
    x = Inputs(**decision["inputs"])
    time_s = predict_time(x, ratio, decision["placement"], decision["overlap"], decision["eager"],
                          decision["delayed"], decision["speculative"], decision["weights_first"])  # fmt: skip
    return decision | {"ratio": ratio, "ratio_over_ranks": ratio, "ratio_this_rank": decision["ratio"],
                       "predicted_time_s": time_s, "predicted_peak_bytes": predict_peak(x, ratio),
                       "predicted_host_bytes": predict_host(x, ratio)}  # fmt: skip


def _on_device(inputs: Inputs, row: dict) -> bool:
    return fits_device(inputs, row["peak_bytes"])


def _fitting_ratios(inputs: Inputs) -> list[float]:
    """The ratios of a 0.01 grid whose predicted peak and host memory fit both budgets."""
    ratios = [k / 100 for k in range(101)]
    return [r for r in ratios if predict_host(inputs, r) <= inputs.host_budget_bytes
            and fits_device(inputs, predict_peak(inputs, r))]  # fmt: skip


def _binding(inputs: Inputs, table: list[dict], chosen: int, best: int, any_fits: bool) -> str:
    """What kept the choice (table[chosen]; table[best] the fastest fitting) from a ratio predicted faster: device
    memory (a smaller ratio), host memory (a larger ratio than the fastest that fits), or nothing ("time": the
    choice is predicted fastest, or within the tie of the fastest)."""
    if not any_fits:
        return "nothing_fits"
    below = table[chosen - 1] if chosen > 0 else None
    if below is not None and below["time_s"] < table[chosen]["time_s"] and not _on_device(inputs, below):
        return "device_memory"
    above = table[best + 1] if best + 1 < len(table) else None
    if above is not None and above["time_s"] < table[best]["time_s"] and above["host_bytes"] > inputs.host_budget_bytes:
        return "host_memory"
    return "time"


def _gib(nbytes: float) -> str:
    """Memory in GiB, with two significant digits below 0.01 GiB (a small model's state is not 0.00 GiB)."""
    gib = nbytes / 2**30
    if gib >= 10:
        return f"{gib:.1f} GiB"
    if gib >= 0.01 or gib <= 0:
        return f"{gib:.2f} GiB"
    return f"{gib:.{min(6, 1 - math.floor(math.log10(gib)))}f} GiB"


def _rate(elements_per_s: float) -> str:
    return f"{elements_per_s / 1e9:.2f} Gparam/s" if math.isfinite(elements_per_s) else "not measured"


def explain(decision: dict[str, Any]) -> str:
    """One sentence for a person about a ``ratio="auto"`` decision (``opt.auto_decision``, choose_ratio's dict):
    the ratio chosen, what bound it, in words, and the memory it plans for, in GiB; no limit reads as words."""
    x = Inputs(**decision["inputs"])
    ratio, binding = decision["ratio"], decision.get("binding", "time")
    times = {r: predict_time(x, r, decision["placement"], decision["overlap"], decision["eager"],
                             decision["delayed"], decision["speculative"], decision.get("weights_first", False))
             for r in (0.0, ratio, 1.0 - ratio, 1.0, decision["fastest_fitting_ratio"])}  # fmt: skip
    peak, host = decision["predicted_peak_bytes"], decision["predicted_host_bytes"]
    budget = "no device memory limit" if x.budget_bytes is None else f"a device memory budget of {_gib(x.budget_bytes)}"
    if binding == "nothing_fits":
        why = f"even ratio 1 is predicted to need {_gib(peak)} of device memory, over {budget}"
    elif binding == "device_memory":
        why = (f"it is the least share on the CPU that keeps the device's predicted peak ({_gib(peak)}) within "
               f"{budget}; less would be faster but would not fit")  # fmt: skip
    elif binding == "host_memory":
        fastest = decision["fastest_fitting_ratio"]
        tie = "" if ratio == fastest else f", and {ratio:.2f} is predicted within 2% of that"
        why = (f"more on the CPU would be predicted faster, but the host's memory ({_gib(x.host_budget_bytes)} after "
               f"the margin) holds at most ratio {fastest:.2f}{tie}")  # fmt: skip
    elif x.device_is_cpu:
        kernel, torch_adam = f"twinflow's kernel ({_rate(x.cpu_elements_per_s)})", _rate(x.gpu_elements_per_s)
        steps = f"a predicted step of {times[ratio]:.3f} s against {times[1.0 - ratio]:.3f} s at ratio {1 - ratio:g}"
        if ratio > 0.0:
            why = f"on this CPU {kernel} steps faster than torch's Adam ({torch_adam}): {steps}"
        elif x.cpu_elements_per_s <= x.gpu_elements_per_s:
            why = f"on this CPU torch's Adam ({torch_adam}) steps at least as fast as {kernel}: {steps}"
        else:
            why = (f"on this CPU {kernel} is faster than torch's Adam ({torch_adam}) but saves under 2% of the step "
                   f"({steps}), and ratio 1 would take {_gib(predict_host(x, 1.0))} of host memory for the optimizer's "
                   f"state against {_gib(predict_host(x, 0.0))}")  # fmt: skip
    elif ratio == decision["fastest_fitting_ratio"]:
        why = f"it is predicted to give the fastest step that fits in memory ({times[ratio]:.3f} s)"
    else:
        fastest = decision["fastest_fitting_ratio"]
        why = (f"it is the smallest ratio predicted within 2% of the fastest ({fastest:.2f}: {times[fastest]:.3f} s "
               f"against {times[ratio]:.3f} s)")  # fmt: skip
    free = f" ({_gib(x.host_budget_bytes)} free after the margin)" if math.isfinite(x.host_budget_bytes) else ""
    if x.device_is_cpu:
        device = budget + (" (the device is the CPU)" if x.budget_bytes is None else "")
        memory = f"{device}; the optimizer's state takes {_gib(host)} of host memory{free}"
    else:
        over = "over" if binding == "nothing_fits" else "within"
        memory = (f"predicted device peak {_gib(peak)} {over} {budget}; the CPU share's state takes {_gib(host)} of "
                  f"host memory{free}")  # fmt: skip
    return f"ratio='auto' chose {ratio:.2f} because {why}; {memory}."


def _no_ratio_message(inputs: Inputs, table: list[dict], on_host: list[dict], delayed: bool,
                      speculative: bool) -> str:  # fmt: skip
    gib = 1 << 30
    on_device = [row["ratio"] for row in table if _on_device(inputs, row)]
    need = f"at least {min(on_device):.2f}" if on_device else "more than 1 (none fits)"
    host_max = max((row["ratio"] for row in on_host), default=None)
    holds = f"at most {host_max:.2f}" if host_max is not None else "none, not even 0"
    staging = inputs.grad_bytes / max(inputs.elements, 1)
    options = []
    for other in precisions.ALL:
        if other.host_bytes < precisions.of(inputs.state_precision).host_bytes:
            options.append(_other_precision(inputs, other.name, staging, delayed, speculative))
    fix = ("; both sides' state can be made smaller (opt-in, not exact): " + "; ".join(options)) if options else ""
    more = _more_gpus(inputs)
    fix += f"; or train on more GPUs: {more}" if more else ""
    if inputs.device_is_cpu and inputs.budget_bytes is None:
        least = min(row["host_bytes"] for row in table)
        return (
            "ratio='auto': the optimizer's state does not fit this host's memory at any ratio (the device is the "
            f"CPU, so both sides' state is host memory): the least it takes is {least / gib:.1f} GiB, and the host "
            f"can still give {inputs.host_budget_bytes / gib:.1f} GiB after the margin. Free host memory, or set "
            "memory_margin lower"
        )
    device = "no device memory limit" if inputs.budget_bytes is None else f"{inputs.budget_bytes / gib:.1f} GiB"
    return (
        f"ratio='auto': no ratio fits both memories. The device budget ({device}) needs "
        f"ratio {need}; the host can still give {inputs.host_budget_bytes / gib:.1f} GiB after the margin, which at "
        f"{inputs.host_bytes_per_element:.1f} bytes per CPU-stepped parameter (state_precision="
        f"{inputs.state_precision!r}, pinned staging included) holds ratio {holds}. Free host or device memory, or "
        f"set memory_budget/memory_margin{fix}"
    )


def _more_gpus(inputs: Inputs) -> str:
    """The least GPU count (2, 4 or 8 times today's) at which some ratio would fit, with the model sharded over them
    (FSDP2, zero_optimization stage 3): each rank's parameters, gradients, state and host share divided by the
    factor, its activations as they are (an estimate); '' where none of them would, or the device is the CPU."""
    if inputs.budget_bytes is None:
        return ""
    model_bytes = 2 * inputs.grad_bytes  # the rank's weights and gradients, in the parameters' dtype
    for factor in (2, 4, 8):
        shrink = 1 - 1 / factor
        other = replace(inputs, elements=inputs.elements // factor, grad_bytes=inputs.grad_bytes // factor,
                        released_bytes_per_ratio=inputs.released_bytes_per_ratio // factor,
                        first_peak_bytes=int(inputs.first_peak_bytes - shrink * model_bytes),
                        at_step_bytes=int(inputs.at_step_bytes - shrink * model_bytes),
                        host_budget_bytes=inputs.host_budget_bytes / factor)  # fmt: skip
        fits = _fitting_ratios(other)
        if fits:
            gpus = inputs.world_size * factor
            how = "" if inputs.sharded else " with the model sharded (zero_optimization stage 3)"
            return (
                f"about {gpus} GPUs like this one{how} would fit ratio {fits[0]:.2f} to {fits[-1]:.2f} "
                f"in state_precision={inputs.state_precision!r} (an estimate: activations as measured here)"
            )
    return ""


def _other_precision(inputs: Inputs, precision: str, staging: float, delayed: bool, speculative: bool) -> str:
    """What `precision` would allow: the ratios that fit both memories with both sides' state in it."""
    per = host_bytes_per_element(precision, staging, delayed, speculative)
    by_dtype = {getattr(torch, name): n for name, n in (inputs.elements_by_dtype or {}).items()}
    device = device_bytes(by_dtype, precision) if by_dtype else inputs.state_bytes_per_element
    other = replace(inputs, state_bytes_per_element=device, host_bytes_per_element=per, state_precision=precision)
    fits = _fitting_ratios(other)
    where = f"ratio {fits[0]:.2f} to {fits[-1]:.2f} fits" if fits else "no ratio fits either"
    return (f"state_precision={precision!r} ({device:.1f} bytes of device state and {per:.1f} of host memory a "
            f"parameter: {where})")  # fmt: skip


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
        weights_first: bool = False,
        sharded: bool = False,
    ) -> dict[str, Any]:
        """Measures what the first iteration left (memory, times) and the probes, and chooses (choose_ratio's
        decision, plus ``release_grads`` and ``state_precision``). Called at the first ``step()``."""
        step_start = self._now()
        overlap = "forward_end" in self._marks
        forward = self._marks["forward_end"] - self._marks["forward_start"] if overlap else 0.0
        backward = step_start - self._marks["forward_end"] if overlap else 0.0
        elements = sum(p.numel() for p in params)
        low = sum(p.numel() for p in params if p.dtype != torch.float32)
        by_dtype: dict[torch.dtype, int] = {}
        for p in params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        dtype = max(by_dtype, key=by_dtype.__getitem__, default=torch.bfloat16)  # the staging's, mostly
        on_cpu = self.device.type == "cpu"
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            capacity = free + torch.cuda.memory_reserved(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            at_step = torch.cuda.memory_allocated(self.device)
            host_budget = host_available_bytes() * (1 - margin) / local_ranks()  # each rank its share
        else:  # no device memory to read; on the CPU, both sides' state is host memory (predict_host)
            capacity, peak, at_step = None, 0, 0
            host_budget = host_available_bytes() * (1 - margin) / local_ranks() if on_cpu else float("inf")
        # The margin stays free below whichever limit applies (a 30 GiB budget plans for 27 GiB at margin 0.1).
        limits = [int(x) for x in (capacity, budget) if x is not None]
        budget = int(min(limits) * (1 - margin)) if limits else None  # None: no device memory limit
        probe_n, tensors = probe_elements(elements), len(params) if on_cpu else 1
        if distributed.multi_process():  # the node's ranks probe the kernel together: they share its memory
            distributed.wait_for_ranks(self.device)
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        coded = precisions.of(state_precision).coded_moments
        inputs = Inputs(
            elements=elements,
            grad_bytes=grad_bytes,
            state_bytes_per_element=device_bytes(by_dtype, state_precision),
            # fp32: the upcast batch; compact: the fused step's float32 intermediates of one batch
            temp_bytes=min(elements, BATCH) * 16 if coded else min(low, upcast_elements) * 4,
            # With "first" the CPU share's gradients come last in backward, after the memory peak may have
            # passed: only "last" counts on their release.
            released_bytes_per_ratio=grad_bytes if release_grads and placement == "last" else 0,
            first_peak_bytes=peak,
            at_step_bytes=at_step,
            budget_bytes=budget,
            forward_s=forward,
            backward_s=backward,
            # a single process planning as one of a node's LOCAL_WORLD_SIZE ranks (python -m twinflow.plan
            # --local-ranks) runs the others' probes itself; ranks of a job probe together (above)
            cpu_elements_per_s=cpu_kernel_rate(
                num_threads,
                probe_n,
                state_precision,
                dtype=dtype,
                tensors=tensors,
                sharers=1 if distributed.multi_process() else local_ranks(),
            ),
            # on the CPU, on the same elements as the kernel: the two compete for the same work
            gpu_elements_per_s=device_adam_rate(
                self.device,
                probe_n if on_cpu else min(elements, 1 << 22) or 1,
                dtype=dtype,
                tensors=tensors,
                state_precision=state_precision,
            ),  # fmt: skip
            pcie_bytes_per_s=pcie_rate(self.device),
            host_bytes_per_element=host_bytes_per_element(  # weights first keeps a second staging set too
                state_precision, grad_bytes / max(elements, 1), delayed or weights_first, speculative
            ),  # fmt: skip
            host_budget_bytes=host_budget,
            state_precision=state_precision,
            device_is_cpu=on_cpu,
            elements_by_dtype={str(d).removeprefix("torch."): n for d, n in by_dtype.items()},
            world_size=distributed.rank_and_world()[1],
            sharded=sharded,
        )
        decision = choose_ratio(inputs, placement, overlap, eager, delayed=delayed, speculative=speculative,
                                weights_first=weights_first)  # fmt: skip
        if distributed.multi_process():
            decision = agree(decision, distributed.largest_over_ranks(decision["ratio"], self.device))
        decision["release_grads"], decision["state_precision"] = release_grads, state_precision
        return decision
