"""The typed schema of twinflow's DeepSpeed-style config: its sections, their keys, types, defaults and the
checks across keys. Reading a file, sorting unknown keys and wording the errors is :mod:`twinflow.engine.config`'s job.

Types are strict: a boolean is true or false and a number is a number (not "yes", 1 or "0.5"). The string
"auto" (which the Hugging Face Trainer fills in before DeepSpeed sees a config) is refused with its own error,
:class:`AutoValue`, except in twinflow's ``offload_ratio``, where TwinFlowAdam measures the ratio itself.
"""

from __future__ import annotations

import json
import math
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every offending key, its value and the fix."""


class ConfigProblem(ValueError):
    """A check across keys whose message names every key itself (printed without pydantic's location and input)."""


class AutoValue(ValueError):
    """The string "auto" where a value is needed; ``expected`` says what to write instead ("a number", ...)."""

    def __init__(self, expected: str) -> None:
        super().__init__(f'"auto" is not supported here: expected {expected}')
        self.expected = expected


def json_kind(value: Any) -> str:
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


def json_text(value: Any) -> str:
    """A value as it is written in a JSON config ("yes", true, null), else as Python writes it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def is_auto(value: Any) -> bool:
    """Whether `value` is the Hugging Face Trainer's placeholder "auto" (any case, as a user may type it)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def _no_text(value: Any) -> Any:
    # pydantic would read "0.5" as 0.5 and true as 1; a JSON config means what its types say.
    if is_auto(value):
        raise AutoValue("a number")
    if isinstance(value, str | bool):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = f": write {value.strip()} without quotes"
            except ValueError:
                pass
        raise ValueError(f"expected a number, got {json_kind(value)}{hint}")
    return value


def _strict_bool(value: Any) -> Any:
    # pydantic would read "yes", "off", 1 and 0 as booleans; a JSON config means what its types say.
    if is_auto(value):
        raise AutoValue("true or false")
    if not isinstance(value, bool):
        hint = " without quotes" if isinstance(value, str) and value.strip().lower() in ("true", "false") else ""
        raise ValueError(f"expected true or false{hint}, got {json_kind(value)}")
    return value


def _beta(value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise ValueError("expected a number in [0, 1)")
    return value


def _beta_pair(value: Any) -> Any:
    if is_auto(value):
        raise AutoValue("a list of two numbers [beta1, beta2]")
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


def _fraction_or_auto(value: Any) -> Any:
    # "auto" is TwinFlowAdam's own ratio="auto" (measured at the first step), so here it is a value, not a gap.
    if is_auto(value):
        return "auto"
    expected = 'expected a number in [0, 1] or "auto"'
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            raise ValueError(f"{expected}, got a string") from None
    value = _finite(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(expected)
    return float(value)


Number = Annotated[float, BeforeValidator(_finite)]
Count = Annotated[int, BeforeValidator(_no_text)]
Fraction = Annotated[float, BeforeValidator(_finite), Field(ge=0.0, le=1.0)]
Flag = Annotated[bool, BeforeValidator(_strict_bool)]
Beta = Annotated[float, BeforeValidator(_finite), AfterValidator(_beta)]
FractionOrAuto = Annotated[float | Literal["auto"], BeforeValidator(_fraction_or_auto)]


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


SCHEDULERS: dict[str, type[_Section]] = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
                                         "WarmupCosineLR": WarmupCosineLR}  # fmt: skip


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
    # twinflow's shorthand for zero_optimization.offload_optimizer.ratio; "auto" is TwinFlowAdam's ratio="auto".
    offload_ratio: FractionOrAuto | None = None
    # Which end of the parameter order the CPU steps: "last" overlaps best when attached (the last layers'
    # gradients arrive first in backward); "first" is TwinFlowAdam's default.
    offload_placement: Literal["first", "last"] = "first"
    # Opt-in, not exact: after this many exact steps the CPU share's update of each step lands one step late
    # (ZeRO-Offload's delayed parameter update), so the CPU stays hidden when training clips.
    offload_delay_after: Annotated[Count, Field(ge=0)] | None = None
    # Exact: under clipping the CPU steps as gradients land and redoes the steps the norm clipped.
    offload_speculate: Flag = False
    # Exact: a step that waits for the norm writes the CPU share's new weights first, its state behind them.
    offload_weights_first: Flag = False
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
            raise ConfigProblem("\n  - ".join(problems))
        return self

    @property
    def ratio(self) -> float | Literal["auto"]:
        """The share of parameters stepped on the CPU: offload_ratio, else the nested ratio when offloading.

        "auto" (from ``offload_ratio``) is passed to TwinFlowAdam as ``ratio="auto"``: chosen at the first step.
        """
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
            f'offload_ratio = {json_text(config.offload_ratio)} contradicts {key}.device = "none" (no offload): '
            'set "device": "cpu", or remove offload_ratio to train without offload'
        )
    if config.offload_ratio is not None and "ratio" in given and nested.ratio != config.offload_ratio:
        problems.append(
            f"offload_ratio = {json_text(config.offload_ratio)} disagrees with {key}.ratio = {nested.ratio}: "
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
                f"zero_optimization.cpu_offload = {flag} contradicts {key}.device = "
                f"{json_text(nested.device)}{default}: {fix}"
            )
        elif zero.cpu_offload and "ratio" in given and nested.ratio != meant:
            problems.append(
                f"zero_optimization.cpu_offload = true (everything on the CPU, ratio 1.0) contradicts "
                f"{key}.ratio = {nested.ratio}: {fix}"
            )
        if config.offload_ratio is not None and config.offload_ratio != meant:
            problems.append(
                f"zero_optimization.cpu_offload = {flag} (ratio {meant}) contradicts offload_ratio = "
                f"{json_text(config.offload_ratio)}: {fix}"
            )
    return problems


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


REQUIRED = _Marker("REQUIRED")  # default_at: the key has no default
UNKNOWN = _Marker("UNKNOWN")  # default_at: the location names no key of the schema


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def default_at(loc: tuple[str | int, ...]) -> Any:
    """The default of the key at pydantic's error location `loc` (None: optional, unset unless given), or
    :data:`REQUIRED`, or :data:`UNKNOWN`: what an error can offer as the value to write instead."""
    model: type[BaseModel] | None = Config
    default: Any = UNKNOWN
    for part in loc:
        if isinstance(part, int):
            default = default[part] if isinstance(default, tuple | list) and 0 <= part < len(default) else UNKNOWN
            model = None
        elif part.startswith("function-"):
            continue  # a validator's name in the path
        elif model is None and part in SCHEDULERS:
            model = SCHEDULERS[part]  # the scheduler's type, which pydantic adds to the path
        elif model is not None and part in model.model_fields:
            field = model.model_fields[part]
            default = REQUIRED if field.is_required() else field.default
            nested = _models_in(field.annotation)
            model = nested[0] if len(nested) == 1 else None
        else:
            return UNKNOWN
    return default
