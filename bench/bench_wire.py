"""The trainer's data path without TensorFlow: S shard processes with T
worker threads each and C client processes pulling (or pushing) through the
native client, against a local gather of the same rows and one loopback TCP
stream of the same bytes, measured in the same run (bench/wire_bench.cc).

Reports, per configuration, the wall time per call and the CPU per call of
the clients and of the shards (from /proc), and the ratios the trainer-speed
targets use: client CPU / local gather CPU, shard CPU per pulled row / local
gather CPU per row, and the gather's and the stream's wall time / the
pull's. Needs only a C++17 compiler and Python's standard library: no
TensorFlow, no tf_dlt install (`--build-only` writes a static binary to
copy to a machine with cores to spare; `--binary` runs one built before).

Usage: python bench/bench_wire.py [--shards 2] [--threads 1,2,4] [--clients 1]
       [--ids 65536] [--dim 64] [--calls 30] [--op pull|push] [--rows 1000000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import OUT, emit

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "setup.py"


def core_sources() -> list[str]:
    """The native core's sources (setup.py's list, without the Python bindings)."""
    text = SETUP.read_text()
    block = text[text.index("NATIVE_CORE_SOURCES = [") :]
    block = block[: block.index("]")]
    return [s for s in re.findall(r'"(native/[^"]+\.cc)"', block) if "/python/" not in s]


def built() -> Path:
    """bench/out/wire_bench-<digest of its sources>, built unless it is there."""
    digest = hashlib.sha256()
    sources = [ROOT / "bench/wire_bench.cc", *[ROOT / s for s in core_sources()]]
    for path in sorted({*sources, *(ROOT / "native").rglob("*.h")}):
        digest.update(path.read_bytes())
    out = OUT / f"wire_bench-{digest.hexdigest()[:16]}"
    return out if out.exists() else build(out)


def build(out: Path, static: bool = True) -> Path:
    """Compiles bench/wire_bench.cc with the native core into `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-pthread", f"-I{ROOT}",
        str(ROOT / "bench/wire_bench.cc"), *[str(ROOT / s) for s in core_sources()],
        "-o", str(out),
    ]  # fmt: skip
    if static:
        cmd.append("-static")
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")  # builds may run at once
    cmd[cmd.index(str(out))] = str(partial)
    subprocess.run(cmd, check=True, timeout=1800)
    partial.rename(out)
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_json(cmd: list[str]) -> dict[str, float]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[1]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(binary: Path, args: argparse.Namespace, threads: int) -> dict[str, object]:
    shards = []
    try:
        for i in range(args.shards):
            proc = subprocess.Popen(
                [str(binary), "shard", str(i), str(args.shards), str(threads), str(args.dim),
                 str(args.rows)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            shards.append(proc)
        ports = []
        for proc in shards:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("port "):
                raise RuntimeError(f"a shard did not start: {line!r}")
            ports.append(int(line.split()[1]))
        addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
        before = [cpu_seconds(p.pid) for p in shards]
        start = time.perf_counter()
        clients = [
            subprocess.Popen(
                [
                    str(binary),
                    "client",
                    addresses,
                    str(args.dim),
                    str(args.ids),
                    str(args.calls),
                    args.op,
                    str(args.rows),
                    str(c + 1),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for c in range(args.clients)
        ]
        results = []
        for proc in clients:
            out, _ = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError("a client failed")
            results.append(json.loads(out.strip().splitlines()[-1]))
        wall = time.perf_counter() - start
        shard_cpu = sum(cpu_seconds(p.pid) for p in shards) - sum(before)
    finally:
        for proc in shards:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
    calls = args.calls * args.clients
    warm_up = 3 * args.clients  # each client's first calls (wire_bench.cc), on the shards too
    return {
        "wall_ms_per_call": sum(r["wall_ms_per_call"] for r in results) / len(results),
        "client_cpu_ms_per_call": sum(r["cpu_ms_per_call"] for r in results) / len(results),
        "shard_cpu_ms_per_call": shard_cpu * 1e3 / (calls + warm_up),
        "rows_per_s": calls * args.ids / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--threads", default="1,2", help="shard worker threads, a list")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--ids", type=int, default=65536)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--op", choices=["pull", "push"], default="pull")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--binary", help="a wire_bench built before (default: build one)")
    p.add_argument("--build-only", metavar="PATH", help="build a static binary to PATH and stop")
    args = p.parse_args()
    if args.build_only:
        print(build(Path(args.build_only)))
        return
    binary = Path(args.binary) if args.binary else built()
    gather = run_json([str(binary), "gather", str(args.dim), str(args.ids),
                       str(args.calls), str(args.rows)])  # fmt: skip
    stream = run_json([str(binary), "stream", str(args.ids * args.dim * 4), str(args.calls)])
    for threads in [int(t) for t in args.threads.split(",")]:
        got = measure(binary, args, threads)
        per_row_gather = gather["cpu_ms_per_call"] / args.ids
        record = {
            "bench": "wire", "op": args.op, "shards": args.shards, "threads": threads,
            "clients": args.clients, "ids": args.ids, "dim": args.dim, "cores": os.cpu_count(),
            **got,
            "gather_wall_ms": gather["wall_ms_per_call"],
            "gather_cpu_ms": gather["cpu_ms_per_call"],
            "stream_wall_ms": stream["wall_ms_per_call"],
            "stream_cpu_ms": stream["cpu_ms_per_call"],
            "client_cpu_vs_gather": got["client_cpu_ms_per_call"] / gather["cpu_ms_per_call"],
            "shard_cpu_per_row_vs_gather": got["shard_cpu_ms_per_call"] / args.ids
            / per_row_gather,
            "gather_wall_vs_call": gather["wall_ms_per_call"] / got["wall_ms_per_call"],
            "stream_wall_vs_call": stream["wall_ms_per_call"] / got["wall_ms_per_call"],
        }  # fmt: skip
        emit(record)


if __name__ == "__main__":
    sys.exit(main())
