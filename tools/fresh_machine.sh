#!/usr/bin/env bash
# A fresh machine without a fresh machine: builds a minimal Debian 12 root
# (debootstrap --variant=minbase bookworm), puts a `git clone` of this repository in
# it (committed files only, as a user's clone has), and runs the README's two
# commands there in a chroot: tools/quickstart.sh, then tools/test.sh. A package or
# build target that only this machine happens to have shows up as a failure.
# The root has no CUDA toolkit (as a user's fresh Debian has not): the build falls
# back to the CPU.
#
#   sudo tools/fresh_machine.sh                    # quick start, then tools/test.sh
#   sudo tools/fresh_machine.sh --quickstart-only  # the quick start only
#   EPOCHS=3 (default) the quick start's epochs; FRESH_DIR=DIR where the root goes
#   (default: a new folder under /var/tmp); --keep leaves the root there afterwards;
#   SUMMARY=FILE where the figures go (default: DIR.summary; the logs go to DIR.logs).
#   CTEST_ARGS, JOBS and TESSERA_THREAD_SAFETY_BUILD pass on to tools/test.sh.
#
# Prints, and writes to the summary, the figures: packages in the root before,
# installed by the quick start (and by tools/test.sh), the time from starting
# tools/quickstart.sh to its training line and to the first progress line, its
# total time, the final validation accuracy, and tools/test.sh's ctest line.
# Needs root (debootstrap, mount, chroot) and Debian's archive as this host's apt
# reaches it. Unmounts everything on any exit.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

quickstart_only=0
keep=0
for arg in "$@"; do
  case "$arg" in
    --quickstart-only) quickstart_only=1 ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fresh_machine: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
if [ "$(id -u)" -ne 0 ]; then
  echo "fresh_machine: needs root (debootstrap, mount, chroot): run it with sudo" >&2
  exit 2
fi

epochs=${EPOCHS:-3}
dir=${FRESH_DIR:-$(mktemp -d /var/tmp/tessera-fresh.XXXXXX)}
mkdir -p "$dir"
# The root's "/" as on a Debian machine: mktemp makes it 0700, and then no user but
# root can reach /bin/sh (munge's postinst runs `su munge`: "su: failed to execute
# /bin/sh: Permission denied", and tools/test.sh's apt-get failed, 2026-11-28).
chmod 0755 "$dir"
dir=$(cd "$dir" && pwd)
summary=${SUMMARY:-$dir.summary}
: >"$summary"
log_dir=$dir.logs
mkdir -p "$log_dir"

say() { echo "fresh_machine: $*"; }
record() {  # record KEY VALUE...: one line of the summary, printed too
  local key=$1
  shift
  printf '%-28s %s\n' "$key:" "$*" | tee -a "$summary"
}
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }
mmss() { awk -v s="$1" 'BEGIN { printf "%d min %02d s", int(s / 60), s % 60 }'; }

# --- Cleanup on every exit: the chroot's processes, then the mounts (innermost first).
mounted=()
cleanup() {
  local rc=$?
  set +e
  # Anything still running inside the root (an interrupted job) holds its mounts.
  local p r
  for p in /proc/[0-9]*; do
    r=$(readlink "$p/root" 2>/dev/null) || continue
    if [ "$r" = "$dir" ]; then kill -KILL "${p#/proc/}" 2>/dev/null; fi
  done
  # Ours, and what the tests mounted inside (ip netns: /run/netns and its
  # namespaces), deepest first; the root's own bind mount last.
  local m pass
  for pass in 1 2 3; do  # stacked mounts take one pass each
    for m in $( (printf '%s\n' "${mounted[@]}"
                 awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts) |
               sort -u -r); do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
    done
    if grep -q " $dir " /proc/self/mounts; then
      umount "$dir" 2>/dev/null || umount -l "$dir" 2>/dev/null
    fi
    grep -q " $dir[/ ]" /proc/self/mounts || break
  done
  grep " $dir[/ ]" /proc/self/mounts | while read -r _ m _; do
    echo "fresh_machine: could not unmount $m" >&2
  done
  if [ "$keep" = 0 ] && [ -d "$dir" ]; then
    if grep -q " $dir[/ ]" /proc/self/mounts; then
      echo "fresh_machine: something is still mounted under $dir; left it there" >&2
    else
      rm -rf --one-file-system "$dir"
    fi
  elif [ -d "$dir" ]; then
    say "the root is kept in $dir"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

commit=$(git -C "$root" rev-parse --short HEAD)
record "date" "$(date -u '+%Y-%m-%d %H:%M UTC')"
record "commit" "$commit ($(git -C "$root" log -1 --format=%s HEAD | cut -c1-70))"
if [ -n "$(git -C "$root" status --porcelain --untracked-files=no)" ]; then
  say "the working tree has uncommitted changes; the check uses commit $commit without them"
fi

# --- The root ----------------------------------------------------------------------
if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
fi
# Debian's archive as this host's apt reaches it (the network may reach nothing else).
mirror=""
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
fi
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
  mirror=$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' /etc/apt/sources.list)
fi
mirror=${mirror:-http://deb.debian.org/debian}
say "debootstrap --variant=minbase bookworm $dir $mirror"
t=$(now)
if ! debootstrap --variant=minbase bookworm "$dir" "$mirror" >"$log_dir/debootstrap.log" 2>&1; then
  tail -20 "$log_dir/debootstrap.log" >&2
  echo "fresh_machine: debootstrap failed (log: $log_dir/debootstrap.log)" >&2
  exit 1
fi
record "debootstrap" "$(secs "$t" "$(now)") s ($mirror)"

# apt as on an installed bookworm: this host's sources (bookworm, -updates, -security)
# when it has them, and the settings its apt needs to reach the archive.
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  cp /etc/apt/sources.list.d/debian.sources "$dir/etc/apt/sources.list.d/debian.sources"
  rm -f "$dir/etc/apt/sources.list"
elif [ -f /etc/apt/sources.list ]; then
  cp /etc/apt/sources.list "$dir/etc/apt/sources.list"
fi
apt-config dump | grep -E '^Acquire::(Check-Valid-Until|Check-Date|https?::Proxy)' \
  >"$dir/etc/apt/apt.conf.d/99fresh-machine" || true
cp -L /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
  "$(hostname)" >"$dir/etc/hosts"

bind() {  # bind TYPE-or-bind SOURCE TARGET
  mkdir -p "$3"
  if [ "$1" = bind ]; then mount --bind "$2" "$3"; else mount -t "$1" "$2" "$3"; fi
  mounted+=("$3")
}
# The root is a mount point of its own, as / is on a machine: `ip netns exec`
# (the namespace tests) remounts / as a slave, which fails on a plain folder.
# Private: nothing mounted inside propagates to the host's view of the folder.
mount --bind "$dir" "$dir"
mount --make-private "$dir"
bind proc proc "$dir/proc"
bind sysfs sysfs "$dir/sys"
# The cgroup hierarchies (slurmd's cgroup plugin needs them: slurm_test), as slaves so
# that nothing done in the root, unmounting included, reaches the host's.
if grep -q ' /sys/fs/cgroup ' /proc/self/mounts; then
  mount --rbind /sys/fs/cgroup "$dir/sys/fs/cgroup"
  mount --make-rslave "$dir/sys/fs/cgroup"
  mounted+=("$dir/sys/fs/cgroup")
fi
bind bind /dev "$dir/dev"
bind bind /dev/pts "$dir/dev/pts"
[ -d /dev/shm ] && bind bind /dev/shm "$dir/dev/shm"

git clone -q "$root" "$dir/root/tessera"
say "cloned $commit into $dir/root/tessera"

in_root() {  # in_root COMMAND: runs COMMAND in the clone, in the root, with a clean environment
  local extra=()
  local v
  for v in EPOCHS CTEST_ARGS JOBS TESSERA_THREAD_SAFETY_BUILD; do
    [ -n "${!v:-}" ] && extra+=("$v=${!v}")
  done
  chroot "$dir" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${extra[@]}" \
    /bin/bash -c "cd /root/tessera && $1"
}
packages() { chroot "$dir" dpkg-query -W -f='${db:Status-Abbrev}\n' | grep -c '^ii'; }

# --- The quick start ---------------------------------------------------------------
before=$(packages)
record "packages before" "$before (debootstrap minbase)"
record "load average before" "$(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores; other work on the host shares them)"
say "EPOCHS=$epochs tools/quickstart.sh (in the root; log: $log_dir/quickstart.log)"
export EPOCHS=$epochs
t0=$(now)
set +e
exec 3>"$log_dir/quickstart.log" 4>"$log_dir/marks"
in_root tools/quickstart.sh 3>&- 4>&- 2>&1 | {
  progress=0
  while IFS= read -r line; do
    printf '%s\n' "$line"
    printf '%s\n' "$line" >&3
    case "$line" in
      "quickstart: installing"*) echo "$(now) install" >&4 ;;
      "quickstart: configuring"*) echo "$(now) configure" >&4 ;;
      "quickstart: building"*) echo "$(now) build" >&4 ;;
      "quickstart: training"*) echo "$(now) train" >&4 ;;
      *"Epoch["*"Batch["*) [ "$progress" = 1 ] || { echo "$(now) progress" >&4; progress=1; } ;;
    esac
  done
}
rc=${PIPESTATUS[0]}
exec 3>&- 4>&-
set -e
t1=$(now)
t_train=$(awk '$2 == "train" { print $1; exit }' "$log_dir/marks")
t_progress=$(awk '$2 == "progress" { print $1; exit }' "$log_dir/marks")
after=$(packages)
record "quickstart exit" "$rc"
record "load average after" "$(cut -d' ' -f1-3 /proc/loadavg)"
record "packages installed" "$((after - before)) by tools/quickstart.sh ($before before, $after after)"
if [ -n "$t_train" ]; then
  record "to training start" "$(secs "$t0" "$t_train") s ($(mmss "$(secs "$t0" "$t_train")")) to 'quickstart: training'"
else
  record "to training start" "never (no 'quickstart: training' line)"
fi
if [ -n "$t_progress" ]; then
  record "to first progress line" "$(secs "$t0" "$t_progress") s (the first Epoch[0] Batch line)"
fi
# Each step's time: from its 'quickstart: ...' line to the next one's.
steps=$(awk -v t0="$t0" -v t1="$t1" '
  BEGIN { n = 0 }
  $2 != "progress" { name[n] = $2; at[n++] = $1 }
  END { for (i = 0; i < n; i++) { end = (i + 1 < n) ? at[i + 1] : t1
          printf "%s%s %.0f s", (i ? ", " : ""), name[i], end - at[i] } }' "$log_dir/marks")
record "steps" "${steps:-none}"
record "quickstart total" "$(secs "$t0" "$t1") s ($(mmss "$(secs "$t0" "$t1")")), EPOCHS=$epochs"
acc=$(grep -o 'Validation-accuracy=[0-9.]*' "$log_dir/quickstart.log" | tail -1 | cut -d= -f2 || true)
record "final validation accuracy" "${acc:-none}"
cuda=$(grep -o 'Tessera: CUDA paths [A-Z]*' "$log_dir/quickstart.log" | tail -1 || true)
record "build" "${cuda:-no CUDA line}"
if [ "$rc" -ne 0 ] || [ -z "$acc" ]; then
  echo "fresh_machine: the quick start failed (exit $rc; log: $log_dir/quickstart.log)" >&2
  say "summary: $summary"
  exit 1
fi

# --- The tests ---------------------------------------------------------------------
if [ "$quickstart_only" = 1 ]; then
  record "tools/test.sh" "not run (--quickstart-only)"
  say "summary: $summary"
  exit 0
fi
say "tools/test.sh (in the root; log: $log_dir/test.log)"
t2=$(now)
set +e
in_root tools/test.sh 2>&1 | tee "$log_dir/test.log"
rc=${PIPESTATUS[0]}
set -e
t3=$(now)
record "packages added by test.sh" "$(($(packages) - after))"
record "tools/test.sh exit" "$rc after $(secs "$t2" "$t3") s ($(mmss "$(secs "$t2" "$t3")"))"
record "ctest" "$(grep -E 'tests passed, [0-9]+ tests? failed out of' "$log_dir/test.log" | tail -1 || echo 'no ctest line')"
grep -A200 'The following tests FAILED' "$log_dir/test.log" | grep -E '^\s+[0-9]+ - ' |
  sed 's/^ */failed: /' | tee -a "$summary" || true
say "summary: $summary"
exit "$rc"
