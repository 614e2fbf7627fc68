"""The trainer's data path without TensorFlow: S shard processes with T
worker threads each and C client processes pulling (or pushing) through the
native client, against a local baseline (pulls: a gather of the same rows
from an array; pushes: a scatter-add of the same gradients into one) and one
loopback TCP stream of the same bytes, measured in the same run
(bench/wire_bench.cc).

Reports, per configuration, the wall time per call and the CPU per call of
the clients and of the shards (from /proc), and the ratios the trainer-speed
targets use: client CPU / the local baseline's CPU, shard CPU per row / the
baseline's CPU per row, and the baseline's and the stream's wall time / the
call's. Beside them, the shards' CPU against the least a server on TCP can
spend on the same rows: the local baseline plus the stream's sending end
(pulls: the reply's bytes) or receiving end (pushes: the gradients'),
`shard_cpu_vs_local_and_stream`. With --standby, each shard process also holds --standbys standbys
(default 1) kept by a ReplicaGroup, as a serving primary keeps its standbys
(docs/replication.md), and rows/s are compared with no standby in the same
run. Needs only a C++17 compiler and Python's standard library: no
TensorFlow, no tf_dlt install (`--build-only` writes a static binary to copy
to a machine with cores to spare; `--binary` runs one built before).

Usage: python bench/bench_wire.py [--shards 2] [--threads 1,2,4] [--clients 1]
       [--exchange-threads 0,1,2] [--standby none,sync,async] [--standbys N]
       python3 bench/bench_wire.py --write-capacity --threads 8   (on 16+ cores)
       [--ids 65536] [--dim 64] [--calls 30] [--op pull|push] [--rows 1000000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import emit, load_module

ROOT = Path(__file__).resolve().parent.parent
CAPACITY = ROOT / "tf_dlt" / "tools" / "data" / "capacity.json"


native_build = load_module("tests/native_build.py")


def built(static: bool | None = None) -> Path:
    """The wire_bench binary: bench/wire_bench.cc linked with the native core
    users run (tf_dlt/libdlt_core.so, built in place), or, static, with the
    core compiled at setup.py's flags; static by default only where the
    checkout has no built core (a machine without TensorFlow). Built unless
    its objects and binary are cached (tests/native_build.py)."""
    if static is None:
        static = not native_build.CORE_LIBRARY.exists()
    return native_build.build("wire_bench", "optimized", [ROOT / "bench/wire_bench.cc"], static)


def build(out: Path) -> Path:
    """A static wire_bench binary at `out`, to copy to another machine."""
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built(static=True), out)
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_json(cmd: list[str]) -> dict[str, Any]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[1]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(
    binary: Path,
    args: argparse.Namespace,
    threads: int,
    exchange_threads: int,
    standby: str = "none",
) -> dict[str, object]:
    shards = []
    try:
        for i in range(args.shards):
            proc = subprocess.Popen(
                [str(binary), "shard", str(i), str(args.shards), str(threads), str(args.dim),
                 str(args.rows), standby, str(args.standbys)],
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
                    str(exchange_threads),
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


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def write_capacity(binary: Path, args: argparse.Namespace) -> None:
    """Pull and push rows/s per shard core into tf_dlt/tools/data/capacity.json
    (what `tf-dlt plan` sizes shards by): one shard with the last of
    --threads worker threads serving 8 client processes of 4,096 ids, dim 16.
    Meant for a machine with a core for each of them (16 or more)."""
    threads = int(args.threads.split(",")[-1])
    per_core: dict[str, object] = {}
    for op in ("pull", "push"):
        run = argparse.Namespace(**{**vars(args), "shards": 1, "clients": 8, "ids": 4096,
                                    "dim": 16, "op": op})  # fmt: skip
        got = measure(binary, run, threads, 0)
        per_core[f"{op}_rows_per_s"] = float(got["rows_per_s"]) / threads  # type: ignore[arg-type]
        emit({"bench": "wire_capacity", "op": op, "threads": threads, **got})
    cores = os.cpu_count() or 0
    if cores < 2 * threads:
        print(f"warning: {cores} cores for {threads} shard threads and 8 clients: the "
              "per-core figures undercount", file=sys.stderr)  # fmt: skip
    per_core.update({
        "dim": 16, "ids_per_call": 4096, "clients": 8, "shard_threads": threads,
        "machine": f"{cores} cores ({cpu_model()}), loopback",
        "measured": time.strftime("%Y-%m-%d"),
        "command": f"python3 bench/bench_wire.py --write-capacity --threads {threads}",
    })  # fmt: skip
    data = json.loads(CAPACITY.read_text())
    data["per_core"] = per_core
    CAPACITY.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"wrote {CAPACITY}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--threads", default="1,2", help="shard worker threads, a list")
    p.add_argument(
        "--exchange-threads",
        default="0",
        help="the client's exchange threads, a list (0: automatic, one per core up to 16)",
    )
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--ids", type=int, default=65536)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--op", choices=["pull", "push"], default="pull")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument(
        "--standby",
        default="none",
        help="each shard's standby in its process (docs/replication.md), a list of "
        "none, sync, async",
    )
    p.add_argument(
        "--standbys", type=int, default=1,
        help="standbys per shard with --standby sync or async (1-4), all in its process",
    )  # fmt: skip
    p.add_argument("--binary", help="a wire_bench built before (default: build one)")
    p.add_argument("--build-only", metavar="PATH", help="build a static binary to PATH and stop")
    p.add_argument(
        "--write-capacity",
        action="store_true",
        help="measure rows/s per shard core (1 shard, 8 clients) into tf_dlt/tools/data/"
        "capacity.json, the figures `tf-dlt plan` sizes shards by",
    )
    args = p.parse_args()
    if args.build_only:
        print(build(Path(args.build_only)))
        return
    binary = Path(args.binary) if args.binary else built()
    if args.write_capacity:
        write_capacity(binary, args)
        return
    local_mode = "gather" if args.op == "pull" else "scatter"
    local = run_json([str(binary), local_mode, str(args.dim), str(args.ids),
                      str(args.calls), str(args.rows)])  # fmt: skip
    stream = run_json([str(binary), "stream", str(args.ids * args.dim * 4), str(args.calls)])
    baseline: dict[tuple[int, int], float] = {}  # rows/s without a standby, same run
    for threads, exchange, standby in itertools.product(
        [int(t) for t in args.threads.split(",")],
        [int(t) for t in args.exchange_threads.split(",")],
        args.standby.split(","),
    ):
        got = measure(binary, args, threads, exchange, standby)
        if standby == "none":
            baseline[threads, exchange] = float(got["rows_per_s"])  # type: ignore[arg-type]
        per_row_local = local["cpu_ms_per_call"] / args.ids
        end = "send_cpu_ms_per_call" if args.op == "pull" else "receive_cpu_ms_per_call"
        record = {
            "bench": "wire", "op": args.op, "shards": args.shards, "threads": threads,
            "exchange_threads": exchange, "standby": standby,
            "standbys": 0 if standby == "none" else args.standbys,
            "clients": args.clients, "ids": args.ids, "dim": args.dim, "cores": os.cpu_count(),
            **got,
            "local": local["case"],
            "local_wall_ms": local["wall_ms_per_call"],
            "local_cpu_ms": local["cpu_ms_per_call"],
            "stream_wall_ms": stream["wall_ms_per_call"],
            "stream_cpu_ms": stream["cpu_ms_per_call"],
            "client_cpu_vs_local": got["client_cpu_ms_per_call"] / local["cpu_ms_per_call"],
            "shard_cpu_per_row_vs_local": got["shard_cpu_ms_per_call"] / args.ids
            / per_row_local,
            # What any TCP server spends on these rows at least: the local
            # baseline and one stream's sending (pulls) or receiving (pushes).
            "stream_end_cpu_ms": stream[end],
            "shard_cpu_vs_local_and_stream": got["shard_cpu_ms_per_call"]
            / (local["cpu_ms_per_call"] + stream[end]),
            "local_wall_vs_call": local["wall_ms_per_call"] / got["wall_ms_per_call"],
            "stream_wall_vs_call": stream["wall_ms_per_call"] / got["wall_ms_per_call"],
        }  # fmt: skip
        if standby != "none" and (threads, exchange) in baseline:
            record["rows_per_s_vs_no_standby"] = got["rows_per_s"] / baseline[threads, exchange]
        emit(record)


if __name__ == "__main__":
    sys.exit(main())
