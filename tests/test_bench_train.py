"""The side-by-side training benchmark: its driver, its worker and what it records (on opt-tiny, CPU)."""

import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks import bench_train
from benchmarks.bench_train import deepspeed_config, failure, markdown, parse_system, twinflow_config
from twinflow.models import build_opt

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, str(ROOT / "benchmarks" / "bench_train.py")]


@pytest.mark.parametrize("text, expected", [
    ("amp", ("amp", None)), ("twinflow:0.4", ("twinflow", 0.4)), ("ds-z3:1", ("ds-z3", 1.0)),
    ("ds-z3:0", ("ds-z3", 0.0)), ("ds-z2", ("ds-z2", 1.0)), ("ds-super:0.4", ("ds-super", 0.4)),
    ("ds-zenflow", ("ds-zenflow", 1.0)), ("twinflow:auto", ("twinflow", "auto")),
    ("twinflow-m24-delay:auto", ("twinflow-m24-delay", "auto")),
])  # fmt: skip
def test_system_names_parse(text: str, expected: tuple) -> None:
    assert parse_system(text) == expected


@pytest.mark.parametrize("text, message", [
    ("adam", "unknown name 'adam'"), ("twinflow", r"expected twinflow:R with R in \[0, 1\]"),
    ("amp:0.5", "expected amp"), ("ds-z3:1.5", "ratio '1.5' is not a number in"), ("ds-z3:x", "ratio 'x'"),
    ("ds-zenflow:0.4", "expected ds-zenflow$"), ("ds-z3:auto", r"ratio 'auto' is not a number in \[0, 1\]$"),
    ("twinflow:x", r"not a number in \[0, 1\] \(or 'auto' for twinflow's systems\)"),
])  # fmt: skip
def test_bad_system_names_are_refused_with_the_expected_form(text: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        parse_system(text)


def test_models_are_built_in_the_training_dtype() -> None:
    before = torch.get_default_dtype()
    model = build_opt("opt-tiny", "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == before
    weight = model.model.decoder.layers[0].fc1.weight.float()
    assert 0.01 < weight.std().item() < 0.04  # the model's own init (std 0.02), not zeros or garbage


def test_systems_run_side_by_side_and_a_failure_does_not_stop_the_run(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # torchao's optimizer needs CUDA (or torchao is missing): that system fails, the run goes on
    cmd = [*BENCH, "--model", "opt-tiny", "--seq-len", "32",
           "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--threads", "1",
           "--systems", "amp", "torchao", "twinflow:0.4", "twinflow:auto",
           "--steps-for", "twinflow:0.4=3,1", "twinflow:auto=1,1",
           "--clip", "1.0", "--out", str(out)]  # fmt: skip
    printed = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, timeout=600).stdout
    result = json.loads(out.read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == ["amp", "torchao", "twinflow:0.4", "twinflow:auto"]
    planned = rows["twinflow:auto"]  # the row carries the ratio twinflow planned, and what was asked
    assert planned["status"] == "ok" and planned["ratio_requested"] == "auto" and 0 <= planned["ratio"] <= 1
    assert rows["torchao"]["status"] != "ok" and rows["torchao"]["output_tail"]
    for name, steps in (("amp", 2), ("twinflow:0.4", 3)):
        row = rows[name]
        assert row["status"] == "ok" and len(row["step_seconds"]) == steps and len(row["losses"]) == steps + 1
        assert all(math.isfinite(x) and x > 0 for x in row["step_seconds"] + row["losses"])
        assert row["median_step_seconds"] > 0 and row["peak_host_rss_gib"] > 0
    # the same model, seed and tokens: the first losses agree across systems (AMP in fp32 against bf16)
    assert abs(rows["amp"]["losses"][0] - rows["twinflow:0.4"]["losses"][0]) < 0.05
    assert rows["twinflow:0.4"]["ratio"] == 0.4 and result["markdown"] in printed
    assert "| torchao | - |" in result["markdown"]
    assert result["workload"]["clip"] == 1.0
    assert result["workload"]["deepspeed_zenflow"]["topk_ratio"] == 0.05  # ZenFlow's settings are on record
    # twinflow reports whether it overlapped and the gradient memory it released, per rank
    released = rows["twinflow:0.4"]["released_grad_gib_per_rank"]
    assert rows["twinflow:0.4"]["attached"] is True and len(released) == 1 and released[0] > 0
    assert "released_grad_gib_per_rank" not in rows["amp"]


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_clip_reaches_the_engines_configs(clip: float) -> None:
    """--clip is DeepSpeed's and twinflow's gradient_clipping (0: none); torch systems clip before the step."""
    assert deepspeed_config("ds-z3", 0.4, 2, clip)["gradient_clipping"] == clip
    assert deepspeed_config("ds-z2", 1.0, 2, clip)["gradient_clipping"] == clip
    super_offload = deepspeed_config("ds-super", 0.4, 2, clip)
    assert super_offload["gradient_clipping"] == clip and super_offload["zero_optimization"]["stage"] == 3
    assert super_offload["zero_optimization"]["offload_optimizer"] | {"ratio": 0.4, "super_offload": True} == \
        super_offload["zero_optimization"]["offload_optimizer"]  # fmt: skip
    import twinflow

    config = twinflow.load_config(twinflow_config(0.4, 2, 1, "last", clip), world_size=1)
    assert config.gradient_clipping == clip


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_zenflow_is_zero_offload_plus_the_tutorials_zenflow_block(clip: float) -> None:
    """ds-zenflow: ds-z2's ZeRO-2 offload config, --clip as gradient_clipping, ZenFlow's block under
    zero_optimization with the keys DeepSpeed 0.19.8's ZenFlowConfig reads; nothing else differs from ds-z2."""
    name, ratio = parse_system("ds-zenflow")
    config = deepspeed_config(name, ratio, 3, clip)
    zero = config["zero_optimization"]
    assert config["gradient_clipping"] == clip and config["train_micro_batch_size_per_gpu"] == 3
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["zenflow"] == {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
                               "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}  # fmt: skip
    # ZenFlow rejects a summed gradient all-reduce; AdamW makes DeepSpeed build ZenFlowCPUAdam, which ZeRO supports
    assert "gradient_allreduce_op" not in config and "zero_allow_untested_optimizer" not in config
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}}
    plain = deepspeed_config("ds-z2", 1.0, 3, clip)
    assert "zenflow" not in plain["zero_optimization"]
    assert {**plain, "zero_optimization": {**plain["zero_optimization"], "zenflow": zero["zenflow"]}} == config
    zero["zenflow"]["topk_ratio"] = 0.5  # a config handed out and changed leaves the next one as it was
    assert deepspeed_config(name, ratio, 3, clip)["zero_optimization"]["zenflow"]["topk_ratio"] == 0.05


def test_bad_steps_for_is_refused_before_anything_runs() -> None:
    cmd = [*BENCH, "--systems", "amp",
           "--steps-for", "bf16=3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and "--steps-for 'bf16=3': expected SYSTEM=N" in proc.stderr


def test_markdown_rows_for_cpu_results_and_failures() -> None:
    rows = [
        {"system": "amp", "ratio": None, "status": "ok", "median_step_seconds": 0.5, "peak_gpu_gib": None,
         "peak_host_rss_gib": 1.25, "losses": [2.0, 1.5]},
        {"system": "ds-z3:1", "status": "killed (host memory?)"},
    ]  # fmt: skip
    table = markdown(rows)
    assert "| amp | - | 0.500 s | - | 1.2 GiB | 2.000 -> 1.500 | ok |" in table
    assert "| ds-z3:1 | - | - | - | - | - | killed (host memory?) |" in table


def workers_under(folder: Path) -> list[str]:
    """Command lines of the live bench_train workers whose --result lies under `folder` (an exited process has none)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        if "--worker" in args and any(a.startswith(f"{folder}/") for a in args):
            found.append(f"{cmdline.parent.name}: {' '.join(args)}")
    return found


def end_workers_under(folder: Path) -> None:
    """Kills what a failing run left behind: a held worker never exits on its own."""
    for line in workers_under(folder):
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass  # exited meanwhile


def test_a_timed_out_system_leaves_no_worker_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers under torchrun hold mid-run (--hold-after); the system's timeout fires once both hold."""
    launchers = []

    class HeldLauncher(subprocess.Popen):
        """A system's launcher whose timeout fires once every worker holds, not after some seconds."""

        def __init__(self, args: list[str], **kwargs) -> None:
            super().__init__(args, **kwargs)
            self.early, self.at_timeout = "", []
            if "--worker" in args:
                launchers.append(self)

        def communicate(self, input=None, timeout=None):
            if self not in launchers:
                return super().communicate(input, timeout)
            if timeout is None:  # bench_train stopped the system: every process of it has exited, the output ends
                try:
                    rest, err = super().communicate(input, timeout=60)  # a guard against a hang, never a verdict
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"output still open after the stop: {workers_under(tmp_path)}") from None
                return self.early + rest, err
            # read below the text layer (left empty for the call above), so a poll never misses buffered lines;
            # the run's own timeout bounds the wait, so a worker that never holds fails the checks below
            poller = select.poll()
            poller.register(self.stdout.fileno(), select.POLLIN)
            while not all(f"rank {r} holds after step 1" in self.early for r in (0, 1)):
                if not poller.poll(timeout * 1000):
                    break
                chunk = os.read(self.stdout.fileno(), 1 << 16)
                if not chunk:
                    break  # the launcher exited
                self.early += chunk.decode(errors="replace")
            self.at_timeout = workers_under(tmp_path)
            raise subprocess.TimeoutExpired(self.args, timeout)

    out = tmp_path / "bench.json"
    monkeypatch.setattr(subprocess, "Popen", HeldLauncher)
    # the workers' --result files go to a temporary folder under tmp_path: only this run's workers are looked for
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--model", "opt-tiny", "--seq-len", "32", "--gpus", "2",
                                      "--threads", "1", "--systems", "twinflow:0.4", "--steps", "4", "--warmup", "1",
                                      "--hold-after", "1", "--timeout", "600", "--out", str(out)])  # fmt: skip
    try:
        bench_train.main()
        left = workers_under(tmp_path)  # bench_train waits until every process it stopped has exited
    finally:
        end_workers_under(tmp_path)
    (launcher,) = launchers
    for rank in (0, 1):
        assert f"rank {rank} holds after step 1" in launcher.early, launcher.early[-3000:]
    workers = [c for c in launcher.at_timeout if "torch.distributed.run" not in c]  # not the launcher itself
    assert len(workers) == 2, launcher.at_timeout  # both workers were alive, mid-run, when they were stopped
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "timeout" and row["returncode"] == "timeout"
    assert left == []  # none may be left the moment it returns


@pytest.mark.parametrize("code, output, expected", [
    ("timeout", "CUDA out of memory", "timeout"),
    (1, "torch.OutOfMemoryError: CUDA out of memory ... Signal 9 (SIGKILL) received by PID 7", "out of memory"),
    (1, "exitcode  : -9 (pid: 1840)\n traceback : Signal 9 (SIGKILL) received by PID 1840", "killed (host memory?)"),
    (-9, "", "killed (host memory?)"),
    (1, "ModuleNotFoundError: No module named 'deepspeed'", "failed"),
])  # fmt: skip
def test_failures_are_named_by_their_cause(code, output: str, expected: str) -> None:
    assert failure(code, output) == expected
