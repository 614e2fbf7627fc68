#!/usr/bin/env bash
# Set up, lint and run the whole test suite (C++ suite included). Fails when
# any check fails or when pytest collects no test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh" requirements/test.txt
cd "$ROOT"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/clang-format --dry-run --Werror native/*/*.h native/*/*.cc ops/cc/*/*.h ops/cc/*/*.cc tests/cpp/*.cc bench/*.cc
# Plain `pytest` (not `python -m pytest`) so the installed package is tested,
# not the checkout. Exit code 5 (no tests collected) is a failure too.
.venv/bin/pytest tests "$@"
