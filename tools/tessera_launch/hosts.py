r"""Where a job runs: the hostfile, the placement of servers and workers over its
hosts, this host's addresses and free ports.

    hosts = parse_hostfile_text('a slots=2\nb\n')     # [Host('a', slots=2), Host('b')]
    servers, workers = place(hosts, 1, 2)             # [a], [a, b]

Errors: UsageError naming the flag, file and line, or address at fault.
"""

import fcntl
import random
import re
import socket
import struct
import subprocess

from .options import UsageError

# What launch.py accepts as a host name (hostfile, Slurm node names).
HOST_NAME_RE = re.compile(r'^[A-Za-z0-9_.@%:-]+$')


class Host(object):
    """One hostfile entry: name (as given to ssh), ssh port or None, slots or None."""

    __slots__ = ('name', 'port', 'slots')

    def __init__(self, name, port=None, slots=None):
        self.name, self.port, self.slots = name, port, slots

    def __eq__(self, other):
        return (isinstance(other, Host) and
                (self.name, self.port, self.slots) == (other.name, other.port, other.slots))

    def __hash__(self):
        return hash((self.name, self.port, self.slots))

    def __repr__(self):
        return 'Host(%r, port=%r, slots=%r)' % (self.name, self.port, self.slots)

    @property
    def address(self):
        """The host without any user@ part, for name resolution."""
        return self.name.rpartition('@')[2]

    @property
    def key(self):
        """Identifies a distinct destination (for --sync-dst-dir)."""
        return (self.name, self.port)


_EXPECTED_LINE = "expected 'host', 'host:port' or 'host slots=N'"


def parse_hostfile_text(text, origin='hostfile'):
    """Parses hostfile contents. Raises UsageError naming origin and the line."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split('#', 1)[0].strip()
        if not line:
            continue

        def bad(why):
            return UsageError('%s line %d: %r: %s' % (origin, lineno, raw.strip(), why))

        tokens = line.split()
        spec, port, slots = tokens[0], None, None
        for token in tokens[1:]:
            key, sep, value = token.partition('=')
            if key != 'slots' or not sep or slots is not None:
                raise bad(_EXPECTED_LINE)
            if not value.isdigit() or int(value) < 1:
                raise bad('slots=%s: expected a positive integer' % value)
            slots = int(value)
        if spec.startswith('['):  # [v6addr] or [v6addr]:port
            m = re.match(r'^\[([0-9A-Fa-f:.%a-zA-Z]+)\](?::(.*))?$', spec)
            if not m:
                raise bad(_EXPECTED_LINE)
            name, port_text = m.group(1), m.group(2)
        elif spec.count(':') == 1:
            name, port_text = spec.split(':')
        else:  # plain name, or a bare IPv6 address (no port)
            name, port_text = spec, None
        if not name or name.startswith('-') or not HOST_NAME_RE.match(name):
            raise bad('%r is not a host name; %s' % (name, _EXPECTED_LINE))
        if port_text is not None:
            if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
                raise bad('port %r: expected 1..65535' % port_text)
            port = int(port_text)
        hosts.append(Host(name, port, slots))
    if not hosts:
        raise UsageError('%s: no hosts in it (%s)' % (origin, _EXPECTED_LINE))
    return hosts


def parse_hostfile(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UsageError('-H/--hostfile %s: cannot read it: %s' % (path, e.strerror or e))
    return parse_hostfile_text(text, 'hostfile %s' % path)


def place(hosts, num_servers, num_workers):
    """Places servers then workers on hosts, filling each host's slots (default 1)
    in hostfile order and wrapping around when there are more processes than
    slots, like mpirun's by-slot mapping. Returns (server_hosts, worker_hosts)."""
    slots = [h for h in hosts for _ in range(h.slots or 1)]
    seq = [slots[k % len(slots)] for k in range(num_servers + num_workers)]
    return seq[:num_servers], seq[num_servers:]


def distinct_hosts(hosts):
    seen, out = set(), []
    for h in hosts:
        if h.key not in seen:
            seen.add(h.key)
            out.append(h)
    return out


def interface_ipv4(name):
    """The IPv4 address of a local interface. Raises UsageError."""
    try:
        out = subprocess.run(['ip', '-o', '-4', 'addr', 'show', 'dev', name],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             timeout=10).stdout.decode('utf-8', 'replace')
        m = re.search(r'\binet (\d+\.\d+\.\d+\.\d+)/', out)
        if m:
            return m.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    try:  # No `ip` tool: ask the kernel directly (SIOCGIFADDR).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack('256s', name.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
    except OSError:
        pass
    raise UsageError('--interface %s: no such interface or it has no IPv4 address' % name)


def route_address_towards(host):
    """The local address of the route towards host (UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror:
        infos = socket.getaddrinfo(host, 9, 0, socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def scheduler_address(interface, environ, first_host):
    """The root URI as the hosts reach the launching host. Raises UsageError."""
    if interface:
        return interface_ipv4(interface)
    if environ.get('DMLC_PS_ROOT_URI'):
        return environ['DMLC_PS_ROOT_URI']
    try:
        return route_address_towards(first_host.address)
    except OSError as e:
        raise UsageError('cannot find this host\'s address as seen from %s (%s); pass '
                         '--interface NAME or set DMLC_PS_ROOT_URI'
                         % (first_host.address, getattr(e, 'strerror', None) or e))


def ephemeral_range():
    """The kernel's ephemeral port range (32768-60999 when it cannot be read)."""
    try:
        with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_LOWEST_PORT = 10000


def _binds(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(('', port))
        except OSError:
            return False
        return True


def free_port_run(count, taken=()):
    """The first of `count` consecutive ports, all free now, none in `taken`.

    Chosen below the kernel's ephemeral range. A port in that range (what a bind to
    port 0 returns) can be taken between this check and the daemon's bind by any
    outgoing connection; worse, a client that keeps connecting to a port nobody
    listens on yet can connect to itself (TCP simultaneous open: the kernel may give
    the client that very port as its source) and then holds the port, so the daemon
    fails with "Address already in use" (seen in CI: a test polling a worker's
    metrics port before the worker bound it). Below the range neither can happen.
    Falls back to the kernel's choice when there is no room below the range.
    """
    low, _ = ephemeral_range()
    if low - _LOWEST_PORT >= 1000 + count:
        rng = random.SystemRandom()
        for _ in range(200):
            first = rng.randrange(_LOWEST_PORT, low - count)
            run = range(first, first + count)
            if any(p in taken for p in run):
                continue
            if all(_binds(p) for p in run):
                return first
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(('', 0))
            first = s.getsockname()[1]
        run = range(first, first + count)
        if first + count <= 65536 and not any(p in taken for p in run) and all(
                _binds(p) for p in run):
            return first
    raise UsageError('cannot find %d free consecutive ports on this host' % count)


def pick_port(requested, taken=()):
    """A port the scheduler can bind. Raises UsageError if --port is busy."""
    if not requested:
        return free_port_run(1, taken)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(('', requested))
        except OSError as e:
            raise UsageError('--port %d: cannot be used on this host (%s); is an earlier job '
                             'still running?' % (requested, e.strerror or e))
        return s.getsockname()[1]


def pick_node_ports(count, taken):
    """`count` distinct free ports on this host, none in `taken`.

    Free here when picked; for ssh jobs they are assumed free on the other hosts too
    (a busy one makes that node exit naming the port).
    """
    ports = []
    while len(ports) < count:
        port = free_port_run(1, taken)
        if port not in ports:
            ports.append(port)
    return ports
