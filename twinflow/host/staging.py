"""The CPU share's pinned staging: chunks of host buffers that gradients land in and weights leave from.

The CPU-owned elements, in parameter order, are cut once into chunks of at
most ``chunk_bytes`` of gradient, each with its own pinned host buffer. A
gradient lands in its chunk's buffer; the kernel writes the rounded weights
back into the same buffer, in place (each element's gradient is read before
its weight is written), and the upload reads them from there. So the pinned
memory is the CPU share's gradient, and nothing waits for a staging buffer to
come free. A second set of buffers (the delayed update's next gradients,
speculation's weights) is made the first time a step needs it.

A :class:`Piece` is the one record of a slice: elements [start, end) of one
parameter, its place in a chunk and its place in the host state's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from twinflow.base.transfer import NoEvent, Streams, pinned_buffers, view

ALIGN = 64  # bytes: every piece in a chunk buffer starts on a cache line


class HasRange(Protocol):
    index: int
    start: int
    end: int


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of parameter `param`, stepped on the CPU: at byte `offset` of chunk `chunk`'s
    buffer, and at element `state_offset` of the host state's flat buffers. Number `id` of the CPU share's."""

    id: int
    param: int
    start: int
    end: int
    chunk: int
    offset: int
    state_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class Chunk:
    """One pinned buffer's pieces and its two events (the gradients are down; the weights are back up)."""

    buffer: torch.Tensor
    grad_ready: torch.cuda.Event | NoEvent
    uploaded: torch.cuda.Event | NoEvent
    spare: torch.Tensor | None = None  # the second buffer set's
    pieces: list[Piece] = field(default_factory=list)
    params: list[int] = field(default_factory=list)  # distinct, in order


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def check_chunk_bytes(chunk_bytes: object) -> None:
    if not isinstance(chunk_bytes, int) or chunk_bytes < 256:
        raise ValueError(f"chunk_bytes={chunk_bytes!r}; expected an int >= 256")


def plan_chunks(segments: list[HasRange], itemsizes: list[int], chunk_bytes: int,
                align: int = 1) -> list[list[tuple]]:  # fmt: skip
    """Packs the segments' elements, in order, into chunks of at most `chunk_bytes`.

    Returns per chunk a list of (segment position, a, b, byte offset): elements
    [a, b) of the segment at `byte offset` in the chunk. A segment is cut only
    at multiples of `align` elements from its start (a chunk too small for
    `align` of them takes that many anyway). Pure; deterministic.
    """
    chunks: list[list[tuple]] = []
    current: list[tuple] = []
    used = 0
    for pos, seg in enumerate(segments):
        size = itemsizes[seg.index]
        a, n = 0, seg.end - seg.start
        while a < n:
            room = (chunk_bytes - used) // size
            if room < n - a:
                room = room // align * align if current or room >= align else align
            if room <= 0:
                chunks.append(current)
                current, used = [], 0
                continue
            b = min(n, a + room)
            current.append((pos, a, b, used))
            used += aligned((b - a) * size)
            a = b
    if current:
        chunks.append(current)
    return chunks


def plan_pieces(segments: list[HasRange], itemsizes: list[int], chunk_bytes: int, align: int = 1) -> list[Piece]:
    """Every piece of the CPU segments (in order; their host state laid out one segment after the other), cut
    at multiples of `align` elements from each segment's start (:func:`plan_chunks`)."""
    bases, base = [], 0
    for seg in segments:
        bases.append(base)
        base += seg.end - seg.start
    pieces = []
    for k, plan in enumerate(plan_chunks(segments, itemsizes, chunk_bytes, align)):
        for pos, a, b, offset in plan:
            seg = segments[pos]
            pieces.append(Piece(len(pieces), seg.index, seg.start + a, seg.start + b, k, offset, bases[pos] + a))
    return pieces


def by_param(pieces: list[Piece]) -> dict[int, list[Piece]]:
    """The pieces of each parameter, in order."""
    grouped: dict[int, list[Piece]] = {}
    for pc in pieces:
        grouped.setdefault(pc.param, []).append(pc)
    return grouped


class Staging:
    """Owns the pinned buffers: per piece its host view (the gradient in, the weight out) in each buffer set,
    and the parameter elements it uploads to. Copies run on the download and upload streams."""

    def __init__(self, weights: list[torch.Tensor], pieces: list[Piece], streams: Streams) -> None:
        self.streams = streams
        itemsizes = [w.element_size() for w in weights]
        count = max((pc.chunk for pc in pieces), default=-1) + 1
        self.sizes = [ALIGN] * count
        for pc in pieces:
            self.sizes[pc.chunk] = max(self.sizes[pc.chunk], pc.offset + aligned(pc.numel * itemsizes[pc.param]))
        buffers = pinned_buffers(self.sizes, streams.cuda, "the CPU share's gradients")
        self.pinned_bytes = sum(self.sizes) if streams.cuda else 0
        self.chunks = [Chunk(buf, streams.event(), streams.event()) for buf in buffers]
        self.pieces = pieces
        self.hosts = [view(self.chunks[pc.chunk].buffer, pc.offset, pc.numel, weights[pc.param].dtype) for pc in pieces]
        self.spares: list[torch.Tensor] | None = None
        self.targets = [weights[pc.param].view(-1)[pc.start : pc.end] for pc in pieces]
        for pc in pieces:
            chunk = self.chunks[pc.chunk]
            chunk.pieces.append(pc)
            if pc.param not in chunk.params:
                chunk.params.append(pc.param)
        self.pieces_of = by_param(pieces)
        self.chunks_of = {i: sorted({pc.chunk for pc in pcs}) for i, pcs in self.pieces_of.items()}

    def make_spare(self) -> None:
        """The second buffer set, made the first time a delayed or speculative step needs it."""
        if self.spares is not None or not self.chunks:
            return
        spares = pinned_buffers(self.sizes, self.streams.cuda, "the second set of gradient buffers")
        self.pinned_bytes *= 2
        for chunk, buf in zip(self.chunks, spares):
            chunk.spare = buf
        self.spares = [view(self.chunks[pc.chunk].spare, pc.offset, pc.numel, h.dtype)
                       for pc, h in zip(self.pieces, self.hosts)]  # fmt: skip

    def swap_sets(self) -> None:
        """The next gradients land in the other buffer set (the delayed update's job still uses this one)."""
        for chunk in self.chunks:
            chunk.buffer, chunk.spare = chunk.spare, chunk.buffer
        self.hosts, self.spares = self.spares, self.hosts

    def download(self, i: int, grad: torch.Tensor) -> None:
        """Queues the copy of parameter i's CPU share of `grad` into its pieces' host views."""
        flat = grad.reshape(-1)
        pieces = self.pieces_of[i]
        self.streams.after_compute()
        with self.streams.d2h():
            torch._foreach_copy_([self.hosts[pc.id] for pc in pieces], [flat[pc.start : pc.end] for pc in pieces],
                                 non_blocking=True)  # fmt: skip
        if self.streams.cuda:
            # The copy may run after step() returns and the caller frees the gradient (zero_grad, or the
            # release under attach()): the allocator must not hand its memory out before the copy has read it.
            flat.record_stream(self.streams.d2h_stream)

    def upload(self, k: int, pieces: list[Piece], sources: list[torch.Tensor]) -> None:
        """Queues the copy of `sources` (the pieces' new weights) into the parameters; records chunk k's event."""
        with self.streams.h2d():
            torch._foreach_copy_([self.targets[pc.id] for pc in pieces], sources, non_blocking=True)
            self.chunks[k].uploaded.record(self.streams.h2d_stream)
