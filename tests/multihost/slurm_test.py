#!/usr/bin/env python3
"""tools/launch.py --launcher slurm on a real Slurm cluster of network namespaces.

Builds a three-"host" Slurm cluster on this machine, each host a network
namespace with its own `eth0` on one bridge (10.80.0.0/24) and its own host name
(a UTS namespace):

    <tag>h0  10.80.0.1   slurmctld; salloc and launch.py run here (the login node)
    <tag>h1  10.80.0.11  slurmd, node <tag>n1 } the allocation's nodes
    <tag>h2  10.80.0.12  slurmd, node <tag>n2 }

The test writes its own slurm.conf (auth/none and cred/none: nothing leaves the
namespaces; proctrack/pgid, task/none, select/cons_tres; state, spool, pid and
log files in a temporary folder), starts slurmctld and the slurmds in the
foreground (-D) as its children, and waits for both nodes to be idle. The
daemons enter the namespaces with `nsenter --net` rather than `ip netns exec`,
which mounts a fresh /sys without /sys/fs/cgroup, and slurmd 22.05 refuses to
start without its cgroup mounts even with proctrack/pgid.

Tests (salloc -N 2 -n 2, then launch.py --launcher slurm -n 2 -s 2):
  - a training job (tessera-worker, 1 epoch on 2000 Fashion-MNIST images; the
    C-API check worker when the trainer or the data is missing) exits 0 with the
    scheduler on the first node, server 0 and worker 0 on n1, server 1 and
    worker 1 on n2 (each advertising its node's address), every process running
    with the job's fresh CURVE keys, accuracies printed by both workers, and no
    key folder, process or job step left afterwards;
  - worker 1 exiting 3 makes launch.py exit 3 naming it and its node, within
    seconds, and leaves no Tessera process, slurmstepd or step behind.
  - an elastic job with one copy of each slice (--elastic 2:3 --max-servers 3)
    takes a worker and then a server added from the login node by launch.py
    --add-workers/--add-servers --launcher slurm (steps of the job's
    allocation), every soak round checked exactly;
  - tools/slurm/tessera.sbatch, submitted with `sbatch --wait` as a user would
    (only its variables set: TESSERA_DIR, TESSERA_BUILD_DIR), exits 0 with both
    servers on n1 and both workers on n2 (2 task slots per node).

Slurm's multiple-slurmd mode (several `slurmd -N NAME` on one host, NodeName
entries with their own Port=) also works with Debian 12's slurm-wlm 22.05; the
namespaces are used instead so that every node has its own address, as on a
real cluster, and the test can tell where each process ran.

Needs root, `ip netns`, a bridge, unshare/nsenter (util-linux) and Slurm's
slurmctld, slurmd, salloc, srun, scontrol and sinfo (Debian: slurm-wlm) with the
auth/none plugin (Slurm before 23.11). Without them it skips and says why
(ctest label: multihost).

    TESSERA_BUILD_DIR=build TESSERA_SOURCE_DIR=. python3 tests/multihost/slurm_test.py -v

Clean-up: what the test made (daemons, namespaces, bridge, veths, the
temporary folder) is removed in tearDownModule, from an atexit and signal
handler, and, should this process be SIGKILLed, by the guard process of
tests/support/netns.py, from the state file that lists them.
"""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', 'support'))
import multihost_test as mh  # noqa: E402 (its launch.py runner and worker programs)
import netns  # noqa: E402 (the hosts: namespaces on a bridge, clean-up with its guard)
from netns import run  # noqa: E402

LAUNCH_PY = mh.LAUNCH_PY
BUILD_DIR = mh.BUILD_DIR

TAG = 'tsl%d' % (os.getpid() % 100000)
NUM_NODES = 2
CTLD_HOST = TAG + 'c'

JOB_TIMEOUT_S = 120
IDLE_TIMEOUT_S = 30  # for the slurmds to register and the nodes to be idle
FAIL_BOUND_S = 30  # from start to launch.py's exit when a worker exits 3


def ns_name(i):
    return '%sh%d' % (TAG, i)


def node_name(i):
    return '%sn%d' % (TAG, i)


def v4(i):
    return '10.80.0.%d' % (1 if i == 0 else 10 + i)


def in_ns(i, argv, hostname=None):
    """argv run in host i's network namespace (nsenter keeps /sys and its
    cgroup mounts), with its own host name when hostname is given."""
    argv = ['nsenter', '--net=/run/netns/%s' % ns_name(i)] + list(argv)
    if hostname:
        argv = ['unshare', '--uts', 'sh', '-c', 'hostname "$0" && exec "$@"',
                hostname] + argv
    return argv


def auth_none_plugin():
    """Path of Slurm's auth/none plugin, or None (removed in Slurm 23.11)."""
    for pattern in ('/usr/lib/*/slurm-wlm/auth_none.so', '/usr/lib*/slurm/auth_none.so',
                    '/usr/local/lib*/slurm/auth_none.so'):
        found = glob.glob(pattern)
        if found:
            return found[0]
    return None


def _missing_prerequisite():
    if not hasattr(os, 'geteuid') or os.geteuid() != 0:
        return 'needs root (network namespaces, a bridge and Slurm daemons)'
    path = os.environ.get('PATH', '')
    for tool in ('ip', 'unshare', 'nsenter'):
        if not shutil.which(tool, path=path):
            return '%s not found (Debian: apt-get install iproute2 util-linux)' % tool
    for tool in ('slurmctld', 'slurmd', 'salloc', 'srun', 'scontrol', 'sinfo', 'squeue'):
        if not shutil.which(tool, path=path):
            return '%s not found (Debian: apt-get install slurm-wlm)' % tool
    if auth_none_plugin() is None:
        return ('Slurm\'s auth/none plugin (auth_none.so) not found: this test configures a '
                'cluster without munge, which Slurm before 23.11 allows')
    return netns.namespaces_problem(TAG, _nsenter_and_unshare_problem)


def _nsenter_and_unshare_problem(probe):
    works = run(['nsenter', '--net=/run/netns/%s' % probe, 'ip', 'link', 'set', 'lo', 'up'],
                check=False)
    if works.returncode != 0:
        return '`nsenter --net` does not work here: %s' % works.out.strip()
    works = run(['unshare', '--uts', 'true'], check=False)
    if works.returncode != 0:
        return '`unshare --uts` does not work here: %s' % works.out.strip()
    return None


class SlurmCluster(netns.Resources):
    """The bridge, namespaces, slurmctld and slurmds. One per run."""

    def __init__(self):
        super(SlurmCluster, self).__init__('slurm_test', 'slurm', TAG)
        self.bridge = TAG + 'br'
        self.conf = os.path.join(self.tmp, 'slurm.conf')
        self.daemons = []  # Popen of slurmctld and the slurmds

    def env(self):
        """What every Slurm command of the test runs with."""
        return {'PATH': os.environ['PATH'], 'HOME': os.environ.get('HOME', '/root'),
                'LANG': 'C.UTF-8', 'SLURM_CONF': self.conf}

    def setup(self):
        netns.make_bridge(self, self.bridge)
        for i in range(NUM_NODES + 1):
            netns.make_namespace(self, ns_name(i))
            netns.connect_to_bridge(self, ns_name(i), self.bridge, '%sv%d' % (TAG, i),
                                    '%sp%d' % (TAG, i), [v4(i) + '/24'])
        self._write_conf()
        self._start_daemons()
        self._wait_idle()

    def _write_conf(self):
        t = self.tmp
        for d in ('state', 'spool'):
            os.makedirs(os.path.join(t, d))
        for i in range(1, NUM_NODES + 1):
            os.makedirs(os.path.join(t, 'spool', node_name(i)))
        lines = [
            'ClusterName=%s' % TAG,
            'SlurmctldHost=%s(%s)' % (CTLD_HOST, v4(0)),
            'SlurmUser=root', 'SlurmdUser=root',
            'AuthType=auth/none', 'CredType=cred/none',
            'StateSaveLocation=%s/state' % t,
            'SlurmdSpoolDir=%s/spool/%%n' % t,
            'SlurmctldPidFile=%s/slurmctld.pid' % t,
            'SlurmdPidFile=%s/slurmd-%%n.pid' % t,
            'SlurmctldLogFile=%s/slurmctld.log' % t,
            'SlurmdLogFile=%s/slurmd-%%n.log' % t,
            'ProctrackType=proctrack/pgid', 'TaskPlugin=task/none',
            'SelectType=select/cons_tres', 'SelectTypeParameters=CR_CPU',
            'JobAcctGatherType=jobacct_gather/none',
            'AccountingStorageType=accounting_storage/none',
            'MpiDefault=none', 'ReturnToService=2',
            # The nodes' CPU count is what the test says, not this VM's.
            'SlurmdParameters=config_overrides',
            'SlurmdTimeout=60', 'SlurmctldTimeout=60', 'MailProg=/bin/true',
        ]
        for i in range(1, NUM_NODES + 1):
            lines.append('NodeName=%s NodeAddr=%s NodeHostname=%s CPUs=4 State=UNKNOWN'
                         % (node_name(i), v4(i), node_name(i)))
        lines.append('PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP')
        with open(self.conf, 'w') as f:
            f.write('\n'.join(lines) + '\n')

    def _spawn(self, argv, log):
        out = open(os.path.join(self.tmp, log), 'wb')
        proc = subprocess.Popen(argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        pidfile = os.path.join(self.tmp, log + '.pid')
        with open(pidfile, 'w') as f:
            f.write('%d\n' % proc.pid)
        self.remember('pidfiles', pidfile)
        self.daemons.append(proc)
        return proc

    def _start_daemons(self):
        # -i: ignore state files (there are none; a fresh cluster).
        self._spawn(in_ns(0, ['slurmctld', '-D', '-i'], hostname=CTLD_HOST), 'slurmctld.out')
        for i in range(1, NUM_NODES + 1):
            self._spawn(in_ns(i, ['slurmd', '-D', '-N', node_name(i)], hostname=node_name(i)),
                        'slurmd-%d.out' % i)

    def slurm(self, argv, check=True):
        """A Slurm client command run on the login host h0."""
        return run(in_ns(0, argv), check=check, env=self.env())

    def _log_tails(self):
        out = []
        for name in sorted(os.listdir(self.tmp)):
            if name.endswith('.out') or name.endswith('.log'):
                with open(os.path.join(self.tmp, name), errors='replace') as f:
                    out.append('--- %s\n%s' % (name, ''.join(f.readlines()[-8:])))
        return '\n'.join(out)

    def _wait_idle(self):
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        states = ''
        while time.monotonic() < deadline:
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError('a Slurm daemon exited (%s) while starting:\n%s'
                                       % (proc.returncode, self._log_tails()))
            probe = self.slurm(['sinfo', '--noheader', '--Node', '--format=%N %t'],
                               check=False)
            states = probe.out.strip()
            idle = re.findall(r'^(\S+) idle$', states, re.M)
            if sorted(idle) == [node_name(i) for i in range(1, NUM_NODES + 1)]:
                return
            time.sleep(0.3)
        raise RuntimeError('Slurm nodes not idle after %d s (sinfo: %r):\n%s'
                           % (IDLE_TIMEOUT_S, states, self._log_tails()))

    def processes(self):
        """(namespace, pid, program) of every process in the namespaces but the
        Slurm daemons themselves: what a finished job must not leave behind
        (a slurmstepd left there is a step Slurm did not end)."""
        return netns.namespace_processes(  # Debian: slurmd-wlm
            [ns_name(i) for i in range(NUM_NODES + 1)],
            lambda _, program: re.match(r'^slurm(ctld|d)(-wlm)?$', program))

    def teardown(self):
        super(SlurmCluster, self).teardown()
        for proc in self.daemons:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


CLUSTER = None


def setUpModule():
    global CLUSTER
    netns.require('slurm_test', _missing_prerequisite, mh.DAEMONS, BUILD_DIR)
    started = time.monotonic()
    CLUSTER = netns.set_up(SlurmCluster())
    sys.stderr.write('\nslurm_test: cluster of %d slurmd nodes idle after %.1f s\n'
                     % (NUM_NODES, time.monotonic() - started))


def tearDownModule():
    if CLUSTER is not None:
        CLUSTER.teardown()


class SlurmJob(mh.LaunchRun):
    """`salloc -N 2 -n 2 launch.py --launcher slurm ...` on the login host h0."""

    def __init__(self, cluster, worker_argv, extra_env=None):
        env = cluster.env()
        env.update({'PS_VERBOSE': '1', 'PYTHONUNBUFFERED': '1'})
        env.update(extra_env or {})
        argv = in_ns(0, ['salloc', '--nodes=%d' % NUM_NODES, '--ntasks=%d' % NUM_NODES,
                         '--time=5',
                         sys.executable, LAUNCH_PY, '--launcher', 'slurm',
                         '-n', '2', '-s', '2',
                         '--scheduler-binary',
                         os.path.join(BUILD_DIR, 'scheduler', 'tessera-scheduler'),
                         '--server-binary',
                         os.path.join(BUILD_DIR, 'server', 'tessera-server')]
                     + list(worker_argv))
        super(SlurmJob, self).__init__(argv, env, cluster.tmp)


class SlurmLauncherTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.worker_argv, what = mh.worker_program()
        cls.trains = 'tessera-worker' in what
        sys.stderr.write('slurm_test: worker program: %s\n' % what)

    def setUp(self):
        self.cluster = CLUSTER
        self.key_folders_before = self.key_folders()
        self.addCleanup(self._no_leftovers)

    @staticmethod
    def key_folders():
        """The folders REMOTE_WRAPPER makes for keys (the namespaces share /tmp)."""
        return set(glob.glob('/tmp/tessera-key.*'))

    def _no_leftovers(self):
        """No process but the Slurm daemons, no job or step, no key folder."""
        deadline = time.monotonic() + 15
        left = netns.kill_leftovers(self.cluster.processes, 15)
        self.assertEqual(left, [], 'processes left behind after the job (namespace, pid, '
                         'program)')
        queue = self.cluster.slurm(['squeue', '--noheader', '--steps']).out.strip()
        while queue and time.monotonic() < deadline:
            time.sleep(0.2)
            queue = self.cluster.slurm(['squeue', '--noheader', '--steps']).out.strip()
        self.assertEqual(queue, '', 'job steps left behind (squeue --steps)')
        self.assertEqual(self.key_folders() - self.key_folders_before, set(),
                         'key folders left behind on the nodes')

    def run_job(self, worker_argv, timeout=JOB_TIMEOUT_S):
        job = SlurmJob(self.cluster, worker_argv)
        rc = job.wait(timeout)
        sys.stderr.write('slurm_test: %s: salloc/launch.py exit %s after %.1f s\n'
                         % (self.id().rsplit('.', 1)[-1], rc, job.elapsed))
        self.assertIsNotNone(rc, 'salloc still running after %d s:\n%s' % (timeout, job.tail()))
        return job, rc

    def test_two_servers_two_workers_over_two_nodes(self):
        job, rc = self.run_job(self.worker_argv)
        self.assertEqual(rc, 0, job.tail())
        # The scheduler on the first node, at its NodeAddr.
        self.assertIn('[scheduler] ', job.output)
        self.assertRegex(job.output, r'(?m)^\[scheduler\] .*scheduler listening on %s:\d+'
                         % re.escape(v4(1)))
        # Servers then workers fill the nodes' slots (1 task each): n1, n2, n1, n2.
        want = [('server 0', v4(1)), ('server 1', v4(2)), ('worker 0', v4(1)),
                ('worker 1', v4(2))]
        self.assertEqual(job.advertised(), want, 'where the processes ran:\n%s' % job.tail())
        for name in ('scheduler', 'server 0', 'server 1', 'worker 0', 'worker 1'):
            self.assertRegex(job.output, r'(?m)^\[%s\] .*connections authenticated and '
                             r'encrypted \(CURVE\) with the %s key ' % (name, name.split()[0]),
                             '%s did not run with the job\'s key:\n%s' % (name, job.tail()))
        self.assertRegex(job.output, r'(?m)^salloc: Granted job allocation \d+')
        if self.trains:
            # One epoch on 2000 images: far above chance (0.1) on both workers.
            for w in (0, 1):
                m = re.search(r'(?m)^\[worker %d\] Epoch\[0\] Train-accuracy=([0-9.]+)$' % w,
                              job.output)
                self.assertIsNotNone(m, 'worker %d printed no Train-accuracy:\n%s'
                                     % (w, job.tail()))
                self.assertGreater(float(m.group(1)), 0.25, m.group(0))
                self.assertLessEqual(float(m.group(1)), 1.0, m.group(0))
            m = re.search(r'(?m)^\[worker 0\] Epoch\[0\] Validation-accuracy=([0-9.]+)$',
                          job.output)
            self.assertIsNotNone(m, 'worker 0 printed no Validation-accuracy:\n%s'
                                 % job.tail())
            self.assertGreater(float(m.group(1)), 0.3, m.group(0))

    def test_worker_exit_3_stops_every_task_and_names_it(self):
        wrapper = os.path.join(self.cluster.tmp, 'exit3_worker.sh')
        with open(wrapper, 'w') as f:
            f.write('#!/bin/sh\n'
                    '# Worker 1 (DMLC_TASK_ID 3 with 2 servers) exits 3 once the job runs.\n'
                    'if [ "$DMLC_TASK_ID" = 3 ]; then sleep 2; echo "worker 1 exits 3 on '
                    '$(hostname)"; exit 3; fi\n'
                    'exec "$@"\n')
        os.chmod(wrapper, 0o755)
        job, rc = self.run_job([wrapper] + mh.long_worker_program(), timeout=FAIL_BOUND_S + 30)
        self.assertEqual(rc, 3, job.tail())
        self.assertLess(job.elapsed, FAIL_BOUND_S, job.tail())
        self.assertIn('[worker 1] worker 1 exits 3 on %s' % node_name(2), job.output)
        self.assertRegex(job.output, r'(?m)^launch\.py: worker 1 on %s \(pid \d+\) exited with '
                         r'status 3; stopping the job$' % re.escape(node_name(2)))
        # The others were stopped (SIGTERM from their step's watchdog: 128+15).
        for name in ('scheduler', 'server 0', 'server 1', 'worker 0'):
            self.assertRegex(job.output, r'(?m)^\[%s\] srun: error: %sn\d: task 0: Exited '
                             r'with exit code (143|137)$' % (name, TAG), job.tail())
        # _no_leftovers (clean-up) then checks the namespaces, steps and key folders.

    def test_worker_and_server_added_to_a_running_elastic_job(self):
        # An elastic Slurm job of 2 of at most 3 servers, one copy of each slice
        # (--elastic 2:3 --max-servers 3, no replicas), names its job file and how
        # to add processes. Two launch.py runs on the login node (outside salloc)
        # add a worker and then a server with --launcher slurm: each starts as a
        # step of the job's allocation (srun --jobid) on its first node, with a
        # joiner's node key on the step's stdin. The worker joins the soak as rank 2
        # and its pushes count (the job's workers check every round exactly,
        # SOAK_JOINER=2); the server takes rank 2 and the slices it will answer for.
        # Everything ends 0, with no step, process or key folder left.
        checker = os.path.join(BUILD_DIR, 'tests', 'core', 'kv_check_worker')
        job = SlurmJob(self.cluster, ['--elastic', '2:3', '--max-servers', '3',
                                      '--env-worker', 'SOAK_JOINER:2', '--env-worker',
                                      'SOAK_PRINT_ROUNDS:1', checker, 'soak', '600', '20'],
                       extra_env={'TESSERA_BIGARRAY_BOUND': '1000'})
        adders = []
        try:
            m = self.wait_line(job, r'to add workers while it runs: launch.py --add-workers N '
                                    r'--join (\S+) --launcher slurm COMMAND')
            self.wait_line(job, r'to add servers while it runs: launch.py --add-servers N '
                                r'--join %s --launcher slurm$' % re.escape(m.group(1)))
            self.wait_line(job, r'^\[worker \d\] round 10 done at')
            base = in_ns(0, [sys.executable, LAUNCH_PY, '--launcher', 'slurm', '--join',
                             m.group(1)])
            env = job.proc_env  # salloc's: outside the allocation, the file names it
            # The worker first (it outlives the job's two: their rounds after its
            # last would lack its pushes).
            adders.append(mh.LaunchRun(base + ['--add-workers', '1', '--env', 'SOAK_JOIN:1',
                                               checker, 'soak', '800'],
                                       env, self.cluster.tmp))
            self.wait_line(adders[0], r"joined the job \(generation \d+\): in every key's "
                                      r'rounds from round \d+')
            adders.append(mh.LaunchRun(base + ['--add-servers', '1'], env, self.cluster.tmp))
            rc = job.wait(JOB_TIMEOUT_S)
            codes = [a.wait(60) for a in adders]
        finally:
            for run_ in [job] + adders:
                if run_.proc.poll() is None:
                    os.killpg(run_.proc.pid, signal.SIGKILL)
        everything = job.output + ''.join(a.output for a in adders)
        self.assertEqual(rc, 0, job.tail(120) + ''.join(a.tail() for a in adders))
        self.assertEqual(codes, [0, 0], ''.join(a.tail() for a in adders))
        worker_out, server_out = adders[0].output, adders[1].output
        self.assertIn('launch.py: adding 1 worker(s) to the elastic job of', worker_out)
        self.assertIn('launch.py: adding 1 server(s) to the running job of', server_out)
        self.assertRegex(worker_out, r'(?m)^\[added worker 0\] .*worker advertises '
                                     r'%s:\d+;' % re.escape(v4(1)))
        self.assertRegex(server_out, r'(?m)^\[added server 0\] .*server advertises '
                                     r'%s:\d+;' % re.escape(v4(1)))
        for out, role in ((server_out, 'server'), (worker_out, 'worker')):
            self.assertRegex(out, r'(?m)^\[added %s 0\] .*connections authenticated and '
                                  r'encrypted \(CURVE\) with the %s key ' % (role, role))
        self.assertIn('[added worker 0] soak joined: rank 2, 800 rounds', worker_out)
        self.assertRegex(job.output, r'\[scheduler\] .*joins the job \(join 1\): 3 of at '
                                     r'most 3 worker\(s\) in it')
        self.assertRegex(job.output, r'\[scheduler\] .*takes server rank \d, which had no '
                                     r'server')
        self.assertRegex(job.output, r'\[scheduler\] .*answers for the key slices moved to '
                                     r'it \(server \d of 3')
        sums = re.findall(r'soak ok: rank \d of \d+, \d+ rounds checksum=([0-9a-f]{16})',
                          everything)
        self.assertEqual(len(sums), 2, job.tail(120))
        self.assertEqual(sums[0], sums[1], job.tail(120))

    def wait_line(self, run_, pattern, timeout=60):
        return mh.wait_line(self, run_, pattern, timeout)

    def test_sbatch_example_as_a_user_submits_it(self):
        # tools/slurm/tessera.sbatch unchanged but for its variables: 2 nodes, 2 task
        # slots each, so both servers land on n1 and both workers on n2.
        out = os.path.join(self.cluster.tmp, 'sbatch-%d.out' % time.monotonic_ns())
        env = self.cluster.env()
        env.update({'TESSERA_DIR': mh.SOURCE_DIR, 'TESSERA_BUILD_DIR': BUILD_DIR,
                    'PS_VERBOSE': '1', 'FASHION_MNIST_DIR': mh.DATA_DIR})
        script = os.path.join(mh.SOURCE_DIR, 'tools', 'slurm', 'tessera.sbatch')
        started = time.monotonic()
        proc = subprocess.run(in_ns(0, ['sbatch', '--wait', '--output=%s' % out, script]),
                              env=env, cwd=self.cluster.tmp, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=JOB_TIMEOUT_S)
        sys.stderr.write('slurm_test: sbatch --wait exit %d after %.1f s\n'
                         % (proc.returncode, time.monotonic() - started))
        with open(out, errors='replace') as f:
            output = f.read()
        tail = proc.stdout.decode('utf-8', 'replace') + output[-4000:]
        self.assertEqual(proc.returncode, 0, tail)
        advertised = sorted(re.findall(r'^\[((?:server|worker) \d)\] .*\b(?:server|worker) '
                                       r'advertises (\S+):\d+;', output, re.M))
        self.assertEqual(advertised, [('server 0', v4(1)), ('server 1', v4(1)),
                                      ('worker 0', v4(2)), ('worker 1', v4(2))], tail)
        self.assertRegex(output, r'(?m)^\[scheduler\] .*scheduler listening on %s:\d+'
                         % re.escape(v4(1)))
        if self.trains:
            self.assertEqual(len(re.findall(r'(?m)^\[worker \d\] Epoch\[0\] '
                                            r'Train-accuracy=0\.\d+$', output)), 2, tail)


if __name__ == '__main__':
    unittest.main()
