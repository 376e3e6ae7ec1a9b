#!/usr/bin/env bash
# Installs the Debian packages Tessera builds, tests and runs with (only those missing).
# Runs apt-get as root, or through sudo when not root.
set -euo pipefail

packages=(
  build-essential cmake pkg-config python3
  libzmq3-dev cppzmq-dev libsodium-dev libssl-dev libprotobuf-dev protobuf-compiler libabsl-dev
  libgtest-dev libgmock-dev libopenblas-dev zlib1g-dev
  # The metrics endpoint (TESSERA_METRICS_PORT).
  libcpp-httplib-dev
  # Tests and tools of metrics and traces: scrapes (curl), their validation
  # (promtool, from prometheus) and tools/plot.py's figures (matplotlib).
  curl prometheus python3-matplotlib
  # Tests: GNU MPFR is the reference for the server's exact round sums.
  libmpfr-dev
  dataset-fashion-mnist
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
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
