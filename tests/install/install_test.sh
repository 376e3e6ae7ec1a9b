#!/usr/bin/env bash
# Installs the build into a temporary prefix, then builds a C program against it the
# way the README says (cc prog.c $(pkg-config --cflags --libs tessera)) and runs it; and,
# given a Python with NumPy, imports the installed tessera package, which must load the
# installed libtessera.
# Usage: install_test.sh BUILD_DIR [PYTHON]
set -euo pipefail
build=$1
python=${2:-}
prefix=$(mktemp -d /tmp/tessera-install-XXXXXX)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in bin/tessera-scheduler bin/tessera-server bin/tessera-worker bin/tessera-launch bin/tessera-keygen \
         include/tessera/c_api.h \
         include/tessera/kv_worker.h; do
  [ -e "$prefix/$f" ] || { echo "install_test: $f was not installed"; exit 1; }
done
pc=$(find "$prefix" -name tessera.pc | head -1)
[ -n "$pc" ] || { echo "install_test: tessera.pc was not installed"; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$pc")
cat > "$prefix/prog.c" <<'C'
#include <stdio.h>
#include <tessera/c_api.h>
int main(void) {
  float g[8] = {0.6f, -0.7f, 0.2f, 0.5f, -0.5f, 0.49f, 1.0f, -2.0f}, r[8] = {0};
  unsigned char out[4];
  if (tessera_2bit_quantize(g, r, 8, 0.5f, out) != 0) return 1;
  printf("%zu %02X %02X %02X %02X\n", tessera_2bit_compressed_bytes(17), out[0], out[1], out[2], out[3]);
  TesseraKV* kv;
  if (tessera_kv_create("dist_sync", &kv) == 0) return 1; /* no DMLC_* set: must fail */
  printf("%s\n", tessera_last_error());
  return 0;
}
C
# shellcheck disable=SC2046
cc "$prefix/prog.c" -o "$prefix/prog" $(pkg-config --cflags --libs tessera)
out=$(env -u DMLC_ROLE LD_LIBRARY_PATH="$(pkg-config --variable=libdir tessera)" "$prefix/prog")
echo "$out"
expected=$'8 E3 8E 00 00\nINVALID_ARGUMENT: DMLC_ROLE is not set: expected scheduler, server or worker'
[ "$out" = "$expected" ] || { echo "install_test: unexpected output; expected:"; echo "$expected"; exit 1; }

if [ -n "$python" ] && "$python" -c 'import numpy' 2>/dev/null; then
  init=$(find "$prefix" -path '*/tessera/__init__.py' | head -1)
  [ -n "$init" ] || { echo "install_test: the tessera Python package was not installed"; exit 1; }
  site=$(dirname "$(dirname "$init")")
  out=$(cd / && env -u DMLC_ROLE -u TESSERA_LIBRARY -u TESSERA_BUILD_DIR PYTHONPATH="$site" \
        "$python" -c 'import tessera
try:
    tessera.KVStore("dist_sync")
except tessera.TesseraError as e:
    print(e)
print(tessera.__file__)
import os; print(os.path.realpath(tessera.library_path()))')
  echo "$out"
  expected="INVALID_ARGUMENT: DMLC_ROLE is not set: expected scheduler, server or worker
$site/tessera/__init__.py
$(readlink -f "$(pkg-config --variable=libdir tessera)/libtessera.so.0")"
  [ "$out" = "$expected" ] || { echo "install_test: unexpected Python output; expected:"; echo "$expected"; exit 1; }
else
  echo "install_test: no Python with NumPy given; the Python package was not checked"
fi
echo "install_test: ok"
