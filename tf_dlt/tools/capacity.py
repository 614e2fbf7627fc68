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
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADER_BYTES = 8  # update count and last-touched stamp
# Per row beside its record: the generation of its last write (delta
# checkpoints' change tracking).
GENERATION_BYTES = 2
# A checkpoint row besides its values and slots: id, update count, stamp.
FILE_ROW_BYTES = 16


@cache
def figures() -> dict[str, Any]:
    """The measured figures (tf_dlt/tools/data/capacity.json)."""
    data: dict[str, Any] = json.loads(DATA.read_text())
    return data


def raw_record_bytes(
    dim: int, optimizer: str, value_dtype: str = "float32", slot_dtype: str = "float32"
) -> int:
    """Header, values and optimizer slots of one stored row (8-byte aligned)."""
    if optimizer not in SLOTS:
        raise ValueError(f"optimizer must be one of {sorted(SLOTS)}, got {optimizer!r}")
    for dtype in (value_dtype, slot_dtype):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtypes must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    raw = HEADER_BYTES + dim * (
        DTYPE_BYTES[value_dtype] + DTYPE_BYTES[slot_dtype] * SLOTS[optimizer]
    )
    return -(-raw // 8) * 8


def index_bytes_per_row() -> float:
    """Measured table bytes per row beyond the record and its generation:
    the index (12-byte entries at a load factor of 0.375 to 0.75) and arena
    slack. Figures measured before change tracking have no generation."""
    f = figures()
    measured_generation = float(f.get("generation_bytes", 0))
    return float(f["table_bytes_per_row"]) - float(f["raw_record_bytes"]) - measured_generation


def bytes_per_row(
    dim: int, optimizer: str, value_dtype: str = "float32", slot_dtype: str = "float32"
) -> float:
    """Memory one row takes on a shard: its record, its generation and the
    measured index bytes per row."""
    return (
        raw_record_bytes(dim, optimizer, value_dtype, slot_dtype)
        + GENERATION_BYTES
        + index_bytes_per_row()
    )


def checkpoint_bytes_per_row(dim: int, optimizer: str) -> float:
    """Bytes one row takes in a checkpoint (float32 values and slots, id,
    count and stamp), scaled from the measured figure."""
    f = figures()
    measured = FILE_ROW_BYTES + 4 * int(f["dim"]) * (1 + SLOTS[str(f["optimizer"])])
    mine = FILE_ROW_BYTES + 4 * dim * (1 + SLOTS[optimizer])
    return float(f["checkpoint_bytes_per_row"]) * mine / measured


def table_bytes(
    rows: float,
    dim: int,
    optimizer: str,
    value_dtype: str = "float32",
    slot_dtype: str = "float32",
    admission_rate: float = 1.0,
    sketch_bytes: float = 0.0,
) -> float:
    """Memory of a table that sees `rows` distinct ids, of which
    `admission_rate` get a row, with its admission sketch (all shards)."""
    per_row = bytes_per_row(dim, optimizer, value_dtype, slot_dtype)
    return rows * admission_rate * per_row + sketch_bytes


@dataclass(frozen=True)
class Plan:
    resident_rows: float
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
    value_dtype: str = "float32",
    slot_dtype: str = "float32",
    admission_rate: float = 1.0,
    sketch_bytes: float = 0.0,
) -> Plan:
    """Shards needed for memory (rows x `admission_rate` resident rows x
    bytes/row, plus the admission sketch, x headroom per shard of
    `shard_memory_gib`) and for throughput (every trainer pulling and
    pushing `batch` x `unique_fraction` rows `steps_per_second` times a
    second, at the measured rows/s per shard), whichever is larger. `rows`
    counts the distinct ids the tables see; `admission_rate` the fraction
    that get a row (1 without admission; measure it with bench_admission)."""
    if rows <= 0 or dim < 1 or trainers < 1 or batch < 1:
        raise ValueError("rows, dim, trainers and batch must be positive")
    if not 0 < admission_rate <= 1 or sketch_bytes < 0:
        raise ValueError("admission_rate must be in (0, 1] and sketch_bytes >= 0")
    f = figures()
    per_row = bytes_per_row(dim, optimizer, value_dtype, slot_dtype)
    resident = rows * admission_rate
    table = table_bytes(rows, dim, optimizer, value_dtype, slot_dtype, admission_rate, sketch_bytes)
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
    checkpoint = resident * checkpoint_bytes_per_row(dim, optimizer)
    return Plan(
        resident_rows=resident,
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
    admitted = (
        f" of which {p.resident_rows:.3g} admitted ({args.admission_rate:g})"
        if args.admission_rate < 1
        else ""
    )
    sketch = f" + {_size(args.sketch_bytes)} sketch" if args.sketch_bytes else ""
    return "\n".join([
        f"table: {args.rows:.3g} ids{admitted} x dim {args.dim}, {args.optimizer}, "
        f"{args.value_dtype} values, {args.slot_dtype} slots: "
        f"{p.bytes_per_row:.0f} B/row{sketch} -> {_size(p.table_bytes)}",
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
        f"- bytes/row = 8 B header + dim x (value bytes + slot bytes x optimizer slots), "
        f"rounded to 8, + {GENERATION_BYTES} B change generation (delta checkpoints) "
        f"+ {index_bytes_per_row():.1f} B of index per row, measured at "
        f"{int(f['rows']):,} rows of dim {f['dim']} ({f['optimizer']});",
        "- with admission, only admitted ids hold a row; the sketch is per table "
        "(spread over the shards); checkpoints store float32 rows whatever the dtype;",
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
    a("--value-dtype", default="float32", choices=sorted(DTYPE_BYTES), help="stored values")
    a("--slot-dtype", default="float32", choices=sorted(DTYPE_BYTES), help="stored slots")
    a(
        "--admission-rate",
        type=float,
        default=1.0,
        help="fraction of ids that get a row (admission; 1: every id)",
    )
    a("--sketch-bytes", type=float, default=0.0, help="Frequency admission sketch memory")
    a("--json", action="store_true", help="print the plan as JSON")
    return parser


def run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    try:
        p = plan(
            args.rows, args.dim, args.optimizer, args.trainers, args.batch,
            shard_memory_gib=args.shard_memory_gib, headroom=args.headroom,
            steps_per_second=args.steps_per_second, unique_fraction=args.unique_fraction,
            value_dtype=args.value_dtype, slot_dtype=args.slot_dtype,
            admission_rate=args.admission_rate, sketch_bytes=args.sketch_bytes,
        )  # fmt: skip
    except ValueError as e:
        print(f"tf-dlt plan: {e}", file=sys.stderr)
        return 2
    out.write((json.dumps(p.__dict__, indent=2) if args.json else report(p, args)) + "\n")
    return 0
