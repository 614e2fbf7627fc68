"""Runs benchmarks from bench/cases.py, each a process of its own, from the
repository root: ``python bench [--quick] [--jobs N] [--timeout S] [--list]
[NAME ...]`` (all when no name is given; one at a time unless --jobs says
more). Each case prints its JSON lines (and appends them to
bench/out/results.jsonl, or with --quick to bench/out/results-quick.jsonl,
which bench/plot.py never reads); this prints a line per case and exits
non-zero if any failed. A case that runs past --timeout is stopped with
every process it started, and counts as failed."""

from __future__ import annotations

import argparse
import os
import signal
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
    p.add_argument(
        "--timeout", type=float, metavar="S",
        help="seconds a case may run before it is stopped and counted failed (default: 600 "
        "with --quick, none otherwise)",
    )  # fmt: skip
    args = p.parse_args()
    timeout = args.timeout if args.timeout is not None else (600.0 if args.quick else None)
    if timeout is not None and timeout <= 0:
        p.error("--timeout must be positive")
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
                # A session of its own: a case stopped goes with its shards.
                process = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
                running.append((case.name, process, time.monotonic()))
            done, timed_out = _first_done(running, timeout)
            running.remove(done)
            name, process, start = done
            outcome = "ok" if process.returncode == 0 else f"FAILED ({process.returncode})"
            if timed_out:
                outcome = (
                    f"FAILED (stopped past --timeout {timeout:.0f} s, with every process of "
                    f"session {process.pid})"
                )
            log(f"{name}: {outcome} in {time.monotonic() - start:.0f} s")
            if process.returncode != 0:
                failed.append(name)
    finally:  # (interrupted: no case left running)
        for _, process, _ in running:
            _stop(process)
    summary = f"{len(cases) - len(failed)} of {len(cases)} cases ok"
    log(summary + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def _first_done(
    running: list[tuple[str, subprocess.Popen[bytes], float]], timeout: float | None
) -> tuple[tuple[str, subprocess.Popen[bytes], float], bool]:
    """The first of `running` to end (polled: cases last seconds), or to run
    past `timeout` (stopped); and whether it ran past it."""
    while True:
        for entry in running:
            if entry[1].poll() is not None:
                return entry, False
            if timeout is not None and time.monotonic() - entry[2] > timeout:
                _stop(entry[1])
                return entry, True
        time.sleep(0.2)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Kills a case and every process of its session (its shards)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # gone with them already
        pass
    process.wait()


if __name__ == "__main__":
    sys.exit(main())
