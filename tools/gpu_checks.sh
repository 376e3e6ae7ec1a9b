#!/usr/bin/env bash
# The checks that need a GPU, as one run on a lent GPU machine (docs/testing.md, "On a
# GPU"): builds Tessera with CUDA for the device, runs the gpu-labelled tests and their
# host twins, the CUDA tests under compute-sanitizer's memcheck, tessera-codec-bench (its
# GPU half: the 2-bit kernels beside a device-to-device copy, and a gradient's trip to
# the host with and without compression), and the training job on the GPU beside the
# same job on the CPU, on the same machine; then tools/bench/cpu_checks.sh, the CPU-bound
# targets two cores cannot settle (sealed 1 MB push/pull and the 4 KB round trip beside
# raw ZeroMQ, a row push + pull per byte beside raw ZeroMQ), on the machine's 16 cores.
#
#   source .device/activate.sh && tools/gpu_checks.sh      # on the GPU machine
#
# Writes its log and the figures under $OUT (or /tmp/tessera-gpu). Exits non-zero when
# the build or a test fails; the benchmarks only print. GPU_CHECKS=train builds the
# daemons and the worker only and runs the training jobs alone; GPU_CHECKS=cpu the CPU
# measurements alone (cpu_checks.sh, RUNS of each comparison: 3).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${OUT:-/tmp/tessera-gpu}
mkdir -p "$out"
build=${BUILD_DIR:-build-gpu}
arch=${CUDA_ARCH:-90}
jobs=$(nproc)
status=0
stamp() { echo "== $(date +%T) $*"; }

stamp "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc; lscpu | grep -m1 'Model name'

stamp "configure (CUDA arch $arch)"
# Unpacked packages (the GPU machine's .device) lack the -dev files of libzmq's private
# requirements (Kerberos, PGM, NORM, libbsd), which pkg-config insists on: give it a
# libzmq.pc without them.
if ! pkg-config --exists libzmq; then
  for d in ${PKG_CONFIG_PATH//:/ }; do
    [ -f "$d/libzmq.pc" ] || continue
    mkdir -p /tmp/tessera-pc
    grep -v '^Requires.private' "$d/libzmq.pc" >/tmp/tessera-pc/libzmq.pc
    export PKG_CONFIG_PATH="/tmp/tessera-pc:$PKG_CONFIG_PATH"
    break
  done
fi
cmake -S . -B "$build" -DTESSERA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" >"$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; exit 1; }
grep -i 'cuda' "$out/configure.log" | tail -3

tests=(two_bit_gpu_test model_mlp_cuda_test gpu_codec_bench_test two_bit_kernels_test
  model_mlp_kernels_test two_bit_test model_mlp_test)
stamp "build"
targets=(tessera-worker tessera-server tessera-scheduler tessera-keygen)
[ "${GPU_CHECKS:-all}" = all ] && targets+=("${tests[@]}" tessera-codec-bench)
case "${GPU_CHECKS:-all}" in all | cpu) targets+=(tessera-bench seed_step_bench ps_bound_bench) ;; esac
cmake --build "$build" -j "$jobs" --target "${targets[@]}" >"$out/build.log" 2>&1 ||
  { grep -B2 -A8 -m5 'error' "$out/build.log"; tail -20 "$out/build.log"; exit 1; }

if [ "${GPU_CHECKS:-all}" = all ]; then
stamp "tests"
(cd "$build" && ctest --output-on-failure --timeout 300 -R "^($(IFS='|'; echo "${tests[*]}"))\$") ||
  status=1

stamp "compute-sanitizer memcheck"
command -v compute-sanitizer >/dev/null || echo "compute-sanitizer: not on PATH; skipped"
command -v compute-sanitizer >/dev/null && for t in tests/compression/two_bit_gpu_test tests/model/model_mlp_cuda_test; do
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$build/$t" \
    >"$out/memcheck-$(basename "$t").log" 2>&1
  rc=$?
  echo "$(basename "$t") under memcheck: exit $rc; $(grep -m1 'ERROR SUMMARY' \
    "$out/memcheck-$(basename "$t").log")"
  [ "$rc" = 0 ] || status=1
done

stamp "tessera-codec-bench"
"$build/tests/compression/tessera-codec-bench" --max-mb=256

fi  # GPU_CHECKS=all

if [ "${GPU_CHECKS:-all}" = all ] || [ "${GPU_CHECKS:-all}" = cpu ]; then
  stamp "CPU-bound targets on $(nproc) cores (tools/bench/cpu_checks.sh; log in cpu.log)"
  BUILD_DIR="$build" tools/bench/cpu_checks.sh 2>&1 | tee "$out/cpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  [ "${GPU_CHECKS:-all}" = cpu ] && { stamp "done, status $status"; exit "$status"; }
fi

stamp "training: 2 workers, 1 server, 3 epochs, secured (launch.py's default)"
export TESSERA_BUILD_DIR="$root/$build"
logs=/tmp/tessera-gpu-logs  # the jobs' logs (not in $OUT: at most 8 files come back)
mkdir -p "$logs"
for device in cuda cpu; do
  for gc in none 2bit; do
   for fuse in off on; do
    rm -f "$out"/m-*.json
    start=$(date +%s.%N)
    python3 tools/launch.py -n 2 -s 1 --launcher local "$build/worker/tessera-worker" \
      --device "$device" --kv-store dist_sync --gc-type "$gc" --gc-threshold 1 \
      --lr 0.3 --momentum 0 --lr-step-epochs 12 --epochs 3 --fuse-keys "$fuse" \
      --metrics-out "$out/m-{rank}.json" >"$logs/train-$device-$gc-$fuse.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    [ "$rc" = 0 ] || { status=1; tail -15 "$logs/train-$device-$gc-$fuse.log"; }
    python3 - "$device" "$gc" "$rc" "$start" "$end" "$out" "$fuse" <<'EOF'
import glob, json, sys
device, gc, rc, start, end, out, fuse = sys.argv[1:]
gc = gc + (' fused' if fuse == 'on' else '')
ms = [json.load(open(p)) for p in sorted(glob.glob(out + '/m-*.json'))]
if not ms:
    print('%s %s: exit %s, no metrics' % (device, gc, rc)); sys.exit()
avg = lambda k: sum(m.get(k, 0) for m in ms) / len(ms)
r0 = next((m for m in ms if m.get('rank') == 0), ms[0])
print('%-4s gc=%-10s exit %s job %.1f s | samples/s %.0f | per worker: compute %.2f s '
      'issue %.2f s comm %.2f s data %.2f s | accuracy %.4f loss %.4f' % (
          device, gc, rc, float(end) - float(start),
          sum(m.get('samples_per_second', 0) for m in ms), avg('time_compute_s'),
          avg('time_issue_s'), avg('time_comm_s'), avg('time_data_s'),
          r0.get('test_accuracy', -1), r0.get('final_loss', -1)))
EOF
   done
  done
done
rm -f "$out"/m-*.json
stamp "done, status $status"
exit "$status"
