"""The probes ``ratio="auto"`` measures with: the CPU kernel's, the device side's Adam's and PCIe's throughput.

Each times one untimed warm-up call (fresh memory's first touch, the kernel's
load), then keeps calling for at least ``PROBE_WINDOW_S`` and reports the
fastest call. On a machine whose cores other processes share, a short probe is
at the mercy of a burst of their work (an OpenMP thread that loses its core
stalls the whole parallel region: on two shared cores, a neighbour's OpenMP
loop cut a short probe's figure 5 to 30 times); the fastest call of a longer
window is what the kernel does when it has the cores, as a training step
mostly has them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from twinflow.base.partition import Segment
from twinflow.device.device_compact import CompactDeviceState
from twinflow.host import ops
from twinflow.precision import compact
from twinflow.precision import state_precision as precisions

PROBE_ELEMENTS = 1 << 26  # 1 GiB of fp32 state: well past a 300 MiB L3, which would flatter the kernel
MIN_PROBE_ELEMENTS = 1 << 20  # below this a call is mostly its fixed cost, which a real step spreads wider
PROBE_WINDOW_S = 0.5  # a probe keeps timing this long (module docstring)
PROBE_MAX_CALLS = 100  # and stops here however short the calls: a small probe's window is its calls


def timed(fn: Callable[[], None], repeats: int, cuda: bool, clock: Callable[[], float] = time.perf_counter,
           window_s: float = PROBE_WINDOW_S, max_calls: int = PROBE_MAX_CALLS) -> float:  # fmt: skip
    """The fastest of the timed calls of `fn`, in seconds: one untimed warm-up call first (one-time costs: fresh
    memory's first touch, a kernel's load), then at least `repeats` calls, and more until `window_s` of them have
    passed or `max_calls` were made (a burst of other processes on the cores must not decide the figure)."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < repeats or (spent < window_s and calls < max_calls):
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        took = clock() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def probe_elements(elements: int) -> int:
    """How many elements a probe steps for a model of `elements` parameters: as many, within
    [``MIN_PROBE_ELEMENTS``, ``PROBE_ELEMENTS``] (a small model's state sits in cache, as it will in training)."""
    return max(MIN_PROBE_ELEMENTS, min(int(elements), PROBE_ELEMENTS))


def _split(elements: int, tensors: int) -> list[int]:
    """`elements` in `tensors` near-equal sizes (the model's tensor count: per-tensor costs count too)."""
    tensors = max(1, min(int(tensors), elements))
    return [elements // tensors + (1 if k < elements % tensors else 0) for k in range(tensors)]


def cpu_kernel_rate(
    num_threads: int | None, elements: int = PROBE_ELEMENTS, state_precision: str = "fp32", *,
    dtype: torch.dtype = torch.bfloat16, tensors: int = 1, clock: Callable[[], float] = time.perf_counter,
    sharers: int = 1,
) -> float:  # fmt: skip
    """Elements per second of the CPU kernel, on fresh host memory, with the state in `state_precision` ("fp32",
    "int8" or "int8_m24"): `elements` in `tensors` tensors, gradients in and weights out in `dtype` (the
    pinned staging's, the parameters' dtype), `num_threads` threads (None: the kernel's default). `clock`: the
    timer (tests inject one). `sharers` > 1: as one of that many ranks sharing the host, the others' kernels
    run the same probe at the same time, each in a thread of its own (the kernel releases the interpreter), so
    the rate is this rank's share of the host's memory bandwidth."""
    if sharers > 1:
        others = [threading.Thread(target=cpu_kernel_rate, args=(num_threads, elements, state_precision),
                                   kwargs={"dtype": dtype, "tensors": tensors}, daemon=True)
                  for _ in range(sharers - 1)]  # fmt: skip
        for thread in others:
            thread.start()
        try:
            return cpu_kernel_rate(num_threads, elements, state_precision, dtype=dtype, tensors=tensors, clock=clock)
        finally:
            for thread in others:
                thread.join()
    ops.load()  # a first-use compile must not be timed
    sizes = _split(elements, tensors)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    extra: dict[str, Any] = {}
    precision = precisions.of(state_precision)
    if not precision.coded_moments:
        moments, kernel = ([torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]), ops.adam_step_
    else:
        moments, kernel = tuple(zip(*(compact.fresh(n) for n in sizes))), ops.adam_step_q8_
        if precision.masters24:
            params, extra = compact.kernel_masters([compact.Master24.empty(n).copy_(p) for n, p in zip(sizes, params)])
    step = [0]

    def run() -> None:
        step[0] += 1
        # out_copies are the gradients' buffers, as in training (the staging carries the gradient down and the
        # weight back up)
        kernel(params, grads, *(list(m) for m in moments), [step[0]] * len(sizes), lr=1e-5, beta1=0.9,
               beta2=0.999, eps=1e-8, out_copies=grads, num_threads=num_threads, **extra)  # fmt: skip

    return elements / timed(run, 3, cuda=False, clock=clock)


def device_adam_rate(
    device: torch.device, elements: int, *, dtype: torch.dtype = torch.bfloat16, tensors: int = 1,
    clock: Callable[[], float] = time.perf_counter, state_precision: str = "fp32",
) -> float:  # fmt: skip
    """Elements per second of the device side's step on `device`, a GPU or this CPU (inf elsewhere): fused AdamW
    over fp32 masters (for `dtype` other than float32 the gradient's upcast and the rounded copy back too), and on
    a GPU under a compact `state_precision` the device side's own compact step
    (:class:`~twinflow.device.device_compact.CompactDeviceState`, its Triton kernel: 158-164 Gparam/s on an H200,
    where fused AdamW over fp32 alone runs at about 121). On the CPU (tests) the compact step runs as torch
    operations, some hundred times slower than a GPU's; fused AdamW stands in for it there, as it did everywhere
    before."""
    if device.type not in ("cuda", "cpu"):
        return float("inf")
    sizes = _split(elements, tensors)
    weights = [torch.randn(n, device=device, dtype=dtype) for n in sizes]
    grads = [torch.randn_like(w) for w in weights]
    if device.type == "cuda" and precisions.of(state_precision).coded_moments:
        run = compact_device_step(weights, grads, state_precision)
    else:
        masters = [w if dtype == torch.float32 else w.float() for w in weights]  # an fp32 weight is its own master
        m, v = [torch.zeros_like(x) for x in masters], [torch.zeros_like(x) for x in masters]
        steps = [torch.zeros((), device=device) for _ in sizes]

        def run() -> None:
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(masters, [g.float() for g in grads], m, v, [], steps, lr=1e-5, beta1=0.9,
                                beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
            if dtype != torch.float32:
                torch._foreach_copy_(weights, masters)

    return elements / timed(run, 3, cuda=device.type == "cuda", clock=clock)


def compact_device_step(weights: list[torch.Tensor], grads: list[torch.Tensor], state_precision: str) -> Callable:
    """A call that steps `weights` with `grads` as the device side's compact state does."""
    state = CompactDeviceState([Segment(i, 0, w.numel(), on_cpu=False) for i, w in enumerate(weights)], weights,
                               state_precision)  # fmt: skip
    hyper = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True, bias_correction=True)
    group_of = [0] * len(weights)
    return lambda: state.step(state.states, [hyper], group_of, grads.__getitem__, None)


def pcie_rate(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Device-to-host bytes per second into pinned memory."""
    if device.type != "cuda":
        return float("inf")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return nbytes / timed(lambda: dst.copy_(src, non_blocking=True), 3, cuda=True)
