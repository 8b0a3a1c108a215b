"""The C++ kernel, on every SIMD path, against torch.optim and a float64 reference."""

import os
import threading
from collections.abc import Callable

import pytest
import torch

from tests.reference import adam_reference
from twinflow.base import node
from twinflow.host import ops

SIZES = [1, 7, 17, 1_000_003]  # none a multiple of a vector width
STEPS = 20


def assert_close_1e6(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-6 relative: element-wise (atol 1e-6 for unit-scale values near 0) and in norm."""
    expected = expected.to(actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    assert ((actual - expected).norm() / expected.norm()).item() < 1e-6


def random_set(sizes: list[int], gen: torch.Generator) -> dict[str, list[torch.Tensor]]:
    params = [torch.randn(n, generator=gen) for n in sizes]
    return {
        "params": params,
        "exp_avgs": [torch.zeros(n) for n in sizes],
        "exp_avg_sqs": [torch.zeros(n) for n in sizes],
    }


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_matches_torch(simd: str, adamw_mode: bool, weight_decay: float) -> None:
    gen = torch.Generator().manual_seed(1)
    state = random_set(SIZES, gen)
    ref_params = [p.clone().requires_grad_() for p in state["params"]]
    opt_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = opt_cls(ref_params, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay)
    for step in range(1, STEPS + 1):
        grads = [torch.randn(n, generator=gen) for n in SIZES]
        for rp, g in zip(ref_params, grads):
            rp.grad = g.clone()
        ref_opt.step()
        ops.adam_step_(
            state["params"],
            grads,
            state["exp_avgs"],
            state["exp_avg_sqs"],
            [step] * len(SIZES),
            lr=3e-3,
            beta1=0.8,
            beta2=0.99,
            eps=1e-7,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            num_threads=3,  # an odd split: thread boundaries fall inside tensors
            simd=simd,
        )
    for p, rp in zip(state["params"], ref_params):
        assert_close_1e6(p, rp.detach())
    for p, rp in zip(state["exp_avg_sqs"], ref_params):
        assert_close_1e6(p, ref_opt.state[rp]["exp_avg_sq"])


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_grads_and_output(simd: str, adamw_mode: bool, grad_dtype, out_dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    sizes = [7, 17, 100_003]
    state = random_set(sizes, gen)
    start = [p.clone() for p in state["params"]]
    history = [[] for _ in sizes]
    outs = [torch.full((n,), float("nan"), dtype=out_dtype) for n in sizes] if out_dtype else None
    for step in range(1, STEPS + 1):
        grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
        for h, g in zip(history, grads):
            h.append(g.float())  # the reference sees the same, upcast gradients
        ops.adam_step_(
            state["params"],
            grads,
            state["exp_avgs"],
            state["exp_avg_sqs"],
            [step] * len(sizes),
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.05,
            adamw_mode=adamw_mode,
            out_copies=outs,
            simd=simd,
        )
    for i, p in enumerate(state["params"]):
        expected = adam_reference(
            start[i],
            history[i],
            lr=1e-2,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.05,
            adamw_mode=adamw_mode,
            bias_correction=True,
        )
        assert_close_1e6(p, expected)
        if outs is not None:
            assert torch.equal(outs[i], p.to(out_dtype)), "low-precision copy is not round(fp32 result)"


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_without_bias_correction(simd: str, adamw_mode: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    state = random_set(SIZES, gen)
    start = [p.clone() for p in state["params"]]
    history = [[torch.randn(n, generator=gen) for _ in range(STEPS)] for n in SIZES]
    for step in range(1, STEPS + 1):
        ops.adam_step_(
            state["params"],
            [h[step - 1] for h in history],
            state["exp_avgs"],
            state["exp_avg_sqs"],
            [step] * len(SIZES),
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            adamw_mode=adamw_mode,
            bias_correction=False,
            simd=simd,
        )
    for p, s, h in zip(state["params"], start, history):
        expected = adam_reference(
            s,
            h,
            lr=1e-3,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.1,
            adamw_mode=adamw_mode,
            bias_correction=False,
        )
        assert_close_1e6(p, expected)


def test_per_tensor_step_counts(simd: str) -> None:
    """Tensors at different step counts (after a resume) get their own bias correction."""
    gen = torch.Generator().manual_seed(4)
    sizes = [33, 65]
    state = random_set(sizes, gen)
    state["exp_avgs"] = [torch.rand(n, generator=gen) for n in sizes]
    state["exp_avg_sqs"] = [torch.rand(n, generator=gen) for n in sizes]
    refs = [p.clone().requires_grad_() for p in state["params"]]
    ref_opt = torch.optim.AdamW(refs, lr=1e-2)
    grads = [torch.randn(n, generator=gen) for n in sizes]
    for i, (r, g) in enumerate(zip(refs, grads)):
        r.grad = g.clone()
        ref_opt.state[r] = {
            "step": torch.tensor(float(3 + 10 * i)),
            "exp_avg": state["exp_avgs"][i].clone(),
            "exp_avg_sq": state["exp_avg_sqs"][i].clone(),
        }
    ref_opt.step()
    ops.adam_step_(
        state["params"], grads, state["exp_avgs"], state["exp_avg_sqs"], [4, 14],
        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, simd=simd,
    )  # fmt: skip
    for p, r in zip(state["params"], refs):
        assert_close_1e6(p, r.detach())


def test_thread_count_does_not_change_results(simd: str) -> None:
    gen = torch.Generator().manual_seed(5)
    sizes = [5, 70_001, 3, 131_071]
    base = random_set(sizes, gen)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes]
    results = []
    for threads in (1, 2, 3, 7):
        state = {k: [t.clone() for t in v] for k, v in base.items()}
        outs = [torch.empty(n, dtype=torch.float16) for n in sizes]
        ops.adam_step_(
            state["params"], grads, state["exp_avgs"], state["exp_avg_sqs"], [1] * len(sizes),
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, out_copies=outs, num_threads=threads, simd=simd,
        )  # fmt: skip
        results.append(torch.cat(state["params"] + [o.float() for o in outs]))
    for r in results[1:]:
        assert torch.equal(r, results[0])


def edge_values(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values that stress rounding: subnormals, ties, near-overflow, inf, NaN, and random ones."""
    info = torch.finfo(dtype)
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.max, -info.max, info.tiny, info.tiny / 3,
         info.max * 1.001, 65519.0, 65520.0, 2.0**-25, 2.0**-24 * 1.5, 2.0**-24 * 2.5, 1.0 + 2.0**-11, 1.0 + 2.0**-8]
    )  # fmt: skip
    scales = torch.logspace(-45, 38, 4000, base=2.0) if dtype == torch.float16 else torch.logspace(-130, 127, 4000, 2)
    random = torch.randn(4000, generator=gen) * scales
    # Exact ties between two neighbouring low-precision values.
    low = torch.randn(2000, generator=gen).to(dtype)
    ties = (low.float() + torch.nextafter(low, torch.tensor(float("inf"), dtype=dtype)).float()) / 2
    return torch.cat([specials, random, ties[torch.isfinite(ties)]])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_output_rounding_edge_cases(simd: str, out_dtype) -> None:
    """With lr=0 the update leaves p unchanged, so the copy must equal torch's own rounding of p."""
    gen = torch.Generator().manual_seed(6)
    p = edge_values(out_dtype, gen)
    n = p.numel()
    out = torch.empty(n, dtype=out_dtype)
    ops.adam_step_(
        [p.clone()], [torch.rand(n, generator=gen) + 0.5], [torch.zeros(n)], [torch.zeros(n)], [1],
        lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, out_copies=[out], simd=simd,
    )  # fmt: skip
    expected = p.to(out_dtype)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_gradient_decoding_every_bit_pattern(simd: str, grad_dtype) -> None:
    """With beta1=0 the first moment becomes the decoded gradient exactly: check all 65536 patterns."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    grad = bits.view(grad_dtype)
    n = grad.numel()
    m = torch.zeros(n)
    ops.adam_step_(
        [torch.randn(n)], [grad], [m], [torch.zeros(n)], [1],
        lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8, simd=simd,
    )  # fmt: skip
    torch.testing.assert_close(m, grad.float(), rtol=0, atol=0, equal_nan=True)


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def good_args(n: int = 40) -> dict:
    gen = torch.Generator().manual_seed(7)
    return dict(
        params=[torch.randn(n, generator=gen), torch.randn(3, generator=gen)],
        grads=[torch.randn(n, generator=gen), torch.randn(3, generator=gen)],
        exp_avgs=[torch.rand(n, generator=gen), torch.rand(3, generator=gen)],
        exp_avg_sqs=[torch.rand(n, generator=gen), torch.rand(3, generator=gen)],
        steps=[1, 1],
    )


BAD_CASES = {
    "non-contiguous param": (
        lambda a: a["params"].__setitem__(0, torch.randn(80)[::2]),
        ValueError,
        r"params\[0\] is not contiguous",
    ),
    "non-contiguous grad": (
        lambda a: a["grads"].__setitem__(1, torch.randn(6)[::2]),
        ValueError,
        r"grads\[1\] is not contiguous",
    ),
    "size mismatch": (lambda a: a["exp_avgs"].__setitem__(1, torch.rand(4)), ValueError, r"exp_avgs\[1\] has 4"),
    "float64 param": (lambda a: a["params"].__setitem__(1, torch.randn(3).double()), TypeError, r"params\[1\].*Double"),
    "int grad": (lambda a: a["grads"].__setitem__(0, torch.ones(40, dtype=torch.int32)), TypeError, r"grads\[0\]"),
    "fp16 state": (lambda a: a["exp_avg_sqs"].__setitem__(0, torch.rand(40).half()), TypeError, r"exp_avg_sqs\[0\]"),
    "list length": (lambda a: a["grads"].pop(), ValueError, r"same length"),
    "negative lr": (lambda a: a.update(lr=-1e-3), ValueError, r"lr must be"),
    "negative eps": (lambda a: a.update(eps=-1e-8), ValueError, r"eps must be"),
    "beta1 = 1": (lambda a: a.update(beta1=1.0), ValueError, r"beta1 must be in \[0, 1\)"),
    "beta2 < 0": (lambda a: a.update(beta2=-0.1), ValueError, r"beta2 must be in \[0, 1\)"),
    "step 0": (lambda a: a.update(steps=[1, 0]), ValueError, r"steps\[1\] must be >= 1"),
    "int out copy": (
        lambda a: a.update(out_copies=[torch.empty(40, dtype=torch.int16), torch.empty(3)]),
        TypeError,
        r"out_copies\[0\]",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_raises_and_modifies_nothing(case: str) -> None:
    mutate, error, message = BAD_CASES[case]
    args = good_args()
    args.update(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    mutate(args)
    tensors = args["params"] + args["grads"] + args["exp_avgs"] + args["exp_avg_sqs"]
    before = snapshot(tensors)
    params, grads, exp_avgs, exp_avg_sqs, steps = (
        args.pop(k) for k in ("params", "grads", "exp_avgs", "exp_avg_sqs", "steps")
    )
    with pytest.raises(error, match=message):
        ops.adam_step_(params, grads, exp_avgs, exp_avg_sqs, steps, **args)
    for b, t in zip(before, tensors):
        assert torch.equal(b, t)


def test_a_meta_tensor_is_refused_before_the_kernel() -> None:
    """A tensor outside host memory is refused by name before the op is called (a meta tensor reached the fake
    kernel and the call did nothing)."""
    args = good_args()
    args["exp_avgs"][1] = args["exp_avgs"][1].to("meta")
    tensors = args["params"] + args["grads"] + args["exp_avg_sqs"]
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] is on meta"):
        ops.adam_step_(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    for b, t in zip(before, tensors):
        assert torch.equal(b, t)


@pytest.mark.cuda
def test_cuda_tensor_is_refused() -> None:
    args = good_args()
    args["exp_avgs"][1] = args["exp_avgs"][1].cuda()
    tensors = args["params"] + args["grads"] + args["exp_avgs"] + args["exp_avg_sqs"]
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] is on cuda"):
        ops.adam_step_(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    for b, t in zip(before, tensors):
        assert torch.equal(b, t)


def test_simd_env_var_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINFLOW_SIMD", "sse9")
    with pytest.raises(ValueError, match=r"TWINFLOW_SIMD='sse9'.*expected one of"):
        ops.resolve_simd()
    monkeypatch.setenv("TWINFLOW_SIMD", "scalar")
    assert ops.resolve_simd() == 0


def seen_mid_call(call: Callable[[], object], mid_call: Callable[[], bool]) -> int:
    """How many times this thread finds `mid_call()` true while `call()` runs in another thread.

    `mid_call` reads a state that exists only while `call` is under way, never before or after it. Finding it even
    once means this thread ran Python code during the call, so the call let go of the GIL; a call that holds the
    GIL from start to end can never be caught mid-way, however the threads are scheduled: it gives 0 every time.
    No clock is read: this thread polls for as long as the worker thread is alive.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # re-raised below, not lost in the thread
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    seen = 0
    while worker.is_alive():
        seen += bool(mid_call())
    worker.join()
    if errors:
        raise errors[0]
    return seen


def seen_in_one_of(attempts: int, once: Callable[[], int]) -> int:
    """The first nonzero count of up to `attempts` calls: a thread released from the GIL may still find no core."""
    for _ in range(attempts):
        seen = once()
        if seen:
            return seen
    return 0


def test_gil_released_while_kernel_runs() -> None:
    """This thread runs Python code while one kernel call is in flight: it sees the parameter half-updated."""
    n = 12_000_000
    gen = torch.Generator().manual_seed(11)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen) + 0.1
    view = p.numpy()  # read with no torch call in between
    steps = [1]

    def once() -> int:
        first, last = float(view[0]), float(view[-1])
        steps[0] += 1

        def step() -> None:  # one thread walks the tensor from its first element to its last
            ops.adam_step_([p], [g], [m], [v], steps, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, num_threads=1,
                           simd="scalar")  # fmt: skip

        seen = seen_mid_call(step, lambda: view[0] != first and view[-1] == last)
        assert view[0] != first and view[-1] != last  # the call moved both ends: the state above is mid-call only
        return seen

    assert seen_in_one_of(10, once) > 0


@pytest.mark.parametrize("key", [None, lambda x: x], ids=["plain", "python-key"])
def test_gil_check_fails_for_a_call_that_holds_the_gil(key) -> None:
    """The same check on list.sort(), which CPython runs with the list emptied (len 0) until it is sorted.

    Plain sort of ints is C code that holds the GIL throughout: never seen mid-call (the kernel test's check
    would fail). With a Python key function the interpreter hands the GIL over while the keys are computed
    (the list already emptied), and the same helper does see the sort mid-call.
    """
    unsorted = torch.randint(-(1 << 62), 1 << 62, (1_000_000,), generator=torch.Generator().manual_seed(12)).tolist()
    expected, values = sorted(unsorted), []

    def once() -> int:
        values[:] = unsorted
        seen = seen_mid_call(lambda: values.sort(key=key), lambda: len(values) == 0)
        assert values == expected
        return seen

    if key is None:
        assert once() == 0 and once() == 0
    else:
        assert seen_in_one_of(10, once) > 0


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(8)
    n = 37
    args = (
        [torch.randn(n, generator=gen)],
        [torch.randn(n, generator=gen).bfloat16()],
        [torch.rand(n, generator=gen)],
        [torch.rand(n, generator=gen)],
        [torch.empty(n, dtype=torch.bfloat16)],
        [2],
        1e-3, 0.9, 0.999, 1e-8, 0.01, True, True, 0.5, 2, ops.resolve_simd(),
        [torch.randn(n, generator=gen), torch.rand(n, generator=gen), torch.rand(n, generator=gen)],
    )  # fmt: skip
    torch.library.opcheck(torch.ops.twinflow.adam_step_.default, args)
    torch.library.opcheck(torch.ops.twinflow.adam_peek_.default, args)  # the weights-first pass: the same schema


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_grad_scale_equals_prescaled_gradients(simd: str, adamw_mode: bool) -> None:
    gen = torch.Generator().manual_seed(9)
    sizes = [7, 1003]
    a = random_set(sizes, gen)
    b = {k: [t.clone() for t in v] for k, v in a.items()}
    for step in range(1, 6):
        grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        common = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode, simd=simd)
        ops.adam_step_(a["params"], grads, a["exp_avgs"], a["exp_avg_sqs"], [step] * 2, grad_scale=0.37, **common)
        scaled = [g.float() * 0.37 for g in grads]
        ops.adam_step_(b["params"], scaled, b["exp_avgs"], b["exp_avg_sqs"], [step] * 2, **common)
    for p, q in zip(a["params"], b["params"]):
        assert_close_1e6(p, q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_out_copy_may_overwrite_the_gradient_in_place(simd: str, dtype: torch.dtype) -> None:
    """TwinFlowAdam's chunk buffers carry the gradient in and the rounded weight out: same memory."""
    gen = torch.Generator().manual_seed(10)
    sizes = [5, 4099, 70001]  # tails, and thread boundaries inside tensors
    a = random_set(sizes, gen)
    b = {k: [t.clone() for t in v] for k, v in a.items()}
    grads = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    in_place = [g.clone() for g in grads]
    outs = [torch.full((n,), float("nan"), dtype=dtype) for n in sizes]  # poisoned
    common = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, num_threads=3, simd=simd)
    ops.adam_step_(a["params"], grads, a["exp_avgs"], a["exp_avg_sqs"], [1] * 3, out_copies=outs, **common)
    ops.adam_step_(b["params"], in_place, b["exp_avgs"], b["exp_avg_sqs"], [1] * 3, out_copies=in_place, **common)
    for out, ip, p, q in zip(outs, in_place, a["params"], b["params"]):
        assert torch.equal(p, q)
        assert torch.equal(out, ip) and torch.equal(ip, p.to(dtype))


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 3])
def test_out_of_place_equals_in_place_and_leaves_the_sources(simd: str, out_dtype: torch.dtype | None,
                                                             offset: int) -> None:  # fmt: skip
    """A speculative step reads the state from one place and writes it to another, so a rollback can start
    again from the untouched state: bit for bit the in-place step. `offset` puts the outputs off a cache line
    (the kernel steps single elements up to the first whole line, then streams)."""
    gen = torch.Generator().manual_seed(12)
    sizes = [5, 4099, 70001]  # tails, and thread boundaries inside tensors
    a = random_set(sizes, gen)
    for key in ("exp_avgs", "exp_avg_sqs"):  # a later step's moments: nonzero
        a[key] = [torch.rand(n, generator=gen) for n in sizes]
    before = {k: [t.clone() for t in v] for k, v in a.items()}
    # poisoned outputs, each a view `offset` elements into a larger buffer
    out = {k: [torch.full((n + offset,), float("nan"))[offset:] for n in sizes] for k in a}
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    copies = lambda: [torch.empty(n, dtype=out_dtype) for n in sizes] if out_dtype else None  # noqa: E731
    common = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, num_threads=3, simd=simd)
    apart_copies, in_place_copies = copies(), copies()
    ops.adam_step_(out["params"], grads, out["exp_avgs"], out["exp_avg_sqs"], [4] * 3, out_copies=apart_copies,
                   sources=(a["params"], a["exp_avgs"], a["exp_avg_sqs"]), **common)  # fmt: skip
    for key in a:
        assert all(torch.equal(x, y) for x, y in zip(a[key], before[key])), f"{key}: the source was written"
    ops.adam_step_(a["params"], grads, a["exp_avgs"], a["exp_avg_sqs"], [4] * 3, out_copies=in_place_copies,
                   **common)  # fmt: skip
    for key in a:
        for x, y, z in zip(out[key], a[key], before[key]):
            assert torch.equal(x, y), key
            assert not torch.equal(y, z), key  # the step did move it
    if out_dtype is not None:
        assert all(torch.equal(x, y) for x, y in zip(apart_copies, in_place_copies))


def test_sources_are_checked_before_anything_is_written() -> None:
    gen = torch.Generator().manual_seed(13)
    p, m, v = torch.randn(8, generator=gen), torch.rand(8, generator=gen), torch.rand(8, generator=gen)
    kept = [t.clone() for t in (p, m, v)]
    g = torch.randn(8, generator=gen)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    buf = torch.randn(12, generator=gen)
    cases = [
        (([buf[2:10]], [m], [v]), ValueError, "partly overlaps"),  # would read what it already wrote
        (([p.clone()], [m], [v]), ValueError, "must all be read in place or all apart"),
        (([p.double()], [m], [v]), TypeError, r"sources\[0\] has dtype Double; expected float32"),
        (([torch.randn(7)], [m.clone()], [v.clone()]), ValueError, r"sources\[0\] has 7 elements"),
    ]
    for sources, error, message in cases:
        target = buf[:8] if sources[0][0].data_ptr() == buf[2:].data_ptr() else p
        with pytest.raises(error, match=message):
            ops.adam_step_([target], [g], [m], [v], [1], sources=sources, **hyper)
    assert all(torch.equal(x, y) for x, y in zip((p, m, v), kept))


def test_default_threads_follow_the_environment(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import logging

    monkeypatch.setenv("TWINFLOW_NUM_THREADS", "3")
    assert ops.default_num_threads() == 3
    for bad in ("0", "many"):
        monkeypatch.setenv("TWINFLOW_NUM_THREADS", bad)
        with pytest.raises(ValueError, match=rf"TWINFLOW_NUM_THREADS='{bad}': expected a positive integer"):
            ops.default_num_threads()
    monkeypatch.delenv("TWINFLOW_NUM_THREADS")
    # torchrun's OMP_NUM_THREADS=1 with several processes: each rank's kernel takes its share of the cores, said once
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)))
    monkeypatch.setattr(node, "numa_nodes", lambda root="/": {0: set(range(64))})  # one NUMA node, whatever the host
    ops.announced_share.cache_clear()
    with caplog.at_level(logging.INFO, logger="twinflow.notice"):
        assert ops.default_num_threads() == 32
        assert ops.default_num_threads() == 32  # from the cache: one notice
    said = [r.getMessage() for r in caplog.records if r.name == "twinflow.notice"]
    assert said == ["the CPU kernel uses 32 threads: this rank's share of 64 cores among 2 local ranks; "
                    "set TWINFLOW_NUM_THREADS to change it"]  # fmt: skip
    ops.announced_share.cache_clear()
