"""What an attach() notes about a step's gradients, and the checks it makes at ``step()``.

Gradients that left for the host during backward cannot see a change made to them afterwards (an outside
``clip_grad_norm_``, an unscale): each gradient's version is noted when backward finishes it, and one
gradient (the witness) is kept on the device and copied, so that such a change shows at ``step()``.
:data:`NO_NOTES` stands in when the optimizer is not attached: nothing streamed, nothing to check.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch

from twinflow.base import distributed
from twinflow.step.split_state import sparse_gradient_message


class GradNotes:
    """The per-step state of one attachment: the only owner of these sets and copies."""

    attached = True

    def __init__(self, eager: bool, release_grads: bool, fp16: bool, ddp: bool, fsdp: bool) -> None:
        self.eager, self.release_grads, self.fp16, self.ddp, self.fsdp = eager, release_grads, fp16, ddp, fsdp
        self.lock = threading.Lock()  # under DDP, buckets arrive on several communication threads
        self.unwaited: list[int] = []  # chunks of parameters no module owns: step() waits for them
        self.witness: int | None = None
        self.released: set[int] = set()  # parameters whose device gradient the last backward handed back
        self.end_step()

    def open_step(self) -> None:
        """The step's first gradient goes down."""
        self.streamed: set[int] = set()  # parameters whose gradient went down during this backward
        self.released = set()

    def end_step(self) -> None:
        self.streamed = set()
        self.grad_version: dict[int, int] = {}  # each gradient's version when backward finished it
        self.witness_grad: torch.Tensor | None = None

    def choose_witness(self, trainable: list[int], fully_cpu: set[int], sizes: dict[int, int]) -> None:
        """One gradient kept on the device (not released) and copied when backward ends, so that a change made
        to the gradients afterwards shows in its values, and a multiplication by exactly 1 (Trainer's logged
        norm with max_norm=inf) is told apart from a clip."""
        self.end_step()
        kept = [i for i in trainable if i not in fully_cpu] or trainable
        large = [i for i in kept if sizes[i] >= 1024]  # not a bias, whose gradient may be 0
        self.witness = min(large, key=sizes.get) if large else (max(kept, key=sizes.get) if kept else None)

    def released_bytes(self, weights: list[torch.Tensor]) -> int:
        return sum(weights[i].numel() * weights[i].element_size() for i in self.released)

    def releases(self, i: int, fully_cpu: set[int]) -> bool:
        """Whether parameter i's device gradient is handed back once it is down (and notes it)."""
        if self.release_grads and i in fully_cpu and i != self.witness:
            self.released.add(i)
            return True
        return False

    def note_grad(self, i: int, grad: torch.Tensor, name: Callable[[], str | None]) -> None:
        """Backward has finished parameter i's gradient: note its version, copy the witness."""
        if grad.is_sparse:  # attach() refused sparse modules; this one turned sparse since (or is not a module's)
            what = f"parameter {i}" + (f" ({name()!r})" if name() else "")
            raise TypeError(sparse_gradient_message(what) + "; then call zero_grad() before the next backward")
        self.grad_version[i] = grad._version
        if i == self.witness:
            self.witness_grad = distributed.local(grad).detach().clone()

    def refuse_after_eager(self, what: str) -> None:
        """`what` (a clip, an unscale) cannot reach a CPU share that stepped during backward."""
        if self.streamed and self.eager:
            raise RuntimeError(
                f"{what} after an eager overlapped backward: the CPU share has already stepped with unscaled, "
                "unclipped gradients. Pass max_grad_norm= to TwinFlowAdam (the CPU then waits for the norm)"
            )

    def check_grads_untouched(self, with_grad: list[int], params: list[torch.Tensor]) -> None:
        """Gradients changed after backward (an outside clip) cannot reach what already streamed: refused."""
        w, copy = self.witness, self.witness_grad
        if self.ddp or self.fsdp:
            # No version to compare: DDP writes its averages in, and an in-place change of FSDP2's DTensor gradients
            # (clip_grad_norm_'s foreach multiply) leaves their versions alone. The witness's values tell.
            gone = [i for i in self.streamed if params[i].grad is None and i not in self.released]
            if gone:  # DDP with a static graph turned on later reduces zeros for a parameter the step did not use
                raise RuntimeError(
                    f"parameter {gone[0]} streamed a gradient to the CPU share but has none after backward (DDP "
                    "static_graph with an unused parameter?): attach() cannot step it as AdamW would (skip it)"
                )
            witness = params[w].grad if copy is not None else None
            if copy is not None and (witness is None or not torch.equal(distributed.local(witness), copy)):
                raise RuntimeError(
                    f"gradient of parameter {w} was changed after backward (by torch.nn.utils.clip_grad_norm_?) "
                    "while TwinFlowAdam is attached to a DDP or FSDP2 model: the CPU share's gradients left once "
                    "reduced, so the change cannot reach them. Clip with TwinFlowAdam(max_grad_norm=...)"
                )
            return
        changed = [i for i in with_grad if params[i].grad is not None and i in self.grad_version
                   and params[i].grad._version != self.grad_version[i]]  # fmt: skip
        if not changed:
            return
        if w in changed and copy is not None and torch.equal(distributed.local(params[w].grad), copy):
            # Written with the same values: clip_grad_norm_ multiplied by 1 (Hugging Face Trainer's logged norm,
            # max_norm=inf). Exact only if the clipper saw every gradient; released ones it could not see.
            if not self.released:
                return
            raise RuntimeError(
                "gradients were passed through an outside clip_grad_norm_ after backward while TwinFlowAdam is "
                "attached and released the CPU share's gradients, so the norm it took left them out. Use "
                "opt.attach(model, release_grads=False) with TwinFlowAdam(max_grad_norm=...), and let the "
                "training loop not clip (Hugging Face Trainer: max_grad_norm=0 in TrainingArguments)"
            )
        raise RuntimeError(
            f"gradient of parameter {changed[0]} was changed after backward (by torch.nn.utils.clip_grad_norm_, "
            "or an unscale?) while TwinFlowAdam is attached: the CPU share's gradients left during backward, so "
            "the change cannot reach them and the step would be silently off. Clip with "
            f"TwinFlowAdam(max_grad_norm=...) ({_outer_clip_setting()}), or do not attach()"
        )


# training frameworks that clip gradients themselves (by the module their code runs in), and the setting that
# turns their clipping off
_CLIPPERS = {
    "lightning": "with Lightning, leave the Trainer's gradient_clip_val unset so it does not clip again",
    "pytorch_lightning": "with Lightning, leave the Trainer's gradient_clip_val unset so it does not clip again",
    "transformers": "with Hugging Face Trainer, set max_grad_norm=0 in TrainingArguments so it does not clip again",
}


def _outer_clip_setting() -> str:
    """How to turn off the clipping of the framework calling the step (found on the call stack), else of each."""
    frame = sys._getframe(1)
    while frame is not None:
        root = str(frame.f_globals.get("__name__", "")).split(".")[0]
        if root in _CLIPPERS:
            return _CLIPPERS[root]
        frame = frame.f_back
    return "; ".join(dict.fromkeys(_CLIPPERS.values()))


class NoNotes(GradNotes):
    """Not attached: nothing streams, nothing is released or checked."""

    attached = False

    def __init__(self) -> None:
        super().__init__(eager=False, release_grads=False, fp16=False, ddp=False, fsdp=False)

    def check_grads_untouched(self, with_grad: list[int], params: list[torch.Tensor]) -> None:
        pass


NO_NOTES = NoNotes()
