"""Runs benchmarks from bench/cases.py, each a process of its own, from the
repository root: ``python bench [--quick] [--jobs N] [--list] [NAME ...]``
(all when no name is given; one at a time unless --jobs says more). Each
case prints its JSON lines (and appends them to bench/out/results.jsonl, or
with --quick to bench/out/results-quick.jsonl, which bench/plot.py never
reads); this prints a line per case and exits non-zero if any failed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from cases import named
from common import QUICK_ENV, ROOT, log


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench", description=__doc__)
    p.add_argument("names", nargs="*", help="cases to run (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--jobs", type=int, default=1, metavar="N",
        help="cases run at once (default 1: more only for a smoke test, since cases that "
        "share the machine's cores measure each other)",
    )  # fmt: skip
    args = p.parse_args()
    try:
        cases = named(args.names)
    except ValueError as e:
        p.error(str(e))
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.list:
        for case in cases:
            print(f"{case.name:24} {case.what}")
        return 0
    failed = []
    running: list[tuple[str, subprocess.Popen[bytes], float]] = []
    waiting = list(cases)
    env = {**os.environ, QUICK_ENV: "1"} if args.quick else None
    try:
        while waiting or running:
            while waiting and len(running) < args.jobs:
                case = waiting.pop(0)
                cmd = [sys.executable, str(ROOT / "bench" / f"{case.name}.py"),
                       *(case.quick if args.quick else case.full)]  # fmt: skip
                process = subprocess.Popen(cmd, cwd=ROOT, env=env)
                running.append((case.name, process, time.monotonic()))
            done = _first_done(running)
            running.remove(done)
            name, process, start = done
            outcome = "ok" if process.returncode == 0 else f"FAILED ({process.returncode})"
            log(f"{name}: {outcome} in {time.monotonic() - start:.0f} s")
            if process.returncode != 0:
                failed.append(name)
    finally:  # (interrupted: no case left running)
        for _, process, _ in running:
            process.kill()
            process.wait()
    summary = f"{len(cases) - len(failed)} of {len(cases)} cases ok"
    log(summary + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def _first_done(
    running: list[tuple[str, subprocess.Popen[bytes], float]],
) -> tuple[str, subprocess.Popen[bytes], float]:
    """The first of `running` to end (polled: cases last seconds)."""
    while True:
        for entry in running:
            if entry[1].poll() is not None:
                return entry
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
