"""launch.py's main(): checks the command line and the environment, makes the
job's keys, builds its processes with the chosen launcher and runs the job.

    sys.exit(main(script=os.path.abspath(__file__)))   # in tools/launch.py

Exit status: the job's (see tools/launch.py), 2 for a usage error.
"""

import os
import shutil
import sys
import tempfile

from .binaries import SOURCE_TREE_SCRIPT, check_command, find_binary, own_build_dirs
from .config import (build_config, elastic_of, max_servers_of, metrics_urls, replicas_of,
                     servers_change)
from .hosts import interface_ipv4, parse_hostfile, scheduler_address
from .joining import added_server_nodes, added_worker_nodes, write_job_file
from .keys import find_keygen, job_security, prepare_keys
from .local import local_nodes
from .mpi import install_mpi_keys, mpi_child, mpi_nodes, remove_mpi_keys
from .options import PROG, SCHEDULER_BINARY, SERVER_BINARY, SetupError, UsageError, parse_args
from .slurm import slurm_hosts, slurm_node_address, slurm_nodes
from .ssh import remote_path, ssh_nodes, sync_hosts
from .supervisor import Job, install_signal_handlers
from . import status


def add_nodes(args, nodes, what):
    """launch.py --add-workers N (or --add-servers N) --join FILE: runs the N
    workers (servers) that join the running job to their end. Returns their
    exit status (the first failure's, which stops the others)."""
    sys.stderr.write('%s: adding %d %s to the %s job of %s\n'
                     % (PROG, len(nodes), what,
                        'elastic' if what.startswith('worker') else 'running', args.join))
    sys.stderr.flush()
    job = Job(nodes, args.timeout, 0, args.verbose, args.quiet_notice)
    install_signal_handlers(job)
    return job.run()


def main(argv=None, environ=None, script=SOURCE_TREE_SCRIPT):
    """Runs launch.py with `argv` (default: sys.argv[1:]) in `environ` (default:
    os.environ); `script` is the launch.py that runs (where it looks for the
    daemons last, and what mpi ranks run). Returns the exit status."""
    environ = dict(os.environ if environ is None else environ)
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.mpi_child:
            return mpi_child(environ)
        if args.status is not None:
            return status.main(args.status, sys.stdout)
        path_env = environ.get('PATH', os.defpath)
        if args.add_servers is not None:
            return add_nodes(args, added_server_nodes(args, environ), 'server(s)')
        if args.add_workers is not None:
            check_command(args.command, path_env)
            return add_nodes(args, added_worker_nodes(args, environ), 'worker(s)')
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
        fallback = own_build_dirs(environ, script)
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
        keygen = (find_keygen(environ, near=scheduler_bin, script=script)
                  if security == 'generate' else None)
    except UsageError as e:
        sys.stderr.write('%s: error: %s\n' % (PROG, e))
        return 2

    def say(message):
        sys.stderr.write('%s: %s\n' % (PROG, message))
        sys.stderr.flush()

    with tempfile.TemporaryDirectory(prefix='tessera-launch-') as tmpdir:
        remote_key_dir = None
        if security == 'generate':
            try:
                remote_key_dir = prepare_keys(cfg, args, hosts, tmpdir, keygen)
            except (SetupError, OSError) as e:
                say('cannot make the job\'s keys: %s' % e if isinstance(e, OSError) else str(e))
                return 1
        try:
            if args.launcher == 'local':
                nodes = local_nodes(cfg, args, scheduler_bin, server_bin, environ)
            elif args.launcher == 'ssh':
                nodes = ssh_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ)
            elif args.launcher == 'slurm':
                nodes = slurm_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ)
            else:
                nodes = mpi_nodes(cfg, args, hosts, scheduler_bin, server_bin, environ, tmpdir,
                                  script)
        except UsageError as e:
            sys.stderr.write('%s: error: %s\n' % (PROG, e))
            return 2
        job = Job(nodes, args.timeout, args.restarts, args.verbose, args.quiet_notice,
                  replicas=replicas_of(cfg), elastic=elastic_of(cfg))
        install_signal_handlers(job)
        servers_join = servers_change(cfg) and server_bin is not None
        if (elastic_of(cfg) or servers_join) and args.launcher in ('local', 'ssh', 'slurm'):
            workdir = slurm = None
            server_argv = [server_bin] + args.server_argv_extra
            if args.launcher == 'ssh':  # as ssh_nodes runs them on the hosts
                workdir = args.sync_dst_dir or os.getcwd()
                server_argv[0] = remote_path(server_bin, os.getcwd(), args.sync_dst_dir)
            elif args.launcher == 'slurm':  # steps of this allocation, as slurm_nodes
                workdir = os.getcwd()
                slurm = (environ.get('SLURM_JOB_ID') or environ.get('SLURM_JOBID'),
                         [h.name for h in hosts])
            try:
                job_file = write_job_file(tmpdir, cfg,
                                          server_argv if servers_join else None, workdir,
                                          slurm)
            except OSError as e:
                say('cannot write the job file: %s' % e)
                return 1
            on_hosts = {'ssh': ' --launcher ssh -H HOSTFILE',
                        'slurm': ' --launcher slurm'}.get(args.launcher, '')
            if elastic_of(cfg):
                say('elastic job (TESSERA_ELASTIC=%s); to add workers while it runs: '
                    'launch.py --add-workers N --join %s%s COMMAND [ARGS...]'
                    % (elastic_of(cfg), job_file, on_hosts))
            if servers_join:
                ranks = max_servers_of(cfg)
                kind = ('replicated job (TESSERA_REPLICAS=%d' % replicas_of(cfg)
                        if replicas_of(cfg) >= 2
                        else 'job with one copy of each key slice (TESSERA_MAX_SERVERS=%d'
                        % ranks)
                say('%s, %d of %d server rank(s) with a server); to add servers while it '
                    'runs: launch.py --add-servers N --join %s%s'
                    % (kind, cfg.num_servers, ranks, job_file, on_hosts))
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
