"""DeepSpeed-style JSON configuration: read, validated and typed.

``load_config(path_or_dict)`` reads the keys twinflow uses, with DeepSpeed's
names and meanings, derives the batch sizes by DeepSpeed's rule, and returns
a :class:`Config` (its schema: :mod:`twinflow.engine.config_schema`, whose public
names are importable from here too). Keys DeepSpeed has and twinflow does
not use are ignored with one warning naming them; any other key, a wrong
type or a value out of range raises :class:`ConfigError` naming the key
path, the value and what was expected. Types are strict: a boolean is true
or false and a number is a number (not "yes", 1 or "0.5"); the Hugging Face
Trainer's "auto" is refused with what to write instead, except in twinflow's
``offload_ratio`` (TwinFlowAdam's ``ratio="auto"``). Offload settings that
contradict each other, or that DeepSpeed would read as no offload, are
refused; DeepSpeed's deprecated ``zero_optimization.cpu_offload`` is read as
DeepSpeed reads it (true: offload_optimizer device "cpu", ratio 1.0), with a
warning. ZeRO-3 parameter offload (``zero_optimization.offload_param``) is
not done: asking for it draws a :class:`UserWarning`. DeepSpeed's own
Twin-Flow files load unchanged.
"""

from __future__ import annotations

import difflib
import json
import logging
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from twinflow.engine.config_schema import (
    BF16,
    FP16,
    REQUIRED,
    SCHEDULERS,
    UNKNOWN,
    AutoValue,
    Beta,
    Config,
    ConfigError,
    ConfigProblem,
    Count,
    Flag,
    Fraction,
    FractionOrAuto,
    Number,
    OffloadOptimizer,
    Optimizer,
    OptimizerParams,
    WarmupCosineLR,
    WarmupCosineLRParams,
    WarmupDecayLR,
    WarmupDecayLRParams,
    WarmupLR,
    WarmupLRParams,
    WarmupType,
    ZeroOptimization,
    default_at,
    json_kind,
    json_text,
)

__all__ = [
    "BF16", "FP16", "Beta", "Config", "ConfigError", "Count", "Flag", "Fraction", "FractionOrAuto", "Number",
    "OffloadOptimizer", "Optimizer", "OptimizerParams", "WarmupCosineLR", "WarmupCosineLRParams", "WarmupDecayLR",
    "WarmupDecayLRParams", "WarmupLR", "WarmupLRParams", "WarmupType", "ZeroOptimization", "derive_batch_sizes",
    "load_config",
]  # fmt: skip

log = logging.getLogger(__name__)

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


def _key_path(loc: tuple[str | int, ...]) -> str:
    """The key path as the user wrote it: list indices in brackets, pydantic's own entries left out."""
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith("function-") or (i == 1 and loc[0] == "scheduler" and part in SCHEDULERS):
            continue  # a validator's name, or the scheduler type pydantic adds to the path
        else:
            path += f".{part}" if path else part
    return path


def _describe(error: dict[str, Any]) -> str:
    """One problem as "key = value: what was expected", never dumping a whole section."""
    if isinstance(error.get("ctx", {}).get("error"), ConfigProblem):
        return str(error["ctx"]["error"])
    path = _key_path(error["loc"])
    value = error.get("input")
    kind = error["type"]
    schedulers = ", ".join(json_text(name) for name in SCHEDULERS)
    if kind == "missing":
        return f"{path}: required key missing"
    if kind == "union_tag_invalid":
        return f"{path}.type = {json_text(error['ctx']['tag'])}: expected one of {schedulers}"
    if kind == "union_tag_not_found":
        return f"{path}.type: required key missing (one of {schedulers})"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path or 'the config'} = {json_text(value)}: expected an object {{...}}, got {json_kind(value)}"
    if isinstance(error.get("ctx", {}).get("error"), AutoValue):
        return f"{path} = {json_text(value)}: {_auto_message(path, error['loc'], error['ctx']['error'].expected)}"
    message = error["msg"].removeprefix("Value error, ")
    if isinstance(value, dict):  # a section: its contents are not the problem's value
        return f"{path or 'the config'}: {message}"
    return f"{path} = {json_text(value)}: {message}"


# Where twinflow has its own key for what "auto" asks of a DeepSpeed key.
_AUTO_ALTERNATIVES = {
    "zero_optimization.offload_optimizer.ratio": 'for a ratio twinflow measures, remove it and set "offload_ratio": '
    '"auto" at the top level (TwinFlowAdam\'s ratio="auto", chosen at the first step)',
}


def _auto_message(path: str, loc: tuple[str | int, ...], expected: str) -> str:
    """Why "auto" is refused at `path` and what to write there instead (with the key's default when it has one)."""
    default = default_at(loc)
    if default is REQUIRED:
        instead = f"write {expected} instead (the key is required)"
    elif default is None or default is UNKNOWN:
        instead = f"write {expected} instead, or leave the key out"
    else:
        instead = f"write {expected} instead, e.g. the default {json_text(default)} (or leave the key out)"
    alternative = _AUTO_ALTERNATIVES.get(path)
    return (
        '"auto" is not supported: the Hugging Face Trainer\'s DeepSpeed integration fills it in, and twinflow '
        f"reads the config as written; {instead}" + (f"; {alternative}" if alternative else "")
    )


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
            raise ConfigProblem(f"key {json_text(key)} appears twice in one JSON object: keep one of them")
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
        except ConfigProblem as exc:
            raise ConfigError(f"{path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object {{...}} at the top level, got {json_kind(raw)}")
    if "world_size" in raw:
        raise ConfigError("world_size is not a config key (it comes from the launcher, torchrun): remove it")
    if world_size is None:
        from twinflow.base.distributed import rank_and_world

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
    train, micro, accumulation = derive_batch_sizes(
        config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
        world_size,
    )  # fmt: skip
    # Warnings only for a config that is returned: a refused one reports its problems and nothing else.
    not_done = _parameter_offload(config.zero_optimization)
    for key, asked in not_done.items():
        warnings.warn(
            f"{asked} asks for DeepSpeed's ZeRO-3 parameter offload, which twinflow does not do: the parameters "
            "stay on the GPU (each rank's shard under stage 3), and only optimizer state is offloaded, the share set "
            f"by offload_ratio (or zero_optimization.offload_optimizer.ratio). Remove {key} from the config to "
            "silence this warning.",
            UserWarning,
            stacklevel=2,
        )
    ignored = [key for key in ignored if key not in not_done]
    if ignored:
        log.warning("twinflow ignores these DeepSpeed keys: %s", ", ".join(ignored))
    if config.zero_optimization.cpu_offload is not None:
        log.warning(
            "zero_optimization.cpu_offload is deprecated in DeepSpeed; read as %s",
            'offload_optimizer {"device": "cpu", "ratio": 1.0} (the whole step on the CPU): write that instead'
            if config.zero_optimization.cpu_offload
            else "no optimizer offload: remove it",
        )
    return config.model_copy(
        update={
            "train_batch_size": train,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation,
        }
    )


def _parameter_offload(zero: ZeroOptimization) -> dict[str, str]:
    """The keys asking DeepSpeed to offload the parameters themselves: {key path: "key = value" as written}.

    DeepSpeed's default device is "none" (no offload), so an offload_param without a device asks nothing.
    """
    given = zero.model_extra or {}
    asked = {}
    param = given.get("offload_param")
    if isinstance(param, dict) and param.get("device", "none") != "none":
        asked["zero_optimization.offload_param"] = (
            f"zero_optimization.offload_param.device = {json_text(param['device'])}"
        )
    if given.get("cpu_offload_params") is True:  # DeepSpeed's deprecated spelling of offload_param device "cpu"
        asked["zero_optimization.cpu_offload_params"] = "zero_optimization.cpu_offload_params = true"
    return asked
