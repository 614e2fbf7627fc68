"""Capacity planning from measured figures: how many shards, how much memory
each, how much network per training step and how long a save takes, for a
table of a given size (`tf-dlt plan`; `tf-dlt k8s` sizes shards the same
way).

The figures come from tf_dlt/tools/data/capacity.json, written by
`python bench/bench_scale.py --write-capacity` (100 million rows of dim 10 in
2 shard processes on the machine docs/benchmarks.md describes): bytes per
row over the raw record, save and load bytes/s per shard; and by
`python3 bench/bench_wire.py --write-capacity` (one shard with 8 worker
threads serving 8 trainer processes on a machine with cores for all of
them): pull and push rows/s per shard core, which sizes shards for
throughput. With a disk tier, the SSD's random reads/s (`--ssd-reads-per-second`,
by default the figure `python bench/bench_tier_scale.py --load-fractions`
measured, in the file's "tier" entry) bound the steps/s a shard serves: each
pull of a row not in RAM reads the device once.

    tf-dlt plan --rows 1e11 --dim 10 --optimizer adagrad --trainers 100 --batch 4096
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import IO, Any

from tf_dlt import _native, sizes
from tf_dlt.checkpoint import shard_files
from tf_dlt.table_config import TableConfig

DATA = Path(__file__).parent / "data" / "capacity.json"
# The core's record layout (native/core/table.h): optimizer slots per value,
# bytes per stored value, a record's header (update count and last-touched
# stamp) and, beside each record, the generation of its last write (delta
# checkpoints' change tracking).
SLOTS = _native.OPTIMIZER_SLOTS
DTYPE_BYTES = _native.DTYPE_BYTES
GENERATION_BYTES = _native.GENERATION_BYTES
# The disk tier (docs/tiered_storage.md): tier files double when 3/4 full,
# so slots are 3/8 to 3/4 used: the plan takes the mean, 9/16.
TIER_MEAN_FILL = 9 / 16
# The keeper holds RAM rows under this fraction of --memory-budget.
BUDGET_FRACTION = _native.MEMORY_TARGET_FRACTION
# What a shard process holds before any table (67-80 MiB measured at
# start; the shard measures its own): with a save's buffers and the least
# room for rows, about the smallest budget a shard takes (it refuses less
# at start; docs/tiered_storage.md).
PROCESS_BYTES = 72 << 20
LEAST_BUDGET = (PROCESS_BYTES + _native.PERSIST_RESERVE_BYTES + _native.MIN_ROW_ROOM_BYTES) / (
    _native.MEMORY_TARGET_FRACTION
)


def row_room(budget: float) -> float:
    """The bytes a shard under `budget` lets its rows (and tier entries)
    take: the keeper's fraction of it, less a save's buffers and what the
    process holds (the plan divided tables by the whole budget: a 300 MiB
    shard planned for 184 MiB of rows kept 70 and evicted the rest)."""
    return max(0.0, budget * BUDGET_FRACTION - _native.PERSIST_RESERVE_BYTES - PROCESS_BYTES)


def tier_slot_bytes(record: int) -> tuple[float, float]:
    """RAM and disk bytes per disk tier slot for records of `record` bytes:
    its page's fingerprints (16 bits a slot), ghost bits (1 a slot) and
    count of used slots, and its page's bytes (each slot its record, the
    8-byte id, a 16-bit generation and 2 bytes of padding; the page rounded
    to 4 KiB), over the page's slots (`native/core/disk_tier.h`)."""
    page_bytes, slots, page_ram = _native.tier_page(record)
    return page_ram / slots, page_bytes / slots


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
    config = TableConfig.create(
        "plan", dim, optimizer=optimizer, value_dtype=value_dtype, slot_dtype=slot_dtype
    )
    return _native.record_bytes(config.to_dict())


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


def checkpoint_bytes_per_row(
    dim: int, optimizer: str, value_dtype: str = "float32", slot_dtype: str = "float32"
) -> float:
    """Bytes one row takes in a checkpoint (values and slots in their dtypes,
    id, count and stamp), scaled from the measured float32 figure."""
    f = figures()
    f_dim = int(f["dim"])
    measured = shard_files.file_row_bytes(f_dim, f_dim * SLOTS[str(f["optimizer"])])
    mine = shard_files.file_row_bytes(dim, dim * SLOTS[optimizer], value_dtype, slot_dtype)
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


def zipf_hit_rate(rows: float, hot: float, skew: float) -> float:
    """Fraction of Zipf(`skew`) accesses over `rows` ids that fall on the
    `hot` most frequent ones (generalized harmonic numbers, by the integral
    with the first terms summed)."""
    if hot >= rows:
        return 1.0
    if hot <= 0:
        return 0.0

    def harmonic(n: float) -> float:
        head = min(n, 1000.0)
        total = float(sum(float(k) ** -skew for k in range(1, int(head) + 1)))
        if n <= head:
            return total
        if abs(skew - 1.0) < 1e-9:
            return total + math.log(n / head)
        return total + float(n ** (1 - skew) - head ** (1 - skew)) / (1 - skew)

    return harmonic(hot) / harmonic(rows)


@dataclass(frozen=True)
class Tiers:
    """Where each shard's rows live with a memory budget and a disk tier."""

    ram_rows_per_shard: float
    disk_rows_per_shard: float
    cold_ram_bytes_per_row: float
    disk_bytes_per_row: float
    disk_bytes_per_shard: float
    hit_rate: float  # pulls served from RAM under the traffic's skew
    # Device reads a second per shard at the planned steps/s (one per pulled
    # row not in RAM, once the hot rows are in RAM), and the SSD's reads/s.
    disk_reads_per_second: float = 0.0
    ssd_reads_per_second: float = 0.0


def tier_plan(
    rows_per_shard: float, per_row: float, record: int, budget: float, skew: float,
    rows_per_second: float = 0.0, ssd_reads_per_second: float = 0.0,
) -> Tiers:  # fmt: skip
    """RAM rows (the hottest) and disk rows of a shard of `rows_per_shard`
    rows under a `budget` of bytes, the RAM hit rate under Zipf(skew) (ids
    hash evenly over shards, so each shard sees the same skew), and the
    device reads a second of a shard pulling `rows_per_second` rows."""
    ram_slot, disk_slot = tier_slot_bytes(record)
    cold_ram = ram_slot / TIER_MEAN_FILL
    disk_row = disk_slot / TIER_MEAN_FILL
    room = row_room(budget) - rows_per_shard * cold_ram
    ram_rows = min(rows_per_shard, max(0.0, room / (per_row - cold_ram)))
    disk_rows = rows_per_shard - ram_rows
    hit_rate = zipf_hit_rate(rows_per_shard, ram_rows, skew)
    return Tiers(
        ram_rows_per_shard=ram_rows,
        disk_rows_per_shard=disk_rows,
        cold_ram_bytes_per_row=cold_ram,
        disk_bytes_per_row=disk_row,
        disk_bytes_per_shard=disk_rows * disk_row,
        hit_rate=hit_rate,
        disk_reads_per_second=rows_per_second * (1.0 - hit_rate),
        ssd_reads_per_second=ssd_reads_per_second,
    )


def tier_figures() -> dict[str, Any]:
    """The tier's measured figures (the "tier" entry of capacity.json)."""
    tier: dict[str, Any] = figures()["tier"]
    return tier


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
    tiers: Tiers | None = None
    # With a disk tier: the shards whose SSDs serve the cold reads.
    disk_read_shards: int = 0


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
    memory_budget: float = 0.0,
    ssd_bytes: float = 0.0,
    skew: float = 1.05,
    shard_cores: float = 4.0,
    ssd_reads_per_second: float = 0.0,
) -> Plan:
    """Shards needed for memory (rows x `admission_rate` resident rows x
    bytes/row, plus the admission sketch, x headroom per shard of
    `shard_memory_gib`) and for throughput (every trainer pulling and
    pushing `batch` x `unique_fraction` rows `steps_per_second` times a
    second, at the measured rows/s per core times `shard_cores`), whichever
    is larger. `rows` counts the distinct ids the tables see;
    `admission_rate` the fraction that get a row (1 without admission;
    measure it with bench_admission).

    With a disk tier (`ssd_bytes` per shard, and `memory_budget` bytes per
    shard), a shard's RAM holds only its hottest rows and a 7 B entry per
    cold row: the shards needed are those whose budgets hold the cold
    entries (plus some hot rows) and whose SSDs hold the cold rows, and
    enough that each SSD serves its shard's reads of rows not in RAM
    (`ssd_reads_per_second` random reads a second per shard; 0: the
    measured figure): more shards hold more of the hot rows in RAM."""
    figures_given = (rows, shard_memory_gib, headroom, steps_per_second, unique_fraction,
                     sketch_bytes, memory_budget, ssd_bytes, skew, shard_cores,
                     ssd_reads_per_second)  # fmt: skip
    if not all(math.isfinite(x) for x in figures_given):
        raise ValueError("every figure must be a finite number (not nan or inf)")
    if rows <= 0 or dim < 1 or trainers < 1 or batch < 1 or shard_cores <= 0:
        raise ValueError("rows, dim, trainers, batch and shard_cores must be positive")
    if (shard_memory_gib <= 0 and not memory_budget) or headroom < 1 or steps_per_second < 0:
        raise ValueError(
            "shard_memory_gib must be > 0 (without a memory budget), steps_per_second >= 0 "
            "(0: memory alone), and headroom >= 1 (1: none)"
        )
    if not 0 < unique_fraction <= 1:
        raise ValueError("unique_fraction must be in (0, 1]")
    if memory_budget < 0 or ssd_bytes < 0 or skew <= 0 or ssd_reads_per_second < 0:
        raise ValueError(
            "memory_budget, ssd_bytes and ssd_reads_per_second must be >= 0 and skew > 0"
        )
    if ssd_bytes and not memory_budget:
        raise ValueError("an SSD size needs a memory budget: rows move to disk past it")
    if memory_budget and memory_budget < LEAST_BUDGET:
        raise ValueError(
            f"a memory budget of {memory_budget / 2**20:.3g} MiB is below the smallest a shard "
            f"takes, about {LEAST_BUDGET / 2**20:.0f} MiB (what the process holds, a save's "
            "buffers and room for rows): shards would refuse it at start"
        )
    if not 0 < admission_rate <= 1 or sketch_bytes < 0:
        raise ValueError("admission_rate must be in (0, 1] and sketch_bytes >= 0")
    f = figures()
    per_row = bytes_per_row(dim, optimizer, value_dtype, slot_dtype)
    resident = rows * admission_rate
    table = table_bytes(rows, dim, optimizer, value_dtype, slot_dtype, admission_rate, sketch_bytes)
    if not math.isfinite(table * headroom):  # finite figures, a product past floats
        raise ValueError(
            f"{rows:g} rows of dim {dim} (with a sketch of {sketch_bytes:g} bytes) need more "
            "memory than any cluster has: check rows and sketch_bytes"
        )
    shard_memory = row_room(memory_budget) if memory_budget else shard_memory_gib * 2**30
    memory_shards = math.ceil(table * headroom / shard_memory)
    record = raw_record_bytes(dim, optimizer, value_dtype, slot_dtype)
    if ssd_bytes:
        # The fewest shards whose budgets keep a tenth for hot rows after
        # the cold entries, and whose SSDs hold the rest.
        ram_slot, disk_slot = tier_slot_bytes(record)
        by_index = resident * ram_slot / TIER_MEAN_FILL / (row_room(memory_budget) * 0.9)
        by_disk = resident * disk_slot / TIER_MEAN_FILL / ssd_bytes
        memory_shards = max(1, math.ceil(max(by_index, by_disk)))
    ids = math.ceil(trainers * batch * unique_fraction)
    # Rows/s per shard core were measured at dim per_core["dim"]: scaled by
    # payload size, and by the shard's cores.
    core = f["per_core"]
    payload = 8 + 4 * dim
    measured_payload = 8 + 4 * int(core["dim"])
    pull_rate = float(core["pull_rows_per_s"]) * shard_cores * measured_payload / payload
    push_rate = float(core["push_rows_per_s"]) * shard_cores * measured_payload / payload
    seconds_per_step = ids / pull_rate + ids / push_rate
    throughput_shards = math.ceil(seconds_per_step * steps_per_second)
    shards = max(1, memory_shards, throughput_shards)
    checkpoint = resident * checkpoint_bytes_per_row(dim, optimizer, value_dtype, slot_dtype)
    load_rate = float(f["load_bytes_per_s_per_shard"])
    tiers, disk_read_shards = None, 0
    if ssd_bytes:
        reads = ssd_reads_per_second or float(tier_figures()["device_reads_per_s"])
        rows_per_second = ids * steps_per_second

        def tier_at(n: int) -> Tiers:
            return tier_plan(resident / n, per_row, record, memory_budget, skew,
                             rows_per_second / n, reads)  # fmt: skip

        def keeps_up(n: int) -> bool:
            return tier_at(n).disk_reads_per_second <= reads

        # The fewest shards whose SSDs keep up: more shards each pull fewer
        # rows and, in the same budget, hold more of the hot ones, so the
        # reads per SSD fall as shards rise (doubled, then bisected).
        low, high = 0, 1
        while not keeps_up(high):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if keeps_up(middle) else (middle, high)
        disk_read_shards = high
        shards = max(shards, disk_read_shards)
        tiers = tier_at(shards)
        load_rate = min(load_rate, float(tier_figures()["restore_bytes_per_s"]))
    return Plan(
        resident_rows=resident,
        shards=shards,
        memory_shards=memory_shards,
        throughput_shards=throughput_shards,
        bytes_per_row=per_row,
        table_bytes=table,
        memory_per_shard_bytes=memory_budget if ssd_bytes else table / shards * headroom,
        ids_per_step=ids,
        pull_bytes_per_step=ids * payload,
        push_bytes_per_step=ids * payload,
        save_seconds=checkpoint / (float(f["save_bytes_per_s_per_shard"]) * shards),
        load_seconds=checkpoint / (load_rate * shards),
        checkpoint_bytes=checkpoint,
        tiers=tiers,
        disk_read_shards=disk_read_shards,
    )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} EB"


def report(p: Plan, args: argparse.Namespace) -> str:
    f = figures()
    core = f["per_core"]
    per_second = (p.pull_bytes_per_step + p.push_bytes_per_step) * args.steps_per_second
    admitted = (
        f" of which {p.resident_rows:.3g} admitted ({args.admission_rate:g})"
        if args.admission_rate < 1
        else ""
    )
    sketch = f" + {_size(args.sketch_bytes)} sketch" if args.sketch_bytes else ""
    t = p.tiers
    tiers = [] if t is None else [
        f"tiers per shard: RAM {t.ram_rows_per_shard:.3g} hot rows + "
        f"{t.cold_ram_bytes_per_row:.1f} B per cold row "
        f"({args.memory_budget / 2**30:.3g} GiB budget, "
        f"{row_room(args.memory_budget) / 2**30:.3g} GiB of it for the tables: "
        f"{BUDGET_FRACTION:g} of it less a save's buffers and the process); disk "
        f"{t.disk_rows_per_shard:.3g} rows x "
        f"{t.disk_bytes_per_row:.0f} B = {_size(t.disk_bytes_per_shard)} of "
        f"{_size(args.ssd)} SSD",
        f"expected RAM hit rate under Zipf({args.skew:g}) traffic: {100 * t.hit_rate:.1f}% "
        f"(the rest reads the disk tier once, then serves from RAM)",
        f"device reads per shard at {args.steps_per_second:g} steps/s: "
        f"{t.disk_reads_per_second:,.0f}/s of the SSD's {t.ssd_reads_per_second:,.0f}/s "
        f"(one random read per pulled row not in RAM; {p.disk_read_shards} shards keep up)",
    ]  # fmt: skip
    m = tier_figures()
    tier_assumption = [] if t is None else [
        f"- a tiered shard restores at {_size(float(m['restore_bytes_per_s']))}/s of checkpoint "
        f"and its SSD serves {float(m['device_reads_per_s']):,.0f} random reads/s unless "
        f"--ssd-reads-per-second says otherwise, measured {m['measured']} on {m['machine']} "
        f"(`{m['command']}`);",
    ]  # fmt: skip
    return "\n".join([
        f"table: {args.rows:.3g} ids{admitted} x dim {args.dim}, {args.optimizer}, "
        f"{args.value_dtype} values, {args.slot_dtype} slots: "
        f"{p.bytes_per_row:.0f} B/row{sketch} -> {_size(p.table_bytes)}",
        f"shards: {p.shards} (memory needs {p.memory_shards} "
        + (
            f"with a {args.memory_budget / 2**30:.3g} GiB budget and {_size(args.ssd)} SSD each"
            if t
            else f"at {(args.memory_budget or args.shard_memory_gib * 2**30) / 2**30:g} GiB "
            f"each with x{args.headroom:g} headroom"
        )
        + f"; throughput needs {p.throughput_shards} for {args.steps_per_second:g} steps/s"
        + (f"; the SSDs' reads need {p.disk_read_shards}" if t else "")
        + ")",
        f"memory per shard: {p.memory_per_shard_bytes / 2**30:.1f} GiB "
        + ("(its memory budget)" if t else f"(its share of the table x{args.headroom:g} headroom)"),
        *tiers,
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
        "(spread over the shards); checkpoints store rows in their own dtype;",
        f"- per shard core ({args.shard_cores:g} per shard): pull "
        f"{float(core['pull_rows_per_s']):,.0f} rows/s, push {float(core['push_rows_per_s']):,.0f} "
        f"rows/s at dim {core['dim']} (scaled by payload bytes for other dims), measured "
        f"{core['measured']} with {core['shard_threads']} worker threads serving "
        f"{core['clients']} trainer processes of {core['ids_per_call']:,} ids on {core['machine']} "
        f"(`{core['command']}`); the measured rows/s grew with threads up to "
        f"{core['shard_threads']}, beyond that it is assumed, not measured;",
        f"- per shard: save {_size(float(f['save_bytes_per_s_per_shard']))}/s, load "
        f"{_size(float(f['load_bytes_per_s_per_shard']))}/s, measured {f['measured']} on "
        f"{f['machine']} (`{f['command']}`);",
        *tier_assumption,
        f"- every trainer step pulls and pushes batch x {args.unique_fraction:g} distinct ids "
        "(8 B id + 4 x dim B row each way); frames and headers are not counted;",
        "- shards save and load in parallel, each to its own file; storage bandwidth beyond "
        "the measured local disk is not modelled.",
    ])  # fmt: skip


def parse_size(text: str) -> int:
    """`sizes.parse_bytes` for argparse (its error as a usage error)."""
    try:
        return sizes.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    a(
        "--memory-budget",
        type=parse_size,
        default=0,
        help="per shard, e.g. 48GiB: the shards' --memory-budget (replaces --shard-memory-gib)",
    )
    a("--ssd", type=parse_size, default=0, help="per shard, e.g. 1.6TB: SSD for the disk tier")
    a("--skew", type=float, default=1.05, help="Zipf exponent of the ids' traffic (hit rate)")
    a(
        "--shard-cores",
        type=float,
        default=4.0,
        help="cores of one shard (its --threads; `tf-dlt k8s --shard-cpu`, 4 by default too)",
    )
    a(
        "--ssd-reads-per-second",
        type=float,
        default=0.0,
        help="random 4 KiB reads/s of one shard's SSD (default: the measured figure)",
    )
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
            memory_budget=args.memory_budget, ssd_bytes=args.ssd, skew=args.skew,
            shard_cores=args.shard_cores, ssd_reads_per_second=args.ssd_reads_per_second,
        )  # fmt: skip
    except ValueError as e:
        print(f"tf-dlt plan: {e}", file=sys.stderr)
        return 2
    out.write((json.dumps(asdict(p), indent=2) if args.json else report(p, args)) + "\n")
    return 0
