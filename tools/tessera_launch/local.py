"""The local launcher: every process on this host, the scheduler of the ssh and
mpi launchers too.

    nodes = local_nodes(cfg, args, scheduler_bin, server_bin, os.environ)
"""

from .config import node_env, server_rank
from .options import MPI_SPEC_VAR
from .supervisor import Node


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
                          restartable=True, rank=server_rank(cfg, i)))
    for i in range(cfg.num_workers):
        nodes.append(Node('worker', i, _local_spawn(cfg, 'worker', cfg.num_servers + i,
                                                    args.command, environ),
                          primary=True, restartable=True))
    for j in range(getattr(cfg, 'spare_servers', 0)):
        task_id = cfg.num_servers + cfg.num_workers + j
        nodes.append(Node('spare', j, _local_spawn(cfg, 'spare', task_id, [server_bin] +
                                                   args.server_argv_extra, environ)))
    return nodes
