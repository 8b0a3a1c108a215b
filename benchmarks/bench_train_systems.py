"""The systems bench_train.py compares: their names, the parsing of one on the command line, each one's
configuration, and its model, optimizer and training step.

bench_train.py runs one of these per process (``--worker``); its module docstring describes the systems.
"""

from __future__ import annotations

import torch

DEEPSPEED = ("ds-z3", "ds-z2", "ds-zenflow", "ds-super")
ZERO_STAGE_2 = ("ds-z2", "ds-zenflow")
TWINFLOW = ("twinflow", "twinflow-delay", "twinflow-spec", "twinflow-wf", "twinflow-m24", "twinflow-m24-delay",
            "twinflow-m24-wf")  # fmt: skip
SYSTEMS = ("amp", "bf16", *TWINFLOW, *DEEPSPEED, "torchao")
SINGLE_GPU_ONLY = ("amp", "bf16", "torchao")
LR, WEIGHT_DECAY = 1e-5, 0.01
# The DeepSpeed settings of the reference figures quoted in BENCHMARKS.md.
DS_ZERO = {"sub_group_size": 100_000_000, "reduce_bucket_size": 200_000_000, "overlap_comm": True}
# ZenFlow's block (zero_optimization.zenflow) as DeepSpeed's ZenFlow tutorial gives it: the top 5% of each weight's
# gradient columns step on the GPU every step, the rest accumulate and step on the CPU every 4th step, overlapped
# with the next steps' compute. "auto" selection without a data loader selects the columns once, at the first step.
ZENFLOW = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
           "full_warm_up_rounds": 0, "overlap_step": True}  # fmt: skip


def parse_system(text: str) -> tuple[str, float | str | None]:
    """'twinflow:0.4' -> ('twinflow', 0.4), 'twinflow:auto' -> ('twinflow', 'auto'); checks the name and the ratio,
    naming what is expected."""
    name, _, ratio = text.partition(":")
    if name not in SYSTEMS:
        raise SystemExit(f"system {text!r}: unknown name {name!r}; expected one of {', '.join(SYSTEMS)}")
    needs_ratio = name in (*TWINFLOW, "ds-z3", "ds-super")
    if needs_ratio != bool(ratio):
        form = f"{name}:R with R in [0, 1]" if needs_ratio else name
        raise SystemExit(f"system {text!r}: expected {form}")
    if not ratio:
        return name, 1.0 if name in ZERO_STAGE_2 else None
    if ratio == "auto" and name in TWINFLOW:  # planned by twinflow at the first step (the row records the plan)
        return name, "auto"
    try:
        value = float(ratio)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        auto = " (or 'auto' for twinflow's systems)" if name in TWINFLOW else ""
        raise SystemExit(f"system {text!r}: ratio {ratio!r} is not a number in [0, 1]{auto}")
    return name, value


def deepspeed_config(name: str, ratio: float, micro: int, clip: float) -> dict:
    """DeepSpeed's config for system `name` (ds-z3, ds-z2, ds-zenflow, ds-super) with ratio `ratio` of the optimizer
    on the CPU; ds-zenflow is ds-z2's config with ZenFlow's block added, so that the pair isolates ZenFlow."""
    zero: dict = {"stage": 2 if name in ZERO_STAGE_2 else 3, **DS_ZERO}
    if ratio > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if ratio < 1:
            zero["offload_optimizer"]["ratio"] = ratio
        if name == "ds-super":
            zero["offload_optimizer"]["super_offload"] = True
    if name == "ds-zenflow":
        zero["zenflow"] = dict(ZENFLOW)  # a copy: DeepSpeed is handed a dict it may keep
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": zero,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def twinflow_config(ratio: float | str, micro: int, world: int, placement: str, clip: float, mode: str = "") -> dict:
    """twinflow.initialize's config; `mode` "delay", "spec" or "wf" for twinflow-delay, -spec and -wf, with "m24-"
    before it (or alone) for int8_m24 state on both sides."""
    precision, _, mode = mode.rpartition("m24")
    precision = "int8_m24" if _ else "fp32"
    mode = mode.lstrip("-")
    return {
        "offload_state_precision": precision,
        "offload_delay_after": 1 if mode == "delay" else None,
        "offload_speculate": mode == "spec",
        "offload_weights_first": mode == "wf",
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": 3 if world > 1 else 0},
        "offload_ratio": ratio,
        "offload_placement": placement,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }


def cpu_seconds(host) -> dict:
    """From the CPU side's timeline, per step: the chunks' kernel and upload seconds (what runs once a clipped
    step's norm is known: the critical path's CPU part), and the commits' (weights first: behind the weights)."""
    events = host.timeline or []
    chunk = [e["end"] - e["start"] for e in events if "chunk" in e]
    steps = max(1, len(chunk) // max(1, host.chunk_count))
    commits = sum(e["end"] - e["start"] for e in events if "commit" in e)
    peeks = sum(bool(e.get("peek")) for e in events if "chunk" in e)
    return {"cpu_chunks_s_per_step": sum(chunk) / steps, "cpu_commits_s_per_step": commits / steps,
            "chunks_per_step": host.chunk_count, "weights_first_chunks_per_step": peeks / steps,
            "weights_first_late_steps": host.weights_first.late_steps if host.chunk_count else 0}  # fmt: skip


def build(name: str, ratio: float | None, args, device: str, world: int):
    """(model, one_step(tokens) -> loss, finish(), report() -> dict of the system's own figures) for a system."""
    from twinflow.models import build_opt

    dtype = torch.float32 if name == "amp" else torch.bfloat16
    model = build_opt(args.model, device, dtype)
    finish = lambda: None  # noqa: E731
    report = lambda: {}  # noqa: E731

    if name in ("amp", "bf16"):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device != "cpu")
        autocast = name == "amp"

        def one_step(tokens):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    elif name == "torchao":
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def one_step(tokens):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()
            return loss

    elif name in TWINFLOW:
        import twinflow

        config = twinflow_config(ratio, args.micro_batch, world, args.placement, args.clip, name.partition("-")[2])
        engine, _, _, _ = twinflow.initialize(model=model, config=config)
        opt = engine.local_optimizer
        finish = opt.synchronize
        # released: device gradient memory handed back during the last backward (attached, wholly CPU-stepped)
        coordinator = opt.coordinator

        if coordinator.host.chunk_count:
            coordinator.host.timeline = []  # the CPU's work per step (host clock)

        def report() -> dict:
            host = coordinator.host
            return {"attached": opt.attached, "ratio_planned": opt.ratio,
                    "released_grad_gib": opt.released_grad_bytes / 2**30,
                    "rollbacks": host.speculative.rollbacks if host.chunk_count else 0,
                    "steps_not_speculated": coordinator.speculation.skipped, **cpu_seconds(host)}  # fmt: skip
    else:  # DeepSpeed
        import deepspeed

        config = deepspeed_config(name, ratio, args.micro_batch, args.clip)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    if name in (*TWINFLOW, *DEEPSPEED):  # the same engine calls for both

        def one_step(tokens):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            return loss

    return model, one_step, finish, report
