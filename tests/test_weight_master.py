"""The device form of 24-bit masters (weight rounded to the nearest + a signed residual), over every pattern."""

import pytest
import torch

from twinflow.precision import compact, weight_master


def all_masters(part: int, parts: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Every 24-bit pattern, in `parts` slices: (hi, lo) of slice `part`."""
    n = (1 << 24) // parts
    m24 = torch.arange(part * n, (part + 1) * n, dtype=torch.int64)
    hi = (m24 >> 8).to(torch.int32).to(torch.int16).view(torch.bfloat16)
    return hi, (m24 & 0xFF).to(torch.uint8)


@pytest.mark.parametrize("part", range(16))
def test_every_master_round_trips_and_its_weight_is_the_nearest(part: int) -> None:
    hi, lo = all_masters(part)
    master = compact.decode_master(hi, lo)
    weight, residual = weight_master.split(hi, lo)
    assert weight.dtype == torch.bfloat16 and residual.dtype == torch.int8
    back_hi, back_lo = weight_master.join(weight, residual)
    finite = torch.isfinite(master)
    large = master.abs() > torch.finfo(torch.bfloat16).max  # beyond the largest finite weight: held below it
    exact = finite & ~large
    # the same 24-bit value, bit for bit, and decode agrees with the CPU form's
    assert torch.equal(back_hi.view(torch.int16)[exact], hi.view(torch.int16)[exact])
    assert torch.equal(back_lo[exact], lo[exact])
    decoded = weight_master.decode(weight, residual)
    assert torch.equal(decoded.view(torch.int32)[exact], master.view(torch.int32)[exact])
    # the weight is a nearest bfloat16: torch's own rounding (ties to even) except at ties, which go away from zero
    nearest = master.to(torch.bfloat16)
    tie = (lo == 0x80) & exact
    same = exact & ~tie
    assert torch.equal(weight.view(torch.int16)[same], nearest.view(torch.int16)[same])
    w, m = weight.float()[tie], master[tie]
    assert torch.all(w.abs() > m.abs()) and torch.all(torch.sign(w) == torch.sign(m))
    # infinities stay, NaNs stay NaN, a too-large finite master keeps a finite weight
    assert torch.equal(weight.float()[torch.isinf(master)], master[torch.isinf(master)])
    assert torch.isnan(weight.float()[torch.isnan(master)]).all()
    assert torch.isnan(weight_master.decode(weight, residual)[torch.isnan(master)]).all()
    assert torch.isfinite(weight.float()[large & finite]).all()


def test_the_residual_removes_truncations_bias_toward_zero() -> None:
    """Weights as a truncation of their masters (the CPU form's hi) sit closer to zero by half a step on
    average; the device form's weights are unbiased."""
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(1 << 20, generator=gen) * 0.02  # OPT's initialisation scale
    hi, lo = compact.encode_master(master)
    m24 = compact.decode_master(hi, lo).double()
    step = torch.ldexp(torch.ones_like(m24), torch.frexp(m24).exponent - 8)  # a bfloat16 step in the master's binade
    truncated = (hi.float().double().abs() - m24.abs()) / step
    weight, _ = weight_master.split(hi, lo)
    nearest = (weight.float().double().abs() - m24.abs()) / step
    assert truncated.mean() < -0.45  # toward zero by about half a step
    assert abs(nearest.mean()) < 0.01
    assert nearest.abs().max() <= 0.5 + 1e-9


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_the_device_forms_step_is_the_cpu_kernels_bit_for_bit(simd: str, adamw_mode: bool) -> None:
    """Masters kept as (weight, residual), stepped by twinflow.precision.compact_step's torch operations, against
    the CPU kernel stepping the same masters in its (hi, lo) form: the same 24-bit masters and codes after every step,
    and the weight is the nearest bfloat16 of the master (the kernel's own output copy is the same rounding but
    for ties, which go to even there)."""
    from twinflow.host import ops
    from twinflow.precision import compact_step

    gen = torch.Generator().manual_seed(11)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode)
    n, base = 70001, 123
    start = torch.randn(n, generator=gen)
    kernel_master = compact.Master24.empty(n).copy_(start)
    weight, residual = weight_master.split(kernel_master.hi, kernel_master.lo)
    kernel_codes, codes = compact.fresh(n), dict(zip(compact_step.CODE_KEYS, compact.fresh(n)))
    for step in range(1, 7):
        grad = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4).to(torch.bfloat16)
        scale = 0.5 if step % 2 else 1.0
        masters, m24 = compact.kernel_masters([kernel_master])
        ops.adam_step_q8_(masters, [grad], *([c] for c in kernel_codes), [step], index_bases=[base],
                          grad_scale=scale, num_threads=2, simd=simd, **m24, **hyper)  # fmt: skip
        compact_step.step_weight_master_(weight, residual, grad, codes, step, base, hyper, scale)
        hi, lo = weight_master.join(weight, residual)
        assert torch.equal(hi.view(torch.int16), kernel_master.hi.view(torch.int16)), step
        assert torch.equal(lo, kernel_master.lo), step
        for got, want in zip(codes.values(), kernel_codes):
            assert torch.equal(got, want), step
        master = kernel_master.float()
        assert torch.all(
            (weight.float().double() - master.double()).abs()
            <= (master.bfloat16().float() - master).abs().double() + 1e-45
        )
    assert codes["m_codes"].abs().max() > 100 and not torch.equal(weight.float(), start.bfloat16().float())


@pytest.mark.cuda
def test_the_device_forms_step_on_cuda_is_the_same_bits_as_on_the_cpu() -> None:
    """The torch operations give the same bits on the GPU as on the CPU (and so as the CPU kernel): state moves
    between the sides without being rounded again."""
    from twinflow.precision import compact_step

    gen = torch.Generator().manual_seed(12)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True)
    n = 70001
    hi, lo = compact.encode_master(torch.randn(n, generator=gen))
    sides = {}
    for device in ("cpu", "cuda"):
        weight, residual = (t.to(device) for t in weight_master.split(hi, lo))
        codes = {k: t.to(device) for k, t in zip(compact_step.CODE_KEYS, compact.fresh(n))}
        g = torch.Generator().manual_seed(13)
        for step in range(1, 5):
            grad = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4).to(torch.bfloat16).to(device)
            compact_step.step_weight_master_(weight, residual, grad, codes, step, 5, hyper, 0.5 if step % 2 else 1.0)
        sides[device] = [weight.view(torch.int16).cpu(), residual.cpu()] + [t.cpu() for t in codes.values()]
    for a, b in zip(sides["cpu"], sides["cuda"]):
        assert torch.equal(a, b)


def test_a_tensor_multiplier_gives_the_bits_of_the_same_float() -> None:
    """The device side clips with a coefficient it never reads on the host (a tensor): the same bits as the
    kernel's float multiplier."""
    from twinflow.precision import compact_step

    gen = torch.Generator().manual_seed(14)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True)
    n = 5000
    hi, lo = compact.encode_master(torch.randn(n, generator=gen))
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    results = []
    for scale in (0.37, torch.tensor(0.37), 1.0, torch.tensor(1.0)):
        weight, residual = weight_master.split(hi, lo)
        codes = dict(zip(compact_step.CODE_KEYS, compact.fresh(n)))
        compact_step.step_weight_master_(weight, residual, grad, codes, 2, 0, hyper, scale)
        results.append([weight.view(torch.int16), residual, *codes.values()])
    for a, b in ((0, 1), (2, 3)):
        assert all(torch.equal(x, y) for x, y in zip(results[a], results[b]))
    assert not torch.equal(results[0][2], results[2][2])  # the multiplier reaches the moments (the update is
    # scale-free on a first step from zero moments, the moments are not)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_master24_copy_is_the_nearest_encoding_of_any_source(dtype: torch.dtype) -> None:
    """Master24.copy_ (which takes bfloat16 weights without encoding them) holds what encode_master gives the
    values, for every bfloat16 bit pattern and random values of the wider dtypes (NaN, infinities, subnormals)."""
    if dtype == torch.bfloat16:
        src = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    else:
        gen = torch.Generator().manual_seed(3)
        src = (torch.randn(70_000, generator=gen) * torch.logspace(-45, 38, 70_000).float()).to(dtype)
        src[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    master = compact.Master24.empty(src.numel())
    master.hi.fill_(7.0), master.lo.fill_(0x5A)  # poisoned: every element must be written
    master.copy_(src)
    hi, lo = compact.encode_master(src.float())
    assert torch.equal(master.hi.view(torch.int16), hi.view(torch.int16))
    assert torch.equal(master.lo, lo)


def test_write_weight_gives_the_weight_of_the_masters_batch_by_batch() -> None:
    """A load sets a bf16 weight from float32 masters on the weight's device, a batch at a time (more than two
    batches and a tail here): the same bits as weight_of over the whole tensor, and every element written."""
    n = 2 * compact.COPY_ELEMENTS + 3 * compact.BLOCK + 77
    master = torch.randn(n, generator=torch.Generator().manual_seed(3)) * torch.logspace(-4, 2, n)
    weight = torch.full((n,), float("nan"), dtype=torch.bfloat16)  # poisoned: an element left unwritten shows
    weight_master.write_weight(weight, master)
    assert torch.equal(weight, weight_master.weight_of(master))
