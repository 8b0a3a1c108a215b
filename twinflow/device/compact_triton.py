"""The compact device step as one Triton kernel: a program per block of :data:`twinflow.precision.compact.BLOCK`
elements, its moments' block maxima kept in registers, every byte read once and written once.

It is :mod:`twinflow.precision.compact_step`'s step (the CPU kernel's, csrc/adam_q8.h) written for a GPU, with the
same bits: float32 products and sums rounded one at a time (the kernel is compiled with ``enable_fp_fusion=False``:
no product and sum contracted into one multiply-add), the quotient and square root correctly rounded
(``div_rn``, ``sqrt_rn``: what the CPU kernel and the float64 round trip of the torch step give), the codes and
24-bit masters made with the same integer operations on bit patterns, the rounding noise the same hash of the
element's index and the step. ``tests/test_compact_triton.py`` checks it against the torch step on the CPU through
Triton's interpreter, and ``pytest -m cuda tests/test_device_compact.py`` on a GPU against the CPU kernel.

A kernel compiles in about a second the first time a form (residual or float32 master, the weight's and the
gradient's dtypes, L2 or not) is stepped, and Triton keeps it on disk for later runs: the first step no longer
waits for torch.compile's graphs (tens of seconds, several of them, for OPT-30B).

Two entry points with :mod:`~twinflow.precision.compact_step`'s signatures, :func:`residual_step_` and
:func:`master_step_`, take a batch's tensors (flat, a block-aligned first element), its constants ``c``
(:data:`~twinflow.precision.compact_step.CONSTANTS`' order, float32), the gradient multiplier (a float32 scalar
tensor; None: 1), ``meta`` (the first element's index, the step's noise key: an int64 tensor) and whether the
gradient gets the L2 term.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

from twinflow.precision import compact

try:  # a GPU build of torch brings Triton; a CPU build does not need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover (the callers ask available() first)
    triton = tl = None

BLOCK = compact.BLOCK
# A program steps ROWS blocks with NUM_WARPS warps: eight elements a thread. On an H200, 2^30 elements (one launch):
# 51% of the HBM roofline at ROWS 1, 51% at 2 and 4 with as many warps, 49% at 8; 42% or less at any other
# count of elements a thread (benchmarks/bench_compact_device.py --sweep).
ROWS = 1
NUM_WARPS = 1


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: on the CPU, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device) -> bool:
    """Whether the kernel steps tensors on `device`: Triton is there and the device is a GPU (the interpreter, which
    runs it on the CPU for the tests, is never chosen for state on the CPU)."""
    return triton is not None and device.type == "cuda"


if triton is not None:  # the kernels (under TRITON_INTERPRET=1 at import: the interpreter's, on the CPU)
    _BLOCK = tl.constexpr(BLOCK)

    @triton.jit
    def _pow2(field):
        """2^(field - 127) as float32, for int32 exponent fields in [1, 254]."""
        return (field << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _decode(a, d):
        """q8_decode of magnitudes `a` (int32, sign apart) in a block whose shift is `d` (int32, >= 0)."""
        x = (a << 20).to(tl.float32, bitcast=True)
        wide = d > 127
        x = x * _pow2(tl.where(wide, d, d + 127))
        return tl.where(wide, x * 1.7014118346046923e38, x)

    @triton.jit
    def _field(x, mask, top: tl.constexpr):
        """q8_field (stochastic rounding's rule) of each block (row) of `x`: from its largest magnitude's bit
        pattern. ((L >> 20) + 1) >> 3 is (L + 2^20) >> 23 without the int32 overflow of a NaN's pattern."""
        bits = tl.where(mask, tl.abs(x).to(tl.int32, bitcast=True), 0)
        largest = tl.max(bits, axis=1)  # non-negative patterns order as their values (NaN above all)
        return tl.minimum(tl.maximum(((largest >> 20) + 1) >> 3, top), 254)

    @triton.jit
    def _encode(x, noise, d, top_code: tl.constexpr):
        """q8_encode of magnitudes `x` (float32, >= 0) with 16 random bits each (`noise`, uint32), shift `d`. A NaN
        (its sign bit cut: the pattern of any NaN, then, lies above the top code's) gets the top code."""
        wide = d > 126
        y = x * _pow2(tl.where(wide, 253 - d, 127 - d))
        y = tl.where(wide, y * 1.1754943508222875e-38, y)
        r = (noise << 4) | 8
        return tl.minimum(((y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) + r) >> 20, top_code).to(tl.int32)

    @triton.jit
    def _adam(grad_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, c_ptr, scale_ptr, meta_ptr, first, offs, mask, rows,
              row_mask, master, L2: tl.constexpr):  # fmt: skip
        """The update of ROWS blocks from element `first` (`offs`: [ROWS, BLOCK] int32 offsets from it; `rows`: the
        blocks' indices from first's): their masters `master` (float32), their gradients and moments (loaded here);
        stores the new codes and block scales, and returns (new masters, noise)."""
        # the step's constants, as compact_step.CONSTANTS orders them
        b1, b2 = tl.load(c_ptr + 0), tl.load(c_ptr + 1)
        omb1, omb2 = tl.load(c_ptr + 2), tl.load(c_ptr + 3)
        eps, step_size = tl.load(c_ptr + 4), tl.load(c_ptr + 5)
        inv_bc2, l2, param_scale = tl.load(c_ptr + 6), tl.load(c_ptr + 7), tl.load(c_ptr + 8)
        block0 = first // _BLOCK
        # the moments, decoded
        mc = tl.load(mc_ptr + first + offs, mask=mask, other=0).to(tl.int32)
        vc = tl.load(vc_ptr + first + offs, mask=mask, other=0).to(tl.int32)
        dm = tl.maximum(tl.load(ms_ptr + block0 + rows, mask=row_mask, other=0).to(tl.int32) - 15, 0)[:, None]
        dv = tl.maximum(tl.load(vs_ptr + block0 + rows, mask=row_mask, other=0).to(tl.int32) - 31, 0)[:, None]
        m = _decode(tl.abs(mc), dm)
        m = tl.where(mc < 0, -m, m)
        v = _decode(vc, dv)
        # Adam, one rounding an operation
        g = tl.load(grad_ptr + first + offs, mask=mask, other=0).to(tl.float32) * tl.load(scale_ptr)
        if L2:
            g = g + l2 * master
        m_new = b1 * m + omb1 * g
        v_new = b2 * v + omb2 * (g * g)
        denom = tl.sqrt_rn(v_new) * inv_bc2 + eps
        p_new = master * param_scale - step_size * tl.div_rn(m_new, denom)
        # the noise: lowbias32 of the element's index plus the step's key (mod 2^32)
        x = ((tl.load(meta_ptr + 0) + first + tl.load(meta_ptr + 1)) & 0xFFFFFFFF).to(tl.uint32) + offs.to(tl.uint32)
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        h = x ^ (x >> 16)
        # the moments, encoded: block scales from their largest magnitudes, codes stochastically rounded
        fm, fv = _field(m_new, mask, 15), _field(v_new, mask, 31)
        am = _encode(tl.abs(m_new), h & 0xFFFF, tl.maximum(fm - 15, 0)[:, None], 127)
        negative = m_new.to(tl.int32, bitcast=True) < 0
        tl.store(mc_ptr + first + offs, tl.where(negative, -am, am).to(tl.int8), mask=mask)
        cv = tl.maximum(_encode(v_new, h >> 16, tl.maximum(fv - 31, 0)[:, None], 255), (v_new > 0).to(tl.int32))
        tl.store(vc_ptr + first + offs, cv.to(tl.uint8), mask=mask)
        tl.store(ms_ptr + block0 + rows, fm.to(tl.uint8), mask=row_mask)
        tl.store(vs_ptr + block0 + rows, fv.to(tl.uint8), mask=row_mask)
        return p_new, h

    @triton.jit
    def _tile(n, ROWS: tl.constexpr):
        """This program's ROWS blocks: their first element (int64), the [ROWS, BLOCK] int32 offsets from it, which
        are elements, the blocks' indices from the first's and which are blocks."""
        first = tl.program_id(0).to(tl.int64) * (ROWS * _BLOCK)
        rows = tl.arange(0, ROWS)
        offs = rows[:, None] * _BLOCK + tl.arange(0, _BLOCK)[None, :]
        left = n - first  # elements from `first` on (> 0)
        return first, offs, offs < left, rows, rows * _BLOCK < left

    @triton.jit
    def _residual_kernel(w_ptr, r_ptr, grad_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, c_ptr, scale_ptr, meta_ptr, n,
                        L2: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
        """Masters kept as a bfloat16 weight and a residual byte (twinflow.precision.weight_master)."""
        first, offs, mask, rows, row_mask = _tile(n, ROWS)
        # the 24-bit master of (weight, residual): weight_master.decode
        w = tl.load(w_ptr + first + offs, mask=mask, other=0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        res = tl.load(r_ptr + first + offs, mask=mask, other=0).to(tl.int32)
        w_mag = w & 0x7FFF
        m24 = ((w & 0x8000) << 8) | ((w_mag << 8) + tl.where(w_mag >= 0x7F80, 0, res))
        pattern = ((((m24 >> 8) & 0xFFFF) << 8) | (m24 & 0xFF)).to(tl.uint32) << 8
        master = pattern.to(tl.float32, bitcast=True)
        p_new, h = _adam(grad_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, c_ptr, scale_ptr, meta_ptr, first, offs, mask,
                         rows, row_mask, master, L2)  # fmt: skip
        # rounded to 24 bits with the noise's low byte (compact.encode_master), then split (weight_master.split)
        noise = tl.where(p_new != p_new, 0, h & 0xFF)
        t = ((p_new.to(tl.uint32, bitcast=True) + noise) >> 8).to(tl.int32)
        sign, mag = t & 0x800000, t & 0x7FFFFF
        weight = (mag + 0x80) >> 8
        weight = tl.where(weight >= 0x7F80, 0x7F7F, weight)
        residual = tl.minimum(mag - (weight << 8), 127)
        special = mag >= (0x7F80 << 8)
        weight = tl.where(special, tl.where(mag == (0x7F80 << 8), 0x7F80, 0x7FC0), weight)
        residual = tl.where(special, 0, residual)
        pattern16 = (weight | (sign >> 8)).to(tl.int16)
        tl.store(w_ptr + first + offs, pattern16.to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(r_ptr + first + offs, residual.to(tl.int8), mask=mask)

    @triton.jit
    def _master_kernel(p_ptr, out_ptr, grad_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, c_ptr, scale_ptr, meta_ptr, n,
                      L2: tl.constexpr, HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
        """float32 masters, and their copy in the weight's dtype (rounded to the nearest) where `HAS_OUT`."""
        first, offs, mask, rows, row_mask = _tile(n, ROWS)
        master = tl.load(p_ptr + first + offs, mask=mask, other=0.0)
        p_new, h = _adam(grad_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, c_ptr, scale_ptr, meta_ptr, first, offs, mask,
                         rows, row_mask, master, L2)  # fmt: skip
        tl.store(p_ptr + first + offs, p_new, mask=mask)
        if OUT_BF16:  # to the nearest, ties to even, as torch's conversion (written out: it is the same everywhere)
            bits = p_new.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # a carry out of 32 bits is cut by the int16 below
            rounded = tl.where(p_new != p_new, 0x7FC0, rounded.to(tl.int32)).to(tl.int16)
            tl.store(out_ptr + first + offs, rounded.to(tl.bfloat16, bitcast=True), mask=mask)
        elif HAS_OUT:
            tl.store(out_ptr + first + offs, p_new.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(kernel: Callable, n: int, *args: object, **constants: object) -> None:
    """`kernel` over the blocks of `n` elements, ROWS blocks a program, on the device of the tensors (`args[0]`'s),
    not the current one."""
    grid = (triton.cdiv(compact.blocks(n), ROWS),)
    device = args[0].device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](*args, n, **constants, ROWS=ROWS, num_warps=NUM_WARPS, enable_fp_fusion=False)


def _scale(scale: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if scale is None:  # a multiplication by 1 keeps every bit
        return torch.ones((), dtype=torch.float32, device=like.device)
    return scale.detach().to(like.device, torch.float32)


def residual_step_(weight, residual, grad, codes, c, scale, meta, l2) -> None:  # noqa: ANN001
    """:func:`twinflow.precision.compact_step.residual_step_`, in one kernel launch."""
    n = weight.numel()
    if n == 0:
        return
    _launch(_residual_kernel, n, weight, residual, grad, *codes, c, _scale(scale, weight), meta, L2=bool(l2))


def master_step_(master, weight_out, grad, codes, c, scale, meta, l2) -> None:  # noqa: ANN001
    """:func:`twinflow.precision.compact_step.master_step_`, in one kernel launch."""
    n = master.numel()
    if n == 0:
        return
    out = master if weight_out is None else weight_out
    _launch(_master_kernel, n, master, out, grad, *codes, c, _scale(scale, master), meta, L2=bool(l2),
            HAS_OUT=weight_out is not None, OUT_BF16=out.dtype == torch.bfloat16)  # fmt: skip
