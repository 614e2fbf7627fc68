#!/usr/bin/env bash
# Creates .venv (if needed), installs the pinned requirements given as $1
# (requirements/build.txt or requirements/test.txt) and builds and installs
# tf_dlt into it. Sourced by run_main.sh and run_tests.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQUIREMENTS="${1:-requirements/build.txt}"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"
if ! command -v g++ >/dev/null 2>&1; then
  echo "installing g++ (apt-get)" >&2
  apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r "$REQUIREMENTS"
# No build isolation: the build reads TensorFlow's compile flags from the
# TensorFlow installed above.
.venv/bin/python -m pip install -q --no-build-isolation --no-deps .
# And in place (the same objects, linked into tf_dlt/), so `python` started in
# the checkout, which imports the source tree, works too.
.venv/bin/python setup.py -q build_ext --inplace
