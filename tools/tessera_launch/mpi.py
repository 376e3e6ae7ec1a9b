"""The mpi launcher: servers and workers as the ranks of one mpirun (each rank
re-runs launch.py --mpi-child, which execs its role's program), the scheduler
here; ranks read their role's keys from one folder per host.

    nodes = mpi_nodes(cfg, args, hosts, scheduler_bin, server_bin, os.environ, tmpdir,
                      script)   # script: the launch.py the ranks run

Errors: UsageError (a hostfile mpirun cannot take), SetupError (storing keys).
"""

import base64
import json
import os
import shlex
import subprocess
import sys

from .config import node_env, server_rank
from .hosts import distinct_hosts, place
from .local import scheduler_node
from .options import MPI_SPEC_VAR, PROG, SetupError, UsageError
from .ssh import remote_path, ssh_base_argv
from .supervisor import Node, describe_status, pdeathsig_preexec


def mpi_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ, tmpdir, script):
    """The scheduler here and one mpirun whose ranks run `script` (launch.py)
    --mpi-child, which becomes the rank's server or worker."""
    cwd = os.getcwd()
    workdir = args.sync_dst_dir or cwd
    here = os.path.abspath(script)
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
    # An MPI rank's DMLC_TASK_ID is the rank itself: the scheduler ranks the
    # servers and the workers in that order (config.server_rank).
    server_ranks = [server_rank(cfg, i) for i in range(num_servers)]

    def tag(rank):
        if rank < num_servers:
            return b'[server %d] ' % server_ranks[rank]
        return b'[worker %d] ' % (rank - num_servers)
    mpirun.tag_map = tag
    mpirun.split_stderr = True  # mpirun writes a line's text and newline separately
    return [scheduler_node(cfg, scheduler_bin, environ), mpirun]


def mpi_key_dir_command(key_dir, role):
    """The remote shell command that stores one role's key (read from stdin) in
    key_dir, a 0700 folder of random name that only this user may own."""
    d = shlex.quote(key_dir)
    tmp = shlex.quote('%s/%s.key.tmp' % (key_dir, role))
    final = shlex.quote('%s/%s.key' % (key_dir, role))
    return ('umask 077 && mkdir -p %s && test -O %s && test ! -L %s && chmod 700 %s && '
            'cat > %s && mv -f %s %s' % (d, d, d, d, tmp, tmp, final))


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
    preexec = pdeathsig_preexec()
    if preexec:
        preexec()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        sys.stderr.write('%s: rank %d (%s): cannot run %s: %s\n' % (label, rank, role,
                                                                    argv[0], e))
        return 127
