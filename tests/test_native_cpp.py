"""Builds and runs the C++ test suite of the native core (tests/cpp), which
reads the same golden files as the Python tests, once plainly and once
under AddressSanitizer and UndefinedBehaviorSanitizer."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from native_build import ROOT, SANITIZER_ENV, build

pytestmark = pytest.mark.slow  # builds the C++ suite twice (plain and sanitized)


@pytest.mark.parametrize("flavor", ["plain", "sanitized"])
def test_native_suite_passes(flavor: str) -> None:
    binary = build("native_test", flavor)
    # Helper threads for replication rounds even on 2 cores, so the rounds'
    # parallel reads, lanes and applies run here (under the sanitizers too).
    env = {**os.environ, "TF_DLT_ROW_STREAM_THREADS": "3"}
    if flavor == "sanitized":
        env.update(SANITIZER_ENV)
    result = subprocess.run(
        [str(binary), str(ROOT / "tests/data")], capture_output=True, text=True, timeout=600,
        env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Sanitizer" not in output and "runtime error" not in output, output
    summary = re.search(r"^(\d+) passed, (\d+) failed$", result.stdout.strip(), re.M)
    assert summary and summary.group(2) == "0" and int(summary.group(1)) >= 25, output
    print(summary.group(0))
