#!/usr/bin/env bash
# Quick start on a fresh Debian machine: installs the packages, builds Tessera, and runs
# the main job: a local cluster (2 workers, 1 server) training an MLP on Fashion-MNIST
# with dist_sync and 2-bit gradient compression.
#
#   tools/quickstart.sh                # install, build, train
#   EPOCHS=3 tools/quickstart.sh       # a shorter run
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${BUILD_DIR:-build}

tools/install-deps.sh
cmake -S . -B "$build" -DTESSERA_BUILD_TESTS=OFF
cmake --build "$build" -j "$(nproc)" --target tessera-scheduler tessera-server tessera-worker

exec python3 tools/launch.py -n 2 -s 1 --launcher local \
  "$build/worker/tessera-worker" \
  --kv-store dist_sync --gc-type 2bit --gc-threshold "${GC_THRESHOLD:-1}" \
  --lr 0.3 --momentum 0 --lr-step-epochs 12 --fuse-keys on \
  --epochs "${EPOCHS:-15}" --metrics-out "$build/quickstart-metrics-{rank}.json"
