"""Where the data path's targets stand on this machine, in one prepared run:
the trainer-speed targets (pull and push against a local gather or
scatter-add and one TCP stream, small pulls, a shard's push rows/s against
its worker threads, aggregate rows/s of several clients) and the cost of a
hot standby, each measured by bench/bench_wire.py and checked against its
target. Cases that need more cores than the machine has are reported as
such, not run. With --against, a second wire_bench build (e.g. the commit
before a change, from `bench_wire.py --build-only`) runs every case too,
interleaved with the first (ABBA by repetition), so an A/B shares the
machine's swings.

Like bench_wire.py it needs only a C++17 compiler (or binaries built
before) and Python's standard library: it is what to run, within a time
budget, on a machine with cores to spare that has no TensorFlow.

Usage: python3 bench/bench_wire_targets.py [--binary B] [--against A] [--reps 3]
       [--seconds 420] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench_wire import built

from common import emit

HERE = Path(__file__).resolve().parent
Record = dict[str, object]


@dataclasses.dataclass(frozen=True)
class Check:
    """One target: a figure of one record (`pick` chooses the record among a
    case's, `value` computes the figure) and its bound."""

    what: str
    value: Callable[[Record], float]
    bound: float
    at_most: bool = False  # the figure must be <= bound (else >= bound)
    pick: Callable[[Record], bool] = lambda r: True


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    checks: tuple[Check, ...] = ()
    min_cores: int = 1
    quick: tuple[str, ...] = ()  # replaces the sizes of args for --quick


def field(name: str) -> Callable[[Record], float]:
    return lambda r: float(r[name])  # type: ignore[arg-type]


def is_standby(mode: str) -> Callable[[Record], bool]:
    return lambda r: r.get("standby") == mode


def cases(cores: int) -> list[Case]:
    """The cases, sized for `cores`: shard worker threads and the client's
    exchange threads as the 16-core figures of docs/benchmarks.md use them
    where cores allow, one of each on smaller machines."""
    many = cores >= 8
    threads = "4" if many else "1"
    exchange = "0" if many else "1"
    tiny = ("--rows", "20000", "--calls", "3", "--ids", "4096", "--dim", "16")
    return [
        Case(
            "pull 65,536 x dim 64, 2 shards",
            ("--threads", threads, "--exchange-threads", exchange, "--calls", "60"),
            (
                Check("client CPU / local gather's", field("client_cpu_vs_local"), 1.2, True),
                Check(
                    "shard CPU per row / gather's", field("shard_cpu_per_row_vs_local"), 1.0, True
                ),  # fmt: skip
            ),
            quick=tiny,
        ),
        Case(
            "pull 65,536 x dim 64, 2 shards x 4 threads (wall)",
            ("--threads", "4", "--exchange-threads", "0", "--calls", "60"),
            (
                Check("local gather / pull", field("local_wall_vs_call"), 0.7),
                Check("one TCP stream / pull", field("stream_wall_vs_call"), 1.0),
            ),
            min_cores=8,
            quick=tiny,
        ),
        Case(
            "push 65,536 x dim 64, 2 shards",
            (
                "--op",
                "push",
                "--threads",
                threads,
                "--exchange-threads",
                exchange,
                "--calls",
                "40",
            ),  # fmt: skip
            (
                Check(
                    "client CPU / local scatter-add's", field("client_cpu_vs_local"), 1.2, True
                ),  # fmt: skip
                Check(
                    "shard CPU per row / scatter-add's",
                    field("shard_cpu_per_row_vs_local"),
                    1.0,
                    True,
                ),  # fmt: skip
            ),
            quick=tiny,
        ),
        Case(
            "pull 4,096 x dim 16, 2 shards x 2 threads",
            ("--ids", "4096", "--dim", "16", "--threads", "2", "--calls", "2000"),
            (
                Check(
                    "pull ms - (2 x TCP stream + 0.05 ms)",
                    lambda r: (
                        float(r["wall_ms_per_call"])  # type: ignore[arg-type]
                        - 2 * float(r["stream_wall_ms"])
                        - 0.05
                    ),  # type: ignore[arg-type]
                    0.0,
                    True,
                ),  # fmt: skip
            ),
            min_cores=8,
            quick=("--rows", "20000", "--calls", "20"),
        ),
        Case(
            "push with a standby, 65,536 x dim 64, 2 shards x 4 threads, 1 exchange thread",
            (
                "--op",
                "push",
                "--threads",
                "4",
                "--exchange-threads",
                "1",
                "--calls",
                "20",
                "--standby",
                "none,sync,async",
            ),  # fmt: skip
            (
                Check(
                    "sync rows/s / none",
                    field("rows_per_s_vs_no_standby"),
                    0.7,
                    pick=is_standby("sync"),
                ),  # fmt: skip
                Check(
                    "async rows/s / none",
                    field("rows_per_s_vs_no_standby"),
                    0.9,
                    pick=is_standby("async"),
                ),  # fmt: skip
            ),
            min_cores=8,
            quick=tiny,
        ),
        Case(
            "push 4,096 x dim 16, 1 shard x 1/2/4/8 threads, 8 clients",
            (
                "--shards",
                "1",
                "--clients",
                "8",
                "--ids",
                "4096",
                "--dim",
                "16",
                "--op",
                "push",
                "--threads",
                "1,2,4,8",
                "--calls",
                "300",
            ),  # fmt: skip
            min_cores=16,
            quick=(*tiny, "--clients", "2", "--threads", "1,2"),
        ),
        *[
            Case(
                f"pull 65,536 x dim 64, {shards} shards x 4 threads, {clients} clients",
                (
                    "--shards",
                    str(shards),
                    "--threads",
                    "4",
                    "--clients",
                    str(clients),
                    "--calls",
                    "40",
                ),  # fmt: skip
                min_cores=16,
                quick=tiny,
            )
            for shards in (2, 4)
            for clients in (1, 2, 4, 8)
        ],
    ]


def with_sizes(args: tuple[str, ...], sizes: tuple[str, ...]) -> list[str]:
    """`args` with each option of `sizes` set to its value there."""
    out = list(args)
    for k in range(0, len(sizes), 2):
        if sizes[k] in out:
            out[out.index(sizes[k]) + 1] = sizes[k + 1]
        else:
            out += [sizes[k], sizes[k + 1]]
    return out


def run_case(binary: Path, args: list[str]) -> list[Record]:
    cmd = [sys.executable, str(HERE / "bench_wire.py"), "--binary", str(binary), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--binary", help="the wire_bench build under test (default: build one)")
    p.add_argument("--against", help="a second wire_bench build, run interleaved with the first")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=420.0,
                   help="start no case after this long")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    builds = {"this": Path(args.binary) if args.binary else built()}
    if args.against:
        builds["against"] = Path(args.against)
    start = time.monotonic()
    results: dict[tuple[str, str], list[Record]] = {}
    skipped: list[str] = []
    for rep in range(args.reps):
        order = list(builds) if rep % 2 == 0 else list(reversed(builds))
        for case in cases(cores):
            if case.min_cores > cores and not args.quick:
                if rep == 0:
                    skipped.append(f"{case.name}: needs {case.min_cores} cores, {cores} here")
                continue
            for label in order:
                if time.monotonic() - start > args.seconds:
                    skipped.append(f"{case.name} ({label}, repetition {rep + 1}): out of time")
                    continue
                sizes = with_sizes(case.args, case.quick) if args.quick else list(case.args)
                for record in run_case(builds[label], sizes):
                    results.setdefault((case.name, label), []).append(record)
    report(cases(cores), builds, results, skipped, cores)


def report(
    all_cases: list[Case],
    builds: dict[str, Path],
    results: dict[tuple[str, str], list[Record]],
    skipped: list[str],
    cores: int,
) -> None:
    """One record per target and build (bench: wire_target) with its
    verdict, then a Markdown table of each target's figures by build."""
    lines = [f"\n{cores} cores; builds: " + ", ".join(f"{k} = {v.name}" for k, v in builds.items()),
             "", "| case | target | " + " | ".join(builds) + " | met |",
             "|---|---|" + "---|" * len(builds) + "---|"]  # fmt: skip
    for case in all_cases:
        for check in case.checks:
            cells, met = [], []
            for label in builds:
                figures = [check.value(r) for r in results.get((case.name, label), [])
                           if check.pick(r)]  # fmt: skip
                cells.append(", ".join(f"{v:.3g}" for v in figures) or "-")
                if not figures:
                    continue
                passed = sum((v <= check.bound) if check.at_most else (v >= check.bound)
                             for v in figures)  # fmt: skip
                met.append(f"{label} {passed}/{len(figures)}")
                emit({"bench": "wire_target", "case": case.name, "target": check.what,
                      "bound": check.bound, "at_most": check.at_most, "build": label,
                      "figures": figures, "median": statistics.median(figures),
                      "runs_met": passed, "cores": cores})  # fmt: skip
            sign = "<=" if check.at_most else ">="
            lines.append(f"| {case.name} | {check.what} {sign} {check.bound:g} | "
                         + " | ".join(cells) + f" | {'; '.join(met) or 'not run'} |")  # fmt: skip
    reported = [c for c in all_cases if not c.checks]
    for case in reported:
        for label in builds:
            rows = [f"{int(r['threads'])} threads: {float(r['rows_per_s']) / 1e6:.1f}M"  # type: ignore[arg-type]
                    for r in results.get((case.name, label), [])]  # fmt: skip
            if rows:
                lines.append(f"- {case.name} ({label}): rows/s " + ", ".join(rows))
    lines += [f"- not run: {line}" for line in skipped]
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
