"""The slurm launcher: inside an allocation, one srun step per process (the
scheduler on the first node), each running REMOTE_WRAPPER with its key on the
step's stdin.

    hosts = slurm_hosts(os.environ)            # the allocation's nodes
    nodes = slurm_nodes(cfg, args, hosts, scheduler_bin, server_bin, os.environ)

Errors: UsageError (outside an allocation, or scontrol failing).
"""

import re
import subprocess

from .config import node_env, server_rank
from .hosts import HOST_NAME_RE, Host, place
from .options import MPI_SPEC_VAR, UsageError
from .remote import KEY_FROM_STDIN, REMOTE_WRAPPER, key_stdin
from .supervisor import Node, describe_status


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
        if not HOST_NAME_RE.match(name) or name.startswith('-'):
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
            node.stdin_data = key_stdin(text)
        else:
            node.stdin_data = b''  # stdin stays a pipe: the watchdog waits for its EOF
        return node

    nodes = [step('scheduler', None, None, hosts[0], [scheduler_bin])]
    for i, host in enumerate(server_hosts):
        nodes.append(step('server', i, i, host, [server_bin] + args.server_argv_extra,
                          restartable=True, rank=server_rank(cfg, i)))
    for i, host in enumerate(worker_hosts):
        nodes.append(step('worker', i, cfg.num_servers + i, host, args.command,
                          primary=True, restartable=True))
    return nodes
