"""tf-dlt plan: the capacity plan follows from the measured figures in
tf_dlt/tools/data/capacity.json (written by bench/bench_scale.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tf_dlt import _native
from tf_dlt.tools import capacity


def test_figures_are_measured_and_complete() -> None:
    f = capacity.figures()
    assert f["command"] == "python bench/bench_scale.py --write-capacity"
    assert f["rows"] >= 1_000_000 and f["raw_record_bytes"] == capacity.raw_record_bytes(
        f["dim"], f["optimizer"]
    )
    assert 0 < capacity.index_bytes_per_row() < 64
    for key in ("pull_rows_per_s_per_shard", "push_rows_per_s_per_shard",
                "save_bytes_per_s_per_shard", "load_bytes_per_s_per_shard"):  # fmt: skip
        assert f[key] > 0
    # Throughput per shard core, from a machine with a core for every shard
    # thread and client process.
    core = f["per_core"]
    assert core["command"].startswith("python3 bench/bench_wire.py --write-capacity")
    assert core["pull_rows_per_s"] > 0 and core["push_rows_per_s"] > 0
    assert core["shard_threads"] >= 8 and core["clients"] == 8
    assert int(core["machine"].split()[0]) >= 2 * core["shard_threads"]


def test_throughput_shards_follow_the_cores_per_shard() -> None:
    core = capacity.figures()["per_core"]
    p4 = capacity.plan(1e9, 16, "adagrad", 1000, 4096, steps_per_second=10, shard_cores=4)
    p16 = capacity.plan(1e9, 16, "adagrad", 1000, 4096, steps_per_second=10, shard_cores=16)
    ids = 1000 * 4096
    seconds = ids / (core["pull_rows_per_s"] * 4) + ids / (core["push_rows_per_s"] * 4)
    assert p4.throughput_shards == math.ceil(seconds * 10)
    assert p16.throughput_shards == math.ceil(seconds / 4 * 10)
    with pytest.raises(ValueError, match="shard_cores"):
        capacity.plan(1e9, 16, "adagrad", 1, 4096, shard_cores=0)


def test_plan_for_the_design_target() -> None:
    p = capacity.plan(1e11, 10, "adagrad", 100, 4096, shard_memory_gib=64, headroom=1.5)
    per_row = capacity.bytes_per_row(10, "adagrad")
    # 8 B header + 4 x 10 x 2 B values and slots, the 2 B change generation,
    # + the measured index bytes
    assert p.bytes_per_row == pytest.approx(88 + 2 + capacity.index_bytes_per_row())
    assert p.table_bytes == pytest.approx(1e11 * per_row)
    assert p.memory_shards == math.ceil(1e11 * per_row * 1.5 / (64 * 2**30))
    assert p.shards == max(p.memory_shards, p.throughput_shards)
    assert p.ids_per_step == 409_600
    assert p.pull_bytes_per_step == 409_600 * (8 + 40)
    assert p.save_seconds > 0 and p.memory_per_shard_bytes <= 64 * 2**30
    # More memory per host, fewer shards; more trainers, more network.
    assert capacity.plan(1e11, 10, "adagrad", 100, 4096, shard_memory_gib=256).memory_shards < (
        p.memory_shards
    )
    assert capacity.plan(1e11, 10, "adagrad", 200, 4096).pull_bytes_per_step == (
        2 * p.pull_bytes_per_step
    )


def test_plan_command_prints_the_plan_and_its_assumptions() -> None:
    cmd = [sys.executable, "-m", "tf_dlt.tools.cli", "plan", "--rows", "1e11", "--dim", "10",
           "--optimizer", "adagrad", "--trainers", "100", "--batch", "4096"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in ("shards:", "memory per shard:", "network per step", "checkpoint:",
                     "assumptions:", "bench/bench_scale.py"):  # fmt: skip
        assert expected in text
    bad = subprocess.run(cmd[:5] + ["0", "--dim", "10"], capture_output=True, text=True, cwd="/")
    assert bad.returncode == 2 and "must be positive" in bad.stderr
    # A budget per shard without an SSD: the shards are of that size (the
    # text said 64 GiB, the default).
    budget = subprocess.run([*cmd, "--memory-budget", "8GiB"], capture_output=True, text=True,
                            timeout=60, cwd="/")  # fmt: skip
    assert budget.returncode == 0 and "at 8 GiB each" in budget.stdout, budget.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        ({"shard_memory_gib": 0}, "shard_memory_gib"),  # ZeroDivisionError
        ({"rows": float("inf")}, "finite"),  # OverflowError
        ({"skew": float("nan")}, "finite"),  # "hit rate nan%"
        ({"headroom": -1}, "headroom"),  # "memory per shard: -143.5 GiB"
        ({"steps_per_second": -5}, "steps_per_second"),
        ({"shard_memory_gib": -1, "memory_budget": 0}, "shard_memory_gib"),
        ({"unique_fraction": -1}, "unique_fraction"),
        # 4.6 million shards of 1 KiB: a shard refuses a budget under ~234 MiB.
        ({"memory_budget": 1024, "ssd_bytes": 1 << 40}, "below the smallest a shard takes"),
        # Finite figures whose product is past floats: OverflowError.
        ({"rows": 1e307}, "more memory than any cluster has"),
        ({"sketch_bytes": 1e308, "headroom": 10}, "more memory than any cluster has"),
    ],
)
def test_plan_refuses_figures_that_make_no_plan(args: dict[str, float], says: str) -> None:
    # (A memory-only plan, steps 0, and a budget in place of shard_memory_gib
    # still plan.)
    capacity.plan(1e9, 16, "adagrad", 10, 4096, steps_per_second=0)
    capacity.plan(1e9, 16, "adagrad", 10, 4096, shard_memory_gib=0, memory_budget=8 << 30)
    capacity.plan(1e9, 16, "adagrad", 10, 4096, memory_budget=256 << 20, ssd_bytes=1 << 40)
    given: dict[str, float] = {"rows": 1e9, **args}
    rows = given.pop("rows")
    with pytest.raises(ValueError, match=says):
        capacity.plan(rows, 16, "adagrad", 10, 4096, **given)  # type: ignore[arg-type]


def test_plan_takes_admission_and_16_bit_rows() -> None:
    full = capacity.plan(1e11, 16, "adagrad", 100, 4096)
    half = capacity.plan(1e11, 16, "adagrad", 100, 4096, value_dtype="bfloat16",
                         slot_dtype="bfloat16")  # fmt: skip
    assert capacity.raw_record_bytes(16, "adagrad", "bfloat16", "bfloat16") == 8 + 32 + 32
    assert half.bytes_per_row == pytest.approx(
        72 + capacity.GENERATION_BYTES + capacity.index_bytes_per_row()
    )
    assert half.memory_shards < full.memory_shards
    filtered = capacity.plan(1e11, 16, "adagrad", 100, 4096, admission_rate=0.25,
                             sketch_bytes=2**40)  # fmt: skip
    assert filtered.resident_rows == 2.5e10
    assert filtered.table_bytes == pytest.approx(2.5e10 * full.bytes_per_row + 2**40)
    assert filtered.checkpoint_bytes == pytest.approx(full.checkpoint_bytes / 4)
    assert filtered.pull_bytes_per_step == full.pull_bytes_per_step  # every id is still pulled
    with pytest.raises(ValueError, match="admission_rate"):
        capacity.plan(1e11, 16, "adagrad", 100, 4096, admission_rate=0)
    with pytest.raises(ValueError, match="dtypes must be one of"):
        capacity.raw_record_bytes(16, "adagrad", "int8")


def test_tiered_plan_adds_shards_until_each_ssd_serves_its_cold_reads() -> None:
    tier = capacity.figures()["tier"]
    assert (
        tier["command"].startswith("python bench/bench_tier_scale.py")
        and "--load-fractions" in (tier["command"])
    )
    assert tier["device_reads_per_s"] > 0 and tier["restore_bytes_per_s"] > 0
    args = (1e11, 16, "adagrad", 100, 4096)
    budget = dict(memory_budget=48 * 2**30, ssd_bytes=1.6e12, steps_per_second=10)
    fast = capacity.plan(*args, **budget, ssd_reads_per_second=1e9)
    assert fast.tiers is not None and fast.disk_read_shards == 1
    assert fast.shards == max(fast.memory_shards, fast.throughput_shards)
    # Each shard pulls its share of the rows; those not in RAM read the SSD.
    t = fast.tiers
    rows_per_second = 100 * 4096 * 10 / fast.shards
    assert t.disk_reads_per_second == pytest.approx(rows_per_second * (1 - t.hit_rate))
    assert 0 < t.hit_rate < 1
    # A cold row's RAM, as the memory keeper counts it: its slot's 16-bit
    # fingerprint and ghost bit and its share of its page's 2-byte count of
    # used slots, at the mean fill; its disk: its page's share (4 KiB pages).
    page_bytes, slots, _ = _native.tier_page(capacity.raw_record_bytes(16, "adagrad"))
    assert page_bytes % 4096 == 0 and slots >= 32
    fill = capacity.TIER_MEAN_FILL
    assert t.cold_ram_bytes_per_row == pytest.approx((2 + 1 / 8 + 2 / slots) / fill, rel=0.01)
    assert t.disk_bytes_per_row == pytest.approx(page_bytes / slots / fill)
    slow = capacity.plan(*args, **budget, ssd_reads_per_second=20_000)
    assert slow.tiers is not None and slow.shards == slow.disk_read_shards > fast.shards
    assert slow.tiers.disk_reads_per_second <= 20_000
    # The fewest: one shard less and the SSDs could not keep up.
    fewer = capacity.tier_plan(
        1e11 / (slow.shards - 1), slow.bytes_per_row, capacity.raw_record_bytes(16, "adagrad"),
        48 * 2**30, 1.05, 100 * 4096 * 10 / (slow.shards - 1), 20_000,
    )  # fmt: skip
    assert fewer.disk_reads_per_second > 20_000
    # More shards hold more hot rows, so the hit rate rises with them.
    assert slow.tiers.hit_rate > t.hit_rate
    # The measured figure is the default; a tiered restore is no faster
    # than the measured tiered rate.
    default = capacity.plan(*args, **budget)
    assert default.tiers is not None
    assert default.tiers.ssd_reads_per_second == tier["device_reads_per_s"]
    rate = min(capacity.figures()["load_bytes_per_s_per_shard"], tier["restore_bytes_per_s"])
    assert default.load_seconds == pytest.approx(default.checkpoint_bytes / (rate * default.shards))
    with pytest.raises(ValueError, match="ssd_reads_per_second"):
        capacity.plan(*args, **budget, ssd_reads_per_second=-1)


def test_plan_command_reports_the_ssd_reads() -> None:
    cmd = [sys.executable, "-m", "tf_dlt.tools.cli", "plan", "--rows", "1e11", "--dim", "16",
           "--trainers", "100", "--memory-budget", "48GiB", "--ssd", "1.6TB",
           "--ssd-reads-per-second", "20000"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "of the SSD's 20,000/s" in out.stdout and "the SSDs' reads need" in out.stdout
    assert "bench/bench_tier_scale.py --rows" in out.stdout and "--load-fractions" in out.stdout


@pytest.mark.parametrize(
    ("rows", "budget", "headroom"), [(1e7, 300 << 20, 1.5), (1e10, 48 << 30, 1.0)]
)
def test_a_budgeted_plan_sizes_shards_by_the_room_they_give_rows(
    rows: float, budget: int, headroom: float
) -> None:
    """`tf-dlt plan --rows 1e7 --dim 16 --memory-budget 300MiB` planned 8
    shards of 184 MiB of rows each, dividing the table by the whole budget;
    a shard under it gives its rows about 70 MiB (90% of the budget less a
    save's reserve and the process), and without a tier it evicted 69% of
    them for good (helper-126's review). Tiered plans counted the same
    90% as room for hot rows. Both size by `capacity.row_room` now."""
    room = (
        budget * capacity.BUDGET_FRACTION
        - capacity._native.PERSIST_RESERVE_BYTES
        - capacity.PROCESS_BYTES
    )
    assert capacity.row_room(budget) == pytest.approx(room)
    p = capacity.plan(rows, 16, "adagrad", 1, 4096, memory_budget=budget, headroom=headroom)
    assert p.table_bytes / p.shards <= room
    tiered = capacity.plan(1e9, 16, "adagrad", 1, 4096, memory_budget=1 << 30, ssd_bytes=1e12)
    assert tiered.tiers is not None
    t = tiered.tiers
    ram = (
        t.ram_rows_per_shard * tiered.bytes_per_row
        + t.disk_rows_per_shard * t.cold_ram_bytes_per_row
    )
    assert ram <= capacity.row_room(1 << 30) * 1.0001
