"""Capacity planning from measured figures: how many shards, how much memory
each, how much network per training step and how long a save takes, for a
table of a given size (`tf-dlt plan`; `tf-dlt k8s` sizes shards the same
way).

The figures come from tf_dlt/tools/data/capacity.json, written by
`python bench/bench_scale.py --write-capacity` (100 million rows of dim 10 in
2 shard processes on the machine docs/benchmarks.md describes): bytes per
row over the raw record, rows/s per shard for pulls and pushes, save and
load bytes/s per shard.

    tf-dlt plan --rows 1e11 --dim 10 --optimizer adagrad --trainers 100 --batch 4096
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import IO, Any

DATA = Path(__file__).parent / "data" / "capacity.json"
SLOTS = {"sgd": 0, "adagrad": 1, "keras_adagrad": 1, "adam": 2, "ftrl": 2}
HEADER_BYTES = 16  # id and update count


@cache
def figures() -> dict[str, Any]:
    """The measured figures (tf_dlt/tools/data/capacity.json)."""
    data: dict[str, Any] = json.loads(DATA.read_text())
    return data


def raw_record_bytes(dim: int, optimizer: str) -> int:
    """Header, values and optimizer slots of one row."""
    if optimizer not in SLOTS:
        raise ValueError(f"optimizer must be one of {sorted(SLOTS)}, got {optimizer!r}")
    return HEADER_BYTES + 4 * dim * (1 + SLOTS[optimizer])


def overhead() -> float:
    """Measured table bytes per row over the raw record (index, arena)."""
    f = figures()
    return float(f["table_bytes_per_row"]) / float(f["raw_record_bytes"])


def bytes_per_row(dim: int, optimizer: str) -> float:
    """Memory one row takes on a shard, from the measured overhead."""
    return raw_record_bytes(dim, optimizer) * overhead()


@dataclass(frozen=True)
class Plan:
    shards: int
    memory_shards: int
    throughput_shards: int
    bytes_per_row: float
    table_bytes: float
    memory_per_shard_bytes: float
    ids_per_step: int
    pull_bytes_per_step: float
    push_bytes_per_step: float
    save_seconds: float
    load_seconds: float
    checkpoint_bytes: float


def plan(
    rows: float,
    dim: int,
    optimizer: str,
    trainers: int,
    batch: int,
    *,
    shard_memory_gib: float = 64.0,
    headroom: float = 1.5,
    steps_per_second: float = 10.0,
    unique_fraction: float = 1.0,
) -> Plan:
    """Shards needed for memory (rows x bytes/row x headroom per shard of
    `shard_memory_gib`) and for throughput (every trainer pulling and
    pushing `batch` x `unique_fraction` rows `steps_per_second` times a
    second, at the measured rows/s per shard), whichever is larger."""
    if rows <= 0 or dim < 1 or trainers < 1 or batch < 1:
        raise ValueError("rows, dim, trainers and batch must be positive")
    f = figures()
    per_row = bytes_per_row(dim, optimizer)
    table = rows * per_row
    memory_shards = math.ceil(table * headroom / (shard_memory_gib * 2**30))
    ids = math.ceil(trainers * batch * unique_fraction)
    # Per-shard rows/s were measured at dim f["dim"]: scale by payload size.
    payload = 8 + 4 * dim
    measured_payload = 8 + 4 * int(f["dim"])
    pull_rate = float(f["pull_rows_per_s_per_shard"]) * measured_payload / payload
    push_rate = float(f["push_rows_per_s_per_shard"]) * measured_payload / payload
    seconds_per_step = ids / pull_rate + ids / push_rate
    throughput_shards = math.ceil(seconds_per_step * steps_per_second)
    shards = max(1, memory_shards, throughput_shards)
    checkpoint = (
        rows
        * float(f["checkpoint_bytes_per_row"])
        * (raw_record_bytes(dim, optimizer) / float(f["raw_record_bytes"]))
    )
    return Plan(
        shards=shards,
        memory_shards=memory_shards,
        throughput_shards=throughput_shards,
        bytes_per_row=per_row,
        table_bytes=table,
        memory_per_shard_bytes=table / shards * headroom,
        ids_per_step=ids,
        pull_bytes_per_step=ids * payload,
        push_bytes_per_step=ids * payload,
        save_seconds=checkpoint / (float(f["save_bytes_per_s_per_shard"]) * shards),
        load_seconds=checkpoint / (float(f["load_bytes_per_s_per_shard"]) * shards),
        checkpoint_bytes=checkpoint,
    )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} EB"


def report(p: Plan, args: argparse.Namespace) -> str:
    f = figures()
    per_second = (p.pull_bytes_per_step + p.push_bytes_per_step) * args.steps_per_second
    return "\n".join([
        f"table: {args.rows:.3g} rows x dim {args.dim}, {args.optimizer}: "
        f"{p.bytes_per_row:.0f} B/row -> {_size(p.table_bytes)}",
        f"shards: {p.shards} (memory needs {p.memory_shards} at {args.shard_memory_gib:g} GiB "
        f"each with x{args.headroom:g} headroom; throughput needs {p.throughput_shards} for "
        f"{args.steps_per_second:g} steps/s)",
        f"memory per shard: {p.memory_per_shard_bytes / 2**30:.1f} GiB "
        f"(its share of the table x{args.headroom:g} headroom)",
        f"network per step (all {args.trainers} trainers, {p.ids_per_step:,} ids): pull "
        f"{_size(p.pull_bytes_per_step)}, push {_size(p.push_bytes_per_step)}; at "
        f"{args.steps_per_second:g} steps/s: {_size(per_second)}/s, "
        f"{_size(per_second / p.shards)}/s per shard",
        f"checkpoint: {_size(p.checkpoint_bytes)}; save {p.save_seconds:.0f} s, load "
        f"{p.load_seconds:.0f} s (all shards in parallel)",
        "",
        "assumptions:",
        f"- bytes/row = (16 B header + 4 x dim x (1 + optimizer slots)) x {overhead():.3f}, the "
        f"table overhead measured at {int(f['rows']):,} rows of dim {f['dim']} ({f['optimizer']});",
        f"- per shard: pull {float(f['pull_rows_per_s_per_shard']):,.0f} rows/s, push "
        f"{float(f['push_rows_per_s_per_shard']):,.0f} rows/s at dim {f['dim']} (scaled by payload "
        f"bytes for other dims), save {_size(float(f['save_bytes_per_s_per_shard']))}/s, load "
        f"{_size(float(f['load_bytes_per_s_per_shard']))}/s, measured {f['measured']} on "
        f"{f['machine']} (`{f['command']}`), 2 shards sharing 2 vCPUs (about a core each): "
        "a shard with more cores serves more;",
        f"- every trainer step pulls and pushes batch x {args.unique_fraction:g} distinct ids "
        "(8 B id + 4 x dim B row each way); frames and headers are not counted;",
        "- shards save and load in parallel, each to its own file; storage bandwidth beyond "
        "the measured local disk is not modelled.",
    ])  # fmt: skip


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    a("--rows", type=float, required=True, help="rows over all tables, e.g. 1e11")
    a("--dim", type=int, required=True)
    a("--optimizer", default="adagrad", choices=sorted(SLOTS))
    a("--trainers", type=int, default=1)
    a("--batch", type=int, default=4096, help="ids one trainer looks up per step")
    a("--unique-fraction", type=float, default=1.0, help="distinct ids / ids in a batch")
    a("--steps-per-second", type=float, default=10.0, help="per trainer")
    a("--shard-memory-gib", type=float, default=64.0, help="memory of one shard's host")
    a("--headroom", type=float, default=1.5, help="memory over the table estimate")
    a("--json", action="store_true", help="print the plan as JSON")
    return parser


def run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    try:
        p = plan(
            args.rows, args.dim, args.optimizer, args.trainers, args.batch,
            shard_memory_gib=args.shard_memory_gib, headroom=args.headroom,
            steps_per_second=args.steps_per_second, unique_fraction=args.unique_fraction,
        )  # fmt: skip
    except ValueError as e:
        print(f"tf-dlt plan: {e}", file=sys.stderr)
        return 2
    out.write((json.dumps(p.__dict__, indent=2) if args.json else report(p, args)) + "\n")
    return 0
