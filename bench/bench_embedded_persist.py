"""Peak memory of saving and loading embedded tables (tf_dlt.save /
tf_dlt.load of a model whose tables live in this process), against the
bytes of the rows themselves (values and optimizer slots, float32), each in
a fresh process: the extra resident memory at the peak of the call, over
what the process held before it (VmHWM reset through /proc/self/clear_refs).
A load that builds the checkpoint's tables next to the model's empty ones
and installs them peaks near 1x; one that stages a copy and imports it into
a second peaks near 2x.

Usage: python bench/bench_embedded_persist.py [--rows 2000000] [--dim 32]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from common import emit, log, print_result, result_of


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_extra(fn):  # type: ignore[no-untyped-def]
    """Runs `fn`; the most resident bytes it added at any moment."""
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def _model(dim: int):  # type: ignore[no-untyped-def]
    import keras

    import tf_dlt

    ids = keras.Input(shape=(1,), dtype="int64")
    layer = tf_dlt.layers.Embedding(
        output_dim=dim, is_distributed=True, optimizer="adagrad", name="persist_emb"
    )
    model = keras.Model(ids, keras.layers.Flatten()(layer(ids)))
    return model, layer


def child(mode: str, path: str, rows: int, dim: int) -> None:
    import numpy as np
    import tensorflow as tf

    import tf_dlt

    model, layer = _model(dim)
    if mode == "save":
        batch = 1 << 18
        for start in range(0, rows, batch):
            ids = np.arange(start, min(rows, start + batch), dtype=np.int64)
            values = np.random.default_rng(start).normal(size=(len(ids), dim)).astype(np.float32)
            tf_dlt.ops.assign(layer.client, tf.constant(ids), tf.constant(values),
                              layer.table_name, dim)  # fmt: skip
        print_result(_peak_extra(lambda: tf_dlt.save(model, path)))
    else:
        print_result(_peak_extra(lambda: tf_dlt.load(model, path)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.rows, args.dim)
        return
    row_bytes = args.rows * args.dim * 4 * 2  # values and Adagrad accumulators
    with tempfile.TemporaryDirectory(prefix="tf_dlt-bench-") as tmp:
        path = str(Path(tmp) / "ckpt")
        for mode in ("save", "load"):
            cmd = [sys.executable, __file__, "--rows", str(args.rows), "--dim", str(args.dim),
                   "--child", mode, path]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
            extra = int(result_of(out.stdout))
            log(f"embedded {mode}: peak {extra / 2**20:.0f} MiB over {row_bytes / 2**20:.0f} MiB")
            emit({"case": f"embedded_{mode}_peak", "rows": args.rows, "dim": args.dim,
                  "value": extra, "baseline_value": row_bytes, "unit": "bytes"})  # fmt: skip


if __name__ == "__main__":
    main()
