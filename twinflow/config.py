"""DeepSpeed-style JSON configuration: parsed, validated and typed (pydantic).

``load_config(path_or_dict)`` reads the keys twinflow uses, with DeepSpeed's
names and meanings, derives the batch sizes by DeepSpeed's rule, and returns
a :class:`Config`. Keys DeepSpeed has and twinflow does not use are ignored
with one warning naming them; any other key, a wrong type or a value out of
range raises :class:`ConfigError` naming the key path, the value and what
was expected. Types are strict: a boolean is true or false and a number is
a number (not "yes", 1 or "0.5"). Offload settings that contradict each
other, or that DeepSpeed would read as no offload, are refused; DeepSpeed's
deprecated ``zero_optimization.cpu_offload`` is read as DeepSpeed reads it
(true: offload_optimizer device "cpu", ratio 1.0), with a warning. DeepSpeed's
own Twin-Flow files load unchanged.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every offending key, its value and the fix."""


class _Problem(ValueError):
    """A check across keys whose message names every key itself (printed without pydantic's location and input)."""


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for messages about a JSON file."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else type(value).__name__


def _show(value: Any) -> str:
    """A value as it is written in a JSON config ("yes", true, null), else as Python writes it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _no_text(value: Any) -> Any:
    # pydantic would read "0.5" as 0.5 and true as 1; a JSON config means what its types say.
    if isinstance(value, str | bool):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = f": write {value.strip()} without quotes"
            except ValueError:
                pass
        raise ValueError(f"expected a number, got {_kind(value)}{hint}")
    return value


def _strict_bool(value: Any) -> Any:
    # pydantic would read "yes", "off", 1 and 0 as booleans; a JSON config means what its types say.
    if not isinstance(value, bool):
        hint = " without quotes" if isinstance(value, str) and value.strip().lower() in ("true", "false") else ""
        raise ValueError(f"expected true or false{hint}, got {_kind(value)}")
    return value


def _beta(value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise ValueError("expected a number in [0, 1)")
    return value


def _beta_pair(value: Any) -> Any:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError("expected a list of two numbers [beta1, beta2], each in [0, 1), e.g. [0.9, 0.999]")
    return value


def _optimizer_type(value: Any) -> Any:
    # DeepSpeed matches the type case-insensitively; anything else is reported as written.
    if isinstance(value, str) and value.lower() in ("adam", "adamw"):
        return value.lower()
    raise ValueError('expected "Adam" or "AdamW" (any case): twinflow steps Adam only')


def _finite(value: Any) -> Any:
    value = _no_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


Number = Annotated[float, BeforeValidator(_finite)]
Count = Annotated[int, BeforeValidator(_no_text)]
Fraction = Annotated[float, BeforeValidator(_finite), Field(ge=0.0, le=1.0)]
Flag = Annotated[bool, BeforeValidator(_strict_bool)]
Beta = Annotated[float, BeforeValidator(_finite), AfterValidator(_beta)]


class _Section(BaseModel):
    # Unknown keys are kept here and sorted out after validation (DeepSpeed's are ignored, others refused).
    model_config = ConfigDict(extra="allow", frozen=True)


class BF16(_Section):
    enabled: Flag = False


class FP16(_Section):
    """DeepSpeed's fp16 block: loss_scale 0 means dynamic scaling starting at 2**initial_scale_power."""

    enabled: Flag = False
    loss_scale: Annotated[Number, Field(ge=0.0)] = 0.0
    initial_scale_power: Annotated[Count, Field(ge=0, le=64)] = 16
    loss_scale_window: Annotated[Count, Field(gt=0)] = 1000
    hysteresis: Annotated[Count, Field(gt=0)] = 2
    min_loss_scale: Annotated[Number, Field(gt=0.0)] = 1.0


class OptimizerParams(_Section):
    lr: Annotated[Number, Field(ge=0.0)] = 1e-3
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(_beta_pair)] = (0.9, 0.999)
    eps: Annotated[Number, Field(ge=0.0)] = 1e-8
    weight_decay: Annotated[Number, Field(ge=0.0)] = 0.0
    adam_w_mode: Flag = True  # DeepSpeed's "Adam" decouples weight decay unless this is false
    bias_correction: Flag = True


class Optimizer(_Section):
    type: Annotated[Literal["adam", "adamw"], BeforeValidator(_optimizer_type)]
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
    device: Literal["cpu", "none"] = "none"  # DeepSpeed's default: no offload, whatever the ratio says
    pin_memory: Flag = False
    ratio: Fraction = 1.0  # DeepSpeed's default: everything on the CPU once offloading


class ZeroOptimization(_Section):
    stage: Annotated[Count, Field(ge=0, le=3)] = 0
    offload_optimizer: OffloadOptimizer = OffloadOptimizer()
    # DeepSpeed's deprecated spelling of offload_optimizer {"device": "cpu"} (ratio 1.0); read as DeepSpeed reads it.
    cpu_offload: Flag | None = None

    @model_validator(mode="before")
    @classmethod
    def _map_cpu_offload(cls, data: Any) -> Any:
        # Only when offload_optimizer is absent: an explicit one stays as written and Config checks that they agree.
        if isinstance(data, dict) and data.get("cpu_offload") is True and "offload_optimizer" not in data:
            return data | {"offload_optimizer": {"device": "cpu"}}
        return data


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
    # Opt-in, not exact: after this many exact steps the CPU share's update of each step lands one step late
    # (ZeRO-Offload's delayed parameter update), so the CPU stays hidden when training clips.
    offload_delay_after: Annotated[Count, Field(ge=0)] | None = None
    # Exact: under clipping the CPU steps as gradients land and redoes the steps the norm clipped.
    offload_speculate: Flag = False
    # Opt-in, not exact: "int8" keeps the CPU share's moments in 8 bits (6 bytes of host state a parameter, not 12);
    # "int8_m24" also its masters in 24 bits (5 bytes).
    offload_state_precision: Literal["fp32", "int8", "int8_m24"] = "fp32"
    world_size: Annotated[Count, Field(gt=0)] = 1

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        problems = []
        if self.bf16.enabled and self.fp16.enabled:
            problems.append("bf16.enabled and fp16.enabled are both true: enable one of them")
        problems += _offload_problems(self)
        if problems:
            raise _Problem("\n  - ".join(problems))
        return self

    @property
    def ratio(self) -> float:
        """The share of parameters stepped on the CPU: offload_ratio, else the nested ratio when offloading."""
        if self.offload_ratio is not None:
            return self.offload_ratio
        nested = self.zero_optimization.offload_optimizer
        return nested.ratio if nested.device == "cpu" else 0.0


def _offload_problems(config: Config) -> list[str]:
    """Offload settings that contradict each other, or that DeepSpeed would read as no offload at all."""
    problems = []
    zero = config.zero_optimization
    nested = zero.offload_optimizer
    given = nested.model_fields_set
    key = "zero_optimization.offload_optimizer"
    if "ratio" in given and nested.ratio > 0 and nested.device != "cpu":
        why = "as given" if "device" in given else "DeepSpeed's default"
        problems.append(
            f'{key}.ratio = {nested.ratio} has no effect while {key}.device is "none" ({why}: no offload): '
            f'set "device": "cpu" in {key} to step that share on the CPU, or remove the ratio'
        )
    if config.offload_ratio and "device" in given and nested.device == "none":
        problems.append(
            f'offload_ratio = {config.offload_ratio} contradicts {key}.device = "none" (no offload): '
            'set "device": "cpu", or remove offload_ratio to train without offload'
        )
    if config.offload_ratio is not None and "ratio" in given and nested.ratio != config.offload_ratio:
        problems.append(
            f"offload_ratio = {config.offload_ratio} disagrees with {key}.ratio = {nested.ratio}: "
            "give one of them, or the same value in both"
        )
    if zero.cpu_offload is not None:
        # cpu_offload: true is DeepSpeed's full offload (device cpu, ratio 1.0); false is no offload.
        meant = 1.0 if zero.cpu_offload else 0.0
        flag = "true" if zero.cpu_offload else "false"
        fix = "remove the deprecated zero_optimization.cpu_offload"
        if (nested.device == "cpu") != zero.cpu_offload:
            default = "" if "device" in given else " (DeepSpeed's default)"
            problems.append(
                f"zero_optimization.cpu_offload = {flag} contradicts {key}.device = {_show(nested.device)}{default}: "
                f"{fix}"
            )
        elif zero.cpu_offload and "ratio" in given and nested.ratio != meant:
            problems.append(
                f"zero_optimization.cpu_offload = true (everything on the CPU, ratio 1.0) contradicts "
                f"{key}.ratio = {nested.ratio}: {fix}"
            )
        if config.offload_ratio is not None and config.offload_ratio != meant:
            problems.append(
                f"zero_optimization.cpu_offload = {flag} (ratio {meant}) contradicts offload_ratio = "
                f"{config.offload_ratio}: {fix}"
            )
    return problems


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


_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _key_path(loc: tuple[str | int, ...]) -> str:
    """The key path as the user wrote it: list indices in brackets, pydantic's own entries left out."""
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith("function-") or (i == 1 and loc[0] == "scheduler" and part in _SCHEDULERS):
            continue  # a validator's name, or the scheduler type pydantic adds to the path
        else:
            path += f".{part}" if path else part
    return path


def _describe(error: dict[str, Any]) -> str:
    """One problem as "key = value: what was expected", never dumping a whole section."""
    if isinstance(error.get("ctx", {}).get("error"), _Problem):
        return str(error["ctx"]["error"])
    path = _key_path(error["loc"])
    value = error.get("input")
    kind = error["type"]
    schedulers = ", ".join(_show(name) for name in _SCHEDULERS)
    if kind == "missing":
        return f"{path}: required key missing"
    if kind == "union_tag_invalid":
        return f"{path}.type = {_show(error['ctx']['tag'])}: expected one of {schedulers}"
    if kind == "union_tag_not_found":
        return f"{path}.type: required key missing (one of {schedulers})"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path or 'the config'} = {_show(value)}: expected an object {{...}}, got {_kind(value)}"
    message = error["msg"].removeprefix("Value error, ")
    if isinstance(value, dict):  # a section: its contents are not the problem's value
        return f"{path or 'the config'}: {message}"
    return f"{path} = {_show(value)}: {message}"


def _divide(train: int, factor: int, what: str) -> int:
    quotient, rest = divmod(train, factor)
    if rest or quotient == 0:
        nearest = sorted({max(factor, train - rest), train - rest + factor})
        raise ConfigError(
            f"train_batch_size = {train} is not a multiple of {what} = {factor}: set train_batch_size to a "
            f"multiple of {factor} (e.g. {' or '.join(map(str, nearest))}), or leave it out to have it derived"
        )
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


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of two equal keys without a word; DeepSpeed refuses them, and so do we.
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Problem(f"key {_show(key)} appears twice in one JSON object: keep one of them")
        seen[key] = value
    return seen


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
        except FileNotFoundError as exc:
            where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
            raise ConfigError(f"config file {str(path)!r} not found{where}: check the path") from exc
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): a config is a JSON file") from exc
        try:
            raw = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
        except _Problem as exc:
            raise ConfigError(f"{path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object {{...}} at the top level, got {_kind(raw)}")
    if "world_size" in raw:
        raise ConfigError("world_size is not a config key (it comes from the launcher, torchrun): remove it")
    if world_size is None:
        from twinflow.distributed import rank_and_world

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
        lines = [f"{key}: not a key twinflow or DeepSpeed knows: " + (f"did you mean {' or '.join(close)}?"
                 if close else "remove it") for key, close in unknown]  # fmt: skip
        raise ConfigError("invalid twinflow config:\n  - " + "\n  - ".join(lines))
    if ignored:
        log.warning("twinflow ignores these DeepSpeed keys: %s", ", ".join(ignored))
    if config.zero_optimization.cpu_offload is not None:
        log.warning(
            "zero_optimization.cpu_offload is deprecated in DeepSpeed; read as %s",
            'offload_optimizer {"device": "cpu", "ratio": 1.0} (the whole step on the CPU): write that instead'
            if config.zero_optimization.cpu_offload
            else "no optimizer offload: remove it",
        )
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
