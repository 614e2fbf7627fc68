"""The benchmarks as a suite: bench/cases.py lists every benchmark script,
none edits sys.path, and every case still runs at its quick size (a smoke
test: its figures are not checked; timing belongs to the benchmarks)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _case_names() -> list[str]:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--list"], capture_output=True, text=True, check=True,
        cwd=ROOT, timeout=60,
    )  # fmt: skip
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def test_the_case_list_holds_every_benchmark_and_none_edits_sys_path() -> None:
    scripts = sorted(p.stem for p in BENCH.glob("bench_*.py"))
    assert sorted(_case_names()) == scripts
    commands = [line for line in (BENCH / "run_all.sh").read_text().splitlines()
                if line.startswith("$PY")]  # fmt: skip
    assert '$PY bench "$@"' in commands  # the list, not a list of its own
    assert not [c for c in commands if "bench_" in c]
    for path in [*BENCH.rglob("*.py")]:
        assert "sys.path" not in path.read_text().replace("no benchmark edits sys.path", ""), path


@pytest.mark.slow
def test_every_case_runs_quick() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--jobs", "2"], capture_output=True, text=True,
        cwd=ROOT, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-6000:]
    ran = re.findall(r"^(bench_\w+): ok in", out.stderr, re.M)
    assert sorted(ran) == sorted(_case_names()), out.stderr[-3000:]


def test_a_case_past_its_timeout_is_stopped_with_every_process_it_started() -> None:
    """`python bench --timeout S`: a case that runs past it fails, and its
    shard processes go with it (a hung case held a run of every case for
    good)."""
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--timeout", "9", "bench_soak"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    found = re.search(r"bench_soak: FAILED \(stopped past --timeout 9 s, with every "
                      r"process of session (\d+)\)", out.stderr)  # fmt: skip
    assert found, out.stderr[-3000:]
    session = int(found.group(1))

    def left() -> list[str]:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            # (state, and the session id: the 3rd and 6th fields; a zombie
            # waits for init to collect it)
            if int(fields[3]) == session and fields[0] != "Z":
                alive.append(stat.parent.name)
        return alive

    wait_until(lambda: not left(), f"the processes of session {session} to end", timeout=10)


@pytest.mark.slow
def test_the_cache_replay_pulls_what_a_trained_run_pulls() -> None:
    """bench_cache --replay (the stream through the cache's C++ core, no
    model) stands for model.fit on shards when policies are compared: the
    same bytes, against no cache, as a trained run on 2 shard processes."""

    def bench(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, str(BENCH / "bench_cache.py"), "--train", "20000", "--epochs", "2",
             *args], capture_output=True, text=True, cwd=ROOT, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1]

    def trained(case: str) -> float:
        line = bench("--validation", "1024", "--case", case)
        return float(json.loads(line.removeprefix("RESULT "))["pull_bytes_per_step"])

    cached, uncached = trained("2000,4"), trained("0,0")
    replayed = json.loads(bench("--replay", "--rows", "2000", "--steps", "4"))
    assert replayed["fills"] > 1000 and replayed["hits"] > 10000  # the cache did work
    assert abs(replayed["value"] - cached / uncached) < 0.001, (replayed, cached / uncached)
