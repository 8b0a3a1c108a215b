"""The compact device step's Triton kernel (twinflow.device.compact_triton) against the torch step it is written
from (twinflow.precision.compact_step, itself the CPU kernel's bits): run on the CPU by Triton's interpreter, every
output compared bit for bit. On a GPU, tests/test_device_compact.py compares the compiled kernel with the CPU's.

Triton's interpreter must be chosen before Triton is imported (its own library functions are made then), so the
cases run in a process of their own: this file, run as a script with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from twinflow.precision import compact, compact_step

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True, bias_correction=True)


def _codes(n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random moments: codes anywhere, block scales around a moment's usual fields, the lowest, and the wide range."""
    blocks = compact.blocks(n)
    m = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int16).to(torch.int8)
    v = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int16).to(torch.uint8)
    sm = torch.randint(100, 135, (blocks,), generator=gen).to(torch.uint8)
    sv = torch.randint(80, 130, (blocks,), generator=gen).to(torch.uint8)
    sm[0], sv[0] = 15, 31  # the lowest fields: codes below the lowest binade
    if blocks > 2:
        sm[1], sv[1] = 250, 200  # shifts past 127: the wide decode and encode
    return [m, sm, v, sv]


PAD = 4 * compact.BLOCK  # bytes past each written tensor's end, which no step may write


def _padded_clones(codes: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Copies of `codes`, each the head of a longer tensor whose tail is PAD random bytes: (the copies, (each
    tail, a copy of it))."""
    whole = [torch.cat([t, torch.randint(0, 100, (PAD // t.element_size(),), dtype=torch.int16).to(t.dtype)])
             for t in codes]  # fmt: skip
    tails = [w[t.numel() :] for w, t in zip(whole, codes)]
    return [w[: t.numel()] for w, t in zip(whole, codes)], [(t, t.clone()) for t in tails]


def _tails_kept(tails: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return all(torch.equal(tail, kept) for tail, kept in tails)


def _grads(n: int, gen: torch.Generator, dtype: torch.dtype, special: bool) -> torch.Tensor:
    grad = torch.randn(n, generator=gen) * torch.logspace(-6, 1, n)[torch.randperm(n, generator=gen)]
    grad[::7] = 0
    if special:
        grad[3], grad[100], grad[101] = float("inf"), float("nan"), -float("inf")
    return grad.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor, skip: torch.Tensor | None = None) -> bool:
    """Bit for bit; `skip` (per element): elements whose update is NaN, compared only in that they are NaN."""
    if skip is None or a.numel() != skip.numel():
        return a.view(torch.uint8).equal(b.view(torch.uint8))
    if a.is_floating_point() and not torch.equal(a[skip].isnan(), b[skip].isnan()):
        return False
    return a[~skip].view(torch.uint8).equal(b[~skip].view(torch.uint8))


def residual_case(kernel, n: int, grad_dtype: torch.dtype, adamw: bool, scaled: bool, special: bool,  # noqa: ANN001
                  nan_bits: bool = True) -> list[str]:  # fmt: skip
    """The names of the outputs where the kernel's residual form differs from the torch step's (none: the same).
    Without `nan_bits`, an element whose update is NaN counts as the same where both give a NaN weight: a GPU's
    NaN is 0x7FFFFFFF, an x86 CPU's 0xFFC00000 (sign set), and the sign then reaches the weight and the code."""
    gen = torch.Generator().manual_seed(n + 7 * adamw + 3 * scaled)
    grad, codes = _grads(n, gen, grad_dtype, special), _codes(n, gen)
    weight = (torch.randn(n, generator=gen) * torch.logspace(-30, 3, n)).bfloat16()
    weight[5], weight[6] = float("inf"), 3.3e38  # infinity, and a weight at bfloat16's top
    residual = torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int16).to(torch.int8)
    hyper = dict(HYPER, adamw_mode=adamw)
    c, l2 = compact_step.constants(3, hyper), compact_step.uses_l2(hyper)
    scale = torch.tensor(0.37) if scaled else None
    meta = torch.tensor([1 << 32 | 12345, compact.key(3)])  # an index past 32 bits: the hash takes its low 32
    outs = []
    for step in (compact_step.residual_step_, kernel.residual_step_):
        (w, r, *cs), tails = _padded_clones([weight, residual, *codes])
        step(w, r, grad.clone(), cs, c, scale, meta, l2)
        outs.append([w, r, *cs])
        assert _tails_kept(tails), "a step wrote past the end of a weight, residual, code or scale tensor"
    assert not _same(outs[0][0], weight)  # the step moved the weights: a kernel that writes nothing differs
    skip = None if nan_bits else outs[0][0].isnan() | grad.isnan()
    assert nan_bits or not skip.all()
    names = ("weight", "residual", *compact_step.CODE_KEYS)
    return [name for name, a, b in zip(names, *outs, strict=True) if not _same(a, b, skip)]


def master_case(kernel, out_dtype: torch.dtype | None, adamw: bool) -> list[str]:  # noqa: ANN001
    """The same for the float32 master form, with its copy in the weight's dtype (`out_dtype`)."""
    n = 3 * 256 + 200
    gen = torch.Generator().manual_seed(11 + adamw)
    grad, codes = _grads(n, gen, torch.float32, special=False), _codes(n, gen)
    master = torch.randn(n, generator=gen) * torch.logspace(-8, 2, n)
    hyper = dict(HYPER, adamw_mode=adamw)
    c, meta, l2 = compact_step.constants(7, hyper), torch.tensor([4096, compact.key(7)]), compact_step.uses_l2(hyper)
    outs = []
    for step in (compact_step.master_step_, kernel.master_step_):
        out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)  # poisoned
        (p, *cs), tails = _padded_clones([master, *codes])
        if out is not None:
            (out,), out_tail = _padded_clones([out])
            tails += out_tail
        step(p, out, grad.clone(), cs, c, torch.tensor(1.0), meta, l2)
        outs.append([p, *cs] + ([] if out is None else [out]))
        assert _tails_kept(tails), "a step wrote past the end of a master, weight, code or scale tensor"
    assert not outs[0][0].equal(master)
    names = ("master", *compact_step.CODE_KEYS, "weight")
    return [name for name, a, b in zip(names, *outs) if not _same(a, b)]


def cases() -> list[tuple[str, object]]:
    """(name, zero-argument check) for every case."""
    out = []
    for n, dtype, (adamw, scaled, special) in itertools.product(
        (256, 5 * 256 + 37),
        (torch.bfloat16, torch.float32),
        ((True, False, False), (False, True, False), (True, True, True)),
    ):
        name = f"residual n={n} grad={dtype} adamw={adamw} scaled={scaled} special={special}"
        out.append(
            (name, lambda k, nan_bits=True, a=(n, dtype, adamw, scaled, special): residual_case(k, *a, nan_bits))
        )
    for out_dtype, adamw in itertools.product((None, torch.bfloat16, torch.float16), (True, False)):
        out.append((f"master out={out_dtype} adamw={adamw}",
                    lambda k, nan_bits=True, a=(out_dtype, adamw): master_case(k, *a)))  # fmt: skip
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole storage `t` views, as a flat tensor of t's dtype (a padded clone's tail included)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


def _on_gpu(fn, args: tuple) -> None:  # noqa: ANN001
    """`fn` on GPU copies of `args` (tensors, lists of tensors), each tensor's whole storage moved (a padded
    clone's tail too), and copied back whole: a write past a tensor's end reaches the CPU tail."""
    wholes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        whole = _whole(t)
        wholes.append((whole, whole.cuda()))
        return wholes[-1][1].as_strided(t.shape, t.stride(), t.storage_offset())

    fn(*[[move(t) for t in a] if isinstance(a, list) else move(a) for a in args])
    for cpu, gpu in wholes:
        cpu.copy_(gpu)


class _GpuKernel:
    """The kernel's entry points taking CPU tensors, run on the GPU."""

    @staticmethod
    def residual_step_(*args: object) -> None:
        from twinflow.device import compact_triton

        _on_gpu(compact_triton.residual_step_, args)

    @staticmethod
    def master_step_(*args: object) -> None:
        from twinflow.device import compact_triton

        _on_gpu(compact_triton.master_step_, args)


ROWS = (1, 4)  # blocks a program steps: one, and several (the last program's blocks in part past the tensor's end)


def _at_rows(rows: int, run):  # noqa: ANN001, ANN202
    """`run()` with the kernel stepping `rows` blocks a program; its own setting restored."""
    from twinflow.device import compact_triton

    chosen, compact_triton.ROWS = compact_triton.ROWS, rows
    try:
        return run()
    finally:
        compact_triton.ROWS = chosen


@pytest.mark.cuda
@pytest.mark.parametrize("rows", ROWS)
def test_on_the_gpu_the_kernel_keeps_the_torch_steps_bits_in_every_case(rows: int) -> None:
    differ = _at_rows(rows, lambda: {name: d for name, check in cases() if (d := check(_GpuKernel, nan_bits=False))})
    assert not differ


def test_the_kernel_keeps_the_torch_steps_bits_in_every_case() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (a GPU build of torch brings it)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("same bits:") == len(cases()) * len(ROWS), done.stdout


if __name__ == "__main__":  # under TRITON_INTERPRET=1: every case, its verdict a line
    from twinflow.device import compact_triton

    assert compact_triton.interpreting() and not compact_triton.available(torch.device("cpu"))
    failed = []
    for rows, (name, check) in itertools.product(ROWS, cases()):
        differ = _at_rows(rows, lambda check=check: check(compact_triton))
        print(f"{'same bits:' if not differ else 'DIFFERENT ' + ', '.join(differ) + ':'} {name} rows={rows}")
        failed += [name] if differ else []
    sys.exit(1 if failed else 0)
