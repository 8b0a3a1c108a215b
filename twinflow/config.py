"""DeepSpeed-style JSON configuration: parsed, validated and typed (pydantic).

``load_config(path_or_dict)`` reads the keys twinflow uses, with DeepSpeed's
names and meanings, derives the batch sizes by DeepSpeed's rule, and returns
a :class:`Config`. Keys DeepSpeed has and twinflow does not use are ignored
with one warning naming them; any other key, a wrong type or a value out of
range raises :class:`ConfigError` naming the key path, the value and what
was expected. DeepSpeed's own Twin-Flow files load unchanged.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every offending key, its value and the fix."""


def _no_text(value: Any) -> Any:
    # pydantic would read "0.5" as 0.5 and true as 1; a JSON config means what its types say.
    if isinstance(value, str | bool):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    return value


def _finite(value: Any) -> Any:
    value = _no_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


Number = Annotated[float, BeforeValidator(_finite)]
Count = Annotated[int, BeforeValidator(_no_text)]
Fraction = Annotated[float, BeforeValidator(_finite), Field(ge=0.0, le=1.0)]


class _Section(BaseModel):
    # Unknown keys are kept here and sorted out after validation (DeepSpeed's are ignored, others refused).
    model_config = ConfigDict(extra="allow", frozen=True)


class BF16(_Section):
    enabled: bool = False


class FP16(_Section):
    """DeepSpeed's fp16 block: loss_scale 0 means dynamic scaling starting at 2**initial_scale_power."""

    enabled: bool = False
    loss_scale: Annotated[Number, Field(ge=0.0)] = 0.0
    initial_scale_power: Annotated[Count, Field(ge=0, le=64)] = 16
    loss_scale_window: Annotated[Count, Field(gt=0)] = 1000
    hysteresis: Annotated[Count, Field(gt=0)] = 2
    min_loss_scale: Annotated[Number, Field(gt=0.0)] = 1.0


class OptimizerParams(_Section):
    lr: Annotated[Number, Field(ge=0.0)] = 1e-3
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    eps: Annotated[Number, Field(ge=0.0)] = 1e-8
    weight_decay: Annotated[Number, Field(ge=0.0)] = 0.0
    adam_w_mode: bool = True  # DeepSpeed's "Adam" decouples weight decay unless this is false
    bias_correction: bool = True

    @model_validator(mode="after")
    def _betas_below_one(self) -> OptimizerParams:
        for i, beta in enumerate(self.betas):
            if beta >= 1.0:
                raise ValueError(f"betas[{i}] = {beta}: expected a number in [0, 1)")
        return self


class Optimizer(_Section):
    # DeepSpeed matches the type case-insensitively; an unknown one is reported as written.
    type: Annotated[
        Literal["adam", "adamw"],
        BeforeValidator(lambda v: v.lower() if isinstance(v, str) and v.lower() in ("adam", "adamw") else v),
    ]
    params: OptimizerParams = OptimizerParams()

    @property
    def adamw_mode(self) -> bool:
        """Decoupled weight decay: always for AdamW; for Adam unless ``adam_w_mode`` is false (DeepSpeed)."""
        return self.type == "adamw" or self.params.adam_w_mode


WarmupType = Literal["log", "linear"]


class WarmupLRParams(_Section):
    warmup_min_lr: Annotated[Number, Field(ge=0.0)] = 0.0
    warmup_max_lr: Annotated[Number, Field(ge=0.0)] = 0.001
    warmup_num_steps: Annotated[Count, Field(ge=0)] = 1000
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: Annotated[Count, Field(gt=0)]


class WarmupCosineLRParams(_Section):
    total_num_steps: Annotated[Count, Field(gt=0)]
    warmup_min_ratio: Fraction = 0.0
    warmup_num_steps: Annotated[Count, Field(ge=0)] = 1000
    cos_min_ratio: Fraction = 0.0001
    warmup_type: WarmupType = "log"


class WarmupLR(_Section):
    type: Literal["WarmupLR"]
    params: WarmupLRParams = WarmupLRParams()


class WarmupDecayLR(_Section):
    type: Literal["WarmupDecayLR"]
    params: WarmupDecayLRParams


class WarmupCosineLR(_Section):
    type: Literal["WarmupCosineLR"]
    params: WarmupCosineLRParams


class OffloadOptimizer(_Section):
    device: Literal["cpu", "none"] = "none"
    pin_memory: bool = False
    ratio: Fraction = 1.0  # DeepSpeed's default: everything on the CPU once offloading


class ZeroOptimization(_Section):
    stage: Annotated[Count, Field(ge=0, le=3)] = 0
    offload_optimizer: OffloadOptimizer = OffloadOptimizer()


class Config(_Section):
    """The keys twinflow reads, typed; batch sizes are filled in by DeepSpeed's rule."""

    train_batch_size: Annotated[Count, Field(gt=0)] | None = None
    train_micro_batch_size_per_gpu: Annotated[Count, Field(gt=0)] | None = None
    gradient_accumulation_steps: Annotated[Count, Field(gt=0)] | None = None
    gradient_clipping: Annotated[Number, Field(ge=0.0)] = 0.0
    bf16: BF16 = BF16()
    fp16: FP16 = FP16()
    optimizer: Optimizer | None = None
    scheduler: Annotated[WarmupLR | WarmupDecayLR | WarmupCosineLR, Field(discriminator="type")] | None = None
    zero_optimization: ZeroOptimization = ZeroOptimization()
    steps_per_print: Annotated[Count, Field(gt=0)] = 10
    offload_ratio: Fraction | None = None  # twinflow's shorthand for zero_optimization.offload_optimizer.ratio
    # Which end of the parameter order the CPU steps: "last" overlaps best when attached (the last layers'
    # gradients arrive first in backward); "first" is TwinFlowAdam's default.
    offload_placement: Literal["first", "last"] = "first"
    world_size: Annotated[Count, Field(gt=0)] = 1

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.bf16.enabled and self.fp16.enabled:
            raise ValueError("bf16.enabled and fp16.enabled are both true: enable one of them")
        nested = self.zero_optimization.offload_optimizer
        if self.offload_ratio is not None and "ratio" in nested.model_fields_set and nested.ratio != self.offload_ratio:
            raise ValueError(
                f"offload_ratio = {self.offload_ratio} disagrees with zero_optimization.offload_optimizer.ratio = "
                f"{nested.ratio}: give one of them, or the same value in both"
            )
        return self

    @property
    def ratio(self) -> float:
        """The share of parameters stepped on the CPU: offload_ratio, else the nested ratio when offloading."""
        if self.offload_ratio is not None:
            return self.offload_ratio
        nested = self.zero_optimization.offload_optimizer
        return nested.ratio if nested.device == "cpu" else 0.0


# Keys DeepSpeed accepts that twinflow does not use: ignored with one warning. Anything else is refused.
_DEEPSPEED_IGNORED = {
    "": {
        "wall_clock_breakdown",
        "memory_breakdown",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "amp",
        "activation_checkpointing",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "monitor_config",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "data_types",
        "compression_training",
        "curriculum_learning",
        "data_efficiency",
        "elasticity",
        "autotuning",
        "dump_state",
        "checkpoint",
        "aio",
        "pipeline",
        "disable_allgather",
        "fp32_allreduce",
        "load_universal_checkpoint",
        "use_data_before_expert_parallel",
        "graph_harvesting",
        "timers",
        "eigenvalue",
        "quantize_training",
        "sparse_attention",
        "nebula",
        "weight_quantization",
        "hybrid_engine",
        "compile",
        "torch_autocast",
        "zero_optimization_stage",
    },
    "zero_optimization": {
        "contiguous_gradients",
        "overlap_comm",
        "reduce_scatter",
        "reduce_bucket_size",
        "allgather_partitions",
        "allgather_bucket_size",
        "use_multi_rank_bucket_allreduce",
        "sub_group_size",
        "cpu_offload",
        "cpu_offload_params",
        "cpu_offload_use_pin_memory",
        "offload_param",
        "prefetch_bucket_size",
        "stage3_prefetch_bucket_size",
        "param_persistence_threshold",
        "stage3_param_persistence_threshold",
        "model_persistence_threshold",
        "stage3_model_persistence_threshold",
        "max_live_parameters",
        "stage3_max_live_parameters",
        "max_reuse_distance",
        "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "stage3_use_all_reduce_for_fetch_params",
        "ignore_unused_parameters",
        "legacy_stage1",
        "round_robin_gradients",
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        "zeropp_loco_param",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "memory_efficient_linear",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
        "elastic_checkpoint",
        "load_from_fp32_weights",
    },
    "zero_optimization.offload_optimizer": {
        "nvme_path",
        "buffer_count",
        "fast_init",
        "pipeline",
        "pipeline_read",
        "pipeline_write",
        "super_offload",
        "cpuadam_cores_perc",
    },
    "optimizer.params": {"torch_adam", "amsgrad", "fused"},
    "bf16": {
        "immediate_grad_update",
        "check_grad_overflow",
        "bf16_master_weights_and_grads",
        "bf16_optimizer_states",
    },  # fmt: skip
    "fp16": {"auto_cast", "fp16_master_weights_and_grads", "consecutive_hysteresis"},
}


def _extras(section: BaseModel, path: str, ignored: list[str], unknown: list[tuple[str, list[str]]]) -> None:
    """Sorts every key pydantic kept as extra into DeepSpeed's (ignored) and unknown (refused)."""
    for key in section.model_extra or {}:
        full = f"{path}.{key}" if path else key
        if key in _DEEPSPEED_IGNORED.get(path, set()):
            ignored.append(full)
        else:
            known = list(type(section).model_fields) + sorted(_DEEPSPEED_IGNORED.get(path, set()))
            unknown.append((full, difflib.get_close_matches(key, known, n=2)))
    for name in type(section).model_fields:
        child = getattr(section, name)
        if isinstance(child, BaseModel):
            _extras(child, f"{path}.{name}" if path else name, ignored, unknown)


def _describe(error: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in error["loc"] if not str(p).startswith("function-")) or "(top level)"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] in ("missing",):
        return f"{path}: required key missing"
    return f"{path} = {error.get('input')!r}: {message}"


def _divide(train: int, factor: int, what: str) -> int:
    quotient, rest = divmod(train, factor)
    if rest or quotient == 0:
        raise ConfigError(f"train_batch_size = {train} is not a multiple of {what}")
    return quotient


def derive_batch_sizes(
    train: int | None, micro: int | None, accumulation: int | None, world_size: int
) -> tuple[int, int, int]:
    """DeepSpeed's rule: train_batch_size = micro batch x accumulation steps x world size; two give the third."""
    if train is not None and micro is not None and accumulation is not None:
        if train != micro * accumulation * world_size:
            raise ConfigError(
                f"train_batch_size = {train} but train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                f"world size = {micro} x {accumulation} x {world_size} = {micro * accumulation * world_size}: "
                "make them agree, or leave one of the three out to have it derived"
            )
        return train, micro, accumulation
    if train is not None and micro is not None:
        what = f"train_micro_batch_size_per_gpu x world size = {micro} x {world_size}"
        return train, micro, _divide(train, micro * world_size, what)
    if train is not None:
        accumulation = accumulation or 1
        what = f"gradient_accumulation_steps x world size = {accumulation} x {world_size}"
        return train, _divide(train, accumulation * world_size, what), accumulation
    if micro is not None:
        accumulation = accumulation or 1
        return micro * accumulation * world_size, micro, accumulation
    raise ConfigError("set train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed needs one of them)")


def load_config(source: str | Path | dict[str, Any], *, world_size: int | None = None) -> Config:
    """Reads a DeepSpeed-style JSON file (or an already parsed dict) into a validated :class:`Config`.

    ``world_size`` (default: torch.distributed's, else 1) enters DeepSpeed's
    batch-size rule. Nothing is half-applied: it either returns a complete
    Config or raises ConfigError listing every problem it found.
    """
    if isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from exc
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level, got {type(raw).__name__}")
    if "world_size" in raw:
        raise ConfigError("world_size is not a config key: it comes from the launcher (torchrun)")
    if world_size is None:
        from twinflow.checkpoint import rank_and_world

        world_size = rank_and_world()[1]
    try:
        config = Config.model_validate(raw | {"world_size": world_size})
    except ValidationError as exc:
        problems = "\n  - ".join(_describe(e) for e in exc.errors())
        raise ConfigError(f"invalid twinflow config:\n  - {problems}") from None
    ignored: list[str] = []
    unknown: list[tuple[str, list[str]]] = []
    _extras(config, "", ignored, unknown)
    if unknown:
        lines = [f"{key}: not a key twinflow or DeepSpeed knows" + (f" (did you mean {' or '.join(close)}?)"
                 if close else "") for key, close in unknown]  # fmt: skip
        raise ConfigError("invalid twinflow config:\n  - " + "\n  - ".join(lines))
    if ignored:
        log.warning("twinflow ignores these DeepSpeed keys: %s", ", ".join(ignored))
    train, micro, accumulation = derive_batch_sizes(
        config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
        world_size,
    )  # fmt: skip
    return config.model_copy(
        update={
            "train_batch_size": train,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation,
        }
    )
