"""``twinflow.initialize``: a DeepSpeed-shaped engine over TwinFlowAdam and PyTorch's own distributed engines.

What it does with a config (see :mod:`twinflow.engine.config`):

- precision: ``bf16.enabled`` casts the model to bfloat16 (TwinFlowAdam keeps
  fp32 masters); ``fp16.enabled`` to float16 with loss scaling (static or
  DeepSpeed's dynamic scaler; an overflow skips the step on both sides);
  otherwise it trains in the model's dtype.
- optimizer: TwinFlowAdam with the config's Adam/AdamW parameters, the
  offload ratio and ``gradient_clipping`` as its ``max_grad_norm``.
- scheduler: DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR.
- accumulation: ``backward`` divides the loss by the accumulation steps
  (DeepSpeed's default) and streams gradients only on the closing micro-step;
  ``step`` steps only at the boundary.
- one process: TwinFlowAdam is attached to the model (gradients stream in
  backward, the CPU overlaps). Several processes (torchrun): stage 0 wraps the
  model in DDP, and TwinFlowAdam is attached to it (each bucket streams once
  DDP has averaged it); stage 1 also shards the optimizer state with
  ``torch.distributed.optim.ZeroRedundancyOptimizer``, each rank's share
  stepped by TwinFlowAdam at the configured ratio (not attached); stages 2
  and 3 shard the model with FSDP2 (``fully_shard``; reshard after forward
  off for 2, on for 3) and TwinFlowAdam, attached, steps each rank's local
  shards as their reduce-scatter lands.
- checkpoints: :mod:`twinflow.checkpoint.portable` (on PyTorch's distributed checkpoint; any number of processes
  resumes).
- ``steps_per_print``: every that many optimizer steps, rank 0 writes one line
  through :func:`twinflow.base.notice.notice` (seen without configuring logging),
  as DeepSpeed does: step, skipped steps, the loss (mean of this rank's
  micro-batches since the last line), the learning rates, the gradient norm (when
  clipping measured it) and samples/s (train_batch_size over the time since
  the last line, or since the first step).

Refused with a ConfigError: fp16 with stage 1 on several processes.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from twinflow.base.distributed import rank_and_world
from twinflow.base.notice import notice
from twinflow.checkpoint import portable as portable_checkpoint
from twinflow.checkpoint.any_format import load_either
from twinflow.engine.config import Config, ConfigError, load_config
from twinflow.engine.schedulers import build_scheduler
from twinflow.optim import offload_states
from twinflow.optim.twin_flow_adam import TwinFlowAdam


class LossScaler:
    """fp16 loss scaling with DeepSpeed's rules.

    ``loss_scale`` > 0: a fixed scale. 0: dynamic, starting at
    2**initial_scale_power; an overflow skips the step and, once
    ``hysteresis`` overflows have been absorbed, halves the scale (not below
    ``min_loss_scale``); ``loss_scale_window`` steps without overflow double it
    (and restore the hysteresis).
    """

    def __init__(self, fp16: Any) -> None:
        self.dynamic = fp16.loss_scale == 0
        self.scale = float(2**fp16.initial_scale_power) if self.dynamic else float(fp16.loss_scale)
        self.window, self.hysteresis, self.min_scale = fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale
        self.cur_hysteresis = self.hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.cur_hysteresis = self.hysteresis
            self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        keys = ("scale", "cur_hysteresis", "iteration", "last_overflow")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class Progress:
    """The ``steps_per_print`` line: DeepSpeed's step, skipped and lr, plus the mean loss of the micro-batches
    since the last line, the step's gradient norm and samples/s since the last line.

    Losses stay tensors until a line is written, so steps without a line add no host synchronisation. The
    clock starts after the first step (its kernel build and ``ratio="auto"`` probe are not throughput).
    """

    def __init__(self, batch_size: int, print_here: bool) -> None:
        self.batch_size, self.print_here = batch_size, print_here
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._clock: tuple[int, float] | None = None  # (global step, time) the samples/s count from

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (as passed to ``backward``, before any scaling)."""
        if not self.print_here:
            return
        loss = loss.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._losses += 1

    def step_done(
        self, step: int, skipped: int, lrs: list[float], grad_norm: torch.Tensor | float | None, print_now: bool
    ) -> None:
        """After optimizer step `step`; writes the line when `print_now` (`grad_norm`: this step's, if measured)."""
        if not self.print_here:
            return
        if not print_now:
            if self._clock is None:
                self._clock = (step, time.perf_counter())
            return
        parts = [f"step={step}", f"skipped={skipped}"]
        if self._loss_sum is not None:
            parts.append(f"loss={float(self._loss_sum) / self._losses:.5g}")
            self._loss_sum, self._losses = None, 0
        parts.append("lr=[" + ", ".join(f"{float(lr):.6g}" for lr in lrs) + "]")
        if grad_norm is not None:
            parts.append(f"grad_norm={float(grad_norm):.5g}")
        now = time.perf_counter()  # after the loss and norm reached the host: the work so far is done
        if self._clock is not None and now > self._clock[1]:
            parts.append(f"samples/s={(step - self._clock[0]) * self.batch_size / (now - self._clock[1]):.2f}")
        self._clock = (step, now)
        notice("%s", ", ".join(parts))


class Engine:
    """Runs forward, backward and step as a DeepSpeed engine does; built by :func:`initialize`."""

    def __init__(self, model: torch.nn.Module, config: Config, model_parameters: Any | None) -> None:
        self.config = config
        self.world_size = config.world_size
        self.module = model
        stage = config.zero_optimization.stage
        distributed = self.world_size > 1
        if config.bf16.enabled:
            model.to(torch.bfloat16)
        self.loss_scaler = LossScaler(config.fp16) if config.fp16.enabled else None
        if self.loss_scaler is not None:
            if distributed and stage == 1:
                raise ConfigError(
                    "fp16 with zero_optimization.stage = 1 on several processes: each rank's optimizer sees only "
                    "its share, so an overflow would not skip the step everywhere; use bf16, or stage 0, 2 or 3"
                )
            model.to(torch.float16)
        if distributed and stage >= 2:
            _fully_shard(model, reshard_after_forward=stage == 3)
            self.network = model
        elif distributed:
            self.network = torch.nn.parallel.DistributedDataParallel(model)
        else:
            self.network = model
        params = model_parameters if model_parameters is not None else model.parameters()
        # ZeRO-1: each rank's TwinFlowAdam sees only its share, so clipping by its own norm would be wrong.
        # DDP leaves every rank the whole averaged gradient: the engine clips over the whole model instead.
        zero1 = distributed and stage == 1
        self._clip_in_engine = zero1 and config.gradient_clipping > 0
        kwargs = self._optimizer_kwargs(clip=not zero1)
        if zero1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=TwinFlowAdam, **kwargs)
            self.local_optimizer = self.optimizer.optim
        else:
            self.optimizer = self.local_optimizer = TwinFlowAdam(params, **kwargs)
        if not distributed:
            self.local_optimizer.attach(model)
        elif stage != 1:  # gradients stream once reduced: DDP's averaged buckets, FSDP2's reduce-scattered shards
            self.local_optimizer.attach(self.network)
        self.lr_scheduler = build_scheduler(config.scheduler, self.optimizer) if config.scheduler else None
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.progress = Progress(config.train_batch_size, print_here=rank_and_world()[0] == 0)

    def _optimizer_kwargs(self, clip: bool) -> dict[str, Any]:
        config = self.config
        opt = config.optimizer
        kwargs: dict[str, Any] = {
            "ratio": config.ratio,
            "placement": config.offload_placement,
            "max_grad_norm": (config.gradient_clipping or None) if clip else None,
            "delay_after": config.offload_delay_after,
            "speculate": config.offload_speculate,
            "weights_first": config.offload_weights_first,
            "state_precision": config.offload_state_precision,
        }
        if opt is not None:
            p = opt.params
            kwargs |= {"lr": p.lr, "betas": p.betas, "eps": p.eps, "weight_decay": p.weight_decay,
                       "adamw_mode": opt.adamw_mode, "bias_correction": p.bias_correction}  # fmt: skip
        return kwargs

    # ------------------------------------------------------------- training
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.network(*inputs, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the coming backward closes an accumulation window."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of loss / accumulation steps; only the closing micro-step syncs and streams gradients."""
        scaled = loss / self.config.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        if self.is_gradient_accumulation_boundary():
            scaled.backward()
        else:
            with self._no_sync():
                scaled.backward()
        self.micro_steps += 1
        self.progress.add_loss(loss)

    def _no_sync(self):
        stack = contextlib.ExitStack()
        if isinstance(self.network, torch.nn.parallel.DistributedDataParallel):
            stack.enter_context(self.network.no_sync())
        stack.enter_context(self.local_optimizer.no_sync())  # TwinFlowAdam, also under ZeRO-1
        return stack

    def step(self) -> None:
        """At an accumulation boundary: optimizer step (clipping inside), scheduler step, gradients cleared."""
        if self.micro_steps % self.config.gradient_accumulation_steps != 0:
            return
        grad_norm = None
        if self._clip_in_engine:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.gradient_clipping)
        skipped_before = self.local_optimizer.skipped_steps
        norm_before = getattr(self.local_optimizer, "last_grad_norm", None)  # set by steps that clip
        if self.loss_scaler is not None:
            self.local_optimizer.unscale_(1.0 / self.loss_scaler.scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        overflow = self.local_optimizer.skipped_steps > skipped_before
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        if self.lr_scheduler is not None and not overflow:  # as DeepSpeed: a skipped step keeps the schedule
            self.lr_scheduler.step()
        self.skipped_steps += int(overflow)
        self.global_steps += 1
        norm_after = getattr(self.local_optimizer, "last_grad_norm", None)
        if grad_norm is None and norm_after is not norm_before:  # this step's norm, not an earlier step's
            grad_norm = norm_after
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.progress.step_done(self.global_steps, self.skipped_steps, lrs, grad_norm,
                                print_now=self.global_steps % self.config.steps_per_print == 0)  # fmt: skip

    # ------------------------------------------------------ between phases
    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> int:  # fmt: skip
        """DeepSpeed's ``engine.offload_states``: frees the device for another phase (an RL rollout) through
        :meth:`TwinFlowAdam.offload_states`. `include` takes DeepSpeed's names (``optim_states``, ``hp_params``,
        ``lp_grads``, ``contiguous_grad_buffer``, ``lp_params``) or ours (``optimizer``, ``grads``,
        ``weights``); None moves all three. The buffer is always pinned on a GPU and the copies finished on
        return (`pin_memory` and `non_blocking` are accepted for DeepSpeed's signature). Under ZeRO-1 this
        rank's optimizer moves the weights of its own share. Returns the bytes moved."""
        if str(getattr(device, "value", device)) != "cpu":
            raise ValueError(f"offload_states(device={device!r}): states move to host memory only; pass "
                             'device="cpu"')  # fmt: skip
        kinds, weights = offload_states.engine_include(include)
        return self.local_optimizer.offload_states(kinds, weights=weights)

    def reload_states(self, non_blocking: bool = False) -> int:
        """DeepSpeed's ``engine.reload_states``: what :meth:`offload_states` moved comes back; returns the bytes."""
        return self.local_optimizer.reload_states()

    # ---------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: dict | None = None,
                        portable: bool = True, asynchronous: bool = False) -> Path:  # fmt: skip
        """Writes the model, the optimizer's state, the scheduler and the counters atomically, in the format any
        number of processes resumes from, under any stage, ratio or precision (:mod:`twinflow.checkpoint.portable`,
        on PyTorch's distributed checkpoint); `asynchronous`: written in the background while training goes on, put
        in place at the next save or load or :meth:`wait_checkpoint`. `portable` is accepted as True only: the
        per-rank format of twinflow 0.1.0 is no longer written."""
        if not portable:
            raise ValueError(
                "save_checkpoint(portable=False): the per-rank format (one shard a rank) is no longer written; "
                "leave portable out: the portable format resumes on any number of processes, this one's included"
            )
        self.wait_checkpoint()
        tag = tag or f"global_step{self.global_steps}"
        extra = {"global_steps": self.global_steps, "micro_steps": self.micro_steps, "client_state": client_state or {},
                 "skipped_steps": self.skipped_steps,
                 "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}  # fmt: skip
        chosen = self.local_optimizer.ratio  # offload_ratio "auto": the ratio chosen at the first step
        meta = {"config": self.config.model_dump(mode="json"), "ratio": self.config.ratio if chosen is None else chosen}
        if self.optimizer is not self.local_optimizer:  # ZeRO-1: the scheduler set its groups' lr after the step,
            for group, local in zip(self.optimizer.param_groups, self.local_optimizer.param_groups):  # not yet ours
                local["lr"] = group["lr"]
        parts = dict(model=self.module, optimizer=self.local_optimizer, scheduler=self.lr_scheduler, extra=extra,
                     meta=meta)  # fmt: skip
        saved = portable_checkpoint.save_portable(save_dir, tag, **parts, asynchronous=asynchronous)
        return saved.final if isinstance(saved, portable_checkpoint.PendingSave) else saved

    def wait_checkpoint(self, release_memory: bool = False) -> Path | None:
        """Waits for an asynchronous save still being written and puts it in place; returns its folder (None: no
        save was pending). An asynchronous save keeps its host copy of the state (this rank's share of the
        checkpoint) for the next one, which copies into it several times faster: `release_memory` frees it."""
        done = portable_checkpoint.wait_pending()
        if release_memory:
            portable_checkpoint.release_kept_copies()
        return done

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None) -> tuple[Path, dict]:
        """Restores a checkpoint (``latest`` when no tag); returns (its folder, the saved client_state)."""
        # offload_ratio "auto" not decided yet: the optimizer keeps the loaded state until its first step builds it
        self.wait_checkpoint(release_memory=True)  # the load needs host memory more than the next save
        extra, meta = load_either(load_dir, tag, model=self.module, optimizer=self.local_optimizer,
                           scheduler=self.lr_scheduler)  # fmt: skip
        if self.optimizer is not self.local_optimizer:  # ZeRO-1: its groups drive the local optimizer's lr
            for group, local in zip(self.optimizer.param_groups, self.local_optimizer.param_groups):
                group["lr"] = local["lr"]
        self.global_steps, self.micro_steps = int(extra["global_steps"]), int(extra["micro_steps"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        if self.loss_scaler is not None and extra.get("loss_scaler"):
            self.loss_scaler.load_state_dict(extra["loss_scaler"])
        return Path(load_dir) / meta["tag"], extra["client_state"]


def _fully_shard(model: torch.nn.Module, reshard_after_forward: bool) -> None:
    """FSDP2 over every member of the model's ModuleLists (its blocks), then the root.

    Stage 2 keeps the gathered parameters from forward to backward (ZeRO-2's
    memory for gradients and optimizer state, parameters whole); stage 3
    reshards them after forward (ZeRO-3).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def initialize(
    model: torch.nn.Module,
    config: str | Path | dict | Config,
    model_parameters: Any | None = None,
    training_data: torch.utils.data.Dataset | None = None,
) -> tuple[Engine, torch.optim.Optimizer, torch.utils.data.DataLoader | None, Any]:
    """Shaped like ``deepspeed.initialize``: returns (engine, optimizer, dataloader, lr_scheduler).

    The dataloader (when `training_data` is given) yields micro-batches of
    ``train_micro_batch_size_per_gpu``, shuffled; with several processes each
    rank reads its own part (DistributedSampler).
    """
    if not isinstance(config, Config):
        config = load_config(config)
    engine = Engine(model, config, model_parameters)
    loader = None
    if training_data is not None:
        if engine.world_size > 1:
            sampler = torch.utils.data.distributed.DistributedSampler(training_data)
        else:
            sampler = torch.utils.data.RandomSampler(training_data)
        loader = torch.utils.data.DataLoader(
            training_data, batch_size=config.train_micro_batch_size_per_gpu, sampler=sampler
        )
    return engine, engine.optimizer, loader, engine.lr_scheduler
