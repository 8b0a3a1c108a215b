"""Adam over compact state (8-bit moments, 24-bit masters) written once as float32 torch operations.

The CPU kernel's update (csrc/adam_q8.h), one operation at a time and in its order, with its constants
(csrc/cpu_adam.cpp make_consts: computed in double, each rounded to float32) and its rounding noise: on the
CPU it gives the kernel's bits exactly (tests/test_compact_kernel.py checks this on every SIMD path). It is the
device side's step for compact state (:mod:`twinflow.device.device_compact`), where a bf16 parameter's master is kept
as the weight plus a residual byte (:mod:`twinflow.precision.weight_master`): :func:`step_weight_master_`.

Quotients and square roots are taken in float64 and rounded to float32 (the correctly rounded float32 result,
which a GPU's fast float32 division is not), and every rounded result passes an integer OR with a zero the
compiler cannot see (the constants' last entry), so that torch.compile's GPU code neither contracts a product
and a sum into one multiply-add nor drops a rounding between two float64 operations. Compiled for the GPU, the
step is meant to keep the CPU kernel's bits too (``pytest -m cuda tests/test_device_compact.py`` checks it).
"""

from __future__ import annotations

import math

import torch

from twinflow.precision import compact, weight_master

F32, F64 = torch.float32, torch.float64
CODE_KEYS = ("m_codes", "m_scales", "v_codes", "v_scales")
CONSTANTS = ("b1", "b2", "omb1", "omb2", "eps", "step_size", "inv_bc2_sqrt", "l2", "param_scale", "zero")
_B1, _B2, _OMB1, _OMB2, _EPS, _STEP_SIZE, _INV_BC2, _L2, _PARAM_SCALE, _ZERO = range(len(CONSTANTS))
_M32 = 0xFFFFFFFF


def constant_values(step: int, hyper: dict) -> list[float]:
    """The step's constants (:data:`CONSTANTS`' order) as the kernel computes them, in double (each is rounded
    to float32 when it becomes a tensor)."""
    beta1, beta2, lr, wd = hyper["beta1"], hyper["beta2"], hyper["lr"], hyper["weight_decay"]
    correct = hyper.get("bias_correction", True)
    bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if correct else (1.0, 1.0)
    adamw = hyper["adamw_mode"]
    return [beta1, beta2, 1.0 - beta1, 1.0 - beta2, hyper["eps"], lr / bc1, 1.0 / math.sqrt(bc2),
            0.0 if adamw else wd, 1.0 - lr * wd if adamw else 1.0, 0.0]  # fmt: skip


def constants(step: int, hyper: dict, device: torch.device | None = None) -> torch.Tensor:
    """:func:`constant_values` as one float32 tensor."""
    return torch.tensor(constant_values(step, hyper), dtype=F32, device=device)


def uses_l2(hyper: dict) -> bool:
    """Whether the gradient gets ``weight_decay * master`` (Adam's L2 term; AdamW decays the master instead)."""
    return not hyper["adamw_mode"] and hyper["weight_decay"] != 0.0


def _keep(x: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 `x` unchanged, its bits OR-ed with `zero` (an int32 0 the compiler cannot see): a rounding
    torch.compile's GPU code would otherwise drop (a float64 -> float32 -> float64 round trip) or fuse away (a
    product contracted with the following sum into one multiply-add) happens where the operation says."""
    return (x.to(F32).view(torch.int32) | zero).view(F32)


def mul32(a: torch.Tensor, b: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """a * b rounded to float32, never contracted into a following addition."""
    return _keep(a * b, zero)


def div32(a: torch.Tensor, b: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """a / b correctly rounded to float32 (a GPU's fast float32 division is not): the float64 quotient rounded
    once more, which gives the correctly rounded float32 one."""
    return _keep(a.to(F64) / b.to(F64), zero)


def sqrt32(x: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root, as the kernel's (torch's own float32 sqrt on the CPU is not:
    about 1 in 6 results differ in the last bit), kept apart from its users."""
    return _keep(x.to(F64).sqrt(), zero)


def noise(index_base: torch.Tensor | int, numel: int, key: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """The kernel's rounding noise for `numel` elements from `index_base` under the step's `key`
    (:func:`twinflow.precision.compact.key`); tensors or ints alike."""
    index = (torch.arange(numel, dtype=torch.int64, device=device) + index_base) & _M32
    return compact.hash32(index, key)


def update(master: torch.Tensor, grad: torch.Tensor, codes: list[torch.Tensor], c: torch.Tensor,
           scale: torch.Tensor | None, l2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Adam's update of float32 `master` from 8-bit moments `codes` (:data:`CODE_KEYS`' order), the step's
    constants `c` and the gradient multiplier `scale` (None: 1): (new master, new exp_avg, new exp_avg_sq), all
    float32, before any rounding to 24 or 8 bits."""
    z = c[_ZERO].view(torch.int32)  # 0, from a tensor: opaque to a compiler
    m = compact.decode_exp_avg(codes[0], codes[1])
    v = compact.decode_exp_avg_sq(codes[2], codes[3])
    g = grad.to(F32)
    if scale is not None:  # a multiplication by 1 keeps every bit: None skips it
        g = mul32(g, scale.to(F32), z)
    if l2:
        g = g + mul32(c[_L2], master, z)
    m_new = mul32(c[_B1], m, z) + mul32(c[_OMB1], g, z)
    v_new = mul32(c[_B2], v, z) + mul32(c[_OMB2], mul32(g, g, z), z)
    denom = mul32(sqrt32(v_new, z), c[_INV_BC2], z) + c[_EPS]
    p_new = mul32(master, c[_PARAM_SCALE], z) - mul32(c[_STEP_SIZE], div32(m_new, denom, z), z)
    return p_new, m_new, v_new


def multiplier(scale: float | torch.Tensor) -> torch.Tensor | None:
    """The gradient multiplier :func:`update` takes: None for a plain 1 (a multiplication by 1 keeps every bit)."""
    return None if not isinstance(scale, torch.Tensor) and scale == 1.0 else torch.as_tensor(scale, dtype=F32)


def adam_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    codes: dict[str, torch.Tensor],
    step: int,
    index_base: int,
    hyper: dict,
    scale: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One step of float32 `master` (not written) with 8-bit moments `codes`: returns the new master (float32,
    before any rounding to 24 bits), the new codes, and the step's rounding noise (32 bits per element; its low
    8 round a 24-bit master). `index_base`: the first element's index (the noise's)."""
    c = constants(step, hyper, master.device)
    p_new, m_new, v_new = update(master, grad, [codes[k] for k in CODE_KEYS], c, multiplier(scale), uses_l2(hyper))
    bits = noise(index_base, master.numel(), compact.key(step), master.device)
    return p_new, dict(zip(CODE_KEYS, compact.encode(m_new, v_new, bits))), bits


def residual_step_(weight, residual, grad, codes, c, scale, meta, l2):  # noqa: ANN001, ANN201 (compiled)
    """One step, in place, of masters kept as (bf16 `weight`, int8 `residual`) with 8-bit moments `codes`
    (:data:`CODE_KEYS`' order): constants `c`, multiplier `scale` (or None), `meta` = (first element's index,
    the step's noise key) as a tensor, `l2` as :func:`uses_l2`. The new master is rounded to 24 bits with the
    kernel's noise, then split into the weight (the nearest) and the residual: the CPU kernel's bits."""
    master = weight_master.decode(weight, residual)
    p_new, m_new, v_new = update(master, grad, codes, c, scale, l2)
    bits = noise(meta[0], weight.numel(), meta[1], weight.device)
    encoded = compact.encode(m_new, v_new, bits)
    new_weight, new_residual = weight_master.split(*compact.encode_master(p_new, bits & 0xFF))
    weight.copy_(new_weight)
    residual.copy_(new_residual)
    for target, value in zip(codes, encoded):
        target.copy_(value)


def master_step_(master, weight_out, grad, codes, c, scale, meta, l2):  # noqa: ANN001, ANN201 (compiled)
    """:func:`residual_step_` for a float32 `master`, and its rounded copy into `weight_out` (None: the master is
    the weight)."""
    p_new, m_new, v_new = update(master, grad, codes, c, scale, l2)
    encoded = compact.encode(m_new, v_new, noise(meta[0], master.numel(), meta[1], master.device))
    master.copy_(p_new)
    if weight_out is not None:
        weight_out.copy_(p_new)  # the weight: the master rounded to its dtype (to the nearest, ties to even)
    for target, value in zip(codes, encoded):
        target.copy_(value)


@torch.no_grad()
def step_weight_master_(weight: torch.Tensor, residual: torch.Tensor, grad: torch.Tensor,
                        codes: dict[str, torch.Tensor], step: int, index_base: int, hyper: dict,
                        scale: float | torch.Tensor = 1.0) -> None:  # fmt: skip
    """:func:`residual_step_` from a step count, the element's index and the hyper-parameters."""
    meta = torch.tensor([index_base, compact.key(step)], device=weight.device)
    residual_step_(weight, residual, grad, [codes[k] for k in CODE_KEYS], constants(step, hyper, weight.device),
                   multiplier(scale), meta, uses_l2(hyper))  # fmt: skip
