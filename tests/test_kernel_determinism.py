"""Bitwise reproducibility of the C++ kernel on each SIMD path (after DeepSpeed's CPU Adam tests).

Each path processes whole vectors in its main loop and the leftover elements of a range in a
scalar tail. Where a range starts and ends depends on the thread split and on how tensors are
grouped into calls, so the tail must round exactly like the vector lanes: for a given path, every
element's result may depend only on that element's inputs.
"""

import pytest
import torch

from twinflow.host import ops

STEPS = 3
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.7)
GRAD_DTYPES = [torch.float32, torch.bfloat16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]


def awkward_sizes() -> list[int]:
    """No size a multiple of a vector width, and many small tensors around two large ones."""
    gen = torch.Generator().manual_seed(11)
    small = [int(n) for n in torch.randint(1, 100, (40,), generator=gen)]
    return [1, 7, 15, 17, 33] + small[:20] + [1_000_003] + small[20:] + [65_537, 3]


def make_state(sizes: list[int], grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> dict:
    """Random, nonzero parameters, moments and per-step gradients."""
    gen = torch.Generator().manual_seed(12)

    def nonzero(n: int) -> torch.Tensor:
        x = torch.randn(n, generator=gen)
        return torch.where(x == 0, torch.ones_like(x), x)

    return {
        "params": [nonzero(n) for n in sizes],
        "exp_avgs": [nonzero(n) * 0.1 for n in sizes],
        "exp_avg_sqs": [torch.rand(n, generator=gen) * 0.01 + 1e-4 for n in sizes],
        "grads": [[nonzero(n).to(grad_dtype) for n in sizes] for _ in range(STEPS)],
        "outs": [torch.empty(n, dtype=out_dtype) for n in sizes] if out_dtype else None,
    }


def split_state(state: dict, at: int) -> dict:
    """The same single-tensor state as two tensors, split at element `at`."""

    def split(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        (t,) = ts
        return [t[:at].clone(), t[at:].clone()]

    return {
        "params": split(state["params"]),
        "exp_avgs": split(state["exp_avgs"]),
        "exp_avg_sqs": split(state["exp_avg_sqs"]),
        "grads": [split(g) for g in state["grads"]],
        "outs": split(state["outs"]) if state["outs"] is not None else None,
    }


def run(state: dict, groups: list[list[int]], num_threads: int, simd: str, adamw_mode: bool) -> dict[str, torch.Tensor]:
    """STEPS steps on a copy of `state`, one adam_step_ call per group of tensor indices per step.

    Returns each state tensor kind concatenated and reinterpreted as integers (bitwise comparison).
    """
    s = {k: [t.clone() for t in state[k]] for k in ("params", "exp_avgs", "exp_avg_sqs")}
    outs = [t.clone() for t in state["outs"]] if state["outs"] is not None else None
    for step in range(1, STEPS + 1):
        grads = state["grads"][step - 1]
        for group in groups:
            ops.adam_step_(
                [s["params"][i] for i in group],
                [grads[i] for i in group],
                [s["exp_avgs"][i] for i in group],
                [s["exp_avg_sqs"][i] for i in group],
                [step] * len(group),
                out_copies=[outs[i] for i in group] if outs is not None else None,
                adamw_mode=adamw_mode,
                num_threads=num_threads,
                simd=simd,
                **HYPER,
            )
    result = {k: torch.cat(v).view(torch.int32) for k, v in s.items()}
    if outs is not None:
        result["outs"] = torch.cat(outs).view(torch.int16 if outs[0].element_size() == 2 else torch.int32)
    return result


def assert_bitwise_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        differ = (actual[key] != expected[key]).nonzero().flatten()
        assert differ.numel() == 0, f"{key}: {differ.numel()} elements differ, first at {differ[:8].tolist()}"


parametrize_dtypes = pytest.mark.parametrize(
    "grad_dtype,out_dtype", [(g, o) for g in GRAD_DTYPES for o in OUT_DTYPES], ids=lambda d: str(d).split(".")[-1]
)


@parametrize_dtypes
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_thread_count_is_bitwise_irrelevant(simd: str, grad_dtype, out_dtype, adamw_mode: bool) -> None:
    state = make_state(awkward_sizes(), grad_dtype, out_dtype)
    everything = [list(range(len(state["params"])))]
    one = run(state, everything, 1, simd, adamw_mode)
    for threads in (2, 3):
        assert_bitwise_equal(run(state, everything, threads, simd, adamw_mode), one)


@parametrize_dtypes
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_one_call_equals_one_call_per_tensor(simd: str, grad_dtype, out_dtype, adamw_mode: bool) -> None:
    state = make_state(awkward_sizes(), grad_dtype, out_dtype)
    n = len(state["params"])
    together = run(state, [list(range(n))], 3, simd, adamw_mode)
    separately = run(state, [[i] for i in range(n)], 1, simd, adamw_mode)
    assert_bitwise_equal(together, separately)


@parametrize_dtypes
@pytest.mark.parametrize("at", [37, 50_015, 99_999])
def test_splitting_a_tensor_is_bitwise_irrelevant(simd: str, grad_dtype, out_dtype, at: int) -> None:
    """One tensor vs. the same data as two tensors split at an offset that is no multiple of 8 or 16."""
    state = make_state([100_003], grad_dtype, out_dtype)
    whole = run(state, [[0]], 1, simd, adamw_mode=False)
    halves = split_state(state, at)
    assert_bitwise_equal(run(halves, [[0, 1]], 1, simd, adamw_mode=False), whole)
    assert_bitwise_equal(run(halves, [[0], [1]], 1, simd, adamw_mode=False), whole)


def nan_state(n: int, gen: torch.Generator) -> dict:
    """fp16 gradients and float32 params with NaNs of random sign and payload, never both in one element."""
    state = make_state([n], torch.float16, torch.float16)
    where = torch.randperm(n, generator=gen)[: n // 2]
    in_param, in_grad = where[: n // 4], where[n // 4 :]
    mantissa = torch.randint(1, 1 << 23, (in_param.numel(),), generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, (in_param.numel(),), generator=gen, dtype=torch.int32) << 31
    state["params"][0].view(torch.int32)[in_param] = sign | 0x7F800000 | mantissa
    for grads in state["grads"]:
        half = 0x7C00 | torch.randint(1, 1 << 10, (in_grad.numel(),), generator=gen, dtype=torch.int32)
        half |= torch.randint(0, 2, (in_grad.numel(),), generator=gen, dtype=torch.int32) << 15
        grads[0].view(torch.int16)[in_grad] = half.to(torch.int16)  # wraps to the same 16 bits
    return state


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_nan_payloads_do_not_depend_on_the_split(simd: str, adamw_mode: bool) -> None:
    """A NaN (signalling or quiet, any payload) comes out the same from the vector lanes and the tail."""
    gen = torch.Generator().manual_seed(13)
    state = nan_state(100_003, gen)
    whole = run(state, [[0]], 1, simd, adamw_mode)
    assert whole["params"].view(torch.float32).isnan().any()
    assert_bitwise_equal(run(state, [[0]], 3, simd, adamw_mode), whole)
    assert_bitwise_equal(run(split_state(state, 50_015), [[0, 1]], 1, simd, adamw_mode), whole)
