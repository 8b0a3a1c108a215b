"""load_config: DeepSpeed-style JSON, validated; every bad value named with its key path."""

import json
import logging

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
    with caplog.at_level(logging.WARNING, logger="twinflow.config"):
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
         r"zero_optimization\.offload_optimizer\.ratio = 'abc': expected a number, got str"),
        ({"offload_ratio": "0.5"}, r"offload_ratio = '0\.5': expected a number"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-4}}},
         r"optimizer\.params\.lr = -0\.0001: Input should be greater than or equal to 0"),
        ({"optimizer": {"type": "SGD"}}, r"optimizer\.type = 'SGD': Input should be 'adam' or 'adamw'"),
        ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}}, r"betas\[1\] = 1\.0: expected .*\[0, 1\)"),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
         r"train_batch_size = 30 but .* = 4 x 2 x 1 = 8"),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, r"30 is not a multiple of .* 4 x 1"),
        ({"offload_ratio": 0.3, "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.4}}},
         r"offload_ratio = 0\.3 disagrees with zero_optimization\.offload_optimizer\.ratio = 0\.4"),
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization\.stage = 4: Input should be less than or equal to 3"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
         r"offload_optimizer\.device = 'nvme': Input should be 'cpu' or 'none'"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
         r"scheduler\.WarmupDecayLR\.params\.total_num_steps: required key missing"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, r"scheduler = .*does not match any of the expected tags"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"both true: enable one of them"),
        ({"gradient_clipinng": 1.0}, r"gradient_clipinng: not a key twinflow or DeepSpeed knows \(did you mean "
                                     r"gradient_clipping\?\)"),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, r"fp16\.loss_scale_window = 0: Input should be greater"),
        ({"world_size": 4}, r"world_size is not a config key"),
    ],
)  # fmt: skip
def test_malformed_configs_name_key_value_and_expectation(patch: dict, message: str) -> None:
    raw = {"train_micro_batch_size_per_gpu": 2} | patch
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


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
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n "bf16": {enabled: true}}')
    with pytest.raises(ConfigError, match="not valid JSON at line 2"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_config(bad)


def test_the_example_config_loads() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "configs" / "twin_flow_bf16.json"
    config = load_config(path, world_size=2)
    assert config.ratio == 0.4 and config.bf16.enabled and config.train_batch_size == 8
    assert config.scheduler.type == "WarmupDecayLR" and config.optimizer.adamw_mode


@pytest.mark.parametrize("name, world, ratio, placement, batch", [
    ("opt-13b.json", 1, 0.5, "last", 4),
    ("opt-30b.json", 4, 0.4, "first", 16),
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
    with pytest.raises(ConfigError, match=r"offload_placement = 'middle'.*'first' or 'last'"):
        load_config(base | {"offload_placement": "middle"})
