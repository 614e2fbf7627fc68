"""Turns bench/out/tier_probe/<run>/*.log of probe.cc into markdown tables.

Usage: python summarize.py bench/out/tier_probe/run1 [bench/out/tier_probe/run2 ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PHASES = [
    ("load", "load"), ("load+settle", "load+settle"), ("read_uniform", "read uni"),
    ("read_zipf", "read zipf"), ("churn(promote+demote)", "churn"), ("miss", "miss"),
    ("read_uniform_cold", "read uni COLD"), ("read_zipf_cold", "read zipf COLD"),
]  # fmt: skip
ENGINES = ["rocksdb", "lmdb", "pagehash", "lmdb_nordahead"]
STRUCTURES = {
    "rocksdb_struct": " (table readers+block cache)",
    "lmdb_branch_pages": " (branch pages)",
    "pagehash_struct": " (fingerprints+counts)",
}
HEADER = ["engine", *(p[1] for p in PHASES), "RAM B/row: RSS growth (anon)",
          "RAM B/row: engine structures", "disk B/row", "peak RSS MiB (VmHWM)",
          "RSS at end MiB"]  # fmt: skip


def _kib(text: str, name: str) -> int:
    found = re.search(name + r"=(\d+)", text)
    if found is None:
        raise ValueError(f"no {name} in the log")
    return int(found.group(1))


def row(engine: str, text: str) -> list[str]:
    """One engine's line of the table, from its log."""
    rates = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"phase=(\S+) ops=\d+ sec=\S+ rows_per_s=(\d+)", text)
    }
    per_row = {m.group(1): float(m.group(2)) for m in re.finditer(r"MEMROW (\S+) (\S+)", text)}
    key = next((k for k in per_row if k.endswith(("_struct", "_branch_pages"))), "")
    structures = f"{per_row[key]:.2f}{STRUCTURES.get(key, '')}" if key else "-"
    return [
        engine, *(f"{rates[p[0]]:,.0f}" for p in PHASES),
        f"{per_row['rss_growth']:.1f} ({per_row['anon_growth']:.1f})", structures,
        f"{per_row['disk_apparent']:.1f}", f"{_kib(text, 'VmHWM') / 1024:.0f}",
        f"{_kib(text, 'VmRSS_end') / 1024:.0f}",
    ]  # fmt: skip


def main() -> None:
    for directory in map(Path, sys.argv[1:]):
        print(f"\n#### {directory.name} (rows/s; churn = promote+demote iterations/s)\n")
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER))
        for engine in ENGINES:
            log = directory / f"{engine}.log"
            if log.exists():
                print("| " + " | ".join(row(engine, log.read_text())) + " |")


if __name__ == "__main__":
    main()
