"""load_config: DeepSpeed-style JSON, validated; every bad value named with its key path."""

import json
import logging
import re
import warnings
from pathlib import Path

import pytest

from twinflow import ConfigError, load_config

# DeepSpeed's Twin-Flow setup as the anchors ran it: ZeRO-3, optimizer offload with a ratio.
DEEPSPEED_TWIN_FLOW = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 100,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.4},
        "sub_group_size": 1e8,
        "reduce_bucket_size": 2e8,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_param_persistence_threshold": 1e4,
    },
    "wall_clock_breakdown": False,
}


def test_deepspeed_twin_flow_file_loads_unchanged(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEEPSPEED_TWIN_FLOW))
    with caplog.at_level(logging.WARNING, logger="twinflow.engine.config"):
        config = load_config(path, world_size=2)
    assert config.ratio == 0.4 and config.zero_optimization.stage == 3
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        8, 4, 1,
    )  # fmt: skip
    assert config.optimizer.adamw_mode and config.optimizer.params.betas == (0.9, 0.95)
    assert config.bf16.enabled and config.gradient_clipping == 1.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    for key in ("zero_optimization.sub_group_size", "zero_optimization.overlap_comm", "wall_clock_breakdown"):
        assert key in warnings[0]


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
         r"zero_optimization\.offload_optimizer\.ratio = 1\.5: Input should be less than or equal to 1"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": "abc"}}},
         r'zero_optimization\.offload_optimizer\.ratio = "abc": expected a number, got a string'),
        ({"offload_ratio": "0.5"},
         r'offload_ratio = "0\.5": expected a number, got a string: write 0\.5 without quotes'),
        ({"steps_per_print": True}, r"steps_per_print = true: expected a number, got a boolean"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-4}}},
         r"optimizer\.params\.lr = -0\.0001: Input should be greater than or equal to 0"),
        ({"optimizer": {"type": "SGD"}}, r'optimizer\.type = "SGD": expected "Adam" or "AdamW" \(any case\)'),
        ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}}, r"betas\[1\] = 1\.0: expected .*\[0, 1\)"),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
         r"train_batch_size = 30 but .* = 4 x 2 x 1 = 8"),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
         r"30 is not a multiple of .* 4 x 1 = 4: set train_batch_size to a multiple of 4 \(e\.g\. 28 or 32\)"),
        ({"offload_ratio": 0.3, "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.4}}},
         r"offload_ratio = 0\.3 disagrees with zero_optimization\.offload_optimizer\.ratio = 0\.4"),
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization\.stage = 4: Input should be less than or equal to 3"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
         r"offload_optimizer\.device = \"nvme\": Input should be 'cpu' or 'none'"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
         r"^invalid twinflow config:\n  - scheduler\.params\.total_num_steps: required key missing$"),
        ({"scheduler": {"type": "OneCycle", "params": {}}},
         r'scheduler\.type = "OneCycle": expected one of "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"'),
        ({"scheduler": {"params": {}}}, r"scheduler\.type: required key missing"),
        ({"bf16": True}, r"bf16 = true: expected an object \{\.\.\.\}, got a boolean"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"both true: enable one of them"),
        ({"gradient_clipinng": 1.0}, r"gradient_clipinng: not a key twinflow or DeepSpeed knows: did you mean "
                                     r"gradient_clipping\?"),
        ({"colour": 1.0}, r"colour: not a key twinflow or DeepSpeed knows: remove it"),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, r"fp16\.loss_scale_window = 0: Input should be greater"),
        ({"world_size": 4}, r"world_size is not a config key .*: remove it"),
    ],
)  # fmt: skip
def test_malformed_configs_name_key_value_and_expectation(patch: dict, message: str) -> None:
    raw = {"train_micro_batch_size_per_gpu": 2} | patch
    with pytest.raises(ConfigError, match=message) as error:
        load_config(raw)
    # The problem is named, not the input dumped (which would also show the world_size load_config adds)
    assert not re.search(r"""\{["']train_micro_batch_size_per_gpu["']: 2""", str(error.value)), str(error.value)
    assert "(top level)" not in str(error.value)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        load_config({})


@pytest.mark.parametrize(
    "given, world, expected",
    [
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4, (32, 2, 4)),
        ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2,
         (24, 3, 4)),
    ],
)  # fmt: skip
def test_batch_sizes_follow_deepspeeds_rule(given: dict, world: int, expected: tuple) -> None:
    c = load_config(given, world_size=world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected


def test_ratio_sources_and_deepspeed_adam_semantics() -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    assert load_config(base).ratio == 0.0  # no offload
    assert load_config(base | {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}).ratio == 1.0
    assert load_config(base | {"offload_ratio": 0.25}).ratio == 0.25
    same = {"offload_ratio": 0.25, "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.25}}}
    assert load_config(base | same).ratio == 0.25
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false
    assert load_config(base | {"optimizer": {"type": "Adam"}}).optimizer.adamw_mode
    adam = load_config(base | {"optimizer": {"type": "adam", "params": {"adam_w_mode": False}}})
    assert not adam.optimizer.adamw_mode


def test_scheduler_params_with_deepspeeds_names_and_defaults() -> None:
    c = load_config(
        {"train_micro_batch_size_per_gpu": 1,
         "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_num_steps": 50}}}
    )  # fmt: skip
    assert c.scheduler.type == "WarmupCosineLR"
    assert (c.scheduler.params.total_num_steps, c.scheduler.params.warmup_num_steps) == (500, 50)
    assert c.scheduler.params.cos_min_ratio == 0.0001 and c.scheduler.params.warmup_type == "log"
    w = load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupLR"}})
    assert w.scheduler.params.warmup_max_lr == 0.001 and w.scheduler.params.warmup_num_steps == 1000


def test_file_problems_are_config_errors(tmp_path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match=f"config file '{missing}' not found: check the path"):
        load_config(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n "bf16": {enabled: true}}')
    with pytest.raises(ConfigError, match=f"{bad}: not valid JSON at line 2, column 11: Expecting property name"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object .* got a list"):
        load_config(bad)
    # json would keep the second value without a word; DeepSpeed refuses duplicates
    bad.write_text('{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true}, "bf16": {"enabled": false}}')
    with pytest.raises(ConfigError, match=f'{bad}: key "bf16" appears twice in one JSON object: keep one'):
        load_config(bad)
    bad.write_bytes(b'{"train_micro_batch_size_per_gpu": 2, "x": "\xff"}')
    with pytest.raises(ConfigError, match=f"{bad}: not UTF-8 text"):
        load_config(bad)


def test_the_example_config_loads() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "configs" / "twin_flow_bf16.json"
    config = load_config(path, world_size=2)
    assert config.ratio == 0.4 and config.bf16.enabled and config.train_batch_size == 8
    assert config.scheduler.type == "WarmupDecayLR" and config.optimizer.adamw_mode


@pytest.mark.parametrize("name, world, ratio, placement, batch", [
    ("opt-13b.json", 1, 0.5, "last", 4),
    ("opt-13b-h100-int8.json", 1, 0.55, "last", 4),
    ("opt-13b-h100-int8_m24.json", 1, 0.3, "last", 4),
    ("opt-13b-h100-int8_m24-delayed.json", 1, 0.3, "last", 4),
    ("opt-30b.json", 4, "auto", "last", 16),
    ("opt-30b-1gpu.json", 1, 0.53, "last", 4),
])  # fmt: skip
def test_the_opt_example_configs_load(name: str, world: int, ratio: float, placement: str, batch: int) -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "configs" / name
    config = load_config(path, world_size=world)
    assert (config.ratio, config.offload_placement, config.train_batch_size) == (ratio, placement, batch)
    assert config.bf16.enabled and config.gradient_clipping == 1.0


def test_offload_placement_reaches_the_optimizer_and_bad_values_are_named() -> None:
    import torch

    import twinflow

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    base = {"train_micro_batch_size_per_gpu": 1, "offload_ratio": 0.5}
    engine, optimizer, _, _ = twinflow.initialize(model=model, config=base | {"offload_placement": "last"})
    assert optimizer.placement == "last"
    engine.local_optimizer.detach()
    assert load_config(base).offload_placement == "first"
    with pytest.raises(ConfigError, match=r"offload_placement = \"middle\".*'first' or 'last'"):
        load_config(base | {"offload_placement": "middle"})


FLAGS = ["bf16.enabled", "fp16.enabled", "optimizer.params.adam_w_mode", "optimizer.params.bias_correction",
         "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.cpu_offload"]  # fmt: skip


def _nested(path: str, value: object) -> dict:
    """{"a": {"b": value}} from "a.b" (optimizer sections get the type they need)."""
    *parents, leaf = path.split(".")
    raw: dict = {leaf: value}
    for key in reversed(parents):
        raw = {key: raw}
    if "optimizer" in raw:
        raw["optimizer"]["type"] = "Adam"
    return {"train_micro_batch_size_per_gpu": 1} | raw


NOT_BOOLEANS = [("yes", '"yes"'), ("no", '"no"'), ("true", '"true"'), (0, "0"), (1, "1"), (None, "null")]


@pytest.mark.parametrize("key, value, shown", [
    (key, value, shown) for key in FLAGS for value, shown in NOT_BOOLEANS
    if not (value is None and key == "zero_optimization.cpu_offload")  # null there means not given
])  # fmt: skip
def test_booleans_are_true_or_false_only(key: str, value: object, shown: str) -> None:
    # pydantic alone reads "yes" as true and "no" or 0 as false; a JSON config means what its types say
    with pytest.raises(ConfigError, match=re.escape(f"{key} = {shown}: expected true or false")):
        load_config(_nested(key, value))


@pytest.mark.parametrize("key", [k for k in FLAGS if k != "zero_optimization.cpu_offload"])
def test_booleans_accept_true_and_false(key: str) -> None:
    for value in (True, False):
        config = load_config(_nested(key, value))
        section = config
        for part in key.split("."):
            section = getattr(section, part)
        assert section is value


@pytest.mark.parametrize("offload, why", [
    ({"ratio": 0.4}, "DeepSpeed's default"),
    ({"ratio": 0.4, "device": "none"}, "as given"),
    ({"ratio": 0.4, "pin_memory": True}, "DeepSpeed's default"),
])  # fmt: skip
def test_a_nested_ratio_without_the_cpu_device_is_refused(offload: dict, why: str) -> None:
    # DeepSpeed's offload_optimizer.device defaults to "none": the ratio alone would train with no offload
    with pytest.raises(ConfigError) as error:
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"offload_optimizer": offload}})
    message = str(error.value)
    assert "zero_optimization.offload_optimizer.ratio = 0.4 has no effect" in message
    assert why in message and 'set "device": "cpu" in zero_optimization.offload_optimizer' in message


def test_offload_with_no_effect_is_refused_but_ratio_zero_is_fine() -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    assert load_config(base | {"zero_optimization": {"offload_optimizer": {"ratio": 0}}}).ratio == 0.0
    assert load_config(base | {"zero_optimization": {"offload_optimizer": {"device": "none"}}}).ratio == 0.0
    with pytest.raises(
        ConfigError,
        match=r"offload_ratio = 0\.4 contradicts zero_optimization\.offload_optimizer\."
        r'device = "none" .*: set "device": "cpu", or remove offload_ratio',
    ):
        load_config(base | {"offload_ratio": 0.4, "zero_optimization": {"offload_optimizer": {"device": "none"}}})


def test_deprecated_cpu_offload_is_full_offload_as_in_deepspeed(caplog: pytest.LogCaptureFixture) -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    with caplog.at_level(logging.WARNING, logger="twinflow.engine.config"):
        config = load_config(base | {"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert config.ratio == 1.0 and config.zero_optimization.offload_optimizer.device == "cpu"
    [warning] = [r.getMessage() for r in caplog.records]
    assert "zero_optimization.cpu_offload is deprecated" in warning
    assert 'offload_optimizer {"device": "cpu", "ratio": 1.0}' in warning and "ignores" not in warning
    # an explicit offload_optimizer that agrees is kept; false means no offload
    agreeing = {"cpu_offload": True, "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 1.0}}
    config = load_config(base | {"zero_optimization": agreeing})
    assert config.ratio == 1.0 and config.zero_optimization.offload_optimizer.pin_memory
    assert load_config(base | {"offload_ratio": 1.0, "zero_optimization": {"cpu_offload": True}}).ratio == 1.0
    assert load_config(base | {"zero_optimization": {"cpu_offload": False}}).ratio == 0.0


@pytest.mark.parametrize("patch, message", [
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "none"}}},
     r'cpu_offload = true contradicts zero_optimization\.offload_optimizer\.device = "none"'),
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"pin_memory": True}}},
     r"cpu_offload = true contradicts .*device = \"none\" \(DeepSpeed's default\)"),
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu", "ratio": 0.4}}},
     r"cpu_offload = true \(everything on the CPU, ratio 1\.0\) contradicts .*offload_optimizer\.ratio = 0\.4"),
    ({"zero_optimization": {"cpu_offload": False, "offload_optimizer": {"device": "cpu"}}},
     r'cpu_offload = false contradicts zero_optimization\.offload_optimizer\.device = "cpu"'),
    ({"offload_ratio": 0.4, "zero_optimization": {"cpu_offload": True}},
     r"cpu_offload = true \(ratio 1\.0\) contradicts offload_ratio = 0\.4"),
])  # fmt: skip
def test_cpu_offload_contradicting_offload_settings_is_refused(patch: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message + ": remove the deprecated zero_optimization.cpu_offload"):
        load_config({"train_micro_batch_size_per_gpu": 1} | patch)


def test_disagreeing_ratios_name_both_keys_and_the_fix_without_dumping_the_config() -> None:
    raw = {"train_micro_batch_size_per_gpu": 1, "offload_ratio": 0.3,
           "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.4}}}  # fmt: skip
    with pytest.raises(ConfigError) as error:
        load_config(raw)
    assert str(error.value) == (
        "invalid twinflow config:\n  - offload_ratio = 0.3 disagrees with zero_optimization.offload_optimizer.ratio "
        "= 0.4: give one of them, or the same value in both"
    )


@pytest.mark.parametrize("betas, message", [
    ([0.9, 1.5], r"betas\[1\] = 1\.5: expected a number in \[0, 1\)$"),
    ([0.9, 1.0], r"betas\[1\] = 1\.0: expected a number in \[0, 1\)$"),
    ([-0.1, 0.9], r"betas\[0\] = -0\.1: expected a number in \[0, 1\)$"),
    ([0.9, 0.99, 0.9], r"betas = \[0\.9, 0\.99, 0\.9\]: expected a list of two numbers"),
    (0.9, r"betas = 0\.9: expected a list of two numbers \[beta1, beta2\], each in \[0, 1\)"),
])  # fmt: skip
def test_betas_message_matches_the_rule(betas: object, message: str) -> None:
    # one rule for every beta, [0, 1), and one message saying it (1.5 used to say "<= 1" while 1.0 was refused)
    with pytest.raises(ConfigError, match=r"optimizer\.params\." + message):
        load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"betas": betas}}})


EXAMPLE_CONFIGS = sorted((Path(__file__).resolve().parent.parent / "examples" / "configs").glob("*.json"))


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_example_configs_load_without_any_warning(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # README points new users at these files; a warning on every use teaches them to ignore warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.DEBUG):
            load_config(path, world_size=1)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# A Hugging Face Trainer ZeRO-3 config as its documentation gives it: the Trainer fills in every "auto".
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip

AUTO_EXPLAINED = (
    '"auto" is not supported: the Hugging Face Trainer\'s DeepSpeed integration fills it in, and twinflow reads the '
    "config as written; "
)


def test_hf_trainer_auto_values_are_each_named_with_what_to_write() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(HF_ZERO3, world_size=1)
    lines = str(error.value).split("\n  - ")[1:]
    named = {line.partition(" = ")[0] for line in lines}
    # every "auto" twinflow reads is named; those in keys twinflow ignores (reduce_bucket_size, ...) are not problems
    assert named == {
        "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
        "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps", "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
        "train_micro_batch_size_per_gpu",
    }  # fmt: skip
    assert all(f' = "auto": {AUTO_EXPLAINED}write ' in line for line in lines), lines
    assert "expected a number, got a string" not in str(error.value)


@pytest.mark.parametrize("key, value, instead", [
    ("optimizer.params.lr", "auto", "write a number instead, e.g. the default 0.001 (or leave the key out)"),
    ("optimizer.params.eps", "auto", "write a number instead, e.g. the default 1e-08 (or leave the key out)"),
    ("optimizer.params.betas", "auto",
     "write a list of two numbers [beta1, beta2] instead, e.g. the default [0.9, 0.999] (or leave the key out)"),
    ("optimizer.params.betas", [0.9, "auto"], "write a number instead, e.g. the default 0.999 (or leave the key out)"),
    ("bf16.enabled", "auto", "write true or false instead, e.g. the default false (or leave the key out)"),
    ("fp16.initial_scale_power", "Auto", "write a number instead, e.g. the default 16 (or leave the key out)"),
    ("train_micro_batch_size_per_gpu", "auto", "write a number instead, or leave the key out"),
    ("steps_per_print", "auto", "write a number instead, e.g. the default 10 (or leave the key out)"),
    ("zero_optimization.stage", "auto", "write a number instead, e.g. the default 0 (or leave the key out)"),
    ("scheduler.params.warmup_num_steps", "auto",
     "write a number instead, e.g. the default 1000 (or leave the key out)"),
    ("scheduler.params.total_num_steps", "auto", "write a number instead (the key is required)"),
])  # fmt: skip
def test_auto_names_the_key_and_the_number_to_write(key: str, value: object, instead: str) -> None:
    raw = _nested(key, value) | {"train_micro_batch_size_per_gpu": 1}
    if key == "train_micro_batch_size_per_gpu":
        raw[key] = value
    if key.startswith("scheduler"):
        raw["scheduler"]["type"] = "WarmupDecayLR"
        raw["scheduler"]["params"] = {"total_num_steps": 100} | raw["scheduler"]["params"]
    with pytest.raises(ConfigError) as error:
        load_config(raw)
    shown = key + ("[1]" if isinstance(value, list) else "")
    (line,) = str(error.value).split("\n  - ")[1:]
    assert line == f"{shown} = {json.dumps(value if isinstance(value, str) else value[1])}: {AUTO_EXPLAINED}{instead}"


def test_auto_in_the_nested_offload_ratio_points_at_offload_ratio() -> None:
    raw = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": "auto"}}}  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(AUTO_EXPLAINED) + r'.*set "offload_ratio": "auto" at the top'):
        load_config(raw)


@pytest.mark.parametrize("written", ["auto", "AUTO", " Auto "])
def test_offload_ratio_auto_is_accepted(written: str) -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    config = load_config(base | {"offload_ratio": written})
    assert config.offload_ratio == "auto" and config.ratio == "auto"
    # with the nested device "cpu" (no nested ratio) it is the same request
    config = load_config(
        base | {"offload_ratio": written, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    )
    assert config.ratio == "auto"


@pytest.mark.parametrize("patch, message", [
    ({"offload_ratio": "auto", "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.4}}},
     r'offload_ratio = "auto" disagrees with zero_optimization\.offload_optimizer\.ratio = 0\.4'),
    ({"offload_ratio": "auto", "zero_optimization": {"offload_optimizer": {"device": "none"}}},
     r'offload_ratio = "auto" contradicts zero_optimization\.offload_optimizer\.device = "none"'),
    ({"offload_ratio": "auto", "zero_optimization": {"cpu_offload": True}},
     r'cpu_offload = true \(ratio 1\.0\) contradicts offload_ratio = "auto"'),
    ({"offload_ratio": 1.5}, r'offload_ratio = 1\.5: expected a number in \[0, 1\] or "auto"$'),
    ({"offload_ratio": "half"}, r'offload_ratio = "half": expected a number in \[0, 1\] or "auto", got a string$'),
    ({"offload_ratio": True}, r"offload_ratio = true: expected a number, got a boolean$"),
])  # fmt: skip
def test_offload_ratio_auto_still_meets_the_offload_checks(patch: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"train_micro_batch_size_per_gpu": 1} | patch)


def _load_warnings(raw: dict, caplog: pytest.LogCaptureFixture) -> tuple[list[warnings.WarningMessage], list[str]]:
    with (
        warnings.catch_warnings(record=True) as caught,
        caplog.at_level(logging.WARNING, logger="twinflow.engine.config"),
    ):
        warnings.simplefilter("always")
        load_config(raw, world_size=1)
    return caught, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("zero, key, shown", [
    ({"offload_param": {"device": "cpu", "pin_memory": True}}, "zero_optimization.offload_param",
     'zero_optimization.offload_param.device = "cpu"'),
    ({"offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, "zero_optimization.offload_param",
     'zero_optimization.offload_param.device = "nvme"'),
    ({"cpu_offload_params": True}, "zero_optimization.cpu_offload_params",
     "zero_optimization.cpu_offload_params = true"),
])  # fmt: skip
def test_parameter_offload_draws_a_user_warning(zero: dict, key: str, shown: str, caplog) -> None:
    raw = {"train_micro_batch_size_per_gpu": 1, "offload_ratio": 0.5,
           "zero_optimization": {"stage": 3, "overlap_comm": True} | zero}  # fmt: skip
    caught, logged = _load_warnings(raw, caplog)
    (warning,) = caught
    assert warning.category is UserWarning and warning.filename == __file__  # points at the caller of load_config
    text = str(warning.message)
    assert text.startswith(f"{shown} asks for DeepSpeed's ZeRO-3 parameter offload, which twinflow does not do")
    assert "parameters stay on the GPU" in text and "only optimizer state is offloaded" in text
    assert "offload_ratio" in text and text.endswith(f"Remove {key} from the config to silence this warning.")
    # it has its own warning, so it leaves the ignored keys' line (the others stay there)
    assert logged == ["twinflow ignores these DeepSpeed keys: zero_optimization.overlap_comm"]


@pytest.mark.parametrize("zero", [{"offload_param": {"device": "none"}}, {"offload_param": {"pin_memory": True}},
                                  {"cpu_offload_params": False}])  # fmt: skip
def test_parameter_offload_off_is_only_an_ignored_key(zero: dict, caplog) -> None:
    caught, logged = _load_warnings({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, caplog)
    assert caught == []
    assert logged == [f"twinflow ignores these DeepSpeed keys: zero_optimization.{next(iter(zero))}"]


def test_a_refused_config_warns_nothing(caplog) -> None:
    raw = {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "wall_clock_breakdown": False,
           "zero_optimization": {"offload_param": {"device": "cpu"}, "cpu_offload": False}}  # fmt: skip
    with (
        warnings.catch_warnings(record=True) as caught,
        caplog.at_level(logging.WARNING, logger="twinflow.engine.config"),
    ):
        warnings.simplefilter("always")
        with pytest.raises(ConfigError, match="not a multiple"):
            load_config(raw, world_size=1)
    assert caught == [] and caplog.records == []


def test_schema_names_stay_importable_from_twinflow_config() -> None:
    import twinflow.engine.config
    import twinflow.engine.config_schema

    for name in twinflow.engine.config.__all__:
        assert hasattr(twinflow.engine.config, name), name
    for name in ("Config", "ConfigError", "OffloadOptimizer", "ZeroOptimization", "WarmupLR", "Number", "Flag"):
        assert getattr(twinflow.engine.config, name) is getattr(twinflow.engine.config_schema, name)
    assert twinflow.ConfigError is twinflow.engine.config.ConfigError
