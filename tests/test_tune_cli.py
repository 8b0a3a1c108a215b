"""``python -m twinflow.plan``: progress while it measures, small defaults without a GPU, a recommendation that
agrees with its measurements (fed to it here), strict JSON."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from twinflow.tune.__main__ import DEFAULTS, Progress, build_parser, recommend

ROOT = Path(__file__).resolve().parent.parent


def test_the_cli_shows_progress_before_its_result_and_says_it_chose_cpu_defaults(tmp_path: Path) -> None:
    """On a tiny model, without a GPU: a line when each measurement starts and ends, all before the table and the
    recommendation; the defaults it took for a CPU named; the decision explained in one sentence; strict JSON."""
    table = tmp_path / "tune.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-m", "twinflow.tune", "--model", "opt-tiny", "--batch", "1", "--seq", "16",
         "--warmup", "1", "--steps", "2", "--json", str(table)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True, cwd=ROOT, timeout=300, env=env,
    )  # fmt: skip
    out = done.stdout  # stdout and stderr as they came, in order
    ratios = DEFAULTS["ratios"][1]  # --ratios left out: the CPU default
    starts = [out.index(f"[{k}/{1 + len(ratios)}] ") for k in range(1, 2 + len(ratios))]
    assert starts == sorted(starts) and starts[-1] < out.index("   ratio  predicted s") < out.index("recommendation:")
    assert "[1/4] ratio='auto'" in out and "[1/4] chose " in out and "[4/4] ratio 1.00: 3 steps ..." in out, out
    assert out.count("median step") == 1 + len(ratios)
    # only --ratios was left to its default, and the line says so, with the GPU's default beside it
    assert "no CUDA GPU: small defaults for a CPU (--ratios 0.0 0.5 1.0; with a GPU: --ratios 0.0 0.25 0.5" in out
    assert "--model opt-tiny" not in out.split("no CUDA GPU")[1].split("\n")[0]
    explained = [line for line in out.splitlines() if line.startswith("ratio='auto' chose ")]
    assert len(explained) == 1 and "no device memory limit (the device is the CPU)" in explained[0]
    assert "GPU Adam" not in out and "inf Gparam/s" not in out and "Traceback" not in out
    result = json.loads(table.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON: not strict"))
    assert [r["ratio"] for r in result["rows"][1:]] == ratios and all(r["step_s"] > 0 for r in result["rows"])
    assert result["decision"]["inputs"]["budget_bytes"] is None  # no limit, not 2**62 bytes
    assert result["recommendation"]["ratio"] in [result["decision"]["ratio"], *ratios]


def test_help_gives_both_defaults() -> None:
    text = " ".join(build_parser().format_help().split())
    for gpu, cpu in (("opt-1.3b", "opt-tiny"), ("4", "2"), ("1024", "64")):
        assert f"(default: {gpu} with a CUDA GPU, {cpu} without)" in text
    assert "(default: 0.0 0.25 0.5 0.75 1.0 with a CUDA GPU, 0.0 0.5 1.0 without)" in text
    assert "well under a minute" in text


def rows(times: dict[float, list[float]], auto: float) -> list[dict]:
    """Measured rows as main() keeps them: auto's own run first (its ratio), then one per ratio."""
    return [{"ratio": auto, "steps_s": times[auto][:2]}] + [{"ratio": r, "steps_s": ts} for r, ts in times.items()]


def test_the_recommendation_follows_a_measurement_beyond_the_spread() -> None:
    """The report: ratio 1 measured 1.68 s, ratio 0 (auto's choice) 2.29 s, and 0 was still recommended."""
    measured = {0.0: [2.29, 2.31, 2.25, 2.4], 0.5: [2.0, 2.1, 1.95], 1.0: [1.68, 1.7, 1.66]}
    ratio, why = recommend(rows(measured, auto=0.0), auto_ratio=0.0)
    assert ratio == 1.0 and "measured fastest" in why and "ratio='auto' would choose 0.00" in why
    assert "1.680 s" in why and "2.310 s" in why  # medians; auto's run and ratio 0's pooled


def test_the_recommendation_keeps_autos_choice_within_the_spread_or_when_it_is_fastest() -> None:
    noisy = {0.0: [2.29, 1.5, 2.4], 1.0: [1.68, 1.7, 2.5]}  # medians differ, the steps overlap
    ratio, why = recommend(rows(noisy, auto=0.0), auto_ratio=0.0)
    assert ratio == 0.0 and "within the run-to-run spread" in why
    clear = {0.0: [1.0, 1.1, 1.05], 1.0: [1.6, 1.7, 1.65]}
    assert recommend(rows(clear, auto=0.0), 0.0) == (0.0, "auto's choice, also the fastest measured")
    lost = {0.0: [1.0, 1.1], 1.0: []}  # ratio 1 ran out of memory: nothing to compare with
    assert recommend(rows({0.0: [1.0, 1.1]}, 0.0) + [{"ratio": 1.0, "steps_s": []}], 0.0)[0] == 0.0
    assert recommend(rows(lost, auto=0.0), 0.0)[1].startswith("auto's choice (no other ratio")


def test_progress_falls_back_to_lines_without_tqdm(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    progress = Progress(2, 3, bar=True)
    progress.start("ratio 0.50")
    progress.step(0, 0.01)  # quick: no line of its own
    progress.step(1, 12.5)  # slow: a line, so that a long step does not look like a hang
    progress.done("median step 0.010 s over 3 steps")
    progress.close()
    assert capsys.readouterr().err.splitlines() == [
        "[1/2] ratio 0.50: 3 steps ...",
        "    step 2/3: 12.5 s",
        "[1/2] median step 0.010 s over 3 steps",
    ]


def test_progress_uses_a_tqdm_bar_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    class Bar:
        def __init__(self, total: int, **kw) -> None:
            self.total, self.n, self.lines, self.description = total, 0, [], ""
            made.append(self)

        def update(self, k: int) -> None:
            self.n += k

        def set_description(self, text: str) -> None:
            self.description = text

        def write(self, text: str, file=None) -> None:
            self.lines.append(text)

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    progress = Progress(3, 7, bar=True)
    progress.start("ratio 0.00")
    for i in range(7):
        progress.step(i, 30.0)
    progress.done("median step 30.000 s over 5 steps")
    (bar,) = made
    assert (bar.total, bar.n, bar.description) == (21, 7, "[1/3] ratio 0.00")
    assert bar.lines == ["[1/3] median step 30.000 s over 5 steps"]  # above the bar; no per-step lines


def test_local_ranks_plans_as_one_of_a_nodes_ranks(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--local-ranks N: the host budget is this process's 1/N, the kernel gets 1/N of the cores, and the kernel's
    probe runs beside N-1 copies of itself (sharers), as the ranks of a torchrun job would."""
    import twinflow.plan
    from twinflow.tune import __main__ as cli

    seen = {}
    monkeypatch.setattr(twinflow.plan, "cpu_kernel_rate",
                        lambda *a, sharers=1, **kw: seen.setdefault("sharers", sharers) and 1e9)  # fmt: skip
    monkeypatch.setattr(twinflow.plan, "device_adam_rate", lambda *a, **kw: 2e9)
    monkeypatch.setattr(twinflow.plan, "host_available_bytes", lambda: 64 * 2**30)
    for name in ("LOCAL_WORLD_SIZE", "TWINFLOW_NUM_THREADS"):  # unset now, and as they were after the test
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    cli.main(["--model", "opt-tiny", "--batch", "1", "--seq", "8", "--ratios", "--warmup", "0", "--steps", "1",
              "--local-ranks", "4"])  # fmt: skip
    assert seen["sharers"] == 4
    assert os.environ["LOCAL_WORLD_SIZE"] == "4" and os.environ["TWINFLOW_NUM_THREADS"] == "2"
    out = capsys.readouterr().out
    assert "planned as one of 4 ranks on this host: 2 kernel threads" in out
    # 64 GiB less the margin, a quarter of it for this rank: the sentence gives the host share it planned with
    assert "(14.4 GiB free after the margin)" in out, out


def test_a_shared_probe_runs_the_other_ranks_kernels_beside_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from twinflow.host import ops
    from twinflow.plan import probes

    callers: set[threading.Thread] = set()  # the threads themselves: an ended thread's ident may be given again
    monkeypatch.setattr(ops, "adam_step_", lambda *a, **kw: callers.add(threading.current_thread()))
    assert probes.cpu_kernel_rate(1, 1 << 12, sharers=3) > 0
    assert len(callers) == 3 and threading.current_thread() in callers
