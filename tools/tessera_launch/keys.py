"""Job keys: fresh key files for every job, made by `tessera-keygen` (the one
writer of Tessera key files and their X25519 keys, tools/keygen; format in
common/curve_keys.h): one file per role, plus one of its own for every server
and worker, listed in the scheduler's; and where each process of a launch finds
its key.

    write_job_keys(folder)             # folder/scheduler.key, server.key, worker.key
    texts = make_job_keys()            # {role: file text}
    keygen = find_keygen(os.environ, near=scheduler_binary)

Thread-safety: none needed (no shared state). Errors: UsageError when
tessera-keygen cannot be found (and from job_security), SetupError when it
fails, OSError from the files.
"""

import os
import secrets
import shutil
import subprocess
import tempfile

from .binaries import RUNTIME_TARGET, SOURCE_TREE_SCRIPT, own_build_dirs
from .config import elastic_of, max_servers_of, servers_change
from .options import SetupError, UsageError


ROLES = ('scheduler', 'server', 'worker')
KEYGEN = 'tessera-keygen'


def find_keygen(environ, near=None, script=SOURCE_TREE_SCRIPT):
    """The tessera-keygen of the daemons' build or install: beside the daemon
    binary `near` (an install's bin/) or in its build's tools/keygen, then in
    $TESSERA_BUILD_DIR and the checkout's build, then on PATH. Returns an
    absolute path; raises UsageError naming where it looked (as a missing
    daemon does)."""
    dirs = []
    if near:
        here = os.path.dirname(os.path.abspath(near))
        dirs += [here, os.path.join(os.path.dirname(here), 'tools', 'keygen')]
    for d in own_build_dirs(environ, script):
        dirs += [d, os.path.join(d, 'tools', 'keygen')]
    seen = []
    for d in dirs:
        d = os.path.normpath(d)
        if d in seen:
            continue
        seen.append(d)
        path = os.path.join(d, KEYGEN)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    found = shutil.which(KEYGEN, path=environ.get('PATH', os.defpath))
    if found:
        return os.path.abspath(found)
    raise UsageError('cannot find %s (it makes the job\'s keys): looked in %s and on PATH; '
                     'build it with: cmake --build build --target %s, or set '
                     'TESSERA_BUILD_DIR to the build folder'
                     % (KEYGEN, ', '.join(seen), RUNTIME_TARGET))


def run_keygen(folder, keygen=None, num_servers=None, num_workers=None):
    """Runs tessera-keygen into `folder` (which may exist): role files, and with
    node counts a file of its own for every server and worker."""
    argv = [keygen or find_keygen(os.environ)]
    if num_servers is not None:
        argv += ['--servers', str(num_servers), '--workers', str(num_workers)]
    argv.append(folder)
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          universal_newlines=True)
    if done.returncode != 0:
        raise SetupError('%s failed (exit %d): %s'
                         % (' '.join(argv), done.returncode, done.stderr.strip()))


def _read(path):
    with open(path) as f:
        return f.read()


def make_job_keys(keygen=None):
    """Fresh key files for the three roles; returns {role: key file text}."""
    with tempfile.TemporaryDirectory(prefix='tessera-keys-') as tmp:
        folder = os.path.join(tmp, 'keys')
        run_keygen(folder, keygen)
        return dict((role, _read(os.path.join(folder, role + '.key'))) for role in ROLES)


def write_job_keys(folder, keygen=None):
    """Writes a fresh job's scheduler.key, server.key and worker.key into
    `folder`, each mode 0600, never replacing a file (tessera-keygen DIR)."""
    run_keygen(folder, keygen)


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


# Keys made for workers joining an elastic job (launch.py --add-workers), at
# most: each joiner needs a key no worker used before (the scheduler retires
# the key of a worker that left).
MAX_JOINER_KEYS = 256


def joiner_keys(cfg):
    """Node keys an elastic job makes for joiners beyond its own workers: MAX of
    TESSERA_ELASTIC=MIN:MAX (every rank may be taken again once), at most
    MAX_JOINER_KEYS; 0 for other jobs. Worker keys -n .. -n + this - 1."""
    bounds = elastic_of(cfg).split(':')
    try:
        return min(int(bounds[1]), MAX_JOINER_KEYS) if len(bounds) == 2 else 0
    except ValueError:
        return 0


def server_joiner_keys(cfg):
    """Node keys a job whose servers may change makes for servers added while it runs
    (launch.py --add-servers): one per server rank (every rank may be taken
    again once), at most MAX_JOINER_KEYS; 0 for other jobs. Server keys after
    the job's own servers' and spares'."""
    return min(max_servers_of(cfg), MAX_JOINER_KEYS) if servers_change(cfg) else 0


def prepare_keys(cfg, args, hosts, tmpdir, keygen=None):
    """Writes fresh job keys into tmpdir (0700) with tessera-keygen and says where
    every process finds its own (cfg.key_env, cfg.key_text). Returns the folder
    mpi ranks on other hosts read (created there by install_mpi_keys), or None."""
    node_texts = {}
    if args.launcher != 'mpi':
        # Every process its own key (mpi ranks read one folder per host, by
        # role: they keep their role's keys).
        servers = (cfg.num_servers + getattr(cfg, 'spare_servers', 0)
                   + server_joiner_keys(cfg))
        workers = cfg.num_workers + joiner_keys(cfg)
        run_keygen(tmpdir, keygen, servers, workers)
        for role, count in (('server', servers), ('worker', workers)):
            for index in range(count):
                node_texts[(role, index)] = _read(
                    os.path.join(tmpdir, '%s-%d.key' % (role, index)))
    else:
        run_keygen(tmpdir, keygen)
    texts = dict((role, _read(os.path.join(tmpdir, role + '.key'))) for role in ROLES)
    local = dict((r, {'TESSERA_KEY_FILE': os.path.join(tmpdir, '%s.key' % r)}) for r in ROLES)
    if args.launcher == 'local':
        cfg.key_env = local
        for role, index in node_texts:
            path = os.path.join(tmpdir, '%s-%d.key' % (role, index))
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
