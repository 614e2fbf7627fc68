"""Runs benchmarks from bench/cases.py, each a process of its own, from the
repository root: ``python bench [--quick] [--list] [NAME ...]`` (all when no
name is given). Each case prints its JSON lines (and appends them to
bench/out/results.jsonl, or with --quick to bench/out/results-quick.jsonl,
which bench/plot.py never reads); this prints a line per case and exits
non-zero if any failed."""

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
    args = p.parse_args()
    try:
        cases = named(args.names)
    except ValueError as e:
        p.error(str(e))
    if args.list:
        for case in cases:
            print(f"{case.name:24} {case.what}")
        return 0
    failed = []
    for case in cases:
        cmd = [sys.executable, str(ROOT / "bench" / f"{case.name}.py"),
               *(case.quick if args.quick else case.full)]  # fmt: skip
        start = time.monotonic()
        env = {**os.environ, QUICK_ENV: "1"} if args.quick else None
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        outcome = "ok" if rc == 0 else f"FAILED ({rc})"
        log(f"{case.name}: {outcome} in {time.monotonic() - start:.0f} s")
        if rc != 0:
            failed.append(case.name)
    summary = f"{len(cases) - len(failed)} of {len(cases)} cases ok"
    log(summary + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
