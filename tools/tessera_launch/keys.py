"""Job keys: fresh X25519 key pairs in the key file format the daemons read
(common/curve_keys.h), one file per role, plus one key of its own for every
server and worker; and where each process of a launch finds its key.

The one Python writer of Tessera key files: tests and benchmarks that start
daemons by hand use it too (tools/keygen/tessera-keygen is the C++ one, for
jobs started without launch.py; it makes role keys only).

    write_job_keys(folder)             # folder/scheduler.key, server.key, worker.key
    texts = make_job_keys()            # {role: file text}

Thread-safety: none needed (no shared state). Errors: OSError from the files,
UsageError from job_security.
"""

import os
import secrets

from .options import UsageError


ROLES = ('scheduler', 'server', 'worker')
_Z85_CHARS = ('0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'
              '.-:+=^!/*?&<>()[]{}@%$#')
_P25519 = 2 ** 255 - 19


def z85_encode(data):
    """ZeroMQ's Z85 (RFC 32) of bytes whose length is a multiple of 4."""
    out = []
    for i in range(0, len(data), 4):
        value = int.from_bytes(data[i:i + 4], 'big')
        chunk = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            chunk.append(_Z85_CHARS[digit])
        out.extend(reversed(chunk))
    return ''.join(out)


def x25519(scalar, u):
    """X25519 (RFC 7748, the Montgomery ladder) of 32-byte strings: what
    libsodium's crypto_scalarmult does. Runs once per role per job, on the
    launching host, so Python's non-constant-time integers do not matter."""
    k = bytearray(scalar)
    k[0] &= 248
    k[31] &= 127
    k[31] |= 64
    k = int.from_bytes(bytes(k), 'little')
    x1 = int.from_bytes(u, 'little') & ((1 << 255) - 1)
    x2, z2, x3, z3, swap = 1, 0, x1, 1, 0
    p = _P25519
    for t in reversed(range(255)):
        bit = (k >> t) & 1
        if swap ^ bit:
            x2, x3, z2, z3 = x3, x2, z3, z2
        swap = bit
        a, b = (x2 + z2) % p, (x2 - z2) % p
        aa, bb = a * a % p, b * b % p
        e = (aa - bb) % p
        c, d = (x3 + z3) % p, (x3 - z3) % p
        da, cb = d * a % p, c * b % p
        x3 = (da + cb) ** 2 % p
        z3 = x1 * (da - cb) ** 2 % p
        x2 = aa * bb % p
        z2 = e * (aa + 121665 * e) % p
    if swap:
        x2, z2 = x3, z3
    return (x2 * pow(z2, p - 2, p) % p).to_bytes(32, 'little')


def make_job_keys():
    """Fresh key pairs for the three roles; returns {role: key file text}."""
    pairs = {}
    for role in ROLES:
        secret = secrets.token_bytes(32)
        public = x25519(secret, (9).to_bytes(32, 'little'))
        pairs[role] = (z85_encode(public), z85_encode(secret))
    files = {}
    for role in ROLES:
        lines = ['# Tessera job keys, role %s. Private: keep this file mode 0600.' % role,
                 'role %s' % role, 'secret-key %s' % pairs[role][1]]
        lines += ['%s-public-key %s' % (r, pairs[r][0]) for r in ROLES]
        files[role] = '\n'.join(lines) + '\n'
    return files


def make_node_keys(texts, num_servers, num_workers):
    """A key pair of its own for every server and worker (its identity towards
    the scheduler, so that a worker's keys speak for that worker only), added to
    its role's key file, and the roster of their public halves added to the
    scheduler's. Returns (scheduler's file text, {(role, index): file text})."""
    roster, files = [], {}
    for role, count in (('server', num_servers), ('worker', num_workers)):
        for index in range(count):
            secret = secrets.token_bytes(32)
            public = x25519(secret, (9).to_bytes(32, 'little'))
            files[(role, index)] = (texts[role].rstrip('\n') +
                                    '\n# This process\'s own key (%s %d).\n'
                                    'node-secret-key %s\n' % (role, index, z85_encode(secret)))
            roster.append('node-key %s %s' % (role, z85_encode(public)))
    scheduler = (texts['scheduler'].rstrip('\n') +
                 '\n# Every node\'s own key: a node registers with one of them.\n' +
                 ''.join(line + '\n' for line in roster))
    return scheduler, files


def write_private(path, text):
    """Creates `path` mode 0600 (never replacing a file) and writes `text`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0),
                 0o600)
    with os.fdopen(fd, 'w') as f:
        f.write(text)


def write_job_keys(folder):
    """Writes a fresh job's scheduler.key, server.key and worker.key into
    `folder` (which must exist), each mode 0600, never replacing a file: what
    tessera-keygen writes, for daemons started without launch.py."""
    for role, text in make_job_keys().items():
        write_private(os.path.join(folder, role + '.key'), text)


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


def prepare_keys(cfg, args, hosts, tmpdir):
    """Writes fresh job keys into tmpdir (0700) and says where every process finds
    its own (cfg.key_env, cfg.key_text). Returns the folder mpi ranks on other hosts
    read (created there by install_mpi_keys), or None."""
    texts = make_job_keys()
    node_texts = {}
    if args.launcher != 'mpi':
        # Every process its own key (mpi ranks read one folder per host, by
        # role: they keep their role's keys).
        texts['scheduler'], node_texts = make_node_keys(texts, cfg.num_servers,
                                                        cfg.num_workers)
    for role in ROLES:
        write_private(os.path.join(tmpdir, '%s.key' % role), texts[role])
    local = dict((r, {'TESSERA_KEY_FILE': os.path.join(tmpdir, '%s.key' % r)}) for r in ROLES)
    if args.launcher == 'local':
        cfg.key_env = local
        for (role, index), text in node_texts.items():
            path = os.path.join(tmpdir, '%s-%d.key' % (role, index))
            write_private(path, text)
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
