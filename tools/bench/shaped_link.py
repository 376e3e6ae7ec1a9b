#!/usr/bin/env python3
"""The quick-start job over shaped links: what compression buys on a real network.

Each node of a job (the scheduler, S servers, W workers) runs in its own network
namespace with its own `eth0`, one end of a veth pair whose other end is a port of
one bridge, subnet 10.79.0.0/24 (the multihost and netfault tests use 10.77 and
10.78):

    <tag>n0        10.79.0.1        tessera-scheduler
    <tag>n1..nS    10.79.0.11...    tessera-server
    <tag>n(S+1)..  10.79.0.101...   tessera-worker

Every node's link is shaped with `tbf` to --rates on BOTH ends of its veth: the
namespace end (`eth0`) limits what the node sends, the bridge end what it
receives, so each node has a full-duplex link of that rate, as a machine with its
own NIC on a switch has, rather than one loopback shared by every process and
direction. The shaping of a rate is

    tc qdisc replace dev IF root tbf rate RATE burst 131072 latency 50ms

  - burst 128 KiB (--burst), at every rate: the smallest bucket that passes two
    whole GSO packets of veth (64 KiB of payload plus the segments' headers;
    tbf splits any packet bigger than its bucket in software, which on these 2
    cores costs more than the shaping: a 64 KiB bucket made the job slower
    than 96 or 128 KiB). The bucket is what a link may send at once after it
    was idle, faster than its rate, and a real NIC has none, so it must stay
    small beside a step's messages: a step of the quick-start job sends each
    worker's 0.8 MB gradient of the first layer into the server and the new
    weights back, and the few ms of compute between steps refill a bucket of
    up to 625 kB at 1 Gbit/s. A real 1 Gbit/s network needs about 14 s for the
    job without compression (per step 12.8 ms for two workers' 0.8 MB into
    the server, 12.8 ms back, about 4 ms of compute); with a 1 MB bucket it
    took 8.6 s here and 2-bit pushes bought nothing; with a 2 ms bucket at 10
    Gbit/s (2.5 MB) no step ever waits for tokens, and the link is not shaped
    at all. docs/benchmarks.md has the figures.
  - latency 50ms (--latency): the queue tbf keeps before it drops (6.25 MB at 1
    Gbit/s). A sender's own queue stays short anyway (TCP small queues); the
    queue that grows is a receiver's bridge end, where the pushes of every
    worker meet at one server, as at a switch port. 50 ms holds a whole step of
    every worker: tbf dropped nothing in 50 ms runs, while with 5 ms it
    dropped packets at the server: the runs measure bandwidth, not TCP's loss
    recovery.

The job is tools/quickstart.sh's (build/worker/tessera-worker --kv-store
dist_sync --gc-threshold 1 --lr 0.3 --momentum 0 --lr-step-epochs 12) for
--epochs, with each mode's flags:

    none      --gc-type none
    push2bit  --gc-type 2bit
    both2bit  --gc-type 2bit --gc-pull 2bit

then the worker flags after `--` (a later flag wins). For every run (--runs),
every rate in turn and within it every mode in turn, one job; so the machine's
drifting load falls on all alike. The rate `loopback` (or `none`, or the flag
--loopback) runs the same job on this machine's plain loopback: no namespaces,
no shaping, no root needed.

Printed per rate: a Markdown table with one row per mode, the medians over the
runs of
  wall s      the slowest worker's `wall_seconds` (its --metrics-out): the
              training loop with the per-epoch evaluation, from the first step to
              the last; start-up (loading the data, joining) is not in it
  speed-up    the `none` row's median wall s over this row's
  job s       from starting the scheduler to the last process's exit
  samples/s   the workers' `samples_per_second`, summed
  MB pushed, MB pulled   per worker (payload bytes, 10^6), the workers' mean
  test acc    rank 0's test accuracy after the last epoch
then every run's figures. Before the first job, a link check sends bulk TCP from
worker 0 to server 0 for a second at each shaped rate and prints what arrived
(--no-link-check to skip it). `uptime` is recorded before and after.

Hosts and local groups (issue #47, docs/benchmarks.md "Local groups"): with
--hosts H the nodes are not one namespace each but H "hosts",

    <tag>n0        10.79.0.1        tessera-scheduler (alone)
    <tag>h0..h(H-1) 10.79.0.21...   worker j on host j * H // W, server i on
                                    host i * H // S (blocks: host 0 holds
                                    workers 0..W/H-1)

each with one link shaped as above, so the processes of a host share its
address, its loopback (a worker's bytes to its own host's server never reach
the link) and /dev/shm (every namespace shares this machine's), as the
processes of one machine do: TESSERA_LOCAL_GROUP=1 then groups each host's
workers. --local-group 0,1 runs every mode twice in turn, ungrouped then
grouped (TESSERA_LOCAL_GROUP of the workers; 0 or 1 alone runs only that),
the same run's baseline. Either flag (on loopback too) prints the hosts
report instead of the tables above: per mode and group, medians (min-max)
over the runs of
  step ms     the slowest worker's wall_seconds / its steps
  samples/s   as above
  link tx MB/step/host  bytes the host's eth0 sent (its tx_bytes, read
              inside the namespace before and after the job) / steps, the
              hosts' mean (every run lists each host's)
  pushed, pulled MB/step/host  the host's workers' bytes_pushed and
              bytes_pulled (their --metrics-out) / steps, the hosts' mean
              (on loopback the one machine's, with a namespace per node
              each worker's)
  x           the figure over the same mode's with the group off, same run
  server CPU ms/round   every server's utime + stime at its exit (its
              zombie's /proc/PID/stat) over the rounds of their exit lines
              ("rounds N"), start-up included
  CPU busy    every process's CPU seconds / job s: how many of the
              machine's cores the job kept busy
Workers get DMLC_TASK_ID in start order there (servers 0..S-1, workers
S..S+W-1), so worker j is rank j and its host is known.

    sudo tools/bench/shaped_link.py [--rates 1gbit,10gbit] [--modes none,push2bit]
        [--runs 3] [--epochs 2] [--workers 2] [--servers 1] [--build build]
        [--json FILE] [--loopback] [--burst 128k] [--latency 50ms] [--tag NAME]
        [--timeout 900] [--no-link-check] [--hosts H] [--local-group 0,1]
        [-- worker flags]

Exit status: 0 every job finished; 1 a job failed (its processes' last lines are
printed and the log folder is kept); 2 a usage error; 3 shaped links cannot be
built here (not root, no `ip netns`, `tc` or `tbf`; one line says why: a test
using this tool skips on it); 4 tessera-worker does not take a mode's flags (e.g.
`--gc-pull` on a build without compressed pulls; the line names the flag).

Clean-up is certain: every process is started by this tool and ended by pid; the
namespaces, the bridge and veths, the processes and the temporary folder are
listed in a state file as they are made and removed on exit, on failure, on
SIGINT/SIGTERM/SIGHUP, and, should this process be SIGKILLed, by a guard process
(detached, its own session) that waits for this one's pipe to close. Every
process of a job carries TESSERA_SHAPED_LINK_TAG=<tag> in its environment, so a
test can tell that none is left.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.normpath(os.path.join(HERE, '..', '..'))
sys.path.insert(0, os.path.join(SOURCE_DIR, 'tools'))
sys.path.insert(0, os.path.join(SOURCE_DIR, 'tests', 'support'))
import netns  # noqa: E402  (namespaces on a bridge, processes, clean-up with a guard)
from netns import Proc, run, tail_of  # noqa: E402
from tessera_launch import keys as job_keys  # noqa: E402  (the job keys)
from tessera_launch.hosts import free_port_run  # noqa: E402
PROG = 'shaped_link'

EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_SHAPING = 3
EXIT_UNSUPPORTED_FLAG = 4

SUBNET_PREFIX = '10.79.0.'
ROOT_PORT = 9179
BURST_BYTES = 128 * 1024
LATENCY = '50ms'
# After one process fails, how long the others get to notice and exit.
FAILURE_GRACE_S = 15

QUICKSTART_FLAGS = ['--kv-store', 'dist_sync', '--gc-threshold', '1', '--lr', '0.3',
                    '--momentum', '0', '--lr-step-epochs', '12']
MODES = {
    'none': ['--gc-type', 'none'],
    'push2bit': ['--gc-type', '2bit'],
    'both2bit': ['--gc-type', '2bit', '--gc-pull', '2bit'],
}
LOOPBACK = 'loopback'


def say(text):
    sys.stderr.write('%s: %s\n' % (PROG, text))
    sys.stderr.flush()


def uptime():
    try:
        return subprocess.run(['uptime'], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=10).stdout.decode().strip()
    except (OSError, subprocess.SubprocessError):
        try:
            with open('/proc/loadavg') as f:
                return 'load average: ' + ' '.join(f.read().split()[:3])
        except OSError:
            return '(unknown)'


def parse_rate(text):
    """Bits per second of a tc rate such as 1gbit, 2.5gbit, 100mbit; None if not one."""
    m = re.fullmatch(r'(\d+(?:\.\d+)?)([kmgt]?)bit', text.strip().lower())
    if not m:
        return None
    return float(m.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9, 't': 1e12}[m.group(2)]


def tbf_args(rate, burst=BURST_BYTES, latency=LATENCY):
    """The tbf arguments for a rate (see the module's docstring for why)."""
    return ['tbf', 'rate', rate, 'burst', str(burst), 'latency', latency]


def start_resources(tag):
    """The run's netns.Resources (temporary folder, state file, guard), torn down
    at exit and on SIGINT, SIGTERM and SIGHUP."""
    res = netns.Resources(PROG, 'shaped', tag)
    netns.teardown_on_exit(res)
    return res


class Topology(object):
    """The bridge and one namespace per node, each node's veth shaped on both ends."""

    def __init__(self, res, servers, workers, burst, latency):
        self.res = res
        self.burst, self.latency = burst, latency
        self.bridge = res.tag + 'br'
        # (role, address) per node; node i lives in namespace tag + 'n' + i.
        self.nodes = ([('scheduler', SUBNET_PREFIX + '1')] +
                      [('server', SUBNET_PREFIX + str(11 + i)) for i in range(servers)] +
                      [('worker', SUBNET_PREFIX + str(101 + i)) for i in range(workers)])
        self.namespaces = ['%sn%d' % (res.tag, i) for i in range(len(self.nodes))]
        self.bridge_ends = ['%sv%d' % (res.tag, i) for i in range(len(self.nodes))]
        self.rate = None

    def setup(self):
        netns.make_bridge(self.res, self.bridge)
        for i, ns in enumerate(self.namespaces):
            netns.make_namespace(self.res, ns)
            netns.connect_to_bridge(self.res, ns, self.bridge, self.bridge_ends[i],
                                    '%sp%d' % (self.res.tag, i), [self.nodes[i][1] + '/24'])

    def shape(self, rate):
        """Every node's link to `rate`, both ways (replaces the previous shaping)."""
        if rate == self.rate:
            return
        args = tbf_args(rate, self.burst, self.latency)
        for ns, host_end in zip(self.namespaces, self.bridge_ends):
            run(['tc', 'qdisc', 'replace', 'dev', 'eth0', 'root'] + args, ns=ns)
            run(['tc', 'qdisc', 'replace', 'dev', host_end, 'root'] + args)
        self.rate = rate

    def first(self, role):
        return next(i for i, (r, _) in enumerate(self.nodes) if r == role)

    def placement(self, servers, workers):
        """(namespace, address) of the scheduler, each server, each worker."""
        return [(ns, address) for ns, (_, address) in zip(self.namespaces, self.nodes)]

    def root_uri(self):
        return self.nodes[0][1]

    def check_pair(self):
        """(namespace, namespace, address) of the link check: worker 0 to server 0."""
        w, s = self.first('worker'), self.first('server')
        return self.namespaces[w], self.namespaces[s], self.nodes[s][1]

    def processes(self):
        """(namespace, pid, program) of every process in the namespaces."""
        return netns.namespace_processes(self.namespaces)


class HostTopology(Topology):
    """--hosts H: the scheduler in its own namespace, and H namespaces ("hosts"),
    each with one shaped link, holding the workers and servers placed there in
    blocks (worker j on host j * H // W, server i on host i * H // S): the
    processes of one host share its address and its loopback, as on a machine
    with one NIC, and /dev/shm (every namespace does), so TESSERA_LOCAL_GROUP=1
    groups the workers of each host."""

    def __init__(self, res, servers, workers, hosts, burst, latency):
        self.res = res
        self.burst, self.latency = burst, latency
        self.bridge = res.tag + 'br'
        self.hosts = hosts
        self.server_host = [i * hosts // servers for i in range(servers)]
        self.worker_host = [j * hosts // workers for j in range(workers)]
        # Namespace 0 the scheduler's, namespace 1 + h host h's.
        self.nodes = ([('scheduler', SUBNET_PREFIX + '1')] +
                      [('host', SUBNET_PREFIX + str(21 + h)) for h in range(hosts)])
        self.namespaces = (['%sn0' % res.tag] +
                           ['%sh%d' % (res.tag, h) for h in range(hosts)])
        self.bridge_ends = ['%sv%d' % (res.tag, i) for i in range(len(self.nodes))]
        self.rate = None

    def host_ns(self, h):
        return self.namespaces[1 + h]

    def host_address(self, h):
        return self.nodes[1 + h][1]

    def placement(self, servers, workers):
        return ([(self.namespaces[0], self.nodes[0][1])] +
                [(self.host_ns(h), self.host_address(h)) for h in self.server_host] +
                [(self.host_ns(h), self.host_address(h)) for h in self.worker_host])

    def check_pair(self):
        """Worker 0's host to the first server on another host (or, with one
        host, to the scheduler's namespace)."""
        src = self.worker_host[0]
        dst = next((h for h in self.server_host if h != src), None)
        if dst is None:
            return self.host_ns(src), self.namespaces[0], self.nodes[0][1]
        return self.host_ns(src), self.host_ns(dst), self.host_address(dst)

    def link_counters(self):
        """Per host, (tx_bytes, rx_bytes) of its eth0, read inside its namespace."""
        out = []
        for h in range(self.hosts):
            got = run(['cat', '/sys/class/net/eth0/statistics/tx_bytes',
                       '/sys/class/net/eth0/statistics/rx_bytes'], ns=self.host_ns(h))
            tx, rx = [int(v) for v in got.out.split()]
            out.append((tx, rx))
        return out


def missing_prerequisite(tag):
    """Why shaped links cannot be built here, or None."""
    if not hasattr(os, 'geteuid') or os.geteuid() != 0:
        return 'needs root (network namespaces, a bridge, tc qdiscs)'
    for tool in ('ip', 'tc'):
        if not shutil.which(tool):
            return '`%s` not found (Debian: apt-get install iproute2)' % tool
    return netns.namespaces_problem(tag, _veth_and_tbf_problem)


def _veth_and_tbf_problem(probe):
    veth = run(['ip', 'link', 'add', 'pa', 'type', 'veth', 'peer', 'name', 'pb'], ns=probe,
               check=False)
    if veth.returncode != 0:
        return 'cannot create a veth pair here: %s' % veth.out.strip()
    tbf = run(['tc', 'qdisc', 'add', 'dev', 'pa', 'root'] + tbf_args('1gbit'), ns=probe,
              check=False)
    if tbf.returncode != 0:
        return 'no tbf qdisc here (`tc qdisc add ... tbf`): %s' % tbf.out.strip()
    return None


# ----------------------------------------------------------------------------
# Processes and jobs


def job_env(tag, role, root_uri, root_port, node_host, servers, workers):
    env = dict((k, v) for k, v in os.environ.items() if not k.startswith('DMLC_'))
    env.update({'DMLC_ROLE': role, 'DMLC_PS_ROOT_URI': root_uri,
                'DMLC_PS_ROOT_PORT': str(root_port), 'DMLC_NODE_HOST': node_host,
                'DMLC_NUM_SERVER': str(servers), 'DMLC_NUM_WORKER': str(workers),
                'TESSERA_SHAPED_LINK_TAG': tag, 'LANG': 'C.UTF-8'})
    return env


def cpu_seconds(pid):
    """utime + stime of a process (all its threads) from /proc/PID/stat, or None."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            fields = f.read().rsplit(')', 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / float(os.sysconf('SC_CLK_TCK'))
    except (OSError, ValueError, IndexError):
        return None


class CpuProc(Proc):
    """A Proc that notes its CPU time (cpu_s) when it exits by itself: poll()
    looks for the exit without reaping (waitid WNOWAIT), reads the zombie's
    /proc/PID/stat, then reaps. `ip netns exec` execs, so the pid is the
    program's own."""

    cpu_s = None

    def poll(self):
        if self.proc.returncode is None:
            try:
                exited = os.waitid(os.P_PID, self.pid,
                                   os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                exited = True  # not ours to wait for: Popen says what it knows
            if exited is None:
                return None  # running; reaping now could lose an exit that just came
            if exited is not True and self.cpu_s is None:
                self.cpu_s = cpu_seconds(self.pid)
        return Proc.poll(self)


def free_port():
    """A free port below the ephemeral range (tessera_launch.hosts.free_port_run)."""
    return free_port_run(1)


class Job(object):
    """One job: scheduler, servers and workers, in their namespaces (topo) or on
    this machine's loopback (topo None)."""

    def __init__(self, res, topo, binaries, worker_argv, servers, workers, name, port,
                 worker_env=None, task_ids=False):
        self.procs = []
        self.metrics = os.path.join(res.tmp, '%s-metrics-{rank}.json' % name)
        worker_argv = list(worker_argv) + ['--metrics-out', self.metrics]
        roles = (['scheduler'] + ['server'] * servers + ['worker'] * workers)
        if topo is not None:
            root_uri = topo.root_uri()
            hosts = topo.placement(servers, workers)
        else:
            root_uri = '127.0.0.1'
            hosts = [(None, '127.0.0.1')] * len(roles)
        # Secured as launch.py runs jobs: fresh keys per job, one 0600 file per role.
        keys = None
        if os.environ.get('TESSERA_INSECURE') != '1':
            keys = os.path.join(res.tmp, name + '-keys')
            os.mkdir(keys, 0o700)
            job_keys.write_job_keys(keys)
        self.started = time.monotonic()
        counts = {}
        for role, (ns, address) in zip(roles, hosts):
            argv = {'scheduler': [binaries['scheduler']], 'server': [binaries['server']],
                    'worker': worker_argv}[role]
            label = '%s %d' % (role, counts.get(role, 0))
            counts[role] = counts.get(role, 0) + 1
            log = os.path.join(res.tmp, '%s-%s.log' % (name, label.replace(' ', '')))
            env = job_env(res.tag, role, root_uri, port, address, servers, workers)
            if keys is not None:
                env['TESSERA_KEY_DIR'] = keys
            if role == 'worker' and worker_env:
                env.update(worker_env)
            if task_ids and role != 'scheduler':
                # Ranked in start order (servers 0.., workers S..): worker j is rank j.
                env['DMLC_TASK_ID'] = str(len(self.procs) - 1)
            self.procs.append(CpuProc(res, ns, label, argv, env, log))
        self.elapsed = None
        self.why = None

    def wait(self, timeout):
        """Waits for every process to exit; returns True when all exited 0. After
        the first failure the others get FAILURE_GRACE_S; at `timeout` whatever
        runs is killed by pid."""
        self.why, ended = netns.wait_all(
            self.procs, self.started + timeout, FAILURE_GRACE_S,
            'still running %d s after it started (--timeout)' % timeout)
        self.elapsed = ended - self.started
        codes = [p.proc.returncode for p in self.procs]
        if self.why is None and any(codes):
            self.why = 'not every process exited 0: %s' % ', '.join(
                '%s %s' % (p.label, p.proc.returncode) for p in self.procs)
        return self.why is None

    def end(self):
        for p in self.procs:
            p.end()

    def report(self):
        return '\n'.join('--- %s%s (pid %d, exit %s), last lines of %s:\n%s'
                         % (p.label, ' in ' + p.ns if p.ns else '', p.pid,
                            p.proc.returncode, p.log, tail_of(p.log, 20)) for p in self.procs)

    def server_figures(self):
        """Per server: (rounds from its exit line or None, CPU seconds or None)."""
        out = []
        for p in self.procs:
            if p.label.startswith('server '):
                m = re.search(r'pushes applied \d+ \(.*?\), rounds (\d+)', p.output())
                out.append((int(m.group(1)) if m else None, p.cpu_s))
        return out

    def cpu_by_role(self):
        """CPU seconds of every process, summed per role (None if one is unknown)."""
        out = {}
        for p in self.procs:
            role = p.label.split()[0]
            if role in out and out[role] is None:
                continue
            out[role] = None if p.cpu_s is None else out.get(role, 0.0) + p.cpu_s
        return out

    def worker_metrics(self, workers):
        out = []
        for rank in range(workers):
            with open(self.metrics.replace('{rank}', str(rank))) as f:
                out.append(json.load(f))
        return out


def summarize_run(metrics, job_seconds):
    """One job's figures from its workers' --metrics-out JSON."""
    rank0 = next(m for m in metrics if m.get('rank') == 0)
    n = len(metrics)
    return {
        'wall_s': max(m['wall_seconds'] for m in metrics),
        'job_s': job_seconds,
        'samples_per_second': sum(m['samples_per_second'] for m in metrics),
        'bytes_pushed_per_worker': sum(m['bytes_pushed'] for m in metrics) / n,
        'bytes_pulled_per_worker': sum(m['bytes_pulled'] for m in metrics) / n,
        'test_accuracy': rank0['test_accuracy'],
    }


# ----------------------------------------------------------------------------
# The link check: bulk TCP from one namespace to another

SINK = r'''
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print('ready', flush=True)
s.settimeout(20)
c, _ = s.accept()
c.settimeout(20)
got, t0, buf = 0, None, bytearray(1 << 20)
while True:
    n = c.recv_into(buf)
    if not n:
        break
    if t0 is None:
        t0 = time.monotonic()
    got += n
dt = time.monotonic() - t0
print('received %d bytes in %.3f s' % (got, dt), flush=True)
'''

SOURCE = r'''
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
data = b'x' * (1 << 20)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.sendall(data)
c.close()
'''


def link_check(res, topo, seconds=1.0):
    """Mbit/s of bulk TCP from worker 0 to server 0 (None and a reason on failure)."""
    src_ns, dst_ns, dst_address = topo.check_pair()
    log = os.path.join(res.tmp, 'link-check-sink.log')
    sink = Proc(res, dst_ns, 'link sink', [sys.executable, '-c', SINK, dst_address, '7079'],
                {'PATH': os.environ.get('PATH', ''), 'TESSERA_SHAPED_LINK_TAG': res.tag}, log)
    try:
        deadline = time.monotonic() + 10
        while 'ready' not in sink.output():
            if sink.poll() is not None or time.monotonic() > deadline:
                return None, 'the sink did not start: %s' % tail_of(log, 5)
            time.sleep(0.05)
        run([sys.executable, '-c', SOURCE, dst_address, '7079', str(seconds)],
            ns=src_ns, timeout=30)
        sink.proc.wait(20)
        m = re.search(r'received (\d+) bytes in ([\d.]+) s', sink.output())
        if not m or float(m.group(2)) <= 0:
            return None, 'the sink said: %s' % tail_of(log, 5)
        return int(m.group(1)) * 8 / float(m.group(2)) / 1e6, None
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return None, str(e)
    finally:
        sink.end(signal.SIGKILL)


# ----------------------------------------------------------------------------
# Reporting


def write_json(path, record):
    with open(path, 'w') as f:
        json.dump(record, f, indent=1)
        f.write('\n')


def fmt_mb(b):
    return '%.1f' % (b / 1e6)


def summary_table(rows, modes):
    """Per mode: medians over the runs, and the speed-up against `none`."""
    summary = {}
    for mode in modes:
        runs = rows.get(mode, [])
        if not runs:
            continue
        med = dict((k, statistics.median(r[k] for r in runs)) for k in runs[0])
        med['runs'] = len(runs)
        summary[mode] = med
    base = summary.get('none')
    for mode, med in summary.items():
        med['speedup'] = base['wall_s'] / med['wall_s'] if base and med['wall_s'] > 0 else None
        med['job_speedup'] = (base['job_s'] / med['job_s']
                              if base and med['job_s'] > 0 else None)
    return summary


def print_rate(rate, tbf, summary, rows, modes, link):
    if rate == LOOPBACK:
        print('\n### plain loopback (no namespaces, no shaping)\n')
    else:
        print('\n### %s per node, full duplex (tc %s on both ends of every veth)\n'
              % (rate, ' '.join(tbf)))
        if link is not None:
            print('link check: bulk TCP worker 0 -> server 0: %s\n' % link)
    print('medians of %d run(s); speed-up = none\'s wall s / this wall s\n'
          % max([s['runs'] for s in summary.values()] or [0]))
    print('| mode | wall s | speed-up | job s | samples/s | MB pushed/worker '
          '| MB pulled/worker | test acc |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- |')
    for mode in modes:
        s = summary.get(mode)
        if s is None:
            continue
        print('| %s | %.2f | %s | %.2f | %.0f | %s | %s | %.4f |' % (
            mode, s['wall_s'], '%.2fx' % s['speedup'] if s['speedup'] else '-', s['job_s'],
            s['samples_per_second'], fmt_mb(s['bytes_pushed_per_worker']),
            fmt_mb(s['bytes_pulled_per_worker']), s['test_accuracy']))
    print('\nevery run (wall s / job s, samples/s, MB pushed / pulled per worker, test acc):\n')
    for mode in modes:
        for i, r in enumerate(rows.get(mode, [])):
            print('- %s run %d: %.2f / %.2f s, %.0f samples/s, %s / %s MB, %.4f' % (
                mode, i + 1, r['wall_s'], r['job_s'], r['samples_per_second'],
                fmt_mb(r['bytes_pushed_per_worker']), fmt_mb(r['bytes_pulled_per_worker']),
                r['test_accuracy']))
    sys.stdout.flush()


# ----------------------------------------------------------------------------
# The hosts report (--hosts, --local-group)


def group_label(g):
    return {None: '-', '0': 'off', '1': 'on'}[g]


def summarize_hosts_run(metrics, job, worker_host, links_before, links_after):
    """One job's figures for the hosts report. worker_host[r]: the host of the
    worker of rank r; links_*: per host (tx, rx) bytes of its link, or None."""
    fig = summarize_run(metrics, job.elapsed)
    steps = max(m['steps'] for m in metrics)
    hosts = max(worker_host) + 1
    pushed, pulled = [0.0] * hosts, [0.0] * hosts
    for m in metrics:
        pushed[worker_host[m['rank']]] += m['bytes_pushed'] / float(steps)
        pulled[worker_host[m['rank']]] += m['bytes_pulled'] / float(steps)
    per_host = [{'pushed_per_step': pushed[h], 'pulled_per_step': pulled[h]}
                for h in range(hosts)]
    tx = None
    if links_before is not None and links_after is not None:
        for h, ((tx0, rx0), (tx1, rx1)) in enumerate(zip(links_before, links_after)):
            per_host[h]['link_tx_per_step'] = (tx1 - tx0) / float(steps)
            per_host[h]['link_rx_per_step'] = (rx1 - rx0) / float(steps)
        tx = [p['link_tx_per_step'] for p in per_host]
    servers = job.server_figures()
    counted = [(r, c) for r, c in servers if r is not None and c is not None]
    rounds = sum(r for r, _ in counted)
    cpu = job.cpu_by_role()
    known = [c for c in cpu.values() if c is not None]
    fig.update({
        'steps': steps,
        'step_ms': fig['wall_s'] / steps * 1e3,
        'host_pushed_per_step': statistics.mean(pushed),
        'host_pulled_per_step': statistics.mean(pulled),
        'host_tx_per_step': statistics.mean(tx) if tx else None,
        'host_tx_max_per_step': max(tx) if tx else None,
        'per_host': per_host,
        'server_rounds': [r for r, _ in servers],
        'server_cpu_s': [c for _, c in servers],
        # Every server's CPU over every server's rounds (one server: its CPU / its rounds).
        'server_cpu_ms_per_round': (sum(c for _, c in counted) / rounds * 1e3
                                    if len(counted) == len(servers) and rounds else None),
        'cpu_s_by_role': cpu,
        'cpu_cores_busy': (sum(known) / job.elapsed
                           if len(known) == len(cpu) and job.elapsed else None),
    })
    return fig


def median_of(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def spread_of(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return (min(values), max(values)) if values else None


HOSTS_KEYS = ('wall_s', 'job_s', 'steps', 'step_ms', 'samples_per_second',
              'bytes_pushed_per_worker', 'bytes_pulled_per_worker', 'test_accuracy',
              'host_pushed_per_step', 'host_pulled_per_step', 'host_tx_per_step',
              'host_tx_max_per_step', 'server_cpu_ms_per_round', 'cpu_cores_busy')


def hosts_summary(rows, variants):
    """Per (mode, group): medians and spreads over the runs, and the ratios to
    the same mode ungrouped (group '0') of the same run."""
    summary = {}
    for v in variants:
        runs = rows.get(v, [])
        if not runs:
            continue
        med = dict((k, median_of(runs, k)) for k in HOSTS_KEYS)
        med['spread'] = dict((k, spread_of(runs, k)) for k in
                             ('step_ms', 'host_tx_per_step', 'server_cpu_ms_per_round'))
        med['server_rounds'] = median_of([{'r': r['server_rounds'][0]} for r in runs], 'r')
        med['runs'] = len(runs)
        summary[v] = med
    for (mode, g), med in summary.items():
        base = summary.get((mode, '0'))

        def ratio(key, inverse=False):
            a, b = med.get(key), base.get(key) if base else None
            if not a or not b:
                return None
            return b / a if inverse else a / b
        med['speedup'] = ratio('step_ms', inverse=True)
        med['tx_ratio'] = ratio('host_tx_per_step')
        med['push_ratio'] = ratio('host_pushed_per_step')
        med['pull_ratio'] = ratio('host_pulled_per_step')
        med['server_cpu_ratio'] = ratio('server_cpu_ms_per_round')
    return summary


def _f(value, fmt, none='-'):
    return none if value is None else fmt % value


def _mb(value):
    return _f(value, '%.2f') if value is None else '%.2f' % (value / 1e6)


def _range(spread, scale=1.0, fmt='%.1f'):
    if spread is None:
        return ''
    return ' (%s-%s)' % (fmt % (spread[0] * scale), fmt % (spread[1] * scale))


def print_hosts_rate(rate, tbf, summary, rows, variants, link, where):
    if rate == LOOPBACK:
        print('\n### plain loopback (no namespaces, no shaping), %s\n' % where)
    else:
        print('\n### %s per host link, full duplex (tc %s on both ends of every veth), '
              '%s\n' % (rate, ' '.join(tbf), where))
        if link is not None:
            print('link check: bulk TCP from worker 0\'s host to a server\'s host: %s\n'
                  % link)
    print('medians of %d run(s) (min-max); step ms = the slowest worker\'s wall s / steps; '
          'x = this / the same mode with group off, same run; per host and step: link tx '
          'from its eth0\'s tx_bytes, pushed and pulled from its workers\' metrics; '
          'CPU busy = every process\'s CPU s / job s\n'
          % max([s['runs'] for s in summary.values()] or [0]))
    print('| mode | group | step ms | speed-up | samples/s | link tx MB/step/host | x '
          '| pushed MB/step/host | x | pulled MB/step/host | x | server CPU ms/round '
          '| x | rounds | CPU busy | test acc |')
    print('|' + ' --- |' * 16)
    for v in variants:
        s = summary.get(v)
        if s is None:
            continue
        sp = s['spread']
        print('| %s | %s | %.1f%s | %s | %.0f | %s%s | %s | %s | %s | %s | %s | %s%s | %s '
              '| %s | %s | %s |' % (
                  v[0], group_label(v[1]), s['step_ms'], _range(sp['step_ms']),
                  _f(s['speedup'], '%.2fx'), s['samples_per_second'],
                  _mb(s['host_tx_per_step']), _range(sp['host_tx_per_step'], 1e-6, '%.2f'),
                  _f(s['tx_ratio'], '%.2f'), _mb(s['host_pushed_per_step']),
                  _f(s['push_ratio'], '%.2f'), _mb(s['host_pulled_per_step']),
                  _f(s['pull_ratio'], '%.2f'),
                  _f(s['server_cpu_ms_per_round'], '%.2f'),
                  _range(sp['server_cpu_ms_per_round'], 1.0, '%.2f'),
                  _f(s['server_cpu_ratio'], '%.2f'), _f(s['server_rounds'], '%d'),
                  _f(s['cpu_cores_busy'], '%.2f'), _f(s['test_accuracy'], '%.4f')))
    print('\nevery run (step ms, samples/s, link tx MB/step per host, pushed / pulled '
          'MB/step per host, server CPU ms/round, CPU busy, uptime before):\n')
    for v in variants:
        for i, r in enumerate(rows.get(v, [])):
            print('- %s, group %s, run %d: %.1f ms, %.0f samples/s, tx %s, %s / %s MB, '
                  '%s ms/round, %s busy, %s' % (
                      v[0], group_label(v[1]), i + 1, r['step_ms'], r['samples_per_second'],
                      '/'.join(_mb(h.get('link_tx_per_step')) for h in r['per_host'])
                      if r['host_tx_per_step'] is not None else '-',
                      '/'.join(_mb(h['pushed_per_step']) for h in r['per_host']),
                      '/'.join(_mb(h['pulled_per_step']) for h in r['per_host']),
                      _f(r['server_cpu_ms_per_round'], '%.2f'),
                      _f(r['cpu_cores_busy'], '%.2f'), r['uptime_before']))
    sys.stdout.flush()


def run_hosts_report(args, res, binaries, common, shaped, record):
    """--hosts / --local-group: every mode once per group setting in turn (the
    same run's baseline), figures per host."""
    groups = args.local_group or [None]
    variants = [(mode, g) for mode in args.modes for g in groups]
    record.update({'hosts': args.hosts, 'local_group': args.local_group,
                   'variants': [list(v) for v in variants]})
    topo = None
    if shaped:
        if args.hosts:
            topo = HostTopology(res, args.servers, args.workers, args.hosts, args.burst,
                                args.latency)
            record['placement'] = {'server_host': topo.server_host,
                                   'worker_host': topo.worker_host}
        else:
            topo = Topology(res, args.servers, args.workers, args.burst, args.latency)
        topo.setup()
        for rate in shaped:
            if args.no_link_check:
                continue
            topo.shape(rate)
            mbit, why = link_check(res, topo)
            record['link_check_mbit_s'][rate] = mbit
            say('link check at %s: %s' % (rate, '%.0f Mbit/s' % mbit if mbit else why))
    rows = dict((r, {}) for r in args.rates)
    total = args.runs * len(args.rates) * len(variants)
    n = 0
    for run_index in range(args.runs):
        for rate in args.rates:
            for mode, g in variants:
                n += 1
                name = 'r%d-%s-%s-g%s' % (run_index + 1, rate, mode, group_label(g))
                hosts_topo = None
                if rate == LOOPBACK:
                    job_topo, port = None, free_port()
                    worker_host = [0] * args.workers
                else:
                    topo.shape(rate)
                    job_topo, port = topo, ROOT_PORT + n % 500
                    if args.hosts:
                        hosts_topo = topo
                        worker_host = topo.worker_host
                    else:
                        worker_host = list(range(args.workers))
                argv_w = [binaries['worker']] + common + MODES[mode] + args.extra
                label = 'job %d/%d: run %d, %s, %s, group %s' % (
                    n, total, run_index + 1, rate, mode, group_label(g))
                say(label + ': started')
                load = uptime()
                before = hosts_topo.link_counters() if hosts_topo else None
                job = Job(res, job_topo, binaries, argv_w, args.servers, args.workers,
                          name, port, worker_env={'TESSERA_LOCAL_GROUP': g} if g else None,
                          task_ids=True)
                ok = job.wait(args.timeout)
                after = hosts_topo.link_counters() if hosts_topo else None
                if ok:
                    try:
                        metrics = job.worker_metrics(args.workers)
                    except (OSError, ValueError) as e:
                        ok, job.why = False, 'no --metrics-out JSON: %s' % e
                if job_topo is not None:
                    left = job_topo.processes()
                    if left:
                        ok = False
                        job.why = (job.why or '') + '; left behind: %s' % left
                if not ok:
                    res.keep_logs()
                    say('job %s failed: %s\n%s' % (name, job.why, job.report()))
                    return EXIT_JOB_FAILED
                fig = summarize_hosts_run(metrics, job, worker_host, before, after)
                fig['uptime_before'] = load
                rows[rate].setdefault((mode, g), []).append(fig)
                record['runs'].append(dict(fig, run=run_index + 1, rate=rate, mode=mode,
                                           local_group=g, worker_metrics=metrics))
                say('%s: step %.1f ms, link tx %s MB/step/host, pushed %s / pulled %s '
                    'MB/step/host, server CPU %s ms/round, test acc %.4f' % (
                        label, fig['step_ms'], _mb(fig['host_tx_per_step']),
                        _mb(fig['host_pushed_per_step']), _mb(fig['host_pulled_per_step']),
                        _f(fig['server_cpu_ms_per_round'], '%.2f'), fig['test_accuracy']))
    record['uptime_after'] = uptime()
    if args.hosts:
        where = ('%d hosts, %d worker(s) and %d server(s) in all (workers per host %s, '
                 'servers per host %s), the scheduler in its own namespace' % (
                     args.hosts, args.workers, args.servers,
                     '/'.join(str(topo.worker_host.count(h)) if topo else '-'
                              for h in range(args.hosts)),
                     '/'.join(str(topo.server_host.count(h)) if topo else '-'
                              for h in range(args.hosts))))
    else:
        where = '%d worker(s), %d server(s)' % (args.workers, args.servers)
    print('## shaped_link hosts report: %d epoch(s), %d run(s) per mode and group, '
          'alternating\n' % (args.epochs, args.runs))
    print('command: %s  ' % record['command'])
    print('uptime before: %s  ' % record['uptime_before'])
    print('uptime after: %s' % record['uptime_after'])
    for rate in args.rates:
        summary = hosts_summary(rows[rate], variants)
        record['summary'][rate] = dict(('%s/%s' % (m, group_label(g)), v)
                                       for (m, g), v in summary.items())
        mbit = record['link_check_mbit_s'].get(rate)
        print_hosts_rate(rate, record['tbf'].get(rate), summary, rows[rate], variants,
                         '%.0f Mbit/s' % mbit if mbit else None,
                         where if rate != LOOPBACK else
                         '%d worker(s), %d server(s)' % (args.workers, args.servers))
    if args.json:
        write_json(args.json, record)
    return 0


# ----------------------------------------------------------------------------


def parse_args(argv):
    if '--' in argv:
        cut = argv.index('--')
        argv, extra = argv[:cut], argv[cut + 1:]
    else:
        extra = []
    p = argparse.ArgumentParser(
        prog='shaped_link.py', description=__doc__.split('\n')[0],
        epilog='Worker flags after `--` are appended to every job\'s tessera-worker '
        'command line. See the source\'s docstring for the topology and the figures.')
    p.add_argument('--rates', default='1gbit,10gbit',
                   help='comma-separated tc rates per node (e.g. 1gbit,10gbit), or '
                   '`loopback` (also `none`) for plain loopback (default 1gbit,10gbit)')
    p.add_argument('--rate', dest='rates', help='the same as --rates')
    p.add_argument('--loopback', action='store_true',
                   help='plain loopback only (the same as --rates loopback)')
    p.add_argument('--modes', default='none,push2bit',
                   help='comma-separated, of %s (default none,push2bit)' % ','.join(MODES))
    p.add_argument('--runs', type=int, default=3, help='runs of every mode at every rate (3)')
    p.add_argument('--epochs', type=int, default=2, help='epochs per job (2)')
    p.add_argument('--workers', type=int, default=2, help='workers (2)')
    p.add_argument('--servers', type=int, default=1, help='servers (1)')
    p.add_argument('--build', default=os.path.join(SOURCE_DIR, 'build'),
                   help='build folder with the daemons and tessera-worker (<checkout>/build)')
    p.add_argument('--json', help='write every figure to this file')
    p.add_argument('--timeout', type=int, default=900, help='seconds a job may take (900)')
    p.add_argument('--tag', default='sl%d' % (os.getpid() % 100000),
                   help='prefix of every namespace and link name (up to 8 letters and '
                   'digits; default sl<pid>)')
    p.add_argument('--burst', default=str(BURST_BYTES),
                   help='tbf bucket in bytes, or with k or m (KiB, MiB) (128k)')
    p.add_argument('--latency', default=LATENCY,
                   help='tbf queue as time at the rate, e.g. 50ms (50ms)')
    p.add_argument('--no-link-check', action='store_true',
                   help='skip the bulk TCP check of each shaped rate')
    p.add_argument('--hosts', type=int, default=0,
                   help='H shaped namespaces ("hosts"), the workers and servers placed '
                   'on them in blocks, the scheduler in its own (default 0: one '
                   'namespace per node); prints the hosts report')
    p.add_argument('--local-group', default=None,
                   help='TESSERA_LOCAL_GROUP of the workers: 0, 1, or 0,1 (every job '
                   'of a mode twice, ungrouped then grouped); prints the hosts report')
    args = p.parse_args(argv)
    args.extra = extra
    args.build = os.path.abspath(args.build)  # the processes run in a temporary folder
    if args.loopback:
        args.rates = LOOPBACK
    rates = []
    for r in args.rates.split(','):
        r = r.strip().lower()
        if r in ('none', LOOPBACK):
            r = LOOPBACK
        elif parse_rate(r) is None or parse_rate(r) <= 0:
            p.error('--rates: expected tc rates such as 1gbit or 100mbit, or loopback; '
                    'got %r' % r)
        if r not in rates:
            rates.append(r)
    args.rates = rates
    m = re.fullmatch(r'(\d+)([km]?)', args.burst.strip().lower())
    if not m or int(m.group(1)) == 0:
        p.error('--burst: expected bytes such as 131072, 128k or 1m, got %r' % args.burst)
    args.burst = int(m.group(1)) * {'': 1, 'k': 1024, 'm': 1024 * 1024}[m.group(2)]
    if not re.fullmatch(r'\d+(\.\d+)?(us|ms|s)', args.latency.strip()):
        p.error('--latency: expected a time such as 50ms, got %r' % args.latency)
    modes = [m.strip() for m in args.modes.split(',') if m.strip()]
    for m in modes:
        if m not in MODES:
            p.error('--modes: expected some of %s, got %r' % (','.join(MODES), m))
    if not modes:
        p.error('--modes: expected at least one mode')
    args.modes = list(dict.fromkeys(modes))
    if not re.fullmatch(r'[a-z][a-z0-9]{0,7}', args.tag):
        p.error('--tag: expected up to 8 lower-case letters and digits, starting with a '
                'letter, got %r' % args.tag)
    if args.runs < 1 or args.epochs < 1 or args.timeout < 1:
        p.error('--runs, --epochs and --timeout must be positive')
    if not 1 <= args.servers <= 89 or not 1 <= args.workers <= 150:
        p.error('--servers: 1 to 89, --workers: 1 to 150 (the subnet\'s addresses)')
    if args.hosts and not 1 <= args.hosts <= min(args.workers, 200):
        p.error('--hosts: 1 to --workers (and at most 200), got %d' % args.hosts)
    if args.local_group is not None:
        groups = [g.strip() for g in args.local_group.split(',') if g.strip()]
        if not groups or any(g not in ('0', '1') for g in groups):
            p.error('--local-group: expected 0, 1 or 0,1, got %r' % args.local_group)
        args.local_group = list(dict.fromkeys(groups))
    return args


def check_mode_flags(worker, modes, common, extra):
    """None, or (mode, why) for the first mode whose flags tessera-worker refuses.
    `--help` after the flags: the worker parses them all, then prints its usage."""
    env = dict((k, v) for k, v in os.environ.items() if not k.startswith('DMLC_'))
    for mode in modes:
        argv = [worker] + common + MODES[mode] + extra + ['--help']
        try:
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, env=env, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            return mode, 'cannot run %s: %s' % (worker, e)
        if done.returncode != 0:
            line = (done.stderr.decode('utf-8', 'replace').strip().splitlines() or
                    ['(no message)'])[-1]
            return mode, '`%s` exits %d: %s' % (' '.join(argv[1:-1]), done.returncode, line)
    return None


def main(argv):
    args = parse_args(argv)
    binaries = {'scheduler': os.path.join(args.build, 'scheduler', 'tessera-scheduler'),
                'server': os.path.join(args.build, 'server', 'tessera-server'),
                'worker': os.path.join(args.build, 'worker', 'tessera-worker')}
    for path in binaries.values():
        if not os.access(path, os.X_OK):
            say('%s not built (--build %s)' % (path, args.build))
            return EXIT_USAGE
    common = QUICKSTART_FLAGS + ['--epochs', str(args.epochs)]
    refused = check_mode_flags(binaries['worker'], args.modes, common, args.extra)
    if refused:
        mode, why = refused
        hint = (' (--gc-pull: compressed pulls are not in this build)'
                if '--gc-pull' in why else '')
        say('mode %s is not supported by %s%s: %s' % (mode, binaries['worker'], hint, why))
        return EXIT_UNSUPPORTED_FLAG
    shaped = [r for r in args.rates if r != LOOPBACK]
    os.environ['PATH'] = os.environ.get('PATH', '') + ':/usr/sbin:/sbin'
    if shaped:
        why = missing_prerequisite(args.tag)
        if why:
            say('cannot build shaped links: %s' % why)
            return EXIT_NO_SHAPING

    res = start_resources(args.tag)
    record = {
        'command': ' '.join(['tools/bench/shaped_link.py'] + argv),
        'started': time.strftime('%Y-%m-%d %H:%M:%S %z'),
        'uptime_before': uptime(),
        'rates': args.rates, 'modes': args.modes, 'runs_per_mode': args.runs,
        'epochs': args.epochs, 'workers': args.workers, 'servers': args.servers,
        'worker_flags': dict((m, common + MODES[m] + args.extra) for m in args.modes),
        'tbf': dict((r, tbf_args(r, args.burst, args.latency)) for r in shaped),
        'link_check_mbit_s': {}, 'runs': [], 'summary': {},
    }
    say('uptime: %s' % record['uptime_before'])
    if args.hosts or args.local_group is not None:
        try:
            return run_hosts_report(args, res, binaries, common, shaped, record)
        finally:
            res.teardown()
    try:
        topo = None
        if shaped:
            topo = Topology(res, args.servers, args.workers, args.burst, args.latency)
            topo.setup()
            for rate in shaped:
                if args.no_link_check:
                    continue
                topo.shape(rate)
                mbit, why = link_check(res, topo)
                record['link_check_mbit_s'][rate] = mbit
                say('link check at %s: %s' % (rate, '%.0f Mbit/s' % mbit if mbit else why))
        rows = dict((r, {}) for r in args.rates)
        total = args.runs * len(args.rates) * len(args.modes)
        n = 0
        for run_index in range(args.runs):
            for rate in args.rates:
                for mode in args.modes:
                    n += 1
                    name = 'r%d-%s-%s' % (run_index + 1, rate, mode)
                    if rate == LOOPBACK:
                        job_topo, port = None, free_port()
                    else:
                        topo.shape(rate)
                        job_topo, port = topo, ROOT_PORT + n % 500
                    argv_w = [binaries['worker']] + common + MODES[mode] + args.extra
                    say('job %d/%d: run %d, %s, %s: started' % (n, total, run_index + 1,
                                                               rate, mode))
                    load = uptime()
                    job = Job(res, job_topo, binaries, argv_w, args.servers, args.workers,
                              name, port)
                    ok = job.wait(args.timeout)
                    if ok:
                        try:
                            metrics = job.worker_metrics(args.workers)
                        except (OSError, ValueError) as e:
                            ok, job.why = False, 'no --metrics-out JSON: %s' % e
                    if job_topo is not None:
                        left = job_topo.processes()
                        if left:
                            ok = False
                            job.why = (job.why or '') + '; left behind: %s' % left
                    if not ok:
                        res.keep_logs()
                        say('job %s failed: %s\n%s' % (name, job.why, job.report()))
                        return EXIT_JOB_FAILED
                    fig = summarize_run(metrics, job.elapsed)
                    rows[rate].setdefault(mode, []).append(fig)
                    record['runs'].append(dict(fig, run=run_index + 1, rate=rate, mode=mode,
                                               uptime_before=load, worker_metrics=metrics))
                    say('job %d/%d: run %d, %s, %s: wall %.2f s, job %.2f s, %s MB pushed, '
                        '%s MB pulled per worker, test acc %.4f'
                        % (n, total, run_index + 1, rate, mode, fig['wall_s'], fig['job_s'],
                           fmt_mb(fig['bytes_pushed_per_worker']),
                           fmt_mb(fig['bytes_pulled_per_worker']), fig['test_accuracy']))
        record['uptime_after'] = uptime()
        print('## shaped_link: %d epoch(s), %d worker(s), %d server(s), %d run(s) per mode, '
              'alternating\n' % (args.epochs, args.workers, args.servers, args.runs))
        print('command: %s  ' % record['command'])
        print('uptime before: %s  ' % record['uptime_before'])
        print('uptime after: %s' % record['uptime_after'])
        for rate in args.rates:
            summary = summary_table(rows[rate], args.modes)
            record['summary'][rate] = summary
            mbit = record['link_check_mbit_s'].get(rate)
            print_rate(rate, record['tbf'].get(rate), summary, rows[rate], args.modes,
                       '%.0f Mbit/s' % mbit if mbit else None)
        if args.json:
            write_json(args.json, record)
        return 0
    finally:
        res.teardown()


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
