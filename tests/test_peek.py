"""The kernel's peek pass (new weights first, the state left as it was) and its commit, on every SIMD path.

The peek writes only the rounded weights; the ordinary step run afterwards on the same state commits it. Both
must be bit for bit the single pass: the peek's weights its copy, the commit's masters and moments its state.
"""

import pytest
import torch

from twinflow.host import ops
from twinflow.precision import compact

HYPER = dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-7, num_threads=3)  # 3 threads: cuts fall inside tensors


def state(gen: torch.Generator, sizes: list[int]) -> dict[str, list[torch.Tensor]]:
    """Random masters and moments (after some steps: nonzero, varied magnitudes), each a misaligned view."""

    def view(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros(3), t])[3:]  # starts 12 bytes into its storage: the head loop runs

    return {
        "params": [view(torch.randn(n, generator=gen)) for n in sizes],
        "exp_avgs": [view(torch.randn(n, generator=gen) * 1e-2) for n in sizes],
        "exp_avg_sqs": [view(torch.rand(n, generator=gen) * 1e-4) for n in sizes],
    }


def clone(s: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {k: [t.clone() for t in v] for k, v in s.items()}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit (NaN equals NaN of the same pattern)."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)

    return all(bits(x).equal(bits(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("adamw_mode", "weight_decay", "grad_scale"), [(True, 0.1, 0.37), (False, 0.05, 1.0)])
@pytest.mark.parametrize("apart", [False, True], ids=["in_place", "apart"])
def test_peek_then_commit_is_the_single_pass_bit_for_bit(
    simd: str, out_dtype: torch.dtype, grad_dtype: torch.dtype, adamw_mode: bool, weight_decay: float,
    grad_scale: float, apart: bool,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    sizes = [1, 17, 1000, 70_001]
    start = state(gen, sizes)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
    steps = [3, 1, 7, 12]
    hyper = dict(HYPER, weight_decay=weight_decay, adamw_mode=adamw_mode, grad_scale=grad_scale, simd=simd)

    def call(s: dict, outs: list[torch.Tensor] | None, peek: bool) -> None:
        # apart: read the state from `start`'s tensors, write it to `s`'s (a speculative redo's shape)
        sources = (start["params"], start["exp_avgs"], start["exp_avg_sqs"]) if apart else None
        ops.adam_step_(s["params"], grads, s["exp_avgs"], s["exp_avg_sqs"], steps, out_copies=outs, sources=sources,
                       peek=peek, **hyper)  # fmt: skip

    single = clone(start)
    single_out = [torch.empty(n, dtype=out_dtype) for n in sizes]
    call(single, single_out, peek=False)

    two = clone(start)
    if apart:  # the target of the commit starts poisoned: the sources are what is read
        for t in two["params"] + two["exp_avgs"] + two["exp_avg_sqs"]:
            t.fill_(float("nan"))
    before = clone(two)
    peek_out = [torch.full((n,), float("nan"), dtype=out_dtype) for n in sizes]  # poisoned: every element written
    call(two, peek_out, peek=True)
    assert same(peek_out, single_out)  # the new weights first, bit for bit
    for key in two:  # and nothing of the state written (NaN == NaN bitwise through the int view)
        assert same(two[key], before[key]), key
    call(two, None, peek=False)  # the commit: the ordinary step without a copy
    for key in two:
        assert same(two[key], single[key]), key
    assert not same(single["params"], start["params"])  # the step moved the masters: a no-op would fail above


def test_peek_without_copies_is_refused_and_writes_nothing() -> None:
    gen = torch.Generator().manual_seed(6)
    s = state(gen, [33])
    before = clone(s)
    with pytest.raises(ValueError, match=r"adam_peek_: out_copies must have one tensor per param .* got 0 for 1"):
        ops.adam_step_(s["params"], [torch.randn(33)], s["exp_avgs"], s["exp_avg_sqs"], [1], peek=True, **HYPER)
    assert all(same(s[k], before[k]) for k in s)


def test_the_peek_probe_writes_only_the_copies(simd: str) -> None:
    gen = torch.Generator().manual_seed(7)
    s = state(gen, [5000])
    before = clone(s)
    outs = [torch.full((5000,), float("nan"), dtype=torch.bfloat16)]
    ops.bandwidth_probe_(s["params"], [torch.randn(5000).bfloat16()], s["exp_avgs"], s["exp_avg_sqs"],
                         out_copies=outs, simd=simd, peek=True)  # fmt: skip
    assert all(same(s[k], before[k]) for k in s)
    assert not outs[0].isnan().any()


# ---------------------------------------------------------------- 8-bit moments (state_precision int8, int8_m24)
Q8_SIZES = [1, 255, 257, 1000, 70_001]  # partial blocks, whole ones, thread cuts inside tensors


def q8_state(gen: torch.Generator, master: str) -> dict:
    """Compact state after a few real steps (codes and scales in use), float32 or 24-bit masters."""
    masters = [torch.randn(n, generator=gen) for n in Q8_SIZES]
    if master == "m24":
        masters = [compact.Master24.empty(n).copy_(m) for n, m in zip(Q8_SIZES, masters)]
    q8 = [compact.fresh(n) for n in Q8_SIZES]
    for step in (1, 2, 3):
        grads = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 3 for n in Q8_SIZES]
        q8_call({"masters": masters, "q8": q8}, grads, step, None, False, "scalar", 0.5)
    return {"masters": masters, "q8": q8}


def q8_call(s: dict, grads: list, step: int, outs: list | None, peek: bool, simd: str, scale: float,
            adamw_mode: bool = True) -> None:  # fmt: skip
    params, m24 = compact.kernel_masters(s["masters"])
    ops.adam_step_q8_(params, grads, *zip(*s["q8"]), [step] * len(params), out_copies=outs, simd=simd,
                      index_bases=[31 * i for i in range(len(params))], grad_scale=scale, peek=peek, **m24,
                      **dict(HYPER, weight_decay=0.1 if adamw_mode else 0.02, adamw_mode=adamw_mode))  # fmt: skip


def q8_bits(s: dict) -> list[torch.Tensor]:
    """Every byte of the state: masters (float32, or hi and lo), codes and scales."""
    params, m24 = compact.kernel_masters(s["masters"])
    return [t.view(torch.uint8).clone() for t in params + m24.get("master_lows", []) + [t for q in s["q8"] for t in q]]


def q8_clone(s: dict) -> dict:
    masters = [m.clone() if isinstance(m, torch.Tensor) else compact.Master24(m.hi.clone(), m.lo.clone())
               for m in s["masters"]]  # fmt: skip
    return {"masters": masters, "q8": [[t.clone() for t in q] for q in s["q8"]]}


@pytest.mark.parametrize("master", ["fp32", "m24"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("adamw_mode", "grad_scale"), [(True, 0.37), (False, 1.0)])
def test_q8_peek_then_commit_is_the_single_pass_bit_for_bit(
    simd: str, master: str, out_dtype: torch.dtype, adamw_mode: bool, grad_scale: float
) -> None:
    gen = torch.Generator().manual_seed(11)
    start = q8_state(gen, master)
    grads = [torch.randn(n, generator=gen).bfloat16() for n in Q8_SIZES]
    single = q8_clone(start)
    single_out = [torch.empty(n, dtype=out_dtype) for n in Q8_SIZES]
    q8_call(single, grads, 4, single_out, False, simd, grad_scale, adamw_mode)

    two = q8_clone(start)
    before = q8_bits(two)
    peek_out = [torch.full((n,), float("nan"), dtype=out_dtype) for n in Q8_SIZES]  # poisoned
    q8_call(two, grads, 4, peek_out, True, simd, grad_scale, adamw_mode)
    assert same(peek_out, single_out)  # the new weights first, bit for bit (24-bit rounding and ties included)
    assert all(a.equal(b) for a, b in zip(q8_bits(two), before, strict=True))  # nothing of the state written
    q8_call(two, grads, 4, None, False, simd, grad_scale, adamw_mode)  # the commit: the step without a copy
    assert all(a.equal(b) for a, b in zip(q8_bits(two), q8_bits(single), strict=True))
    assert not all(a.equal(b) for a, b in zip(q8_bits(single), before))  # the step moved the state


def test_q8_peek_without_copies_is_refused_and_writes_nothing() -> None:
    s = q8_state(torch.Generator().manual_seed(12), "m24")
    before = q8_bits(s)
    grads = [torch.randn(n) for n in Q8_SIZES]
    with pytest.raises(ValueError, match=r"adam_peek_q8_: out_copies must have one tensor per param .* got 0 for 5"):
        q8_call(s, grads, 4, None, True, "scalar", 1.0)
    assert all(a.equal(b) for a, b in zip(q8_bits(s), before, strict=True))


@pytest.mark.parametrize("master", ["fp32", "m24"])
def test_the_q8_peek_probe_writes_only_the_copies(simd: str, master: str) -> None:
    s = q8_state(torch.Generator().manual_seed(13), master)
    before = q8_bits(s)
    outs = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in Q8_SIZES]
    params, m24 = compact.kernel_masters(s["masters"])
    ops.bandwidth_probe_q8_(params, [torch.randn(n).bfloat16() for n in Q8_SIZES], *zip(*s["q8"]), out_copies=outs,
                            simd=simd, peek=True, **m24)  # fmt: skip
    assert all(a.equal(b) for a, b in zip(q8_bits(s), before, strict=True))
    assert not any(o.isnan().any() for o in outs)


@pytest.mark.parametrize("master", ["fp32", "m24"])
def test_the_probes_refuse_a_tensor_outside_host_memory(master: str) -> None:
    """The bandwidth probes refuse by name, before the op, a tensor that is not in host memory (the step's ops do;
    a meta tensor reaches the op's fake kernel and a CUDA one crashed the kernel): nothing is written."""
    s = q8_state(torch.Generator().manual_seed(17), master)
    before = q8_bits(s)
    params, m24 = compact.kernel_masters(s["masters"])
    codes = [list(ts) for ts in zip(*s["q8"])]
    codes[2][1] = codes[2][1].to("meta")
    with pytest.raises(ValueError, match=r"exp_avg_sq_codes\[1\] is on meta"):
        ops.bandwidth_probe_q8_(params, [torch.randn(n).bfloat16() for n in Q8_SIZES], *codes, **m24)
    assert all(a.equal(b) for a, b in zip(q8_bits(s), before, strict=True))
    fp32 = [torch.randn(n) for n in Q8_SIZES]
    state = [fp32, [g.clone() for g in fp32], [g.clone() for g in fp32], [g.clone() for g in fp32]]
    kept = [t.clone() for ts in state for t in ts]
    state[3] = state[3][:2] + [state[3][2].to("meta")] + state[3][3:]
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[2\] is on meta"):
        ops.bandwidth_probe_(*state)
    assert all(a.equal(b) for a, b in zip([t for ts in state[:3] for t in ts], kept))
