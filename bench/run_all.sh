#!/usr/bin/env bash
# Runs every benchmark of bench/cases.py at full size (each appends JSON
# lines to bench/out/results.jsonl), then redraws the plots in docs/img/ from
# them. About 15 minutes on the 2-vCPU VM; needs ~13 GB RAM and ~10 GB disk
# (bench_scale), and network to PyPI the first time (bench_peers creates
# .bench/tfra-venv). `python bench --quick` runs every case at a tiny size.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m pip install -q -r requirements/bench.txt
$PY bench "$@"
$PY bench/plot.py
