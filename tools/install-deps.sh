#!/usr/bin/env bash
# Installs the Debian packages Tessera builds, tests and runs with (only those missing),
# in two sets:
#
#   tools/install-deps.sh            # both sets (tools/test.sh, tools/tsan.sh)
#   tools/install-deps.sh --runtime  # the build/run set only (tools/quickstart.sh)
#
# The build/run set is what configuring with -DTESSERA_BUILD_TESTS=OFF, building the
# target tessera-runtime and running the quick-start job need; the test/tool set is
# what the tests, fuzzers, benchmarks, launchers' tests and tools add.
# Runs apt-get (--no-install-recommends) as root, or through sudo when not root.
set -euo pipefail

runtime_packages=(
  # Compilers, make, CMake; pkg-config for the pkg_check_modules below; ccache, through
  # which CMakeLists.txt compiles when it is there (a rebuild, or a second build folder,
  # compiles only what changed).
  build-essential cmake pkg-config ccache
  # tools/launch.py (the standard library only).
  python3
  # What CMakeLists.txt requires: ZeroMQ, libsodium, OpenSSL 3 (libcrypto),
  # protobuf and protoc, Abseil, zlib, OpenBLAS (the worker without a GPU) and
  # cpp-httplib (the metrics endpoint, TESSERA_METRICS_PORT).
  libzmq3-dev libsodium-dev libssl-dev libprotobuf-dev protobuf-compiler libabsl-dev
  zlib1g-dev libopenblas-dev libcpp-httplib-dev
  # The quick-start job's data (/usr/share/datasets/fashion-mnist).
  dataset-fashion-mnist
)

test_packages=(
  # The tests (GoogleTest) and GNU MPFR, the reference for the server's exact round sums.
  libgtest-dev libgmock-dev libmpfr-dev
  # Tests and tools of metrics and traces: scrapes (curl), their validation
  # (promtool, from prometheus) and tools/plot.py's figures (matplotlib).
  curl prometheus python3-matplotlib
  # The Python package (python/tessera), its examples and tests; pip installs it
  # offline (tests/install: pip install --no-build-isolation ./python).
  python3-numpy python3-torch python3-pytest python3-pip python3-setuptools python3-wheel
  # Multi-host tests and launchers.
  iproute2 openssh-server openssh-client rsync openmpi-bin nftables
  # The slurm launcher's test (tests/multihost/slurm_test.py): slurmctld, slurmd, srun.
  slurm-wlm munge
  # Network-fault tests (tests/faults): NFQUEUE rules (iptables) and tools/netfault/nfq_delay.
  iptables libnetfilter-queue-dev
  # tools/test.sh's thread-safety build and the fuzzers.
  clang libclang-rt-14-dev
  # tools/tsan.sh: apt-get source (dpkg-source) of ZeroMQ and Abseil, built with TSan.
  dpkg-dev
)

case "${1:-}" in
  "") packages=("${runtime_packages[@]}" "${test_packages[@]}"); what="build/run and test/tool sets" ;;
  --runtime) packages=("${runtime_packages[@]}"); what="build/run set" ;;
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "install-deps: unknown argument '$1' (use no argument, or --runtime)" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages of the $what present"
  exit 0
fi
echo "install-deps: installing ${#missing[@]} of the ${#packages[@]} packages of the $what: ${missing[*]}"
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
