"""Save / Load throughput of one shard (shared/research/perf.md B9) against
plain disk I/O of the same number of bytes measured in the same run:

- save: shard_files.save_shard GB/s vs sequential write + fsync (target >= 0.7)
- load: shard_files.load_shard GB/s vs reading the same bytes back from the
  page cache and from disk (O_DIRECT), target >= 1 GB/s. The first load of
  the run is reported apart ("cold"): its table memory is new to the process,
  and on a VM the first touch of memory the guest has not used yet costs far
  more than the load itself; later loads reuse memory a table held before,
  as a long-running shard does.
- beside the loads, the first touch of as much fresh memory as the table
  holds (anonymous, huge pages advised, as the table's), which a load must
  fault in: for the cold load after the process sat idle for 3 s, for the
  others right after the last touch freed its memory, as the loads ran
  (`first_touch_seconds` beside each load's `seconds`). On a VM whose host
  takes back the memory a guest frees (free page reporting), memory freed
  a second or more ago costs several seconds per GiB to touch again.

GB/s counts the shard file's bytes. Disk figures swing a lot here, so save,
load and the plain I/O baseline run interleaved `--reps` times and the
medians are compared. Usage:
  python bench/bench_persist.py [--rows N] [--dim D] [--dir PATH] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tf_dlt import _native
from tf_dlt.checkpoint import shard_files
from tf_dlt.checkpoint.manifest import write_manifest

from bench_core import make_table
from common import emit, log


def disk_write_read(path: Path, nbytes: int) -> tuple[float, float]:
    """(write+fsync GB/s, read GB/s) of `nbytes` in 8 MiB blocks."""
    block = os.urandom(8 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass
    read = nbytes / (time.perf_counter() - start) / 1e9
    path.unlink()
    return write, read


def direct_read(path: Path) -> float:
    """GB/s of reading `path` with O_DIRECT (from the device, not the page
    cache), 8 MiB at a time; 0 where O_DIRECT is refused."""
    import mmap

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return 0.0
    buf = mmap.mmap(-1, 8 << 20)
    total, start = 0, time.perf_counter()
    try:
        while (n := os.readv(fd, [buf])) > 0:
            total += n
    except OSError:
        return 0.0
    finally:
        os.close(fd)
    return total / (time.perf_counter() - start) / 1e9


def first_touch(nbytes: int) -> float:
    """Seconds to fault in `nbytes` of fresh private anonymous memory with
    huge pages advised (as the table maps its rows), a write per 4 KiB."""
    import mmap

    import numpy as np

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        pages = np.frombuffer(m, dtype=np.uint8)
        start = time.perf_counter()
        pages[::4096] = 1
        seconds = time.perf_counter() - start
        del pages
    finally:
        m.close()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--reps", type=int, default=4, help="at least 2: the first load is cold")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="the table's value and slot dtype (16-bit rows are stored as 16 bits)",
    )  # fmt: skip
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tf_dlt-bench-", dir=args.dir))
    try:
        log(f"persist: {args.rows} rows of dim {args.dim}, adagrad, {args.dtype}")
        table, _ = make_table(args.rows, args.dim, value_dtype=args.dtype, slot_dtype=args.dtype)
        shard = _native.Shard(0, 1)
        shard.install_tables([table])
        saves, loads, writes, reads, directs = [], [], [], [], []
        for rep in range(args.reps):
            write_gbs, read_gbs = disk_write_read(base / "plain.bin", table.bytes())
            writes.append(write_gbs)
            reads.append(read_gbs)
            start = time.perf_counter()
            part = shard_files.save_shard(str(base / "ck"), shard, f"bench{rep}")
            saves.append(time.perf_counter() - start)
            write_manifest(str(base / "ck"), [part], f"bench{rep}")
            directs.append(direct_read(base / "ck" / part["file"]))
        # Loads back to back (a save between them would hand the memory a
        # loaded table freed to the page cache, and every load would be cold).
        for _ in range(args.reps):
            fresh = _native.Shard(0, 1)
            start = time.perf_counter()
            shard_files.load_shard(str(base / "ck"), fresh)
            loads.append(time.perf_counter() - start)
            assert fresh.tables()[0].size() == args.rows
            del fresh
        # As many first touches, after the loads (measured before, they
        # would hand the loads memory just freed): the first after 3 s idle,
        # the others back to back, as the loads ran.
        time.sleep(3)
        touches = [first_touch(table.bytes()) for _ in range(args.reps)]
        nbytes = part["bytes"]
        cold_s = loads.pop(0)
        touch_cold_s = touches.pop(0)
        save_s, load_s = statistics.median(saves), statistics.median(loads)
        write_gbs, read_gbs = statistics.median(writes), statistics.median(reads)
        common = {
            "rows": args.rows, "dim": args.dim, "dtype": args.dtype, "bytes": nbytes,
            "unit": "GB/s",
        }  # fmt: skip
        emit({
            **common, "name": "persist_save", "value": nbytes / save_s / 1e9, "seconds": save_s,
            "baseline_name": "sequential write + fsync, same bytes", "baseline_value": write_gbs,
            "target_ratio": ">= 0.7",
        })  # fmt: skip
        direct_gbs = statistics.median(directs)
        touch_s = statistics.median(touches)
        for name, seconds, touched in (
            ("persist_load", load_s, touch_s),
            ("persist_load_cold", cold_s, touch_cold_s),
        ):
            emit({
                **common, "name": name, "value": nbytes / seconds / 1e9, "seconds": seconds,
                "baseline_name": "sequential read (page cache), same bytes",
                "baseline_value": read_gbs, "disk_read_gbs": direct_gbs,
                "first_touch_seconds": touched, "table_bytes": table.bytes(),
                "target": ">= 1 GB/s",
            })  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
