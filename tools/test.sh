#!/usr/bin/env bash
# Installs what is missing, configures, builds and runs every test with ctest,
# then checks the thread-safety annotations with a clang build
# (-Wthread-safety as errors, in $BUILD_DIR-thread-safety). Exits non-zero on
# any failure.
#
#   tools/test.sh                  # everything
#   BUILD_DIR=build-asan TESSERA_SANITIZE=address tools/test.sh
#   CTEST_ARGS="-L multihost" tools/test.sh
#   TESSERA_THREAD_SAFETY_BUILD=0 tools/test.sh   # skip the clang build
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}

tools/install-deps.sh

cmake_args=(-S . -B "$build" -DTESSERA_BUILD_TESTS=ON -DTESSERA_WERROR=ON)
[ -n "${TESSERA_ENABLE_CUDA:-}" ] && cmake_args+=(-DTESSERA_ENABLE_CUDA="$TESSERA_ENABLE_CUDA")
[ -n "${TESSERA_SANITIZE:-}" ] && cmake_args+=(-DTESSERA_SANITIZE="$TESSERA_SANITIZE")
cmake "${cmake_args[@]}"
cmake --build "$build" -j "$jobs"

(
  cd "$build"
  # shellcheck disable=SC2086
  ctest --output-on-failure --timeout 900 ${CTEST_ARGS:-}
)

if [ "${TESSERA_THREAD_SAFETY_BUILD:-1}" != 0 ]; then
  # Every ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED is a checked claim.
  CC=clang CXX=clang++ cmake -S . -B "$build-thread-safety" -DTESSERA_BUILD_TESTS=ON \
    -DTESSERA_THREAD_SAFETY=ON -DTESSERA_WERROR=ON -DTESSERA_ENABLE_CUDA=OFF
  cmake --build "$build-thread-safety" -j "$jobs"
  echo "test.sh: thread-safety analysis (clang -Wthread-safety) passed"
fi
