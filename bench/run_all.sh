#!/usr/bin/env bash
# Runs every benchmark of bench/cases.py at full size (each appends JSON
# lines to bench/out/results.jsonl), then redraws the plots in docs/img/ from
# them. About two hours on the 2-vCPU VM (bench_tier_scale grows 5e8 rows
# for an hour); needs ~13 GB RAM, ~60 GB of free disk, and network to PyPI
# the first time (bench_peers creates .bench/tfra-venv); docs/benchmarks.md.
# `python bench --quick` runs every case at a tiny size (its records go to
# bench/out/results-quick.jsonl, never plotted).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m pip install -q -r requirements/bench.txt
$PY bench "$@"
$PY bench/plot.py
