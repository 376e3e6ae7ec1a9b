"""Workers added to a running elastic job (launch.py --add-workers N --join FILE),
and servers added to a running job whose servers may change (replicated, or started
with --max-servers: --add-servers N --join FILE).

An elastic job started by the local or ssh launcher writes a job file into its private
folder (0700, with its keys) and prints how to add workers. The file holds what a
joining worker needs: the scheduler's address and the job's worker variables
(DMLC_*, TESSERA_ELASTIC, where keys are, what launch.py forwarded) and, when
launch.py made the job's keys, the node keys it made for joiners (each added
worker claims one no worker used before).
A second launch.py started with --add-workers N --join FILE runs N copies of the
worker program with those variables; each registers with the scheduler, which
gives it a rank while fewer than MAX workers are in the job (docs/faults.md,
"Elastic jobs").

A job of the ssh launcher writes the same file (its "workdir": the folder its
processes run in on the hosts); its joiners start on the hosts of the adding
launch.py's -H, over ssh, each key sent down its channel's stdin. A job of the
Slurm launcher names its allocation and nodes too ("slurm_job", "slurm_nodes"):
its joiners start as steps of that allocation (srun --jobid) on those nodes,
round-robin, each key on the step's stdin.

The file of a job whose servers may change also holds what an added server needs: the server
program (with --server-args), the servers' variables (TESSERA_SPARE=1: the
scheduler gives it a server rank without a live server, docs/faults.md,
"Servers join", "One copy") and the server keys made for joiners.

    write_job_file(tmpdir, cfg, server_argv)    # the running job's side; the path
    nodes = added_worker_nodes(args, environ)   # the adding launch.py's side
    nodes = added_server_nodes(args, environ)

Errors: UsageError for a job file that cannot be read or is not one.
"""

import json
import os

from .config import node_env, servers_change
from .hosts import HOST_NAME_RE, Host, parse_hostfile
from .keys import MAX_JOINER_KEYS, joiner_keys, server_joiner_keys
from .options import MPI_SPEC_VAR, UsageError, parse_env_specs
from .remote import KEY_FROM_STDIN, REMOTE_WRAPPER, key_stdin
from .slurm import srun_argv
from .ssh import ssh_argv, ssh_base_argv
from .supervisor import Node

JOB_FILE = 'job.json'
_VERSION = 1
# Set per process by the running job's launcher, never shared with a joiner.
_PER_PROCESS = ('TESSERA_METRICS_PORT', 'DMLC_TASK_ID', 'PORT', 'TESSERA_RESTART_COUNT')


def _shared_env(cfg, role):
    env = node_env(cfg, role)
    for name in _PER_PROCESS:
        env.pop(name, None)
    return env


def _key_files(cfg, role, first, count, folder):
    """The node key files made for joiners: those of this host's processes
    (cfg.node_key_env), or for an ssh job, whose keys travel on stdin, the files
    tessera-keygen wrote into the job's folder."""
    keys = []
    for index in range(first, first + count):
        key_env = cfg.node_key_env.get((role, index), {})
        if 'TESSERA_KEY_FILE' in key_env:
            keys.append(key_env['TESSERA_KEY_FILE'])
        elif (role, index) in cfg.node_key_text:
            keys.append(os.path.join(folder, '%s-%d.key' % (role, index)))
    return keys


def write_job_file(folder, cfg, server_argv=None, workdir=None, slurm=None):
    """Writes folder/job.json (0600) for workers (an elastic job) and servers (a
    job whose servers may change, `server_argv` the server program) that join the running job
    `cfg`; returns its path. With fresh keys it lists the node keys made for
    joiners (keys.joiner_keys, keys.server_joiner_keys): each joiner claims one.
    An ssh job (`workdir`: the folder its processes run in on the hosts) says
    so: joiners start there over ssh, their keys on the channel's stdin. A
    Slurm job (`slurm`: (job id, node names)) says so too: joiners start as
    steps of its allocation on its nodes, their keys on the step's stdin."""
    job = {'tessera_job': _VERSION, 'scheduler': '%s:%d' % (cfg.root_uri, cfg.port),
           'worker_env': _shared_env(cfg, 'worker'),
           'joiner_keys': _key_files(cfg, 'worker', cfg.num_workers, joiner_keys(cfg),
                                     folder)}
    if workdir is not None:
        job['launcher'] = 'ssh' if slurm is None else 'slurm'
        job['workdir'] = workdir
    if slurm is not None:
        job['slurm_job'], job['slurm_nodes'] = slurm[0], list(slurm[1])
    if server_argv and servers_change(cfg):
        job['server_argv'] = list(server_argv)
        job['server_env'] = _shared_env(cfg, 'spare')
        job['server_keys'] = _key_files(
            cfg, 'server', cfg.num_servers + getattr(cfg, 'spare_servers', 0),
            server_joiner_keys(cfg), folder)
    path = os.path.join(folder, JOB_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, 'w') as f:
        json.dump(job, f, indent=1, sort_keys=True)
    return path


def claim_key(keys, path, role='worker'):
    """The first key file of `keys` no added worker (or server) claimed yet
    (claimed by creating KEY.claimed, which fails when it exists). Raises
    UsageError when none is left."""
    for key in keys:
        try:
            os.close(os.open(key + '.claimed', os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            return key
        except FileExistsError:
            continue
    if role == 'server':
        raise UsageError('--join %s: every server key the job made for joiners (%d: one per '
                         'server rank, at most %d) is taken; start such a job with your own '
                         'keys (TESSERA_KEY_DIR: any server may use the role key)'
                         % (path, len(keys), MAX_JOINER_KEYS))
    raise UsageError('--join %s: every worker key the job made for joiners (%d: MAX of '
                     '--elastic MIN:MAX, at most %d) is taken; start such a job with your own '
                     'keys (TESSERA_KEY_DIR: any worker may use the role key)'
                     % (path, len(keys), MAX_JOINER_KEYS))


def _load_job_file(path):
    """The job file at `path` as a dict. Raises UsageError, also for a file
    another user owns or others may write (its variables go into the joiners'
    environment)."""
    try:
        # Checked and read through one descriptor (no symbolic link): the file
        # read is the file checked, whatever happens to the path between.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            info = os.fstat(f.fileno())
            if info.st_uid != os.getuid() or info.st_mode & 0o022:
                raise UsageError('--join %s: not trusted: a job file must be your own and '
                                 'writable by you only (launch.py writes it 0600)' % path)
            job = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError('--join %s: cannot read the job file (%s); it is the file an '
                         'elastic job started by launch.py names when it starts, and it '
                         'goes away when that job ends' % (path, e))
    return job


def _where(job, path, args):
    """Where the joiners run: None (a job of this host), or a dict with the
    "workdir" they run in on the hosts and, for a Slurm job, "slurm_job" and
    "slurm_nodes". Raises UsageError when --launcher does not fit the job."""
    kind = job.get('launcher', 'local') if isinstance(job, dict) else 'local'
    if kind == 'slurm' or args.launcher == 'slurm':
        if kind != 'slurm' or args.launcher != 'slurm':
            raise UsageError('--join %s --launcher %s: the job was started by the %s '
                             'launcher; add processes with --launcher %s'
                             % (path, args.launcher, kind, kind))
        nodes = job.get('slurm_nodes')
        if not isinstance(job.get('workdir'), str) or not job.get('workdir') or \
                not isinstance(job.get('slurm_job'), str) or not job.get('slurm_job') or \
                not isinstance(nodes, list) or not nodes or \
                not all(isinstance(n, str) and HOST_NAME_RE.match(n) and
                        not n.startswith('-') for n in nodes):
            raise UsageError('--join %s: the job file of a Slurm job names no "workdir", '
                             '"slurm_job" or "slurm_nodes" (node names)' % path)
        return job
    ssh_job = kind == 'ssh'
    if args.launcher == 'ssh' and not ssh_job:
        raise UsageError('--join %s --launcher ssh: the job was started by the local '
                         'launcher, whose scheduler listens on 127.0.0.1 only: other hosts '
                         'cannot reach it (start the job with --launcher ssh to add '
                         'processes on other hosts)' % path)
    if not ssh_job:
        return None
    workdir = job.get('workdir')
    if not isinstance(workdir, str) or not workdir:
        raise UsageError('--join %s: the job file of an ssh job names no "workdir"' % path)
    if args.launcher != 'ssh':
        raise UsageError('--join %s: the job runs on other hosts (--launcher ssh); add '
                         'processes there with --launcher ssh -H HOSTFILE' % path)
    return {'workdir': workdir}


def read_job_file(path):
    """The worker variables and joiner keys of the job file at `path`. Raises
    UsageError, also for a file another user owns or others may write (its
    variables go into the workers' environment)."""
    return _worker_part(_load_job_file(path), path)


def _worker_part(job, path):
    env = job.get('worker_env') if isinstance(job, dict) else None
    keys = job.get('joiner_keys', []) if isinstance(job, dict) else None
    if (job.get('tessera_job') != _VERSION if isinstance(job, dict) else True) or \
            not isinstance(env, dict) or not env.get('TESSERA_ELASTIC') or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()) or \
            not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise UsageError('--join %s: not a job file of an elastic job (expected what '
                         'launch.py --elastic writes: {"tessera_job": %d, "worker_env": '
                         '{..., "TESSERA_ELASTIC": "MIN:MAX"}})' % (path, _VERSION))
    return env, keys


def added_worker_nodes(args, environ):
    """The N workers of --add-workers: the worker program with the job file's
    variables, then --env and --env-worker on top."""
    job = _load_job_file(args.join)
    job_env, keys = _worker_part(job, args.join)
    where = _where(job, args.join, args)
    job_env.update(parse_env_specs(args.env, '--env', environ))
    job_env.update(parse_env_specs(args.env_worker, '--env-worker', environ))
    return _joiner_nodes(args, environ, 'worker', args.add_workers, args.command, job_env,
                         keys, where)


def _read_key(path, join):
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise UsageError('--join %s: cannot read the joiner key %s (%s); the job\'s keys go '
                         'away when it ends' % (join, path, e.strerror or e))


def _joiner_nodes(args, environ, role, count, argv, job_env, keys, where=None):
    """`count` processes running `argv` with the job file's variables `job_env`;
    with fresh keys each claims its own, never used before. With `where` (an
    ssh or Slurm job, _where) they start in its "workdir" on other hosts,
    round-robin: those of -H over ssh, or the Slurm job's nodes as steps of its
    allocation (srun --jobid); each key goes down the channel's or the step's
    stdin (remote.REMOTE_WRAPPER), never into a file there that outlives the
    process."""
    slurm = where is not None and 'slurm_job' in where
    if slurm:
        hosts = [Host(name, None, 1) for name in where['slurm_nodes']]
    elif where is not None:
        hosts = parse_hostfile(args.hostfile)
    else:
        hosts = None
    nodes = []
    for i in range(count):
        key = claim_key(keys, args.join, role) if keys else None
        own = {'TESSERA_KEY_FILE': key} if key else {}
        env_here = dict(job_env)
        if args.metrics_port is not None:
            env_here['TESSERA_METRICS_PORT'] = str(args.metrics_port + i)
        if hosts is None:
            def spawn(restart_count, env_here=env_here, own=own):
                env = dict(environ)
                env.update(env_here)
                env.update(own)
                return list(argv), env, None
            nodes.append(Node('added ' + role, i, spawn, primary=True))
            continue
        host = hosts[i % len(hosts)]
        keyed = key is not None
        if slurm:
            def remote_spawn(restart_count, host=host, env_here=env_here, keyed=keyed,
                             index=i):
                env = {k: v for k, v in environ.items()
                       if k not in ('DMLC_NODE_HOST', MPI_SPEC_VAR)}
                env.update(env_here)
                step = srun_argv(host, 'added-' + role, index) + [
                    '--jobid=%s' % where['slurm_job'], '--chdir=%s' % where['workdir']]
                wrapper = (['bash', '-c', REMOTE_WRAPPER, 'tessera-launch'] +
                           ([KEY_FROM_STDIN] if keyed else []))
                return step + wrapper + list(argv), env, None
            node = Node('added ' + role, i, remote_spawn, host=host, remote=True,
                        primary=True)
            node.transport = 'srun'
            node.stdin_data = key_stdin(_read_key(key, args.join)) if keyed else b''
            nodes.append(node)
            continue
        ssh_base_argv(host, environ)  # checks TESSERA_SSH_OPTS now

        def remote_spawn(restart_count, host=host, env_here=env_here, keyed=keyed):
            return (ssh_argv(host, where['workdir'], env_here, argv, environ,
                             key_from_stdin=keyed),
                    dict(environ), None)
        node = Node('added ' + role, i, remote_spawn, host=host, remote=True, primary=True)
        if keyed:
            node.stdin_data = key_stdin(_read_key(key, args.join))
        nodes.append(node)
    return nodes


def read_server_job_file(path):
    """The server program, variables and joiner keys of the job file at `path`.
    Raises UsageError, also for a job that servers cannot join (not replicated)."""
    return _server_part(_load_job_file(path), path)


def _server_part(job, path):
    ok = isinstance(job, dict) and job.get('tessera_job') == _VERSION
    argv = job.get('server_argv') if ok else None
    env = job.get('server_env') if ok else None
    keys = job.get('server_keys', []) if ok else None
    if not isinstance(argv, list) or not argv or \
            not all(isinstance(a, str) for a in argv) or not isinstance(env, dict) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()) or \
            not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise UsageError('--join %s: not a job file of a job servers may join (expected '
                         'what launch.py --replicas R >= 2 or --max-servers M writes: '
                         '{"tessera_job": %d, "server_argv": [...], "server_env": {...}}); '
                         'servers join replicated jobs and jobs started with --max-servers '
                         'only' % (path, _VERSION))
    return argv, env, keys


def added_server_nodes(args, environ):
    """The N servers of --add-servers: the job's server program with the job
    file's variables (TESSERA_SPARE=1), then --env and --env-server on top."""
    job = _load_job_file(args.join)
    argv, job_env, keys = _server_part(job, args.join)
    where = _where(job, args.join, args)
    job_env.update(parse_env_specs(args.env, '--env', environ))
    job_env.update(parse_env_specs(args.env_server, '--env-server', environ))
    return _joiner_nodes(args, environ, 'server', args.add_servers, argv, job_env, keys,
                         where)
