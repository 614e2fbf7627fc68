#!/usr/bin/env bash
# The main job: set up, then run the example on local shard server processes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh" requirements/build.txt
cd "$ROOT"
.venv/bin/python examples/shard_round_trip.py "$@"
