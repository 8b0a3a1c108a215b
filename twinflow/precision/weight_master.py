"""24-bit masters whose top half is the weight itself: the layout for a compact device share.

The CPU side keeps a 24-bit master as its top 16 bits and its next 8 (:class:`twinflow.precision.compact.Master24`:
``hi`` and ``lo``, a truncation), and uploads the weight rounded to the nearest. On the device the weight is
already there: if it were ``hi``, a truncation, every weight would sit below its master's magnitude by half a
bfloat16 step on average, a bias toward zero. So the device form is the weight rounded to the nearest (ties
away from zero) and a signed byte, the master's distance from it in steps of 2^-8 of the weight's step:

    magnitude pattern of the master (24 bits) = 256 * that of the weight (16 bits) + residual,  -128 <= residual <= 127

Both forms hold the same 24-bit value, and the conversions are exact, so state moves between the sides (a new
ratio, a checkpoint) without being rounded again. Infinities keep residual 0; a NaN becomes bfloat16's quiet
NaN with its sign; a master beyond bfloat16's largest finite value less half a step is held at that value
plus 127/256 of a step (its weight must stay finite).
"""

from __future__ import annotations

import torch

from twinflow.precision import compact

_SIGN24, _MAG24 = 0x800000, 0x7FFFFF
_INF16, _QNAN16, _MAX16 = 0x7F80, 0x7FC0, 0x7F7F


def _patterns(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return ((hi.view(torch.int16).to(torch.int64) & 0xFFFF) << 8) | lo.to(torch.int64)


def _bf16(pattern: torch.Tensor) -> torch.Tensor:
    return pattern.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # 16-bit pattern: wraps to int16


def split(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, residual) of 24-bit masters given as (hi: bfloat16, lo: uint8): the weight is the master
    rounded to the nearest bfloat16 (ties away from zero), the residual an int8."""
    m24 = _patterns(hi, lo)
    sign, mag = m24 & _SIGN24, m24 & _MAG24
    weight = (mag + 0x80) >> 8
    weight = torch.where(weight >= _INF16, _MAX16, weight)  # a finite master keeps a finite weight
    residual = (mag - (weight << 8)).clamp(max=127)
    special = mag >= _INF16 << 8  # infinity or NaN: the weight says it, the residual is 0
    weight = torch.where(special, torch.where(mag == _INF16 << 8, _INF16, _QNAN16), weight)
    residual = torch.where(special, 0, residual)
    return _bf16(weight | (sign >> 8)), residual.to(torch.int8)


def join(weight: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) of the masters that (weight, residual) hold: :func:`split`'s inverse."""
    w = weight.view(torch.int16).to(torch.int64) & 0xFFFF
    sign, w_mag = (w & 0x8000) << 8, w & 0x7FFF
    mag = (w_mag << 8) + torch.where(w_mag >= _INF16, 0, residual.to(torch.int64))
    m24 = sign | mag
    return _bf16(m24 >> 8), (m24 & 0xFF).to(torch.uint8)


def decode(weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The float32 values of the masters (weight, residual) hold."""
    hi, lo = join(weight, residual)
    bits = (_patterns(hi, lo) << 8).to(torch.int32)  # int64 -> int32 wraps: the bit pattern, sign included
    return bits.view(torch.float32)


def weight_of(master: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weight of float32 masters as a 24-bit master's weight: the master rounded to 24 bits (to the
    nearest), then to the nearest bfloat16, ties away from zero (where torch's conversion goes to even). Both
    sides give a bf16 parameter under "int8_m24" this weight."""
    flat = master.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.bfloat16, device=flat.device)
    for a, b in compact.spans(flat.numel()):
        out[a:b] = split(*compact.encode_master(flat[a:b]))[0]
    return out.view(master.shape)


def write_weight(weight: torch.Tensor, master: torch.Tensor) -> None:
    """Sets the contiguous bfloat16 `weight` to :func:`weight_of` `master` (anywhere), converted a batch at a time on
    the weight's device: a load's host masters convert on the GPU, not in the host's one torchrun thread."""
    out, flat = weight.view(-1), master.reshape(-1)
    for a, b in compact.spans(flat.numel()):
        out[a:b] = split(*compact.encode_master(flat[a:b].to(out.device, torch.float32)))[0]
