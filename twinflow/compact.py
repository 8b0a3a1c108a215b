"""8-bit moments (``state_precision="int8"``): the layout the kernel keeps, decoded and encoded in torch.

Per block of ``BLOCK`` elements of a tensor (the last one may be short):

- ``exp_avg``: int8 codes ``c`` and one float32 scale ``s``, the block's
  largest ``|m|``; ``m = s * t * |t|`` with ``t = c / 127``.
- ``exp_avg_sq``: uint8 codes and one float32 scale ``w``, the square root of
  the block's largest ``v``; ``v = (w * t * t)^2`` with ``t = c / 255``.

Square-root companding keeps codes for values far below the block's largest
(a linear code would round them to zero, and a zero ``v`` under a nonzero
``m`` would blow the update up). The kernel rounds stochastically, to the
grid value below or above with the probabilities that make the decoded
value right on average (rounding the code itself up with probability
``frac(code)`` would not: the grid is curved, and the bias compounds), with
noise hashed from the element's index and the step. So a moment that moves
by less than a code step per step still moves on average (``exp_avg_sq``
moves by ``1 - beta2 = 0.001`` of itself per step, far below a code step). Host state:
4 (float32 master) + 1 + 1 bytes per element, plus 8 bytes per block.
Everything here mirrors csrc/adam_q8.h operation by operation, in float32.
"""

from __future__ import annotations

import torch

BLOCK = 256  # csrc/adam_span.h kQ8Block
_M32 = 0xFFFFFFFF
_SALT_M, _SALT_V = 0x2545F491, 0x9B97A4D3
_F32 = torch.float32


PRECISIONS = ("fp32", "int8")


def check_state_precision(state_precision: object) -> str:
    if state_precision not in PRECISIONS:
        raise ValueError(
            f"state_precision={state_precision!r}; expected 'fp32' (the default: exact) or 'int8' (the CPU share's "
            "moments in 8 bits with a scale per 256 elements: 6 bytes of host state a parameter instead of 12, "
            "not exact)"
        )
    return state_precision


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root, as the kernel's (torch's own float32 sqrt on the CPU is not:
    about 1 in 6 results differ in the last bit)."""
    return x.double().sqrt().to(_F32)


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def fresh(n: int) -> list[torch.Tensor]:
    """Fresh 8-bit moments of n elements, as the kernel takes them: exp_avg codes and scales, exp_avg_sq codes
    and scales (all zero: both moments zero)."""
    return [torch.zeros(n, dtype=torch.int8), torch.zeros(blocks(n)), torch.zeros(n, dtype=torch.uint8),
            torch.zeros(blocks(n))]  # fmt: skip


def _per_element(scales: torch.Tensor, numel: int) -> torch.Tensor:
    return scales.repeat_interleave(BLOCK)[:numel]


def decode_exp_avg(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    t = codes.to(_F32) * torch.tensor(1.0 / 127.0, dtype=_F32)
    return _per_element(scales, codes.numel()) * (t * t.abs())


def decode_exp_avg_sq(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    t = codes.to(_F32) * torch.tensor(1.0 / 255.0, dtype=_F32)
    w = _per_element(scales, codes.numel()) * (t * t)
    return w * w


def uniform(index: torch.Tensor, key: int) -> torch.Tensor:
    """The kernel's rounding noise (lowbias32 of index * golden ratio + key, top 24 bits), for int64 indices."""
    x = (index * 0x9E3779B1 + key) & _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return (x >> 8).to(_F32) * torch.tensor(2.0**-24, dtype=_F32)


def key(step: int, salt: int) -> int:
    return ((step * 0x85EBCA77) & _M32) ^ salt


def _block_max(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    padded = torch.zeros(blocks(n) * BLOCK, dtype=_F32)
    padded[:n] = x
    return padded.view(-1, BLOCK).amax(dim=1)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), torch.zeros((), dtype=_F32))


def _code(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor, top: float, fourth: bool) -> torch.Tensor:
    """csrc/adam_q8.h q8_code: floor(y) or floor(y) + 1 on the grid (c / top)^2 (^4 if `fourth`), up with the
    probability that makes the decoded value right on average."""
    f = lambda v: torch.tensor(v, dtype=_F32)  # noqa: E731
    lo = torch.clamp(y.floor(), max=top - 1.0)

    def grid(c: torch.Tensor) -> torch.Tensor:
        t = c * f(1.0 / top)
        t2 = t * t
        return t2 * t2 if fourth else t2

    below = grid(lo)
    p = torch.clamp((x - below) / (grid(lo + f(1.0)) - below), 0.0, 1.0)
    return torch.clamp(lo + (p + u).floor(), max=top)


def encode(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, noise: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(exp_avg codes, scales, exp_avg_sq codes, scales) of float32 moments; `noise` (per element, in [0, 1)):
    the stochastic rounding's, else 0.5 (to the nearest grid value, as a load does)."""
    m, v = exp_avg.reshape(-1).to(_F32), exp_avg_sq.reshape(-1).to(_F32)
    n = m.numel()
    u_m, u_v = noise if noise is not None else (torch.full((n,), 0.5), torch.full((n,), 0.5))
    scale_m = _block_max(m.abs())
    scale_w = sqrt32(_block_max(v))
    xm = m.abs() * _per_element(_inverse(scale_m), n)
    codes_m = torch.copysign(_code(xm, torch.tensor(127.0, dtype=_F32) * sqrt32(xm), u_m, 127.0, False), m)
    a = sqrt32(v) * _per_element(_inverse(scale_w), n)
    codes_v = _code(a * a, torch.tensor(255.0, dtype=_F32) * sqrt32(a), u_v, 255.0, True)
    return codes_m.to(torch.int8), scale_m, codes_v.to(torch.uint8), scale_w


def kernel_noise(index_base: int, numel: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise the kernel rounds a tensor's moments with at `step` (index_base: its first element's index)."""
    index = (torch.arange(numel, dtype=torch.int64) + index_base) & _M32
    return uniform(index, key(step, _SALT_M)), uniform(index, key(step, _SALT_V))
