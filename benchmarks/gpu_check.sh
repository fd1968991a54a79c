#!/usr/bin/env bash
# One prepared run for a lent GPU machine (see "GPU check" in benchmarks/README.md). Every stage runs under its own
# timeout and writes its logs and JSON to $OUT; a failed stage is recorded and the next one still runs. The whole
# script stays under 9 minutes.
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run   # on a CPU: the same stages with a tiny model (checks the plumbing)
set -u
cd "$(dirname "$0")/.."
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; fi
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's rollout, installed or not
export TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python}"
STATUS="$OUT/stages.txt"
: > "$STATUS"

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start)) limit=$limit" | tee -a "$STATUS"
}

stage env 45 "$PY" benchmarks/gpu_check.py env --out "$OUT" $DRY
stage tests 150 "$PY" -m pytest tests/engine/worker/test_gpu.py -q -p no:cacheprovider --junitxml="$OUT/test_gpu.xml"
stage syncs 75 "$PY" benchmarks/gpu_check.py syncs --out "$OUT" $DRY
stage bench 200 "$PY" benchmarks/gpu_check.py bench --out "$OUT" $DRY
stage table 20 "$PY" benchmarks/gpu_check_table.py --out "$OUT"
cat "$OUT/table.md" 2>/dev/null
cat "$STATUS"
# rc 0 only when every stage finished (tests may fail or skip: their counts are in the table)
! grep -qE "^(env|syncs|bench|table) rc=[^0]" "$STATUS"
