#!/usr/bin/env python3
"""Whole jobs through tools/launch.py with the real daemons (tessera-scheduler,
tessera-server) and real workers on loopback: a job that forms, barriers and exits; a
worker killed with SIGKILL; a node that never comes; a server SIGKILLed at a random
round and restarted by --restarts from its checkpoint; and a short training run.
Every job runs with the fresh keys launch.py makes (one test checks they are
used, differ between jobs and are removed).

Needs TESSERA_BUILD_DIR (the CMake build folder) and TESSERA_SOURCE_DIR.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import uuid

SOURCE = os.environ.get('TESSERA_SOURCE_DIR', os.path.join(os.path.dirname(__file__), '..', '..'))
BUILD = os.environ.get('TESSERA_BUILD_DIR', os.path.join(SOURCE, 'build'))
LAUNCH = os.path.join(SOURCE, 'tools', 'launch.py')
CHECK_WORKER = os.path.join(BUILD, 'tests', 'core', 'kv_check_worker')
TRAIN_WORKER = os.path.join(BUILD, 'worker', 'tessera-worker')
DATA = os.environ.get('FASHION_MNIST_DIR', '/usr/share/datasets/fashion-mnist')


def marked_pids(mark):
    """Pids of live processes whose environment holds TESSERA_TEST_MARK=mark."""
    pids = []
    needle = ('TESSERA_TEST_MARK=' + mark).encode()
    for entry in os.listdir('/proc'):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open('/proc/%s/environ' % entry, 'rb') as f:
                if needle in f.read().split(b'\0'):
                    with open('/proc/%s/stat' % entry) as s:
                        if s.read().split(') ')[-1].startswith('Z'):
                            continue  # a zombie is already dead
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def node_pid(mark, role, task_id):
    """The pid of the live process marked `mark` with DMLC_ROLE=role, DMLC_TASK_ID=task_id."""
    want = {b'DMLC_ROLE=' + role.encode(), b'DMLC_TASK_ID=' + str(task_id).encode()}
    for pid in marked_pids(mark):
        try:
            with open('/proc/%d/environ' % pid, 'rb') as f:
                if want <= set(f.read().split(b'\0')):
                    return pid
        except OSError:
            pass
    return None


def read(path):
    with open(path) as f:
        return f.read()


# How the scheduler declares a node dead: by its heartbeats' time-out, or at once
# when the node's process is gone (its connection closed and its port refuses a new
# one; issue #46's fast failure detection, where the job survives the death).
DEATH = r'(?:stopped heart-beating|is gone: its connection closed)'
FAST_DEATH = (r'is gone: its connection closed and \d+ attempts to connect again to \S+ '
              r'were refused within ([0-9.]+m?s)[^;]*')


def seconds_after(line, wall):
    """Seconds from `wall` (time.time()) to the HH:MM:SS.mmm stamp (local time) that
    a daemon's `line` carries."""
    m = re.search(r'(\d\d):(\d\d):(\d\d)\.(\d{3}) \[', line)
    if m is None:
        raise ValueError('no time stamp in %r' % line)
    stamp = (int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
             + int(m.group(4)) / 1000.0)
    t = time.localtime(wall)
    then = t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + (wall % 1)
    d = stamp - then
    return d + 86400 if d < -43200 else d


def soak_checksums(out):
    return re.findall(r'soak ok: rank \d of \d+, \d+ rounds checksum=([0-9a-f]{16})', out)


class ClusterTestBase(unittest.TestCase):
    """What the whole-job tests share (elastic_cluster_test.py's too): a mark in
    every process's environment, launch.py run or started, and the clean-up."""

    def setUp(self):
        self.mark = uuid.uuid4().hex
        self.tmp = tempfile.TemporaryDirectory(prefix='tessera-launch-')
        # TESSERA_CORE_DUMPS=1: the daemons stay dumpable, so that node_pid and marked_pids
        # can read their /proc/PID/environ without root.
        self.env = dict(os.environ, TESSERA_TEST_MARK=self.mark, TESSERA_CORE_DUMPS='1',
                        PS_HEARTBEAT_INTERVAL='0.2',
                        PS_HEARTBEAT_TIMEOUT='2')
        self.proc = None
        self.started = time.monotonic()

    def tearDown(self):
        # The test's own time, beside unittest's "ok": CI's log says where the minutes go.
        sys.stderr.write('(%.0f s) ' % (time.monotonic() - self.started))
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in marked_pids(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.tmp.cleanup()

    def launch(self, args, timeout):
        start = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, LAUNCH] + args, env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            self.fail('launch.py did not end within %ss:\n%s' % (timeout, out))
        return self.proc.returncode, out, time.monotonic() - start

    def start(self, args):
        self.proc = subprocess.Popen([sys.executable, LAUNCH] + args, env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def kill_and_finish(self, victim, name):
        """SIGKILLs `victim`, launch.py's `name` ('worker 1'), and returns the job's output
        once it has ended, after checking that it restarted the victim and exited 0."""
        self.assertIsNone(self.proc.poll(), 'the job ended before the kill')
        os.kill(victim, signal.SIGKILL)
        try:
            out, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            self.fail('the job did not end within 120 s of the kill:\n' + out)
        self.assertEqual(self.proc.returncode, 0, out)
        self.assertIn('launch.py: %s (pid %d) killed by signal SIGKILL; restarting it '
                      '(restart 1 of 1)' % (name, victim), out)
        return out

    def assert_each_key_applied(self, out, times):
        """Every server's exit summary counts `times` applied pushes for each key."""
        lines = re.findall(r'pushes applied \d+ \(([^)]*)\)', out)
        self.assertTrue(lines, out)
        for line in lines:
            for key, n in re.findall(r'key (\d+): (\d+)', line):
                self.assertEqual(int(n), times, 'key %s: %s' % (key, line))



class LaunchClusterTest(ClusterTestBase):

    def test_job_of_three_workers_and_two_servers_forms_barriers_and_exits(self):
        code, out, took = self.launch(['-n', '3', '-s', '2', '--launcher', 'local',
                                       CHECK_WORKER, 'barrier', '5'], timeout=60)
        self.assertEqual(code, 0, out)
        self.assertLess(took, 30)
        for rank in range(3):
            self.assertIn('barrier ok: rank %d, 5 barriers' % rank, out)
        self.assertIn('[worker 2]', out)
        self.assertEqual(marked_pids(self.mark), [])

    def test_every_job_runs_with_fresh_keys_that_are_gone_afterwards(self):
        self.env['PS_VERBOSE'] = '1'
        self.env['TMPDIR'] = self.tmp.name  # where launch.py keeps the keys
        seen = []
        for _ in range(2):
            code, out, _ = self.launch(['-n', '1', '-s', '1', '--launcher', 'local',
                                        CHECK_WORKER, 'barrier', '1'], timeout=60)
            self.assertEqual(code, 0, out)
            keys = dict(re.findall(r'(?m)^\[(scheduler|server 0|worker 0)\] .*connections '
                                   r'authenticated and encrypted \(CURVE\) with the \w+ '
                                   r'key (\S+)$', out))
            self.assertEqual(sorted(keys), ['scheduler', 'server 0', 'worker 0'], out)
            self.assertEqual(len(set(keys.values())), 3, keys)
            seen.append(keys['worker 0'])
            self.assertEqual(os.listdir(self.tmp.name), [], 'keys left behind')
        self.assertNotEqual(seen[0], seen[1], 'two jobs had the same worker key')

    def test_worker_killed_with_sigkill_stops_the_job(self):
        script = os.path.join(self.tmp.name, 'worker.sh')
        with open(script, 'w') as f:
            f.write('#!/bin/sh\necho $$ > %s/pid.$DMLC_TASK_ID\nexec %s barrier 100000 20\n'
                    % (self.tmp.name, CHECK_WORKER))
        os.chmod(script, 0o755)
        self.proc = subprocess.Popen([sys.executable, LAUNCH, '-n', '2', '-s', '1',
                                      '--scheduler-binary', os.path.join(BUILD, 'scheduler', 'tessera-scheduler'),
                                      '--server-binary', os.path.join(BUILD, 'server', 'tessera-server'),
                                      script], env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        pid_file = os.path.join(self.tmp.name, 'pid.2')  # task ids: server 0, workers 1..2
        deadline = time.monotonic() + 30
        while not os.path.exists(pid_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # let the job form and barrier for a while
        self.assertIsNone(self.proc.poll(), 'the job ended early')
        with open(pid_file) as f:
            victim = int(f.read())
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = self.proc.communicate(timeout=30)
        self.assertLess(time.monotonic() - killed, 15)
        self.assertNotEqual(self.proc.returncode, 0, out)
        self.assertIn('killed by signal SIGKILL', out)
        self.assertRegex(out, r'launch.py: worker \d \(pid %d\)' % victim)
        time.sleep(0.2)
        self.assertEqual(marked_pids(self.mark), [], 'processes left behind')

    def test_launcher_and_daemons_name_a_killed_worker_alike(self):
        # launch.py names its processes in start order; the scheduler must rank them
        # in that order too, not by address. Here launch.py's worker 0 listens on
        # 127.0.0.3 and worker 1 on 127.0.0.2 (DMLC_NODE_HOST), so that address
        # order would make worker 1 rank 0. Worker 0 is SIGKILLed in an elastic job,
        # which goes on without it: launch.py's line, the scheduler's and the
        # workers' own log tags ([worker R] after launch.py's prefix) all name each
        # process the same way.
        script = os.path.join(self.tmp.name, 'worker.sh')
        with open(script, 'w') as f:
            f.write('#!/bin/sh\n'
                    '# -s 1: DMLC_TASK_ID 1 (worker 0) on 127.0.0.3, 2 (worker 1) on '
                    '127.0.0.2\n'
                    'DMLC_NODE_HOST=127.0.0.$((4 - DMLC_TASK_ID)); export DMLC_NODE_HOST\n'
                    'echo $$ > %s/pid.$DMLC_TASK_ID\nexec %s barrier 100000 20\n'
                    % (self.tmp.name, CHECK_WORKER))
        os.chmod(script, 0o755)
        self.env['PS_VERBOSE'] = '1'  # each node says the id and rank it joined as
        self.start(['-n', '2', '-s', '1', '--elastic', '1:2', script])
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(self.proc.stdout), daemon=True)
        reader.start()

        def wait_for(pattern, what, timeout=30):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for line in list(lines):
                    m = re.search(pattern, line)
                    if m:
                        return m
                self.assertIsNone(self.proc.poll(), 'the job ended early:\n' + ''.join(lines))
                time.sleep(0.05)
            self.fail('never saw %s:\n%s' % (what, ''.join(lines)))

        for task in (1, 2):  # both joined: the job formed
            wait_for(r'^\[worker %d\] .*joined as id \d+ rank' % (task - 1),
                     'worker %d joining' % (task - 1))
        victim = int(read(os.path.join(self.tmp.name, 'pid.1')))  # launch.py's worker 0
        os.kill(victim, signal.SIGKILL)
        dead = wait_for(r'^\[scheduler\] .*WARNING worker (\d) \(id \d+ at ([0-9.]+):\d+\) '
                        + DEATH, 'the scheduler declaring it dead')
        self.proc.send_signal(signal.SIGTERM)  # the survivor would barrier for long
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.fail('launch.py did not stop on SIGTERM:\n' + ''.join(lines))
        reader.join(10)
        self.proc.stdout.close()
        out = ''.join(lines)
        self.assertIn('launch.py: worker 0 (pid %d) killed by signal SIGKILL; '
                      'TESSERA_ELASTIC=1:2: the job goes on without it' % victim, out)
        self.assertEqual(dead.groups(), ('0', '127.0.0.3'), out)
        # Every line a worker logs carries its own tag: the rank it joined as.
        tagged = re.findall(r'(?m)^\[worker (\d)\] \S+ \[worker (\d)\]', out)
        self.assertTrue(tagged, out)
        for prefix, tag in tagged:
            self.assertEqual(prefix, tag, out)
        joined = dict(re.findall(r'(?m)^\[worker (\d)\] .*joined as id \d+ rank (\d)', out))
        self.assertEqual(joined, {'0': '0', '1': '1'}, out)
        self.assertEqual(marked_pids(self.mark), [])

    def test_missing_node_ends_at_the_start_deadline(self):
        never = os.path.join(self.tmp.name, 'never-server')
        with open(never, 'w') as f:
            f.write('#!/bin/sh\nexec sleep 1000\n')
        os.chmod(never, 0o755)
        self.env['TESSERA_START_TIMEOUT'] = '2'
        code, out, took = self.launch(['-n', '2', '-s', '1', '--server-binary', never,
                                       '--scheduler-binary',
                                       os.path.join(BUILD, 'scheduler', 'tessera-scheduler'),
                                       CHECK_WORKER, 'barrier', '1'], timeout=60)
        self.assertNotEqual(code, 0, out)
        self.assertLess(took, 20)
        self.assertIn('start-up deadline of 2s passed: 1 of 1 server(s) never registered', out)
        self.assertEqual(marked_pids(self.mark), [])

    def test_slow_formation_says_what_it_waits_for(self):
        # The scheduler names what is missing every 5 s; launch.py says what still
        # runs when nothing was printed for --quiet-notice seconds.
        never = os.path.join(self.tmp.name, 'never-server')
        with open(never, 'w') as f:
            f.write('#!/bin/sh\nexec sleep 1000\n')
        os.chmod(never, 0o755)
        self.env['TESSERA_START_TIMEOUT'] = '7'
        code, out, took = self.launch(['-n', '2', '-s', '1', '--server-binary', never,
                                       '--scheduler-binary',
                                       os.path.join(BUILD, 'scheduler', 'tessera-scheduler'),
                                       '--quiet-notice', '2',
                                       CHECK_WORKER, 'barrier', '1'], timeout=60)
        self.assertNotEqual(code, 0, out)
        self.assertLess(took, 30)
        waiting = re.findall(r'\[scheduler\] .*waiting for (.*) to register \((\d+)s so far; '
                             r'start-up deadline 7s, TESSERA_START_TIMEOUT\)', out)
        self.assertEqual(waiting, [('1 of 1 server(s)', '5')], out)
        notices = re.findall(r'launch.py: no output for (\d+) s \(job running (\d+) s\); '
                             r'still running: (.*)', out)
        self.assertGreaterEqual(len(notices), 2, out)
        for quiet, running, names in notices:
            self.assertGreaterEqual(int(quiet), 2)
            self.assertGreaterEqual(int(running), int(quiet))
            self.assertEqual(names, 'scheduler, server 0, worker 0, worker 1')
        self.assertLess(out.index('waiting for 1 of 1 server(s)'),
                        out.index('start-up deadline of 7s passed'))
        self.assertEqual(marked_pids(self.mark), [])

    def test_server_killed_at_a_random_round_is_restarted_and_resumes(self):
        # Key 99 is split over both servers, key 3 lives on one; 60 rounds of 20 ms.
        self.env.update(TESSERA_BIGARRAY_BOUND='1000', PS_RESEND_TIMEOUT='50')
        job = ['-n', '2', '-s', '2', CHECK_WORKER, 'soak', '60', '20']
        code, out, _ = self.launch(job, timeout=120)
        self.assertEqual(code, 0, out)
        want = soak_checksums(out)
        self.assertEqual(len(want), 2, out)
        self.assertEqual(want[0], want[1], out)

        ckpt = os.path.join(self.tmp.name, 'ckpt')
        self.start(['--restarts', '1', '--server-args',
                    '--checkpoint-dir %s --checkpoint-every 5 --checkpoint-keep 2' % ckpt] + job)
        # Once the victim has written its first checkpoint, a random delay of up to
        # about 40 of the 60 rounds.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                os.path.isdir(ckpt) and any(n.endswith('.ckpt') for n in os.listdir(ckpt))):
            time.sleep(0.01)
        delay = random.uniform(0.0, 0.8)
        sys.stderr.write('killing server 1 %.3f s after the first checkpoint\n' % delay)
        time.sleep(delay)
        victim = node_pid(self.mark, 'server', 1)
        self.assertIsNotNone(victim, 'server 1 is not running')
        out = self.kill_and_finish(victim, 'server 1')
        self.assertRegex(out, r'\[server 1\] .*restarted \(TESSERA_RESTART_COUNT=1\): '
                              r'(resumed from checkpoint \d+|no checkpoint in)')
        self.assertEqual(soak_checksums(out), want, out)
        # Every server, the restarted one included, applied each key's pushes once per
        # worker and round.
        self.assert_each_key_applied(out, 2 * 60)
        self.assertEqual(marked_pids(self.mark), [])

    def test_worker_killed_at_a_random_round_is_restarted_and_rejoins(self):
        # Key 99 is split over both servers, key 3 lives on one; 60 rounds of 40 ms.
        self.env.update(TESSERA_BIGARRAY_BOUND='1000', PS_RESEND_TIMEOUT='50')
        job = ['-n', '2', '-s', '2', CHECK_WORKER, 'soak', '60', '40']
        code, out, _ = self.launch(job, timeout=120)
        self.assertEqual(code, 0, out)
        want = soak_checksums(out)
        self.assertEqual(len(want), 2, out)

        self.start(['--restarts', '1'] + job)
        deadline = time.monotonic() + 60
        victim = None
        while time.monotonic() < deadline and victim is None:
            victim = node_pid(self.mark, 'worker', 3)  # DMLC_TASK_ID of worker 1
            time.sleep(0.01)
        self.assertIsNotNone(victim, 'worker 1 never started')
        # Past the inits (about 0.3 s in) and well before round 60 (about 2.7 s).
        delay = random.uniform(0.8, 1.6)
        sys.stderr.write('killing worker 1 %.3f s after it started\n' % delay)
        time.sleep(delay)
        out = self.kill_and_finish(victim, 'worker 1')
        resumed = re.findall(r'rank (\d+): restarted; resuming at round (\d+)', out)
        self.assertEqual(len(resumed), 1, out)
        self.assertGreater(int(resumed[0][1]), 0, out)
        self.assertLess(int(resumed[0][1]), 60, out)
        # Same weights as the fault-free run, bit for bit: no push lost or doubled.
        self.assertEqual(soak_checksums(out), want, out)
        self.assertEqual(len(re.findall(r'pushes applied ', out)), 2, out)
        self.assert_each_key_applied(out, 2 * 60)
        self.assertEqual(marked_pids(self.mark), [])

    def soak_with_a_death(self, die_at, rank):
        """The soak job with `rank` killing itself at `die_at` (kv_check_worker soak ...
        DIE_AT RANK) and restarted; returns the job's output after checking that it
        ended 0, quickly, with the fault-free checksums."""
        self.env.update(TESSERA_BIGARRAY_BOUND='1000', PS_RESEND_TIMEOUT='50')
        code, out, _ = self.launch(['-n', '2', '-s', '2', CHECK_WORKER, 'soak', '20'],
                                   timeout=120)
        self.assertEqual(code, 0, out)
        want = soak_checksums(out)
        self.assertEqual(len(want), 2, out)
        code, out, took = self.launch(['-n', '2', '-s', '2', '--restarts', '1', CHECK_WORKER,
                                       'soak', '20', '0', die_at, str(rank)], timeout=120)
        self.assertEqual(code, 0, out)
        self.assertRegex(out, r'launch.py: worker \d \(pid \d+\) killed by signal SIGKILL; '
                              r'restarting it \(restart 1 of 1\)')
        self.assertEqual(soak_checksums(out), want, out)
        self.assertLess(took, 60)  # no barrier or round waited for TESSERA_TIMEOUT
        self.assertEqual(marked_pids(self.mark), [])
        return out

    def test_worker_killed_inside_init_is_restarted_and_the_inits_complete(self):
        # Rank 1 dies between its inits while the others wait for it in the second
        # init's barrier: its new life finds both keys and joins that barrier. Rank 0
        # dies before storing the second key while rank 1 waits in that key's
        # barrier: its new life must not join that barrier with its first key, but
        # store the second key and then join it.
        for rank in (1, 0):
            out = self.soak_with_a_death('init', rank)
            # It had pushed nothing: its pushes start at round 0.
            self.assertIn('restarted (TESSERA_RESTART_COUNT=1): resuming at round 0', out)
            self.assertNotIn('restarted; resuming at round', out)

    def test_worker_killed_inside_a_push_whose_round_is_open_repeats_it_and_is_answered(self):
        # Rank 1 dies blocked in its round-5 push of the small key (taken; the round
        # waits for rank 0, which comes 1 s later). Its new life resumes at round 5
        # and pushes that key again at once: the server must answer this repeat when
        # the round completes, not the dead life's request. (Without resends, so that
        # a resend after the round cannot make up for a lost answer.)
        self.env['PS_RESEND'] = '0'
        out = self.soak_with_a_death('push', 1)
        self.assertIn('rank 1: restarted; resuming at round 5', out)

    def test_worker_killed_inside_the_last_barrier_is_restarted_and_the_job_ends(self):
        # Rank 1 dies waiting in close's barrier; the others complete that barrier
        # with its dead entry and finish; its new life, 1.5 s later, has nothing to
        # push, and its close must not wait for the finished workers.
        out = self.soak_with_a_death('close', 1)
        self.assertIn('rank 1: restarted; resuming at round 20', out)

    @unittest.skipUnless(os.path.exists(os.path.join(DATA, 'train-images-idx3-ubyte.gz')),
                         'Fashion-MNIST is not installed (dataset-fashion-mnist)')
    def test_training_worker_killed_mid_epoch_resumes_at_its_step(self):
        # 2 workers x 3000 images / batch 50 = 60 steps an epoch, 3 epochs.
        # The new life loads Fashion-MNIST before it registers again (0.45 s here, 1 s
        # under ThreadSanitizer, more on a loaded machine): with the 2 s heart-beat
        # time-out the scheduler declared it dead first in a tools/tsan.sh run.
        self.env['PS_HEARTBEAT_TIMEOUT'] = '6'
        log = os.path.join(self.tmp.name, 'job.log')
        with open(log, 'w') as f:
            self.proc = subprocess.Popen(
                [sys.executable, LAUNCH, '-n', '2', '-s', '1', '--restarts', '1', TRAIN_WORKER,
                 '--kv-store', 'dist_sync', '--lr', '0.3', '--momentum', '0', '--epochs', '3',
                 '--batch-size', '50', '--train-subset', '6000', '--test-subset', '1000',
                 '--log-every', '20'],
                env=self.env, stdout=f, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 'Epoch[1] Batch[20]' not in read(log):
            self.assertIsNone(self.proc.poll(), read(log))
            time.sleep(0.01)
        victim = node_pid(self.mark, 'worker', 2)  # DMLC_TASK_ID of worker 1
        self.assertIsNotNone(victim, read(log))
        os.kill(victim, signal.SIGKILL)
        try:
            self.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.fail('the job did not end within 180 s of the kill:\n' + read(log))
        out = read(log)
        self.assertEqual(self.proc.returncode, 0, out)
        self.assertIn('launch.py: worker 1 (pid %d) killed by signal SIGKILL; restarting it '
                      '(restart 1 of 1)' % victim, out)
        resumed = re.findall(r'restarted: resuming at step (\d+) \(epoch (\d+), batch (\d+)\)',
                             out)
        self.assertEqual(len(resumed), 1, out)
        step, epoch, batch = (int(x) for x in resumed[0])
        self.assertEqual(step, epoch * 60 + batch, out)
        self.assertGreaterEqual(step, 75, out)  # killed after a worker logged Epoch[1] Batch[20]
        self.assertLess(step, 180, out)
        self.assertIn('Epoch[2] Validation-accuracy=', out)
        # Every key was updated by exactly 2 workers x 3 epochs x 60 steps pushes.
        applied = re.findall(r'pushes applied \d+ \(([^)]*)\)', out)
        self.assertEqual(len(applied), 1, out)
        self.assertEqual(len(re.findall(r'key \d+: ', applied[0])), 6, out)  # W, b of 3 layers
        self.assert_each_key_applied(out, 2 * 3 * 60)
        self.assertEqual(marked_pids(self.mark), [])

    @unittest.skipUnless(os.path.exists(os.path.join(DATA, 'train-images-idx3-ubyte.gz')),
                         'Fashion-MNIST is not installed (dataset-fashion-mnist)')
    def test_short_training_job_lowers_the_loss_and_writes_metrics(self):
        metrics = os.path.join(self.tmp.name, 'metrics-{rank}.json')
        code, out, took = self.launch(['-n', '2', '-s', '1', TRAIN_WORKER, '--kv-store', 'dist_sync',
                                       '--gc-type', '2bit', '--gc-threshold', '1', '--lr', '0.3',
                                       '--momentum', '0', '--epochs', '2', '--train-subset', '6000',
                                       '--test-subset', '2000', '--log-every', '10',
                                       '--metrics-out', metrics],
                                      timeout=300)
        self.assertEqual(code, 0, out)
        self.assertIn('Epoch[1] Validation-accuracy=', out)
        self.assertRegex(out, r'Epoch\[0\] Batch\[\d+\] Speed: [\d.]+ samples/sec accuracy=')
        for rank in range(2):
            with open(metrics.format(rank=rank)) as f:
                m = json.load(f)
            for field in ('test_accuracy', 'epochs', 'wall_seconds', 'samples_per_second',
                          'bytes_pushed', 'bytes_pulled', 'device', 'kv_store', 'gc_type'):
                self.assertIn(field, m)
            self.assertEqual(m['epochs'], 2)
            self.assertEqual(m['kv_store'], 'dist_sync')
            self.assertEqual(m['gc_type'], '2bit')
            self.assertEqual(m['device'], 'cpu')
            self.assertLess(m['final_loss'], 0.7 * m['first_loss'])
            self.assertGreater(m['test_accuracy'], 0.6)
            # 2-bit: pushes are 16x smaller than the pulled float32 weights.
            self.assertLess(m['bytes_pushed'] * 10, m['bytes_pulled'])

    def test_fused_keys_train_to_the_same_bits_as_a_key_per_tensor(self):
        # --fuse-keys on: one key, one push and one pull a step. The servers'
        # sums are exact and SGD is per value, so the run is the same
        # arithmetic as a key per tensor: the same loss and test accuracy to
        # the last bit, with 1 round a step instead of 6.
        results = {}
        for fuse in ('off', 'on'):
            metrics = os.path.join(self.tmp.name, 'fuse-%s-{rank}.json' % fuse)
            code, out, _ = self.launch(['-n', '2', '-s', '1', TRAIN_WORKER, '--kv-store',
                                        'dist_sync', '--gc-type', '2bit', '--gc-threshold', '1',
                                        '--lr', '0.3', '--momentum', '0', '--epochs', '1',
                                        '--train-subset', '3000', '--test-subset', '1000',
                                        '--fuse-keys', fuse, '--metrics-out', metrics],
                                       timeout=300)
            self.assertEqual(code, 0, out)
            with open(metrics.format(rank=0)) as f:
                results[fuse] = json.load(f)
        for field in ('final_loss', 'test_accuracy', 'first_loss'):
            self.assertEqual(results['on'][field], results['off'][field], field)
        self.assertGreater(results['on']['test_accuracy'], 0.5)
        # The same values pushed (2-bit of the same length, one key's padding
        # to a whole word aside) and pulled.
        self.assertEqual(results['on']['bytes_pulled'], results['off']['bytes_pulled'])

    @unittest.skipUnless(os.path.exists(os.path.join(DATA, 'train-images-idx3-ubyte.gz')),
                         'Fashion-MNIST is not installed (dataset-fashion-mnist)')
    def test_layer_by_layer_wait_trains_to_the_same_bits_as_a_wait_per_step(self):
        # --wait-pulls layer (the default): a step's pushes and pulls are waited for
        # layer by layer in the next step's forward, and what is pending at an epoch's
        # end before rank 0's evaluation. The servers' rounds and the weights each
        # forward reads are the same as waiting for all at the end of each step, so
        # dist_sync ends with the same bits: two epochs, server momentum. The step-wise
        # job also sends in FIFO order (TESSERA_SEND_ORDER=fifo, docs/priority.md),
        # the layer-wise one with priorities (the default), over two servers: the
        # order slices go in changes no sum.
        results = {}
        for wait in ('layer', 'step'):
            metrics = os.path.join(self.tmp.name, 'wait-%s-{rank}.json' % wait)
            self.env['TESSERA_SEND_ORDER'] = 'priority' if wait == 'layer' else 'fifo'
            code, out, _ = self.launch(['-n', '2', '-s', '2', TRAIN_WORKER, '--kv-store',
                                        'dist_sync', '--lr', '0.1', '--momentum', '0.9',
                                        '--epochs', '2', '--train-subset', '3000',
                                        '--test-subset', '1000', '--wait-pulls', wait,
                                        '--metrics-out', metrics],
                                       timeout=300)
            self.assertEqual(code, 0, out)
            results[wait] = [json.loads(read(metrics.format(rank=r))) for r in range(2)]
            self.assertEqual(len(re.findall(r'Epoch\[1\] Validation-accuracy=', out)), 1, out)
        for rank in range(2):
            layer, step = results['layer'][rank], results['step'][rank]
            self.assertEqual((layer['wait_pulls'], step['wait_pulls']), ('layer', 'step'))
            self.assertEqual(layer['steps'], step['steps'])
            for field in ('weights_fnv1a', 'first_loss', 'final_loss', 'train_accuracy'):
                self.assertEqual(layer[field], step[field], (rank, field))
            self.assertEqual([e['train_accuracy'] for e in layer['epoch_log']],
                             [e['train_accuracy'] for e in step['epoch_log']])
        # Rank 0's evaluations after each epoch read the same weights.
        self.assertEqual([e['validation_accuracy'] for e in results['layer'][0]['epoch_log']],
                         [e['validation_accuracy'] for e in results['step'][0]['epoch_log']])
        self.assertEqual(results['layer'][0]['weights_fnv1a'],
                         results['layer'][1]['weights_fnv1a'])
        self.assertLess(results['layer'][0]['final_loss'], results['layer'][0]['first_loss'])

    def test_a_bad_wait_pulls_value_is_exit_2_naming_the_flag(self):
        for args, line in (
                (['--wait-pulls', 'tensor'],
                 "tessera-worker: --wait-pulls: expected layer or step, got 'tensor'\n"),
                (['--wait-pulls=layer', '--fuse-keys', 'on'],
                 'tessera-worker: --wait-pulls: layer needs a key per tensor, not '
                 '--fuse-keys on (one key: its pull is waited for by step)\n')):
            env = {k: v for k, v in self.env.items() if not k.startswith('DMLC_')}
            proc = subprocess.run([TRAIN_WORKER] + args, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=60)
            self.assertEqual(proc.returncode, 2, proc.stderr)
            self.assertEqual(proc.stderr, line)
            self.assertEqual(proc.stdout, '')

    def replicated_training_job(self, epochs, train_subset=None):
        """The quick-start training with 2-bit pushes and momentum (optimizer state on
        the servers), every key split over 3 servers (TESSERA_BIGARRAY_BOUND); on the
        first `train_subset` training images when given (all 60,000 otherwise)."""
        self.env.update(TESSERA_BIGARRAY_BOUND='1000', PS_HEARTBEAT_INTERVAL='0.25',
                        PS_HEARTBEAT_TIMEOUT='2', PS_RESEND_TIMEOUT='200')
        subset = ['--train-subset', str(train_subset)] if train_subset else []
        return ['-n', '2', '-s', '3', TRAIN_WORKER, '--kv-store', 'dist_sync', '--gc-type',
                '2bit', '--gc-threshold', '1', '--lr', '0.1', '--momentum', '0.5',
                '--epochs', str(epochs), '--test-subset', '1000'] + subset

    # fault_free_checksums' results by job and environment: the replicated tests run the
    # same job (epochs 3) more than once.
    fault_free = {}

    def fault_free_checksums(self, job):
        """Runs `job` unreplicated and without faults: both workers' final weights
        checksums (equal), what a faulted replicated run must end with."""
        key = (tuple(job), tuple(sorted((k, v) for k, v in self.env.items()
                                        if k != 'TESSERA_TEST_MARK')))
        if key in LaunchClusterTest.fault_free:
            return LaunchClusterTest.fault_free[key]
        code, out, _ = self.launch(job, timeout=300)
        self.assertEqual(code, 0, out)
        want = re.findall(r'Final weights checksum=([0-9a-f]{16})', out)
        self.assertEqual(len(want), 2, out)
        self.assertEqual(want[0], want[1], out)
        LaunchClusterTest.fault_free[key] = want
        return want

    def start_reading(self, args):
        """Starts launch.py with `args` and a thread that collects its output lines:
        returns (lines, thread)."""
        self.start(args)
        lines = []

        def read():
            for line in self.proc.stdout:
                lines.append(line)
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        return lines, reader

    def wait_for_training(self, lines):
        """Waits (up to 60 s) for a worker's first progress line: every key has been made
        on its servers and pushes run. A kill before it, while the keys are still being
        made (a loaded machine reached 1-2 s after the workers started), is another case:
        no slice is there to promote (issue #44's note)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and \
                not any(re.search(r'\[worker \d\] .*Epoch\[\d+\] Batch\[', l) for l in lines):
            self.assertIsNone(self.proc.poll(), 'the job ended before training:\n'
                              + ''.join(lines))
            time.sleep(0.05)
        self.assertTrue(any('Batch[' in l for l in lines),
                        'no worker trained within 60 s:\n' + ''.join(lines))

    def finish_reading(self, lines, reader, timeout, what):
        """Waits up to `timeout` s for the job to end; returns its whole output."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            reader.join(10)
            self.fail('the job did not end within %d s of %s:\n%s'
                      % (timeout, what, ''.join(lines)))
        reader.join(10)
        self.proc.stdout.close()
        return ''.join(lines)

    def wait_for_workers(self):
        """Waits (up to 60 s) until the started job's worker 1 runs."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and node_pid(self.mark, 'worker', 4) is None:
            time.sleep(0.01)  # DMLC_TASK_ID 4: worker 1 of 3 servers and 2 workers
        self.assertIsNotNone(node_pid(self.mark, 'worker', 4), 'worker 1 never started')

    def test_replicated_server_killed_mid_training_fails_over_to_the_same_bits(self):
        # --replicas 2: every slice on its primary and the next server. A server
        # SIGKILLed mid-training and not restarted: its slices' backups take over, the
        # workers resend what was outstanding, and the job ends 0 with the final
        # weights of a fault-free, unreplicated run, bit for bit (every push applied
        # once: a push lost or applied twice changes the exact sums).
        # The heartbeats' time-out is 30 s here: the fail-over within the bound below
        # comes from the closed, refusing connection of the killed process.
        # A third of the training images: an epoch is about 1 s here, 15 s under TSan
        # (tools/tsan.sh runs this test; on all 60,000 its two jobs took 297 s there).
        job = self.replicated_training_job(epochs=3, train_subset=20000)
        want = self.fault_free_checksums(job)

        self.env['PS_HEARTBEAT_TIMEOUT'] = '30'
        lines, reader = self.start_reading(['--replicas', '2'] + job)
        self.wait_for_workers()
        self.wait_for_training(lines)
        delay = random.uniform(0.2, 1.0)  # inside the first epoch (about 1 s)
        sys.stderr.write('killing server 1 %.3f s after the first progress line\n' % delay)
        time.sleep(delay)
        victim = node_pid(self.mark, 'server', 1)
        self.assertIsNotNone(victim, 'server 1 is not running')
        self.assertIsNone(self.proc.poll(), 'the job ended before the kill')
        os.kill(victim, signal.SIGKILL)
        killed_wall = time.time()
        killed = time.monotonic()
        out = self.finish_reading(lines, reader, 240, 'the kill')
        self.assertEqual(self.proc.returncode, 0, out)
        self.assertIn('launch.py: server 1 (pid %d) killed by signal SIGKILL; TESSERA_REPLICAS=2: '
                      'its key slices fail over to their replicas' % victim, out)
        m = re.search(r'^\[scheduler\] .*' + FAST_DEATH + r'; its key slices fail over to '
                      r'their next replica \(TESSERA_REPLICAS=2\)', out, re.M)
        self.assertIsNotNone(m, out)
        after = seconds_after(m.group(0), killed_wall)
        sys.stderr.write('server 1 failed over %.3f s after the SIGKILL (%s after its '
                         'connection closed)\n' % (after, m.group(1)))
        self.assertLess(after, 10, out)  # the heartbeats would take 30 s
        promoted = [int(n) for n in re.findall(r'promoted slices (\d+)', out)]
        self.assertEqual(len(promoted), 2, out)  # the two survivors' summaries
        self.assertGreater(sum(promoted), 0, out)
        self.assertEqual(re.findall(r'Final weights checksum=([0-9a-f]{16})', out), want,
                         out)
        self.assertLess(time.monotonic() - killed, 200)
        self.assertEqual(marked_pids(self.mark), [])

    def test_spare_replaces_a_killed_server_and_a_second_kill_is_survived(self):
        # --replicas 2 --spare-servers 1, 3 servers. launch.py's server 1 SIGKILLed
        # mid-training: its slices fail over, the spare takes its rank, the live servers
        # send it the slices of that rank's chains (state transfer) while training goes
        # on, and it reports caught up. Then it takes back its place in its chains (a
        # hand-back at a round boundary: it answers for rank 1's slices again). Then
        # launch.py's server 2, which shares chains with it, is SIGKILLed too: the
        # replacement answers for their slices. The job ends 0 with the final weights of
        # a fault-free, unreplicated run, bit for bit.
        job = self.replicated_training_job(epochs=4)
        want = self.fault_free_checksums(job)

        lines, reader = self.start_reading(['--replicas', '2', '--spare-servers', '1'] + job)
        took_back = re.compile(r'\[scheduler\] .*server (\d) \(id \d+ at [0-9.:]+\) took back '
                               r'its place in the chains of its key slices \(replacement 1, '
                               r'hand-back in [^)]*\): it answers for the slices of rank '
                               r'\1 again')
        self.wait_for_workers()
        # Mid-training: after a worker's first progress line (every key made). A kill
        # while the keys are still being made is another case: the spare then caught up
        # no slice and its updates were refused (issue #44's note; not fixed here).
        self.wait_for_training(lines)
        time.sleep(random.uniform(0.2, 1.0))
        first = node_pid(self.mark, 'server', 1)
        self.assertIsNotNone(first, 'server 1 is not running')
        self.assertIsNone(self.proc.poll(), 'the job ended before the first kill')
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(took_back.search(l) for l in lines):
            time.sleep(0.05)
        self.assertTrue(any(took_back.search(l) for l in lines), ''.join(lines))
        # Either other server holds some of the replaced rank's slices with it (3
        # servers, chains of 2); launch.py's server 2 is one of them.
        second = node_pid(self.mark, 'server', 2)
        self.assertIsNotNone(second, 'server 2 is not running')
        self.assertIsNone(self.proc.poll(), 'the job ended before the second kill:\n'
                          + ''.join(lines))
        os.kill(second, signal.SIGKILL)
        out = self.finish_reading(lines, reader, 240, 'the kills')
        self.assertEqual(self.proc.returncode, 0, out)
        self.assertRegex(out, r'\[scheduler\] .*spare server at [0-9.:]+ .*waits for a server '
                              r'to die')
        self.assertRegex(out, r'\[scheduler\] .*server (\d) \(id \d+ at [0-9.:]+\) \(host .*\) '
                              r'replaces the dead server of rank \1 \(replacement 1\)')
        self.assertRegex(out, r'\[scheduler\] .*server (\d) \(id \d+ at [0-9.:]+\) caught up: '
                              r'it holds the key slices of rank \1 again \(replacement 1\)')
        m = re.search(r'\[spare 0\] .*caught up: (\d+) key slice\(s\), (\d+) bytes', out)
        self.assertIsNotNone(m, out)
        # The hand-back: the spare answers for slices again before the second kill.
        self.assertRegex(out, r'\[spare 0\] .*hand-back: this server answers for \d+ key '
                              r'slice\(s\) of its chains again')
        self.assertGreater(int(m.group(1)), 0, out)
        self.assertGreater(int(m.group(2)), 0, out)
        # Both kills failed over (the second to the replacement among others).
        self.assertEqual(len(re.findall(r'\[scheduler\] .*' + DEATH + r'.*; its key '
                                        r'slices fail over to their next replica', out)), 2,
                         out)
        spare_summary = re.search(r'\[spare 0\] .*promoted slices (\d+)', out)
        self.assertIsNotNone(spare_summary, out)
        self.assertGreater(int(spare_summary.group(1)), 0, out)  # it answered after kill 2
        self.assertEqual(re.findall(r'Final weights checksum=([0-9a-f]{16})', out), want, out)
        self.assertEqual(marked_pids(self.mark), [])

    def test_replicated_server_restarted_rejoins_as_a_replacement(self):
        # --replicas 2 --restarts 1: launch.py restarts a SIGKILLed server at once, before
        # the heartbeats declare it dead. Its new process holds none of its slices: the
        # scheduler fails the old one over at the registration and gives the rank back
        # as a replacement, which catches up; same weights bit for bit, job ends 0.
        job = self.replicated_training_job(epochs=3)
        want = self.fault_free_checksums(job)

        lines, reader = self.start_reading(['--replicas', '2', '--restarts', '1'] + job)
        self.wait_for_workers()
        self.wait_for_training(lines)
        time.sleep(random.uniform(0.2, 1.0))
        victim = node_pid(self.mark, 'server', 1)
        self.assertIsNotNone(victim, 'server 1 is not running')
        self.assertIsNone(self.proc.poll(), 'the job ended before the kill')
        os.kill(victim, signal.SIGKILL)
        out = self.finish_reading(lines, reader, 240, 'the kill')
        self.assertEqual(self.proc.returncode, 0, out)
        self.assertIn('launch.py: server 1 (pid %d) killed by signal SIGKILL; restarting it '
                      '(restart 1 of 1)' % victim, out)
        # Declared gone by its refusing port, or, when the restart was quicker, at the
        # restart's registration.
        self.assertRegex(out, r'\[scheduler\] .*(?:restarted \(generation 1\) without its key '
                              r'slices|' + FAST_DEATH + r'); its key slices fail over to their '
                              r'next replica')
        self.assertRegex(out, r'\[scheduler\] .*server (\d) \(id \d+ at [0-9.:]+\) \(host .*\) '
                              r'replaces the dead server of rank \1 \(replacement 1\)')
        self.assertRegex(out, r'\[scheduler\] .*caught up: it holds the key slices of rank '
                              r'\d again \(replacement 1\)')
        self.assertEqual(re.findall(r'Final weights checksum=([0-9a-f]{16})', out), want, out)
        self.assertEqual(marked_pids(self.mark), [])

    def test_both_replicas_of_a_slice_killed_end_the_job_naming_the_slices(self):
        # 3 servers, 2 replicas: any two servers are a whole chain. Both SIGKILLed at
        # once: the job ends non-zero within the heartbeat time-out (2 s) and a few
        # seconds, saying which servers' slices lost every replica.
        self.start(['--replicas', '2'] + self.replicated_training_job(epochs=3))
        self.wait_for_workers()
        time.sleep(1.0)
        victims = [node_pid(self.mark, 'server', i) for i in (0, 2)]
        self.assertNotIn(None, victims)
        self.assertIsNone(self.proc.poll(), 'the job ended before the kill')
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            out, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            self.fail('the job did not end within 120 s of the kills:\n' + out)
        took = time.monotonic() - killed
        self.assertNotEqual(self.proc.returncode, 0, out)
        self.assertRegex(out, r'\[scheduler\] .*every replica of the key slices placed on '
                              r'server \d is gone \(servers \d, \d, TESSERA_REPLICAS=2\); '
                              r'ending the job')
        self.assertRegex(out, r'\[worker \d\] .*every replica of the key slices placed on '
                              r'server \d is gone')
        self.assertLess(took, 15, out)  # the heartbeat time-out (2 s) and the teardown
        self.assertEqual(marked_pids(self.mark), [])


def main():
    """unittest.main(), limited to this file's tests that TESSERA_LAUNCHER_TESTS names
    when it is set: entries FILE:TEST separated by spaces or commas (FILE a test file
    beside this one, without .py; TEST a test method's full name). tools/tsan.sh runs
    its shorter list so. A FILE or TEST that does not exist is an error, not a skip."""
    entries = [e for e in re.split(r'[\s,]+', os.environ.get('TESSERA_LAUNCHER_TESTS', ''))
               if e]
    if entries:
        here = os.path.dirname(os.path.abspath(sys.argv[0]))
        mine = os.path.splitext(os.path.basename(sys.argv[0]))[0]
        names = []
        for entry in entries:
            file, _, name = entry.partition(':')
            if not name or not os.path.isfile(os.path.join(here, file + '.py')):
                sys.exit('TESSERA_LAUNCHER_TESTS: %r is not FILE:TEST with FILE a test file '
                         'in %s' % (entry, here))
            if file == mine:
                names.append(name)
        module = sys.modules['__main__']
        known = {m for c in vars(module).values()
                 if isinstance(c, type) and issubclass(c, unittest.TestCase)
                 for m in dir(c) if m.startswith('test_')}
        unknown = sorted(set(names) - known)
        if unknown:
            sys.exit('TESSERA_LAUNCHER_TESTS: no test named %s in %s.py' % (', '.join(unknown), mine))
        sys.stderr.write('TESSERA_LAUNCHER_TESTS: running %d of the %d tests of %s.py\n'
                         % (len(set(names)), len(known), mine))
        if not names:
            return
        for name in names:
            sys.argv += ['-k', '*.' + name]  # the whole name, not a part of another
    unittest.main()


if __name__ == '__main__':
    main()
