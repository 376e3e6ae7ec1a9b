#!/usr/bin/env python3
"""Elastic jobs (TESSERA_ELASTIC, launch.py --elastic) with the real daemons and
workers on loopback: workers that die or say goodbye while the job goes on, the
minimum, a worker that leaves a soak and one that joins it (exact sums)
(docs/faults.md, "Elastic jobs"). Its own ctest entry, apart from
launcher_cluster: two of these train the quick-start model with 4 workers, which
takes long under tools/tsan.sh.

Needs TESSERA_BUILD_DIR (the CMake build folder) and TESSERA_SOURCE_DIR.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_cluster_test as base  # noqa: E402
from launch_cluster_test import (  # noqa: E402
    BUILD, CHECK_WORKER, DEATH, FAST_DEATH, SOURCE, TRAIN_WORKER, marked_pids, node_pid,
    seconds_after, soak_checksums)

sys.path.insert(0, os.path.join(SOURCE, 'tools'))
from tessera_launch import hosts as launch_hosts  # noqa: E402
from tessera_launch import keys as launch_keys  # noqa: E402


class ElasticClusterTest(base.ClusterTestBase):

    def elastic_training_job(self):
        """The quick-start training (2-bit pushes, fused keys) with 4 workers and 1
        server, 3 epochs."""
        return ['-n', '4', '-s', '1', TRAIN_WORKER, '--kv-store', 'dist_sync', '--gc-type',
                '2bit', '--gc-threshold', '1', '--lr', '0.3', '--momentum', '0',
                '--fuse-keys', 'on', '--epochs', '3']

    def assert_soak_checksums_agree(self, out, workers):
        """`workers` soak ok lines in `out`, all with the same checksum."""
        sums = soak_checksums(out)
        self.assertEqual(len(sums), workers, out)
        self.assertEqual(len(set(sums)), 1, out)

    def run_acting_on(self, args, pattern, act, timeout):
        """Runs launch.py with `args`, calling act(match) on the first output line
        that matches `pattern` (once). Returns the exit status and the output."""
        return self.run_acting_on_each(args, [(pattern, act)], timeout)

    def run_acting_on_each(self, args, actions, timeout):
        """run_acting_on with several (pattern, act) pairs, each acted on once, in
        order: the second pattern is looked for from the line after the first's."""
        self.start(args)
        lines = []
        pending = list(actions)
        deadline = time.monotonic() + timeout
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                lines.append(line)
                m = re.search(pending[0][0], line) if pending else None
                if m:
                    pending.pop(0)[1](m)
            self.proc.wait()
        finally:
            timer.cancel()
            self.proc.stdout.close()
        out = ''.join(lines)
        self.assertLess(time.monotonic(), deadline, 'launch.py did not end within %ss:\n%s'
                        % (timeout, out))
        self.assertFalse(pending, 'never saw %r:\n%s' % (pending[0][0] if pending else '',
                                                          out))
        return self.proc.returncode, out

    def kill_after_first_epoch(self, signals, sent_at=None):
        """An act for run_acting_on: sends signals[i] to the i-th worker of launch.py
        that is not rank 0 (the worker that printed the match), in order; appends each
        signal's time.time() to `sent_at` when given."""
        def act(m):
            evaluator = int(m.group(1))  # rank 0 (launch.py names it by rank)
            others = [k for k in range(4) if k != evaluator]
            for k, sig in zip(others, signals):
                pid = node_pid(self.mark, 'worker', 1 + k)  # 1 server first
                self.assertIsNotNone(pid, 'worker %d is not running' % k)
                sys.stderr.write('sending %s to worker %d (pid %d)\n'
                                 % (signal.Signals(sig).name, k, pid))
                os.kill(pid, sig)
                if sent_at is not None:
                    sent_at.append(time.time())
        return act

    def test_elastic_job_goes_on_after_a_killed_and_a_departing_worker(self):
        # --elastic 2:4: after the first epoch one worker is SIGKILLed (declared dead)
        # and another SIGTERMed (it finishes its step and says goodbye). The rounds go
        # on with the two left, whose pushes are scaled to the mean; the job ends 0 and
        # rank 0's validation accuracy is within 1 point of the fixed-size run's.
        job = self.elastic_training_job()
        code, out, _ = self.launch(job, timeout=300)
        self.assertEqual(code, 0, out)
        fixed = float(re.findall(r'Epoch\[2\] Validation-accuracy=([\d.]+)', out)[-1])

        # The heartbeats' time-out is 30 s in the elastic run: the SIGKILLed worker
        # leaves the rounds within the bound below because its process is gone (its
        # connection closed and its port refuses a new one), issue #46.
        sent_at = []
        self.env['PS_HEARTBEAT_TIMEOUT'] = '30'
        code, out = self.run_acting_on(
            ['--elastic', '2:4'] + job, r'\[worker (\d)\] Epoch\[0\] Validation-accuracy=',
            self.kill_after_first_epoch([signal.SIGKILL, signal.SIGTERM], sent_at),
            timeout=300)
        self.assertEqual(code, 0, out)
        self.assertRegex(out, r'launch.py: worker \d \(pid \d+\) killed by signal SIGKILL; '
                              r'TESSERA_ELASTIC=2:4: the job goes on without it')
        m = re.search(r'^\[scheduler\] .*' + FAST_DEATH + r'; the job goes on with [23] of 4 '
                      r'worker\(s\) \(TESSERA_ELASTIC=2:4\)', out, re.M)
        self.assertIsNotNone(m, out)
        after = seconds_after(m.group(0), sent_at[0])
        sys.stderr.write('the SIGKILLed worker left the rounds %.3f s after the kill (%s after '
                         'its connection closed)\n' % (after, m.group(1)))
        self.assertLess(after, 10, out)  # the heartbeats would take 30 s
        self.assertRegex(out, r'\[scheduler\] .*left the job \(it said goodbye\); the job '
                              r'goes on with [23] of 4 worker\(s\)')
        self.assertRegex(out, r'\[worker \d\] Left the job after \d+ step\(s\) \(SIGTERM')
        checksums = re.findall(r'Final weights checksum=([0-9a-f]{16})', out)
        self.assertEqual(len(checksums), 2, out)
        self.assertEqual(checksums[0], checksums[1], out)
        elastic = float(re.findall(r'Epoch\[2\] Validation-accuracy=([\d.]+)', out)[-1])
        sys.stderr.write('validation accuracy: fixed-size %.4f, elastic %.4f\n'
                         % (fixed, elastic))
        self.assertLess(abs(elastic - fixed), 0.01, out)
        self.assertEqual(marked_pids(self.mark), [])

    def test_elastic_job_below_its_minimum_ends_naming_it(self):
        # --elastic 3:4 and two workers SIGKILLed: the second death leaves 2, fewer
        # than the minimum; the job ends non-zero saying so.
        code, out = self.run_acting_on(
            ['--elastic', '3:4'] + self.elastic_training_job(),
            r'\[worker (\d)\] Epoch\[0\] Validation-accuracy=',
            self.kill_after_first_epoch([signal.SIGKILL, signal.SIGKILL]), timeout=120)
        self.assertNotEqual(code, 0, out)
        self.assertRegex(out, r'\[scheduler\] .*' + DEATH + r'.*; 2 worker\(s\) left in '
                              r"the job, fewer than TESSERA_ELASTIC's minimum of 3 \(3:4\); "
                              r'ending the job')
        self.assertEqual(marked_pids(self.mark), [])


    def test_worker_leaving_an_elastic_soak_counts_its_pushes_until_it_left(self):
        # 3 workers, 2 servers, --elastic 2:3, SOAK_LEAVE=2:10: rank 2 leaves after
        # round 10; the soak checks every round's exact values on every rank (the
        # rounds after 10 sum ranks 0 and 1, scaled by 3/2) and the servers applied
        # each key's pushes 3 x 11 + 2 x 19 times.
        self.env.update(SOAK_LEAVE='2:10', TESSERA_BIGARRAY_BOUND='1000')
        code, out, _ = self.launch(['-n', '3', '-s', '2', '--elastic', '2:3', CHECK_WORKER,
                                    'soak', '30'], timeout=120)
        self.assertEqual(code, 0, out)
        self.assertIn('soak left: rank 2 after round 10', out)
        self.assertRegex(out, r'\[scheduler\] .*left the job \(it said goodbye\); the job goes '
                              r'on with 2 of 3 worker\(s\) \(TESSERA_ELASTIC=2:3\)')
        self.assert_soak_checksums_agree(out, 2)
        self.assert_each_key_applied(out, 3 * 11 + 2 * 19)

    def wait_formed(self, metrics_port):
        """Waits until the scheduler's metric says the job formed."""
        # The sample's line (the HELP line starts "1 once ...").
        self.wait_metric(metrics_port, r'^tessera_scheduler_job_formed 1$')

    def wait_metric(self, metrics_port, pattern):
        """Waits (at most 60 s) until a line of the scheduler's metrics matches."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen('http://127.0.0.1:%d/metrics' % metrics_port,
                                            timeout=1) as r:
                    if re.search(pattern, r.read().decode(), re.MULTILINE):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.fail('the scheduler\'s metrics never matched %r' % pattern)

    def adding_servers(self, metrics_port, count, adder):
        """An act for run_acting_on_each on the job's `--add-servers N --join FILE`
        line: once the job formed (and 2 s more), starts launch.py --add-servers
        `count` --join FILE, appended to `adder`."""
        def act(m):
            self.wait_formed(metrics_port)
            time.sleep(2)
            adder.append(subprocess.Popen(
                [sys.executable, base.LAUNCH, '--add-servers', str(count), '--join',
                 m.group(1)],
                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return act

    def signalling_server(self, task_id, sig=signal.SIGTERM):
        """An act for run_acting_on_each: sends `sig` to launch.py's server
        `task_id` in start order (DMLC_TASK_ID; its name is its rank)."""
        def act(m):
            pid = node_pid(self.mark, 'server', task_id)
            self.assertIsNotNone(pid, 'server of DMLC_TASK_ID %d is not running' % task_id)
            sys.stderr.write('%s to the server of DMLC_TASK_ID %d (pid %d)\n'
                             % (signal.Signals(sig).name, task_id, pid))
            os.kill(pid, sig)
        return act

    def adder_output(self, adder, out, timeout=60):
        """The output of the one adding launch.py in `adder`, which must end 0
        within `timeout` s (`out`: the job's, for the failure message)."""
        self.assertEqual(len(adder), 1, out)
        try:
            added_out, _ = adder[0].communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            adder[0].kill()
            added_out, _ = adder[0].communicate()
            self.fail('launch.py %s did not end:\n%s' % (adder[0].args[2], added_out))
        self.assertEqual(adder[0].returncode, 0, added_out + out)
        return added_out

    def test_worker_started_by_hand_joins_an_elastic_soak_and_its_pushes_count(self):
        # A job of 2 workers with --elastic 2:3 and the user's keys (TESSERA_KEY_DIR);
        # a third kv_check_worker started by hand with those keys and the
        # scheduler's address joins as rank 2 while the soak runs. The others check
        # every round exactly: each value gains the joiner's pushes (scaled by 2/3)
        # from one round on, the same round for every value (the joiner enters every
        # slice at one round), and every value saw them before the end. A fourth
        # worker is turned away (the job has its most workers). The servers apply
        # each key's pushes 2 x 250 + 600 times.
        key_dir = os.path.join(self.tmp.name, 'keys')
        launch_keys.write_job_keys(key_dir, keygen=os.path.join(BUILD, 'tools', 'keygen',
                                                                'tessera-keygen'))
        port = launch_hosts.free_port_run(1)
        metrics = launch_hosts.free_port_run(5, taken={port})
        self.env.update(TESSERA_KEY_DIR=key_dir, TESSERA_BIGARRAY_BOUND='1000')
        self.start(['-n', '2', '-s', '2', '--elastic', '2:3', '--port', str(port),
                    '--metrics-port', str(metrics), '--env-worker', 'SOAK_JOINER:2',
                    CHECK_WORKER, 'soak', '250', '20'])
        # Once the job has formed: a worker started earlier would be taken for
        # one of the job's own two.
        self.wait_formed(metrics)
        joiner_env = dict(self.env, DMLC_ROLE='worker', DMLC_PS_ROOT_URI='127.0.0.1',
                          DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_WORKER='2',
                          DMLC_NUM_SERVER='2', TESSERA_ELASTIC='2:3', SOAK_JOIN='1')
        joiner = subprocess.Popen([CHECK_WORKER, 'soak', '600'], env=joiner_env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # The fourth once the third joined (else it could take the third's place).
        self.wait_metric(metrics, r'^tessera_scheduler_workers_joined_total 1$')
        extra = subprocess.run([CHECK_WORKER, 'soak', '10'], env=joiner_env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=60)
        try:
            joined_out, _ = joiner.communicate(timeout=120)
            out, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            joiner.kill()
            self.proc.kill()
            joined_out, _ = joiner.communicate()
            out, _ = self.proc.communicate()
            self.fail('the job or the joiner did not end within 120 s:\n%s\n%s'
                      % (joined_out, out))
        self.assertEqual(joiner.returncode, 0, joined_out + out)
        self.assertIn('soak joined: rank 2, 600 rounds', joined_out)
        self.assertRegex(joined_out, r"joined the job \(generation \d+\): in every key's "
                                     r'rounds from round \d+ \(3 key\(s\)')
        self.assertEqual(self.proc.returncode, 0, out)
        self.assertRegex(out, r'\[scheduler\] .*joins the job \(join 1\): 3 of at most 3 '
                              r'worker\(s\) in it \(TESSERA_ELASTIC=2:3\)')
        self.assertNotEqual(extra.returncode, 0, extra.stdout)
        self.assertIn('the job already has its most workers, 3 (TESSERA_ELASTIC=2:3)',
                      extra.stdout)
        self.assert_soak_checksums_agree(out, 2)
        self.assert_each_key_applied(out, 2 * 250 + 600)

    def test_launch_add_workers_joins_a_running_elastic_job(self):
        # launch.py --elastic names its job file when it starts; a second launch.py
        # with --add-workers 1 --join FILE starts a worker that joins the running
        # soak (its keys and address come from the file) and trains to its end:
        # exact values every round on the job's workers, as with a joiner started
        # by hand. A bad --join names itself.
        metrics = launch_hosts.free_port_run(5)
        self.env.update(TESSERA_BIGARRAY_BOUND='1000')
        adder = []

        def add(m):
            self.wait_formed(metrics)
            adder.append(subprocess.Popen(
                [sys.executable, base.LAUNCH, '--add-workers', '1', '--join', m.group(1),
                 '--env', 'SOAK_JOIN:1', CHECK_WORKER, 'soak', '400'],
                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

        code, out = self.run_acting_on(
            ['-n', '2', '-s', '2', '--elastic', '2:3', '--metrics-port', str(metrics),
             '--env-worker', 'SOAK_JOINER:2', CHECK_WORKER, 'soak', '200', '20'],
            r'to add workers while it runs: launch.py --add-workers N --join (\S+) COMMAND',
            add, timeout=150)
        added_out = self.adder_output(adder, out, timeout=120)
        self.assertEqual(code, 0, out + added_out)
        self.assertIn('launch.py: adding 1 worker(s) to the elastic job of', added_out)
        self.assertIn('[added worker 0] soak joined: rank 2, 400 rounds', added_out)
        self.assertRegex(out, r'\[scheduler\] .*joins the job \(join 1\): 3 of at most 3 '
                              r'worker\(s\) in it')
        self.assert_soak_checksums_agree(out, 2)
        self.assert_each_key_applied(out, 2 * 200 + 400)
        bad = subprocess.run([sys.executable, base.LAUNCH, '--add-workers', '1', '--join',
                              os.path.join(self.tmp.name, 'none.json'), CHECK_WORKER, 'soak'],
                             env=self.env, capture_output=True, text=True, timeout=30)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn('--join %s: cannot read the job file' %
                      os.path.join(self.tmp.name, 'none.json'), bad.stderr)

    def test_replicated_server_leaving_on_sigterm_hands_its_slices_to_their_replicas(self):
        # 3 servers, --replicas 2 (every slice on two servers), 2 workers in a soak
        # checked exactly every round. After round 40, launch.py's server 1 gets
        # SIGTERM: the scheduler takes its goodbye (each slice keeps a live
        # replica), its slices fail over, and it exits 0. Then server 2 gets
        # SIGTERM: without it a chain would have no live replica, so it is refused
        # and serves on. The job ends 0 with equal checksums: no push was lost or
        # applied twice.
        self.env.update(TESSERA_BIGARRAY_BOUND='1000', SOAK_PRINT_ROUNDS='1')
        sigterm = self.signalling_server
        code, out = self.run_acting_on_each(
            ['-n', '2', '-s', '3', '--replicas', '2', CHECK_WORKER, 'soak', '250', '10'],
            [(r'^\[worker \d\] round 40 done at', sigterm(1)),
             (r'left the job \(it said goodbye\); its key slices fail over', sigterm(2))],
            timeout=150)
        self.assertEqual(code, 0, out)
        self.assertRegex(out, r'\[scheduler\] .*server \d \(id \d+ at [^)]*\) left the job '
                              r'\(it said goodbye\); its key slices fail over to their next '
                              r'replica \(TESSERA_REPLICAS=2\)')
        self.assertRegex(out, r'\[server \d\] .*left the job \(SIGTERM\): its key slices fail '
                              r'over to their replicas')
        self.assertRegex(out, r"\[server \d\] .*not leaving: server \d \(id \d+ at [^)]*\) "
                              r'cannot leave: the key slices placed on server \d would have no '
                              r'live replica left \(servers \d, \d, TESSERA_REPLICAS=2\); '
                              r'serving on')
        self.assertEqual(len(re.findall(r'left the job \(it said goodbye\)', out)), 1, out)
        self.assertNotIn('launch.py: server 1', out)  # exited 0: nothing to say
        self.assert_soak_checksums_agree(out, 2)
        self.assertEqual(marked_pids(self.mark), [])

    def test_servers_added_to_a_running_job_take_ranks_and_their_slices(self):
        # 2 servers of at most 4 (--max-servers 4, --replicas 2): the servers take
        # ranks 0 and 2, and ranks 1 and 3 have their slices answered by their
        # replicas. A second launch.py with --add-servers 2 --join FILE starts two
        # servers while the soak runs: each takes a rank without a server, catches up
        # by state transfer and takes back its place in its chains (a hand-back at a
        # round boundary), so it answers for its rank's slices. Then launch.py's
        # server 0 leaves (SIGTERM): its slices fail over to their replicas. The
        # workers check every round's values exactly; the job and the adder end 0.
        # The servers come after the start-up deadline (TESSERA_START_TIMEOUT=2):
        # a node that takes a rank later is not held to it.
        metrics = launch_hosts.free_port_run(5)
        self.env.update(TESSERA_BIGARRAY_BOUND='1000', SOAK_PRINT_ROUNDS='1',
                        TESSERA_START_TIMEOUT='2')
        adder = []

        def sigterm(m):
            pid = node_pid(self.mark, 'server', 0)
            self.assertIsNotNone(pid, 'server 0 is not running')
            sys.stderr.write('SIGTERM to server 0 (pid %d)\n' % pid)
            os.kill(pid, signal.SIGTERM)

        took_back = (r'\[scheduler\] .*\(replacement [12], hand-back in [^)]*\): it '
                     r'answers for the slices of rank [13] again')
        code, out = self.run_acting_on_each(
            ['-n', '2', '-s', '2', '--replicas', '2', '--max-servers', '4',
             '--metrics-port', str(metrics), CHECK_WORKER, 'soak', '600', '20'],
            [(r'to add servers while it runs: launch.py --add-servers N --join (\S+)$',
              self.adding_servers(metrics, 2, adder)),
             # Both added servers took back their place, in either order (under
             # TSan the second replacement finished first and server 0's leave
             # then found its partner in the chain still catching up).
             (took_back, lambda m: None),
             (took_back, sigterm)],
            timeout=180)
        added_out = self.adder_output(adder, out)
        self.assertEqual(code, 0, out + added_out)
        self.assertIn('replicated job (TESSERA_REPLICAS=2, 2 of 4 server rank(s) with a '
                      'server)', out)
        self.assertRegex(out, r'\[scheduler\] .*job formed with 2 of at most 4 server\(s\) '
                              r'\(TESSERA_MAX_SERVERS\): server rank\(s\) 1, 3 wait for a '
                              r'server')
        self.assertIn('launch.py: adding 2 server(s) to the running job of', added_out)
        taken = re.findall(r'\[scheduler\] .*server ([13]) \(id \d+ at [^)]*\) \(host [^)]*\) '
                           r'takes server rank \1, which had no server \(replacement [12]\)',
                           out)
        self.assertEqual(sorted(taken), ['1', '3'], out)
        self.assertEqual(len(re.findall(r'\[scheduler\] .*took back its place in the chains '
                                        r'of its key slices', out)), 2, out)
        # Each added server answered for slices of its own (and applied pushes).
        for i in range(2):
            self.assertRegex(added_out, r'\[added server %d\] .*hand-back: this server '
                                        r'answers for \d+ key slice\(s\) of its chains '
                                        r'again' % i)
            m = re.search(r'\[added server %d\] .*pushes applied (\d+)' % i, added_out)
            self.assertIsNotNone(m, added_out)
            self.assertGreater(int(m.group(1)), 0, added_out)
        # launch.py's server 0 (start order 0: rank 0).
        self.assertRegex(out, r'\[scheduler\] .*server 0 \(id \d+ at [^)]*\) left the job '
                              r'\(it said goodbye\); its key slices fail over')
        self.assertRegex(out, r'\[server 0\] .*left the job \(SIGTERM\): its key slices fail '
                              r'over to their replicas')
        self.assert_soak_checksums_agree(out, 2)
        self.assertEqual(marked_pids(self.mark), [])
        bad = subprocess.run([sys.executable, base.LAUNCH, '--add-servers', '1', '--join',
                              os.path.join(self.tmp.name, 'none.json')],
                             env=self.env, capture_output=True, text=True, timeout=30)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn('--join %s: cannot read the job file' %
                      os.path.join(self.tmp.name, 'none.json'), bad.stderr)


    def test_servers_join_and_leave_a_job_with_one_copy_of_each_slice(self):
        # No replicas: --max-servers 4 with -s 2 places the slices over 4 server
        # ranks; launch.py's servers take ranks 0 and 2 (and it names them so), and
        # ranks 1 and 3 have their slices answered by the next rank with a server.
        # launch.py --add-servers 2 starts two servers while the soak runs: each receives the
        # slices it will answer for from the server answering for them (state
        # transfer, rounds going on), then takes them at a round boundary. Then
        # launch.py's two servers leave on SIGTERM, one after the other: each
        # sends its slices to the next server and stops them at their boundaries,
        # and only then is it marked left. The two added servers end holding every
        # slice. The workers check every round's values exactly.
        metrics = launch_hosts.free_port_run(5)
        self.env.update(TESSERA_BIGARRAY_BOUND='1000', SOAK_PRINT_ROUNDS='1',
                        TESSERA_START_TIMEOUT='2')
        adder = []
        sigterm = self.signalling_server
        code, out = self.run_acting_on_each(
            ['-n', '2', '-s', '2', '--max-servers', '4', '--metrics-port', str(metrics),
             CHECK_WORKER, 'soak', '700', '20'],
            [(r'to add servers while it runs: launch.py --add-servers N --join (\S+)$',
              self.adding_servers(metrics, 2, adder)),
             (r'\[scheduler\] .*answers for the key slices moved to it \(server [13] of 4, '
              r'replacement 2,', sigterm(0)),
             (r'\[scheduler\] .*left the job \(it said goodbye; its key slices moved in',
              sigterm(1))],
            timeout=180)
        added_out = self.adder_output(adder, out)
        self.assertEqual(code, 0, out + added_out)
        self.assertIn('job with one copy of each key slice (TESSERA_MAX_SERVERS=4, 2 of 4 '
                      'server rank(s) with a server); to add servers', out)
        self.assertRegex(out, r'\[scheduler\] .*job formed with 2 of at most 4 server\(s\) '
                              r'\(TESSERA_MAX_SERVERS\): server rank\(s\) 1, 3 wait for a '
                              r'server .*the next rank with a server answers for their key '
                              r'slices until then')
        self.assertEqual(len(re.findall(r'\[scheduler\] .*answers for the key slices moved '
                                        r'to it \(server [13] of 4', out)), 2, out)
        # Both of launch.py's servers left after their slices moved, and the added
        # servers took them; nothing failed over and nothing was declared dead.
        self.assertEqual(len(re.findall(r'\[scheduler\] .*server [02] \(id \d+ at [^)]*\) '
                                        r'left the job \(it said goodbye; its key slices '
                                        r'moved in [^)]*\); the next server answers for its '
                                        r'key slices', out)), 2, out)
        for rank in (0, 2):  # launch.py names its servers by their ranks
            self.assertRegex(out, r'\[server %d\] .*left the job \(SIGTERM\): its key '
                                  r'slices moved to the other servers' % rank)
        self.assertEqual(len(re.findall(r'\[added server \d\] .*server\(s\) [02] left: this '
                                        r'server now answers for \d+ key slice\(s\) that '
                                        r'moved here', added_out)), 2, added_out)
        for i in range(2):
            m = re.search(r'\[added server %d\] .*pushes applied (\d+)' % i, added_out)
            self.assertIsNotNone(m, added_out)
            self.assertGreater(int(m.group(1)), 0, added_out)
        # What they gave to the added servers they dropped (memory given back).
        self.assertRegex(out, r'\[server [02]\] .*key slice\(s\) of this server\'s moved to '
                              r'the server that joined \(this server drops its copy\)')
        self.assertNotIn('declared dead', out + added_out)
        self.assertNotIn('fail over', out + added_out)
        self.assert_soak_checksums_agree(out, 2)
        self.assertEqual(marked_pids(self.mark), [])

    def test_one_copy_last_server_stays_and_a_death_ends_the_job_naming_it(self):
        # --max-servers 2 with -s 2 and no replicas: server 0 leaves on SIGTERM
        # (its slices move to server 1); server 1, the last one, is refused and
        # serves on; stopped (SIGSTOP: silent, as a machine that is gone), it is
        # declared dead with the only copy of every slice and the scheduler ends
        # the job non-zero, saying so.
        self.env.update(TESSERA_BIGARRAY_BOUND='1000', SOAK_PRINT_ROUNDS='1',
                        PS_HEARTBEAT_INTERVAL='0.5', PS_HEARTBEAT_TIMEOUT='2')
        signal_server = self.signalling_server

        code, out = self.run_acting_on_each(
            ['-n', '2', '-s', '2', '--max-servers', '2', CHECK_WORKER, 'soak', '3000', '10'],
            [(r'^\[worker \d\] round 40 done at', signal_server(0, signal.SIGTERM)),
             (r'left the job \(it said goodbye; its key slices moved in',
              signal_server(1, signal.SIGTERM)),
             (r'not leaving: .*cannot leave', signal_server(1, signal.SIGSTOP))],
            timeout=120)
        self.assertNotEqual(code, 0, out)
        self.assertRegex(out, r'\[server 1\] .*not leaving: server \d \(id \d+ at [^)]*\) '
                              r'cannot leave: it is the last server that holds key slices, '
                              r'and they would have nowhere to go \(TESSERA_REPLICAS=1\); '
                              r'serving on')
        self.assertRegex(out, r'\[scheduler\] .*server \d \(id \d+ at [^)]*\) stopped '
                              r'heart-beating: .*; it held the only copy of the key slices it '
                              r'answered for \(TESSERA_REPLICAS=1; a server leaves such a job '
                              r'by SIGTERM, which moves them first\); ending the job')
        self.assertEqual(soak_checksums(out), [])  # no worker finished
        self.assertEqual(marked_pids(self.mark), [])


if __name__ == '__main__':
    base.main()
