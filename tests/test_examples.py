"""The examples run end to end (small sizes): the README's main job and the
same model on 2 shard processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # trains each example end to end

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> tuple[str, str]:
    out = subprocess.run(
        [sys.executable, script, *args], cwd=EXAMPLES, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, out.stderr


def test_main_job_trains_saves_and_exports(tmp_path: Path) -> None:
    out, stderr = _run(
        "ctr_main.py", "--train", "20000", "--validation", "4000", "--epochs", "2",
        "--out", str(tmp_path),
    )  # fmt: skip
    auc = float(re.search(r"AUC (\d\.\d+)", out).group(1))  # type: ignore[union-attr]
    # Only the job's own output: none of TensorFlow's start-up log lines.
    for noise in ("absl::InitializeLog", "cuda", "cpu_feature_guard", "oneDNN"):
        assert noise not in out + stderr, out + stderr
    assert auc > 0.6, out  # chance is 0.5; the task has learnable id effects
    assert (tmp_path / "checkpoint" / "tf_dlt_model.json").exists()
    assert (tmp_path / "serving" / "1" / "saved_model.pb").exists()


def test_two_shard_example() -> None:
    out, _ = _run("ctr_two_shards.py", "--train", "10000")
    assert re.search(r"AUC \d\.\d+; \d+ rows on 2 shards", out), out


def test_shard_round_trip_example() -> None:
    out, _ = _run("shard_round_trip.py", "--steps", "20")
    assert "rows identical = True" in out, out
