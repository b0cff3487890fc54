#!/bin/bash
# The launcher, fault, rank-process, emulation, pool and heartbeat tests N times in a row (issue 48: 30 runs green),
# stopping at the first failure, whose pytest output is kept; one line a run on stdout.
#
#   bash bench/tests_in_a_row.sh 30                       # those files
#   bash bench/tests_in_a_row.sh 5 tests/cli/test_plan.py # other files
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:?usage: tests_in_a_row.sh N [TEST_FILE...]}
shift
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(tests/cli/test_launch.py tests/cli/test_run_faults.py tests/cli/test_rank_processes.py
                                 tests/emulate/test_emulate.py tests/test_dist_pool.py tests/core/test_heartbeat.py)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "start $(date -u +%FT%T) commit=$(git rev-parse --short HEAD) files: ${files[*]}"
for i in $(seq "$runs"); do
  start=$(date +%s)
  python -m pytest -q -p no:cacheprovider "${files[@]}" > "$log" 2>&1
  rc=$?
  echo "run $i rc=$rc $(( $(date +%s) - start )) s $(tail -1 "$log")"
  if [ $rc -ne 0 ]; then
    cp "$log" "tests_in_a_row_failure_$i.log"
    echo "failed: its output is in tests_in_a_row_failure_$i.log"
    exit 1
  fi
done
echo "all $runs runs passed"
