#!/usr/bin/env bash
# Runs the probe for all three engines, one process at a time, and deletes the data afterwards.
# Usage: bench/tier_probe/run.sh RUN_LABEL [extra probe flags, e.g. --n=200000]
# Env: PROBE (binary, default /work/tier_probe_build/probe), DATA_PARENT (default /work).
set -euo pipefail
label=${1:?label}; shift
here=$(cd "$(dirname "$0")" && pwd)
probe=${PROBE:-/work/tier_probe_build/probe}
logdir=$here/../out/tier_probe/$label; mkdir -p "$logdir"  # raw output stays out of git
data=$(mktemp -d "${DATA_PARENT:-/work}/tier_probe_data.XXXXXX")
trap 'rm -rf "$data"' EXIT
{ echo "== $(date -u +%FT%TZ) nproc=$(nproc)"; free -g; df -h "$data"; } > "$logdir/machine.txt"
for e in ${ENGINES:-rocksdb lmdb pagehash lmdb_nordahead}; do
  sync; echo 3 > /proc/sys/vm/drop_caches || echo "drop_caches failed"
  /usr/bin/time -v "$probe" --engine=$e --dir="$data/$e" "$@" > "$logdir/$e.log" 2> "$logdir/$e.time"
  df -h "$data" >> "$logdir/machine.txt"
  rm -rf "${data:?}/$e"
  grep '^RESULT' "$logdir/$e.log" | sed 's/^RESULT //'
done
