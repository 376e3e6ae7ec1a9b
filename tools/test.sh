#!/usr/bin/env bash
# Installs what is missing, configures, builds and runs every test with ctest.
# Exits non-zero on any failure.
#
#   tools/test.sh                  # everything
#   BUILD_DIR=build-asan TESSERA_SANITIZE=address tools/test.sh
#   CTEST_ARGS="-L multihost" tools/test.sh
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

cd "$build"
# shellcheck disable=SC2086
ctest --output-on-failure --timeout 900 ${CTEST_ARGS:-}
