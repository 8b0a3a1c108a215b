"""The compact device step is compiled once, in the background, and that one compilation serves every batch.

On a GPU the step is torch.compile'd (twinflow.device.device_compact.step_functions); here it is compiled on the CPU
the same way, so that what makes torch.compile compile again (a view's base, a size of one block, a missing or
bfloat16 multiplier) shows as a second graph.
"""

import torch
import torch._dynamo

from twinflow.base.partition import Segment
from twinflow.device import device_compact
from twinflow.precision import compact_step

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True, bias_correction=True)


def _state(compiled: bool) -> device_compact.CompactDeviceState:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 96), (3000,), (200,), (7, 512)]
    params = [torch.randn(*s, generator=gen).to(torch.bfloat16) for s in shapes]
    # a whole 2-D parameter, a part of a 1-D one, one of a single block (run eagerly), a 2-D one from its 2nd row;
    # whole blocks only where compiled (torch.compile's CPU code, unlike the GPU's, rounds a short last block's
    # moments otherwise than the eager step: not the path twinflow ships, and not what this test is about)
    segments = [Segment(0, 0, 6144, False), Segment(1, 512, 2816, False), Segment(2, 0, 200, False),
                Segment(3, 512, 3584, False)]  # fmt: skip
    state = device_compact.CompactDeviceState(segments, params, "int8_m24")
    if compiled:  # on the CPU the steps are eager: compile them here as on a GPU
        state.residual_step = device_compact.Compiled(compact_step.residual_step_)
        state.master_step = device_compact.Compiled(compact_step.master_step_)
    return state


def test_one_compilation_warmed_in_the_background_serves_every_batch() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # other tests' compilations counted too
    compiled, eager = _state(compiled=True), _state(compiled=False)
    device_compact.warm_up(compiled.states, compiled.residual_step, compiled.master_step)
    assert compiled.residual_step.warming is not None  # compiling while the caller goes on
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [torch.randn(w.shape, generator=gen).to(torch.bfloat16) for w in compiled.weights]
        # no multiplier, then a bfloat16 one (a clipping coefficient of bfloat16 gradients): the same graph
        scale = None if step == 0 else torch.tensor(0.5, dtype=torch.bfloat16)
        for state in (compiled, eager):
            state.step(state.states, [HYPER], [0] * 4, lambda i, g=grads: g[i], scale)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for i in compiled.of:  # the compiled steps did the eager steps' work, every bit of it
        for key in ("master", "exp_avg", "exp_avg_sq"):
            got, want = compiled.read(i, key), eager.read(i, key)
            assert (want != 0).float().mean() > 0.9 and torch.equal(got, want)
