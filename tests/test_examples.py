"""README's main job runs and learns."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_train_small_runs_and_loss_falls() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_small.py"), "--steps", "40", "--dim", "128", "--layers", "2"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=300,
    ).stdout
    summary = json.loads(out[out.index("{") :])
    assert summary["last_loss"] < 0.5 * summary["first_loss"]
    assert abs(summary["split"]["ratio_achieved"] - 0.4) < 0.01
