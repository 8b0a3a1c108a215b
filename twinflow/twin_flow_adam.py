"""TwinFlowAdam: a fraction of the parameters steps on the CPU, the rest on the GPU, at once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from twinflow import ops
from twinflow.cpu_adam import ParamsT, adam_defaults, check_hyperparams
from twinflow.partition import Segment, check_placement, check_ratio, split
from twinflow.transfer import Staging

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN = 64  # bytes: every piece in a staging buffer starts on a cache line


@dataclass
class _SegmentState:
    """The optimizer state of one segment; its only owner."""

    seg: Segment
    master: torch.Tensor  # fp32; for a float32 parameter on the device side, the parameter slice itself
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    device_step: torch.Tensor | None = None  # device side: the fused kernel's step counter


@dataclass
class _Piece:
    """Elements [a, b) of a CPU segment, staged at `offset` bytes in one chunk."""

    state: _SegmentState
    a: int
    b: int
    grad_offset: int
    param_offset: int


@dataclass
class _KernelCall:
    """One kernel call: the pieces of one chunk that belong to one param group."""

    group: int
    pieces: list[int]  # positions in the chunk
    param_indices: list[int]
    masters: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]


@dataclass
class _Chunk:
    """One chunk's pieces and the views that move and step them, built once and reused every step."""

    pieces: list[_Piece]
    grad_bounds: list[tuple[int, int, int]] = field(default_factory=list)  # (param index, start, end)
    param_dst: list[torch.Tensor] = field(default_factory=list)
    grad_stage: tuple[list[torch.Tensor], list[torch.Tensor]] = field(default_factory=lambda: ([], []))
    param_stage: tuple[list[torch.Tensor], list[torch.Tensor]] = field(default_factory=lambda: ([], []))
    calls: list[_KernelCall] = field(default_factory=list)


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class TwinFlowAdam(torch.optim.Optimizer):
    """Adam/AdamW with `ratio` of the parameter elements stepped on the CPU, the rest on the GPU.

    A drop-in for ``torch.optim.AdamW``. The split is exact to the element, in
    parameter order: ``placement="first"`` gives the CPU the first ``ratio`` of
    the elements, ``"last"`` the last (a tensor at the boundary is cut in two).
    The CPU side keeps fp32 masters, ``exp_avg`` and ``exp_avg_sq`` in host
    memory and updates them with twinflow's kernel; the device side runs torch's
    fused Adam over fp32 masters. bf16/fp16 parameters keep fp32 masters on
    both sides and receive the rounded result. Gradients cross to the host in
    their own dtype, and weights return in the model's dtype, through two
    pinned buffers per direction of ``chunk_bytes`` each; while the kernel
    updates chunk k, chunk k+1 downloads and chunk k-1 uploads. The device step
    is launched first and runs while the CPU works.

    ``state_dict()`` uses torch.optim's layout keyed by parameter index (with
    a ``master`` entry for low-precision parameters), so it loads under another
    ratio or placement and into ``torch.optim.AdamW``, and back.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        ratio: float = 0.4,
        placement: str = "first",
        *,
        chunk_bytes: int = 32 << 20,
        num_threads: int | None = None,
    ) -> None:
        defaults = adam_defaults(lr, betas, eps, weight_decay, adamw_mode, bias_correction, num_threads)
        self.ratio = check_ratio(ratio)
        self.placement = check_placement(placement)
        if not isinstance(chunk_bytes, int) or chunk_bytes < 4 * _ALIGN:
            raise ValueError(f"chunk_bytes={chunk_bytes!r}; expected an int >= {4 * _ALIGN}")
        super().__init__(params, defaults)
        self.chunk_bytes = chunk_bytes
        self.num_threads = num_threads
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._group_of = [gi for gi, group in enumerate(self.param_groups) for _ in group["params"]]
        self._check_params()
        self.device = self._params[0].device if self._params else torch.device("cpu")
        self._steps = [0] * len(self._params)
        self._build_state()

    # ----------------------------------------------------------------- set-up
    def _check_params(self) -> None:
        devices = sorted({str(p.device) for p in self._params})
        if len(devices) > 1:
            raise ValueError(
                f"TwinFlowAdam got parameters on several devices {devices}; it steps the parameters of one "
                "device: build one optimizer per device (or per rank with DDP/FSDP)"
            )
        for i, p in enumerate(self._params):
            if p.dtype not in _DTYPES:
                raise TypeError(f"parameter {i} has dtype {p.dtype}; expected float32, bfloat16 or float16")
            if not p.is_contiguous():
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not contiguous")

    def _build_state(self) -> None:
        segments = split([p.numel() for p in self._params], self.ratio, self.placement)
        self._segments_of: list[list[_SegmentState]] = [[] for _ in self._params]
        self._cpu: list[_SegmentState] = []
        self._dev: list[_SegmentState] = []
        with torch.no_grad():
            for seg in segments:
                p = self._params[seg.index]
                flat = p.detach().view(-1)[seg.start : seg.end]
                if seg.on_cpu:
                    master = torch.empty(seg.numel, dtype=torch.float32)
                    master.copy_(flat)
                    st = _SegmentState(seg, master, torch.zeros_like(master), torch.zeros_like(master))
                    self._cpu.append(st)
                else:
                    master = flat if p.dtype == torch.float32 else flat.float()
                    step = torch.zeros((), dtype=torch.float32, device=p.device)
                    st = _SegmentState(seg, master, torch.zeros_like(master), torch.zeros_like(master), step)
                    self._dev.append(st)
                self._segments_of[seg.index].append(st)
        self._staging = Staging(self.device, self.chunk_bytes) if self._cpu else None
        self._plan_cache: tuple[tuple, list[_Chunk]] | None = None
        self.split_summary = self._summarise()
        log.info("TwinFlowAdam split: %s", self.split_summary)

    def _summarise(self) -> dict[str, Any]:
        def side(states: list[_SegmentState]) -> dict[str, int]:
            tensors = {st.seg.index for st in states}
            elements = sum(st.seg.numel for st in states)
            state_bytes = sum(st.seg.numel * 12 for st in states)  # fp32 master, exp_avg, exp_avg_sq
            return {"tensors": len(tensors), "elements": elements, "state_bytes": state_bytes}

        cpu, dev = side(self._cpu), side(self._dev)
        total = cpu["elements"] + dev["elements"]
        return {
            "ratio_requested": self.ratio,
            "ratio_achieved": cpu["elements"] / total if total else 0.0,
            "placement": self.placement,
            "cpu": cpu,
            "device": dev | {"device": str(self.device)},
            "pinned_bytes": self._staging.pinned_bytes if self._staging else 0,
        }

    # ------------------------------------------------------------------- step
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips all gradients (both sides) by one global norm; no host synchronisation.

        Returns the total norm, as ``torch.nn.utils.clip_grad_norm_`` does.
        """
        return torch.nn.utils.clip_grad_norm_(self._params, max_norm, norm_type, foreach=True)

    def _overflow(self, with_grad: list[int]) -> bool:
        """For fp16 models: any inf/NaN gradient on either side (one host synchronisation)."""
        if not any(self._params[i].dtype == torch.float16 for i in with_grad):
            return False
        grads = [self._params[i].grad for i in with_grad]
        found = torch.stack([torch.logical_not(torch.isfinite(n)) for n in torch._foreach_norm(grads)]).any()
        return bool(found.item())

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step on both sides; returns when both are done (device work in stream order)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            check_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        with_grad = [i for i, p in enumerate(self._params) if p.grad is not None]
        for i in with_grad:
            if self._params[i].grad.is_sparse:
                raise TypeError(f"parameter {i} has a sparse gradient; TwinFlowAdam needs dense gradients")
        if self._overflow(with_grad):
            log.warning("inf/NaN gradient in an fp16 model: step skipped on both sides")
            self.skipped_steps = getattr(self, "skipped_steps", 0) + 1
            return loss
        has_grad = set(with_grad)
        cpu_states = [st for st in self._cpu if st.seg.index in has_grad]
        if cpu_states:
            # Before the device step is queued: downloads wait for backward, not for the GPU's Adam.
            self._staging.start_step()
        self._step_device([st for st in self._dev if st.seg.index in has_grad])
        self._step_cpu(cpu_states)
        for i in with_grad:
            self._steps[i] += 1
        return loss

    def _step_device(self, states: list[_SegmentState]) -> None:
        """Launches torch's fused Adam over the device-side masters, one launch per param group."""
        by_group: dict[int, list[_SegmentState]] = {}
        for st in states:
            by_group.setdefault(self._group_of[st.seg.index], []).append(st)
        for gi, group_states in by_group.items():
            group = self.param_groups[gi]
            grads = []
            for st in group_states:
                g = self._params[st.seg.index].grad.reshape(-1)[st.seg.start : st.seg.end]
                grads.append(g if g.dtype == torch.float32 else g.float())
            masters = [st.master for st in group_states]
            exp_avgs = [st.exp_avg for st in group_states]
            exp_avg_sqs = [st.exp_avg_sq for st in group_states]
            steps = [st.device_step for st in group_states]
            beta1, beta2 = group["betas"]
            torch._foreach_add_(steps, 1)  # the fused kernels read the step after this update
            if group["bias_correction"]:
                fused = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
                fused(
                    masters, grads, exp_avgs, exp_avg_sqs, [], steps,
                    lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                    eps=group["eps"], amsgrad=False, maximize=False,
                )  # fmt: skip
            else:
                _foreach_adam_no_bias_correction(masters, grads, exp_avgs, exp_avg_sqs, group)
            low = [(st, m) for st, m in zip(group_states, masters) if self._params[st.seg.index].dtype != m.dtype]
            if low:
                dst = [self._params[st.seg.index].detach().view(-1)[st.seg.start : st.seg.end] for st, _ in low]
                torch._foreach_copy_(dst, [m for _, m in low])

    def _plan_chunks(self, states: list[_SegmentState]) -> list[list[_Piece]]:
        """Packs the CPU segments' elements, in order, into chunks that fit the staging buffers."""
        chunks: list[list[_Piece]] = []
        current: list[_Piece] = []
        grad_used = param_used = 0
        for st in states:
            p = self._params[st.seg.index]
            gsize, psize = p.grad.element_size(), p.element_size()
            a = 0
            while a < st.seg.numel:
                room = min((self.chunk_bytes - grad_used) // gsize, (self.chunk_bytes - param_used) // psize)
                if room <= 0:
                    chunks.append(current)
                    current, grad_used, param_used = [], 0, 0
                    continue
                b = min(st.seg.numel, a + room)
                current.append(_Piece(st, a, b, grad_used, param_used))
                grad_used += _aligned((b - a) * gsize)
                param_used += _aligned((b - a) * psize)
                a = b
        if current:
            chunks.append(current)
        return chunks

    def _chunk_plan(self, states: list[_SegmentState]) -> list[_Chunk]:
        """The chunks and every view they need; rebuilt only when the set of gradients or dtypes changes."""
        key = tuple((st.seg.index, st.seg.start, self._params[st.seg.index].grad.dtype) for st in states)
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        staging = self._staging
        plan = []
        for pieces in self._plan_chunks(states):
            chunk = _Chunk(pieces=pieces)
            for pc in pieces:
                seg, p = pc.state.seg, self._params[pc.state.seg.index]
                n, gdtype = pc.b - pc.a, p.grad.dtype
                chunk.grad_bounds.append((seg.index, seg.start + pc.a, seg.start + pc.b))
                chunk.param_dst.append(p.detach().view(-1)[seg.start + pc.a : seg.start + pc.b])
                for buf in range(2):
                    chunk.grad_stage[buf].append(Staging.view(staging.grad_bufs[buf], pc.grad_offset, n, gdtype))
                    chunk.param_stage[buf].append(Staging.view(staging.param_bufs[buf], pc.param_offset, n, p.dtype))
            by_group: dict[int, list[int]] = {}
            for j, pc in enumerate(pieces):
                by_group.setdefault(self._group_of[pc.state.seg.index], []).append(j)
            for gi, idx in by_group.items():
                chunk.calls.append(
                    _KernelCall(
                        group=gi,
                        pieces=idx,
                        param_indices=[pieces[j].state.seg.index for j in idx],
                        masters=[pieces[j].state.master[pieces[j].a : pieces[j].b] for j in idx],
                        exp_avgs=[pieces[j].state.exp_avg[pieces[j].a : pieces[j].b] for j in idx],
                        exp_avg_sqs=[pieces[j].state.exp_avg_sq[pieces[j].a : pieces[j].b] for j in idx],
                    )
                )
            plan.append(chunk)
        self._plan_cache = (key, plan)
        return plan

    def _step_cpu(self, states: list[_SegmentState]) -> None:
        """Download gradients, step on the CPU, upload weights: chunk by chunk, double-buffered."""
        if not states:
            return
        st = self._staging
        chunks = self._chunk_plan(states)  # the caller has already ordered downloads after backward
        grads = [p.grad.reshape(-1) if p.grad is not None else None for p in self._params]

        def download(k: int) -> None:
            chunk, buf = chunks[k], k % 2
            with st.d2h():
                sources = [grads[i][a:b] for i, a, b in chunk.grad_bounds]
                torch._foreach_copy_(chunk.grad_stage[buf], sources, non_blocking=True)
                st.grad_ready[buf].record()

        for k in range(min(2, len(chunks))):
            download(k)
        for k, chunk in enumerate(chunks):
            buf = k % 2
            st.grad_ready[buf].synchronize()  # chunk k is on the host
            st.upload_done[buf].synchronize()  # chunk k-2's weights have left this upload buffer
            for call in chunk.calls:
                self._kernel(call, chunk.grad_stage[buf], chunk.param_stage[buf])
            with st.h2d():
                torch._foreach_copy_(chunk.param_dst, chunk.param_stage[buf], non_blocking=True)
                st.upload_done[buf].record()
            if k + 2 < len(chunks):
                download(k + 2)  # the kernel is done with this gradient buffer
        st.finish_step()

    def _kernel(self, call: _KernelCall, grads: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Runs the CPU kernel over the pieces of one param group in one chunk."""
        group = self.param_groups[call.group]
        beta1, beta2 = group["betas"]
        ops.adam_step_(
            call.masters,
            [grads[j] for j in call.pieces],
            call.exp_avgs,
            call.exp_avg_sqs,
            [self._steps[i] + 1 for i in call.param_indices],
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw_mode=group["adamw_mode"],
            bias_correction=group["bias_correction"],
            out_copies=[outs[j] for j in call.pieces],
            num_threads=self.num_threads,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch.optim layout: per-parameter ``step``, ``exp_avg``, ``exp_avg_sq`` (+ ``master``), on the CPU."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(self._params):
            if self._steps[i] == 0:
                continue
            full = {key: torch.empty(p.numel(), dtype=torch.float32) for key in ("exp_avg", "exp_avg_sq", "master")}
            for st in self._segments_of[i]:
                s, e = st.seg.start, st.seg.end
                full["exp_avg"][s:e] = st.exp_avg
                full["exp_avg_sq"][s:e] = st.exp_avg_sq
                full["master"][s:e] = st.master
            entry = {"step": torch.tensor(float(self._steps[i]))}
            entry.update({key: full[key].view(p.shape) for key in ("exp_avg", "exp_avg_sq")})
            if p.dtype != torch.float32:
                entry["master"] = full["master"].view(p.shape)
            state[i] = entry
        groups, index = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a TwinFlowAdam, CPUAdam or torch.optim.Adam(W) state dict, under any ratio or placement.

        Everything is checked before anything changes.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups; this optimizer has {len(self.param_groups)}")
        for gi, (saved, ours) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(ours["params"]):
                raise ValueError(
                    f"param group {gi}: state dict has {len(saved['params'])} parameters, optimizer has "
                    f"{len(ours['params'])}"
                )
        id_to_index = {pid: i for i, pid in enumerate(pid for g in groups for pid in g["params"])}
        loaded: dict[int, dict[str, torch.Tensor]] = {}
        for pid, entry in state_dict["state"].items():
            i = id_to_index[pid]
            p = self._params[i]
            for key in ("exp_avg", "exp_avg_sq") + (("master",) if "master" in entry else ()):
                if entry[key].numel() != p.numel():
                    raise ValueError(
                        f"state of parameter {i}: {key} has {entry[key].numel()} elements, expected {p.numel()}"
                    )
            loaded[i] = entry
        with torch.no_grad():
            for gi, saved in enumerate(groups):
                for key, value in saved.items():
                    if key != "params" and key in self.defaults:
                        self.param_groups[gi][key] = value
            for i, p in enumerate(self._params):
                entry = loaded.get(i)
                self._steps[i] = int(entry["step"]) if entry is not None else 0
                if entry is None:
                    flat = {"exp_avg": None, "exp_avg_sq": None, "master": p.detach().reshape(-1)}
                else:
                    flat = {k: entry[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")}
                    flat["master"] = entry["master"].reshape(-1) if "master" in entry else p.detach().reshape(-1)
                for st in self._segments_of[i]:
                    s, e = st.seg.start, st.seg.end
                    for key in ("exp_avg", "exp_avg_sq"):
                        target = getattr(st, key)
                        target.copy_(flat[key][s:e]) if flat[key] is not None else target.zero_()
                    if st.master.data_ptr() != p.data_ptr() + s * p.element_size():
                        st.master.copy_(flat["master"][s:e])
                    if st.device_step is not None:
                        st.device_step.fill_(self._steps[i])
                if entry is not None and "master" in entry:  # the model's weights follow the masters
                    p.detach().copy_(entry["master"].view(p.shape))


def _foreach_adam_no_bias_correction(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    group: dict[str, Any],
) -> None:
    """Adam/AdamW without bias correction (torch's fused kernels always correct)."""
    beta1, beta2 = group["betas"]
    lr, wd = float(group["lr"]), group["weight_decay"]
    if wd != 0:
        if group["adamw_mode"]:
            torch._foreach_mul_(params, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr)
