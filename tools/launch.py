#!/usr/bin/env python3
"""Starts a whole Tessera job: one scheduler, S servers and W workers.

Command-line compatible with MXNet's tools/launch.py (the dmlc tracker) for the
launchers people use with a parameter server: local, ssh and mpi; and slurm, for
jobs inside a Slurm allocation. Python 3 standard library only.

    # 2 workers and 2 servers on this host; worker flags pass through.
    tools/launch.py -n 2 build/worker/my_trainer --epochs 3

    # 4 workers, 2 servers spread over the hosts of a hostfile, code synced first.
    tools/launch.py -n 4 -s 2 --launcher ssh -H hosts --sync-dst-dir /tmp/job \\
        --interface eth0 ./train.sh

    # Inside a Slurm allocation (salloc, or an sbatch script: tools/slurm/): one
    # srun step per process over the allocation's nodes, the scheduler on the first.
    salloc -N 2 -n 4 tools/launch.py --launcher slurm -n 2 -s 2 build/worker/my_trainer

What every process gets in its environment:
  DMLC_ROLE              scheduler | server | worker
  DMLC_PS_ROOT_URI/PORT  where the scheduler listens
  DMLC_NUM_SERVER/WORKER how many of each the scheduler waits for
  DMLC_TASK_ID           servers 0..S-1, workers S..S+W-1 (as in dmlc-core)
  DMLC_JOB_CLUSTER       local | ssh | mpi | slurm
  TESSERA_RESTART_COUNT  0 on the first start, k on the k-th restart (--restarts)
  TESSERA_KEY_FILE       this process's role key file (see Security below), or
  TESSERA_KEY_DIR        (mpi) a folder with the keys of the roles on that host
  PORT                   with --restarts: a fixed port per server and worker, so a
                         restarted node rejoins under the same identity
  TESSERA_METRICS_PORT   with --metrics-port BASE: BASE + the process's index
                         (scheduler 0, servers 1..S, workers S+1..S+W, that is
                         DMLC_TASK_ID + 1); the list is printed at the start
  forwarded              DMLC_INTERFACE, DMLC_NODE_HOST (local processes only),
                         LD_LIBRARY_PATH, PS_*, TESSERA_*, and --env/--env-server/
                         --env-worker values. Local processes inherit the whole
                         environment of the launcher.

Job semantics: the job succeeds (exit 0) when every worker exits 0 and then the
scheduler and servers exit 0 within --timeout seconds. When any process exits
non-zero or is killed by a signal (and has no --restarts left), every other
process is stopped (SIGTERM, SIGKILL 3 s later), one line names it:

    launch.py: worker 1 (pid 4242) exited with status 3; stopping the job
    launch.py: server 0 on host2 (pid 77) killed by signal SIGKILL; stopping the job

and the launcher exits with that worker's status (1 for anything else). Every
process runs in its own session, so stopping it stops what it started. Usage
errors are one line and exit 2.

Security (docs/security.md): every job gets fresh CURVE keys, one key pair per
role; each process is given its own role's secret key and the public keys,
never on a command line or in the environment: local processes (and, with mpi,
every rank) read a 0600 file in this launcher's 0700 temporary folder
(TESSERA_KEY_FILE / TESSERA_KEY_DIR name its path); over ssh the key travels on
the ssh channel's stdin into a 0600 file in a fresh 0700 folder on the remote
host, removed when the process ends; mpi ranks on other hosts read a 0700 folder
of random name that the launcher creates there over ssh first and removes at the
end. With slurm the key travels like over ssh, on the stdin of the process's
srun step (srun relays it to the task), into a 0600 file in a fresh 0700 folder
on its node, removed when the process ends. TESSERA_KEY_DIR set by the user:
those keys are used as they are (the folder must hold <role>.key on every host).
TESSERA_INSECURE=1: no keys at all.

Slurm (--launcher slurm): run launch.py inside an allocation (salloc, or an
sbatch script; SLURM_JOB_ID and SLURM_JOB_NODELIST must be set). The hosts are
the allocation's nodes (`scontrol show hostnames $SLURM_JOB_NODELIST`), each
with as many slots as SLURM_TASKS_PER_NODE gives it; servers then workers fill
them like the ssh launcher's hostfile. The scheduler runs on the first node and
listens on its NodeAddr (`scontrol show node`), unless DMLC_PS_ROOT_URI says
otherwise. Every process is its own one-task step, `srun --nodes=1 --ntasks=1
--nodelist=NODE --overlap`, in the launcher's working folder (the nodes share
the file system, as on a Slurm cluster), so each has its exit status, its
[role i] prefix, and --restarts; srun exports the launcher's environment plus
the variables above. -H and --sync-dst-dir do not apply.
"""

import argparse
import atexit
import base64
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import posixpath
import re
import secrets
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

PROG = 'launch.py'
SCHEDULER_BINARY = 'tessera-scheduler'
SERVER_BINARY = 'tessera-server'

# Seconds between SIGTERM and SIGKILL when stopping a process group.
TERM_GRACE_S = 3.0
POLL_INTERVAL_S = 0.05

# First line a remote process prints (see REMOTE_WRAPPER); never shown to users.
REMOTE_PID_MARKER = b'__TESSERA_REMOTE_PID__ '
# Carries the per-role argv and environment to `launch.py --mpi-child` ranks.
MPI_SPEC_VAR = 'TESSERA_LAUNCH_MPI_SPEC'
LAUNCHERS = ('local', 'ssh', 'mpi', 'slurm')

# Set by the launcher itself; --env must not override them.
RESERVED_VARS = frozenset([
    'DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT', 'DMLC_NUM_SERVER',
    'DMLC_NUM_WORKER', 'DMLC_TASK_ID', 'DMLC_JOB_CLUSTER',
    'TESSERA_RESTART_COUNT', MPI_SPEC_VAR,
])
# TESSERA_* variables that configure the launcher, not the job.
NOT_FORWARDED = frozenset(['TESSERA_SSH_OPTS', 'TESSERA_RESTART_COUNT', MPI_SPEC_VAR])

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

_ENV_NAME_RE = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')
_HOST_NAME_RE = re.compile(r'^[A-Za-z0-9_.@%:-]+$')


class UsageError(Exception):
    """A caller mistake: reported as one line, exit status 2."""


# ----------------------------------------------------------------------------
# Command line


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _int_arg(minimum, what):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError('expected %s, got %r' % (what, text))
        return value
    return parse


def _port_arg(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError('expected a TCP port 1..65535, got %r' % text)
    return value


def _seconds_arg(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float('inf'):
        raise argparse.ArgumentTypeError('expected a positive number of seconds, got %r' % text)
    return value


def build_parser():
    p = _Parser(
        prog=PROG, allow_abbrev=False,
        usage='%(prog)s -n NUM_WORKERS [-s NUM_SERVERS] [--launcher local|ssh|mpi|slurm] '
              '[-H HOSTFILE] [options] COMMAND [ARGS...]',
        description='Start a Tessera job: a scheduler, servers and workers running COMMAND.')
    p.add_argument('-n', '--num-workers', type=_int_arg(1, 'a positive integer'),
                   help='number of workers (required)')
    p.add_argument('-s', '--num-servers', type=_int_arg(0, 'a non-negative integer'),
                   help='number of servers (default: the number of workers)')
    p.add_argument('--launcher', choices=LAUNCHERS, default='local',
                   help='how to start servers and workers (default: local); slurm: '
                        'inside a Slurm allocation, one srun step per process')
    p.add_argument('-H', '--hostfile',
                   help="hosts for ssh/mpi, one per line: 'host', 'host:sshport', 'host slots=N'")
    p.add_argument('--sync-dst-dir', metavar='DIR',
                   help='rsync the working folder to DIR on every host first and run there')
    p.add_argument('--env', action='append', default=[], metavar='NAME[:VALUE]',
                   help='set NAME for every process (NAME alone: forward the launcher\'s value)')
    p.add_argument('--env-server', action='append', default=[], metavar='NAME[:VALUE]',
                   help='like --env, servers only')
    p.add_argument('--env-worker', action='append', default=[], metavar='NAME[:VALUE]',
                   help='like --env, workers only')
    p.add_argument('--scheduler-binary', metavar='PATH', help='the %s to run' % SCHEDULER_BINARY)
    p.add_argument('--server-binary', metavar='PATH', help='the %s to run' % SERVER_BINARY)
    p.add_argument('--server-args', default='', metavar='"ARGS"',
                   help='extra arguments for every server (split like a shell would)')
    p.add_argument('--interface', metavar='NAME',
                   help='network interface the nodes take their address from (DMLC_INTERFACE)')
    p.add_argument('--port', type=_port_arg, help='scheduler port (default: a free one)')
    p.add_argument('--metrics-port', type=_port_arg, metavar='BASE',
                   help='serve Prometheus metrics: process i (scheduler 0, servers 1..S, '
                        'workers S+1..S+W) on port BASE+i of its address (TESSERA_METRICS_PORT)')
    p.add_argument('--timeout', type=_seconds_arg, default=30.0, metavar='SECONDS',
                   help='grace for the scheduler and servers to exit after the workers '
                        'finished (default: 30)')
    p.add_argument('--restarts', type=_int_arg(0, 'a non-negative integer'), default=0,
                   metavar='N', help='restart a failed server or worker up to N times')
    p.add_argument('--quiet-notice', type=_seconds_arg, default=60.0, metavar='SECONDS',
                   help='when the job has printed nothing for this long, say which of its '
                        'processes still run (default: 60; again every SECONDS)')
    p.add_argument('--verbose', action='store_true', help='say what the launcher does')
    p.add_argument('--mpi-child', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('command', nargs=argparse.REMAINDER, metavar='COMMAND [ARGS...]',
                   help='the worker program and its arguments')
    return p


def _join_server_args(argv):
    """Rewrites '--server-args VALUE' as '--server-args=VALUE' before COMMAND, so
    a value that starts with '-' (the usual case) is not taken for a flag."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == '--server-args' and i + 1 < len(argv):
            argv[i:i + 2] = ['--server-args=' + argv[i + 1]]
        elif token in _VALUE_FLAGS:
            i += 1
        elif token == '--' or not token.startswith('-') or token == '-':
            break  # COMMAND starts here
        i += 1
    return argv


_VALUE_FLAGS = frozenset([
    '-n', '--num-workers', '-s', '--num-servers', '--launcher', '-H', '--hostfile',
    '--sync-dst-dir', '--env', '--env-server', '--env-worker', '--scheduler-binary',
    '--server-binary', '--interface', '--port', '--timeout', '--restarts', '--metrics-port',
])


def parse_args(argv):
    """Parses and checks the command line. Raises UsageError."""
    args = build_parser().parse_args(_join_server_args(argv))
    if args.command and args.command[0] == '--':
        args.command = args.command[1:]
    if args.mpi_child:
        return args
    if args.num_workers is None:
        raise UsageError('argument -n/--num-workers: required (the number of workers)')
    if not args.command:
        raise UsageError('missing COMMAND: expected the worker program (and its arguments) '
                         'after the flags')
    if args.num_servers is None:
        args.num_servers = args.num_workers
    if args.launcher == 'ssh' and not args.hostfile:
        raise UsageError('--launcher ssh: expected -H/--hostfile HOSTFILE')
    if args.launcher == 'slurm':
        if args.hostfile:
            raise UsageError('-H/--hostfile: not used with --launcher slurm (the hosts are '
                             'the allocation\'s nodes, SLURM_JOB_NODELIST)')
        if args.sync_dst_dir:
            raise UsageError('--sync-dst-dir: not supported with --launcher slurm (its '
                             'steps run in the launcher\'s folder, on a file system the '
                             'nodes share)')
    if args.launcher == 'mpi' and args.restarts:
        raise UsageError('--restarts: not supported with --launcher mpi (mpirun stops the '
                         'whole job when a rank fails)')
    if args.metrics_port is not None:
        last = args.metrics_port + args.num_servers + args.num_workers
        if last > 65535:
            raise UsageError('--metrics-port %d: expected a port in 1..%d (this job needs %d '
                             'ports from it)' % (args.metrics_port,
                                                 65535 - args.num_servers - args.num_workers,
                                                 1 + args.num_servers + args.num_workers))
    if args.interface is not None and not re.match(r'^[A-Za-z0-9_.:@-]{1,15}$', args.interface):
        raise UsageError('--interface %r: expected a network interface name such as eth0'
                         % args.interface)
    try:
        args.server_argv_extra = shlex.split(args.server_args)
    except ValueError as e:
        raise UsageError('--server-args %r: %s' % (args.server_args, e))
    return args


def parse_env_spec(spec, flag, environ):
    """Parses one --env value: 'NAME:VALUE' or 'NAME' (forward environ[NAME])."""
    name, sep, value = spec.partition(':')
    if not _ENV_NAME_RE.match(name):
        raise UsageError('%s %r: expected NAME[:VALUE] with NAME a variable name' % (flag, spec))
    if name in RESERVED_VARS:
        raise UsageError('%s %s: set by the launcher itself (use -n, -s, --port, '
                         '--interface or DMLC_PS_ROOT_URI)' % (flag, name))
    if not sep:
        if name not in environ:
            raise UsageError('%s %s: no value given and %s is not set in the launcher\'s '
                             'environment' % (flag, name, name))
        value = environ[name]
    return name, value


def parse_env_specs(specs, flag, environ):
    out = {}
    for spec in specs:
        name, value = parse_env_spec(spec, flag, environ)
        out[name] = value
    return out


# ----------------------------------------------------------------------------
# Hostfile and placement


class Host(object):
    """One hostfile entry: name (as given to ssh), ssh port or None, slots or None."""

    __slots__ = ('name', 'port', 'slots')

    def __init__(self, name, port=None, slots=None):
        self.name, self.port, self.slots = name, port, slots

    def __eq__(self, other):
        return (isinstance(other, Host) and
                (self.name, self.port, self.slots) == (other.name, other.port, other.slots))

    def __hash__(self):
        return hash((self.name, self.port, self.slots))

    def __repr__(self):
        return 'Host(%r, port=%r, slots=%r)' % (self.name, self.port, self.slots)

    @property
    def address(self):
        """The host without any user@ part, for name resolution."""
        return self.name.rpartition('@')[2]

    @property
    def key(self):
        """Identifies a distinct destination (for --sync-dst-dir)."""
        return (self.name, self.port)


_EXPECTED_LINE = "expected 'host', 'host:port' or 'host slots=N'"


def parse_hostfile_text(text, origin='hostfile'):
    """Parses hostfile contents. Raises UsageError naming origin and the line."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split('#', 1)[0].strip()
        if not line:
            continue

        def bad(why):
            return UsageError('%s line %d: %r: %s' % (origin, lineno, raw.strip(), why))

        tokens = line.split()
        spec, port, slots = tokens[0], None, None
        for token in tokens[1:]:
            key, sep, value = token.partition('=')
            if key != 'slots' or not sep or slots is not None:
                raise bad(_EXPECTED_LINE)
            if not value.isdigit() or int(value) < 1:
                raise bad('slots=%s: expected a positive integer' % value)
            slots = int(value)
        if spec.startswith('['):  # [v6addr] or [v6addr]:port
            m = re.match(r'^\[([0-9A-Fa-f:.%a-zA-Z]+)\](?::(.*))?$', spec)
            if not m:
                raise bad(_EXPECTED_LINE)
            name, port_text = m.group(1), m.group(2)
        elif spec.count(':') == 1:
            name, port_text = spec.split(':')
        else:  # plain name, or a bare IPv6 address (no port)
            name, port_text = spec, None
        if not name or name.startswith('-') or not _HOST_NAME_RE.match(name):
            raise bad('%r is not a host name; %s' % (name, _EXPECTED_LINE))
        if port_text is not None:
            if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
                raise bad('port %r: expected 1..65535' % port_text)
            port = int(port_text)
        hosts.append(Host(name, port, slots))
    if not hosts:
        raise UsageError('%s: no hosts in it (%s)' % (origin, _EXPECTED_LINE))
    return hosts


def parse_hostfile(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UsageError('-H/--hostfile %s: cannot read it: %s' % (path, e.strerror or e))
    return parse_hostfile_text(text, 'hostfile %s' % path)


def place(hosts, num_servers, num_workers):
    """Places servers then workers on hosts, filling each host's slots (default 1)
    in hostfile order and wrapping around when there are more processes than
    slots, like mpirun's by-slot mapping. Returns (server_hosts, worker_hosts)."""
    slots = [h for h in hosts for _ in range(h.slots or 1)]
    seq = [slots[k % len(slots)] for k in range(num_servers + num_workers)]
    return seq[:num_servers], seq[num_servers:]


def distinct_hosts(hosts):
    seen, out = set(), []
    for h in hosts:
        if h.key not in seen:
            seen.add(h.key)
            out.append(h)
    return out


# ----------------------------------------------------------------------------
# Binaries


def _is_executable(path):
    return os.path.isfile(path) and os.access(path, os.X_OK)


def own_build_dirs(environ):
    """Where daemons are looked for last, for worker commands such as `python3
    train.py` that say nothing about a build: $TESSERA_BUILD_DIR, this script's
    own folder (installed as bin/tessera-launch beside bin/tessera-scheduler), and
    the build folder of the checkout it is in (tools/../build)."""
    here = os.path.dirname(os.path.abspath(__file__))
    dirs = []
    if environ.get('TESSERA_BUILD_DIR'):
        dirs.append(environ['TESSERA_BUILD_DIR'])
    dirs += [here, os.path.join(os.path.dirname(here), 'build')]
    out = []
    for d in dirs:
        out += [d, os.path.join(d, 'scheduler'), os.path.join(d, 'server')]
    return out


def find_binary(name, flag, explicit, worker_command, path_env, fallback_dirs=()):
    """Finds a daemon binary: the flag, next to the worker command, PATH, then
    `fallback_dirs` (own_build_dirs in a real run).

    Returns an absolute path. Raises UsageError naming where it looked.
    """
    if explicit:
        if not _is_executable(explicit):
            raise UsageError('%s %s: not an executable file' % (flag, explicit))
        return os.path.abspath(explicit)
    looked = []
    if worker_command and '/' in worker_command[0]:
        # The build puts binaries in <build>/scheduler, <build>/server and the worker
        # somewhere below <build> (worker/, tests/core/, ...): look up to 3 levels up.
        here = os.path.dirname(os.path.abspath(worker_command[0]))
        candidates = []
        anc = here
        for _ in range(4):
            candidates += [anc, os.path.join(anc, 'scheduler'), os.path.join(anc, 'server')]
            anc = os.path.dirname(anc)
        for d in candidates:
            d = os.path.normpath(d)
            if d in looked:
                continue
            looked.append(d)
            if _is_executable(os.path.join(d, name)):
                return os.path.join(d, name)
    found = shutil.which(name, path=path_env)
    if found:
        return os.path.abspath(found)
    for d in fallback_dirs:
        if _is_executable(os.path.join(d, name)):
            return os.path.abspath(os.path.join(d, name))
    where = 'next to the worker command (%s) or ' % ', '.join(looked) if looked else ''
    last = ' and in %s' % ', '.join(fallback_dirs) if fallback_dirs else ''
    raise UsageError('cannot find %s: looked %son PATH%s; build it or pass %s PATH'
                     % (name, where, last, flag))


def check_command(command, path_env):
    """Checks that the worker command can be run here (local and mpi launchers)."""
    prog = command[0]
    if '/' in prog:
        if not _is_executable(prog):
            raise UsageError('COMMAND %s: not an executable file' % prog)
    elif not shutil.which(prog, path=path_env):
        raise UsageError('COMMAND %s: not found on PATH' % prog)


# ----------------------------------------------------------------------------
# Addresses and ports


def interface_ipv4(name):
    """The IPv4 address of a local interface. Raises UsageError."""
    try:
        out = subprocess.run(['ip', '-o', '-4', 'addr', 'show', 'dev', name],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             timeout=10).stdout.decode('utf-8', 'replace')
        m = re.search(r'\binet (\d+\.\d+\.\d+\.\d+)/', out)
        if m:
            return m.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    try:  # No `ip` tool: ask the kernel directly (SIOCGIFADDR).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack('256s', name.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
    except OSError:
        pass
    raise UsageError('--interface %s: no such interface or it has no IPv4 address' % name)


def route_address_towards(host):
    """The local address of the route towards host (UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror:
        infos = socket.getaddrinfo(host, 9, 0, socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def scheduler_address(interface, environ, first_host):
    """The root URI as the hosts reach the launching host. Raises UsageError."""
    if interface:
        return interface_ipv4(interface)
    if environ.get('DMLC_PS_ROOT_URI'):
        return environ['DMLC_PS_ROOT_URI']
    try:
        return route_address_towards(first_host.address)
    except OSError as e:
        raise UsageError('cannot find this host\'s address as seen from %s (%s); pass '
                         '--interface NAME or set DMLC_PS_ROOT_URI'
                         % (first_host.address, getattr(e, 'strerror', None) or e))


def pick_port(requested):
    """A port the scheduler can bind. Raises UsageError if --port is busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(('', requested or 0))
        except OSError as e:
            raise UsageError('--port %d: cannot be used on this host (%s); is an earlier job '
                             'still running?' % (requested, e.strerror or e))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------
# Job keys (common/curve_keys.h has the format; the daemons check every file)

ROLES = ('scheduler', 'server', 'worker')
_Z85_CHARS = ('0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'
              '.-:+=^!/*?&<>()[]{}@%$#')
_P25519 = 2 ** 255 - 19


def z85_encode(data):
    """ZeroMQ's Z85 (RFC 32) of bytes whose length is a multiple of 4."""
    out = []
    for i in range(0, len(data), 4):
        value = int.from_bytes(data[i:i + 4], 'big')
        chunk = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            chunk.append(_Z85_CHARS[digit])
        out.extend(reversed(chunk))
    return ''.join(out)


def x25519(scalar, u):
    """X25519 (RFC 7748, the Montgomery ladder) of 32-byte strings: what
    libsodium's crypto_scalarmult does. Runs once per role per job, on the
    launching host, so Python's non-constant-time integers do not matter."""
    k = bytearray(scalar)
    k[0] &= 248
    k[31] &= 127
    k[31] |= 64
    k = int.from_bytes(bytes(k), 'little')
    x1 = int.from_bytes(u, 'little') & ((1 << 255) - 1)
    x2, z2, x3, z3, swap = 1, 0, x1, 1, 0
    p = _P25519
    for t in reversed(range(255)):
        bit = (k >> t) & 1
        if swap ^ bit:
            x2, x3, z2, z3 = x3, x2, z3, z2
        swap = bit
        a, b = (x2 + z2) % p, (x2 - z2) % p
        aa, bb = a * a % p, b * b % p
        e = (aa - bb) % p
        c, d = (x3 + z3) % p, (x3 - z3) % p
        da, cb = d * a % p, c * b % p
        x3 = (da + cb) ** 2 % p
        z3 = x1 * (da - cb) ** 2 % p
        x2 = aa * bb % p
        z2 = e * (aa + 121665 * e) % p
    if swap:
        x2, z2 = x3, z3
    return (x2 * pow(z2, p - 2, p) % p).to_bytes(32, 'little')


def make_job_keys():
    """Fresh key pairs for the three roles; returns {role: key file text}."""
    pairs = {}
    for role in ROLES:
        secret = secrets.token_bytes(32)
        public = x25519(secret, (9).to_bytes(32, 'little'))
        pairs[role] = (z85_encode(public), z85_encode(secret))
    files = {}
    for role in ROLES:
        lines = ['# Tessera job keys, role %s. Private: keep this file mode 0600.' % role,
                 'role %s' % role, 'secret-key %s' % pairs[role][1]]
        lines += ['%s-public-key %s' % (r, pairs[r][0]) for r in ROLES]
        files[role] = '\n'.join(lines) + '\n'
    return files


def make_node_keys(texts, num_servers, num_workers):
    """A key pair of its own for every server and worker (its identity towards
    the scheduler, so that a worker's keys speak for that worker only), added to
    its role's key file, and the roster of their public halves added to the
    scheduler's. Returns (scheduler's file text, {(role, index): file text})."""
    roster, files = [], {}
    for role, count in (('server', num_servers), ('worker', num_workers)):
        for index in range(count):
            secret = secrets.token_bytes(32)
            public = x25519(secret, (9).to_bytes(32, 'little'))
            files[(role, index)] = (texts[role].rstrip('\n') +
                                    '\n# This process\'s own key (%s %d).\n'
                                    'node-secret-key %s\n' % (role, index, z85_encode(secret)))
            roster.append('node-key %s %s' % (role, z85_encode(public)))
    scheduler = (texts['scheduler'].rstrip('\n') +
                 '\n# Every node\'s own key: a node registers with one of them.\n' +
                 ''.join(line + '\n' for line in roster))
    return scheduler, files


def write_private(path, text):
    """Creates `path` mode 0600 (never replacing a file) and writes `text`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0),
                 0o600)
    with os.fdopen(fd, 'w') as f:
        f.write(text)


def job_security(environ):
    """'generate' (fresh keys), 'user' (the user's TESSERA_KEY_DIR) or 'insecure'.

    Raises UsageError for TESSERA_KEY_FILE, which names one role's file."""
    if environ.get('TESSERA_INSECURE', '').strip() == '1':
        return 'insecure'
    if environ.get('TESSERA_KEY_FILE'):
        raise UsageError('TESSERA_KEY_FILE names one role\'s keys, and a job has three; '
                         'unset it (launch.py makes fresh keys for every job) or set '
                         'TESSERA_KEY_DIR to a folder holding scheduler.key, server.key and '
                         'worker.key on every host')
    if environ.get('TESSERA_KEY_DIR'):
        return 'user'
    return 'generate'


def mpi_key_dir_command(key_dir, role):
    """The remote shell command that stores one role's key (read from stdin) in
    key_dir, a 0700 folder of random name that only this user may own."""
    d = shlex.quote(key_dir)
    tmp = shlex.quote('%s/%s.key.tmp' % (key_dir, role))
    final = shlex.quote('%s/%s.key' % (key_dir, role))
    return ('umask 077 && mkdir -p %s && test -O %s && test ! -L %s && chmod 700 %s && '
            'cat > %s && mv -f %s %s' % (d, d, d, d, tmp, tmp, final))


# ----------------------------------------------------------------------------
# Environment


class JobConfig(object):
    """What every process of one job shares."""

    def __init__(self, cluster, root_uri, port, num_servers, num_workers, forwarded,
                 env_all, env_server, env_worker, node_ports=None, metrics_port=None):
        self.cluster = cluster
        # By role: the variables that tell its processes where their keys are
        # (set once the keys are written); none for remote ssh processes, whose
        # key travels on stdin (key_text).
        self.key_env = {}
        # By role: the key file text (fresh keys), for ssh and mpi hosts.
        self.key_text = {}
        # By (role, index): the same for one process, holding its own key
        # (make_node_keys); it wins over its role's. Not for mpi ranks.
        self.node_key_env = {}
        self.node_key_text = {}
        # With --restarts: by DMLC_TASK_ID, the port each server and worker listens
        # on, the same on every start (the scheduler knows a restarted node by its
        # address). None: any port.
        self.node_ports = node_ports
        # --metrics-port: the scheduler's metrics port; process i gets this + i.
        self.metrics_port = metrics_port
        self.root_uri = root_uri
        self.port = port
        self.num_servers = num_servers
        self.num_workers = num_workers
        self.forwarded = forwarded
        self.env_all = env_all
        self.env_server = env_server
        self.env_worker = env_worker


def forwarded_env(environ, remote, interface=None):
    """The launcher variables passed on to nodes (all of them go to local ones)."""
    out = {}
    for name, value in environ.items():
        if name.startswith('PS_') or (name.startswith('TESSERA_') and name not in NOT_FORWARDED):
            out[name] = value
    names = ['LD_LIBRARY_PATH', 'DMLC_INTERFACE'] + ([] if remote else ['DMLC_NODE_HOST'])
    for name in names:
        if name in environ:
            out[name] = environ[name]
    if interface:
        out['DMLC_INTERFACE'] = interface
    out.setdefault('PYTHONUNBUFFERED', environ.get('PYTHONUNBUFFERED', '1'))
    return out


def node_env(cfg, role, task_id=None, restart_count=0):
    """The variables one process gets on top of its base environment.

    Precedence: forwarded < --env < --env-server/--env-worker < launcher's own.
    """
    env = dict(cfg.forwarded)
    env.update(cfg.env_all)
    if role == 'server':
        env.update(cfg.env_server)
    elif role == 'worker':
        env.update(cfg.env_worker)
    env.update({
        'DMLC_ROLE': role,
        'DMLC_PS_ROOT_URI': cfg.root_uri,
        'DMLC_PS_ROOT_PORT': str(cfg.port),
        'DMLC_NUM_SERVER': str(cfg.num_servers),
        'DMLC_NUM_WORKER': str(cfg.num_workers),
        'DMLC_JOB_CLUSTER': cfg.cluster,
        'TESSERA_RESTART_COUNT': str(restart_count),
    })
    env.update(cfg.key_env.get(role, {}))
    if task_id is not None and role in ('server', 'worker'):
        index = task_id if role == 'server' else task_id - cfg.num_servers
        env.update(cfg.node_key_env.get((role, index), {}))
    if cfg.metrics_port is not None:
        env['TESSERA_METRICS_PORT'] = str(metrics_port_of(cfg, task_id))
    if task_id is not None:
        env['DMLC_TASK_ID'] = str(task_id)
        if cfg.node_ports:
            env['PORT'] = str(cfg.node_ports[task_id])
    return env


def metrics_port_of(cfg, task_id):
    """--metrics-port: the scheduler's is BASE, a node's BASE + DMLC_TASK_ID + 1."""
    return cfg.metrics_port + (0 if task_id is None else task_id + 1)


def metrics_urls(cfg, nodes):
    """(name, url) of every process's metrics endpoint, in index order."""
    out = []
    for node in nodes:
        if node.role == 'mpirun':
            # Ranks: servers first, then workers, on the hosts of the placement.
            for rank in range(cfg.num_servers + cfg.num_workers):
                name = ('server %d' % rank if rank < cfg.num_servers
                        else 'worker %d' % (rank - cfg.num_servers))
                host = (cfg.mpi_hosts[rank] if getattr(cfg, 'mpi_hosts', None)
                        else cfg.root_uri)
                out.append((name, host, metrics_port_of(cfg, rank)))
            continue
        task_id = None
        if node.role == 'server':
            task_id = node.index
        elif node.role == 'worker':
            task_id = cfg.num_servers + node.index
        host = node.host.name if node.host is not None else cfg.root_uri
        out.append((node.name, host, metrics_port_of(cfg, task_id)))
    return [(name, 'http://%s/metrics' % (('[%s]:%d' if ':' in host else '%s:%d')
                                          % (host, port)))
            for name, host, port in out]


# ----------------------------------------------------------------------------
# Remote commands


def ssh_base_argv(host, environ):
    argv = ['ssh', '-o', 'StrictHostKeyChecking=no', '-o', 'BatchMode=yes']
    if host.port:
        argv += ['-p', str(host.port)]
    try:
        argv += shlex.split(environ.get('TESSERA_SSH_OPTS', ''))
    except ValueError as e:
        raise UsageError('TESSERA_SSH_OPTS %r: %s' % (environ['TESSERA_SSH_OPTS'], e))
    return argv


def remote_command(workdir, env, argv, key_from_stdin=False):
    """The shell command ssh runs remotely: cd, then REMOTE_WRAPPER around env+argv
    (reading the node's key from stdin first when key_from_stdin)."""
    assigns = ' '.join(shlex.quote('%s=%s' % kv) for kv in sorted(env.items()))
    return 'cd %s && exec bash -c %s tessera-launch %senv %s %s' % (
        shlex.quote(workdir), shlex.quote(REMOTE_WRAPPER),
        KEY_FROM_STDIN + ' ' if key_from_stdin else '', assigns,
        ' '.join(shlex.quote(a) for a in argv))


def ssh_argv(host, workdir, env, argv, environ, key_from_stdin=False):
    return ssh_base_argv(host, environ) + [host.name, remote_command(workdir, env, argv,
                                                                     key_from_stdin)]


def rsync_argv(host, src_dir, dst_dir, environ):
    ssh = ' '.join(shlex.quote(a) for a in ssh_base_argv(host, environ))
    target = '[%s]' % host.name if ':' in host.name else host.name
    return ['rsync', '-az', '-e', ssh,
            '--rsync-path', 'mkdir -p %s && rsync' % shlex.quote(dst_dir),
            src_dir.rstrip('/') + '/', '%s:%s/' % (target, dst_dir.rstrip('/') or '/')]


def remote_path(path, cwd, sync_dir):
    """Where a local absolute path inside the synced folder lives on the hosts."""
    if sync_dir and os.path.isabs(path):
        rel = os.path.relpath(path, cwd)
        if rel != '..' and not rel.startswith('..' + os.sep):
            return posixpath.join(sync_dir, rel)
    return path


# ----------------------------------------------------------------------------
# Process supervision


def _pdeathsig_preexec():
    """A preexec_fn that has the kernel SIGKILL the child if the launcher dies."""
    if not sys.platform.startswith('linux'):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec():
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    return preexec


def signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return 'signal %d' % signum


def describe_status(rc, remote, transport='ssh'):
    """'exited with status 3' / 'killed by signal SIGKILL' for a Popen returncode;
    remote: the status came through `transport` (ssh or srun)."""
    if rc < 0:
        return 'killed by signal %s' % signal_name(-rc)
    if remote and rc == 255 and transport == 'ssh':
        return 'exited with status 255 (ssh failed, or the remote process exited 255)'
    if remote and 128 < rc < 128 + 65:
        return 'exited with status %d (128+%s)' % (rc, signal_name(rc - 128))
    return 'exited with status %d' % rc


class Node(object):
    """One process of the job. `spawn(restart_count)` returns (argv, env, cwd)."""

    def __init__(self, role, index, spawn, host=None, remote=False, primary=False,
                 restartable=False):
        self.role = role
        self.index = index
        self.spawn = spawn
        self.host = host
        self.remote = remote
        self.primary = primary  # the job is done when all primaries exited 0
        self.restartable = restartable
        self.proc = None
        self.readers = []
        self.restarts = 0
        self.returncode = None
        self.remote_pid = None
        self.pgids = []  # every process group this node ever had
        self.tag_map = None  # mpirun: rank -> prefix bytes
        self.split_stderr = False  # relay stderr on its own pipe (mpirun)
        # Remote: what goes down the ssh channel's stdin first (the node's key,
        # see REMOTE_WRAPPER); never on a command line.
        self.stdin_data = None
        # Remote: what carries the process there (ssh, or srun for slurm).
        self.transport = 'ssh'

    @property
    def name(self):
        return self.role if self.index is None else '%s %d' % (self.role, self.index)

    @property
    def prefix(self):
        return ('[%s] ' % self.name).encode()

    @property
    def running(self):
        return self.proc is not None and self.returncode is None

    def label(self):
        """'worker 1 on hostB (pid 42)' for messages."""
        where = ' on %s' % self.host.name if self.host is not None else ''
        if self.remote and self.remote_pid:
            pid = 'pid %d' % self.remote_pid
        elif self.remote:
            pid = '%s pid %d' % (self.transport, self.proc.pid)
        else:
            pid = 'pid %d' % self.proc.pid
        return '%s%s (%s)' % (self.name, where, pid)


_MPI_TAG_RE = re.compile(rb'\[\d+,(\d+)\]<(std(?:out|err|diag))>:')


class Job(object):
    """Starts nodes, relays their output, and supervises them to the end.

    Thread-safety: only the main thread starts, polls and kills; reader threads
    only write output under `_out_lock`. Signal handlers only set `stop_signal`.
    """

    def __init__(self, nodes, timeout, restarts, verbose, quiet_notice=60.0):
        self.nodes = nodes
        self.timeout = timeout
        self.quiet_notice = quiet_notice
        self.last_output = time.monotonic()  # under _out_lock
        self.max_restarts = restarts
        self.verbose = verbose
        self.stop_signal = None
        self._out_lock = threading.Lock()
        self._preexec = _pdeathsig_preexec()
        self._torn_down = False
        atexit.register(self._at_exit)

    def _at_exit(self):
        if not self._torn_down:  # an unexpected exit: leave nothing behind
            self.kill_now()

    # -- output

    def say(self, message):
        with self._out_lock:
            try:
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            try:
                sys.stderr.write('%s: %s\n' % (PROG, message))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def _emit(self, data):
        with self._out_lock:
            self.last_output = time.monotonic()
            try:
                out = getattr(sys.stdout, 'buffer', None)
                if out is None:
                    sys.stdout.write(data.decode('utf-8', 'replace'))
                else:
                    out.write(data)
                sys.stdout.flush()
            except (OSError, ValueError):
                pass  # Our stdout is gone; keep draining the pipe anyway.

    @staticmethod
    def _tag_prefix(node, key):
        return node.prefix if key is None else node.tag_map(key[0])

    def _relay_tagged(self, node, line, partial):
        """Splits mpirun --tag-output text into lines per rank. mpirun tags each
        chunk a rank writes ('[1,2]<stdout>:text'), and a chunk need not end a
        line, so chunks of several ranks can share one line of mpirun's output."""
        key, start = None, 0
        pieces = []
        for m in _MPI_TAG_RE.finditer(line):
            pieces.append((key, line[start:m.start()]))
            key, start = (int(m.group(1)), m.group(2)), m.end()
        pieces.append((key, line[start:]))
        for key, text in pieces:
            if not text:
                continue
            text = partial.pop(key, b'') + text
            *lines, rest = text.split(b'\n')
            for one in lines:
                self._emit(self._tag_prefix(node, key) + one + b'\n')
            if rest:
                partial[key] = rest

    def _relay(self, node, pipe):
        partial = {}  # mpirun: (rank, stream) -> text of an unfinished line
        try:
            for line in iter(pipe.readline, b''):
                if not line.endswith(b'\n'):
                    line += b'\n'
                if node.remote and line.startswith(REMOTE_PID_MARKER):
                    try:
                        node.remote_pid = int(line[len(REMOTE_PID_MARKER):])
                        continue
                    except ValueError:
                        pass
                if node.tag_map is not None:
                    self._relay_tagged(node, line, partial)
                else:
                    self._emit(node.prefix + line)
        except (OSError, ValueError):
            pass
        finally:
            for key, text in partial.items():
                if text:
                    self._emit(self._tag_prefix(node, key) + text + b'\n')
            try:
                pipe.close()
            except OSError:
                pass

    # -- processes

    def start(self, node):
        """Starts node. Returns an error message or None."""
        argv, env, cwd = node.spawn(node.restarts)
        try:
            proc = subprocess.Popen(
                argv, env=env, cwd=cwd,
                stdin=subprocess.PIPE if node.remote else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE if node.split_stderr else subprocess.STDOUT,
                start_new_session=True, preexec_fn=self._preexec)
        except OSError as e:
            return 'cannot start %s: %s' % (node.name, e)
        node.proc, node.returncode, node.remote_pid = proc, None, None
        node.pgids.append(proc.pid)
        if node.stdin_data is not None and proc.stdin is not None:
            try:  # a few hundred bytes: the pipe takes them without blocking
                proc.stdin.write(node.stdin_data)
                proc.stdin.flush()
            except OSError:
                pass  # ssh exited at once; its status says why
        node.readers = []
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                reader = threading.Thread(target=self._relay, args=(node, pipe),
                                          name='relay %s' % node.name, daemon=True)
                reader.start()
                node.readers.append(reader)
        if self.verbose:
            self.say('started %s: %s' % (node.label(), ' '.join(shlex.quote(a) for a in argv)))
        return None

    @staticmethod
    def _killpg(pgid, sig):
        try:
            os.killpg(pgid, sig)
            return True
        except OSError:
            return False  # ESRCH: the group is gone; EPERM: not ours any more.

    def _poll(self, node):
        if node.running:
            rc = node.proc.poll()
            if rc is not None:
                node.returncode = rc
                for reader in node.readers:  # its last lines go before our message
                    reader.join(0.5)
                return True
        return False

    def _group_alive(self, pgid):
        try:
            os.killpg(pgid, 0)
            return True
        except OSError:
            return False

    def teardown(self):
        """Stops every process group of the job: SIGTERM, then SIGKILL after 3 s."""
        if self._torn_down:
            return
        self._torn_down = True
        for node in self.nodes:
            if node.remote and node.proc is not None and node.proc.stdin:
                try:  # EOF on the channel: the remote watchdog stops the process.
                    node.proc.stdin.close()
                except OSError:
                    pass
        for node in self.nodes:
            for pgid in node.pgids:
                if not node.remote:
                    self._killpg(pgid, signal.SIGTERM)
        # Remote processes get TERM_GRACE_S from their watchdog, plus transit.
        grace = TERM_GRACE_S + (1.5 if any(n.remote for n in self.nodes) else 0.0)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for node in self.nodes:
                self._poll(node)
            if not any(self._group_alive(g) for n in self.nodes for g in n.pgids):
                break
            time.sleep(POLL_INTERVAL_S)
        self.kill_now()
        for node in self.nodes:
            for reader in node.readers:
                reader.join(1.0)

    def kill_now(self):
        """SIGKILLs every process group of the job and reaps the leaders."""
        for node in self.nodes:
            for pgid in node.pgids:
                self._killpg(pgid, signal.SIGKILL)
        for node in self.nodes:
            if node.running:
                try:
                    node.returncode = node.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass

    def _stop(self, message, status):
        self.teardown()  # first, so that the message is the job's last line
        self.say(message)
        return status

    def _exit_status(self, node, rc):
        if node.role in ('worker', 'mpirun') and rc > 0:
            return rc
        return 1

    def run(self):
        """Runs the job to its end. Returns the launcher's exit status."""
        try:
            return self._run()
        finally:
            self.teardown()

    def _run(self):
        for node in self.nodes:
            if self.stop_signal:
                break
            error = self.start(node)
            if error:
                return self._stop('%s; stopping the job' % error, 1)
        primaries = [n for n in self.nodes if n.primary]
        daemons = [n for n in self.nodes if not n.primary]
        grace_since = None
        started = last_notice = time.monotonic()
        while True:
            now = time.monotonic()
            with self._out_lock:
                last_output = self.last_output
            if now - max(last_output, last_notice) >= self.quiet_notice:
                # A job that prints nothing for a long time is not taken for a hung one.
                last_notice = now
                self.say('no output for %d s (job running %d s); still running: %s'
                         % (now - last_output, now - started,
                            ', '.join(n.name for n in self.nodes if n.running)))
            if self.stop_signal:
                return self._stop('received %s; stopping the job' % signal_name(self.stop_signal),
                                  128 + self.stop_signal)
            for node in self.nodes:
                if not self._poll(node):
                    continue
                rc = node.returncode
                if rc == 0:
                    if self.verbose:
                        self.say('%s exited with status 0' % node.label())
                    continue
                what = '%s %s' % (node.label(), describe_status(rc, node.remote,
                                                                node.transport))
                if node.restartable and node.restarts < self.max_restarts:
                    node.restarts += 1
                    self.say('%s; restarting it (restart %d of %d)'
                             % (what, node.restarts, self.max_restarts))
                    self._killpg(node.proc.pid, signal.SIGKILL)  # leftovers of the old one
                    if node.proc.stdin:
                        node.proc.stdin.close()
                    error = self.start(node)
                    if error:
                        return self._stop('%s; stopping the job' % error, 1)
                    continue
                return self._stop('%s; stopping the job' % what, self._exit_status(node, rc))
            primaries_done = all(n.returncode == 0 for n in primaries)
            daemons_done = all(n.returncode == 0 for n in daemons)
            if primaries_done and daemons_done:
                return 0
            if primaries_done or daemons_done:
                now = time.monotonic()
                grace_since = grace_since or now
                if now - grace_since > self.timeout:
                    late = [n for n in self.nodes if n.running]
                    after = ('all workers finished' if primaries_done
                             else 'the scheduler and servers exited')
                    for node in late[1:]:
                        self.say('%s still running %g s after %s' % (node.label(), self.timeout,
                                                                     after))
                    return self._stop('%s still running %g s after %s; stopping the job'
                                      % (late[0].label(), self.timeout, after), 1)
            time.sleep(POLL_INTERVAL_S)


def install_signal_handlers(job):
    def handler(signum, _frame):
        if job.stop_signal is None:
            job.stop_signal = signum
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


# ----------------------------------------------------------------------------
# Launchers


class SetupError(Exception):
    """The job could not be prepared (e.g. rsync failed): one line, exit 1."""


def _run_step(argv, what):
    """Runs a setup command (rsync) to completion. Raises SetupError on failure."""
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        raise SetupError('%s: cannot run %s: %s' % (what, argv[0], e))
    if proc.returncode != 0:
        tail = proc.stdout.decode('utf-8', 'replace').strip().splitlines()[-1:] or ['']
        raise SetupError('%s failed (%s): %s' % (what, describe_status(proc.returncode, False),
                                                 tail[0]))


def sync_hosts(hosts, dst_dir, environ, verbose, say):
    src = os.getcwd()
    for host in distinct_hosts(hosts):
        argv = rsync_argv(host, src, dst_dir, environ)
        if verbose:
            say('syncing %s to %s:%s' % (src, host.name, dst_dir))
        _run_step(argv, '--sync-dst-dir: rsync to %s' % host.name)


def pick_node_ports(count, taken):
    """`count` distinct free ports on this host, none in `taken`.

    Free here when picked; for ssh jobs they are assumed free on the other hosts too
    (a busy one makes that node exit naming the port).
    """
    ports = []
    while len(ports) < count:
        port = pick_port(None)
        if port not in ports and port not in taken:
            ports.append(port)
    return ports


def build_config(args, environ, cluster, root_uri, remote):
    port = pick_port(args.port)
    node_ports = None
    if args.restarts and args.launcher != 'mpi':
        node_ports = pick_node_ports(args.num_servers + args.num_workers, {port})
    return JobConfig(
        cluster=cluster, root_uri=root_uri, port=port, node_ports=node_ports,
        metrics_port=args.metrics_port,
        num_servers=args.num_servers, num_workers=args.num_workers,
        forwarded=forwarded_env(environ, remote, args.interface),
        env_all=parse_env_specs(args.env, '--env', environ),
        env_server=parse_env_specs(args.env_server, '--env-server', environ),
        env_worker=parse_env_specs(args.env_worker, '--env-worker', environ))


def _local_spawn(cfg, role, task_id, argv, environ):
    def spawn(restart_count):
        env = dict(environ)
        env.pop(MPI_SPEC_VAR, None)
        env.update(node_env(cfg, role, task_id, restart_count))
        return list(argv), env, None
    return spawn


def scheduler_node(cfg, binary, environ):
    return Node('scheduler', None, _local_spawn(cfg, 'scheduler', None, [binary], environ))


def local_nodes(cfg, args, scheduler_bin, server_bin, environ):
    nodes = [scheduler_node(cfg, scheduler_bin, environ)]
    for i in range(cfg.num_servers):
        nodes.append(Node('server', i, _local_spawn(cfg, 'server', i, [server_bin] +
                                                    args.server_argv_extra, environ),
                          restartable=True))
    for i in range(cfg.num_workers):
        nodes.append(Node('worker', i, _local_spawn(cfg, 'worker', cfg.num_servers + i,
                                                    args.command, environ),
                          primary=True, restartable=True))
    return nodes


def ssh_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ):
    cwd = os.getcwd()
    workdir = args.sync_dst_dir or cwd
    server_hosts, worker_hosts = place(hosts, cfg.num_servers, cfg.num_workers)
    ssh_base_argv(hosts[0], environ)  # checks TESSERA_SSH_OPTS early

    def remote_spawn(role, task_id, host, argv):
        argv = [remote_path(argv[0], cwd, args.sync_dst_dir)] + list(argv[1:])

        def spawn(restart_count):
            return (ssh_argv(host, workdir, node_env(cfg, role, task_id, restart_count), argv,
                             environ, key_from_stdin=role in cfg.key_text),
                    dict(environ), None)
        return spawn

    def keyed(node):
        text = cfg.node_key_text.get((node.role, node.index), cfg.key_text.get(node.role))
        if text is not None:
            node.stdin_data = (text + KEY_END_MARKER + '\n').encode()
        return node

    nodes = [scheduler_node(cfg, scheduler_bin, environ)]
    for i, host in enumerate(server_hosts):
        nodes.append(keyed(Node('server', i, remote_spawn('server', i, host,
                                                          [server_bin] + args.server_argv_extra),
                                host=host, remote=True, restartable=True)))
    for i, host in enumerate(worker_hosts):
        nodes.append(keyed(Node('worker', i, remote_spawn('worker', cfg.num_servers + i, host,
                                                          args.command),
                                host=host, remote=True, primary=True, restartable=True)))
    return nodes


def mpi_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ, tmpdir):
    cwd = os.getcwd()
    workdir = args.sync_dst_dir or cwd
    here = os.path.abspath(__file__)
    python = sys.executable or 'python3'
    if hosts:
        python = 'python3'
        here = remote_path(here, cwd, args.sync_dst_dir)
        server_bin = remote_path(server_bin, cwd, args.sync_dst_dir)
    worker_argv = list(args.command)
    worker_argv[0] = remote_path(worker_argv[0], cwd, args.sync_dst_dir)
    # Shared variables travel as -x; per-role ones in the spec the ranks read.
    common = node_env(cfg, 'server')
    for name in ('DMLC_ROLE', 'TESSERA_RESTART_COUNT'):
        del common[name]
    common.pop('TESSERA_METRICS_PORT', None)  # per rank (mpi_child)
    role_env = {}
    for role, extra in (('server', cfg.env_server), ('worker', cfg.env_worker)):
        role_env[role] = dict(cfg.forwarded)
        role_env[role].update(cfg.env_all)
        role_env[role].update(extra)
    for env in role_env.values():
        for name in env:
            common.pop(name, None)
    spec = {
        'metrics_port': cfg.metrics_port,
        'num_servers': cfg.num_servers,
        'server_argv': [server_bin] + args.server_argv_extra if cfg.num_servers else [],
        'worker_argv': worker_argv,
        'server_env': role_env['server'],
        'worker_env': role_env['worker'],
    }
    common[MPI_SPEC_VAR] = base64.urlsafe_b64encode(json.dumps(spec).encode()).decode()
    argv = ['mpirun', '--allow-run-as-root', '--oversubscribe', '--tag-output',
            '-np', str(cfg.num_servers + cfg.num_workers), '--wdir', workdir]
    if hosts:
        ports = set(h.port for h in hosts if h.port)
        if len(ports) > 1 or (ports and any(h.port is None for h in hosts)):
            raise UsageError('-H/--hostfile: --launcher mpi needs the same ssh port on every '
                             'host (Open MPI has one ssh command line)')
        # One line per rank for Open MPI's sequential mapper (rank i runs on line
        # i): the placement of the ssh launcher. By-slot mapping of an
        # oversubscribed hostfile would pile the extra ranks (servers first) onto
        # the first host instead of wrapping around.
        server_hosts, worker_hosts = place(hosts, cfg.num_servers, cfg.num_workers)
        cfg.mpi_hosts = [h.name for h in server_hosts + worker_hosts]
        hostfile = os.path.join(tmpdir, 'openmpi-hostfile')
        with open(hostfile, 'w') as f:
            for h in server_hosts + worker_hosts:
                f.write('%s\n' % h.name)
        rsh = ssh_base_argv(hosts[0], environ)[1:]
        argv += ['--hostfile', hostfile, '--mca', 'rmaps', 'seq',
                 '--mca', 'plm_rsh_args', ' '.join(shlex.quote(a) for a in rsh)]
    for name, value in sorted(common.items()):
        argv += ['-x', '%s=%s' % (name, value)]
    argv += [python, here, '--mpi-child']

    def spawn(_restart_count):
        return argv, dict(environ), None

    mpirun = Node('mpirun', None, spawn, primary=True)
    num_servers = cfg.num_servers

    def tag(rank):
        if rank < num_servers:
            return b'[server %d] ' % rank
        return b'[worker %d] ' % (rank - num_servers)
    mpirun.tag_map = tag
    mpirun.split_stderr = True  # mpirun writes a line's text and newline separately
    return [scheduler_node(cfg, scheduler_bin, environ), mpirun]


# ----------------------------------------------------------------------------
# Slurm

_TASKS_PER_NODE_RE = re.compile(r'^(\d+)(?:\(x(\d+)\))?$')


def parse_tasks_per_node(text):
    """SLURM_TASKS_PER_NODE ('2(x3),1') as a list of counts ([2, 2, 2, 1]), or
    None when text is not in that form."""
    counts = []
    for part in text.split(','):
        m = _TASKS_PER_NODE_RE.match(part.strip())
        if not m or int(m.group(1)) < 1:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _slurm_query(argv, what):
    """Runs a Slurm client command (scontrol) and returns its output. Raises
    UsageError naming what it was for."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise UsageError('--launcher slurm: %s: cannot run %s: %s' % (what, argv[0], e))
    if proc.returncode != 0:
        err = proc.stderr.decode('utf-8', 'replace').strip().splitlines()[-1:] or ['']
        raise UsageError('--launcher slurm: %s: `%s` %s: %s'
                         % (what, ' '.join(argv), describe_status(proc.returncode, False),
                            err[0]))
    return proc.stdout.decode('utf-8', 'replace')


def slurm_hosts(environ):
    """The allocation's nodes as Hosts, in SLURM_JOB_NODELIST order, each with
    its SLURM_TASKS_PER_NODE count as slots (1 each when that is missing or does
    not match the node count). Raises UsageError outside an allocation."""
    job_id = environ.get('SLURM_JOB_ID') or environ.get('SLURM_JOBID')
    nodelist = environ.get('SLURM_JOB_NODELIST') or environ.get('SLURM_NODELIST')
    if not job_id or not nodelist:
        raise UsageError('--launcher slurm: %s is not set: run launch.py inside a Slurm '
                         'allocation (salloc -N NODES ... tools/launch.py ..., or an sbatch '
                         'script: tools/slurm/)'
                         % ('SLURM_JOB_ID' if not job_id else 'SLURM_JOB_NODELIST'))
    names = _slurm_query(['scontrol', 'show', 'hostnames', nodelist],
                         'SLURM_JOB_NODELIST=%s' % nodelist).split()
    if not names:
        raise UsageError('--launcher slurm: SLURM_JOB_NODELIST=%s: `scontrol show hostnames` '
                         'gave no nodes' % nodelist)
    for name in names:
        if not _HOST_NAME_RE.match(name) or name.startswith('-'):
            raise UsageError('--launcher slurm: SLURM_JOB_NODELIST=%s: %r is not a node name'
                             % (nodelist, name))
    counts = parse_tasks_per_node(environ.get('SLURM_TASKS_PER_NODE', ''))
    if counts is None or len(counts) != len(names):
        counts = [1] * len(names)
    return [Host(name, None, slots) for name, slots in zip(names, counts)]


def slurm_node_address(name):
    """The NodeAddr Slurm reaches node `name` at (its name when Slurm has no
    other address for it). Raises UsageError."""
    out = _slurm_query(['scontrol', 'show', 'node', '--oneliner', name],
                       'the address of node %s (the scheduler\'s)' % name)
    m = re.search(r'(?:^|\s)NodeAddr=(\S+)', out)
    return m.group(1) if m else name


def srun_argv(host, role, index):
    """srun for one process: a one-task step on `host` that shares the
    allocation's CPUs with the job's other steps (--overlap), so that S+W+1 steps
    start at once whatever the allocation's task count. --export=ALL: an sbatch
    --export=NONE (SLURM_EXPORT_ENV) must not strip the DMLC_* variables."""
    name = role if index is None else '%s-%d' % (role, index)
    return ['srun', '--nodes=1', '--ntasks=1', '--ntasks-per-node=1',
            '--nodelist=%s' % host.name, '--overlap', '--export=ALL', '--quiet',
            '--job-name=tessera-%s' % name]


def slurm_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ):
    """The job as one srun step per process: scheduler on hosts[0], servers then
    workers placed over the hosts' slots. Each step runs REMOTE_WRAPPER, which
    reads the process's key from the step's stdin and stops the process when
    that stdin closes (teardown)."""
    server_hosts, worker_hosts = place(hosts, cfg.num_servers, cfg.num_workers)
    base = dict(environ)
    for name in ('DMLC_NODE_HOST', MPI_SPEC_VAR):  # this host's, not the nodes'
        base.pop(name, None)

    def step(role, index, task_id, host, argv, **kw):
        def spawn(restart_count):
            env = dict(base)
            env.update(node_env(cfg, role, task_id, restart_count))
            keyed = role in cfg.key_text
            wrapper = (['bash', '-c', REMOTE_WRAPPER, 'tessera-launch'] +
                       ([KEY_FROM_STDIN] if keyed else []))
            return srun_argv(host, role, index) + wrapper + list(argv), env, None
        node = Node(role, index, spawn, host=host, remote=True, **kw)
        node.transport = 'srun'
        text = cfg.node_key_text.get((role, index), cfg.key_text.get(role))
        if text is not None:
            node.stdin_data = (text + KEY_END_MARKER + '\n').encode()
        else:
            node.stdin_data = b''  # stdin stays a pipe: the watchdog waits for its EOF
        return node

    nodes = [step('scheduler', None, None, hosts[0], [scheduler_bin])]
    for i, host in enumerate(server_hosts):
        nodes.append(step('server', i, i, host, [server_bin] + args.server_argv_extra,
                          restartable=True))
    for i, host in enumerate(worker_hosts):
        nodes.append(step('worker', i, cfg.num_servers + i, host, args.command,
                          primary=True, restartable=True))
    return nodes


def prepare_keys(cfg, args, hosts, tmpdir):
    """Writes fresh job keys into tmpdir (0700) and says where every process finds
    its own (cfg.key_env, cfg.key_text). Returns the folder mpi ranks on other hosts
    read (created there by install_mpi_keys), or None."""
    texts = make_job_keys()
    node_texts = {}
    if args.launcher != 'mpi':
        # Every process its own key (mpi ranks read one folder per host, by
        # role: they keep their role's keys).
        texts['scheduler'], node_texts = make_node_keys(texts, cfg.num_servers,
                                                        cfg.num_workers)
    for role in ROLES:
        write_private(os.path.join(tmpdir, '%s.key' % role), texts[role])
    local = dict((r, {'TESSERA_KEY_FILE': os.path.join(tmpdir, '%s.key' % r)}) for r in ROLES)
    if args.launcher == 'local':
        cfg.key_env = local
        for (role, index), text in node_texts.items():
            path = os.path.join(tmpdir, '%s-%d.key' % (role, index))
            write_private(path, text)
            cfg.node_key_env[(role, index)] = {'TESSERA_KEY_FILE': path}
        return None
    if args.launcher == 'slurm':  # every process is remote, the scheduler too
        cfg.key_env = {}
        cfg.key_text = dict(texts)
        cfg.node_key_text = node_texts
        return None
    cfg.key_env = {'scheduler': local['scheduler']}
    cfg.key_text = {'server': texts['server'], 'worker': texts['worker']}
    if args.launcher == 'ssh':
        cfg.node_key_text = node_texts
        return None
    # mpi: every rank of a host reads one folder, named on mpirun's command line.
    remote_dir = '/tmp/tessera-keys-%s' % secrets.token_hex(16) if hosts else None
    for role in ('server', 'worker'):
        cfg.key_env[role] = {'TESSERA_KEY_DIR': remote_dir or tmpdir}
    return remote_dir


def install_mpi_keys(cfg, hosts, remote_dir, environ, verbose, say):
    """Puts each host's roles' keys into remote_dir there, over ssh (stdin).
    Raises SetupError."""
    server_hosts, worker_hosts = place(hosts, cfg.num_servers, cfg.num_workers)
    for host in distinct_hosts(hosts):
        roles = [r for r, on in (('server', server_hosts), ('worker', worker_hosts))
                 if any(h.key == host.key for h in on)]
        for role in roles:
            if verbose:
                say('storing the %s key in %s:%s' % (role, host.name, remote_dir))
            argv = ssh_base_argv(host, environ) + [host.name,
                                                   mpi_key_dir_command(remote_dir, role)]
            try:
                proc = subprocess.run(argv, input=cfg.key_text[role].encode(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      timeout=60)
            except (OSError, subprocess.SubprocessError) as e:
                raise SetupError('cannot store the job keys on %s: %s' % (host.name, e))
            if proc.returncode != 0:
                tail = proc.stdout.decode('utf-8', 'replace').strip().splitlines()[-1:] or ['']
                raise SetupError('cannot store the job keys on %s (%s): %s'
                                 % (host.name, describe_status(proc.returncode, True), tail[0]))


def remove_mpi_keys(hosts, remote_dir, environ):
    """Removes remote_dir from every host (best effort)."""
    for host in distinct_hosts(hosts):
        argv = ssh_base_argv(host, environ) + [host.name, 'rm -rf %s' % shlex.quote(remote_dir)]
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass


def mpi_child(environ):
    """One mpirun rank: becomes a server or a worker (by rank) via exec."""
    label = '%s --mpi-child' % PROG
    rank = None
    for name in ('OMPI_COMM_WORLD_RANK', 'PMIX_RANK', 'PMI_RANK'):
        if environ.get(name, '').isdigit():
            rank = int(environ[name])
            break
    if rank is None or MPI_SPEC_VAR not in environ:
        sys.stderr.write('%s: expected OMPI_COMM_WORLD_RANK and %s (run by launch.py '
                         '--launcher mpi)\n' % (label, MPI_SPEC_VAR))
        return 2
    spec = json.loads(base64.urlsafe_b64decode(environ[MPI_SPEC_VAR].encode()))
    role = 'server' if rank < spec['num_servers'] else 'worker'
    env = dict(environ)
    del env[MPI_SPEC_VAR]
    env.update(spec['%s_env' % role])
    env.update({'DMLC_ROLE': role, 'DMLC_TASK_ID': str(rank), 'TESSERA_RESTART_COUNT': '0'})
    if spec.get('metrics_port') is not None:
        env['TESSERA_METRICS_PORT'] = str(spec['metrics_port'] + rank + 1)
    argv = spec['%s_argv' % role]
    preexec = _pdeathsig_preexec()
    if preexec:
        preexec()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        sys.stderr.write('%s: rank %d (%s): cannot run %s: %s\n' % (label, rank, role,
                                                                    argv[0], e))
        return 127


def main(argv=None, environ=None):
    environ = dict(os.environ if environ is None else environ)
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.mpi_child:
            return mpi_child(environ)
        path_env = environ.get('PATH', os.defpath)
        if args.interface:
            interface_ipv4(args.interface)  # fails early for a wrong name
        hosts = None
        if args.launcher in ('ssh', 'mpi') and args.hostfile:
            hosts = parse_hostfile(args.hostfile)
        if args.launcher != 'ssh':
            check_command(args.command, path_env)
        if args.launcher == 'mpi' and not shutil.which('mpirun', path=path_env):
            raise UsageError('--launcher mpi: mpirun not found on PATH (Debian: apt-get '
                             'install openmpi-bin)')
        if args.launcher == 'slurm':
            for tool in ('srun', 'scontrol'):
                if not shutil.which(tool, path=path_env):
                    raise UsageError('--launcher slurm: %s not found on PATH (Debian: '
                                     'apt-get install slurm-client)' % tool)
            hosts = slurm_hosts(environ)
        fallback = own_build_dirs(environ)
        scheduler_bin = find_binary(SCHEDULER_BINARY, '--scheduler-binary',
                                    args.scheduler_binary, args.command, path_env, fallback)
        server_bin = None
        if args.num_servers > 0:
            server_bin = find_binary(SERVER_BINARY, '--server-binary', args.server_binary,
                                     args.command, path_env, fallback)
        if args.launcher == 'local':
            cfg = build_config(args, environ, 'local', '127.0.0.1', remote=False)
        elif args.launcher == 'slurm':
            root = environ.get('DMLC_PS_ROOT_URI') or slurm_node_address(hosts[0].name)
            cfg = build_config(args, environ, 'slurm', root, remote=True)
        else:
            root = (scheduler_address(args.interface, environ, hosts[0]) if hosts
                    else '127.0.0.1')
            cfg = build_config(args, environ, args.launcher, root, remote=bool(hosts))
        security = job_security(environ)
    except UsageError as e:
        sys.stderr.write('%s: error: %s\n' % (PROG, e))
        return 2

    def say(message):
        sys.stderr.write('%s: %s\n' % (PROG, message))
        sys.stderr.flush()

    with tempfile.TemporaryDirectory(prefix='tessera-launch-') as tmpdir:
        remote_key_dir = None
        if security == 'generate':
            remote_key_dir = prepare_keys(cfg, args, hosts, tmpdir)
        try:
            if args.launcher == 'local':
                nodes = local_nodes(cfg, args, scheduler_bin, server_bin, environ)
            elif args.launcher == 'ssh':
                nodes = ssh_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ)
            elif args.launcher == 'slurm':
                nodes = slurm_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ)
            else:
                nodes = mpi_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ, tmpdir)
        except UsageError as e:
            sys.stderr.write('%s: error: %s\n' % (PROG, e))
            return 2
        job = Job(nodes, args.timeout, args.restarts, args.verbose, args.quiet_notice)
        install_signal_handlers(job)
        if args.verbose:
            say('%s job: scheduler at %s:%d, %d server(s), %d worker(s)'
                % (cfg.cluster, cfg.root_uri, cfg.port, cfg.num_servers, cfg.num_workers))
        if cfg.metrics_port is not None:
            say('metrics: ' + ', '.join('%s %s' % (name, url)
                                        for name, url in metrics_urls(cfg, nodes)))
        if args.sync_dst_dir and hosts:
            try:
                sync_hosts(hosts, args.sync_dst_dir, environ, args.verbose, say)
            except SetupError as e:
                say(str(e))
                return 1
            if job.stop_signal:
                return 128 + job.stop_signal
        try:
            if remote_key_dir:
                try:
                    install_mpi_keys(cfg, hosts, remote_key_dir, environ, args.verbose, say)
                except SetupError as e:
                    say(str(e))
                    return 1
            return job.run()
        finally:
            if remote_key_dir:
                remove_mpi_keys(hosts, remote_key_dir, environ)


if __name__ == '__main__':
    sys.exit(main())
