#!/usr/bin/env bash
# The main job: set up, then train the CTR example on the embedded tables.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh" requirements/build.txt
cd "$ROOT"
.venv/bin/python examples/ctr_main.py "$@"
