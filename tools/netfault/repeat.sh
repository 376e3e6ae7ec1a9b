#!/usr/bin/env bash
# Runs the network-fault test N times in a row (default 20) and reports how many
# passed. Not part of CI (each run takes about 80-100 s); it is how the
# test's reliability is measured (docs/faults.md). The output of each failed run,
# which names the folder holding every process's full log, is kept in
# $OUT_DIR/run-K.log.
#
#   tools/netfault/repeat.sh            # 20 runs against ./build
#   BUILD_DIR=build-ci tools/netfault/repeat.sh 5
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
runs=${1:-20}
build=$(cd "${BUILD_DIR:-$root/build}" && pwd)
out=${OUT_DIR:-$(mktemp -d /tmp/tessera-netfault-repeat-XXXXXX)}
mkdir -p "$out"
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "repeat.sh: N='$runs': expected a whole number >= 1" >&2; exit 2; }

passed=0
failed=()
start=$(date +%s)
for ((k = 1; k <= runs; k++)); do
  t0=$(date +%s)
  log="$out/run-$k.log"
  (cd "$build" && ctest -R '^netfault_test$' --output-on-failure --timeout 600) >"$log" 2>&1
  rc=$?
  if ((rc == 0)) && grep -q "SKIPPED" "$log"; then
    echo "repeat.sh: netfault_test skipped (needs root and namespaces): $(grep -m1 SKIPPED "$log")" >&2
    exit 2
  fi
  if ((rc == 0)); then
    passed=$((passed + 1))
    echo "run $k/$runs: passed in $(($(date +%s) - t0)) s"
    rm -f "$log"
  else
    failed+=("$k")
    echo "run $k/$runs: FAILED in $(($(date +%s) - t0)) s; output in $log"
    grep -m1 "logs of every process are kept in" "$log" || true
  fi
done
echo "repeat.sh: $passed of $runs runs passed in $(($(date +%s) - start)) s${failed:+; failed: ${failed[*]}}"
((passed == runs))
