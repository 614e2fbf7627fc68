"""The main job until the Keras layer lands: a small training loop against
two local shard server processes, then a checkpoint re-loaded onto three.

Each step pulls the rows of a Zipf-distributed batch of ids, computes the
gradient of a squared error towards a fixed target row per id, and pushes it
(server-side Adagrad). The loss falls as the shards apply the updates.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import tf_dlt

DIM = 16


def start_shards(
    num_shards: int, workdir: Path, *extra: str
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs, port_files = [], []
    for i in range(num_shards):
        port_file = workdir / f"shard{i}-of-{num_shards}.port"
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tf_dlt.server", "--port", "0", "--bind", "127.0.0.1",
               "--shard-index", str(i), "--num-shards", str(num_shards),
               "--port-file", str(port_file), "--log-level", "WARNING", *extra]  # fmt: skip
        procs.append(subprocess.Popen(cmd))
        port_files.append(port_file)
    addresses = []
    for proc, port_file in zip(procs, port_files, strict=True):
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(procs)
                raise SystemExit(f"shard server failed to start (exit {proc.returncode})")
            time.sleep(0.05)
        addresses.append(f"127.0.0.1:{port_file.read_text().split()[0]}")
    return procs, addresses


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)


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
        procs, addresses = start_shards(2, workdir)
        try:
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
        finally:
            stop(procs)
        procs, addresses = start_shards(3, workdir, "--load-from", str(workdir / "ckpt"))
        try:
            with tf_dlt.Client(addresses) as client:
                same = np.array_equal(client.pull("ctr_emb", probe, training=False), expected)
        finally:
            stop(procs)
        print(f"reloaded onto 3 shards: rows identical = {same}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
