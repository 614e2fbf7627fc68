"""The main job until the Keras layer lands: a small training loop against
two local shard server processes, then a checkpoint re-loaded onto three.

Each step pulls the rows of a Zipf-distributed batch of ids, computes the
gradient of a squared error towards a fixed target row per id, and pushes it
(server-side Adagrad). The loss falls as the shards apply the updates.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import tf_dlt
from tf_dlt.server.local import LocalCluster

DIM = 16


def target(ids: np.ndarray) -> np.ndarray:
    """The row each id should learn: a fixed function of the id."""
    phase = (ids % 1000).astype(np.float32)[..., None] / 1000.0
    return np.sin(phase * np.arange(1, DIM + 1, dtype=np.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=100_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="tf_dlt-main-") as tmp:
        workdir = Path(tmp)
        with LocalCluster(2, "--log-level", "WARNING") as two:
            addresses = two.addresses
            with tf_dlt.Client(addresses) as client:
                client.create_table("ctr_emb", DIM, "uniform", tf_dlt.optimizers.Adagrad(), seed=1)
                print(f"2 shard servers at {', '.join(addresses)}; training {args.steps} steps")
                for step in range(1, args.steps + 1):
                    ids = (rng.zipf(1.2, args.batch) % args.vocab).astype(np.int64)
                    rows = client.pull("ctr_emb", ids)
                    diff = rows - target(ids)
                    loss = float(np.mean(diff**2))
                    client.push("ctr_emb", ids, 2.0 * diff / DIM, learning_rate=0.5)
                    if step == 1 or step % 50 == 0:
                        print(f"step {step:4d}  loss {loss:.5f}")
                probe = np.unique(ids)
                expected = client.pull("ctr_emb", probe, training=False)
                stats = client.stats()
                rows_total = sum(int(s["tables"][0]["rows"]) for s in stats)
                p99 = max(s["pull_latency"]["p99_us"] for s in stats)
                print(f"{rows_total} rows on 2 shards; pull p99 {p99:.0f} us")
                ckpt = workdir / "ckpt"
                manifest = client.save(str(ckpt))
                print(f"saved {len(manifest['files'])} shard files to {ckpt}")
        with (
            LocalCluster(3, "--log-level", "WARNING", "--load-from", str(ckpt)) as three,
            tf_dlt.Client(three.addresses) as client,
        ):
            same = np.array_equal(client.pull("ctr_emb", probe, training=False), expected)
        print(f"reloaded onto 3 shards: rows identical = {same}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
