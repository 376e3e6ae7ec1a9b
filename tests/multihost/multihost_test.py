#!/usr/bin/env python3
"""Multi-machine jobs: tools/launch.py across hosts with separate network stacks.

Builds four "hosts" on this machine, each a network namespace with its own
`eth0` on one bridge (IPv4 10.77.0.x/24 and IPv6 fd77::x/64) plus a `dummy0`
whose address (10.99.N.1/24) no other host can reach:

    h0  10.77.0.1   fd77::1    the launching host: launch.py and the scheduler
    h1  10.77.0.11  fd77::11   } an sshd each (throw-away keys); servers and
    h2  10.77.0.12  fd77::12   } workers land here round-robin
    h3  10.77.0.13  fd77::13   }

`dummy0` is created before `eth0` moves in, so it is the first non-loopback
interface of every host: a node that took "the first interface" would
advertise an address nobody can reach, and its job would fail. (Kernels
without the dummy driver get a veth pair with both ends inside the host.)

Tests: the ssh launcher (with --sync-dst-dir) and the mpi launcher, 2 servers
and 2 workers over h1..h3, exit 0, each node advertising its own host's
address and running with the job's keys (launch.py's fresh CURVE keys, over
the ssh channel or in a folder it makes on each host, gone after the job); DMLC_INTERFACE=eth0 succeeds and DMLC_INTERFACE=dummy0 fails within
the start-up deadline (+5 s, see node.cc) naming the unreachable address; a
worker SIGKILLed on h3 stops the job everywhere with a non-zero exit; a
hostname DMLC_PS_ROOT_URI (/etc/netns/<ns>/hosts) with DMLC_NODE_HOST winning
over DMLC_INTERFACE; IPv6 hosts and root URI; and, with IPv4 between hosts
dropped, DMLC_INTERFACE with an IPv6 scheduler advertising IPv6. After every
test no process but the sshds may remain in any namespace. PS_VERBOSE=1 logs
("<role> advertises ADDR:PORT") show where each node ran. Also: a worker and a
server added over ssh (launch.py --add-workers/--add-servers --launcher ssh) to
a running elastic, replicated ssh job (MULTIHOST_DUMP=FILE writes that test's
whole output there).

The namespaces share the file system, so the build folder has the same path on
every host; --sync-dst-dir is exercised anyway (a worker wrapper script is
synced and run from the copy).

Needs root, `ip netns`, a bridge, sshd/ssh (Debian openssh-server and
openssh-client); rsync for the --sync-dst-dir test and mpirun (openmpi-bin) for
the mpi test. Without them the tests skip and say why. ctest label: multihost.

    TESSERA_BUILD_DIR=build TESSERA_SOURCE_DIR=. python3 tests/multihost/multihost_test.py -v

Clean-up is certain: whatever the test made (namespaces, bridge, veths, sshds,
/etc/netns/<ns>, job processes) is removed in tearDownModule, from an atexit
and signal handler, and, should this process be SIGKILLed (a ctest time-out),
by a guard process that waits for this one's pipe to close.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'support'))
import netns  # noqa: E402 (the hosts: namespaces on a bridge, processes, clean-up)
from netns import quiet, run  # noqa: E402

SOURCE_DIR = os.environ.get('TESSERA_SOURCE_DIR') or os.path.normpath(os.path.join(HERE, '..', '..'))
BUILD_DIR = os.environ.get('TESSERA_BUILD_DIR') or os.path.join(SOURCE_DIR, 'build')
LAUNCH_PY = os.path.join(SOURCE_DIR, 'tools', 'launch.py')
DAEMONS = [os.path.join(BUILD_DIR, 'scheduler', 'tessera-scheduler'),
           os.path.join(BUILD_DIR, 'server', 'tessera-server')]
DATA_DIR = os.environ.get('FASHION_MNIST_DIR') or '/usr/share/datasets/fashion-mnist'

TAG = 'tmh%d' % (os.getpid() % 100000)  # prefix of every name this run makes
NUM_HOSTS = 3  # remote hosts h1..h3; h0 launches
SUBNET4 = '10.77.0.0/24'

# Time bounds (seconds). Each job here takes a few seconds.
JOB_TIMEOUT_S = 120
START_TIMEOUT_S = 10  # TESSERA_START_TIMEOUT in the negative tests: room for ssh and
# the daemons to start on a loaded machine (at 3 s a CI run under load ended before any
# node had started and said which address it advertises)
# A node gives up start-up deadline + 5 s after it registered (common/node.cc).
NEGATIVE_BOUND_S = START_TIMEOUT_S + 5 + 20
KILL_BOUND_S = 20

TESSERA_BINARIES = frozenset(['tessera-scheduler', 'tessera-server', 'tessera-worker',
                              'kv_check_worker'])


def ns_name(i):
    return '%sh%d' % (TAG, i)


def v4(i):
    return '10.77.0.%d' % (1 if i == 0 else 10 + i)


def v6(i):
    return 'fd77::%d' % (1 if i == 0 else 10 + i)


def dummy_v4(i):
    return '10.99.%d.1' % i


# ----------------------------------------------------------------------------
# The hosts (tests/support/netns.py makes them and cleans up, guard included)


class Topology(netns.Resources):
    """The bridge, namespaces and sshds. One per run (set up once per module)."""

    def __init__(self):
        super(Topology, self).__init__('multihost_test', 'multihost', TAG)
        self.key = os.path.join(self.tmp, 'id_ed25519')
        self.bridge = TAG + 'br'
        self.namespaces = [ns_name(i) for i in range(NUM_HOSTS + 1)]
        self.root_name = '%s-root' % TAG  # resolves to h0's address on every host
        self.self_name = '%s-self' % TAG  # resolves to each host's own address

    def setup(self):
        netns.make_bridge(self, self.bridge)
        for i, ns in enumerate(self.namespaces):
            self._add_host(i, ns)
        self._start_sshds()

    def _add_host(self, i, ns):
        # /etc/netns/<ns>/hosts is bind-mounted over /etc/hosts by `ip netns exec`.
        if not os.path.isdir('/etc/netns'):
            os.makedirs('/etc/netns')
            self.remember('empty_dirs', '/etc/netns')
        etc = os.path.join('/etc/netns', ns)
        os.makedirs(etc, exist_ok=True)
        self.remember('dirs', etc)
        try:
            with open('/etc/hosts') as f:
                hosts = f.read()
        except OSError:
            hosts = '127.0.0.1 localhost\n::1 localhost\n'
        with open(os.path.join(etc, 'hosts'), 'w') as f:
            f.write(hosts.rstrip('\n') + '\n%s %s\n%s %s\n' % (v4(0), self.root_name, v4(i),
                                                              self.self_name))
        netns.make_namespace(self, ns)
        # dummy0 first: the lowest index after lo, so "the first interface" is wrong.
        if run(['ip', 'link', 'add', 'dummy0', 'type', 'dummy'], ns=ns, check=False).returncode:
            # No dummy driver in this kernel: a veth pair with both ends in this
            # namespace is just as unreachable from the other hosts.
            run(['ip', 'link', 'add', 'dummy0', 'type', 'veth', 'peer', 'name', 'dummy0p'],
                ns=ns)
            run(['ip', 'link', 'set', 'dummy0p', 'up'], ns=ns)
        run(['ip', 'addr', 'add', dummy_v4(i) + '/24', 'dev', 'dummy0'], ns=ns)
        run(['ip', 'link', 'set', 'dummy0', 'up'], ns=ns)
        netns.connect_to_bridge(self, ns, self.bridge, '%sv%d' % (TAG, i), '%sp%d' % (TAG, i),
                                [v4(i) + '/24', v6(i) + '/64'])

    def ssh_opts(self):
        return ['-i', self.key, '-F', '/dev/null', '-o', 'UserKnownHostsFile=/dev/null',
                '-o', 'LogLevel=ERROR', '-o', 'ConnectTimeout=10', '-o', 'IdentitiesOnly=yes']

    def _start_sshds(self):
        run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-C', TAG, '-f', self.key])
        auth = os.path.join(self.tmp, 'authorized_keys')
        shutil.copy(self.key + '.pub', auth)
        os.makedirs('/run/sshd', exist_ok=True)
        sshd = shutil.which('sshd') or '/usr/sbin/sshd'
        for i in range(1, NUM_HOSTS + 1):
            ns = self.namespaces[i]
            hostkey = os.path.join(self.tmp, 'hostkey_%d' % i)
            run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f', hostkey])
            pidfile = os.path.join(self.tmp, 'sshd_%d.pid' % i)
            config = os.path.join(self.tmp, 'sshd_%d.conf' % i)
            with open(config, 'w') as f:
                f.write('\n'.join([
                    'Port 22', 'ListenAddress %s' % v4(i), 'ListenAddress %s' % v6(i),
                    'HostKey %s' % hostkey, 'PidFile %s' % pidfile,
                    'AuthorizedKeysFile %s' % auth, 'UsePAM no', 'StrictModes no',
                    'PermitRootLogin prohibit-password', 'PasswordAuthentication no',
                    'KbdInteractiveAuthentication no', 'PrintMotd no', 'MaxStartups 100',
                    'MaxSessions 100', 'LogLevel ERROR', '']))
            self.remember('pidfiles', pidfile)
            run([sshd, '-f', config, '-E', os.path.join(self.tmp, 'sshd_%d.log' % i)], ns=ns)
        deadline = time.monotonic() + 20
        for i in range(1, NUM_HOSTS + 1):
            while True:
                probe = run(['ssh'] + self.ssh_opts() + ['-o', 'BatchMode=yes', '-o',
                                                         'StrictHostKeyChecking=no',
                                                         v4(i), 'true'],
                            check=False, ns=self.namespaces[0])
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError('sshd in %s does not answer on %s: %s'
                                       % (self.namespaces[i], v4(i), probe.out.strip()))
                time.sleep(0.2)

    def processes(self):
        """(namespace, pid, program) of every process in our namespaces but the
        listening sshds: what a finished job must not leave behind."""
        sshds = set()
        for pidfile in self.state['pidfiles']:
            try:
                with open(pidfile) as f:
                    sshds.add(int(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        return netns.namespace_processes(self.namespaces, lambda pid, _: pid in sshds)


TOPOLOGY = None


def _missing_prerequisite():
    if not hasattr(os, 'geteuid') or os.geteuid() != 0:
        return 'needs root (network namespaces, a bridge and sshd)'
    for tool in ('ip', 'sshd', 'ssh', 'ssh-keygen'):
        if not shutil.which(tool, path=os.environ.get('PATH', '') + ':/usr/sbin:/sbin'):
            return ('%s not found (Debian: apt-get install iproute2 openssh-server '
                    'openssh-client)' % tool)
    return netns.namespaces_problem(TAG)


def setUpModule():
    global TOPOLOGY
    netns.require('multihost_test', _missing_prerequisite, DAEMONS, BUILD_DIR)
    TOPOLOGY = netns.set_up(Topology())


def tearDownModule():
    if TOPOLOGY is not None:
        TOPOLOGY.teardown()


# ----------------------------------------------------------------------------
# Jobs


def worker_program():
    """(argv, description) of the worker every job runs: tessera-worker training
    for an epoch on a subset when it is built and the data is there, else the
    C-API check worker's `nightly` mode."""
    trainer = os.path.join(BUILD_DIR, 'worker', 'tessera-worker')
    if os.access(trainer, os.X_OK) and os.path.isdir(DATA_DIR):
        return ([trainer, '--kv-store', 'dist_sync', '--epochs', '1', '--train-subset', '2000',
                 '--test-subset', '500', '--batch-size', '100', '--data', DATA_DIR],
                'tessera-worker, 1 epoch on 2000 Fashion-MNIST images')
    checker = os.path.join(BUILD_DIR, 'tests', 'core', 'kv_check_worker')
    return [checker, 'nightly'], 'kv_check_worker nightly (tessera-worker or data missing)'


def long_worker_program():
    """A worker that runs far longer than the kill test waits."""
    trainer = os.path.join(BUILD_DIR, 'worker', 'tessera-worker')
    if os.access(trainer, os.X_OK) and os.path.isdir(DATA_DIR):
        return [trainer, '--kv-store', 'dist_sync', '--epochs', '100000', '--train-subset',
                '1000', '--test-subset', '100', '--batch-size', '100', '--log-every', '1000',
                '--data', DATA_DIR]
    return [os.path.join(BUILD_DIR, 'tests', 'core', 'kv_check_worker'), 'barrier', '100000',
            '20']


def wait_line(test, run, pattern, timeout=60):
    """The first match of `pattern` in the output of `run` (a LaunchRun),
    waiting at most `timeout` seconds while it runs; fails `test` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, run.output, re.M)
        if m:
            return m
        test.assertIsNone(run.proc.poll(), 'ended before %r:\n%s' % (pattern, run.tail()))
        time.sleep(0.1)
    test.fail('no line matched %r within %d s:\n%s' % (pattern, timeout, run.tail()))


class LaunchRun(object):
    """One launch.py run started by `argv` (through `ip netns exec` here, salloc in
    slurm_test), its output collected by a thread."""

    def __init__(self, argv, env, cwd):
        self.argv = argv
        self.proc_env = env
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env=env, cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.elapsed = None

    def _read(self):
        for line in iter(self.proc.stdout.readline, b''):
            self.lines.append(line.decode('utf-8', 'replace'))

    @property
    def output(self):
        return ''.join(self.lines)

    def wait(self, timeout=JOB_TIMEOUT_S):
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = None
        self.elapsed = time.monotonic() - self.started
        self._reader.join(5)
        self.proc.stdout.close()
        return rc

    def advertised(self):
        """[(launcher's label, address)] from the nodes' PS_VERBOSE 'advertises'
        lines, e.g. ('server 1', '10.77.0.12')."""
        return sorted(re.findall(r'^\[((?:server|worker) \d)\] .*\b(?:server|worker) '
                                 r'advertises (\S+):\d+;', self.output, re.M))

    def tail(self, n=60):
        return ''.join(self.lines[-n:])


class Job(LaunchRun):
    """One launch.py run inside h0 over the hosts h1..h3 (or `hosts`)."""

    def __init__(self, topo, launcher_args, worker_argv, env=None, cwd=None, hosts=None):
        self.topo = topo
        self.hostfile = os.path.join(topo.tmp, 'hostfile-%d' % time.monotonic_ns())
        with open(self.hostfile, 'w') as f:
            for h in hosts or [v4(i) for i in range(1, NUM_HOSTS + 1)]:
                f.write('%s\n' % h)
        environ = {
            'PATH': os.environ['PATH'], 'HOME': os.environ.get('HOME', '/root'),
            'LANG': 'C.UTF-8', 'PS_VERBOSE': '1', 'PYTHONUNBUFFERED': '1',
            'TESSERA_SSH_OPTS': ' '.join(topo.ssh_opts()),
        }
        environ.update(env or {})
        argv = (['ip', 'netns', 'exec', topo.namespaces[0], sys.executable, LAUNCH_PY,
                 '-n', '2', '-s', '2', '-H', self.hostfile,
                 '--scheduler-binary', os.path.join(BUILD_DIR, 'scheduler', 'tessera-scheduler'),
                 '--server-binary', os.path.join(BUILD_DIR, 'server', 'tessera-server')]
                + list(launcher_args) + list(worker_argv))
        super(Job, self).__init__(argv, environ, cwd or topo.tmp)


class MultiHostTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.worker_argv, what = worker_program()
        sys.stderr.write('\nmultihost_test: worker program: %s\n' % what)

    def setUp(self):
        self.topo = TOPOLOGY
        self.addCleanup(self._no_leftovers)

    def _no_leftovers(self):
        """Every job must leave no Tessera process on any host; kill any it left."""
        left = netns.kill_leftovers(self.topo.processes, 15)
        self.assertEqual(left, [], 'processes left behind after the job (namespace, pid, '
                         'program)')

    def run_job(self, launcher_args, worker_argv=None, env=None, cwd=None, hosts=None,
                timeout=JOB_TIMEOUT_S):
        job = Job(self.topo, launcher_args, worker_argv or self.worker_argv, env=env,
                  cwd=cwd, hosts=hosts)
        rc = job.wait(timeout)
        sys.stderr.write('multihost_test: %s: launch.py exit %s after %.1f s\n'
                         % (self.id().rsplit('.', 1)[-1], rc, job.elapsed))
        self.assertIsNotNone(rc, 'launch.py still running after %d s:\n%s'
                             % (timeout, job.tail()))
        return job, rc

    @staticmethod
    def key_folders():
        """Folders launch.py makes for keys on the hosts (the namespaces share /tmp)."""
        import glob
        return set(glob.glob('/tmp/tessera-key.*') + glob.glob('/tmp/tessera-keys-*'))

    def assert_secured(self, job, folders_before):
        """Every node's connections were authenticated and encrypted with its role's
        key (the PS_VERBOSE line of common/curve_keys.cc), and no key folder that
        the job made on a host outlived it."""
        for name in ('scheduler', 'server 0', 'server 1', 'worker 0', 'worker 1'):
            role = name.split()[0]
            self.assertRegex(job.output, r'(?m)^\[%s\] .*connections authenticated and '
                             r'encrypted \(CURVE\) with the %s key ' % (name, role),
                             '%s did not run secured:\n%s' % (name, job.tail()))
        self.assertNotIn('TESSERA_INSECURE', job.output)
        self.assertEqual(self.key_folders() - folders_before, set(),
                         'key folders left behind on the hosts')

    def assert_ran_on_every_host(self, job, addresses):
        """Servers on h1, h2 and workers on h3, h1 (round-robin over the hostfile),
        each advertising its host's address in `addresses` (h1, h2, h3)."""
        h1, h2, h3 = addresses
        want = [('server 0', h1), ('server 1', h2), ('worker 0', h3), ('worker 1', h1)]
        self.assertEqual(job.advertised(), want, 'where the nodes ran (launcher label, '
                         'advertised address):\n%s' % job.tail())

    # -- (1) ssh launcher, with --sync-dst-dir

    def test_ssh_launcher_two_servers_two_workers_over_three_hosts(self):
        if not shutil.which('rsync'):
            self.skipTest('rsync not found (Debian: apt-get install rsync)')
        src = os.path.join(self.topo.tmp, 'job-src')
        dst = os.path.join(self.topo.tmp, 'job-synced')
        os.makedirs(src)
        wrapper = os.path.join(src, 'run_worker.sh')
        with open(wrapper, 'w') as f:
            f.write('#!/bin/sh\n'
                    'echo "multihost wrapper in $(pwd) with $(ip -o -4 addr show dev eth0 '
                    '| awk \'{print $4}\')"\n'
                    'exec "$@"\n')
        os.chmod(wrapper, 0o755)
        folders = self.key_folders()
        job, rc = self.run_job(['--launcher', 'ssh', '--sync-dst-dir', dst, './run_worker.sh'],
                               cwd=src)
        self.assertEqual(rc, 0, job.tail())
        self.assert_secured(job, folders)
        self.assertTrue(os.path.isfile(os.path.join(dst, 'run_worker.sh')),
                        '--sync-dst-dir did not copy the folder to %s' % dst)
        wrapped = re.findall(r'multihost wrapper in (\S+) with (\S+)/24', job.output)
        self.assertEqual(sorted(wrapped), sorted([(dst, v4(3)), (dst, v4(1))]),
                         'the workers should run the synced wrapper on h3 and h1:\n%s'
                         % job.tail())
        self.assertIn('scheduler listening on %s:' % v4(0), job.output)
        self.assert_ran_on_every_host(job, [v4(1), v4(2), v4(3)])

    # -- (2) mpi launcher

    def test_mpi_launcher_two_servers_two_workers_over_three_hosts(self):
        if not shutil.which('mpirun'):
            self.skipTest('mpirun not found (Debian: apt-get install openmpi-bin)')
        env = {
            # Open MPI's daemons talk over the bridge only, never over dummy0.
            'OMPI_MCA_oob_tcp_if_include': SUBNET4,
            'OMPI_MCA_btl_tcp_if_include': SUBNET4,
            'OMPI_MCA_btl': 'self,tcp',
            'OMPI_MCA_plm_rsh_agent': 'ssh',
        }
        folders = self.key_folders()
        job, rc = self.run_job(['--launcher', 'mpi'], env=env)
        self.assertEqual(rc, 0, job.tail())
        self.assert_secured(job, folders)
        self.assertIn('scheduler listening on %s:' % v4(0), job.output)
        self.assert_ran_on_every_host(job, [v4(1), v4(2), v4(3)])

    # -- (3) DMLC_INTERFACE

    def test_interface_eth0_picks_the_reachable_address(self):
        job, rc = self.run_job(['--launcher', 'ssh', '--interface', 'eth0'])
        self.assertEqual(rc, 0, job.tail())
        self.assertIn('scheduler listening on %s:' % v4(0), job.output)
        self.assert_ran_on_every_host(job, [v4(1), v4(2), v4(3)])
        self.assertNotIn('10.99.', job.output)

    def test_interface_unreachable_fails_naming_the_address(self):
        job, rc = self.run_job(['--launcher', 'ssh', '--env', 'DMLC_INTERFACE:dummy0'],
                               env={'TESSERA_START_TIMEOUT': str(START_TIMEOUT_S)},
                               timeout=NEGATIVE_BOUND_S + 30)
        self.assertNotEqual(rc, 0, job.tail())
        self.assertLess(job.elapsed, NEGATIVE_BOUND_S, job.tail())
        advertised = set(address for _, address in job.advertised())
        self.assertTrue(advertised and advertised <= set(dummy_v4(i) for i in range(1, 4)),
                        'nodes should advertise their dummy0 address: %s\n%s'
                        % (sorted(advertised), job.tail()))
        # e.g. "tessera-server: no node table from the scheduler at 10.77.0.1:P within
        # 8s (this node advertises 10.99.1.1:P; ... can it reach that address?)"
        named = [l for l in job.lines if re.search(r'10\.99\.[123]\.1', l) and
                 re.search(r'reach|no node table|deadline', l)]
        self.assertTrue(named, 'no error line names the unreachable address:\n%s' % job.tail())

    # -- (4) a worker killed on one host

    def test_worker_killed_stops_the_job_everywhere(self):
        job = Job(self.topo, ['--launcher', 'ssh'], long_worker_program())
        victim = None
        deadline = time.monotonic() + 60
        try:
            while victim is None and time.monotonic() < deadline:
                self.assertIsNone(job.proc.poll(), 'the job ended early:\n%s' % job.tail())
                if 'joined as' in job.output and job.output.count('joined as') >= 4:
                    for ns, pid, program in self.topo.processes():
                        if (ns == self.topo.namespaces[3] and program in TESSERA_BINARIES
                                and program != 'tessera-server'):
                            victim = (ns, pid, program)
                time.sleep(0.2)
            self.assertIsNotNone(victim, 'no worker showed up on h3:\n%s' % job.tail())
            time.sleep(1.0)  # let it train a little
            run(['kill', '-9', str(victim[1])], ns=victim[0])
            killed_at = time.monotonic()
            rc = job.wait(KILL_BOUND_S + 10)
            took = time.monotonic() - killed_at
        finally:
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
        sys.stderr.write('multihost_test: killed worker pid %d in %s; launch.py exit %s %.1f s '
                         'later\n' % (victim[1], victim[0], rc, took))
        self.assertIsNotNone(rc, 'launch.py still running %d s after the kill:\n%s'
                             % (KILL_BOUND_S + 10, job.tail()))
        self.assertNotEqual(rc, 0, job.tail())
        self.assertLess(took, KILL_BOUND_S, job.tail())
        self.assertRegex(job.output, r'worker \d on %s \(pid %d\) (killed by signal SIGKILL|'
                         r'exited with status 137)' % (re.escape(v4(3)), victim[1]))
        # _no_leftovers (cleanup) then checks every namespace within 15 s.

    def test_replicated_job_survives_the_loss_of_a_whole_host(self):
        # 3 servers and 2 workers round-robin over h1..h3 put server 2 alone on h3.
        # With --replicas 2 every slice also lives on the next server, so taking h3
        # away mid-training (its link down, every Tessera process in it killed) is
        # survived: the other servers take over its slices and the job ends 0, both
        # workers with the same final weights.
        trainer = os.path.join(BUILD_DIR, 'worker', 'tessera-worker')
        if not (os.access(trainer, os.X_OK) and os.path.isdir(DATA_DIR)):
            self.skipTest('needs tessera-worker and Fashion-MNIST')
        argv = [trainer, '--kv-store', 'dist_sync', '--gc-type', '2bit', '--gc-threshold',
                '1', '--momentum', '0.5', '--lr', '0.1', '--epochs', '300',
                '--train-subset', '1000', '--test-subset', '100', '--batch-size', '100',
                '--log-every', '1000', '--data', DATA_DIR]
        env = {'PS_HEARTBEAT_INTERVAL': '0.5', 'PS_HEARTBEAT_TIMEOUT': '3',
               'TESSERA_BIGARRAY_BOUND': '1000'}
        ns = self.topo.namespaces[3]
        # --timeout 5: the ssh session to h3 never ends (its link is down); once the
        # job ended OK the launcher takes it for lost after that grace.
        job = Job(self.topo, ['--launcher', 'ssh', '-s', '3', '--replicas', '2',
                              '--timeout', '5'], argv, env=env)
        self.addCleanup(run, ['ip', 'link', 'set', 'eth0', 'up'], ns=ns, check=False)
        victims = []
        deadline = time.monotonic() + 60
        try:
            while not victims and time.monotonic() < deadline:
                self.assertIsNone(job.proc.poll(), 'the job ended early:\n%s' % job.tail())
                if job.output.count('joined as') >= 5:
                    victims = [(n, pid, program) for n, pid, program in self.topo.processes()
                               if n == ns and program in TESSERA_BINARIES]
                time.sleep(0.2)
            self.assertEqual([v[2] for v in victims], ['tessera-server'],
                             'h3 should hold server 2 alone:\n%s' % job.tail())
            time.sleep(1.0)  # let it train a little
            run(['ip', 'link', 'set', 'eth0', 'down'], ns=ns)
            for _, pid, _ in victims:
                run(['kill', '-9', str(pid)], ns=ns, check=False)
            killed_at = time.monotonic()
            rc = job.wait(JOB_TIMEOUT_S)
            took = time.monotonic() - killed_at
        finally:
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
        sys.stderr.write('multihost_test: took h3 away (server pid %d); launch.py exit %s '
                         '%.1f s later\n' % (victims[0][1], rc, took))
        self.assertEqual(rc, 0, job.tail(120))
        self.assertRegex(job.output, r'\[scheduler\] .*(?:stopped heart-beating|is gone: its '
                                     r'connection closed).*; its key '
                         r'slices fail over to their next replica \(TESSERA_REPLICAS=2\)')
        self.assertIn('launch.py: server 2 on %s' % v4(3), job.output)
        sums = re.findall(r'Final weights checksum=([0-9a-f]{16})', job.output)
        self.assertEqual(len(sums), 2, job.tail(120))
        self.assertEqual(sums[0], sums[1], job.tail(120))

    def wait_line(self, run, pattern, timeout=60):
        return wait_line(self, run, pattern, timeout)

    def test_workers_and_servers_added_over_ssh_join_a_running_job(self):
        # An elastic, replicated ssh job (--elastic 2:3, --replicas 2, 2 of at most 3
        # server ranks) over h1..h3 names its job file and how to add processes on
        # other hosts. Two more launch.py runs in h0 add a worker and a server on h3
        # over ssh (--launcher ssh -H with h3 only): each gets a joiner's node key on
        # its ssh channel, registers with the scheduler at h0's address and advertises
        # h3's. The worker joins the soak as rank 2 and its pushes count (the job's
        # two workers check every round exactly, SOAK_JOINER=2); the server takes
        # rank 2, catches up and takes back its place. Everything ends 0, secured,
        # with no key folder left on a host.
        checker = os.path.join(BUILD_DIR, 'tests', 'core', 'kv_check_worker')
        folders = self.key_folders()
        # Only PS_* and TESSERA_* variables reach other hosts by themselves.
        job = Job(self.topo, ['--launcher', 'ssh', '--elastic', '2:3', '--replicas', '2',
                              '--max-servers', '3', '--env-worker', 'SOAK_JOINER:2',
                              '--env-worker', 'SOAK_PRINT_ROUNDS:1'],
                  [checker, 'soak', '500', '20'], env={'TESSERA_BIGARRAY_BOUND': '1000'})
        adders = []
        try:
            files = [self.wait_line(job, r'to add workers while it runs: launch.py '
                                         r'--add-workers N --join (\S+) --launcher ssh '
                                         r'-H HOSTFILE COMMAND'),
                     self.wait_line(job, r'to add servers while it runs: launch.py '
                                         r'--add-servers N --join (\S+) --launcher ssh '
                                         r'-H HOSTFILE$')]
            self.assertEqual(files[0].group(1), files[1].group(1))
            self.wait_line(job, r'^\[worker \d\] round 10 done at')
            h3 = os.path.join(self.topo.tmp, 'hostfile-h3')
            with open(h3, 'w') as f:
                f.write('%s\n' % v4(3))
            base = ['ip', 'netns', 'exec', self.topo.namespaces[0], sys.executable,
                    LAUNCH_PY, '--launcher', 'ssh', '-H', h3, '--join', files[0].group(1)]
            # The worker first: the server that comes after it must learn from
            # the slices it takes which rounds wait for the joiner. The joiner
            # outlives the job's two (their rounds after its last would lack
            # its pushes).
            adders.append(LaunchRun(base + ['--add-workers', '1', '--env', 'SOAK_JOIN:1',
                                            checker, 'soak', '700'],
                                    job.proc_env, self.topo.tmp))
            self.wait_line(adders[0], r"joined the job \(generation \d+\): in every key's "
                                      r'rounds from round \d+')
            adders.append(LaunchRun(base + ['--add-servers', '1'], job.proc_env,
                                    self.topo.tmp))
            rc = job.wait(JOB_TIMEOUT_S)
            codes = [a.wait(60) for a in adders]
        finally:
            for run_ in [job] + adders:
                if run_.proc.poll() is None:
                    os.killpg(run_.proc.pid, signal.SIGKILL)
        everything = job.output + ''.join(a.output for a in adders)
        if os.environ.get('MULTIHOST_DUMP'):
            with open(os.environ['MULTIHOST_DUMP'], 'w') as f:
                f.write(everything)
        self.assertEqual(rc, 0, job.tail(120) + ''.join(a.tail() for a in adders))
        self.assertEqual(codes, [0, 0], ''.join(a.tail() for a in adders))
        worker_out, server_out = adders[0].output, adders[1].output
        self.assertIn('launch.py: adding 1 server(s) to the running job of', server_out)
        self.assertRegex(server_out, r'(?m)^\[added server 0\] .*server advertises '
                                     r'%s:\d+;' % re.escape(v4(3)))
        self.assertRegex(worker_out, r'(?m)^\[added worker 0\] .*worker advertises '
                                     r'%s:\d+;' % re.escape(v4(3)))
        for out, role in ((server_out, 'server'), (worker_out, 'worker')):
            self.assertRegex(out, r'(?m)^\[added %s 0\] .*connections authenticated and '
                                  r'encrypted \(CURVE\) with the %s key ' % (role, role))
        self.assertIn('[added worker 0] soak joined: rank 2, 700 rounds', worker_out)
        self.assertRegex(job.output, r'\[scheduler\] .*joins the job \(join 1\): 3 of at '
                                     r'most 3 worker\(s\) in it')
        self.assertRegex(job.output, r'\[scheduler\] .*takes server rank 2, which had no '
                                     r'server')
        self.assertRegex(job.output, r'\[scheduler\] .*hand-back in [^)]*\): it answers for '
                                     r'the slices of rank 2 again')
        sums = re.findall(r'soak ok: rank \d of \d+, \d+ rounds checksum=([0-9a-f]{16})',
                          everything)
        self.assertEqual(len(sums), 2, job.tail(120))
        self.assertEqual(sums[0], sums[1], job.tail(120))
        self.assertEqual(self.key_folders() - folders, set(),
                         'key folders left behind on the hosts')

    # -- (5) hostname root URI, DMLC_NODE_HOST over DMLC_INTERFACE, IPv6

    def test_hostname_root_uri_and_node_host_over_interface(self):
        # Every host's /etc/hosts (via /etc/netns/<ns>/hosts) maps TAG-root to h0
        # and TAG-self to the host itself; dummy0 would be unreachable, so only
        # DMLC_NODE_HOST winning over DMLC_INTERFACE lets the job succeed.
        job, rc = self.run_job(['--launcher', 'ssh', '--env', 'DMLC_INTERFACE:dummy0',
                                '--env', 'DMLC_NODE_HOST:%s' % self.topo.self_name],
                               env={'DMLC_PS_ROOT_URI': self.topo.root_name})
        self.assertEqual(rc, 0, job.tail())
        self.assertIn('scheduler listening on %s:' % v4(0), job.output)
        self.assertIn('scheduler at %s:' % v4(0), job.output)
        self.assert_ran_on_every_host(job, [v4(1), v4(2), v4(3)])

    def test_ipv6_hosts_and_root_uri(self):
        job, rc = self.run_job(['--launcher', 'ssh'], env={'DMLC_PS_ROOT_URI': v6(0)},
                               hosts=[v6(i) for i in range(1, NUM_HOSTS + 1)])
        self.assertEqual(rc, 0, job.tail())
        self.assertIn('scheduler listening on %s:' % v6(0), job.output)
        self.assert_ran_on_every_host(job, [v6(1), v6(2), v6(3)])

    def test_ipv6_root_uri_with_interface_advertises_ipv6(self):
        # Regression: with DMLC_INTERFACE set, a node advertised the interface's IPv4
        # address even when the scheduler is IPv6. Here IPv4 between hosts is
        # dropped (nftables on every eth0), so only an IPv6 advertisement works.
        if not shutil.which('nft'):
            self.skipTest('nft not found (Debian: apt-get install nftables)')
        table = TAG + 'nov4'
        for ns in self.topo.namespaces:
            self.addCleanup(quiet, ['ip', 'netns', 'exec', ns, 'nft', 'delete', 'table', 'ip',
                                     table])
            run(['nft', 'add', 'table', 'ip', table], ns=ns)
            run(['nft', 'add', 'chain', 'ip', table, 'input',
                 '{ type filter hook input priority 0 ; policy accept ; }'], ns=ns)
            run(['nft', 'add', 'rule', 'ip', table, 'input', 'iifname', 'eth0', 'drop'], ns=ns)
        job, rc = self.run_job(['--launcher', 'ssh', '--env', 'DMLC_INTERFACE:eth0'],
                               env={'DMLC_PS_ROOT_URI': v6(0),
                                    # Generous: a positive test must not race the loaders.
                                    'TESSERA_START_TIMEOUT': '30'},
                               hosts=[v6(i) for i in range(1, NUM_HOSTS + 1)],
                               timeout=NEGATIVE_BOUND_S + 30)
        self.assertEqual(rc, 0, job.tail())
        self.assert_ran_on_every_host(job, [v6(1), v6(2), v6(3)])


if __name__ == '__main__':
    unittest.main()
