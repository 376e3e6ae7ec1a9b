#!/usr/bin/env python3
"""Host-local aggregation (issue #47) in whole jobs through tools/launch.py: four
tessera-workers on this host with TESSERA_LOCAL_GROUP=1 form one local group,
push each key part once for the group, and with 2-bit pushes train to the same
bits as the same job without the group; a member killed mid-training ends the
job, named, instead of hanging the group.

Needs TESSERA_BUILD_DIR (the CMake build folder) and TESSERA_SOURCE_DIR.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

SOURCE = os.environ.get('TESSERA_SOURCE_DIR', os.path.join(os.path.dirname(__file__), '..', '..'))
BUILD = os.environ.get('TESSERA_BUILD_DIR', os.path.join(SOURCE, 'build'))
LAUNCH = os.path.join(SOURCE, 'tools', 'launch.py')
TRAIN_WORKER = os.path.join(BUILD, 'worker', 'tessera-worker')
DATA = os.environ.get('FASHION_MNIST_DIR', '/usr/share/datasets/fashion-mnist')
HAVE_DATA = os.path.exists(os.path.join(DATA, 'train-images-idx3-ubyte.gz'))

# A short quick-start job: a key per tensor (six keys, spread over the members),
# 2-bit pushes; 1,536 images a worker = 12 steps.
JOB = ['-n', '4', '-s', '1', TRAIN_WORKER, '--kv-store', 'dist_sync', '--lr', '0.3',
       '--momentum', '0', '--epochs', '1', '--train-subset', '6144', '--test-subset', '500',
       '--log-every', '1000']


def pushes_applied(out):
    """The server's count of pushes applied, from its exit line."""
    m = re.search(r'\[server 0\].*pushes applied (\d+)', out)
    return int(m.group(1)) if m else None


@unittest.skipUnless(HAVE_DATA, 'no Fashion-MNIST data (dataset-fashion-mnist)')
class LocalGroupJobTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix='tessera-group-')
        self.env = dict(os.environ, TESSERA_TEST_MARK=uuid.uuid4().hex, TESSERA_CORE_DUMPS='1',
                        PS_HEARTBEAT_INTERVAL='0.2', PS_HEARTBEAT_TIMEOUT='2')
        self.env.pop('TESSERA_LOCAL_GROUP', None)
        self.started = time.monotonic()

    def tearDown(self):
        sys.stderr.write('(%.1f s) ' % (time.monotonic() - self.started))
        self.tmp.cleanup()

    def run_job(self, name, extra, group, timeout=300):
        """Runs JOB + extra; returns (exit code, output, per-rank metrics)."""
        metrics = os.path.join(self.tmp.name, name + '-{rank}.json')
        env = dict(self.env, TESSERA_LOCAL_GROUP='1' if group else '0', PS_VERBOSE='1')
        proc = subprocess.run([sys.executable, LAUNCH] + JOB + extra +
                              ['--metrics-out', metrics], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        results = []
        for rank in range(4):
            path = metrics.format(rank=rank)
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
        return proc.returncode, proc.stdout, results

    def test_two_bit_job_trains_to_the_same_bits_with_a_quarter_of_the_pushes(self):
        extra = ['--gc-type', '2bit', '--gc-threshold', '1']
        code, flat_out, flat = self.run_job('flat', extra, group=False)
        self.assertEqual(code, 0, flat_out)
        code, out, grouped = self.run_job('grouped', extra, group=True)
        self.assertEqual(code, 0, out)
        self.assertIn('4 worker(s) asked to group with the workers on their host '
                      '(TESSERA_LOCAL_GROUP=1): 4 in 1 group(s)', out)
        self.assertEqual(len(grouped), 4)
        # Every member ends with the flat job's weights, to the last bit.
        for rank, r in enumerate(grouped):
            self.assertEqual(r['weights_fnv1a'], flat[0]['weights_fnv1a'])
            self.assertEqual(r['final_loss'], flat[rank]['final_loss'])
        # The server took one push a key and step from the group, four without it.
        self.assertEqual(pushes_applied(flat_out), 4 * pushes_applied(out))
        # Each key part left the host once: the members' bytes together are the
        # group's counts (4 bits a value), half the members' 2-bit pushes, and
        # every member carried a share (the keys cut into a part per member).
        self.assertLessEqual(sum(r['bytes_pushed'] for r in grouped),
                             sum(r['bytes_pushed'] for r in flat) * 0.51)
        for r in grouped:
            self.assertGreater(r['bytes_pushed'], 0, grouped)
        self.assertEqual(sum(r['bytes_pulled'] for r in grouped),
                         sum(r['bytes_pulled'] for r in flat) // 4)
        # MXNet's name for it: dist_device_sync groups whatever TESSERA_LOCAL_GROUP says.
        code, out, device = self.run_job('device', extra + ['--kv-store', 'dist_device_sync'],
                                         group=False)
        self.assertEqual(code, 0, out)
        self.assertIn('4 in 1 group(s)', out)
        self.assertEqual([r['weights_fnv1a'] for r in device], [flat[0]['weights_fnv1a']] * 4)
        self.assertEqual(pushes_applied(out), pushes_applied(flat_out) // 4)

    def test_two_bit_both_ways_members_agree_and_learn(self):
        # Pull compression too: each part's owner keeps the part's compressed copy.
        # Not the flat job's bits: a grouped job cuts its keys into a part per member
        # (NodeTable.local_group_split), and a compressed pull's threshold is chosen
        # per part (docs/local_groups.md).
        extra = ['--gc-type', '2bit', '--gc-threshold', '1', '--gc-pull', '2bit']
        code, out, grouped = self.run_job('grouped2', extra, group=True)
        self.assertEqual(code, 0, out)
        self.assertEqual(len(grouped), 4)
        self.assertEqual(len({r['weights_fnv1a'] for r in grouped}), 1, grouped)
        self.assertLess(grouped[0]['final_loss'], grouped[0]['first_loss'])

    def test_float_job_members_agree_and_learn(self):
        code, out, grouped = self.run_job('float', [], group=True)
        self.assertEqual(code, 0, out)
        self.assertEqual(len(grouped), 4)
        self.assertEqual(len({r['weights_fnv1a'] for r in grouped}), 1, grouped)
        self.assertLess(grouped[0]['final_loss'], grouped[0]['first_loss'])
        self.assertGreater(grouped[0]['test_accuracy'], 0.5)

    def test_replicated_server_killed_mid_training_fails_over_to_the_same_bits(self):
        # --replicas 2 with the group: a group's push is replicated as any round's
        # update; after server 1's SIGKILL its slices' backups take the owners' resent
        # pushes (each part's owner resends its group push), and the job ends with
        # the weights of the same job without groups, faults or replicas.
        job = ['-n', '4', '-s', '3', TRAIN_WORKER, '--kv-store', 'dist_sync', '--gc-type',
               '2bit', '--gc-threshold', '1', '--lr', '0.1', '--momentum', '0.5', '--epochs',
               '1', '--train-subset', '30000', '--test-subset', '500', '--log-every', '10']
        env = dict(self.env, TESSERA_BIGARRAY_BOUND='1000', PS_RESEND_TIMEOUT='200',
                   PS_HEARTBEAT_TIMEOUT='30', PS_HEARTBEAT_INTERVAL='0.25')
        clean = subprocess.run([sys.executable, LAUNCH] + job, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        self.assertEqual(clean.returncode, 0, clean.stdout)
        want = re.findall(r'Final weights checksum=([0-9a-f]{16})', clean.stdout)
        self.assertEqual(len(want), 4, clean.stdout)
        env['TESSERA_LOCAL_GROUP'] = '1'
        proc = subprocess.Popen([sys.executable, LAUNCH, '--replicas', '2'] + job, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:  # until the first progress line
            lines.append(line)
            if 'Batch[10]' in line:
                break
        time.sleep(0.3)
        victim = self.node_pid(env['TESSERA_TEST_MARK'], 'server', task_id=1)
        self.assertIsNotNone(victim, ''.join(lines))
        self.assertIsNone(proc.poll(), 'the job ended before the kill')
        os.kill(victim, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=300)
        out = ''.join(lines) + rest
        self.assertEqual(proc.returncode, 0, out)
        self.assertIn('launch.py: server 1 (pid %d) killed by signal SIGKILL; TESSERA_REPLICAS=2'
                      % victim, out)
        self.assertIn('4 in 1 group(s)', out)
        promoted = [int(n) for n in re.findall(r'promoted slices (\d+)', out)]
        self.assertEqual(len(promoted), 2, out)  # the two survivors' summaries
        self.assertGreater(sum(promoted), 0, out)
        self.assertEqual(re.findall(r'Final weights checksum=([0-9a-f]{16})', out), want, out)

    def kill_member_mid_training(self, rank, launcher_flags=()):
        """Starts a long grouped job, SIGKILLs worker `rank` 3 s into it and returns
        (victim pid, the job's output) once the job ended non-zero within 60 s."""
        env = dict(self.env, TESSERA_LOCAL_GROUP='1')
        proc = subprocess.Popen([sys.executable, LAUNCH] + list(launcher_flags) + JOB[:-1] +
                                ['10', '--epochs', '50'], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            time.sleep(0.2)
            victim = self.node_pid(env['TESSERA_TEST_MARK'], 'worker', task_id=1 + rank)
        self.assertIsNotNone(victim, 'worker %d never started' % rank)
        time.sleep(3)  # into training
        self.assertIsNone(proc.poll(), 'the job ended before the kill')
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        self.assertNotEqual(proc.returncode, 0, out)
        self.assertLess(time.monotonic() - killed, 60, out)
        return victim, out

    def test_a_killed_member_ends_the_job_naming_it(self):
        victim, out = self.kill_member_mid_training(2)
        self.assertRegex(out, r'worker 2 \(pid %d\) killed by signal SIGKILL' % victim)

    def test_a_member_restarted_by_restarts_ends_the_job_saying_why(self):
        # --restarts 1: the killed member's new life cannot rejoin its group (the
        # group's segment is gone and its mates' calls failed); it says so, and the
        # job ends non-zero instead of waiting.
        victim, out = self.kill_member_mid_training(1, ['--restarts', '1'])
        self.assertIn('worker 1 (pid %d) killed by signal SIGKILL; restarting it' % victim, out)
        self.assertRegex(out, r'worker 1 restarted \(TESSERA_RESTART_COUNT=1\) into local group 1: '
                              r'a member of a local group cannot rejoin it')

    @staticmethod
    def node_pid(mark, role, task_id):
        """The pid of the live tessera-<role> marked `mark` with DMLC_TASK_ID=task_id."""
        want = {b'TESSERA_TEST_MARK=' + mark.encode(), b'DMLC_ROLE=' + role.encode(),
                b'DMLC_TASK_ID=' + str(task_id).encode()}
        for entry in os.listdir('/proc'):
            if not entry.isdigit():
                continue
            try:
                with open('/proc/%s/environ' % entry, 'rb') as f:
                    if want <= set(f.read().split(b'\0')):
                        with open('/proc/%s/comm' % entry) as c:
                            if c.read().strip() == 'tessera-' + role:
                                return int(entry)
            except OSError:
                pass
        return None

if __name__ == '__main__':
    unittest.main()
