"""The 8-bit moments' kernel (state_precision="int8") against float32 and float64 references of its recurrence."""

import math

import pytest
import torch

from twinflow.host import ops
from twinflow.precision import compact, compact_step, weight_master

SIZES = [1, 7, 255, 256, 257, 1000, 70001]  # partial blocks, whole ones, and thread boundaries inside tensors
F32 = torch.float32


def reference_step(p, g, state, step, index_base, hyper, scale):
    """twinflow.precision.compact_step's float32 torch operations, csrc/adam_q8.h one at a time and in its order (the
    device side's compact step: the kernel must give its bits); `p`: float32 masters, or 24-bit ones (a
    Master24, rounded in place: the float32 value comes back)."""
    if isinstance(p, compact.Master24):
        p_new, *rest = reference_step(p.float(), g, state, step, index_base, hyper, scale)
        p.hi, p.lo = compact.encode_master(p_new, compact.kernel_noise(index_base, p.numel(), step) & 0xFF)
        return (p.float(), *rest)
    p_new, codes, _ = compact_step.adam_step(p, g, state, step, index_base, hyper, scale)
    return p_new, codes


def fresh(n: int) -> dict:
    return dict(zip(("m_codes", "m_scales", "v_codes", "v_scales"), compact.fresh(n)))


def kernel_step(params, grads, states, step, bases, hyper, scale, simd, outs=None, threads=3):
    """`params`: float32 tensors, or Master24s (24-bit masters)."""
    params, m24 = compact.kernel_masters(params)
    ops.adam_step_q8_(params, grads, [s["m_codes"] for s in states], [s["m_scales"] for s in states],
                      [s["v_codes"] for s in states], [s["v_scales"] for s in states], [step] * len(params),
                      index_bases=bases, grad_scale=scale, out_copies=outs, num_threads=threads, simd=simd, **m24,
                      **hyper)  # fmt: skip


def masters(values: list[torch.Tensor], kind: str) -> list:
    """float32 masters (clones of `values`), or 24-bit ones holding `values` rounded to the nearest."""
    return [compact.Master24.empty(v.numel()).copy_(v) if kind == "m24" else v.clone() for v in values]


def values(p) -> torch.Tensor:
    return p.float() if isinstance(p, compact.Master24) else p


def test_block_size_matches_the_kernel() -> None:
    assert ops.q8_block_size() == compact.BLOCK


@pytest.mark.parametrize("master", ["fp32", "m24"])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_the_float32_reference_bit_for_bit(simd: str, adamw_mode: bool, grad_dtype, master) -> None:
    gen = torch.Generator().manual_seed(3)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode)
    start = [torch.randn(n, generator=gen) for n in SIZES]
    params, ref = masters(start, master), masters(start, master)
    states, ref_states = [fresh(n) for n in SIZES], [fresh(n) for n in SIZES]
    bases = [17 * i for i in range(len(SIZES))]
    for step in range(1, 9):
        # gradients whose scale varies by element: small moments beside large ones in one block
        grads = [(torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4).to(grad_dtype) for n in SIZES]
        scale = 0.5 if step % 2 else 1.0
        outs = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in SIZES]  # poisoned
        kernel_step(params, grads, states, step, bases, hyper, scale, simd, outs)
        for i in range(len(SIZES)):
            p_new, ref_states[i] = reference_step(ref[i], grads[i], ref_states[i], step, bases[i], hyper, scale)
            ref[i] = ref[i] if master == "m24" else p_new
            # a 24-bit master's weight: the nearest, ties away from zero (as the device side keeps it)
            assert torch.equal(outs[i], weight_master.weight_of(p_new) if master == "m24" else p_new.bfloat16())
    for i in range(len(SIZES)):
        assert torch.equal(values(params[i]), values(ref[i]))
        for key in ref_states[i]:
            assert torch.equal(states[i][key], ref_states[i][key]), (SIZES[i], key)
        assert states[i]["m_codes"].abs().max() > 100 and states[i]["v_codes"].max() > 200  # codes in use


def test_extreme_scales_bit_for_bit_even_with_subnormals_flushed(simd: str) -> None:
    """Block scales more than 2^127 above a code's bottom (past one float32 power of two), moments far below
    float32's normal range (the codes' bottom binade as subnormals, and subnormal moments), and a caller that
    flushes subnormals to zero: the kernel clears that for its own run."""
    gen = torch.Generator().manual_seed(5)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    scales = [1e6, 3e4, 1e-16, 1e-18]
    n = 1000
    params = [torch.randn(n, generator=gen) for _ in scales]
    ref = [p.clone() for p in params]
    states, ref_states = [fresh(n) for _ in scales], [fresh(n) for _ in scales]
    for step in range(1, 6):
        grads = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4 * k for k in scales]
        for i in range(len(scales)):
            ref[i], ref_states[i] = reference_step(ref[i], grads[i], ref_states[i], step, 0, hyper, 1.0)
        assert torch.set_flush_denormal(True) or simd == "scalar"  # x86 with SSE3: supported
        try:
            kernel_step(params, grads, states, step, [0] * len(scales), hyper, 1.0, simd, threads=1)
        finally:
            torch.set_flush_denormal(False)
    for i in range(len(scales)):
        assert torch.equal(params[i], ref[i]), scales[i]
        for key in ref_states[i]:
            assert torch.equal(states[i][key], ref_states[i][key]), (scales[i], key)
    assert states[0]["m_scales"].max() - compact.TOP_FIELD_M > 127  # D past one float32 power of two
    assert states[0]["v_scales"].max() - compact.TOP_FIELD_V > 127
    v_tiny = compact.decode_exp_avg_sq(states[3]["v_codes"], states[3]["v_scales"])
    assert ((v_tiny > 0) & (v_tiny < torch.finfo(torch.float32).tiny)).any()  # subnormal moments kept


def test_one_step_against_a_float64_reference_of_the_recurrence(simd: str) -> None:
    gen = torch.Generator().manual_seed(4)
    n = 70001
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True)
    p = torch.randn(n, generator=gen)
    state = fresh(n)
    for step in range(1, 4):  # a state with history
        kernel_step([p], [torch.randn(n, generator=gen)], [state], step, [0], hyper, 1.0, simd)
    m = compact.decode_exp_avg(state["m_codes"], state["m_scales"]).double()
    v = compact.decode_exp_avg_sq(state["v_codes"], state["v_scales"]).double()
    g = torch.randn(n, generator=gen)
    p64, g64 = p.double(), g.double()
    m_new = 0.9 * m + 0.1 * g64
    v_new = 0.999 * v + 0.001 * g64 * g64
    bc1, bc2 = 1 - 0.9**4, 1 - 0.999**4
    p_new = p64 * (1 - 1e-3 * 0.01) - 1e-3 / bc1 * m_new / (v_new.sqrt() / math.sqrt(bc2) + 1e-8)
    kernel_step([p], [g], [state], 4, [0], hyper, 1.0, simd)
    torch.testing.assert_close(p.double(), p_new, rtol=1e-6, atol=1e-7)
    # the stored moments: one of the two codes around the float64 value (3 mantissa bits: a step is at most an
    # eighth of the value; below the block's lowest binade the steps are even, 2^(D - 129))
    cases = ((compact.decode_exp_avg, "m_codes", "m_scales", m_new, compact.TOP_FIELD_M),
             (compact.decode_exp_avg_sq, "v_codes", "v_scales", v_new, compact.TOP_FIELD_V))  # fmt: skip
    for decode, codes, scales, exact, top in cases:
        stored = decode(state[codes], state[scales]).double()
        d = compact.block_shift(state[scales], n, top).double()
        step = torch.maximum(exact.abs() / 8, 2.0 ** (d - 129))
        assert ((stored - exact).abs() <= step * (1 + 1e-6)).all()
        assert ((stored - exact).abs() > 1e-3 * step).float().mean() > 0.9  # rounded: not an exact copy
        assert (stored == 0).float().mean() < 0.001  # the range keeps codes for small values


def test_moments_decay_without_stalling_or_bias(simd: str) -> None:
    """Small moments beside a block's largest, with no gradient: they decay by 1 - beta per step, far below a code
    step (rounding to the nearest code would hold them still) and must not drift (rounding the code, not the value,
    up with probability frac(code) gave v 2.3 x its value after 1000 steps)."""
    n = 4096
    hyper = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    p, state = torch.zeros(n), fresh(n)
    top = torch.zeros(n, dtype=torch.bool)
    top[::256] = True  # one element per block keeps its gradient, and the block's scale, up
    kernel_step([p], [torch.ones(n)], [state], 1, [0], hyper, 1.0, simd)
    for step in range(2, 1002):
        kernel_step([p], [top * 100.0], [state], step, [0], hyper, 1.0, simd)
        if step in (30, 1001):
            v = compact.decode_exp_avg_sq(state["v_codes"], state["v_scales"])[~top].double().mean().item()
            expected = 1e-3 * 0.999 ** (step - 1)
            assert abs(v - expected) / expected < 0.05, (step, v, expected)
        if step == 30:
            m = compact.decode_exp_avg(state["m_codes"], state["m_scales"])[~top].double().mean().item()
            expected = 0.1 * 0.9 ** (step - 1)
            assert abs(m - expected) / expected < 0.05, (m, expected)


def test_bad_arguments_are_refused_before_anything_is_written() -> None:
    p, g = torch.randn(300), torch.randn(300)
    state = fresh(300)
    kept = p.clone()
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    cases = [
        ({**state, "m_codes": torch.zeros(300, dtype=torch.uint8)}, TypeError, r"exp_avg_codes\[0\] has dtype Byte"),
        ({**state, "v_scales": torch.zeros(2)}, TypeError, r"exp_avg_sq_scales\[0\] has dtype Float; expected Byte"),
        (
            {**state, "v_scales": torch.zeros(1, dtype=torch.uint8)},
            ValueError,
            r"exp_avg_sq_scales\[0\] has 1 elements; expected 2",
        ),
        ({**state, "v_codes": torch.zeros(299, dtype=torch.uint8)}, ValueError, r"exp_avg_sq_codes\[0\] has 299"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            kernel_step([p], [g], [bad], 1, [0], hyper, 1.0, None)
    assert torch.equal(p, kept) and not state["m_scales"].any()


def test_24_bit_master_one_step_against_float64(simd: str) -> None:
    """The rounded master is one of the two 24-bit values around the float64 step's result (a step of 2^-15 of
    its binade), and not always the nearer one: the rounding is stochastic."""
    gen = torch.Generator().manual_seed(6)
    n = 70001
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True)
    p, state = masters([torch.randn(n, generator=gen)], "m24")[0], fresh(n)
    for step in range(1, 4):
        kernel_step([p], [torch.randn(n, generator=gen)], [state], step, [0], hyper, 1.0, simd)
    m = compact.decode_exp_avg(state["m_codes"], state["m_scales"]).double()
    v = compact.decode_exp_avg_sq(state["v_codes"], state["v_scales"]).double()
    g = torch.randn(n, generator=gen)
    p64 = p.float().double()
    m_new, v_new = 0.9 * m + 0.1 * g.double(), 0.999 * v + 0.001 * g.double() ** 2
    bc1, bc2 = 1 - 0.9**4, 1 - 0.999**4
    p_new = p64 * (1 - 1e-3 * 0.01) - 1e-3 / bc1 * m_new / (v_new.sqrt() / math.sqrt(bc2) + 1e-8)
    out = torch.full((n,), float("nan"))  # poisoned
    kernel_step([p], [g], [state], 4, [0], hyper, 1.0, simd, outs=[out])
    stored = p.float().double()
    assert torch.equal(out, p.float())  # the weight written is the master
    ulp = 2.0 ** (torch.floor(torch.log2(p_new.abs())) - 15)  # the 24-bit step of each result's binade
    err = (stored - p_new).abs()
    assert (err <= ulp * (1 + 1e-3)).all(), (err / ulp).max()
    nearest = compact.decode_master(*compact.encode_master(p_new.float())).double()
    assert ((stored != nearest).float().mean() > 0.1) and (err > 1e-3 * ulp).float().mean() > 0.9


def test_24_bit_master_takes_updates_far_below_its_step(simd: str) -> None:
    """lr 1e-6 on weights near 1: each update is 1/30 of the master's step (2^-15), so rounding to the nearest would
    hold every weight still; stochastic rounding moves them by the right amount on average."""
    gen = torch.Generator().manual_seed(7)
    n, steps, lr = 8192, 300, 1e-6
    hyper = dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    start = 1.25 + 0.1 * torch.rand(n, generator=gen)
    p, state = masters([start], "m24")[0], fresh(n)
    before, expected = p.float().double(), torch.zeros(n, dtype=torch.float64)
    for step in range(1, steps + 1):
        grad = 0.5 + torch.rand(n, generator=gen)  # positive: Adam's update is about -lr every step
        # the update the kernel takes, in float64 from the moments it starts from
        m = 0.9 * compact.decode_exp_avg(state["m_codes"], state["m_scales"]).double() + 0.1 * grad.double()
        v = 0.999 * compact.decode_exp_avg_sq(state["v_codes"], state["v_scales"]).double() + 0.001 * grad.double() ** 2
        expected += lr / (1 - 0.9**step) * m / (v.sqrt() / math.sqrt(1 - 0.999**step) + 1e-8)
        kernel_step([p], [grad], [state], step, [0], hyper, 1.0, simd)
    moved = (before - p.float().double()).mean().item()
    assert abs(moved / expected.mean().item() - 1) < 0.015, (moved, expected.mean().item())


def test_a_v_below_its_blocks_range_keeps_the_lowest_code(simd: str) -> None:
    """Gradient scales spread over 2^-20..1 inside each block put some v below the codes' 2^-30 range while their m
    still has a code. Rounded to zero such a v would make the update m / eps (thousands of times lr); it keeps the
    lowest code instead, so every update stays within Adam's usual bound of a few lr."""
    gen = torch.Generator().manual_seed(8)
    n = 4096
    hyper = dict(lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    scale = torch.exp2(-20 * torch.rand(n, generator=gen))
    p, state, largest = torch.randn(n, generator=gen), fresh(n), 0.0
    for step in range(1, 41):
        before = p.clone()
        kernel_step([p], [scale * (0.3 + torch.randn(n, generator=gen))], [state], step, [0], hyper, 1.0, simd)
        largest = max(largest, (p - before).abs().max().item())  # lr 1: the update itself
    m = compact.decode_exp_avg(state["m_codes"], state["m_scales"])
    v = compact.decode_exp_avg_sq(state["v_codes"], state["v_scales"])
    exact_v = 1e-3 * scale**2  # about: each v is at least (1 - beta2) g^2 of its own gradients
    assert (exact_v < 2.0**-30 * v.view(-1, 256).amax(dim=1).repeat_interleave(256)).sum() > 100  # below range
    assert not ((v == 0) & (m != 0)).any()
    assert largest < 10, largest


def test_24_bit_masters_keep_nan_and_inf(simd: str) -> None:
    """A NaN gradient makes a NaN master, which must stay NaN: with an all-ones payload (CUDA's NaN, 0x7FFFFFFF, or
    its negative) adding rounding noise would carry into the sign and leave -0 or +0. Infinities stay infinite."""
    n = 64
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(9))
    patterns = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32).repeat(n // 4 + 1)[: n // 2]
    grad[: n // 2] = patterns.view(torch.float32)
    grad[n // 2 : n // 2 + 4] = float("inf")
    p, state = masters([torch.randn(n, generator=torch.Generator().manual_seed(10))], "m24")[0], fresh(n)
    out = torch.zeros(n)
    kernel_step([p], [grad], [state], 1, [0], hyper, 1.0, simd, outs=[out])
    assert torch.isnan(p.float()[: n // 2]).all() and torch.isnan(out[: n // 2]).all()
    hi, lo = compact.encode_master(torch.cat([patterns.view(torch.float32), torch.tensor([float("inf"), -1e30])]),
                                   torch.full((n // 2 + 2,), 255, dtype=torch.int64))  # fmt: skip
    back = compact.decode_master(hi, lo)
    assert torch.isnan(back[: n // 2]).all() and back[n // 2] == float("inf") and back[-1] < -9.9e29


def test_24_bit_masters_refuse_a_weight_copy_or_gradient_in_their_memory() -> None:
    """The weight copy is written in pass 2, after the master was read: a copy into the master's own bfloat16 half
    (natural to try, as it is a bfloat16 tensor) would corrupt it. Refused before anything is written."""
    n = 300
    p, state = masters([torch.randn(n)], "m24")[0], fresh(n)
    kept_hi, kept_lo = p.hi.clone(), p.lo.clone()
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    with pytest.raises(ValueError, match=r"out_copies\[0\] shares memory with the 24-bit master of params\[0\]"):
        kernel_step([p], [torch.randn(n)], [state], 1, [0], hyper, 1.0, None, outs=[p.hi])
    with pytest.raises(ValueError, match=r"grads\[0\] shares memory with the 24-bit master"):
        kernel_step([p], [p.hi], [state], 1, [0], hyper, 1.0, None)
    with pytest.raises(TypeError, match=r"master_lows\[0\] has dtype Char; expected Byte"):
        kernel_step([compact.Master24(p.hi, p.lo.view(torch.int8))], [torch.randn(n)], [state], 1, [0], hyper, 1.0,
                    None)  # fmt: skip
    assert torch.equal(p.hi, kept_hi) and torch.equal(p.lo, kept_lo) and not state["m_scales"].any()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_24_bit_masters_write_float32_and_float16_copies(simd: str, out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    n = 1000
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True)
    p, ref, state, ref_state = *masters([torch.randn(n, generator=gen)] * 2, "m24"), fresh(n), fresh(n)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen)
        out = torch.full((n,), float("nan"), dtype=out_dtype)  # poisoned
        kernel_step([p], [g], [state], step, [0], hyper, 1.0, simd, outs=[out])
        p_new, ref_state = reference_step(ref, g, ref_state, step, 0, hyper, 1.0)
        assert torch.equal(out, p_new.to(out_dtype)) and torch.equal(p.float(), p_new)
