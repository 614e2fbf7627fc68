"""Soak: 4 trainer processes pull and push against 2 shard processes for a
bounded time. No errors, shard memory flat after warm-up (< 5% growth), and
pull/push latency reported (p50, p99 on both sides).

Short by default (CI); the long variant runs 10 minutes:
    TF_DLT_SOAK_SECONDS=600 pytest tests/test_soak.py -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import Cluster

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("TF_DLT_SOAK_SECONDS", "20"))
WARMUP = min(5.0, SECONDS / 4)
TRAINERS, ROWS, DIM, BATCH = 4, 200_000, 16, 4096

TRAINER = f"""
import json, sys, time
import numpy as np, tf_dlt
from tf_dlt import errors
addresses, seconds, seed = sys.argv[1].split(","), float(sys.argv[2]), int(sys.argv[3])
client = tf_dlt.Client(addresses)
rng = np.random.default_rng(seed)
pulls, pushes, failures, steps = [], [], 0, 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    ids = np.unique(rng.zipf(1.1, {BATCH}) % {ROWS})
    try:
        t0 = time.perf_counter()
        rows = client.pull("soak", ids)
        t1 = time.perf_counter()
        client.push("soak", ids, np.full_like(rows, 1e-3), 0.01)
        t2 = time.perf_counter()
    except errors.DltError as e:
        failures += 1
        print("error:", e, file=sys.stderr)
        continue
    pulls.append(t1 - t0)
    pushes.append(t2 - t1)
    steps += 1
print(json.dumps({{"steps": steps, "failures": failures,
                  "pull_ms": [float(np.percentile(pulls, q)) * 1e3 for q in (50, 99)],
                  "push_ms": [float(np.percentile(pushes, q)) * 1e3 for q in (50, 99)]}}))
"""


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_soak_four_trainers_two_shards(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2)
    with cluster.client() as client:
        client.create_table("soak", DIM, optimizer="adagrad")
        client.pull("soak", np.arange(ROWS))  # every row exists before the clock starts
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TRAINER, ",".join(cluster.addresses), str(SECONDS), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )  # fmt: skip
        for i in range(TRAINERS)
    ]
    time.sleep(WARMUP)
    pids = [p.pid for p in cluster.processes]
    warm = [_rss_kib(pid) for pid in pids]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=SECONDS + 120)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    final = [_rss_kib(pid) for pid in pids]
    with cluster.client() as client:
        stats = client.stats()
    growth = [(f - w) / w for f, w in zip(final, warm, strict=True)]
    steps = sum(r["steps"] for r in reports)
    print(
        f"\nsoak {SECONDS:.0f} s, {TRAINERS} trainers x 2 shards: {steps} pull+push steps "
        f"(batches of {BATCH} Zipf draws); shard RSS after warm-up {warm} KiB -> {final} KiB "
        f"(growth {[f'{g:.2%}' for g in growth]})"
    )
    for i, r in enumerate(reports):
        pull_ms, push_ms = r["pull_ms"], r["push_ms"]
        print(
            f"trainer {i}: {r['steps']} steps, pull p50/p99 {pull_ms[0]:.2f}/{pull_ms[1]:.2f} ms, "
            f"push p50/p99 {push_ms[0]:.2f}/{push_ms[1]:.2f} ms"
        )
    for s in stats:
        pull, push = s["pull_latency"], s["push_latency"]
        print(
            f"shard {s.get('shard_index', 0)}: service pull p50/p99 {pull['p50_us']:.0f}/"
            f"{pull['p99_us']:.0f} us, push p50/p99 {push['p50_us']:.0f}/{push['p99_us']:.0f} us"
        )
        assert not s["errors"], s["errors"]
        assert pull["p50_us"] > 0 and int(pull["count"]) > 0
    assert all(r["failures"] == 0 and r["steps"] > 0 for r in reports)
    assert all(g < 0.05 for g in growth), growth
    assert all(p.poll() is None for p in cluster.processes)
