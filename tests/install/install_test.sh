#!/usr/bin/env bash
# Installs the build into a temporary prefix, then uses it as a user would:
#   - a C program built through pkg-config (cc prog.c $(pkg-config --cflags --libs tessera));
#   - a C++ program (KVWorker, so Abseil too) built through pkg-config, and the same
#     program and the C one built by CMake projects through find_package(Tessera) and
#     tessera::tessera;
#   - given a Python with NumPy: the tessera package as cmake installed it, and as
#     `pip install --no-build-isolation --no-deps ./python` installs it into a virtual
#     environment against that prefix (offline, Debian's python3-pip, python3-setuptools
#     and python3-wheel); each must load the installed libtessera and report the version
#     in VERSION.
# Every program runs: it reads the version and fails to join a job (no DMLC_*), which
# must give InvalidArgument with its code and message.
# Usage: install_test.sh BUILD_DIR [PYTHON [SOURCE_DIR]]
set -euo pipefail
build=$(cd "$1" && pwd)
python=${2:-}
src=${3:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
version=$(head -1 "$src/VERSION")
tmp=$(mktemp -d /tmp/tessera-install-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "install_test: $*"; exit 1; }
expect() {  # expect WHAT EXPECTED ACTUAL
  [ "$3" = "$2" ] || { printf 'install_test: %s: unexpected output\n%s\nexpected:\n%s\n' "$1" "$3" "$2"; exit 1; }
}

cmake --install "$build" --prefix "$prefix" >/dev/null
for f in bin/tessera-scheduler bin/tessera-server bin/tessera-worker bin/tessera-launch bin/tessera-keygen \
         include/tessera/c_api.h include/tessera/kv_worker.h include/tessera/export.h; do
  [ -e "$prefix/$f" ] || fail "$f was not installed"
done
pc=$(find "$prefix" -name tessera.pc | head -1)
[ -n "$pc" ] || fail "tessera.pc was not installed"
config=$(find "$prefix" -name TesseraConfig.cmake | head -1)
[ -n "$config" ] || fail "TesseraConfig.cmake was not installed"
for f in TesseraConfigVersion.cmake TesseraTargets.cmake; do
  [ -e "$(dirname "$config")/$f" ] || fail "$f was not installed beside TesseraConfig.cmake"
done
export PKG_CONFIG_PATH=$(dirname "$pc")
libdir=$(pkg-config --variable=libdir tessera)
lib=$(readlink -f "$libdir/libtessera.so.0")
[ "$(pkg-config --modversion tessera)" = "$version" ] || fail "tessera.pc says version $(pkg-config --modversion tessera), VERSION $version"
no_job="INVALID_ARGUMENT: DMLC_ROLE is not set: expected scheduler, server or worker"

# --- C through pkg-config -------------------------------------------------------------
mkdir "$tmp/c"
cat > "$tmp/c/prog.c" <<'C'
#include <stdio.h>
#include <tessera/c_api.h>
int main(void) {
  float g[8] = {0.6f, -0.7f, 0.2f, 0.5f, -0.5f, 0.49f, 1.0f, -2.0f}, r[8] = {0};
  unsigned char out[4];
  if (tessera_2bit_quantize(g, r, 8, 0.5f, out) != TESSERA_OK) return 1;
  printf("%zu %02X %02X %02X %02X\n", tessera_2bit_compressed_bytes(17), out[0], out[1], out[2], out[3]);
  TesseraKV* kv;
  int code = tessera_kv_create("dist_sync", &kv); /* no DMLC_* set: must fail */
  printf("%s %d %s\n", tessera_version(), code, tessera_last_error());
  return code == TESSERA_INVALID_ARGUMENT ? 0 : 1;
}
C
# shellcheck disable=SC2046
cc -Wall -Werror "$tmp/c/prog.c" -o "$tmp/c/prog" $(pkg-config --cflags --libs tessera)
out=$(env -u DMLC_ROLE LD_LIBRARY_PATH="$libdir" "$tmp/c/prog")
echo "$out"
expect "C program (pkg-config)" $'8 E3 8E 00 00\n'"$version 3 $no_job" "$out"

# --- C++ through pkg-config -----------------------------------------------------------
mkdir "$tmp/cpp"
cat > "$tmp/cpp/prog.cc" <<'CPP'
#include <iostream>
#include <memory>

#include <tessera/c_api.h>
#include <tessera/kv_worker.h>

int main() {
  absl::StatusOr<std::unique_ptr<tessera::KVWorker>> kv =
      tessera::KVWorker::Create("dist_sync");  // no DMLC_* set: must fail
  if (kv.ok()) return 1;
  // operator<< of a Status is Abseil's own: the program links Abseil itself.
  std::cout << tessera_version() << " " << static_cast<int>(kv.status().code())
            << " " << kv.status() << "\n";
  return 0;
}
CPP
# shellcheck disable=SC2046
c++ -std=c++17 -Wall -Werror "$tmp/cpp/prog.cc" -o "$tmp/cpp/prog" $(pkg-config --cflags --libs tessera)
out=$(env -u DMLC_ROLE LD_LIBRARY_PATH="$libdir" "$tmp/cpp/prog")
echo "$out"
expect "C++ program (pkg-config)" "$version 3 $no_job" "$out"

# --- C++ and C through find_package(Tessera) ----------------------------------------
mkdir "$tmp/cmake"
cp "$tmp/cpp/prog.cc" "$tmp/c/prog.c" "$tmp/cmake/"
cat > "$tmp/cmake/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.22)
project(tessera_consumer LANGUAGES C CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(Tessera $version EXACT REQUIRED)
add_executable(cpp_prog prog.cc)
target_link_libraries(cpp_prog PRIVATE tessera::tessera)
add_executable(c_prog prog.c)
target_link_libraries(c_prog PRIVATE tessera::tessera)
CMAKE
# Only the prefix is named: the package, its target and its library come from there.
cmake -S "$tmp/cmake" -B "$tmp/cmake/build" -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_BUILD_TYPE=Release >"$tmp/cmake/log" 2>&1 || { cat "$tmp/cmake/log"; fail "find_package(Tessera) failed"; }
cmake --build "$tmp/cmake/build" >>"$tmp/cmake/log" 2>&1 || { cat "$tmp/cmake/log"; fail "building against tessera::tessera failed"; }
# CMake gives the programs the library's directory as their RUNPATH.
out=$(env -u DMLC_ROLE -u LD_LIBRARY_PATH "$tmp/cmake/build/cpp_prog")
echo "$out"
expect "C++ program (find_package)" "$version 3 $no_job" "$out"
out=$(env -u DMLC_ROLE -u LD_LIBRARY_PATH "$tmp/cmake/build/c_prog")
expect "C program (find_package)" $'8 E3 8E 00 00\n'"$version 3 $no_job" "$out"
[ "$(ldd "$tmp/cmake/build/cpp_prog" | awk '$1 == "libtessera.so.0" {print $3}' | xargs readlink -f)" = "$lib" ] \
  || fail "the find_package program does not load $lib: $(ldd "$tmp/cmake/build/cpp_prog" | grep tessera)"

# --- Python ---------------------------------------------------------------------------
if [ -z "$python" ] || ! "$python" -c 'import numpy' 2>/dev/null; then
  echo "install_test: no Python with NumPy given; the Python package was not checked"
  echo "install_test: ok"
  exit 0
fi
# Imports the package in a clean environment, from /, and prints what it found.
check_python() {  # check_python WHAT INTERPRETER [PYTHONPATH]
  local out expected
  out=$(cd / && env -u DMLC_ROLE -u TESSERA_LIBRARY -u TESSERA_BUILD_DIR -u LD_LIBRARY_PATH \
        PYTHONPATH="${3:-}" "$2" -c 'import os, tessera
try:
    tessera.KVStore("dist_sync")
except tessera.TesseraError as e:
    print(e)
print(tessera.__file__)
print(os.path.realpath(tessera.library_path()))
print(tessera.__version__, tessera.library_version())
print(callable(tessera.KVStore.set_pull_compression))')
  echo "$out"
  expected="$no_job
$4/tessera/__init__.py
$lib
$version $version
True"
  expect "$1" "$expected" "$out"
}

init=$(find "$prefix" -path '*/tessera/__init__.py' | head -1)
[ -n "$init" ] || fail "the tessera Python package was not installed"
site=$(dirname "$(dirname "$init")")
check_python "Python package (cmake --install)" "$python" "$site" "$site"

# pip, offline, into a virtual environment that sees the system's NumPy; from a copy
# of python/ and VERSION, so the build writes nothing into the source tree.
{ "$python" -c 'import setuptools, wheel' && "$python" -m pip --version; } >/dev/null 2>&1 \
  || fail "$python lacks pip, setuptools or wheel (Debian: python3-pip python3-setuptools python3-wheel)"
mkdir "$tmp/src"
cp -r "$src/python" "$src/VERSION" "$tmp/src/"
rm -rf "$tmp/src/python/build" "$tmp/src/python/"*.egg-info
"$python" -m venv --system-site-packages --without-pip "$tmp/venv"
PIP_NO_INDEX=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
  "$tmp/venv/bin/python" -m pip install --quiet --no-build-isolation --no-deps "$tmp/src/python" \
  >"$tmp/pip.log" 2>&1 || { cat "$tmp/pip.log"; fail "pip install ./python failed"; }
venv_site=$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
check_python "Python package (pip install ./python)" "$tmp/venv/bin/python" "" "$venv_site"
echo "install_test: ok"
