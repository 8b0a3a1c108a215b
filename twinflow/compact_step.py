"""Adam over compact state (8-bit moments, 24-bit masters) written once as float32 torch operations.

The CPU kernel's update (csrc/adam_q8.h), one operation at a time and in its order, with its constants
(csrc/cpu_adam.cpp make_consts: computed in double, each rounded to float32) and its rounding noise: on the
CPU it gives the kernel's bits exactly (tests/test_compact_kernel.py checks this on every SIMD path). It is the
device side's step for compact state, where the master is kept as the weight plus a residual byte
(:mod:`twinflow.weight_master`): :func:`step_weight_master_`.
"""

from __future__ import annotations

import math

import torch

from twinflow import compact, weight_master

F32 = torch.float32
CODE_KEYS = ("m_codes", "m_scales", "v_codes", "v_scales")


def constants(step: int, hyper: dict, scale: float | torch.Tensor,
              device: torch.device | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The step's constants as the kernel computes them (in double, each rounded to float32); a tensor `scale`
    (the device side's clipping coefficient, never read on the host) is taken as it is, in float32."""
    beta1, beta2, lr, wd = hyper["beta1"], hyper["beta2"], hyper["lr"], hyper["weight_decay"]
    correct = hyper.get("bias_correction", True)
    bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if correct else (1.0, 1.0)
    adamw = hyper["adamw_mode"]
    values = dict(b1=beta1, b2=beta2, omb1=1.0 - beta1, omb2=1.0 - beta2, eps=hyper["eps"], step_size=lr / bc1,
                  inv_bc2_sqrt=1.0 / math.sqrt(bc2), l2=0.0 if adamw else wd,
                  param_scale=1.0 - lr * wd if adamw else 1.0)  # fmt: skip
    c = {k: torch.tensor(v, dtype=F32, device=device) for k, v in values.items()}
    c["scale"] = scale.to(device, F32) if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=F32,
                                                                                            device=device)  # fmt: skip
    return c


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
    c = constants(step, hyper, scale, master.device)
    m = compact.decode_exp_avg(codes["m_codes"], codes["m_scales"])
    v = compact.decode_exp_avg_sq(codes["v_codes"], codes["v_scales"])
    g = grad.to(F32)
    if isinstance(scale, torch.Tensor) or scale != 1.0:  # a multiplication by 1 keeps every bit: skipped
        g = g * c["scale"]
    if not hyper["adamw_mode"] and hyper["weight_decay"] != 0.0:
        g = g + c["l2"] * master
    m_new = c["b1"] * m + c["omb1"] * g
    v_new = c["b2"] * v + c["omb2"] * (g * g)
    denom = compact.sqrt32(v_new) * c["inv_bc2_sqrt"] + c["eps"]
    p_new = master * c["param_scale"]
    p_new = p_new - c["step_size"] * (m_new / denom)
    noise = compact.kernel_noise(index_base, master.numel(), step, master.device)
    return p_new, dict(zip(CODE_KEYS, compact.encode(m_new, v_new, noise))), noise


@torch.no_grad()
def step_weight_master_(weight: torch.Tensor, residual: torch.Tensor, grad: torch.Tensor,
                        codes: dict[str, torch.Tensor], step: int, index_base: int, hyper: dict,
                        scale: float | torch.Tensor = 1.0) -> None:  # fmt: skip
    """One step, in place, of masters kept as (bf16 `weight`, int8 `residual`) with 8-bit moments `codes`: the
    new master is rounded to 24 bits with the kernel's noise, then split into the weight (the nearest) and the
    residual. The same bits as the CPU kernel on the same masters in its (hi, lo) form."""
    master = weight_master.decode(weight, residual)
    p_new, encoded, noise = adam_step(master, grad, codes, step, index_base, hyper, scale)
    hi, lo = compact.encode_master(p_new, noise & 0xFF)
    new_weight, new_residual = weight_master.split(hi, lo)
    weight.copy_(new_weight)
    residual.copy_(new_residual)
    for key in CODE_KEYS:
        codes[key].copy_(encoded[key])
