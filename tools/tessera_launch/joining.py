"""Workers added to a running elastic job (launch.py --add-workers N --join FILE).

An elastic job started by the local launcher writes a job file into its private
folder (0700, with its keys) and prints how to add workers. The file holds what a
joining worker needs: the scheduler's address and the job's worker variables
(DMLC_*, TESSERA_ELASTIC, where keys are, what launch.py forwarded) and, when
launch.py made the job's keys, the node keys it made for joiners (each added
worker claims one no worker used before).
A second launch.py started with --add-workers N --join FILE runs N copies of the
worker program with those variables; each registers with the scheduler, which
gives it a rank while fewer than MAX workers are in the job (docs/faults.md,
"Elastic jobs").

    write_job_file(tmpdir, cfg)          # the running job's side; returns the path
    nodes = added_worker_nodes(args, environ)   # the adding launch.py's side

Errors: UsageError for a job file that cannot be read or is not one.
"""

import json
import os

from .config import node_env
from .keys import MAX_JOINER_KEYS, joiner_keys
from .options import UsageError, parse_env_specs
from .supervisor import Node

JOB_FILE = 'job.json'
_VERSION = 1
# Set per process by the running job's launcher, never shared with a joiner.
_PER_PROCESS = ('TESSERA_METRICS_PORT', 'DMLC_TASK_ID', 'PORT', 'TESSERA_RESTART_COUNT')


def write_job_file(folder, cfg):
    """Writes folder/job.json (0600) for workers that join the running job `cfg`;
    returns its path. With fresh keys it lists the worker keys made for joiners
    (keys.joiner_keys): each added worker claims one."""
    env = node_env(cfg, 'worker')
    for name in _PER_PROCESS:
        env.pop(name, None)
    keys = []
    for index in range(cfg.num_workers, cfg.num_workers + joiner_keys(cfg)):
        key_env = cfg.node_key_env.get(('worker', index), {})
        if 'TESSERA_KEY_FILE' in key_env:
            keys.append(key_env['TESSERA_KEY_FILE'])
    path = os.path.join(folder, JOB_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, 'w') as f:
        json.dump({'tessera_job': _VERSION, 'scheduler': '%s:%d' % (cfg.root_uri, cfg.port),
                   'worker_env': env, 'joiner_keys': keys}, f, indent=1, sort_keys=True)
    return path


def claim_key(keys, path):
    """The first key file of `keys` no added worker claimed yet (claimed by
    creating KEY.claimed, which fails when it exists). Raises UsageError when
    none is left."""
    for key in keys:
        try:
            os.close(os.open(key + '.claimed', os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            return key
        except FileExistsError:
            continue
    raise UsageError('--join %s: every worker key the job made for joiners (%d: MAX of '
                     '--elastic MIN:MAX, at most %d) is taken; start such a job with your own '
                     'keys (TESSERA_KEY_DIR: any worker may use the role key)'
                     % (path, len(keys), MAX_JOINER_KEYS))


def read_job_file(path):
    """The worker variables and joiner keys of the job file at `path`. Raises
    UsageError, also for a file another user owns or others may write (its
    variables go into the workers' environment)."""
    try:
        info = os.stat(path)
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise UsageError('--join %s: not trusted: a job file must be your own and '
                             'writable by you only (launch.py writes it 0600)' % path)
        with open(path) as f:
            job = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError('--join %s: cannot read the job file (%s); it is the file an '
                         'elastic job started by launch.py names when it starts, and it '
                         'goes away when that job ends' % (path, e))
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
    job_env, keys = read_job_file(args.join)
    job_env.update(parse_env_specs(args.env, '--env', environ))
    job_env.update(parse_env_specs(args.env_worker, '--env-worker', environ))
    nodes = []
    for i in range(args.add_workers):
        # A job with fresh keys: each worker its own, never used before.
        own = {'TESSERA_KEY_FILE': claim_key(keys, args.join)} if keys else {}

        def spawn(restart_count, i=i, own=own):
            env = dict(environ)
            env.update(job_env)
            env.update(own)
            if args.metrics_port is not None:
                env['TESSERA_METRICS_PORT'] = str(args.metrics_port + i)
            return list(args.command), env, None
        nodes.append(Node('added worker', i, spawn, primary=True))
    return nodes
