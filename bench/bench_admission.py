"""Memory policy vs model quality, on the main job's CTR model
(examples/ctr_model.py) trained on a long-tail stream: categorical ids
Zipf(1.05) over 1e9 ids per feature, one pass over `--train` examples (an
online stream), held-out AUC on `--test` examples drawn the same way, tables
on 2 local shard processes. Measured in one run against the unfiltered
float32 table:

- Frequency(min_count) admission for each --min-counts: resident rows (and
  their ratio to the unfiltered table's; target <= 1/3) and AUC (target
  within 0.002 of unfiltered);
- bfloat16 and float16 values and slots: table bytes per row (target <= 0.6x
  of float32) and AUC (target within 0.002).

Each case is a JSON line (bench/out/results.jsonl); bench/plot.py draws
docs/img/admission.png (resident rows and AUC vs min_count).

Usage: python bench/bench_admission.py [--train 2000000] [--test 200000]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import tf_dlt
from tf_dlt import admission
from tf_dlt.server.local import LocalCluster

from common import emit, example, log

_ctr = example("ctr_model")
make_data, make_model = _ctr.make_data, _ctr.make_model

ZIPF, VOCAB = 1.05, 10**9


def train_and_score(
    cluster: LocalCluster,
    name: str,
    data: tuple[Any, Any],
    test: tuple[Any, Any],
    batch: int,
    **options: Any,
) -> dict[str, float]:
    """One pass over `data` with the table options; held-out AUC, the
    table's resident rows and bytes per row."""
    model = tf_dlt.transpile(make_model(name=name, **options), cluster.addresses)
    start = time.monotonic()
    model.fit(*data, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    seconds = time.monotonic() - start
    _, auc = model.evaluate(*test, batch_size=4096, verbose=0)
    with tf_dlt.Client(cluster.addresses) as client:
        info = client.list_tables()[name]
        client.drop_table(name)  # free the shards' memory for the next case
    return {
        "auc": float(auc),
        "rows": int(info["rows"]),
        "bytes_per_row": info["bytes"] / max(1, info["rows"]),
        "refused": int(info["refused"]),
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--train", type=int, default=2_000_000)
    ap.add_argument("--test", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--min-counts", default="2,3,4,5")
    args = ap.parse_args()
    data = make_data(args.train, seed=0, zipf=ZIPF, vocab=VOCAB)
    test = make_data(args.test, seed=1, zipf=ZIPF, vocab=VOCAB)
    common = {"train": args.train, "test": args.test, "zipf": ZIPF, "vocab": VOCAB}
    with LocalCluster(2, "--log-level", "WARNING") as cluster:
        base = train_and_score(cluster, "unfiltered", data, test, args.batch)
        log(f"unfiltered: {base}")
        emit({"name": "admission_baseline", **common, **base})
        for k in (int(v) for v in args.min_counts.split(",")):
            r = train_and_score(
                cluster, f"min{k}", data, test, args.batch,
                admission=admission.Frequency(min_count=k),
            )  # fmt: skip
            log(f"min_count {k}: {r}")
            emit({
                "name": "admission", "min_count": k, **common, **r,
                "rows_ratio": r["rows"] / base["rows"], "auc_delta": r["auc"] - base["auc"],
                "baseline_rows": base["rows"], "baseline_auc": base["auc"],
            })  # fmt: skip
        for dtype in ("bfloat16", "float16"):
            r = train_and_score(
                cluster, f"rows_{dtype}", data, test, args.batch,
                value_dtype=dtype, slot_dtype=dtype,
            )  # fmt: skip
            log(f"{dtype}: {r}")
            emit({
                "name": "row_dtype", "dtype": dtype, **common, **r,
                "bytes_ratio": r["bytes_per_row"] / base["bytes_per_row"],
                "auc_delta": r["auc"] - base["auc"],
                "baseline_bytes_per_row": base["bytes_per_row"], "baseline_auc": base["auc"],
            })  # fmt: skip


if __name__ == "__main__":
    main()
