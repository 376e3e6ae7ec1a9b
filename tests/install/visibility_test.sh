#!/usr/bin/env bash
# libtessera.so exports its public API and nothing else (include/tessera/export.h).
# Every defined dynamic symbol (nm -D --defined-only) must be
#   - a C function that include/tessera/c_api.h declares TESSERA_EXPORT, or
#   - a member, vtable or type_info of a class include/tessera marks
#     TESSERA_EXPORT (tessera::KVWorker, tessera::PulledValue),
# and every function c_api.h declares, KVWorker::Create and KVWorker's vtable
# and type_info must be there. So it fails when an internal symbol leaks
# (tessera::Node, KVClient, RequestTracker, the protobuf messages of
# tessera::wire, Abseil's or the standard library's templates, a static
# library's symbols) and when a public one is missing.
# Usage: visibility_test.sh LIBTESSERA INCLUDE_DIR
set -euo pipefail
lib=$1
include=$2
for tool in nm c++filt; do
  command -v "$tool" >/dev/null || { echo "visibility_test: $tool not found (binutils)"; exit 1; }
done

# The C API: TESSERA_EXPORT declarations in c_api.h (not names in comments).
c_api=$(sed -n 's/^TESSERA_EXPORT [^(]*\b\(tessera_[a-z0-9_]*\)(.*/\1/p' "$include/tessera/c_api.h" | sort -u)
[ -n "$c_api" ] || { echo "visibility_test: no TESSERA_EXPORT functions in $include/tessera/c_api.h"; exit 1; }
# The exported C++ classes.
classes=$(cat "$include"/tessera/*.h | sed -n 's/^\(class\|struct\) TESSERA_EXPORT \([A-Za-z0-9_]*\).*/\2/p' | sort -u)
[ -n "$classes" ] || { echo "visibility_test: no TESSERA_EXPORT classes in $include/tessera"; exit 1; }
class_re=$(echo "$classes" | paste -sd '|')
cpp_re="^(tessera::($class_re)::|(vtable|typeinfo|typeinfo name|VTT|construction vtable) for tessera::($class_re)\$)"
# What the linker itself defines in every shared library.
linker_re='^(_init|_fini|_edata|_end|__bss_start)$'

symbols=$(nm -D --defined-only "$lib" | awk 'NF >= 3 {print $3}' | sed 's/@.*//' | sort -u)
bad=()
num_c=0
num_cpp=0
exported_cpp=""
while IFS= read -r sym; do
  if [[ $sym == _Z* ]]; then
    name=$(c++filt "$sym")
    if [[ $name =~ $cpp_re ]]; then
      num_cpp=$((num_cpp + 1))
      exported_cpp+="$name"$'\n'
    else
      bad+=("$name")
    fi
  elif grep -qxF "$sym" <<<"$c_api"; then
    num_c=$((num_c + 1))
  elif [[ ! $sym =~ $linker_re ]]; then
    bad+=("$sym")
  fi
done <<<"$symbols"

missing=()
while IFS= read -r fn; do
  grep -qxF "$fn" <<<"$symbols" || missing+=("$fn")
done <<<"$c_api"
for name in 'tessera::KVWorker::Create(' 'vtable for tessera::KVWorker' 'typeinfo for tessera::KVWorker' \
            'tessera::PulledValue::CopyTo('; do
  grep -qF "$name" <<<"$exported_cpp" || missing+=("$name")
done

echo "visibility_test: $lib exports $(wc -l <<<"$symbols") symbols:" \
     "$num_c C functions, $num_cpp of the classes $(echo $classes)"
status=0
if ((${#bad[@]})); then
  echo "visibility_test: ${#bad[@]} symbols exported that are not the public API, e.g.:"
  printf '  %s\n' "${bad[@]:0:40}"
  status=1
fi
if ((${#missing[@]})); then
  echo "visibility_test: ${#missing[@]} public symbols not exported:"
  printf '  %s\n' "${missing[@]}"
  status=1
fi
[ "$status" = 0 ] && echo "visibility_test: ok"
exit "$status"
