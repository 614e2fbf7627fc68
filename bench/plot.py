"""Plots of the benchmark results: reads bench/out/results.jsonl (every
bench script appends its JSON lines there) and writes PNGs to docs/img/:

- pull_vs_batch.png: pull rows/s vs batch size (bench_scale.py, 1M rows);
- pull_vs_table_size.png: pull and push rows/s and pull latency vs rows in
  the table (bench_scale.py, 1M .. 100M rows);
- pull_vs_shards.png: pull rows/s vs shard processes (bench_ops.py shards);
- admission.png: resident rows and held-out AUC vs Frequency min_count
  (bench_admission.py; min_count 1 is the unfiltered table);
- tiers.png: a tiered shard's pull and push rows/s (as a share of the same
  table all in RAM) and its peak RSS against the memory budget, vs the
  budget as a fraction of the table (bench_tiers.py);
- tier_scale.png: pull rows/s of a tiered shard restored from one checkpoint
  under several budgets (as a share of a 1M-row table all in RAM), and the
  restore's rows/s and peak RSS, vs the budget as a fraction of the table
  (bench_tier_scale.py --load-fractions, 5e8 rows);
- cache.png: model.fit examples/s and bytes pulled per step (against no
  cache) vs hot-row cache size, one line per staleness bound, per Zipf
  exponent (bench_cache.py);
- wire.png: aggregate pull rows/s of 1, 2, 4, 8 client processes against 2
  and 4 shards, per batch shape (bench_wire.py, the machine with the most
  cores among the records).

The latest record of each kind is plotted. Usage: python bench/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "out" / "results.jsonl"
IMG = ROOT / "docs" / "img"


def _latest(records: list[dict[str, Any]], name: str, key: str) -> list[dict[str, Any]]:
    """The last record of `name` for each value of `key`, sorted by it."""
    by_key = {r[key]: r for r in records if r.get("name") == name}
    return [by_key[k] for k in sorted(by_key)]


def _latest_tiers(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The last tiers run's records (the table size of the last one) by case,
    each case's sorted by budget fraction."""
    tiers = [r for r in records if r.get("bench") == "tiers"]
    if not tiers:
        return {}
    rows = tiers[-1]["rows"]
    by_case: dict[str, dict[float, dict[str, Any]]] = {}
    for r in tiers:
        if r["rows"] == rows:
            by_case.setdefault(r["case"], {})[r["budget_fraction"]] = r
    return {case: [got[f] for f in sorted(got)] for case, got in by_case.items()}


def _plot_tiers(cases: dict[str, list[dict[str, Any]]]) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    for case, points in cases.items():
        fractions = [r["budget_fraction"] for r in points]
        a1.plot(fractions, [r["value"] / r["baseline_value"] for r in points], "o-", label=case)
    a1.axhline(0.5, color="grey", linestyle=":", label="target (Zipf)")
    points = next(iter(cases.values()))  # RSS and the table are one per budget
    first = points[0]
    a1.set(xlabel="memory budget / table's RAM", ylabel="rows/s vs all in RAM",
           title=f"Tiered shard, {first['rows'] / 1e6:g}M rows of dim {first['dim']}")  # fmt: skip
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    fractions = [r["budget_fraction"] for r in points]
    a2.plot(fractions, [r["rss_over_budget"] for r in points], "o-", label="peak RSS / budget")
    a2.axhline(1.1, color="grey", linestyle=":", label="budget + 10%")
    a2.set(xlabel="memory budget / table's RAM", ylabel="peak RSS / budget",
           title="Peak RSS (load and traffic)", ylim=(0, 1.3))  # fmt: skip
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    _save(fig, "tiers.png")


def _latest_tier_scale(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last restore run of bench_tier_scale (the records sharing its
    last record's all-RAM baseline, measured once a run), sorted by budget
    fraction."""
    runs = [r for r in records if r.get("bench") == "tier_scale" and r.get("case") == "restore"]
    if not runs:
        return []
    key = "baseline_zipf_pull_rows_per_s"
    got = {r["budget_fraction"]: r for r in runs if r[key] == runs[-1][key]}
    return [got[f] for f in sorted(got)]


def _plot_tier_scale(points: list[dict[str, Any]]) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    fractions = [r["budget_fraction"] for r in points]
    for key, label in [
        ("zipf_pull", "Zipf training pulls"),
        ("zipf_pull_only", "Zipf pulls alone"),
        ("uniform_pull", "uniform training pulls"),
    ]:
        ratio = [r[f"{key}_rows_per_s"] / r[f"baseline_{key}_rows_per_s"] for r in points]
        a1.plot(fractions, ratio, "o-", label=label)
    a1.axhline(0.5, color="grey", linestyle=":", label="target (Zipf)")
    first = points[0]
    title = f"Restored tiered shard, {first['rows'] / 1e6:g}M rows of dim {first['dim']}"
    a1.set(yscale="log", xlabel="memory budget / table's RAM", ylabel="rows/s vs 1M rows in RAM",
           title=title)  # fmt: skip
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.plot(fractions, [r["load_rows_per_s"] / 1e6 for r in points], "o-", label="restore M rows/s")
    a2.plot(fractions, [r["rss_over_budget"] for r in points], "s-", label="peak RSS / budget")
    a2.axhline(1.1, color="grey", linestyle=":", label="budget + 10%")
    a2.set(xlabel="memory budget / table's RAM", title="Restore rate and peak RSS", ylim=(0, None))
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    _save(fig, "tier_scale.png")


def _latest_cache_runs(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per Zipf exponent, the cached cases of the last bench_cache.py run
    (the records after its "no cache" record)."""
    runs: dict[float, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("bench") != "cache":
            continue
        if r["case"] == "no cache":
            runs[r["zipf"]] = []
        elif r["zipf"] in runs:  # the cached cases, and the bound
            runs[r["zipf"]].append(r)
    return [runs[z] for z in sorted(runs) if any(r["case"] == "cache" for r in runs[z])]


def _plot_cache(runs: list[list[dict[str, Any]]]) -> None:
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 3.6 * len(runs)), squeeze=False)
    for (a1, a2), run in zip(axes, runs, strict=True):
        cases = [r for r in run if r["case"] == "cache"]
        bounds = [r["value"] for r in run if r["case"].startswith("best possible cache")]
        first = cases[0]
        for steps in sorted({r["staleness_steps"] for r in cases}):
            line = sorted(
                (r for r in cases if r["staleness_steps"] == steps), key=lambda r: r["rows"]
            )
            rows = [r["rows"] for r in line]
            a1.plot(rows, [r["examples_per_s"] / 1e3 for r in line], "o-",
                    label=f"refresh every {steps} lookups")  # fmt: skip
            a2.plot(rows, [r["ratio"] for r in line], "o-", label=f"every {steps} lookups")
        a1.axhline(first["examples_per_s_baseline"] / 1e3, color="k", ls="--", label="no cache")
        a1.set(xscale="log", xlabel="cache rows per table", ylabel="k examples/s",
               title=f"model.fit, 2 shards, Zipf({first['zipf']})")  # fmt: skip
        a2.axhline(1.0, color="k", ls="--")
        a2.axhline(0.5, color="tab:red", ls=":", label="target 0.5")
        if bounds:
            a2.axhline(bounds[-1], color="tab:gray", ls="-.", label="best possible cache")
        a2.set(xscale="log", xlabel="cache rows per table", ylabel="pull bytes per step / no cache",
               title="Bytes pulled from the shards")  # fmt: skip
        for ax in (a1, a2):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    _save(fig, "cache.png")


def _latest_wire(
    records: list[dict[str, Any]],
) -> dict[tuple[int, int, int, int], list[dict[str, Any]]]:
    """bench_wire pulls by (shards, threads, ids, dim) from the machine with
    the most cores, the last record for each client count, sorted by it."""
    wire = [r for r in records if r.get("bench") == "wire" and r.get("op") == "pull"]
    if not wire:
        return {}
    cores = max(r["cores"] for r in wire)
    lines: dict[tuple[int, int, int, int], dict[int, dict[str, Any]]] = {}
    for r in wire:
        if r["cores"] == cores and r.get("exchange_threads", 0) == 0:
            key = (r["shards"], r["threads"], r["ids"], r["dim"])
            lines.setdefault(key, {})[r["clients"]] = r
    return {k: [v[c] for c in sorted(v)] for k, v in lines.items() if len(v) > 1}


def _plot_wire(lines: dict[tuple[int, int, int, int], list[dict[str, Any]]]) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for (shards, threads, ids, dim), points in sorted(lines.items()):
        ax.plot([r["clients"] for r in points], [r["rows_per_s"] / 1e6 for r in points], "o-",
                label=f"{shards} shards x {threads} threads, {ids:,} ids x dim {dim}")  # fmt: skip
    cores = next(iter(lines.values()))[0]["cores"]
    ax.set(xscale="log", xlabel="client processes", ylabel="M rows/s (all clients)",
           title=f"Aggregate pull rows/s ({cores} cores, loopback)")  # fmt: skip
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, "wire.png")


def _save(fig: Any, name: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(IMG / name, dpi=110)
    plt.close(fig)
    print(f"wrote docs/img/{name}")


def main() -> None:
    records = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    batch = _latest(records, "pull_vs_batch", "batch")
    if batch:
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        ax.plot([r["batch"] for r in batch], [r["rows_per_s"] / 1e6 for r in batch], "o-")
        first = batch[0]
        title = f"Pull rows/s vs batch (2 shards, {first['rows']:,} rows, dim {first['dim']})"
        ax.set(xscale="log", xlabel="ids per pull (batch)", ylabel="M rows/s", title=title)
        ax.grid(alpha=0.3)
        _save(fig, "pull_vs_batch.png")
    sizes = _latest(records, "scale_point", "rows")
    if sizes:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
        rows = [r["rows"] / 1e6 for r in sizes]
        a1.plot(rows, [r["pull_rows_per_s"] / 1e6 for r in sizes], "o-", label="pull")
        a1.plot(rows, [r["push_rows_per_s"] / 1e6 for r in sizes], "s-", label="push (Adagrad)")
        a1.set(xscale="log", xlabel="rows in the table (M)", ylabel="M rows/s",
               title="Throughput vs table size (batch 65536)")  # fmt: skip
        a1.legend()
        a1.grid(alpha=0.3)
        a2.plot(rows, [r["pull_p50_ms_65536"] for r in sizes], "o-", label="batch 65536")
        a2.plot(rows, [r["pull_p50_ms_1024"] for r in sizes], "s-", label="batch 1024")
        a2.set(xscale="log", xlabel="rows in the table (M)", ylabel="pull p50 (ms)",
               title="Pull latency vs table size")  # fmt: skip
        a2.legend()
        a2.grid(alpha=0.3)
        _save(fig, "pull_vs_table_size.png")
    shards = _latest(records, "pull_vs_shards", "shards")
    if shards:
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        ax.bar([str(r["shards"]) for r in shards], [r["rows_per_s"] / 1e6 for r in shards])
        ax.set(xlabel="shard processes (2 vCPU machine)", ylabel="M rows/s",
               title=f"Pull rows/s vs shards (batch {shards[0]['batch']})")  # fmt: skip
        ax.grid(alpha=0.3, axis="y")
        _save(fig, "pull_vs_shards.png")
    admitted = _latest(records, "admission", "min_count")
    if admitted:
        base = admitted[0]
        counts = [1] + [r["min_count"] for r in admitted]
        rows = [base["baseline_rows"] / 1e6] + [r["rows"] / 1e6 for r in admitted]
        auc = [base["baseline_auc"]] + [r["auc"] for r in admitted]
        fig, a1 = plt.subplots(figsize=(6, 3.8))
        a1.bar(counts, rows, color="tab:blue", alpha=0.6, label="resident rows")
        a1.set(xlabel="Frequency min_count (1: no admission)", ylabel="resident rows (M)",
               title=f"Admission on a long-tail stream ({base['train']:,} examples)")  # fmt: skip
        a2 = a1.twinx()
        a2.plot(counts, auc, "o-", color="tab:red", label="held-out AUC")
        a2.set_ylabel("held-out AUC")
        handles = a1.get_legend_handles_labels()[0] + a2.get_legend_handles_labels()[0]
        a2.legend(handles, [h.get_label() for h in handles], loc="center right")
        _save(fig, "admission.png")
    tiers = _latest_tiers(records)
    if tiers:
        _plot_tiers(tiers)
    tier_scale = _latest_tier_scale(records)
    if tier_scale:
        _plot_tier_scale(tier_scale)
    cache = _latest_cache_runs(records)
    if cache:
        _plot_cache(cache)
    wire = _latest_wire(records)
    if wire:
        _plot_wire(wire)


if __name__ == "__main__":
    main()
