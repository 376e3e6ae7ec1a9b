"""The launcher's command line: its flags, their checks, and the errors that end
a launch before any process starts.

    args = parse_args(['-n', '2', '-s', '1', 'build/worker/my_trainer'])
    args.num_workers, args.num_servers, args.command   # 2, 1, ['build/...']

Errors: UsageError (a caller mistake: one line, exit 2), SetupError (the job
could not be prepared, e.g. rsync failed: one line, exit 1).
"""

import argparse
import re
import shlex

PROG = 'launch.py'
SCHEDULER_BINARY = 'tessera-scheduler'
SERVER_BINARY = 'tessera-server'

# Carries the per-role argv and environment to `launch.py --mpi-child` ranks.
MPI_SPEC_VAR = 'TESSERA_LAUNCH_MPI_SPEC'
LAUNCHERS = ('local', 'ssh', 'mpi', 'slurm')

# Set by the launcher itself; --env must not override them.
RESERVED_VARS = frozenset([
    'DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT', 'DMLC_NUM_SERVER',
    'DMLC_NUM_WORKER', 'DMLC_TASK_ID', 'DMLC_JOB_CLUSTER',
    'TESSERA_RESTART_COUNT', MPI_SPEC_VAR,
])
_ENV_NAME_RE = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')


class UsageError(Exception):
    """A caller mistake: reported as one line, exit status 2."""


class SetupError(Exception):
    """The job could not be prepared (e.g. rsync failed): one line, exit 1."""


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
              '[-H HOSTFILE] [options] COMMAND [ARGS...]\n'
              '       %(prog)s --status [HOST:PORT] (or --metrics-port BASE --status)',
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
    p.add_argument('--status', nargs='?', const='', metavar='HOST:PORT',
                   help='print what a running job waits for (its processes\' /debug/pending) '
                        'and exit; HOST:PORT: the scheduler\'s metrics address (default: '
                        '127.0.0.1 and --metrics-port)')
    p.add_argument('--timeout', type=_seconds_arg, default=30.0, metavar='SECONDS',
                   help='grace for the scheduler and servers to exit after the workers '
                        'finished (default: 30)')
    p.add_argument('--restarts', type=_int_arg(0, 'a non-negative integer'), default=0,
                   metavar='N', help='restart a failed server or worker up to N times')
    p.add_argument('--replicas', type=_int_arg(1, 'a whole number >= 1'), default=None,
                   metavar='R', help='servers holding each key slice (TESSERA_REPLICAS, default '
                   '1): a server that dies is replaced by the next replica of each of its '
                   'slices and the job goes on (docs/faults.md); with --restarts a dead '
                   'server is restarted and rejoins as a replacement')
    p.add_argument('--spare-servers', type=_int_arg(0, 'a non-negative integer'), default=0,
                   metavar='K', help='start K spare servers (TESSERA_SPARE=1, --launcher local): '
                   'each waits until a server dies, takes its rank and catches up on its '
                   'key slices from their replicas (needs --replicas R >= 2)')
    p.add_argument('--max-servers', type=_int_arg(1, 'a positive integer'), default=None,
                   metavar='M', help='servers may join the running job up to M, and leave '
                   'it (TESSERA_MAX_SERVERS, -s <= M, with --replicas R >= 2 also M <= -s x R): '
                   'the key slices are placed over M server ranks, the -s servers take '
                   'ranks spread over them, and a server added later (--add-servers) '
                   'takes a rank without one, catches up and answers for its slices; '
                   'without --replicas each slice has one copy, moved to a server that '
                   'joins and away from one that leaves on SIGTERM '
                   '(docs/faults.md, "Servers join")')
    p.add_argument('--add-servers', type=_int_arg(1, 'a positive integer'), default=None,
                   metavar='N', help='add N servers to a running job (replicated, or '
                   'started with --max-servers) instead of starting one: needs --join '
                   'FILE, the job file that job named when it started; each takes a '
                   'server rank that has no live server')
    p.add_argument('--elastic', default=None, metavar='MIN:MAX',
                   help='an elastic job (TESSERA_ELASTIC): a worker that dies or leaves '
                   '(SIGTERM: after its step) no longer ends the job while at least MIN '
                   'workers remain; the rounds go on without it; while fewer than MAX are '
                   'in the job, a worker started with its keys and the scheduler\'s '
                   'address joins it (docs/faults.md, "Elastic jobs")')
    p.add_argument('--add-workers', type=_int_arg(1, 'a positive integer'), default=None,
                   metavar='N', help='add N workers (this COMMAND) to a running elastic job '
                   'instead of starting one: needs --join FILE, the job file that job named '
                   'when it started; -n, -s and the job\'s other settings come from it')
    p.add_argument('--join', default=None, metavar='FILE',
                   help='with --add-workers or --add-servers: the running job\'s job file '
                   '(launch.py --elastic or --replicas prints its path); for a job of the '
                   'ssh launcher add --launcher ssh -H HOSTFILE: the added processes start '
                   'on those hosts')
    p.add_argument('--quiet-notice', type=_seconds_arg, default=60.0, metavar='SECONDS',
                   help='when the job has printed nothing for this long, say which of its '
                        'processes still run (default: 60; again every SECONDS)')
    p.add_argument('--verbose', action='store_true', help='say what the launcher does')
    p.add_argument('--mpi-child', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('command', nargs=argparse.REMAINDER, metavar='COMMAND [ARGS...]',
                   help='the worker program and its arguments')
    return p


def _check_adder_launcher(args, flag):
    """--add-workers/--add-servers start their processes on this host (--launcher
    local), on the hosts of -H over ssh (--launcher ssh), or as steps of a Slurm
    job's allocation on its nodes (--launcher slurm: the job file names them)."""
    if args.launcher not in ('local', 'ssh', 'slurm'):
        raise UsageError('%s: with --launcher local (on this host), ssh (on the hosts of '
                         '-H) or slurm (on the Slurm job\'s nodes), not %s'
                         % (flag, args.launcher))
    if args.launcher == 'ssh' and not args.hostfile:
        raise UsageError('%s --launcher ssh: expected -H/--hostfile HOSTFILE (the hosts the '
                         'added processes start on, round-robin)' % flag)
    if args.launcher in ('local', 'slurm') and args.hostfile:
        raise UsageError('-H/--hostfile: only with --launcher ssh (%s starts its processes '
                         'on this host with --launcher local, and on the Slurm job\'s nodes '
                         'with --launcher slurm)' % flag)
    if args.sync_dst_dir:
        raise UsageError('--sync-dst-dir: not with %s (the added processes run in the '
                         'job\'s own folder on the hosts, which the job file names)' % flag)


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
    '--replicas', '--spare-servers', '--elastic', '--add-workers', '--join',
    '--max-servers', '--add-servers',
])


def parse_args(argv):
    """Parses and checks the command line. Raises UsageError."""
    args = build_parser().parse_args(_join_server_args(argv))
    if args.command and args.command[0] == '--':
        args.command = args.command[1:]
    if args.mpi_child:
        return args
    if args.status is not None:
        if not args.status:
            if args.metrics_port is None:
                raise UsageError('--status: expected HOST:PORT (the scheduler\'s metrics '
                                 'address) or --metrics-port BASE')
            args.status = '127.0.0.1:%d' % args.metrics_port
        return args
    if args.add_servers is not None:
        if args.add_workers is not None:
            raise UsageError('--add-servers and --add-workers: one at a time (each is a '
                             'launch.py of its own)')
        if not args.join:
            raise UsageError('--add-servers N and --join FILE go together (N servers join '
                             'the running job of the job file FILE)')
        if args.command:
            raise UsageError('--add-servers: no COMMAND (the servers run the job\'s '
                             'tessera-server, which the job file names)')
        _check_adder_launcher(args, '--add-servers')
        for flag, value in (('-n', args.num_workers), ('-s', args.num_servers),
                            ('--elastic', args.elastic), ('--replicas', args.replicas),
                            ('--max-servers', args.max_servers)):
            if value is not None:
                raise UsageError('%s: not with --add-servers (the job file says the job\'s '
                                 'settings)' % flag)
        return args
    if args.add_workers is not None or args.join is not None:
        if args.add_workers is None or not args.join:
            raise UsageError('--add-workers N and --join FILE go together (N workers join '
                             'the running elastic job of the job file FILE)')
        if not args.command:
            raise UsageError('missing COMMAND: expected the worker program (and its '
                             'arguments) after the flags')
        _check_adder_launcher(args, '--add-workers')
        for flag, value in (('-n', args.num_workers), ('-s', args.num_servers),
                            ('--elastic', args.elastic), ('--replicas', args.replicas),
                            ('--max-servers', args.max_servers)):
            if value is not None:
                raise UsageError('%s: not with --add-workers (the job file says the job\'s '
                                 'settings)' % flag)
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
    if args.replicas is not None and args.replicas > args.num_servers:
        raise UsageError('--replicas %d: expected at most the number of servers (%d)'
                         % (args.replicas, args.num_servers))
    if args.spare_servers:
        if args.replicas is None or args.replicas < 2:
            raise UsageError('--spare-servers %d: needs --replicas R >= 2 (a spare takes the '
                             'rank of a dead server and catches up from its slices\' '
                             'replicas)' % args.spare_servers)
        if args.launcher != 'local':
            raise UsageError('--spare-servers: only with --launcher local so far (spares on '
                             'other hosts: start tessera-server with TESSERA_SPARE=1 there)')
    if args.max_servers is not None:
        replicas = args.replicas or 1
        most = max(args.num_servers, 256)  # as the servers read TESSERA_MAX_SERVERS
        if replicas < 2 and not args.num_servers <= args.max_servers <= most:
            raise UsageError('--max-servers %d: expected -s (%d) <= M <= %d (one copy of '
                             'each slice)' % (args.max_servers, args.num_servers, most))
        if replicas >= 2 and not (args.num_servers <= args.max_servers
                                  <= args.num_servers * replicas):
            raise UsageError('--max-servers %d: expected -s (%d) <= M <= -s x --replicas '
                             '(%d): every chain of R ranks needs a server at the start'
                             % (args.max_servers, args.num_servers,
                                args.num_servers * replicas))
    if args.elastic is not None:
        m = re.match(r'^(\d+):(\d+)$', args.elastic)
        low, high = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        if not m or low < 1 or low > args.num_workers or high < args.num_workers:
            raise UsageError('--elastic %r: expected MIN:MAX with 1 <= MIN <= -n (%d) <= MAX'
                             % (args.elastic, args.num_workers))
    if args.metrics_port is not None:
        last = args.metrics_port + args.num_servers + args.num_workers + args.spare_servers
        if last > 65535:
            raise UsageError('--metrics-port %d: expected a port in 1..%d (this job needs %d '
                             'ports from it)' % (args.metrics_port,
                                                 65535 - args.num_servers - args.num_workers
                                                 - args.spare_servers,
                                                 1 + args.num_servers + args.num_workers
                                                 + args.spare_servers))
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
