#!/usr/bin/env bash
# The CPU-bound targets that two cores cannot settle (issue #44, item 8), as one short
# run on a machine with more cores: tools/gpu_checks.sh calls it on the lent 16-core GPU
# machine; it runs anywhere with a built BUILD_DIR. Each figure is printed beside its
# same-run raw baseline:
#
#   1. security: tools/bench/security_ab.py (tessera-bench, 1 server + 1 worker on
#      loopback, insecure / authenticated / sealed alternated and rotated, RUNS runs):
#      the sealed 1 MB blocking push and pull over the same run's plain raw ZeroMQ
#      one-way stream (target >= 0.5x), and the 4 KB pushpull round trip over the raw
#      4 KB round trip (target <= 1.2x).
#   2. rows: tools/bench/seed_step.py --okrows 25000 --ok-keys 250000 --overlap
#      --security none: a row push + pull of 25,000 rows of a 250,000-row key beside
#      raw ZeroMQ's rate for the same bytes (target >= 0.8x per byte), and
#      ps_bound_bench (the same bytes through a protocol-free server) beside its own raw
#      stream.
#
#   BUILD_DIR=build-gpu tools/bench/cpu_checks.sh      # RUNS (3) per comparison
#
# Exits non-zero when a program fails; the targets only print (a benchmark, not a test).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
build=$(cd "${BUILD_DIR:-build}" && pwd)
runs=${RUNS:-3}
status=0
stamp() { echo "== $(date +%T) cpu_checks: $*"; }
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "cpu_checks.sh: RUNS='$runs': expected a whole number >= 1" >&2; exit 2; }
for b in tools/bench/tessera-bench tools/bench/seed_step_bench tools/bench/ps_bound_bench \
         scheduler/tessera-scheduler server/tessera-server; do
  [ -x "$build/$b" ] || { echo "cpu_checks.sh: $build/$b is missing: build the targets" \
    "tessera-bench seed_step_bench ps_bound_bench tessera-runtime" >&2; exit 2; }
done

stamp "$(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1), load $(cut -d' ' -f1-3 /proc/loadavg)"

stamp "1. security: security_ab.py --runs $runs (sealed 1 MB blocking >= 0.5x plain raw; 4 KB round trip <= 1.2x raw)"
python3 tools/bench/security_ab.py --runs "$runs" --bench "$build/tools/bench/tessera-bench" || status=1

stamp "2. rows: seed_step.py --okrows 25000 --ok-keys 250000 --overlap --security none (TESSERA_INSECURE=1), $runs runs"
for ((k = 1; k <= runs; k++)); do
  python3 tools/bench/seed_step.py --modes '' --okrows 25000 --ok-keys 250000 \
    --security none --overlap --build "$build" || status=1
  "$build/tools/bench/ps_bound_bench" --runs=1 --mb=205 || status=1
done
stamp "done, status $status"
exit "$status"
