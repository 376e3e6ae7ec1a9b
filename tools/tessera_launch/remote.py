"""How a process runs on another host (over ssh, or in a Slurm step): the
shell wrapper around it, and the key it reads from its stdin there.

    argv = ['bash', '-c', REMOTE_WRAPPER, 'tessera-launch', KEY_FROM_STDIN, binary]
    node.stdin_data = key_stdin(key_file_text)   # then EOF on stdin stops it
"""

# First line a remote process prints (see REMOTE_WRAPPER); never shown to users.
REMOTE_PID_MARKER = b'__TESSERA_REMOTE_PID__ '

# The remote wrapper's first argument when the node's key follows on stdin, and
# the line that ends the key there.
KEY_FROM_STDIN = '--tessera-key-from-stdin'
KEY_END_MARKER = '__TESSERA_KEY_END__'

# Runs on the remote host under bash, with the job's command in "$@". The
# command gets its own process group, and the first output line is its pid. A
# watchdog reads the ssh channel's stdin: when it closes (the launcher tears the
# job down, the launcher dies, or the connection drops) the group gets SIGTERM,
# then SIGKILL. Exits with the command's status (128+N when killed by signal N),
# after killing whatever the command left in its group.
#
# With KEY_FROM_STDIN first, the lines before KEY_END_MARKER on stdin are the
# node's key file: they go into a 0600 file in a fresh 0700 folder, exported as
# TESSERA_KEY_FILE and removed when the wrapper ends. They are read before the
# watchdog starts reading, and never appear on a command line.
REMOTE_WRAPPER = r'''exec 3<&0 0</dev/null 4>&2 2>/dev/null
set -m
if [ "$1" = --tessera-key-from-stdin ]; then
  shift
  keydir=$(umask 077 && mktemp -d "${TMPDIR:-/tmp}/tessera-key.XXXXXXXXXX") || exit 125
  trap 'rm -rf "$keydir"' EXIT
  ( umask 077
    while IFS= read -r -u 3 line; do
      [ "$line" = __TESSERA_KEY_END__ ] && exit 0
      printf '%s\n' "$line"
    done > "$keydir/node.key"
    exit 1 ) || exit 125
  export TESSERA_KEY_FILE="$keydir/node.key"
fi
( echo "__TESSERA_REMOTE_PID__ $BASHPID"; exec "$@" ) 3<&- 2>&4 4>&- &
pid=$!
{ read -r -u 3 _; kill -TERM -- -$pid; sleep 3; kill -KILL -- -$pid; } 4>&- &
wd=$!
exec 3<&- 4>&-
wait $pid; rc=$?
kill -KILL -- -$pid
kill -KILL -- -$wd
exit $rc'''


def key_stdin(text):
    """What goes down a remote process's stdin first: its key file text, then
    the line that ends it (see REMOTE_WRAPPER)."""
    return (text + KEY_END_MARKER + '\n').encode()
