"""8-bit moments (``state_precision="int8"``): the layout the kernel keeps, decoded and encoded in torch.

Per block of ``BLOCK`` elements of a tensor (the last one may be short), each
moment has one byte of scale: the float32 exponent field ``F`` of a power of
two, chosen from the block's largest magnitude so that it stays within the
top code. Each element has one byte of code: a small floating-point number
relative to that scale, with 3 mantissa bits.

- ``exp_avg``: int8, a sign and 7 bits of magnitude ``a`` (4 exponent bits:
  15 binades, down to 2^-14 of the block's top binade).
- ``exp_avg_sq``: uint8, 8 bits of magnitude (5 exponent bits: 31 binades,
  down to 2^-30). The wide range matters more here than the precision: a
  ``v`` rounded to zero beside a large one in its block would blow its
  element's update up. Below the range, a positive ``v`` keeps the lowest
  nonzero code (rounded up: its update only shrinks).

A magnitude shifted left by 20 is the bit pattern of a float32 near the
bottom of float32's range (its exponent field is the code's; the evenly
spaced codes below the lowest binade are float32 subnormals). Decoding
multiplies it by ``2^D``, ``D = F - top field`` (15 or 31, at least 0);
encoding multiplies by ``2^-D``, adds random bits below the kept mantissa and
shifts right: stochastic rounding that is right on average, so a moment that
moves by less than a code step per step still moves on average
(``exp_avg_sq`` moves by ``1 - beta2 = 0.001`` of itself per step, far below
a code step). The noise is a hash of the element's index and the step. Host
state: 4 (float32 master) + 1 + 1 bytes per element, plus 2 bytes per block.

``state_precision="int8_m24"`` keeps the same moments and a 24-bit master
(:class:`Master24`, bottom of this module): 3 + 1 + 1 bytes per element, plus
the 2 per block.

This is the definition, written the short way. The kernel (csrc/adam_q8.h)
gets the same bits without a multiply, working on bit patterns so that no
subnormal appears on the way (on x86 those take slow microcode assists), and
matches this bit for bit (tests/test_compact_kernel.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BLOCK = 256  # csrc/adam_span.h kQ8Block
COPY_ELEMENTS = 1 << 20  # 24-bit master copies and host reads convert this many elements at a time (scratch ~48 MiB)
TOP_FIELD_M, TOP_FIELD_V = 15, 31  # exponent bits: 4 for exp_avg, 5 for exp_avg_sq
_M32 = 0xFFFFFFFF
_SALT = 0x2545F491
_F32 = torch.float32


def spans(numel: int, size: int = COPY_ELEMENTS) -> list[tuple[int, int]]:
    """[a, b) ranges of at most `size` elements covering `numel` (each `a` a block's start when `size` is a
    multiple of the block): work done a batch at a time keeps its scratch bounded, whatever the tensor."""
    return [(a, min(numel, a + size)) for a in range(0, numel, size)]


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def fresh(n: int, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Fresh 8-bit moments of n elements on `device` (default: the host), as the kernel takes them: exp_avg
    codes and scales, exp_avg_sq codes and scales (all zero: both moments zero)."""
    codes = [(n, torch.int8), (blocks(n), torch.uint8), (n, torch.uint8), (blocks(n), torch.uint8)]
    return [torch.zeros(size, dtype=dtype, device=device) for size, dtype in codes]


def _per_element(per_block: torch.Tensor, numel: int) -> torch.Tensor:
    # a gather, not repeat_interleave: its output's size is known from `numel`, so torch.compile keeps it fused
    return per_block[torch.arange(numel, device=per_block.device) // BLOCK]


def _pow2(field: torch.Tensor | int) -> torch.Tensor:
    """2^(field - 127) in float32, for exponent fields in [1, 254]."""
    return (torch.as_tensor(field, dtype=torch.int64) << 23).to(torch.int32).view(_F32)


def block_shift(scales: torch.Tensor, numel: int, top: int, block_of: torch.Tensor | None = None) -> torch.Tensor:
    """Each element's ``D = F - top`` (int64, at least 0): its block's scale field ``F`` (``scales``, one per block
    of ``numel`` elements; `block_of`: each element's block, where they are not counted from the first) minus the
    moment's top field (:data:`TOP_FIELD_M` or :data:`TOP_FIELD_V`). Decoding multiplies a code's value by
    ``2^D``, encoding by ``2^-D``; below the block's lowest binade the codes are ``2^(D - 129)`` apart."""
    fields = _per_element(scales.to(torch.int64), numel) if block_of is None else scales[block_of].to(torch.int64)
    return torch.clamp(fields - top, min=0)


def _decode(a: torch.Tensor, sign: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """csrc/adam_q8.h q8_decode: magnitudes a (int64) with sign bits, blocks' D per element."""
    x = ((a << 20) | sign).to(torch.int32).view(_F32)
    wide = d > 127
    x = x * _pow2(torch.where(wide, d, d + 127))  # d > 127: 2^(d - 127), then 2^127
    return torch.where(wide, x * _pow2(254), x)


def decode_exp_avg(codes: torch.Tensor, scales: torch.Tensor, block_of: torch.Tensor | None = None) -> torch.Tensor:
    """exp_avg in float32 from its codes and its blocks' scales (`block_of`: as :func:`block_shift` takes it)."""
    c = codes.to(torch.int64)
    return _decode(c.abs(), (c < 0).to(torch.int64) << 31, block_shift(scales, c.numel(), TOP_FIELD_M, block_of))


def decode_exp_avg_sq(codes: torch.Tensor, scales: torch.Tensor, block_of: torch.Tensor | None = None) -> torch.Tensor:
    """exp_avg_sq in float32 from its codes and its blocks' scales (`block_of`: as :func:`block_shift` takes it)."""
    shift = block_shift(scales, codes.numel(), TOP_FIELD_V, block_of)
    return _decode(codes.to(torch.int64), torch.zeros((), dtype=torch.int64), shift)


def hash32(index: torch.Tensor, key: int) -> torch.Tensor:
    """The kernel's rounding noise: lowbias32 (Wellons) of index + key, for int64 indices."""
    x = (index + key) & _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def key(step: int) -> int:
    return ((step * 0x85EBCA77) & _M32) ^ _SALT


def _block_max(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    padded = x.new_zeros(blocks(n) * BLOCK, dtype=_F32)
    padded[:n] = x
    return padded.view(-1, BLOCK).amax(dim=1)


def _field(largest: torch.Tensor, top: int, nearest: bool = False) -> torch.Tensor:
    """csrc/adam_q8.h q8_field: each block's exponent field, one higher where its largest value could round above
    the top code: stochastically (the kernel's rule: 1.875 times a power of two or more), or (`nearest`) to the
    nearest code (1.9375 or more; so a block decoded and encoded again keeps its field and its codes)."""
    f = ((largest.view(torch.int32).to(torch.int64) & _M32) + (1 << (19 if nearest else 20))) >> 23
    return torch.clamp(f, min=top, max=254).to(torch.uint8)


def _encode(x: torch.Tensor, noise: torch.Tensor, d: torch.Tensor, top_code: int) -> torch.Tensor:
    """csrc/adam_q8.h q8_encode: magnitudes x >= 0 to codes; noise: 16 random bits per element."""
    wide = d > 126
    y = x * _pow2(torch.where(wide, 253 - d, 127 - d))  # d > 126: 2^-(d - 126), then 2^-126
    y = torch.where(wide, y * _pow2(1), y)
    r = (noise << 4) | 8
    return torch.clamp(((y.view(torch.int32).to(torch.int64) & _M32) + r) >> 20, max=top_code)


def encode(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, noise: torch.Tensor | None = None):
    """(exp_avg codes, scales, exp_avg_sq codes, scales) of float32 moments; `noise`: the stochastic rounding's 32
    random bits per element (the kernel's: :func:`kernel_noise`), else to the nearest code (as a load does)."""
    m, v = exp_avg.reshape(-1).to(_F32), exp_avg_sq.reshape(-1).to(_F32)
    n = m.numel()
    h = noise if noise is not None else torch.full((n,), 0x80008000, dtype=torch.int64, device=m.device)
    nearest = noise is None
    scale_m = _field(_block_max(m.abs()), TOP_FIELD_M, nearest)
    scale_v = _field(_block_max(v), TOP_FIELD_V, nearest)
    a = _encode(m.abs(), h & 0xFFFF, block_shift(scale_m, n, TOP_FIELD_M), 127)
    codes_m = torch.where(torch.signbit(m), -a, a)
    # a positive v keeps at least the lowest code: zero beside a nonzero m would make the update m / eps
    codes_v = torch.maximum(_encode(v, h >> 16, block_shift(scale_v, n, TOP_FIELD_V), 255), (v > 0).to(torch.int64))
    return codes_m.to(torch.int8), scale_m, codes_v.to(torch.uint8), scale_v


def kernel_noise(index_base: int, numel: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """The noise the kernel rounds a tensor's moments with at `step` (index_base: its first element's index)."""
    index = (torch.arange(numel, dtype=torch.int64, device=device) + index_base) & _M32
    return hash32(index, key(step))


# ---------------------------------------------------------------------------------------------------------------
# 24-bit masters (state_precision "int8_m24"): a float32's top 16 bits (a bfloat16: sign, exponent, 7 mantissa bits)
# and its next 8 mantissa bits (uint8); the low 8 are zero. 15 mantissa bits: a relative step of 2^-15. The kernel
# rounds each new master to them stochastically: it adds 8 random bits (the element's hash's low 8) to the float32
# bit pattern and cuts the low 8 (csrc/adam_q8.h m24_encode), which rounds the magnitude up with probability
# (cut bits) / 256, so the master is right on average and updates far below its step still move it.


def decode_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 values of 24-bit masters (hi: bfloat16, lo: uint8)."""
    bits = ((hi.view(torch.int16).to(torch.int64) & 0xFFFF) << 16) | (lo.to(torch.int64) << 8)
    return bits.to(torch.int32).view(_F32)  # int64 -> int32 wraps: the bit pattern, sign included


def encode_master(x: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) of float32 values `x`; `noise`: 8 random bits per element (the kernel's: the low 8 of
    :func:`kernel_noise`), else to the nearest (ties away from zero, as a load does)."""
    x = x.reshape(-1).to(_F32)
    bits = x.view(torch.int32).to(torch.int64) & _M32
    noise = torch.where(torch.isnan(x), 0, noise if noise is not None else 0x80)  # a NaN is cut: no carry into the sign
    t = ((bits + noise) & _M32) >> 8
    hi = (t >> 8).to(torch.int32).to(torch.int16).view(torch.bfloat16)  # 16-bit pattern: wraps to int16
    return hi, (t & 0xFF).to(torch.uint8)


def kernel_masters(masters: list) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """The 8-bit op's ``params`` for these masters, and its keyword arguments for them: float32 tensors as they
    are; 24-bit ones (:class:`Master24`) as their top halves, with their low bytes as ``master_lows``."""
    if masters and isinstance(masters[0], Master24):
        return [m.hi for m in masters], {"master_lows": [m.lo for m in masters]}
    return list(masters), {}


class Master24:
    """A flat range of 24-bit masters: ``hi`` (bfloat16, the top 16 bits) and ``lo`` (uint8, the next 8).

    Stands where a float32 master tensor would: sliced, copied into (rounded to the nearest), read back
    (:meth:`float`).
    """

    def __init__(self, hi: torch.Tensor, lo: torch.Tensor) -> None:
        self.hi, self.lo = hi, lo

    @classmethod
    def empty(cls, n: int, alloc: Callable[..., torch.Tensor] = torch.empty) -> Master24:
        """`n` masters to be written, made by `alloc` (``torch.zeros``: their pages touched now)."""
        return cls(alloc(n, dtype=torch.bfloat16), alloc(n, dtype=torch.uint8))

    def __getitem__(self, index: slice) -> Master24:
        return Master24(self.hi[index], self.lo[index])

    def numel(self) -> int:
        return self.hi.numel()

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes

    def data_ptr(self) -> int:
        return self.hi.data_ptr()

    def float(self) -> torch.Tensor:
        return decode_master(self.hi, self.lo)

    def copy_(self, src: torch.Tensor) -> Master24:
        """`src`'s values, rounded to the nearest 24-bit master (ties away from zero)."""
        flat = src.detach().reshape(-1)
        if flat.dtype == torch.bfloat16:  # a bfloat16 is a 24-bit master exactly: the top half, a zero low byte
            self.hi.copy_(flat)
            self.lo.zero_()
            return self
        for a, b in spans(flat.numel()):  # encoded where `src` lives, a span at a time: bounded scratch there
            hi, lo = encode_master(flat[a:b])
            self.hi[a:b].copy_(hi)
            self.lo[a:b].copy_(lo)
        return self
