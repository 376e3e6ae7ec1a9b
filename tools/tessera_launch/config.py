"""What every process of a job shares (JobConfig), and the environment each one
gets from it: the DMLC_* variables, what is forwarded from the launcher, --env
values, key locations, ports, the job's id (TESSERA_JOB_ID).

    cfg = build_config(args, os.environ, 'local', '127.0.0.1', remote=False)
    env = node_env(cfg, 'worker', task_id=cfg.num_servers)   # worker 0's variables

Errors: UsageError from build_config (a busy --port, a bad --env).
"""

import secrets
import sys

from .hosts import pick_node_ports, pick_port
from .options import MPI_SPEC_VAR, parse_env_specs

# TESSERA_* variables that configure the launcher, not the job.
NOT_FORWARDED = frozenset(['TESSERA_SSH_OPTS', 'TESSERA_RESTART_COUNT', MPI_SPEC_VAR])


class JobConfig(object):
    """What every process of one job shares."""

    def __init__(self, cluster, root_uri, port, num_servers, num_workers, forwarded,
                 env_all, env_server, env_worker, node_ports=None, metrics_port=None,
                 spare_servers=0):
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
        self.spare_servers = spare_servers  # servers with TESSERA_SPARE=1, after the workers
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
    Spare servers (role 'spare') have task ids after the workers'.
    """
    spare = role == 'spare'
    if spare:
        role = 'server'
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
        if spare:  # its node key: the servers' keys after the N ranks'
            index = cfg.num_servers + task_id - cfg.num_servers - cfg.num_workers
        env.update(cfg.node_key_env.get((role, index), {}))
    if cfg.metrics_port is not None:
        env['TESSERA_METRICS_PORT'] = str(metrics_port_of(cfg, task_id))
    if task_id is not None:
        env['DMLC_TASK_ID'] = str(task_id)
        if cfg.node_ports:
            env['PORT'] = str(cfg.node_ports[task_id])
    if spare:
        env['TESSERA_SPARE'] = '1'
    return env


def server_rank(cfg, index):
    """The rank the scheduler gives launch.py's server `index` (start order, as
    DMLC_TASK_ID): `index` itself, but in a job with TESSERA_MAX_SERVERS = M
    above -s = S the S servers take ranks spread over the M, index x M / S
    (scheduler.cc, FormJob), and are named by them."""
    most = max_servers_of(cfg)
    if cfg.num_servers <= 0 or most <= cfg.num_servers:
        return index
    return index * most // cfg.num_servers


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
                name = ('server %d' % server_rank(cfg, rank) if rank < cfg.num_servers
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
        elif node.role == 'spare':
            task_id = cfg.num_servers + cfg.num_workers + node.index
        host = node.host.name if node.host is not None else cfg.root_uri
        out.append((node.name, host, metrics_port_of(cfg, task_id)))
    return [(name, 'http://%s/metrics' % (('[%s]:%d' if ':' in host else '%s:%d')
                                          % (host, port)))
            for name, host, port in out]


def build_config(args, environ, cluster, root_uri, remote):
    port = pick_port(args.port)
    node_ports = None
    if args.restarts and args.launcher != 'mpi':
        node_ports = pick_node_ports(args.num_servers + args.num_workers
                                     + args.spare_servers, {port})
    env_all = parse_env_specs(args.env, '--env', environ)
    if args.replicas is not None:
        env_all['TESSERA_REPLICAS'] = str(args.replicas)
    if getattr(args, 'elastic', None) is not None:
        env_all['TESSERA_ELASTIC'] = args.elastic
    if getattr(args, 'max_servers', None) is not None:
        env_all['TESSERA_MAX_SERVERS'] = str(args.max_servers)
    if (not environ.get('TESSERA_KEY_DIR') and not environ.get('TESSERA_JOB_ID')
            and not env_all.get('TESSERA_JOB_ID')):
        # With keys it makes, a fresh job id (bound into every sealed link's
        # key, docs/security.md); joiners get it from the job file. Not with the
        # user's keys (TESSERA_KEY_DIR): a process started by hand with them
        # joins an elastic job, so the id is the user's to set, as for a job
        # started by hand.
        env_all['TESSERA_JOB_ID'] = fresh_job_id()
    warn_unbound_key_dir(environ, env_all)
    return JobConfig(
        cluster=cluster, root_uri=root_uri, port=port, node_ports=node_ports,
        metrics_port=args.metrics_port, spare_servers=args.spare_servers,
        num_servers=args.num_servers, num_workers=args.num_workers,
        forwarded=forwarded_env(environ, remote, args.interface),
        env_all=env_all,
        env_server=parse_env_specs(args.env_server, '--env-server', environ),
        env_worker=parse_env_specs(args.env_worker, '--env-worker', environ))


def warn_unbound_key_dir(environ, env_all):
    """Warns when the user's keys (TESSERA_KEY_DIR) go without a TESSERA_JOB_ID.

    Two jobs started with one key folder and no job id are not told apart: a
    process of one opens links of the other (docs/security.md, "job id").
    """
    if not environ.get('TESSERA_KEY_DIR') or environ.get('TESSERA_INSECURE') == '1':
        return
    if environ.get('TESSERA_JOB_ID') or env_all.get('TESSERA_JOB_ID'):
        return
    sys.stderr.write(
        'launch.py: warning: TESSERA_KEY_DIR is set and TESSERA_JOB_ID is not: '
        'another job started with the keys of %s is not told apart from this '
        'one (a process of either could reach the other); set TESSERA_JOB_ID '
        'to a value of this job alone (docs/security.md)\n'
        % environ['TESSERA_KEY_DIR'])
    sys.stderr.flush()


def fresh_job_id():
    """A TESSERA_JOB_ID no other job has: 'launch-' and 64 random bits."""
    return 'launch-' + secrets.token_hex(8)


def elastic_of(cfg):
    """TESSERA_ELASTIC as the nodes get it ('' when unset)."""
    value = cfg.forwarded.get('TESSERA_ELASTIC', '')
    return cfg.env_all.get('TESSERA_ELASTIC', value)


def max_servers_of(cfg):
    """The server ranks of the job: TESSERA_MAX_SERVERS as the servers get it, or
    -s when unset or not a number."""
    value = cfg.forwarded.get('TESSERA_MAX_SERVERS')
    value = cfg.env_all.get('TESSERA_MAX_SERVERS', value)
    value = cfg.env_server.get('TESSERA_MAX_SERVERS', value)
    try:
        return max(int(value), cfg.num_servers) if value else cfg.num_servers
    except ValueError:
        return cfg.num_servers


def servers_change(cfg):
    """Whether servers may join and leave the running job: a replicated one, or
    one started with TESSERA_MAX_SERVERS (one copy of each key slice, moved to
    the server that joins or away from the one that leaves)."""
    value = cfg.forwarded.get('TESSERA_MAX_SERVERS')
    value = cfg.env_all.get('TESSERA_MAX_SERVERS', value)
    value = cfg.env_server.get('TESSERA_MAX_SERVERS', value)
    return replicas_of(cfg) >= 2 or bool(value)


def replicas_of(cfg):
    """TESSERA_REPLICAS as the servers get it (--replicas, --env, --env-server or
    the launcher's environment); 1 when unset or not a number (the servers then
    say what is wrong with it)."""
    value = cfg.forwarded.get('TESSERA_REPLICAS')
    value = cfg.env_all.get('TESSERA_REPLICAS', value)
    value = cfg.env_server.get('TESSERA_REPLICAS', value)
    try:
        return max(1, int(value)) if value is not None else 1
    except ValueError:
        return 1
