#!/usr/bin/env bash
# Runs every benchmark (each appends JSON lines to bench/out/results.jsonl),
# then redraws the plots in docs/img/ from them. About 15 minutes on the
# 2-vCPU VM; needs ~13 GB RAM and ~10 GB disk (bench_scale), and network to
# PyPI the first time (bench_peers creates .bench/tfra-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m pip install -q -r requirements/bench.txt
$PY bench/bench_core.py
$PY bench/bench_persist.py
$PY bench/bench_delta.py
$PY bench/bench_ops.py
$PY bench/bench_connections.py
$PY bench/bench_keras.py
$PY bench/bench_fit_steady.py
$PY bench/bench_cache.py
$PY bench/bench_trainers.py
$PY bench/bench_scale.py --write-capacity
$PY bench/bench_admission.py
$PY bench/bench_memory.py
$PY bench/bench_peers.py
$PY bench/plot.py
