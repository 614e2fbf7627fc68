"""Shared helpers of the benchmarks: timing, the JSON line format, loadavg.

Every case prints one JSON line with its same-run baseline and the ratio;
absolute figures on a 2-core shared machine swing 2-3x, ratios much less.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).parent / "out"
# Set by `python bench --quick` for its cases: their records go apart.
QUICK_ENV = "TF_DLT_BENCH_QUICK"


def load_module(path: str) -> ModuleType:
    """The module at `path` (from the repository root) outside bench/, e.g.
    an example's model or the C++ test build, imported once by its path, so
    no benchmark edits sys.path."""
    name = Path(path).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def example(name: str) -> ModuleType:
    """examples/<name>.py (after examples/quiet_tensorflow.py, which the
    examples import first)."""
    load_module("examples/quiet_tensorflow.py")
    return load_module(f"examples/{name}.py")


def loadavg() -> float:
    return os.getloadavg()[0]


def sorted_seconds(fn: Callable[[], object], reps: int = 7, warmup: int = 2) -> list[float]:
    """Seconds per call of `fn`, `reps` calls after `warmup`, sorted."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)


def median_seconds(fn: Callable[[], object], reps: int = 7, warmup: int = 2) -> tuple[float, float]:
    """(median, p99-ish max) seconds per call of `fn` after warm-up."""
    times = sorted_seconds(fn, reps, warmup)
    return statistics.median(times), times[-1]


def stale_build() -> str | None:
    """Why the tf_dlt this process imported is not the working tree's build,
    or None. `python bench/x.py` imports the copy installed in .venv, not
    the repository's: after a change to native/ rebuilt in place
    (`setup.py build_ext --inplace`), a benchmark would measure the build
    before it unless the package is installed again or PYTHONPATH names the
    repository root (the same for its Python sources)."""
    module = sys.modules.get("tf_dlt")
    if module is None or module.__file__ is None:
        return None
    package = Path(module.__file__).resolve().parent
    if package == ROOT / "tf_dlt":
        return None
    built = [p.stat().st_mtime for p in package.glob("*.so")]
    sources = [p.stat().st_mtime for p in (ROOT / "native").rglob("*.[ch]*")]
    sources += [p.stat().st_mtime for p in (ROOT / "tf_dlt").rglob("*.py")]
    if built and sources and max(sources) > min(built):
        return (f"tf_dlt imported from {package}, installed before the latest change to "
                f"native/ or tf_dlt/: install it again, or run with PYTHONPATH={ROOT}")  # fmt: skip
    return None


def emit(record: dict[str, Any]) -> dict[str, Any]:
    """Prints one JSON line (and appends it to bench/out/results.jsonl, or
    for a `python bench --quick` run to results-quick.jsonl: tiny sizes
    never reach the plots); a record measured with a stale installed build
    says so (stale_build)."""
    record = {"loadavg": round(loadavg(), 2), "noisy": loadavg() > os.cpu_count(), **record}
    stale = stale_build()
    if stale:
        log(f"warning: {stale}")
        record["stale_build"] = stale
    if record.get("baseline_value") and record.get("value") is not None:
        record["ratio"] = round(record["value"] / record["baseline_value"], 3)
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    OUT.mkdir(exist_ok=True)
    results = "results-quick.jsonl" if os.environ.get(QUICK_ENV) else "results.jsonl"
    with (OUT / results).open("a") as f:
        f.write(line + "\n")
    return record


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds a process (all its threads) has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# A benchmark that runs its cases in child processes: the child prints its
# result on one line (print_result), the parent reads it back (result_of).
_RESULT = "RESULT "


def print_result(value: Any) -> None:
    print(_RESULT + json.dumps(value), flush=True)


def result_of(stdout: str) -> Any:
    """The value of the last result line in a child's `stdout`; None if it
    printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(_RESULT)]
    return json.loads(lines[-1][len(_RESULT) :]) if lines else None
