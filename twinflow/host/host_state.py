"""The CPU share's optimizer state: masters and moments in their precision, the only owner of those tensors.

The precision is a codec, chosen once when the state is made:

- ``fp32``: float32 masters and moments, three flat buffers.
- ``int8`` / ``int8_m24``: 8-bit moments with a scale per block (twinflow.precision.compact), one set per piece (the
  blocks start at each piece's first element); float32 or 24-bit masters.

Everyone else sees float32: the kernel's arguments come from :meth:`HostState.step`, and ``opt.state``,
``state_dict`` and checkpoints read and write through :meth:`read`, :meth:`write` and :meth:`view`.

Speculation's second set (fp32 only) is a scratch twin of each buffer. A speculative step writes a piece's
new state into the set it is not current in and leaves the current one untouched; :meth:`flip` makes the
written set current. Readers see the first set: :meth:`settle` copies pieces back first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from twinflow.base import node
from twinflow.host import ops
from twinflow.host.staging import Piece, by_param
from twinflow.precision import compact
from twinflow.precision import state_precision as precisions
from twinflow.precision.state_owner import FP32, M24, RawPart
from twinflow.precision.state_precision import StatePrecision

MOMENTS = ("exp_avg", "exp_avg_sq")
KEYS = ("master",) + MOMENTS  # a piece's state, in the kernel's order


class Fp32Codec:
    """float32 masters and moments: one flat buffer each, a view per piece; an optional scratch twin."""

    def __init__(self, total: int, pieces: list[Piece], alloc: Callable[..., torch.Tensor] = torch.empty) -> None:
        # the masters to be written (made by `alloc`: see HostState); the moments fresh (zero), as the 8-bit codec's
        f32 = torch.float32  # named: torch's default dtype may be another
        self.buffers = [alloc(total, dtype=f32), torch.zeros(total, dtype=f32), torch.zeros(total, dtype=f32)]
        self.pieces = pieces
        self.sets = [self.slices(self.buffers)]

    def slices(self, buffers: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        return [[b[pc.state_offset : pc.state_offset + pc.numel] for b in buffers] for pc in self.pieces]

    @property
    def state_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def make_scratch(self) -> None:
        if len(self.sets) == 1:
            # zeros, not empty: every page is touched here, once, not by the first speculative kernel to write it
            # (faulting pages in from 16 threads ran it 3-4x slower on an H200 host)
            self.sets.append(self.slices([torch.zeros_like(b) for b in self.buffers]))

    def field(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the first set's `key` buffer (a view)."""
        return self.buffers[KEYS.index(key)][lo:hi]

    def read(self, pieces: list[Piece], key: str, out: torch.Tensor, lo: int, hi: int) -> None:
        for pc in pieces:
            a, b = max(pc.start, lo), min(pc.end, hi)
            if a < b:
                out[a - lo : b - lo].copy_(self.sets[0][pc.id][KEYS.index(key)][a - pc.start : b - pc.start])

    def write(self, pieces: list[Piece], values: dict[str, torch.Tensor | None], lo: int) -> None:
        for key, value in values.items():
            for pc in pieces:
                target = self.sets[0][pc.id][KEYS.index(key)]
                target.copy_(value[pc.start - lo : pc.end - lo]) if value is not None else target.zero_()

    def step(self, pieces: list[Piece], grads: list[torch.Tensor], outs: list[torch.Tensor], steps: list[int],
             current: list[int], apart: bool, hyper: dict) -> None:  # fmt: skip
        now = [self.sets[c][pc.id] for pc, c in zip(pieces, current)]
        written = [self.sets[1 - c][pc.id] for pc, c in zip(pieces, current)] if apart else now
        ops.adam_step_(
            [w[0] for w in written], grads, [w[1] for w in written], [w[2] for w in written], steps,
            out_copies=outs,  # in place (each gradient element is read before its weight is written), or apart
            sources=tuple([c[k] for c in now] for k in range(3)) if apart else None, **hyper,
        )  # fmt: skip

    def copy_back(self, pc: Piece) -> None:
        torch._foreach_copy_(self.sets[0][pc.id], self.sets[1][pc.id])


class Int8Codec:
    """8-bit moments, per piece (codes and block scales); float32 masters, or 24-bit ones (`master24`). The codes'
    conversions to and from float32 (a load, a ``state_dict``, a new ratio) run a batch at a time on the device
    `convert_on()` names when they start: a GPU where the weights are one (on an H200 machine 82 against 44 million
    elements a second for a load's encoding with the host's 16 threads, benchmarks/host_codes_convert.py; more
    where torchrun leaves a rank fewer), the host otherwise."""

    def __init__(self, total: int, pieces: list[Piece], master24: bool, convert_on: Callable[[], torch.device],
                 alloc: Callable[..., torch.Tensor] = torch.empty) -> None:  # fmt: skip
        # the masters to be written, made by `alloc` (see HostState)
        self.master = compact.Master24.empty(total, alloc) if master24 else alloc(total, dtype=torch.float32)
        self.masters = [self.master[pc.state_offset : pc.state_offset + pc.numel] for pc in pieces]
        self.q8 = [compact.fresh(pc.numel) for pc in pieces]
        self.convert_on = convert_on

    @property
    def state_bytes(self) -> int:
        return self.master.nbytes + sum(t.nbytes for q in self.q8 for t in q)

    def field(self, key: str, lo: int, hi: int) -> torch.Tensor | None:
        return self.master[lo:hi] if key == "master" and isinstance(self.master, torch.Tensor) else None

    def read(self, pieces: list[Piece], key: str, out: torch.Tensor, lo: int, hi: int) -> None:
        """Decodes elements [lo, hi) into `out` a batch at a time (its scratch bounded by compact.COPY_ELEMENTS,
        whatever the piece)."""
        decode = compact.decode_exp_avg if key == "exp_avg" else compact.decode_exp_avg_sq
        k, device = (0 if key == "exp_avg" else 2), self.convert_on()
        for pc in pieces:
            for a, b in compact.spans(pc.numel):  # each a at a block's start: the scales slice cleanly
                x, y = max(pc.start + a, lo), min(pc.start + b, hi)  # the part of this batch asked for
                if x >= y:
                    continue
                if key == "master":
                    m = self.masters[pc.id][x - pc.start : y - pc.start]
                    part = m.float() if isinstance(m, compact.Master24) else m
                else:
                    q = self.q8[pc.id]
                    codes, scales = q[k][a:b], q[k + 1][a // compact.BLOCK : compact.blocks(b)]
                    part = decode(codes.to(device), scales.to(device))[x - pc.start - a : y - pc.start - a]
                out[x - lo : y - lo].copy_(part)

    def read_all(self, pieces: list[Piece], key: str) -> torch.Tensor:
        out = torch.empty(sum(pc.numel for pc in pieces), dtype=torch.float32)
        self.read(pieces, key, out, pieces[0].start, pieces[-1].end)
        return out

    def write(self, pieces: list[Piece], values: dict[str, torch.Tensor | None], lo: int) -> None:
        if "master" in values:
            for pc in pieces:
                self.masters[pc.id].copy_(values["master"][pc.start - lo : pc.end - lo])
        if not any(key in values for key in MOMENTS):
            return
        both = [values[k] if k in values else self.read_all(pieces, k) for k in MOMENTS]  # encoded together
        device = self.convert_on()
        for pc in pieces:
            q = self.q8[pc.id]
            if both[0] is None:
                for t in q:
                    t.zero_()
                continue
            at = pc.start - lo
            for a, b in compact.spans(pc.numel):  # a batch at a time: encoding's int64 scratch stays bounded
                moments = [x[at + a : at + b].to(device, torch.float32) for x in both]
                encoded = compact.encode(*moments)
                blocks = slice(a // compact.BLOCK, compact.blocks(b))
                torch._foreach_copy_([q[0][a:b], q[1][blocks], q[2][a:b], q[3][blocks]], list(encoded))

    def step(self, pieces: list[Piece], grads: list[torch.Tensor], outs: list[torch.Tensor], steps: list[int],
             current: list[int], apart: bool, hyper: dict) -> None:  # fmt: skip
        masters, m24 = compact.kernel_masters([self.masters[pc.id] for pc in pieces])
        ops.adam_step_q8_(masters, grads, *zip(*(self.q8[pc.id] for pc in pieces)), steps, out_copies=outs,
                          index_bases=[pc.start for pc in pieces], **m24, **hyper)  # fmt: skip


def conversion_threads() -> contextlib.AbstractContextManager[None]:
    """torch's threads raised to the CPU kernel's share for a conversion of the whole state (a load, a save, a new
    ratio), then put back: torchrun leaves each rank one thread, and a load's encoding of 1.3B parameters'
    moments ran 8M elements a second in it (a first step of 28 s after a portable load on an H200)."""
    return node.torch_threads(ops.default_num_threads())


class HostState:
    """Masters and moments of the CPU share's pieces, in the codec of `precision`; which set is current. A
    :class:`twinflow.precision.state_owner.StateOwner`. Made with fresh (zero) moments and unset masters: write
    every parameter's masters before a step."""

    def __init__(self, pieces: list[Piece], precision: StatePrecision | str,
                 convert_on: torch.device | None = None) -> None:  # fmt: skip
        total = sum(pc.numel for pc in pieces)
        self.pieces = pieces
        self.precision = precision = precisions.of(precision)
        self.convert_on(convert_on)
        # masters first written from a GPU's weights are zeroed now, in the builder's threads, so that the copy from
        # the GPU finds its pages touched (1.1-1.3 GB/s into new host memory, 12 into memory touched before)
        alloc = torch.zeros if self.conversion_device.type == "cuda" else torch.empty
        self.codec = (
            Int8Codec(total, pieces, precision.masters24, lambda: self.conversion_device, alloc)
            if precision.coded_moments
            else Fp32Codec(total, pieces, alloc)
        )
        self.current = [0] * len(pieces)  # per piece: the set its state is in (1: speculation's scratch)
        self.pieces_of = by_param(pieces)
        self.span = {i: (pcs[0].start, pcs[-1].end, pcs[0].state_offset) for i, pcs in self.pieces_of.items()}

    def convert_on(self, device: torch.device | None) -> None:
        """Where the codes' conversions run from now on: `device` if it is a GPU, else the host (``offload_states()``
        gives the GPU's memory away: its conversions come back to the host until ``reload_states()``)."""
        self.conversion_device = device if device is not None and device.type == "cuda" else torch.device("cpu")

    @property
    def state_bytes(self) -> int:
        """Host memory of the masters and moments (not speculation's scratch set)."""
        return self.codec.state_bytes

    def holds(self, i: int) -> bool:
        return i in self.span

    def range(self, i: int) -> tuple[int, int]:
        """The elements [start, end) of parameter i that step on the CPU."""
        start, end, _ = self.span[i]
        return start, end

    def view(self, i: int, key: str) -> torch.Tensor | None:
        """A live float32 view of parameter i's CPU elements of `key`, where the codec keeps one, else None."""
        start, end, base = self.span[i]
        return self.codec.field(key, base, base + end - start)

    @torch.no_grad()
    def read(
        self, i: int, key: str, out: torch.Tensor | None = None, lo: int = 0, hi: int | None = None
    ) -> torch.Tensor:
        """A float32 copy of parameter i's CPU elements of `key` (the first set: call :meth:`settle` first), or of
        its elements [lo, hi) of them, into `out` if given (flat, host memory), decoded a batch at a time."""
        start, end, _ = self.span[i]
        hi = end - start if hi is None else hi
        out = torch.empty(hi - lo, dtype=torch.float32) if out is None else out
        with conversion_threads():
            self.codec.read(self.pieces_of[i], key, out, start + lo, start + hi)
        return out

    @torch.no_grad()
    def write(self, i: int, values: dict[str, torch.Tensor | None]) -> None:
        """Sets `values` (flat over parameter i's CPU elements; a moment None: fresh) in the precision kept."""
        with conversion_threads():
            self.codec.write(self.pieces_of[i], values, self.span[i][0])

    def raw(self, i: int) -> list[RawPart]:
        """Parameter i's CPU state as a compact codec keeps it, a part per piece: live views of the moments' codes
        and block scales (counted from the piece's first element) and of its masters (float32, or 24-bit as hi
        and lo), for a checkpoint to copy out or in unchanged; the weights are not this owner's (None)."""
        if not self.precision.coded_moments:
            raise ValueError(f"the CPU share's state is {self.precision.name}: it keeps no codes; read() it instead")
        parts = []
        for pc in self.pieces_of[i]:
            master = self.codec.masters[pc.id]
            m24 = isinstance(master, compact.Master24)
            tensors = (master.hi, master.lo) if m24 else (master,)
            parts.append(RawPart(pc.start, pc.end, self.codec.q8[pc.id], M24 if m24 else FP32, tensors))
        return parts

    def set_step(self, i: int, steps: int) -> None:
        """Nothing: the CPU share's step counts come with each step's arguments."""

    def make_scratch(self) -> None:
        """Speculation's second set (12 bytes per element), made the first time a step speculates."""
        self.codec.make_scratch()

    def step(self, pieces: list[Piece], grads: list[torch.Tensor], outs: list[torch.Tensor],
             steps: Sequence[int], apart: bool, hyper: dict) -> None:  # fmt: skip
        """The kernel over `pieces` (one param group's): gradients in `grads`, rounded weights into `outs`; the
        state in place, or (`apart`) from each piece's current set into the other, the current left as it was."""
        self.codec.step(pieces, grads, outs, list(steps), [self.current[pc.id] for pc in pieces], apart, hyper)

    def flip(self, pieces: list[Piece]) -> None:
        """The set an out-of-place step wrote becomes the pieces' current one."""
        for pc in pieces:
            self.current[pc.id] ^= 1

    def settle(self, params: set[int] | None = None) -> None:
        """The current state of pieces (of `params`, else all) is in the first set again (call while no kernel
        steps them)."""
        for pc in self.pieces:
            if self.current[pc.id] and (params is None or pc.param in params):
                self.codec.copy_back(pc)
                self.current[pc.id] = 0
