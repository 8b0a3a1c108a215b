"""The device share in a compact precision (twinflow.device.device_compact): the same bits as the CPU share's kernel,
state that moves between the sides (a new ratio, a state dict) unchanged, and its bytes."""

import copy

import pytest
import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam
from twinflow.base.partition import Segment
from twinflow.device.device_compact import CompactDeviceState
from twinflow.precision import compact


def make(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # sizes that are not multiples of the 256-element block, so the cuts fall inside tensors
    model = torch.nn.Sequential(torch.nn.Linear(61, 300), torch.nn.GELU(), torch.nn.Linear(300, 9))
    return model.to(dtype)


def train(model: torch.nn.Module, opt: TwinFlowAdam, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 61, generator=gen)
        y = x[:, :9] * 0.5  # something to learn
        x = x.to(dtype)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    return losses


def state_bits(opt: TwinFlowAdam) -> list[tuple[int, str, torch.Tensor]]:
    """Every entry of the state dict, as raw bits."""
    out = []
    for i, entry in sorted(opt.state_dict()["state"].items()):
        for key in sorted(entry):
            value = entry[key]
            out.append((i, key, value.view(torch.int32) if value.dtype == torch.float32 else value))
    return out


def assert_same(a_model, a_opt, b_model, b_opt) -> None:  # noqa: ANN001
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(p.view(torch.int16) if p.dtype == torch.bfloat16 else p, q.view(torch.int16)
                           if q.dtype == torch.bfloat16 else q)  # fmt: skip
    for (i, key, x), (j, key2, y) in zip(state_bits(a_opt), state_bits(b_opt), strict=True):
        assert (i, key) == (j, key2) and torch.equal(x, y), (i, key)


CASES = [(torch.bfloat16, "int8_m24"), (torch.bfloat16, "int8"), (torch.float32, "int8")]


@pytest.mark.parametrize("dtype, precision", CASES)
@pytest.mark.parametrize("ratio", [0.0, 0.37])
def test_the_device_share_steps_like_the_cpu_kernel_bit_for_bit(dtype, precision, ratio) -> None:  # noqa: ANN001
    """Ratio 1 is the CPU kernel alone; ratio 0 the device side alone (here on the CPU, eagerly); 0.37 both,
    with a tensor cut between them. The same rounding noise per element, the same blocks and the same weight
    rounding: every weight, master and moment is bit for bit the same."""
    runs = []
    for r in (1.0, ratio):
        model = make(dtype)
        opt = TwinFlowAdam(model.parameters(), lr=1e-2, weight_decay=0.1, ratio=r, chunk_bytes=4096,
                           state_precision=precision)  # fmt: skip
        losses = train(model, opt, 6)
        runs.append((model, opt, losses))
    (cpu_model, cpu_opt, cpu_losses), (model, opt, losses) = runs
    assert opt.split_summary["device"]["elements"] > 0 and losses[-1] < losses[0]
    assert_same(cpu_model, cpu_opt, model, opt)
    assert cpu_losses == losses


@pytest.mark.parametrize("dtype, precision", CASES[:2])
def test_resume_at_another_ratio_keeps_every_bit(dtype, precision) -> None:  # noqa: ANN001
    """Three steps at ratio 0.3, the state dict loaded into an optimizer at ratio 0.7, three more: bit for bit
    six steps at ratio 0.3 (the state moved across the sides without being quantised again)."""
    straight = make(dtype)
    straight_opt = TwinFlowAdam(straight.parameters(), lr=1e-2, ratio=0.3, state_precision=precision)
    train(straight, straight_opt, 3)
    train(straight, straight_opt, 3, seed=2)

    first = make(dtype)
    first_opt = TwinFlowAdam(first.parameters(), lr=1e-2, ratio=0.3, state_precision=precision)
    train(first, first_opt, 3)
    saved = copy.deepcopy(first_opt.state_dict())
    second = make(dtype, seed=5)  # other weights: the masters in the state dict must set them
    second.load_state_dict(first.state_dict())
    second_opt = TwinFlowAdam(second.parameters(), lr=1e-2, ratio=0.7, state_precision=precision)
    second_opt.load_state_dict(saved)
    assert second_opt.split_summary["ratio_achieved"] > 0.6
    train(second, second_opt, 3, seed=2)
    assert_same(straight, straight_opt, second, second_opt)


def test_device_state_bytes_are_three_an_element_for_bf16_under_int8_m24() -> None:
    model = make(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.0, state_precision="int8_m24")
    dev = opt.split_summary["device"]
    blocks = sum(compact.blocks(p.numel()) for p in model.parameters())
    assert dev["state_precision"] == "int8_m24"
    assert dev["state_bytes"] == 3 * dev["elements"] + 2 * blocks
    fp32 = TwinFlowAdam(make(torch.bfloat16).parameters(), ratio=0.0)
    assert fp32.split_summary["device"]["state_bytes"] == 12 * dev["elements"]


@pytest.mark.parametrize("placement", ["first", "last"])
def test_compact_cuts_fall_on_block_starts(placement: str) -> None:
    model = make(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.41, placement=placement, chunk_bytes=1000,
                       state_precision="int8_m24")  # fmt: skip
    split = opt.coordinator.split
    for st in split.device_state.states:
        assert st.seg.start % compact.BLOCK == 0
    for pc in split.host.pieces:
        assert pc.start % compact.BLOCK == 0
    assert abs(opt.split_summary["ratio_achieved"] - 0.41) < 300 / sum(p.numel() for p in model.parameters())


def test_opt_state_reads_and_writes_through_the_compact_device_state() -> None:
    """An entry read decodes; a write (a new exp_avg) is encoded and read back as its nearest codes; the weight
    follows a master written through load_state_dict."""
    model = make(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.0, state_precision="int8_m24")
    train(model, opt, 2)
    p = model[0].weight
    state = opt.state_dict()
    entry = state["state"][0]
    gen = torch.Generator().manual_seed(3)
    entry["exp_avg"] = torch.randn(entry["exp_avg"].shape, generator=gen) * 1e-3
    entry["master"] = torch.randn(entry["master"].shape, generator=gen) * 0.05
    opt.load_state_dict(state)
    back = opt.state_dict()["state"][0]
    codes = compact.encode(entry["exp_avg"].reshape(-1), back["exp_avg_sq"].reshape(-1))
    nearest = compact.decode_exp_avg(codes[0], codes[1]).view(p.shape)
    assert torch.equal(back["exp_avg"], nearest)
    hi, lo = compact.encode_master(entry["master"])
    assert torch.equal(back["master"].reshape(-1), compact.decode_master(hi, lo))
    assert (p.float() - entry["master"]).abs().max() <= entry["master"].abs().max() * 2**-8


def _steps_on(device: torch.device, n: int, dtype: torch.dtype, precision: str, grads: list[torch.Tensor]):
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(n, generator=gen) * 0.05).to(dtype).to(device)
    seg = Segment(0, 0, n, on_cpu=False)
    state = CompactDeviceState([seg], [weight], precision)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True,
                 bias_correction=True)  # fmt: skip
    for k, g in enumerate(grads):
        scale = torch.tensor(0.5 if k % 2 else 1.0, device=device)
        state.step(state.states, [hyper], [0], lambda i, g=g: g.to(device), scale)
    st = state.states[0]
    parts = [weight] + [t for t in (st.master, st.residual) if t is not None] + st.codes
    return [t.cpu() for t in parts]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "int8_m24"), (torch.float32, "int8"),
                                              (torch.bfloat16, "int8")])  # fmt: skip
def test_the_device_steps_kernel_keeps_the_cpus_bits(dtype, precision) -> None:  # noqa: ANN001
    """The Triton kernel of the compact step on the GPU against the same step as torch operations on the CPU (the
    kernel's bits): every weight, residual, code and scale after several steps."""
    n = 3 * (1 << 16) + 77
    gen = torch.Generator().manual_seed(8)
    grads = [(torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4).to(dtype) for _ in range(5)]
    on_cpu = _steps_on(torch.device("cpu"), n, dtype, precision, grads)
    on_gpu = _steps_on(torch.device("cuda"), n, dtype, precision, grads)
    for a, b in zip(on_cpu, on_gpu, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.cuda
def test_build_state_dict_save_and_load_on_the_gpu_never_hold_a_float32_copy(tmp_path) -> None:  # noqa: ANN001
    """max_memory_allocated above what is kept, for a 67M-parameter bf16 layer wholly on the device: a float32
    copy of its masters alone would be 256 MiB; the build, state_dict(), a portable checkpoint's save and load, and
    a state dict's load each stay within one batch's scratch, less than one chunk."""
    from benchmarks.compact_device_peaks import measure

    measured = measure(tmp_path)  # the measurement `python benchmarks/compact_device_peaks.py` reports
    n, peaks, chunk = measured["numel"], measured["peaks"], measured["chunk_bytes"]
    fp32_copy = 4 * n
    assert measured["state_bytes"] < 3.01 * n
    # measured on an H200: 0 (build), 61 MiB (state_dict), 54 (save), 67 (load), 84 (load_state_dict): a batch's
    # decode or encode scratch on the device, within one chunk (128 MiB), half a float32 copy
    assert chunk <= fp32_copy / 2
    for phase, value in peaks.items():
        assert value <= chunk, (phase, peaks)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["int8", "int8_m24"])
def test_the_host_codes_convert_on_the_gpu_with_the_cpus_bits(precision: str) -> None:
    """A load's encoding and a state_dict's decoding of the CPU share's codes run on the GPU where the weights are:
    the same codes, scales and float32 moments as the host's own conversion, bit for bit."""
    from twinflow.host.host_state import HostState
    from twinflow.host.staging import plan_pieces

    n = 3 * (1 << 20) + 777  # several conversion batches, a partial block
    segs = [Segment(0, 256, n, on_cpu=True)]
    pieces = plan_pieces(segs, [2], 1 << 22, 256)
    gen = torch.Generator().manual_seed(5)
    values = {"master": torch.randn(n - 256, generator=gen),
              "exp_avg": torch.randn(n - 256, generator=gen) * torch.logspace(-9, -1, n - 256),
              "exp_avg_sq": torch.rand(n - 256, generator=gen) * torch.logspace(-14, -2, n - 256)}  # fmt: skip
    states = [HostState(pieces, precision, torch.device(d)) for d in ("cpu", "cuda")]
    assert [s.conversion_device.type for s in states] == ["cpu", "cuda"]
    for state in states:
        state.write(0, values)
    cpu, gpu = (state.codec.q8 for state in states)
    assert all(torch.equal(a, b) for qa, qb in zip(cpu, gpu) for a, b in zip(qa, qb))
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = (state.read(0, key) for state in states)
        assert a.device.type == b.device.type == "cpu" and torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert not torch.equal(states[0].read(0, "exp_avg"), torch.zeros(n - 256))  # the moments are there


def test_the_host_codes_convert_on_a_gpu_or_on_the_host() -> None:
    """The CPU share's conversions go to a GPU only: another device (meta here; mps, xla) or none is the host."""
    from twinflow.host.host_state import HostState
    from twinflow.host.staging import plan_pieces

    pieces = plan_pieces([Segment(0, 0, 512, on_cpu=True)], [2], 1 << 20, 256)
    for device in (None, torch.device("meta"), torch.device("cpu")):
        assert HostState(pieces, "int8_m24", device).conversion_device == torch.device("cpu")
    state = HostState(pieces, "int8_m24", torch.device("cuda", 1))  # a GPU is kept as named, even unseen here
    assert state.conversion_device == torch.device("cuda", 1)
    state.convert_on(None)
    assert state.conversion_device == torch.device("cpu")
