"""The ssh launcher: servers and workers on the hosts of a hostfile, each over
its own ssh connection (REMOTE_WRAPPER, the key on the channel's stdin), the
scheduler here; and --sync-dst-dir's rsync.

    nodes = ssh_nodes(cfg, args, hosts, scheduler_bin, server_bin, os.environ)

Errors: UsageError (TESSERA_SSH_OPTS), SetupError (rsync).
"""

import os
import posixpath
import shlex
import subprocess

from .config import node_env, server_rank
from .hosts import distinct_hosts, place
from .local import scheduler_node
from .options import SetupError, UsageError
from .remote import KEY_FROM_STDIN, REMOTE_WRAPPER, key_stdin
from .supervisor import Node, describe_status


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
            node.stdin_data = key_stdin(text)
        return node

    nodes = [scheduler_node(cfg, scheduler_bin, environ)]
    for i, host in enumerate(server_hosts):
        nodes.append(keyed(Node('server', i, remote_spawn('server', i, host,
                                                          [server_bin] + args.server_argv_extra),
                                host=host, remote=True, restartable=True,
                                rank=server_rank(cfg, i))))
    for i, host in enumerate(worker_hosts):
        nodes.append(keyed(Node('worker', i, remote_spawn('worker', cfg.num_servers + i, host,
                                                          args.command),
                                host=host, remote=True, primary=True, restartable=True)))
    return nodes
