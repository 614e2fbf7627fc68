"""Builds and runs the C++ test suite of the native core (tests/cpp), which
reads the same golden files as the Python tests."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build() -> Path:
    sources = sorted((ROOT / "native").rglob("*.cc"))
    sources = [s for s in sources if "python" not in s.parts] + [ROOT / "tests/cpp/native_test.cc"]
    headers = sorted((ROOT / "native").rglob("*.h"))
    digest = hashlib.sha256()
    for path in sources + headers:
        digest.update(path.read_bytes())
    out_dir = ROOT / "tests/cpp/build"
    out_dir.mkdir(parents=True, exist_ok=True)
    binary = out_dir / f"native_test-{digest.hexdigest()[:16]}"
    if not binary.exists():
        cmd = ["g++", "-std=c++17", "-O1", "-g", "-pthread", "-Wall", "-Werror", f"-I{ROOT}"]
        subprocess.run([*cmd, *map(str, sources), "-o", str(binary)], check=True, timeout=600)
    return binary


def test_native_suite_passes() -> None:
    binary = _build()
    result = subprocess.run(
        [str(binary), str(ROOT / "tests/data")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("9 passed, 0 failed"), result.stdout
