#!/usr/bin/env bash
# Installs what is missing, configures, builds and runs every test with ctest,
# then checks the thread-safety annotations with a clang build
# (-Wthread-safety as errors, in $BUILD_DIR-thread-safety). Exits non-zero on
# any failure; prints each phase's time last.
#
#   tools/test.sh                  # everything, CI's tier
#   tools/test.sh --long           # and the long tier: netfault_test's membership scenes
#                                  # under faults and the one-copy leave scene again and
#                                  # again (NETFAULT_ONE_COPY_RUNS, 5); docs/testing.md
#   BUILD_DIR=build-asan TESSERA_SANITIZE=address tools/test.sh
#   CTEST_ARGS="-L multihost" tools/test.sh
#   TESSERA_THREAD_SAFETY_BUILD=0 tools/test.sh   # skip the clang build
#   TESSERA_UNITY_BUILD=OFF tools/test.sh          # one compilation per source file
#
# Both builds are unity builds (CMAKE_UNITY_BUILD, as tools/quickstart.sh's, whose
# objects ccache then reuses): each target's sources compiled in batches, the
# Protocol Buffers, Abseil and GoogleTest headers parsed once a batch.
#
# ctest runs JOBS (nproc) tests at a time; the tests that build network namespaces or
# load the machine (RUN_SERIAL in their CMakeLists) run alone.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
for arg in "$@"; do
  case "$arg" in
    --long) export NETFAULT_LONG=1 ;;
    *) echo "test.sh: unknown argument '$arg': expected --long (or none)" >&2; exit 2 ;;
  esac
done
now() { date +%s; }
phases=()
t0=$(now)
phase() {  # name: the time since the last phase ended
  phases+=("$1 $(($(now) - t0)) s")
  t0=$(now)
}

tools/install-deps.sh
phase "install"

unity=${TESSERA_UNITY_BUILD:-ON}
cmake_args=(-S . -B "$build" -DTESSERA_BUILD_TESTS=ON -DTESSERA_WERROR=ON
  -DCMAKE_UNITY_BUILD="$unity")
[ -n "${TESSERA_ENABLE_CUDA:-}" ] && cmake_args+=(-DTESSERA_ENABLE_CUDA="$TESSERA_ENABLE_CUDA")
[ -n "${TESSERA_SANITIZE:-}" ] && cmake_args+=(-DTESSERA_SANITIZE="$TESSERA_SANITIZE")
cmake "${cmake_args[@]}"
cmake --build "$build" -j "$jobs"
phase "build"

ctest_rc=0
(
  cd "$build"
  # shellcheck disable=SC2086
  ctest --output-on-failure --timeout 900 -j "$jobs" ${CTEST_ARGS:-}
) || ctest_rc=$?
phase "ctest${NETFAULT_LONG:+ (long tier)}"
if [ "$ctest_rc" -ne 0 ]; then
  echo "test.sh: ctest failed (exit $ctest_rc); times: $(IFS=,; echo "${phases[*]}")" >&2
  exit "$ctest_rc"
fi

if [ "${TESSERA_THREAD_SAFETY_BUILD:-1}" != 0 ]; then
  # Every ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED is a checked claim.
  # The analysis is clang's front end: each file is compiled with -fsyntax-only
  # (tools/thread_safety_check.py), nothing is generated or linked but the protobuf
  # headers; the fuzzers (compiled without the analysis) are left to the main build.
  CC=clang CXX=clang++ cmake -S . -B "$build-thread-safety" -DTESSERA_BUILD_TESTS=ON \
    -DTESSERA_THREAD_SAFETY=ON -DTESSERA_WERROR=ON -DTESSERA_ENABLE_CUDA=OFF \
    -DTESSERA_CCACHE=OFF -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCMAKE_UNITY_BUILD="$unity" \
    -DCMAKE_BUILD_TYPE=None -DCMAKE_C_FLAGS="-O0 -g0" -DCMAKE_CXX_FLAGS="-O0 -g0"
  cmake --build "$build-thread-safety" -j "$jobs" --target tessera_proto
  python3 tools/thread_safety_check.py "$build-thread-safety" -j "$jobs"
  echo "test.sh: thread-safety analysis (clang -Wthread-safety) passed"
  phase "thread-safety build"
fi
echo "test.sh: times: $(IFS=,; echo "${phases[*]}")"
