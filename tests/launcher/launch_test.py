#!/usr/bin/env python3
"""Tests for tools/launch.py, without the C++ daemons.

Fake daemons and workers (one Python script, FAKE_NODE below) record their
environment and pid, and misbehave on request; a fake `ssh` runs the remote
command locally with a scrubbed environment, so the ssh launcher is tested end
to end, teardown included.

    python3 tests/launcher/launch_test.py -v
    TESSERA_SOURCE_DIR=/path/to/tessera python3 -m unittest launch_test
"""

import contextlib
import glob
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

SOURCE_DIR = os.environ.get('TESSERA_SOURCE_DIR') or os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
LAUNCH = os.path.join(SOURCE_DIR, 'tools', 'launch.py')

sys.path.insert(0, os.path.dirname(LAUNCH))
from tessera_launch.binaries import find_binary, own_build_dirs  # noqa: E402
from tessera_launch.config import (  # noqa: E402
    JobConfig, build_config, elastic_of, forwarded_env, max_servers_of, metrics_urls, node_env,
    replicas_of, server_rank)
from tessera_launch.hosts import (  # noqa: E402
    Host, distinct_hosts, ephemeral_range, free_port_run, interface_ipv4, parse_hostfile,
    parse_hostfile_text, pick_node_ports, pick_port, place, scheduler_address)
from tessera_launch.joining import (  # noqa: E402
    added_server_nodes, added_worker_nodes, read_job_file, read_server_job_file,
    write_job_file)
from tessera_launch.keys import (  # noqa: E402
    job_security, joiner_keys, make_job_keys, prepare_keys, server_joiner_keys,
    write_job_keys)
from tessera_launch.options import (  # noqa: E402
    MPI_SPEC_VAR, UsageError, parse_args, parse_env_specs)
from tessera_launch.remote import (  # noqa: E402
    KEY_END_MARKER, KEY_FROM_STDIN, REMOTE_PID_MARKER, REMOTE_WRAPPER, key_stdin)
from tessera_launch.local import local_nodes  # noqa: E402
from tessera_launch.mpi import mpi_nodes  # noqa: E402
from tessera_launch.slurm import parse_tasks_per_node, slurm_hosts, slurm_nodes  # noqa: E402
from tessera_launch.ssh import remote_path, rsync_argv, ssh_argv  # noqa: E402
from tessera_launch.supervisor import Job, Node, describe_status  # noqa: E402
from tessera_launch.status import summarize  # noqa: E402

# Bound on one launcher run in these tests (they take about a second each).
RUN_TIMEOUT_S = 60

# One script plays scheduler, server and worker (by DMLC_ROLE). It writes a
# record to $TESSERA_FAKE_DIR/rec, prints a line to stdout and to stderr, and:
#   daemons: exit 0 once DMLC_NUM_WORKER workers finished (files in done/),
#            never with --hang, at once with --exit CODE; --spawn-child starts
#            a `sleep` grandchild; --ignore-term ignores SIGTERM.
#   workers: --fail-index I [--exit-code C] [--fail-times K] exits C (default 3)
#            when it is worker I (and started fewer than K times before);
#            --sigkill-index I kills itself; --hang-index I sleeps; else exit 0.
FAKE_NODE = r'''
import json, os, signal, subprocess, sys, time

def opt(name, default=None):
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default

role = os.environ.get('DMLC_ROLE', '?')
fake_dir = os.environ['TESSERA_FAKE_DIR']
num_servers = int(os.environ['DMLC_NUM_SERVER'])
num_workers = int(os.environ['DMLC_NUM_WORKER'])
task = int(os.environ.get('DMLC_TASK_ID', '0'))
index = {'server': task, 'worker': task - num_servers}.get(role, 0)
restart = int(os.environ.get('TESSERA_RESTART_COUNT', '-1'))
if '--ignore-term' in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
rec = {'role': role, 'index': index, 'restart': restart, 'pid': os.getpid(),
       'cwd': os.getcwd(), 'argv': sys.argv, 'env': dict(os.environ)}
key = os.environ.get('TESSERA_KEY_FILE')
if not key and os.environ.get('TESSERA_KEY_DIR'):
    key = os.path.join(os.environ['TESSERA_KEY_DIR'], role + '.key')
if key:  # where the job's keys were, and how they were kept
    with open(key) as f:
        rec['key'] = {'path': key, 'text': f.read(), 'mode': os.stat(key).st_mode & 0o7777,
                      'dir_mode': os.stat(os.path.dirname(key)).st_mode & 0o7777,
                      'dir_files': sorted(os.listdir(os.path.dirname(key)))}
if '--spawn-child' in sys.argv:
    rec['child_pid'] = subprocess.Popen(['sleep', '300']).pid
path = os.path.join(fake_dir, 'rec', '%s-%d-%d-%d.json' % (role, index, restart, os.getpid()))
with open(path + '.tmp', 'w') as f:
    json.dump(rec, f)
os.rename(path + '.tmp', path)
name = role if role == 'scheduler' else '%s %d' % (role, index)
print('hello from %s' % name, flush=True)
print('stderr from %s' % name, file=sys.stderr, flush=True)

if role in ('scheduler', 'server'):
    if opt('--exit') is not None:
        sys.exit(int(opt('--exit')))
    while True:
        done = len(os.listdir(os.path.join(fake_dir, 'done')))
        if '--hang' not in sys.argv and done >= num_workers:
            sys.exit(0)
        time.sleep(0.05)

def me(flag):
    return opt(flag) is not None and int(opt(flag)) == index

if me('--fail-index') and restart < int(opt('--fail-times', '1000000')):
    sys.exit(int(opt('--exit-code', '3')))
if me('--sigkill-index'):
    os.kill(os.getpid(), signal.SIGKILL)
if me('--hang-index'):
    time.sleep(300)
time.sleep(float(opt('--sleep', '0')))
open(os.path.join(fake_dir, 'done', str(index)), 'w').close()
'''

# Runs `ssh [opts] host command...` locally: logs the call, then runs the
# command with bash in an environment as bare as a fresh ssh session's.
FAKE_SSH = r'''
import json, os, sys
with_arg = set('-o -p -i -l -F -E -J -b -c -D -e -L -m -O -Q -R -S -W -w'.split())
args, opts = sys.argv[1:], []
while args and args[0].startswith('-'):
    n = 2 if args[0] in with_arg else 1
    opts += args[:n]
    args = args[n:]
host, command = args[0], ' '.join(args[1:])
with open(os.environ['FAKE_SSH_LOG'], 'a') as f:
    f.write(json.dumps({'opts': opts, 'host': host, 'command': command}) + '\n')
env = {'PATH': os.environ['PATH'], 'HOME': os.environ.get('HOME', '/'),
       'FAKE_SSH_HOST': host}
os.chdir(env['HOME'])
os.execve('/bin/bash', ['bash', '-c', command], env)
'''


def _write_script(path, body):
    with open(path, 'w') as f:
        f.write('#!%s\n%s' % (sys.executable, body))
    os.chmod(path, 0o755)


def pid_alive(pid):
    """True if pid exists and is not a zombie."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            state = f.read().rsplit(')', 1)[1].split()[0]
        return state not in ('Z', 'X')
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def one_line_error(test, result, *needles):
    """Asserts a usage error: exit 2 and one stderr line holding every needle."""
    test.assertEqual(result.returncode, 2, result.stderr)
    lines = result.stderr.strip().splitlines()
    test.assertEqual(len(lines), 1, result.stderr)
    for needle in needles:
        test.assertIn(needle, lines[0])


class FakeJobTest(unittest.TestCase):
    """Base: a temp dir with fake binaries, and helpers to run the launcher."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix='tessera-launch-test-')
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.bin = os.path.join(self.dir, 'bin')
        self.fake_dir = os.path.join(self.dir, 'fake')
        for d in (self.bin, os.path.join(self.fake_dir, 'rec'),
                  os.path.join(self.fake_dir, 'done')):
            os.makedirs(d)
        for name in ('tessera-scheduler', 'tessera-server', 'fake-worker'):
            _write_script(os.path.join(self.bin, name), FAKE_NODE)
        _write_script(os.path.join(self.bin, 'ssh'), FAKE_SSH)
        self.ssh_log = os.path.join(self.dir, 'ssh.log')
        self.worker = os.path.join(self.bin, 'fake-worker')
        self.addCleanup(self._kill_leftovers)

    def _kill_leftovers(self):
        for pid in self.all_pids():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

    def env(self, **extra):
        env = dict(os.environ)
        for name in list(env):
            if name.startswith(('DMLC_', 'PS_', 'TESSERA_')):
                del env[name]
        env['TESSERA_FAKE_DIR'] = self.fake_dir
        env['FAKE_SSH_LOG'] = self.ssh_log
        env.update(extra)
        return env

    def launch(self, args, env=None, cwd=None, daemons=True, script=LAUNCH):
        argv = [sys.executable, script]
        if daemons:
            argv += ['--scheduler-binary', os.path.join(self.bin, 'tessera-scheduler'),
                     '--server-binary', os.path.join(self.bin, 'tessera-server')]
        start = time.monotonic()
        result = subprocess.run(argv + args, env=env or self.env(), cwd=cwd or self.dir,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True, timeout=RUN_TIMEOUT_S)
        result.elapsed = time.monotonic() - start
        return result

    def assert_secured(self, result, ssh_calls=()):
        """Every process of the last job read its own role's key from a 0600 file
        in a 0700 folder; no secret key was on a command line, in an environment
        or in the output; every key file is gone."""
        records = self.records()
        self.assertTrue(records)
        secrets_seen = set()
        for rec in records:
            key = rec.get('key')
            self.assertIsNotNone(key, '%s %d has no key' % (rec['role'], rec['index']))
            self.assertEqual(key['mode'], 0o600, rec['role'])
            self.assertEqual(key['dir_mode'], 0o700, rec['role'])
            lines = dict(line.split(' ', 1) for line in key['text'].splitlines()
                         if not line.startswith('#'))
            self.assertEqual(lines['role'], rec['role'])
            secrets_seen.add(lines['secret-key'])
            self.assertFalse(os.path.exists(key['path']), key['path'])
        self.assertEqual(len(secrets_seen), 3 if any(r['role'] == 'worker' for r in records)
                         else 2)
        for secret in secrets_seen:
            for rec in records:
                self.assertNotIn(secret, ' '.join(rec['argv']))
                self.assertNotIn(secret, json.dumps(rec['env']))
            for call in ssh_calls:
                self.assertNotIn(secret, json.dumps(call))
            self.assertNotIn(secret, result.stdout + result.stderr)

    def records(self):
        out = []
        for path in sorted(glob.glob(os.path.join(self.fake_dir, 'rec', '*.json'))):
            with open(path) as f:
                out.append(json.load(f))
        return out

    def record(self, role, index=0, restart=0):
        found = [r for r in self.records()
                 if (r['role'], r['index'], r['restart']) == (role, index, restart)]
        self.assertEqual(len(found), 1, 'records of %s %d (restart %d): %s'
                         % (role, index, restart, found))
        return found[0]

    def all_pids(self):
        pids = []
        for rec in self.records():
            pids.append(rec['pid'])
            if 'child_pid' in rec:
                pids.append(rec['child_pid'])
        return pids

    def assert_nothing_left(self):
        pids = self.all_pids()
        self.assertTrue(pids)
        deadline = time.monotonic() + 2.0  # init may take a moment to reap orphans
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.05)
        self.assertEqual([p for p in pids if pid_alive(p)], [], 'processes left behind')

    def ssh_calls(self):
        if not os.path.exists(self.ssh_log):
            return []
        with open(self.ssh_log) as f:
            return [json.loads(line) for line in f]

    def hostfile(self, text):
        path = os.path.join(self.dir, 'hosts')
        with open(path, 'w') as f:
            f.write(text)
        return path


# ----------------------------------------------------------------------------
# Units


class SupervisorGraceTest(unittest.TestCase):
    """The grace after which a launcher stops what is still running starts when one
    side of the job (its primaries, or its daemons) has ended, never because a side
    is empty."""

    @staticmethod
    def sleeper(seconds, status=0):
        code = 'import sys, time; time.sleep(%r); sys.exit(%d)' % (seconds, status)
        return lambda restarts: ([sys.executable, '-c', code], dict(os.environ), None)

    def run_job(self, nodes, timeout):
        job = Job(nodes, timeout=timeout, restarts=0, verbose=False)
        start = time.monotonic()
        return job.run(), time.monotonic() - start

    def test_a_launcher_of_primaries_only_waits_for_them_past_the_grace(self):
        # launch.py --add-servers: its added servers are its only nodes. They ran
        # 30 s under TSan in CI and were stopped as "still running 30 s after the
        # scheduler and servers exited" (the adder has neither): exit 1.
        nodes = [Node('added server', i, self.sleeper(1.5), primary=True) for i in (0, 1)]
        status, took = self.run_job(nodes, timeout=0.3)
        self.assertEqual(status, 0)
        self.assertGreaterEqual(took, 1.5)
        self.assertEqual([n.returncode for n in nodes], [0, 0])

    def test_daemons_left_running_after_the_primaries_end_are_stopped(self):
        nodes = [Node('worker', 0, self.sleeper(0.1), primary=True),
                 Node('server', 0, self.sleeper(60))]
        status, took = self.run_job(nodes, timeout=0.5)
        self.assertEqual(status, 1)
        self.assertLess(took, 30)


class StatusSummaryTest(unittest.TestCase):
    """launch.py --status's summary of /debug/pending answers (as a server
    prints them: 64-bit integers are strings)."""

    def test_a_held_dist_ssp_pull_names_the_rank_that_holds_it(self):
        scheduler = {'pid': 10, 'host': 'h', 'nodes': []}
        server = ({'role': 'server', 'rank': 0},
                  {'role': 'server', 'rank': 0, 'id': 8, 'pid': 11,
                   'held_pulls_total': 2,
                   'held_pulls': [
                       {'key': '8', 'offset': '0', 'rank': 1, 'command': 'KV_PULL',
                        'clock': '3', 'staleness': 1, 'held_by': 2,
                        'held_by_pushes': '1', 'steps': '1', 'age_s': 0.25},
                       {'key': '8', 'offset': '0', 'rank': 0, 'command': 'KV_PULL',
                        'clock': '4', 'staleness': 1, 'held_by': 2,
                        'held_by_pushes': '1', 'steps': '2', 'age_s': 1.5}]},
                  None)
        joiner = ({'role': 'worker', 'rank': 2, 'id': 13, 'host': '127.0.0.1',
                   'port': 4000},
                  {'role': 'worker', 'rank': 2, 'id': 13, 'pid': 12}, None)
        lines = summarize(scheduler, [server, joiner])
        self.assertIn("oldest held pull: key 8 on server 0, rank 0's KV_PULL at clock 4, "
                      'held 1.500 s, waits for worker 2 (id 13 at 127.0.0.1:4000) (2 step(s) '
                      'short: 1 of its pushes taken, the bound s = 1 needs 3)', lines)
        self.assertIn('server 0 (id 8, pid 11): 2 dist_ssp pull(s) held by the bound', lines)


class HostfileTest(unittest.TestCase):
    def test_all_line_forms(self):
        text = ('# cluster\n\n'
                'alpha\n'
                'beta:2222\n'
                '  gamma slots=4   # four GPUs\n'
                'delta:23 slots=2\n'
                'root@10.0.0.5\n'
                '[fe80::1%eth0]:2200\n'
                '[::1]\n'
                'fd00::7\n')
        H = Host
        self.assertEqual(parse_hostfile_text(text), [
            H('alpha'), H('beta', 2222), H('gamma', None, 4), H('delta', 23, 2),
            H('root@10.0.0.5'), H('fe80::1%eth0', 2200), H('::1'), H('fd00::7')])
        self.assertEqual(H('root@10.0.0.5').address, '10.0.0.5')

    def test_bad_lines_name_the_line(self):
        cases = {
            'a slots=0': 'slots=0',
            'a slots=x': 'slots=x',
            'a slots=1 slots=2': "expected 'host'",
            'a b': "expected 'host'",
            'a:99999': 'port',
            'a:ssh': 'port',
            'a:': 'port',
            '-oProxyCommand=x': 'not a host name',
            'a/b': 'not a host name',
            '[::1': "expected 'host'",
        }
        for line, needle in cases.items():
            with self.subTest(line=line):
                with self.assertRaises(UsageError) as cm:
                    parse_hostfile_text('ok\n# c\n' + line + '\n', 'hostfile h')
                message = str(cm.exception)
                self.assertIn('hostfile h line 3', message)
                self.assertIn(needle, message)
                self.assertNotIn('\n', message)

    def test_empty_hostfile(self):
        with self.assertRaisesRegex(UsageError, 'no hosts'):
            parse_hostfile_text('# nothing\n\n')


class PlacementTest(unittest.TestCase):
    def names(self, hosts):
        return [h.name for h in hosts]

    def test_round_robin_without_slots(self):
        hosts = [Host('a'), Host('b')]
        servers, workers = place(hosts, 2, 3)
        self.assertEqual(self.names(servers), ['a', 'b'])
        self.assertEqual(self.names(workers), ['a', 'b', 'a'])

    def test_fills_slots_in_order_then_wraps(self):
        hosts = [Host('a', slots=2), Host('b'), Host('c', slots=3)]
        servers, workers = place(hosts, 2, 6)
        self.assertEqual(self.names(servers), ['a', 'a'])
        self.assertEqual(self.names(workers), ['b', 'c', 'c', 'c', 'a', 'a'])

    def test_no_servers(self):
        servers, workers = place([Host('a')], 0, 2)
        self.assertEqual((servers, self.names(workers)), ([], ['a', 'a']))

    def test_distinct_hosts(self):
        hosts = [Host('a', slots=2), Host('b'), Host('a'),
                 Host('a', 2200)]
        self.assertEqual([h.key for h in distinct_hosts(hosts)],
                         [('a', None), ('b', None), ('a', 2200)])


class SlurmTest(unittest.TestCase):
    """The slurm launcher's parts that need no Slurm (slurm_test runs it on one)."""

    def test_tasks_per_node(self):
        self.assertEqual(parse_tasks_per_node('2(x3),1'), [2, 2, 2, 1])
        self.assertEqual(parse_tasks_per_node('4'), [4])
        self.assertEqual(parse_tasks_per_node('1(x2)'), [1, 1])
        for bad in ('', 'x', '2(x)', '0', '2,,1'):
            self.assertIsNone(parse_tasks_per_node(bad), bad)

    def test_outside_an_allocation_names_the_variable(self):
        with self.assertRaisesRegex(UsageError, 'SLURM_JOB_ID is not set.*salloc'):
            slurm_hosts({'PATH': '/bin'})
        with self.assertRaisesRegex(UsageError, 'SLURM_JOB_NODELIST is not set'):
            slurm_hosts({'SLURM_JOB_ID': '7'})

    def test_flags_that_do_not_apply(self):
        with self.assertRaisesRegex(UsageError, '-H/--hostfile.*launcher slurm'):
            parse_args(['-n', '1', '--launcher', 'slurm', '-H', 'h', 'w'])
        with self.assertRaisesRegex(UsageError, '--sync-dst-dir.*launcher slurm'):
            parse_args(['-n', '1', '--launcher', 'slurm', '--sync-dst-dir', '/d', 'w'])

    def test_one_step_per_process_with_its_key_on_stdin(self):
        args = parse_args(['-n', '2', '-s', '1', '--launcher', 'slurm',
                                  '--server-args', '--x 1', '/w', '--epochs', '1'])
        hosts = [Host('n1', slots=2), Host('n2', slots=2)]
        environ = {'PATH': '/bin', 'SLURM_JOB_ID': '7', 'DMLC_NODE_HOST': 'login1',
                   'TESSERA_X': 'y'}
        cfg = build_config(args, environ, 'slurm', '10.0.0.1', remote=True)
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        prepare_keys(cfg, args, hosts, tmp)
        nodes = slurm_nodes(cfg, args, hosts, '/b/sched', '/b/server', environ)
        self.assertEqual([(n.name, n.host.name) for n in nodes],
                         [('scheduler', 'n1'), ('server 0', 'n1'), ('worker 0', 'n1'),
                          ('worker 1', 'n2')])
        secrets = [line.split()[1] for text in cfg.key_text.values()
                   for line in text.splitlines() if line.startswith('secret-key ')]
        self.assertEqual(len(secrets), 3)
        for node in nodes:
            argv, env, _ = node.spawn(0)
            self.assertEqual(argv[:6], ['srun', '--nodes=1', '--ntasks=1',
                                        '--ntasks-per-node=1', '--nodelist=%s' % node.host.name,
                                        '--overlap'])
            self.assertIn('--export=ALL', argv)
            self.assertIn(KEY_FROM_STDIN, argv)
            role = node.role
            self.assertEqual(env['DMLC_ROLE'], role)
            self.assertEqual(env['DMLC_PS_ROOT_URI'], '10.0.0.1')
            self.assertEqual(env['DMLC_JOB_CLUSTER'], 'slurm')
            self.assertEqual(env['TESSERA_X'], 'y')
            self.assertNotIn('DMLC_NODE_HOST', env)  # the login node's, not the nodes'
            self.assertNotIn('TESSERA_KEY_FILE', env)
            self.assertIn(('secret-key %s' % [l.split()[1] for l in
                                              cfg.key_text[role].splitlines()
                                              if l.startswith('secret-key ')][0]).encode(),
                          node.stdin_data)
            self.assertTrue(node.stdin_data.endswith(
                (KEY_END_MARKER + '\n').encode()))
            for secret in secrets:
                self.assertFalse(any(secret in a for a in argv), 'a key on the command line')
                self.assertFalse(any(secret in v for v in env.values()),
                                 'a key in the environment')
        self.assertEqual(nodes[1].spawn(0)[0][-3:], ['/b/server', '--x', '1'])
        self.assertEqual(nodes[3].spawn(0)[0][-3:], ['/w', '--epochs', '1'])
        self.assertEqual(nodes[3].spawn(0)[1]['DMLC_TASK_ID'], '2')
        self.assertEqual(describe_status(255, True, 'srun'), 'exited with status 255')


class EnvTest(unittest.TestCase):
    ENVIRON = {
        'PATH': '/bin', 'HOME': '/root', 'LD_LIBRARY_PATH': '/opt/lib',
        'PS_VERBOSE': '1', 'PS_HEARTBEAT_INTERVAL': '2', 'PS_HEARTBEAT_TIMEOUT': '10',
        'TESSERA_LOG': 'debug', 'TESSERA_SSH_OPTS': '-i k', 'TESSERA_RESTART_COUNT': '7',
        'DMLC_INTERFACE': 'eth1', 'DMLC_NODE_HOST': '10.1.1.1', 'OMP_NUM_THREADS': '4',
    }

    def config(self, remote, interface=None, env_all=None, env_server=None,
               env_worker=None):
        return JobConfig('ssh' if remote else 'local', '10.0.0.1', 9100, 2, 3,
                                forwarded_env(self.ENVIRON, remote, interface),
                                env_all or {}, env_server or {}, env_worker or {})

    def test_forwarded_variables(self):
        local = forwarded_env(self.ENVIRON, remote=False)
        remote = forwarded_env(self.ENVIRON, remote=True)
        for name in ('LD_LIBRARY_PATH', 'PS_VERBOSE', 'PS_HEARTBEAT_INTERVAL',
                     'PS_HEARTBEAT_TIMEOUT', 'TESSERA_LOG', 'DMLC_INTERFACE'):
            self.assertEqual(remote[name], self.ENVIRON[name], name)
        self.assertEqual(local['DMLC_NODE_HOST'], '10.1.1.1')
        self.assertNotIn('DMLC_NODE_HOST', remote)
        for name in ('PATH', 'HOME', 'TESSERA_SSH_OPTS', 'TESSERA_RESTART_COUNT',
                     'OMP_NUM_THREADS'):
            self.assertNotIn(name, remote)
        self.assertEqual(forwarded_env(self.ENVIRON, True, 'ib0')['DMLC_INTERFACE'],
                         'ib0')

    def test_node_env(self):
        cfg = self.config(True, env_all={'OMP_NUM_THREADS': '2', 'PS_VERBOSE': '2'},
                          env_worker={'OMP_NUM_THREADS': '8'}, env_server={'S': '1'})
        worker = node_env(cfg, 'worker', task_id=3, restart_count=1)
        self.assertEqual(worker['DMLC_ROLE'], 'worker')
        self.assertEqual(worker['DMLC_PS_ROOT_URI'], '10.0.0.1')
        self.assertEqual(worker['DMLC_PS_ROOT_PORT'], '9100')
        self.assertEqual(worker['DMLC_NUM_SERVER'], '2')
        self.assertEqual(worker['DMLC_NUM_WORKER'], '3')
        self.assertEqual(worker['DMLC_TASK_ID'], '3')
        self.assertEqual(worker['TESSERA_RESTART_COUNT'], '1')
        self.assertEqual(worker['OMP_NUM_THREADS'], '8')  # --env-worker beats --env
        self.assertEqual(worker['PS_VERBOSE'], '2')  # --env beats forwarded
        self.assertNotIn('S', worker)
        server = node_env(cfg, 'server', task_id=0)
        self.assertEqual((server['S'], server['OMP_NUM_THREADS']), ('1', '2'))
        self.assertEqual(server['TESSERA_RESTART_COUNT'], '0')
        self.assertNotIn('PORT', server)  # no --restarts: any port
        scheduler = node_env(cfg, 'scheduler')
        self.assertEqual(scheduler['DMLC_ROLE'], 'scheduler')
        self.assertNotIn('DMLC_TASK_ID', scheduler)

    def test_every_job_gets_a_fresh_job_id_unless_one_is_set(self):
        args = parse_args(['-n', '2', '-s', '1', '/bin/true'])
        env = dict(self.ENVIRON)
        env.pop('TESSERA_JOB_ID', None)
        env.pop('TESSERA_KEY_DIR', None)
        one = build_config(args, env, 'local', '127.0.0.1', remote=False)
        two = build_config(args, env, 'local', '127.0.0.1', remote=False)
        ids = [node_env(one, role, task_id=t)['TESSERA_JOB_ID']
               for role, t in (('scheduler', None), ('server', 0), ('worker', 1))]
        self.assertEqual(len(set(ids)), 1)
        self.assertRegex(ids[0], r'^launch-[0-9a-f]{16}$')
        self.assertNotEqual(node_env(two, 'worker', task_id=1)['TESSERA_JOB_ID'], ids[0])
        env['TESSERA_JOB_ID'] = 'mine'
        kept = build_config(args, env, 'local', '127.0.0.1', remote=False)
        self.assertEqual(node_env(kept, 'server', task_id=0)['TESSERA_JOB_ID'], 'mine')
        given = build_config(parse_args(['--env', 'TESSERA_JOB_ID:x', '-n', '1', '/bin/true']),
                             self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual(node_env(given, 'worker', task_id=1)['TESSERA_JOB_ID'], 'x')
        # The user's keys: the user's id, or none (a worker started by hand with
        # those keys may join the job).
        env['TESSERA_KEY_DIR'] = '/keys'
        del env['TESSERA_JOB_ID']
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            users = build_config(args, env, 'local', '127.0.0.1', remote=False)
        self.assertNotIn('TESSERA_JOB_ID', node_env(users, 'worker', task_id=1))
        # ... and a warning saying so, naming the folder; none with an id.
        self.assertIn('launch.py: warning: TESSERA_KEY_DIR is set and TESSERA_JOB_ID '
                      'is not: another job started with the keys of /keys', err.getvalue())
        env['TESSERA_JOB_ID'] = 'mine'
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            build_config(args, env, 'local', '127.0.0.1', remote=False)
        self.assertEqual(err.getvalue(), '')

    def test_restarts_give_each_server_and_worker_a_fixed_port(self):
        args = parse_args(['-n', '2', '-s', '3', '--restarts', '1', '/bin/true'])
        cfg = build_config(args, self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual(len(cfg.node_ports), 5)
        self.assertEqual(len(set(cfg.node_ports + [cfg.port])), 6)
        for task_id in range(5):
            role = 'server' if task_id < 3 else 'worker'
            first = node_env(cfg, role, task_id=task_id, restart_count=0)
            again = node_env(cfg, role, task_id=task_id, restart_count=1)
            self.assertEqual(first['PORT'], str(cfg.node_ports[task_id]))
            self.assertEqual(again['PORT'], first['PORT'])
        self.assertNotIn('PORT', node_env(cfg, 'scheduler'))
        plain = build_config(parse_args(['-n', '2', '-s', '3', '/bin/true']),
                                    self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertIsNone(plain.node_ports)

    def test_replicas_reach_every_process_and_the_supervisor(self):
        args = parse_args(['-n', '2', '-s', '3', '--replicas', '2', '/bin/true'])
        cfg = build_config(args, self.ENVIRON, 'local', '127.0.0.1', remote=False)
        for role, task_id in (('scheduler', None), ('server', 1), ('worker', 3)):
            self.assertEqual(node_env(cfg, role, task_id=task_id)['TESSERA_REPLICAS'], '2')
        self.assertEqual(replicas_of(cfg), 2)
        # Set in the launcher's environment or with --env-server, the supervisor
        # reads the same value; unset it is 1.
        plain = parse_args(['-n', '2', '-s', '3', '--env-server', 'TESSERA_REPLICAS:3',
                            '/bin/true'])
        self.assertEqual(replicas_of(build_config(plain, self.ENVIRON, 'local', '127.0.0.1',
                                                  remote=False)), 3)
        none = build_config(parse_args(['-n', '2', '/bin/true']), self.ENVIRON, 'local',
                            '127.0.0.1', remote=False)
        self.assertEqual(replicas_of(none), 1)
        self.assertNotIn('TESSERA_REPLICAS', node_env(none, 'server', task_id=0))

    def test_spare_servers_get_their_own_keys_ports_and_tessera_spare(self):
        args = parse_args(['-n', '2', '-s', '3', '--replicas', '2', '--spare-servers', '2',
                           '--metrics-port', '9100', '--restarts', '1', '/bin/true'])
        cfg = build_config(args, self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual(cfg.spare_servers, 2)
        self.assertEqual(len(cfg.node_ports), 7)  # 3 servers, 2 workers, 2 spares
        cfg.node_key_env = dict(((r, i), {'TESSERA_KEY_FILE': '%s-%d.key' % (r, i)})
                                for r, n in (('server', 5), ('worker', 2)) for i in range(n))
        for j in range(2):
            env = node_env(cfg, 'spare', task_id=5 + j)
            self.assertEqual(env['DMLC_ROLE'], 'server')
            self.assertEqual(env['TESSERA_SPARE'], '1')
            self.assertEqual(env['DMLC_TASK_ID'], str(5 + j))
            self.assertEqual(env['TESSERA_METRICS_PORT'], str(9106 + j))
            self.assertEqual(env['TESSERA_KEY_FILE'], 'server-%d.key' % (3 + j))
            self.assertEqual(env['PORT'], str(cfg.node_ports[5 + j]))
        self.assertNotIn('TESSERA_SPARE', node_env(cfg, 'server', task_id=0))
        for argv, message in (
                (['-s', '3', '--spare-servers', '1'], '--spare-servers 1: needs --replicas R >= 2'),
                (['-s', '3', '--replicas', '1', '--spare-servers', '1'], 'needs --replicas'),
                (['-s', '3', '--spare-servers', '-1'], '--spare-servers'),
                (['-s', '3', '--replicas', '2', '--spare-servers', '1', '--launcher', 'ssh',
                  '-H', '/dev/null'], 'only with --launcher local')):
            with self.assertRaisesRegex(UsageError, message):
                parse_args(['-n', '1'] + argv + ['/bin/true'])

    def test_elastic_sets_tessera_elastic_for_every_node_and_checks_its_bounds(self):
        args = parse_args(['-n', '4', '-s', '1', '--elastic', '2:4', '/bin/true'])
        cfg = build_config(args, self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual(elastic_of(cfg), '2:4')
        for role, task_id in (('scheduler', None), ('server', 0), ('worker', 1)):
            self.assertEqual(node_env(cfg, role, task_id=task_id)['TESSERA_ELASTIC'], '2:4')
        plain = build_config(parse_args(['-n', '2', '/bin/true']), self.ENVIRON, 'local',
                             '127.0.0.1', remote=False)
        self.assertEqual(elastic_of(plain), '')
        self.assertNotIn('TESSERA_ELASTIC', node_env(plain, 'worker', task_id=1))
        self.assertEqual(parse_args(['-n', '4', '--elastic', '1:9', '/bin/true']).elastic, '1:9')
        for bounds in ('0:4', '5:6', '2:3', '2', 'a:b', '2:4:6'):
            with self.assertRaisesRegex(UsageError, r"--elastic '%s': expected MIN:MAX with "
                                        r'1 <= MIN <= -n \(4\) <= MAX' % bounds):
                parse_args(['-n', '4', '--elastic', bounds, '/bin/true'])

    def test_elastic_job_file_gives_added_workers_the_jobs_variables_and_own_keys(self):
        # launch.py --elastic 2:3 makes 2 + 3 worker keys; its job file holds the
        # workers' variables (nothing per process) and the 3 joiner keys; each
        # added worker claims one never claimed before, and a fourth finds none.
        args = parse_args(['-n', '2', '-s', '1', '--elastic', '2:3', '--metrics-port', '9100',
                           '--env-worker', 'A:1', '/bin/true'])
        cfg = build_config(args, self.ENVIRON, 'local', '127.0.0.1', remote=False)
        with tempfile.TemporaryDirectory() as tmp:
            prepare_keys(cfg, args, None, tmp)
            self.assertEqual(joiner_keys(cfg), 3)
            path = write_job_file(tmp, cfg)
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
            env, keys = read_job_file(path)
            self.assertEqual(env['DMLC_ROLE'], 'worker')
            self.assertEqual(env['DMLC_PS_ROOT_PORT'], str(cfg.port))
            self.assertEqual(env['DMLC_NUM_WORKER'], '2')
            self.assertEqual(env['TESSERA_ELASTIC'], '2:3')
            self.assertEqual(env['A'], '1')
            for name in ('TESSERA_METRICS_PORT', 'DMLC_TASK_ID', 'TESSERA_RESTART_COUNT'):
                self.assertNotIn(name, env)
            self.assertEqual(keys, [os.path.join(tmp, 'worker-%d.key' % i) for i in (2, 3, 4)])
            added = parse_args(['--add-workers', '2', '--join', path, '--env', 'B:2',
                                '/bin/true', 'x'])
            nodes = added_worker_nodes(added, {'PATH': '/bin'})
            self.assertEqual([n.name for n in nodes], ['added worker 0', 'added worker 1'])
            argv, first, _ = nodes[0].spawn(0)
            _, second, _ = nodes[1].spawn(0)
            self.assertEqual(argv, ['/bin/true', 'x'])
            self.assertEqual((first['B'], first['TESSERA_ELASTIC']), ('2', '2:3'))
            self.assertEqual([first['TESSERA_KEY_FILE'], second['TESSERA_KEY_FILE']], keys[:2])
            self.assertEqual(added_worker_nodes(
                parse_args(['--add-workers', '1', '--join', path, '/bin/true']),
                {})[0].spawn(0)[1]['TESSERA_KEY_FILE'], keys[2])
            with self.assertRaisesRegex(UsageError, r'every worker key the job made for '
                                        r'joiners \(3: MAX of --elastic MIN:MAX, at most '
                                        r'256\) is taken'):
                added_worker_nodes(parse_args(['--add-workers', '1', '--join', path,
                                               '/bin/true']), {})
            other = os.path.join(tmp, 'other.json')
            with open(other, 'w') as f:
                f.write('{"worker_env": {}}')
            os.chmod(other, 0o600)
            with self.assertRaisesRegex(UsageError, r'not a job file of an elastic job'):
                read_job_file(other)
            link = os.path.join(tmp, 'link.json')
            os.symlink(path, link)  # read through one descriptor: no link followed
            with self.assertRaisesRegex(UsageError, r'--join %s: cannot read the job file'
                                        % re.escape(link)):
                read_job_file(link)
            os.chmod(path, 0o620)  # others may write it: its variables are not trusted
            with self.assertRaisesRegex(UsageError, r'not trusted: a job file must be your '
                                        r'own and writable by you only'):
                read_job_file(path)
        for argv, message in (
                (['--add-workers', '1', '/bin/true'], 'go together'),
                (['--join', 'f', '/bin/true'], 'go together'),
                (['--add-workers', '1', '--join', 'f'], 'missing COMMAND'),
                (['--add-workers', '1', '--join', 'f', '-n', '2', '/bin/true'],
                 '-n: not with --add-workers'),
                (['--add-workers', '1', '--join', 'f', '--launcher', 'ssh', '/bin/true'],
                 r'--add-workers --launcher ssh: expected -H/--hostfile HOSTFILE'),
                (['--add-workers', '1', '--join', 'f', '--launcher', 'mpi', '/bin/true'],
                 r'--add-workers: with --launcher local \(on this host\), ssh \(on the hosts '
                 r'of -H\) or slurm \(on the Slurm job\'s nodes\), not mpi'),
                (['--add-workers', '1', '--join', 'f', '--launcher', 'slurm', '-H', 'h',
                  '/bin/true'], r'-H/--hostfile: only with --launcher ssh'),
                (['--add-workers', '1', '--join', 'f', '-H', 'h', '/bin/true'],
                 r'-H/--hostfile: only with --launcher ssh')):
            with self.assertRaisesRegex(UsageError, message):
                parse_args(argv)

    def test_max_servers_job_file_gives_added_servers_the_servers_variables_and_keys(self):
        # --max-servers 4 with -s 2 --replicas 2: TESSERA_MAX_SERVERS for every
        # process, 2 + 4 server keys (one per rank for joiners); the job file holds
        # the server program, the servers' variables with TESSERA_SPARE=1 and the 4
        # joiner keys, each claimed once by an added server.
        args = parse_args(['-n', '2', '-s', '2', '--replicas', '2', '--max-servers', '4',
                           '--env-server', 'S:1', '/bin/true'])
        cfg = build_config(args, self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual(max_servers_of(cfg), 4)
        for role, task_id in (('scheduler', None), ('server', 1), ('worker', 3)):
            self.assertEqual(node_env(cfg, role, task_id=task_id)['TESSERA_MAX_SERVERS'], '4')
        with tempfile.TemporaryDirectory() as tmp:
            prepare_keys(cfg, args, None, tmp)
            self.assertEqual(server_joiner_keys(cfg), 4)
            path = write_job_file(tmp, cfg, ['/x/tessera-server', '--flag'])
            argv, env, keys = read_server_job_file(path)
            self.assertEqual(argv, ['/x/tessera-server', '--flag'])
            self.assertEqual((env['DMLC_ROLE'], env['TESSERA_SPARE'], env['DMLC_NUM_SERVER'],
                              env['TESSERA_MAX_SERVERS'], env['S']),
                             ('server', '1', '2', '4', '1'))
            for name in ('TESSERA_METRICS_PORT', 'DMLC_TASK_ID', 'TESSERA_RESTART_COUNT'):
                self.assertNotIn(name, env)
            self.assertEqual(keys, [os.path.join(tmp, 'server-%d.key' % i) for i in range(2, 6)])
            nodes = added_server_nodes(parse_args(['--add-servers', '3', '--join', path,
                                                   '--env', 'B:2', '--metrics-port', '9300']),
                                       {'PATH': '/bin'})
            self.assertEqual([n.name for n in nodes],
                             ['added server 0', 'added server 1', 'added server 2'])
            spawned = [n.spawn(0) for n in nodes]
            self.assertEqual(spawned[0][0], ['/x/tessera-server', '--flag'])
            self.assertEqual([e['TESSERA_KEY_FILE'] for _, e, _ in spawned], keys[:3])
            self.assertEqual([e['TESSERA_METRICS_PORT'] for _, e, _ in spawned],
                             ['9300', '9301', '9302'])
            self.assertEqual(spawned[1][1]['B'], '2')
            added_server_nodes(parse_args(['--add-servers', '1', '--join', path]), {})
            with self.assertRaisesRegex(UsageError, r'every server key the job made for '
                                        r'joiners \(4: one per server rank, at most 256\) '
                                        r'is taken'):
                added_server_nodes(parse_args(['--add-servers', '1', '--join', path]), {})
            # An unreplicated job's file has nothing for servers.
            plain = build_config(parse_args(['-n', '2', '--elastic', '2:3', '/bin/true']),
                                 self.ENVIRON, 'local', '127.0.0.1', remote=False)
            self.assertEqual(server_joiner_keys(plain), 0)
            os.mkdir(os.path.join(tmp, 'plain'))
            other = write_job_file(os.path.join(tmp, 'plain'), plain, ['/x/tessera-server'])
            with self.assertRaisesRegex(UsageError, r'not a job file of a job servers may join'):
                read_server_job_file(other)
        for argv, message in (
                (['-s', '3', '--max-servers', '2'],
                 r'--max-servers 2: expected -s \(3\) <= M <= 256 \(one copy of each slice\)$'),
                (['-s', '3', '--max-servers', '257'], r'expected -s \(3\) <= M <= 256'),
                (['-s', '2', '--replicas', '2', '--max-servers', '5'],
                 r'--max-servers 5: expected -s \(2\) <= M <= -s x --replicas \(4\)'),
                (['-s', '3', '--replicas', '2', '--max-servers', '2'], 'expected -s'),
                (['--add-servers', '1', '/bin/true'], 'go together'),
                (['--add-servers', '1', '--join', 'f', '/bin/true'], 'no COMMAND'),
                (['--add-servers', '1', '--join', 'f', '-s', '2'],
                 '-s: not with --add-servers'),
                (['--add-servers', '1', '--add-workers', '1', '--join', 'f'], 'one at a time'),
                (['--add-servers', '1', '--join', 'f', '--launcher', 'ssh'],
                 r'--add-servers --launcher ssh: expected -H/--hostfile HOSTFILE'),
                (['--add-servers', '1', '--join', 'f', '--launcher', 'ssh', '-H', 'h',
                  '--sync-dst-dir', '/d'], r'--sync-dst-dir: not with --add-servers')):
            with self.assertRaisesRegex(UsageError, message):
                parse_args((['-n', '1'] if argv[0] == '-s' else []) + argv
                           + (['/bin/true'] if argv[0] == '-s' else []))

    def local_elastic_job_file(self, tmp):
        """The job file of an elastic job of the local launcher, in tmp/local."""
        os.mkdir(os.path.join(tmp, 'local'))
        cfg = build_config(parse_args(['-n', '2', '--elastic', '2:3', '/bin/true']),
                           self.ENVIRON, 'local', '127.0.0.1', remote=False)
        return write_job_file(os.path.join(tmp, 'local'), cfg)

    def test_ssh_job_file_starts_added_processes_on_the_hosts_with_keys_on_stdin(self):
        # An elastic, replicated ssh job's file says where its processes run on the
        # hosts; launch.py --add-workers/--add-servers --launcher ssh -H starts the
        # joiners there over ssh, round-robin over the hostfile, each with a joiner
        # key of its own on the channel's stdin (never a local path in its
        # variables). A job of the local launcher cannot take joiners from other
        # hosts, and an ssh job's file needs --launcher ssh.
        with tempfile.TemporaryDirectory() as tmp:
            hostfile = os.path.join(tmp, 'hosts')
            with open(hostfile, 'w') as f:
                f.write('hostA\nhostB:2222\n')
            args = parse_args(['-n', '2', '-s', '2', '--launcher', 'ssh', '-H', hostfile,
                               '--elastic', '2:3', '--replicas', '2', '--max-servers', '3',
                               '/bin/true'])
            cfg = build_config(args, self.ENVIRON, 'ssh', '10.0.0.1', remote=True)
            hosts = parse_hostfile(hostfile)
            prepare_keys(cfg, args, hosts, tmp)
            path = write_job_file(tmp, cfg, ['/x/tessera-server'], workdir='/w')
            env, keys = read_job_file(path)
            self.assertEqual(env['DMLC_PS_ROOT_URI'], '10.0.0.1')
            self.assertNotIn('TESSERA_KEY_FILE', env)
            self.assertEqual(keys, [os.path.join(tmp, 'worker-%d.key' % i) for i in (2, 3, 4)])
            workers = added_worker_nodes(
                parse_args(['--add-workers', '2', '--join', path, '--launcher', 'ssh', '-H',
                            hostfile, 'run.sh', 'x']), {'PATH': '/bin'})
            self.assertEqual([(n.name, n.host.name, n.remote) for n in workers],
                             [('added worker 0', 'hostA', True),
                              ('added worker 1', 'hostB', True)])
            argv, local_env, _ = workers[1].spawn(0)
            self.assertEqual(argv[:2], ['ssh', '-o'])
            self.assertEqual(argv[argv.index('-p') + 1], '2222')
            self.assertEqual(argv[-2], 'hostB')
            self.assertIn('cd /w && exec bash -c', argv[-1])
            self.assertIn('--tessera-key-from-stdin', argv[-1])
            self.assertIn('DMLC_ROLE=worker', argv[-1])
            self.assertTrue(argv[-1].endswith(' run.sh x'), argv[-1])
            self.assertNotIn('TESSERA_KEY_FILE=', argv[-1].split('tessera-launch ', 1)[1])
            self.assertEqual(local_env, {'PATH': '/bin'})
            with open(keys[1]) as f:
                self.assertEqual(workers[1].stdin_data, key_stdin(f.read()))
            servers = added_server_nodes(
                parse_args(['--add-servers', '1', '--join', path, '--launcher', 'ssh', '-H',
                            hostfile]), {})
            argv, _, _ = servers[0].spawn(0)
            self.assertIn('TESSERA_SPARE=1', argv[-1])
            self.assertTrue(argv[-1].endswith(' /x/tessera-server'), argv[-1])
            self.assertIsNotNone(servers[0].stdin_data)
            with self.assertRaisesRegex(UsageError, r'the job runs on other hosts '
                                        r'\(--launcher ssh\); add processes there with '
                                        r'--launcher ssh -H HOSTFILE'):
                added_worker_nodes(parse_args(['--add-workers', '1', '--join', path,
                                               '/bin/true']), {})
            local = self.local_elastic_job_file(tmp)
            with self.assertRaisesRegex(UsageError, r'the job was started by the local '
                                        r'launcher, whose scheduler listens on 127.0.0.1 '
                                        r'only'):
                added_worker_nodes(parse_args(['--add-workers', '1', '--join', local,
                                               '--launcher', 'ssh', '-H', hostfile,
                                               '/bin/true']), {})

    def test_slurm_job_file_starts_added_processes_as_steps_of_its_allocation(self):
        # An elastic Slurm job's file names its allocation, its nodes and its folder;
        # launch.py --add-workers/--add-servers --launcher slurm starts each joiner as
        # a step of that allocation (srun --jobid, --overlap) on its nodes,
        # round-robin, in that folder, its joiner key on the step's stdin. A Slurm
        # job's file needs --launcher slurm, and --launcher slurm a Slurm job's file.
        with tempfile.TemporaryDirectory() as tmp:
            args = parse_args(['-n', '2', '-s', '2', '--launcher', 'slurm', '--elastic',
                               '2:3', '--max-servers', '3', '/bin/true'])
            cfg = build_config(args, self.ENVIRON, 'slurm', '10.0.0.1', remote=True)
            prepare_keys(cfg, args, [], tmp)
            path = write_job_file(tmp, cfg, ['/x/tessera-server'], workdir='/w',
                                  slurm=('4711', ['n1', 'n2']))
            workers = added_worker_nodes(
                parse_args(['--add-workers', '3', '--join', path, '--launcher', 'slurm',
                            'run.sh', 'x']), {'PATH': '/bin', 'DMLC_NODE_HOST': 'login'})
            self.assertEqual([(n.name, n.host.name, n.remote, n.transport) for n in workers],
                             [('added worker 0', 'n1', True, 'srun'),
                              ('added worker 1', 'n2', True, 'srun'),
                              ('added worker 2', 'n1', True, 'srun')])
            argv, env, _ = workers[1].spawn(0)
            self.assertEqual(argv[0], 'srun')
            for flag in ('--nodelist=n2', '--overlap', '--jobid=4711', '--chdir=/w',
                         '--job-name=tessera-added-worker-1'):
                self.assertIn(flag, argv)
            self.assertEqual(argv[-3:-2], ['--tessera-key-from-stdin'])
            self.assertEqual(argv[-2:], ['run.sh', 'x'])
            self.assertEqual(env['DMLC_ROLE'], 'worker')
            self.assertEqual(env['DMLC_PS_ROOT_URI'], '10.0.0.1')
            self.assertEqual(env['PATH'], '/bin')
            self.assertNotIn('DMLC_NODE_HOST', env)  # the login node's, not a node's
            self.assertNotIn('TESSERA_KEY_FILE', env)
            with open(os.path.join(tmp, 'worker-3.key')) as f:
                self.assertEqual(workers[1].stdin_data, key_stdin(f.read()))
            servers = added_server_nodes(
                parse_args(['--add-servers', '1', '--join', path, '--launcher', 'slurm']), {})
            argv, env, _ = servers[0].spawn(0)
            self.assertEqual(argv[-1], '/x/tessera-server')
            self.assertEqual(env['TESSERA_SPARE'], '1')
            self.assertEqual(env['TESSERA_MAX_SERVERS'], '3')
            with self.assertRaisesRegex(UsageError, r'the job was started by the slurm '
                                        r'launcher; add processes with --launcher slurm'):
                added_worker_nodes(parse_args(['--add-workers', '1', '--join', path,
                                               '/bin/true']), {})
            local = self.local_elastic_job_file(tmp)
            with self.assertRaisesRegex(UsageError, r'the job was started by the local '
                                        r'launcher; add processes with --launcher local'):
                added_worker_nodes(parse_args(['--add-workers', '1', '--join', local,
                                               '--launcher', 'slurm', '/bin/true']), {})

    def test_metrics_port_gives_each_process_base_plus_its_index(self):
        args = parse_args(['-n', '2', '-s', '3', '--metrics-port', '9100', '/bin/true'])
        cfg = build_config(args, self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual(node_env(cfg, 'scheduler')['TESSERA_METRICS_PORT'], '9100')
        for task_id in range(5):
            role = 'server' if task_id < 3 else 'worker'
            env = node_env(cfg, role, task_id=task_id, restart_count=task_id % 2)
            self.assertEqual(env['TESSERA_METRICS_PORT'], str(9101 + task_id))
        plain = build_config(parse_args(['-n', '2', '/bin/true']),
                                    self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertNotIn('TESSERA_METRICS_PORT', node_env(plain, 'worker', task_id=2))
        nodes = [Node('scheduler', None, None)] + \
            [Node('server', i, None) for i in range(3)] + \
            [Node('worker', i, None) for i in range(2)]
        self.assertEqual(metrics_urls(cfg, nodes), [
            ('scheduler', 'http://127.0.0.1:9100/metrics'),
            ('server 0', 'http://127.0.0.1:9101/metrics'),
            ('server 1', 'http://127.0.0.1:9102/metrics'),
            ('server 2', 'http://127.0.0.1:9103/metrics'),
            ('worker 0', 'http://127.0.0.1:9104/metrics'),
            ('worker 1', 'http://127.0.0.1:9105/metrics')])

    def test_processes_are_named_by_the_ranks_the_scheduler_gives_them(self):
        # The scheduler ranks each role in start order (DMLC_TASK_ID): launch.py's
        # worker i is rank i whatever its address, and so named. With --max-servers
        # M above -s S the servers take ranks spread over the M, i x M / S
        # (scheduler.cc, FormJob), and are named by them in every launcher, their
        # DMLC_TASK_ID and metrics port still by start order.
        plain = build_config(parse_args(['-n', '2', '-s', '3', '/bin/true']),
                             self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual([server_rank(plain, i) for i in range(3)], [0, 1, 2])
        args = parse_args(['-n', '2', '-s', '2', '--replicas', '2', '--max-servers', '4',
                           '--spare-servers', '1', '--metrics-port', '9100', '/bin/true'])
        cfg = build_config(args, self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual([server_rank(cfg, i) for i in range(2)], [0, 2])
        nodes = local_nodes(cfg, args, '/b/sched', '/b/server', self.ENVIRON)
        self.assertEqual([n.name for n in nodes],
                         ['scheduler', 'server 0', 'server 2', 'worker 0', 'worker 1',
                          'spare 0'])
        self.assertEqual([n.spawn(0)[1].get('DMLC_TASK_ID') for n in nodes],
                         [None, '0', '1', '2', '3', '4'])
        self.assertEqual(nodes[2].prefix, b'[server 2] ')
        self.assertEqual([name for name, _ in metrics_urls(cfg, nodes)],
                         [n.name for n in nodes])
        self.assertEqual(metrics_urls(cfg, nodes)[2],
                         ('server 2', 'http://127.0.0.1:9102/metrics'))
        three = build_config(parse_args(['-n', '1', '-s', '3', '--max-servers', '8',
                                         '/bin/true']),
                             self.ENVIRON, 'local', '127.0.0.1', remote=False)
        self.assertEqual([server_rank(three, i) for i in range(3)], [0, 2, 5])
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        slurm_args = parse_args(['-n', '2', '-s', '2', '--max-servers', '4', '--launcher',
                                 'slurm', '/w'])
        slurm_cfg = build_config(slurm_args, {'PATH': '/bin'}, 'slurm', '10.0.0.1',
                                 remote=True)
        steps = slurm_nodes(slurm_cfg, slurm_args, [Host('n1', slots=4)], '/b/sched',
                            '/b/server', {'PATH': '/bin'})
        self.assertEqual([n.name for n in steps],
                         ['scheduler', 'server 0', 'server 2', 'worker 0', 'worker 1'])
        mpi_args = parse_args(['-n', '2', '-s', '2', '--max-servers', '4', '--launcher',
                               'mpi', '/w'])
        mpi_cfg = build_config(mpi_args, {'PATH': '/bin'}, 'mpi', '127.0.0.1', remote=False)
        mpirun = mpi_nodes(mpi_cfg, mpi_args, None, '/b/sched', '/b/server', {'PATH': '/bin'},
                           tmp, LAUNCH)[1]
        self.assertEqual([mpirun.tag_map(rank) for rank in range(4)],
                         [b'[server 0] ', b'[server 2] ', b'[worker 0] ', b'[worker 1] '])

    def test_env_specs(self):
        parse = parse_env_specs
        self.assertEqual(parse(['A:1', 'B:x:y', 'C:', 'OMP_NUM_THREADS'], '--env',
                               self.ENVIRON),
                         {'A': '1', 'B': 'x:y', 'C': '', 'OMP_NUM_THREADS': '4'})
        for spec, needle in (('NOPE', 'not set'), ('1A:2', 'NAME[:VALUE]'),
                             ('DMLC_ROLE:worker', 'set by the launcher'), (':x', 'NAME')):
            with self.subTest(spec=spec):
                with self.assertRaisesRegex(UsageError, re.escape(needle)):
                    parse([spec], '--env-worker', self.ENVIRON)


class BinaryDiscoveryTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix='tessera-launch-test-')
        self.addCleanup(shutil.rmtree, self.dir, True)
        for sub in ('build/scheduler', 'build/server', 'build/worker', 'path'):
            os.makedirs(os.path.join(self.dir, sub))
        self.worker = os.path.join(self.dir, 'build', 'worker', 'trainer')
        _write_script(self.worker, 'pass\n')

    def put(self, rel):
        path = os.path.join(self.dir, rel)
        _write_script(path, 'pass\n')
        return path

    def find(self, name, explicit=None, command=None, path=''):
        return find_binary(name, '--server-binary', explicit,
                                  command or [self.worker], path)

    def test_explicit_wins(self):
        mine = self.put('path/my-server')
        self.put('build/server/tessera-server')
        self.assertEqual(self.find('tessera-server', explicit=mine), mine)

    def test_explicit_must_be_executable(self):
        with self.assertRaisesRegex(UsageError, '--server-binary .*not an executable'):
            self.find('tessera-server', explicit=os.path.join(self.dir, 'missing'))

    def test_build_layout_next_to_worker(self):
        sched = self.put('build/scheduler/tessera-scheduler')
        server = self.put('build/server/tessera-server')
        self.assertEqual(self.find('tessera-scheduler'), sched)
        self.assertEqual(self.find('tessera-server'), server)

    def test_same_dir_and_path(self):
        same = self.put('build/worker/tessera-server')
        self.assertEqual(self.find('tessera-server'), same)
        on_path = self.put('path/tessera-scheduler')
        self.assertEqual(self.find('tessera-scheduler', command=['python3', 'x.py'],
                                   path=os.path.join(self.dir, 'path')), on_path)

    def test_a_command_that_names_no_build_finds_the_daemons_in_the_fallback_dirs(self):
        # `launch.py ... python3 train.py`: PATH first, then launch.py's own build dirs.
        self.put('build/scheduler/tessera-scheduler')
        fallback = own_build_dirs({'TESSERA_BUILD_DIR': os.path.join(self.dir, 'build')})
        self.assertEqual(fallback[:3], [os.path.join(self.dir, 'build'),
                                        os.path.join(self.dir, 'build', 'scheduler'),
                                        os.path.join(self.dir, 'build', 'server')])
        found = find_binary('tessera-scheduler', '--scheduler-binary', None,
                                   ['python3', 'x.py'], os.path.join(self.dir, 'path'), fallback)
        self.assertEqual(found, os.path.join(self.dir, 'build', 'scheduler', 'tessera-scheduler'))
        on_path = self.put('path/tessera-scheduler')
        found = find_binary('tessera-scheduler', '--scheduler-binary', None,
                                   ['python3', 'x.py'], os.path.join(self.dir, 'path'), fallback)
        self.assertEqual(found, on_path)
        # Without TESSERA_BUILD_DIR: beside launch.py (an install's bin/), then the
        # build folder of launch.py's checkout.
        tools = os.path.dirname(os.path.abspath(LAUNCH))
        self.assertEqual(own_build_dirs({})[0], tools)
        self.assertEqual(own_build_dirs({})[3],
                         os.path.join(os.path.dirname(tools), 'build'))
        with self.assertRaisesRegex(UsageError, 'and in .*%s' % re.escape(tools)):
            find_binary('tessera-nothing', '--server-binary', None, ['python3'],
                               os.path.join(self.dir, 'path'), own_build_dirs({}))

    def test_not_found_names_where_it_looked(self):
        with self.assertRaises(UsageError) as cm:
            self.find('tessera-server', path=os.path.join(self.dir, 'path'))
        message = str(cm.exception)
        self.assertIn('cannot find tessera-server', message)
        self.assertIn(os.path.join(self.dir, 'build', 'server'), message)
        self.assertIn('PATH', message)
        self.assertIn('--server-binary', message)


class RemoteCommandTest(unittest.TestCase):
    def test_ssh_argv(self):
        argv = ssh_argv(Host('h', 2222), '/w d', {'A': "it's", 'B': '2'},
                               ['./train', '--lr', '0.1 x'],
                               {'TESSERA_SSH_OPTS': '-i "/k y" -o ConnectTimeout=5'})
        self.assertEqual(argv[:8], ['ssh', '-o', 'StrictHostKeyChecking=no', '-o',
                                    'BatchMode=yes', '-p', '2222', '-i'])
        self.assertEqual(argv[8:12], ['/k y', '-o', 'ConnectTimeout=5', 'h'])
        command = argv[12]
        self.assertTrue(command.startswith("cd '/w d' && exec bash -c "), command)
        self.assertIn("env 'A=it'\"'\"'s' B=2 ./train --lr '0.1 x'", command)

    def test_rsync_argv(self):
        argv = rsync_argv(Host('u@h', 23), '/src', '/dst dir', {})
        self.assertEqual(argv[:3], ['rsync', '-az', '-e'])
        self.assertIn('-p 23', argv[3])
        self.assertEqual(argv[-2:], ['/src/', 'u@h:/dst dir/'])
        self.assertIn("mkdir -p '/dst dir'", argv[argv.index('--rsync-path') + 1])

    def test_remote_path(self):
        self.assertEqual(remote_path('/home/me/job/bin/w', '/home/me/job', '/tmp/j'),
                         '/tmp/j/bin/w')
        self.assertEqual(remote_path('/usr/bin/w', '/home/me/job', '/tmp/j'),
                         '/usr/bin/w')
        self.assertEqual(remote_path('/home/me/job/w', '/home/me/job', None),
                         '/home/me/job/w')

    def wrapper(self, *argv):
        proc = subprocess.Popen(['bash', '-c', REMOTE_WRAPPER, 'x'] + list(argv),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        def cleanup():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()
        self.addCleanup(cleanup)
        first = proc.stdout.readline()
        self.assertTrue(first.startswith(REMOTE_PID_MARKER), first)
        return proc, int(first[len(REMOTE_PID_MARKER):])

    def test_wrapper_passes_status_and_output(self):
        proc, _ = self.wrapper('bash', '-c', 'echo out; echo err >&2; exit 3')
        self.assertEqual(proc.wait(10), 3)
        self.assertEqual(proc.stdout.read(), b'out\nerr\n')

    def test_wrapper_takes_the_key_from_stdin_into_a_private_file(self):
        script = ('stat -c %a "$TESSERA_KEY_FILE" "$(dirname "$TESSERA_KEY_FILE")"; '
                  'cat "$TESSERA_KEY_FILE"; echo "$TESSERA_KEY_FILE"; sleep 0.3')
        proc = subprocess.Popen(['bash', '-c', REMOTE_WRAPPER, 'x', KEY_FROM_STDIN,
                                 'bash', '-c', script],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.addCleanup(proc.stdout.close)
        proc.stdin.write(b'role worker\nsecret-key abc\n' + KEY_END_MARKER.encode() +
                         b'\n')
        proc.stdin.flush()
        # The channel stays open: the key's lines must not look like its end.
        self.assertEqual(proc.wait(10), 0)
        proc.stdin.close()
        lines = proc.stdout.read().decode().splitlines()
        self.assertTrue(lines[0].startswith(REMOTE_PID_MARKER.decode()), lines)
        self.assertEqual(lines[1:5], ['600', '700', 'role worker', 'secret-key abc'])
        self.assertFalse(os.path.exists(lines[5]), 'the key outlived its process')
        self.assertFalse(os.path.exists(os.path.dirname(lines[5])))

    def test_wrapper_kills_command_when_channel_closes(self):
        proc, pid = self.wrapper('bash', '-c', 'sleep 300 & echo $!; wait')
        child = int(proc.stdout.readline())
        self.assertTrue(pid_alive(pid) and pid_alive(child))
        proc.stdin.close()  # what a dropped ssh connection looks like remotely
        self.assertEqual(proc.wait(10), 128 + signal.SIGTERM)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and (pid_alive(pid) or pid_alive(child)):
            time.sleep(0.05)
        self.assertFalse(pid_alive(pid) or pid_alive(child))


class KeyTest(unittest.TestCase):
    def test_every_process_gets_a_file_of_its_own_listed_by_the_scheduler(self):
        # tessera-keygen --servers 2 --workers 3, as a local launch runs it.
        args = parse_args(['-n', '3', '-s', '2', '/w'])
        cfg = build_config(args, {'PATH': '/bin'}, 'local', '127.0.0.1', remote=False)
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        prepare_keys(cfg, args, [], tmp)
        scheduler = open(os.path.join(tmp, 'scheduler.key')).read()
        roster = [line.split() for line in scheduler.splitlines()
                  if line.startswith('node-key ')]
        self.assertEqual([r[1] for r in roster], ['server'] * 2 + ['worker'] * 3)
        self.assertEqual(len(set(r[2] for r in roster)), 5)
        own = set()
        for (role, index), env in sorted(cfg.node_key_env.items()):
            path = env['TESSERA_KEY_FILE']
            self.assertEqual(path, os.path.join(tmp, '%s-%d.key' % (role, index)))
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
            text = open(path).read()
            role_text = open(os.path.join(tmp, role + '.key')).read()
            self.assertTrue(text.startswith(role_text), text)
            secret = [l.split()[1] for l in text.splitlines()
                      if l.startswith('node-secret-key ')]
            self.assertEqual(len(secret), 1)
            self.assertEqual(len(secret[0]), 40)
            own.add(secret[0])
        self.assertEqual(len(own), 5)
        self.assertEqual(sorted(cfg.node_key_env),
                         [('server', 0), ('server', 1), ('worker', 0), ('worker', 1),
                          ('worker', 2)])

    def test_each_role_gets_its_own_secret_and_every_public_key(self):
        files = make_job_keys()
        self.assertEqual(sorted(files), ['scheduler', 'server', 'worker'])
        parsed = {}
        for role, text in files.items():
            lines = dict(line.split(' ', 1) for line in text.splitlines()
                         if not line.startswith('#'))
            self.assertEqual(lines['role'], role)
            self.assertEqual(len(lines['secret-key']), 40)
            parsed[role] = lines
        for role in files:
            for other in files:
                key = '%s-public-key' % other
                self.assertEqual(parsed[role][key], parsed[other][key])
                if other != role:
                    self.assertNotIn(parsed[other]['secret-key'], files[role])
        self.assertNotEqual(make_job_keys()['worker'], files['worker'])

    def test_job_security(self):
        self.assertEqual(job_security({}), 'generate')
        self.assertEqual(job_security({'TESSERA_INSECURE': '1'}), 'insecure')
        self.assertEqual(job_security({'TESSERA_KEY_DIR': '/k'}), 'user')
        with self.assertRaisesRegex(UsageError, 'TESSERA_KEY_FILE names one role'):
            job_security({'TESSERA_KEY_FILE': '/k/worker.key'})


class AddressTest(unittest.TestCase):
    def test_interface(self):
        self.assertEqual(interface_ipv4('lo'), '127.0.0.1')
        with self.assertRaisesRegex(UsageError, '--interface nosuch0'):
            interface_ipv4('nosuch0')

    def test_scheduler_address_order(self):
        first = Host('127.0.0.1')
        self.assertEqual(scheduler_address('lo', {'DMLC_PS_ROOT_URI': 'x'}, first),
                         '127.0.0.1')
        self.assertEqual(scheduler_address(None, {'DMLC_PS_ROOT_URI': 'sched.example'},
                                                  first), 'sched.example')
        self.assertEqual(scheduler_address(None, {}, first), '127.0.0.1')
        with self.assertRaisesRegex(UsageError, '--interface'):
            scheduler_address(None, {}, Host('no-such-host.invalid'))

    def test_busy_port_is_an_error(self):
        with socket.socket() as s:
            s.bind(('', 0))
            s.listen(1)
            with self.assertRaisesRegex(UsageError, '--port %d' % s.getsockname()[1]):
                pick_port(s.getsockname()[1])
        self.assertGreater(pick_port(None), 0)

    def test_chosen_ports_lie_below_the_ephemeral_range(self):
        # A port in that range can be a connecting client's own source port: a
        # test polling it before the daemon bound it once held it (CI).
        low, high = ephemeral_range()
        self.assertLess(low, high)
        for _ in range(20):
            first = free_port_run(4)
            self.assertGreaterEqual(first, 10000)
            self.assertLess(first + 3, low)
            for port in range(first, first + 4):
                with socket.socket() as s:
                    s.bind(('', port))  # free: raises if not
        chosen = pick_node_ports(6, {pick_port(None)})
        self.assertEqual(len(set(chosen)), 6)
        self.assertTrue(all(p < low for p in chosen), chosen)
        self.assertNotIn(free_port_run(1, taken=range(10000, low - 1001)), range(10000, low - 1001))


class CommandLineTest(FakeJobTest):
    def test_usage_errors_are_one_line(self):
        w = self.worker
        cases = [
            (['-n', '0', w], '-n/--num-workers', 'positive integer', "'0'"),
            (['-n', 'abc', w], '-n/--num-workers', "'abc'"),
            (['-n', '2', '-s', '-1', w], '-s/--num-servers'),
            (['-n', '2'], 'missing COMMAND'),
            ([w], '-n/--num-workers', 'required'),
            (['-n', '1', '--launcher', 'yarn', w], '--launcher', "'yarn'"),
            (['-n', '1', '--launcher', 'ssh', w], '--launcher ssh', '-H'),
            (['-n', '1', '--launcher', 'ssh', '-H', '/no/such/file', w], '/no/such/file'),
            (['-n', '1', '--launcher', 'ssh', '-H', self.hostfile('a\nb slots=two\n'), w],
             'line 2', 'slots=two'),
            (['-n', '1', '--port', '70000', w], '--port'),
            (['-n', '1', '--timeout', '-3', w], '--timeout'),
            (['-n', '1', '--env', 'X', w], '--env X', 'not set'),
            (['-n', '1', '--interface', 'nosuch0', w], '--interface nosuch0'),
            (['-n', '1', os.path.join(self.dir, 'missing-worker')], 'missing-worker'),
            (['-n', '1', '--launcher', 'mpi', '--restarts', '1', w], '--restarts'),
            (['-n', '2', '--metrics-port', '65533', w], '--metrics-port 65533',
             '1..65531', '5 ports'),
            (['-n', '2', '--metrics-port', '0', w], '--metrics-port', "'0'"),
            (['--status'], '--status: expected HOST:PORT', '--metrics-port BASE'),
            (['-n', '2', '-s', '2', '--replicas', '3', w], '--replicas 3',
             'at most the number of servers (2)'),
            (['-n', '2', '--replicas', '0', w], '--replicas', "'0'"),
        ]
        for args, *needles in cases:
            with self.subTest(args=args):
                one_line_error(self, self.launch(args), *needles)

    def test_status_of_a_job_that_is_not_there_says_so(self):
        # A port nobody listens on: exit 1, naming the address.
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
        for args in (['--status', '127.0.0.1:%d' % port],
                     ['--metrics-port', str(port), '--status']):
            with self.subTest(args=args):
                got = self.launch(args)
                self.assertEqual(got.returncode, 1, got.stdout + got.stderr)
                self.assertIn('launch.py --status: no answer from the scheduler at '
                              'http://127.0.0.1:%d: ' % port, got.stdout)

    def test_missing_daemon_binary(self):
        os.makedirs(os.path.join(self.dir, 'build', 'worker'))
        worker = os.path.join(self.dir, 'build', 'worker', 'w')
        shutil.copy(self.worker, worker)
        # A copy of launch.py and its package away from any build (it also looks
        # beside itself and in its checkout's build folder).
        os.makedirs(os.path.join(self.dir, 'lone', 'tools'))
        script = os.path.join(self.dir, 'lone', 'tools', 'launch.py')
        shutil.copy(LAUNCH, script)
        shutil.copytree(os.path.join(os.path.dirname(LAUNCH), 'tessera_launch'),
                        os.path.join(self.dir, 'lone', 'tools', 'tessera_launch'),
                        ignore=shutil.ignore_patterns('__pycache__'))
        env = self.env(PATH='/usr/bin:/bin')
        env.pop('TESSERA_BUILD_DIR', None)
        result = self.launch(['-n', '1', worker], daemons=False, env=env, script=script)
        one_line_error(self, result, 'cannot find tessera-scheduler',
                       os.path.join(self.dir, 'build', 'scheduler'), 'PATH',
                       os.path.join(self.dir, 'lone', 'build'), '--scheduler-binary')
        result = self.launch(['-n', '1', '--scheduler-binary',
                              os.path.join(self.bin, 'tessera-scheduler'), worker],
                             daemons=False, env=env, script=script)
        one_line_error(self, result, 'cannot find tessera-server', '--server-binary')
        self.assertEqual(self.records(), [])


# ----------------------------------------------------------------------------
# Local launcher


class LocalLaunchTest(FakeJobTest):
    def test_success(self):
        result = self.launch(['-n', '2', '-s', '2', '--env', 'CUSTOM:yes',
                              self.worker, '--sleep', '0.2'],
                             env=self.env(DMLC_NODE_HOST='127.0.0.1', PS_VERBOSE='1'))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertLess(result.elapsed, 15)
        self.assertEqual(result.stderr, '')
        for name in ('scheduler', 'server 0', 'server 1', 'worker 0', 'worker 1'):
            self.assertIn('[%s] hello from %s\n' % (name, name), result.stdout)
            self.assertIn('[%s] stderr from %s\n' % (name, name), result.stdout)
        for line in result.stdout.splitlines():
            self.assertRegex(line, r'^\[(scheduler|server \d|worker \d)\] ')
        sched = self.record('scheduler')
        port = sched['env']['DMLC_PS_ROOT_PORT']
        for role, index, task in (('scheduler', 0, None), ('server', 0, '0'),
                                  ('server', 1, '1'), ('worker', 0, '2'), ('worker', 1, '3')):
            env = self.record(role, index)['env']
            self.assertEqual(env['DMLC_ROLE'], role)
            self.assertEqual(env['DMLC_PS_ROOT_URI'], '127.0.0.1')
            self.assertEqual(env['DMLC_PS_ROOT_PORT'], port)
            self.assertEqual((env['DMLC_NUM_SERVER'], env['DMLC_NUM_WORKER']), ('2', '2'))
            self.assertEqual(env['TESSERA_RESTART_COUNT'], '0')
            self.assertEqual(env.get('DMLC_TASK_ID'), task)
            self.assertEqual(env['DMLC_NODE_HOST'], '127.0.0.1')
            self.assertEqual(env['PS_VERBOSE'], '1')
            self.assertEqual(env['CUSTOM'], 'yes')
        self.assertEqual(self.record('worker', 1)['argv'][1:], ['--sleep', '0.2'])
        self.assertNotIn('TESSERA_METRICS_PORT', self.record('worker', 1)['env'])
        self.assert_secured(result)
        self.assert_nothing_left()

    def test_metrics_ports_are_printed_and_given(self):
        result = self.launch(['-n', '2', '-s', '1', '--metrics-port', '19100', self.worker],
                             env=self.env(DMLC_NODE_HOST='127.0.0.1'))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stderr,
                         'launch.py: metrics: scheduler http://127.0.0.1:19100/metrics, '
                         'server 0 http://127.0.0.1:19101/metrics, '
                         'worker 0 http://127.0.0.1:19102/metrics, '
                         'worker 1 http://127.0.0.1:19103/metrics\n')
        for role, index, port in (('scheduler', 0, 19100), ('server', 0, 19101),
                                  ('worker', 0, 19102), ('worker', 1, 19103)):
            self.assertEqual(self.record(role, index)['env']['TESSERA_METRICS_PORT'], str(port))

    def test_secured_unless_insecure_or_keys_of_the_users(self):
        result = self.launch(['-n', '1', '-s', '1', self.worker],
                             env=self.env(TESSERA_INSECURE='1'))
        self.assertEqual(result.returncode, 0, result.stderr)
        for rec in self.records():
            self.assertNotIn('key', rec)
            self.assertEqual(rec['env']['TESSERA_INSECURE'], '1')
        keys = os.path.join(self.dir, 'mykeys')
        os.mkdir(keys, 0o700)
        write_job_keys(keys)
        shutil.rmtree(os.path.join(self.fake_dir, 'rec'))
        os.mkdir(os.path.join(self.fake_dir, 'rec'))
        result = self.launch(['-n', '1', '-s', '1', self.worker],
                             env=self.env(TESSERA_KEY_DIR=keys))
        self.assertEqual(result.returncode, 0, result.stderr)
        for rec in self.records():
            self.assertNotIn('TESSERA_KEY_FILE', rec['env'])
            self.assertEqual(rec['key']['path'], os.path.join(keys, rec['role'] + '.key'))
        result = self.launch(['-n', '1', self.worker],
                             env=self.env(TESSERA_KEY_FILE=os.path.join(keys, 'worker.key')))
        one_line_error(self, result, 'TESSERA_KEY_FILE names one role', 'TESSERA_KEY_DIR')

    def test_default_servers_and_port(self):
        result = self.launch(['-n', '3', '--port', str(pick_port(None)),
                              self.worker])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(len([r for r in self.records() if r['role'] == 'server']), 3)

    def test_worker_failure_stops_the_job(self):
        result = self.launch(['-n', '3', '-s', '2', '--server-args',
                              '--hang --spawn-child --ignore-term', self.worker,
                              '--fail-index', '1', '--exit-code', '3', '--hang-index', '0',
                              '--hang-index', '2'])
        self.assertEqual(result.returncode, 3, result.stderr)
        pid = self.record('worker', 1)['pid']
        self.assertIn('launch.py: worker 1 (pid %d) exited with status 3; stopping the job'
                      % pid, result.stderr)
        self.assertIn('[worker 1] hello from worker 1', result.stdout)
        self.assertLess(result.elapsed, 20)
        self.assert_nothing_left()

    def test_worker_killed_by_signal(self):
        result = self.launch(['-n', '2', '--server-args', '--hang', self.worker,
                              '--sigkill-index', '0', '--hang-index', '1'])
        self.assertEqual(result.returncode, 1, result.stderr)
        pid = self.record('worker', 0)['pid']
        self.assertIn('launch.py: worker 0 (pid %d) killed by signal SIGKILL; stopping the job'
                      % pid, result.stderr)
        self.assert_nothing_left()

    def test_server_failure_stops_the_job(self):
        result = self.launch(['-n', '2', '-s', '1', '--server-args', '--exit 5', self.worker,
                              '--hang-index', '0', '--hang-index', '1'])
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertRegex(result.stderr,
                         r'launch.py: server 0 \(pid \d+\) exited with status 5; stopping')
        self.assert_nothing_left()

    def test_restart_a_failed_worker(self):
        result = self.launch(['-n', '2', '--restarts', '1', self.worker,
                              '--fail-index', '1', '--fail-times', '1'])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertRegex(result.stderr, r'worker 1 \(pid \d+\) exited with status 3; '
                                        r'restarting it \(restart 1 of 1\)')
        first, second = self.record('worker', 1, 0), self.record('worker', 1, 1)
        self.assertEqual(second['env']['TESSERA_RESTART_COUNT'], '1')
        self.assertEqual(first['env']['DMLC_PS_ROOT_PORT'], second['env']['DMLC_PS_ROOT_PORT'])
        self.assertEqual([r['restart'] for r in self.records() if r['role'] == 'worker'
                          and r['index'] == 0], [0])
        self.assert_nothing_left()

    def test_restarts_run_out(self):
        result = self.launch(['-n', '1', '-s', '1', '--restarts', '2', self.worker,
                              '--fail-index', '0', '--exit-code', '4'])
        self.assertEqual(result.returncode, 4, result.stderr)
        self.assertEqual(sorted(r['restart'] for r in self.records() if r['role'] == 'worker'),
                         [0, 1, 2])
        self.assertRegex(result.stderr, r'worker 0 \(pid \d+\) exited with status 4; stopping')
        self.assert_nothing_left()

    def test_daemons_that_do_not_exit_are_killed_and_reported(self):
        result = self.launch(['-n', '1', '-s', '1', '--timeout', '0.5', '--server-args',
                              '--hang --spawn-child', self.worker])
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertRegex(result.stderr, r'launch.py: server 0 \(pid \d+\) still running '
                                        r'0.5 s after all workers finished; stopping the job')
        self.assertLess(result.elapsed, 15)
        self.assert_nothing_left()

    def test_sigterm_to_launcher_stops_everything(self):
        argv = [sys.executable, LAUNCH,
                '--scheduler-binary', os.path.join(self.bin, 'tessera-scheduler'),
                '--server-binary', os.path.join(self.bin, 'tessera-server'),
                '-n', '2', '--server-args', '--spawn-child', self.worker, '--hang-index', '0',
                '--hang-index', '1']
        proc = subprocess.Popen(argv, env=self.env(), cwd=self.dir, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, universal_newlines=True)
        deadline = time.monotonic() + 20
        while len(self.records()) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(len(self.records()), 5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        self.assertEqual(proc.returncode, 128 + signal.SIGTERM, err)
        self.assertIn('launch.py: received SIGTERM; stopping the job', err)
        self.assert_nothing_left()


# ----------------------------------------------------------------------------
# ssh launcher (fake ssh on PATH)


class SshLaunchTest(FakeJobTest):
    def ssh_env(self, **extra):
        return self.env(PATH=self.bin + os.pathsep + os.environ.get('PATH', ''), **extra)

    def test_placement_env_and_options(self):
        hosts = self.hostfile('# test cluster\nhostA\nhostB slots=2\n\nhostC:2222\n')
        result = self.launch(
            ['-n', '3', '-s', '2', '--launcher', 'ssh', '-H', hosts, '--interface', 'lo',
             '--env', 'CUSTOM_A', '--env', 'CUSTOM_B:b', '--env-worker', 'W_ONLY:w',
             '--env-server', 'S_ONLY:s', self.worker, '--sleep', '0.1'],
            env=self.ssh_env(CUSTOM_A='a', PS_HEARTBEAT_TIMEOUT='9', LD_LIBRARY_PATH='/l',
                             DMLC_NODE_HOST='10.9.9.9', NOT_FORWARDED='x',
                             TESSERA_SSH_OPTS='-o ConnectTimeout=5'))
        self.assertEqual(result.returncode, 0, result.stderr)
        expected = {('server', 0): 'hostA', ('server', 1): 'hostB', ('worker', 0): 'hostB',
                    ('worker', 1): 'hostC', ('worker', 2): 'hostA'}
        for (role, index), host in expected.items():
            env = self.record(role, index)['env']
            self.assertEqual(env['FAKE_SSH_HOST'], host, (role, index))
            self.assertEqual(env['DMLC_ROLE'], role)
            self.assertEqual(env['DMLC_PS_ROOT_URI'], '127.0.0.1')
            self.assertEqual(env['DMLC_INTERFACE'], 'lo')
            self.assertEqual((env['DMLC_NUM_SERVER'], env['DMLC_NUM_WORKER']), ('2', '3'))
            self.assertEqual(env['TESSERA_RESTART_COUNT'], '0')
            self.assertEqual(env['DMLC_JOB_CLUSTER'], 'ssh')
            self.assertEqual((env['CUSTOM_A'], env['CUSTOM_B']), ('a', 'b'))
            self.assertEqual((env['PS_HEARTBEAT_TIMEOUT'], env['LD_LIBRARY_PATH']), ('9', '/l'))
            self.assertEqual(env['TESSERA_FAKE_DIR'], self.fake_dir)
            self.assertEqual(env.get('W_ONLY'), 'w' if role == 'worker' else None)
            self.assertEqual(env.get('S_ONLY'), 's' if role == 'server' else None)
            for name in ('DMLC_NODE_HOST', 'NOT_FORWARDED', 'TESSERA_SSH_OPTS'):
                self.assertNotIn(name, env)
            self.assertEqual(self.record(role, index)['cwd'], self.dir)
        scheduler = self.record('scheduler')['env']
        self.assertNotIn('FAKE_SSH_HOST', scheduler)
        self.assertEqual(scheduler['DMLC_PS_ROOT_URI'], '127.0.0.1')
        calls = self.ssh_calls()
        self.assertEqual(sorted(c['host'] for c in calls),
                         ['hostA', 'hostA', 'hostB', 'hostB', 'hostC'])
        for call in calls:
            opts = call['opts']
            self.assertIn('StrictHostKeyChecking=no', opts)
            self.assertIn('BatchMode=yes', opts)
            self.assertIn('ConnectTimeout=5', opts)
            self.assertEqual('-p' in opts, call['host'] == 'hostC')
            if call['host'] == 'hostC':
                self.assertEqual(opts[opts.index('-p') + 1], '2222')
        self.assertIn('[worker 2] hello from worker 2', result.stdout)
        self.assertNotIn('__TESSERA_REMOTE_PID__', result.stdout)
        self.assert_secured(result, calls)
        for rec in self.records():
            if rec['role'] != 'scheduler':  # from the ssh channel, into a folder of its own
                self.assertRegex(rec['key']['path'], r'/tessera-key\.[^/]+/node\.key$')
                self.assertEqual(rec['key']['dir_files'], ['node.key'])
        self.assert_nothing_left()

    def test_remote_failure_stops_every_host(self):
        hosts = self.hostfile('h1\nh2\n')
        result = self.launch(['-n', '3', '-s', '2', '--launcher', 'ssh', '-H', hosts,
                              '--server-args', '--hang --spawn-child', self.worker,
                              '--fail-index', '1', '--hang-index', '0', '--hang-index', '2'],
                             env=self.ssh_env(DMLC_PS_ROOT_URI='127.0.0.1'))
        self.assertEqual(result.returncode, 3, result.stderr)
        failed = self.record('worker', 1)
        self.assertIn('launch.py: worker 1 on %s (pid %d) exited with status 3; stopping the '
                      'job' % (failed['env']['FAKE_SSH_HOST'], failed['pid']), result.stderr)
        self.assertEqual(failed['env']['FAKE_SSH_HOST'], 'h2')  # s0 h1, s1 h2, w0 h1, w1 h2
        self.assertLess(result.elapsed, 20)
        self.assert_nothing_left()

    def test_remote_restart(self):
        hosts = self.hostfile('h1\n')
        result = self.launch(['-n', '2', '-s', '1', '--launcher', 'ssh', '-H', hosts,
                              '--restarts', '1', self.worker, '--fail-index', '0',
                              '--fail-times', '1'],
                             env=self.ssh_env(DMLC_PS_ROOT_URI='127.0.0.1'))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(self.record('worker', 0, 1)['env']['TESSERA_RESTART_COUNT'], '1')
        self.assert_secured(result, self.ssh_calls())
        self.assert_nothing_left()

    @unittest.skipUnless(shutil.which('rsync'), 'rsync is not installed')
    def test_sync_dst_dir(self):
        src = os.path.join(self.dir, 'src')
        dst = os.path.join(self.dir, 'dst')
        os.makedirs(os.path.join(src, 'data'))
        with open(os.path.join(src, 'data', 'input.txt'), 'w') as f:
            f.write('x')
        shutil.copy(self.worker, os.path.join(src, 'run-worker'))
        hosts = self.hostfile('hostA slots=2\nhostB\nhostA\n')
        result = self.launch(['-n', '3', '-s', '1', '--launcher', 'ssh', '-H', hosts,
                              '--sync-dst-dir', dst, './run-worker'],
                             env=self.ssh_env(DMLC_PS_ROOT_URI='127.0.0.1'), cwd=src)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertTrue(os.path.exists(os.path.join(dst, 'data', 'input.txt')))
        syncs = [c['host'] for c in self.ssh_calls() if 'rsync --server' in c['command']]
        self.assertEqual(sorted(syncs), ['hostA', 'hostB'])
        for rec in self.records():
            if rec['role'] != 'scheduler':
                self.assertEqual(rec['cwd'], dst)

    def test_unreachable_first_host_without_address(self):
        hosts = self.hostfile('no-such-host.invalid\n')
        result = self.launch(['-n', '1', '--launcher', 'ssh', '-H', hosts, self.worker],
                             env=self.ssh_env())
        one_line_error(self, result, 'no-such-host.invalid', '--interface', 'DMLC_PS_ROOT_URI')


# ----------------------------------------------------------------------------
# mpi launcher (needs Open MPI's mpirun)


@unittest.skipUnless(shutil.which('mpirun'), 'mpirun is not installed (apt-get install '
                     'openmpi-bin)')
class MpiLaunchTest(FakeJobTest):
    def test_success(self):
        result = self.launch(['-n', '2', '-s', '1', '--launcher', 'mpi', '--env-worker',
                              'W_ONLY:w', self.worker, '--sleep', '0.1'])
        self.assertEqual(result.returncode, 0, result.stderr + result.stdout)
        port = self.record('scheduler')['env']['DMLC_PS_ROOT_PORT']
        for role, index, task in (('server', 0, '0'), ('worker', 0, '1'), ('worker', 1, '2')):
            env = self.record(role, index)['env']
            self.assertEqual((env['DMLC_ROLE'], env['DMLC_TASK_ID']), (role, task))
            self.assertEqual(env['DMLC_PS_ROOT_PORT'], port)
            self.assertEqual(env['DMLC_PS_ROOT_URI'], '127.0.0.1')
            self.assertEqual((env['DMLC_NUM_SERVER'], env['DMLC_NUM_WORKER']), ('1', '2'))
            self.assertEqual(env.get('W_ONLY'), 'w' if role == 'worker' else None)
            self.assertNotIn(MPI_SPEC_VAR, env)
            self.assertIn('[%s %d] hello from %s %d' % (role, index, role, index),
                          result.stdout)
        self.assert_secured(result)
        self.assert_nothing_left()

    def test_failure(self):
        result = self.launch(['-n', '2', '-s', '1', '--launcher', 'mpi', '--server-args',
                              '--hang', self.worker, '--fail-index', '1', '--hang-index', '0'])
        self.assertNotEqual(result.returncode, 0)
        self.assertRegex(result.stderr, r'launch.py: mpirun \(pid \d+\) exited with status '
                                        r'\d+; stopping the job')
        self.assert_nothing_left()


if __name__ == '__main__':
    unittest.main()
