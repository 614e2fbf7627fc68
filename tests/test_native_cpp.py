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
PARTS = 2


@pytest.mark.parametrize("flavor", ["plain", "sanitized"])
def test_native_suite_passes(flavor: str) -> None:
    binary = build("native_test", flavor)
    # Helper threads for replication rounds even on 2 cores, so the rounds'
    # parallel reads, lanes and applies run here (under the sanitizers too).
    env = {**os.environ, "TF_DLT_ROW_STREAM_THREADS": "3"}
    if flavor == "sanitized":
        env.update(SANITIZER_ENV)
    # Two halves at once: most of the suite's time is waiting (deadlines,
    # sleeps), and each test makes its own files and ports.
    halves = [
        subprocess.Popen(
            [str(binary), str(ROOT / "tests/data"), f"--part={k}/{PARTS}"],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for k in range(PARTS)
    ]
    passed = 0
    try:
        for half in halves:
            stdout, stderr = half.communicate(timeout=600)
            output = stdout + stderr
            assert half.returncode == 0, output
            assert "Sanitizer" not in output and "runtime error" not in output, output
            summary = re.search(r"^(\d+) passed, (\d+) failed$", stdout.strip(), re.M)
            assert summary and summary.group(2) == "0", output
            passed += int(summary.group(1))
    finally:
        for half in halves:
            half.kill()
            half.wait()
    listed = subprocess.run(
        [str(binary), str(ROOT / "tests/data"), "--list"],
        env=env, text=True, capture_output=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    assert len(listed) >= 170 and passed == len(listed), (passed, len(listed))
    print(f"{passed} passed")
