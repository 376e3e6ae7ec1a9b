#!/usr/bin/env python3
"""tools/bench/shaped_link.py: a brief run, a killed run, and a refused flag.

  test_two_modes_at_one_rate: `shaped_link.py --rates 1gbit --modes none,push2bit
      --runs 1 --epochs 1 -- --train-subset 4000 --test-subset 1000` exits 0; its
      JSON has one run and one summary row per mode; 2-bit pushes send at most a
      tenth of the uncompressed bytes per worker; the link check saw no more
      than the rate (the links are shaped); no namespace, link or process of
      the run is left.
  test_hosts_report_groups_each_host: `--rates 1gbit --hosts 2 --workers 4
      --servers 2 --local-group 0,1 --modes none --runs 1 --epochs 1` places
      two workers and one server on each host; the grouped job's workers push
      and pull half the ungrouped job's bytes per host and step (groups of two),
      and its hosts' links send at most 0.6x the ungrouped job's; the run
      reads every host's link counters and the servers' CPU per round; nothing
      is left.
  test_killed_tool_leaves_nothing: the tool SIGKILLed while its first job runs;
      its guard removes the namespaces, the bridge, the veths and every process
      within GUARD_BOUND_S.
  test_refused_worker_flag_exits_4: a worker flag tessera-worker does not take
      (after `--`) stops the tool before anything is built, with exit status 4
      and a line naming the flag.

Needs root and `ip netns` (the tool exits 3 without them; the tests then print
"shaped_link_test: SKIPPED: <why>"), a build with tessera-worker and the
Fashion-MNIST data. ctest label: multihost.

    TESSERA_BUILD_DIR=build TESSERA_SOURCE_DIR=. python3 tests/multihost/shaped_link_test.py -v

Every run gets its own --tag, so the check for what is left looks only at this
test's names: namespaces and links starting with the tag, and processes whose
environment carries TESSERA_SHAPED_LINK_TAG=<tag> or whose command line names
the run's state file (the guard).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = (os.environ.get('TESSERA_SOURCE_DIR') or
              os.path.normpath(os.path.join(HERE, '..', '..')))
BUILD_DIR = os.path.abspath(os.environ.get('TESSERA_BUILD_DIR') or
                            os.path.join(SOURCE_DIR, 'build'))
TOOL = os.path.join(SOURCE_DIR, 'tools', 'bench', 'shaped_link.py')
WORKER = os.path.join(BUILD_DIR, 'worker', 'tessera-worker')
DATA_DIR = os.environ.get('FASHION_MNIST_DIR') or '/usr/share/datasets/fashion-mnist'

SUBSET = ['--train-subset', '4000', '--test-subset', '1000']
RUN_BOUND_S = 150  # the brief run (about 15 s here)
GUARD_BOUND_S = 30  # from the SIGKILL to nothing left
EXIT_NO_SHAPING = 3
EXIT_UNSUPPORTED_FLAG = 4


def tool_argv(tag, *args):
    return [sys.executable, TOOL, '--build', BUILD_DIR, '--tag', tag] + list(args)


def leftovers(tag):
    """Names and processes of the run tagged `tag` that still exist."""
    found = []
    try:
        netns = subprocess.run(['ip', 'netns', 'list'], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, timeout=10).stdout.decode()
        links = subprocess.run(['ip', '-o', 'link', 'show'], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, timeout=10).stdout.decode()
    except (OSError, subprocess.SubprocessError) as e:
        return ['cannot list namespaces or links: %s' % e]
    found += ['namespace ' + l.split()[0] for l in netns.splitlines()
              if l.split() and l.split()[0].startswith(tag)]
    found += ['link ' + l.split(':')[1].strip().split('@')[0] for l in links.splitlines()
              if ':' in l and l.split(':')[1].strip().startswith(tag)]
    marker = ('TESSERA_SHAPED_LINK_TAG=%s' % tag).encode()
    state = ('tessera-shaped-%s.json' % tag).encode()
    for pid in os.listdir('/proc'):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open('/proc/%s/environ' % pid, 'rb') as f:
                environ = f.read().split(b'\0')
            with open('/proc/%s/cmdline' % pid, 'rb') as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker in environ or state in cmdline:
            found.append('process %s: %s' % (pid, cmdline.replace(b'\0', b' ').decode(
                'utf-8', 'replace').strip()))
    return found


def wait_for_nothing_left(tag, bound_s):
    deadline = time.monotonic() + bound_s
    left = leftovers(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = leftovers(tag)
    return left


def skip_if_no_shaping(test, rc, err):
    if rc == EXIT_NO_SHAPING:
        why = err.strip().splitlines()[-1] if err.strip() else '(no message)'
        sys.stderr.write('shaped_link_test: SKIPPED: %s\n' % why)
        test.skipTest(why)


def setUpModule():
    why = None
    if not os.access(WORKER, os.X_OK):
        why = '%s not built (TESSERA_BUILD_DIR=%s)' % (WORKER, BUILD_DIR)
    elif not os.path.isdir(DATA_DIR):
        why = ('no Fashion-MNIST in %s (Debian: apt-get install dataset-fashion-mnist, or '
               'set FASHION_MNIST_DIR)' % DATA_DIR)
    if why:
        sys.stderr.write('shaped_link_test: SKIPPED: %s\n' % why)
        raise unittest.SkipTest(why)


class ShapedLinkTest(unittest.TestCase):

    def tag(self, suffix):
        return 't%s%d' % (suffix, os.getpid() % 100000)

    def test_two_modes_at_one_rate(self):
        tag = self.tag('a')
        with tempfile.TemporaryDirectory() as tmp:
            out_json = os.path.join(tmp, 'shaped.json')
            argv = tool_argv(tag, '--rates', '1gbit', '--modes', 'none,push2bit', '--runs',
                             '1', '--epochs', '1', '--json', out_json, '--') + SUBSET
            started = time.monotonic()
            try:
                done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, timeout=RUN_BOUND_S)
            finally:
                left = wait_for_nothing_left(tag, 10)
            took = time.monotonic() - started
            out = done.stdout.decode('utf-8', 'replace')
            err = done.stderr.decode('utf-8', 'replace')
            skip_if_no_shaping(self, done.returncode, err)
            sys.stderr.write('\nshaped_link_test: the tool took %.1f s; it printed:\n%s\n'
                             % (took, out))
            self.assertEqual(done.returncode, 0, 'stderr:\n%s' % err)
            self.assertEqual(left, [], 'left behind by the tool')
            with open(out_json) as f:
                record = json.load(f)
        self.assertEqual([(r['rate'], r['mode']) for r in record['runs']],
                         [('1gbit', 'none'), ('1gbit', 'push2bit')])
        summary = record['summary']['1gbit']
        self.assertEqual(sorted(summary), ['none', 'push2bit'])
        none, push2bit = summary['none'], summary['push2bit']
        for mode, row in summary.items():
            for key in ('wall_s', 'job_s', 'samples_per_second', 'bytes_pushed_per_worker',
                        'bytes_pulled_per_worker'):
                self.assertGreater(row[key], 0, '%s: %s' % (mode, key))
            self.assertGreater(row['test_accuracy'], 0.3, mode)  # chance is 0.1
        self.assertAlmostEqual(none['speedup'], 1.0)
        self.assertLessEqual(push2bit['bytes_pushed_per_worker'],
                             none['bytes_pushed_per_worker'] / 10)
        mbit = record['link_check_mbit_s']['1gbit']
        self.assertIsNotNone(mbit, 'the link check failed:\n%s' % err)
        # Unshaped, a veth carries several Gbit/s here; shaped, at most the rate
        # (tbf's 2 ms bucket adds 0.2 % over the second).
        self.assertLess(mbit, 1000 * 1.05, 'the link is not shaped to 1gbit')
        self.assertIn('| push2bit |', out)

    def test_hosts_report_groups_each_host(self):
        tag = self.tag('h')
        with tempfile.TemporaryDirectory() as tmp:
            out_json = os.path.join(tmp, 'hosts.json')
            argv = tool_argv(tag, '--rates', '1gbit', '--hosts', '2', '--workers', '4',
                             '--servers', '2', '--local-group', '0,1', '--modes', 'none',
                             '--runs', '1', '--epochs', '1', '--no-link-check', '--json',
                             out_json, '--', '--fuse-keys', 'on') + SUBSET
            try:
                done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, timeout=RUN_BOUND_S)
            finally:
                left = wait_for_nothing_left(tag, 10)
            out = done.stdout.decode('utf-8', 'replace')
            err = done.stderr.decode('utf-8', 'replace')
            skip_if_no_shaping(self, done.returncode, err)
            self.assertEqual(done.returncode, 0, 'stderr:\n%s' % err)
            self.assertEqual(left, [], 'left behind by the tool')
            with open(out_json) as f:
                record = json.load(f)
        self.assertEqual(record['placement'], {'server_host': [0, 1],
                                               'worker_host': [0, 0, 1, 1]})
        self.assertEqual([(r['mode'], r['local_group']) for r in record['runs']],
                         [('none', '0'), ('none', '1')])
        flat, grouped = record['runs']
        for run in (flat, grouped):
            self.assertEqual(len(run['per_host']), 2)
            for host in run['per_host']:
                self.assertGreater(host['link_tx_per_step'], 0)
            self.assertGreater(run['server_cpu_ms_per_round'] or 0, 0,
                               (run['server_rounds'], run['server_cpu_s'], err))
            self.assertGreater(sum(run['server_rounds']), 0)
        # Groups of two: each key part leaves a host once instead of twice.
        self.assertAlmostEqual(grouped['host_pushed_per_step'],
                               flat['host_pushed_per_step'] / 2, delta=0.01 * 1e6)
        self.assertAlmostEqual(grouped['host_pulled_per_step'],
                               flat['host_pulled_per_step'] / 2, delta=0.01 * 1e6)
        self.assertLess(grouped['host_tx_per_step'], 0.6 * flat['host_tx_per_step'])
        self.assertIn('| none | on |', out)

    def test_killed_tool_leaves_nothing(self):
        tag = self.tag('k')
        argv = tool_argv(tag, '--rates', '1gbit', '--modes', 'none', '--runs', '1',
                         '--epochs', '1000', '--no-link-check', '--') + SUBSET
        with tempfile.TemporaryFile() as errf:
            tool = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errf,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                deadline = time.monotonic() + 60
                while True:
                    errf.seek(0)
                    err = errf.read().decode('utf-8', 'replace')
                    if 'started' in err or tool.poll() is not None:
                        break
                    self.assertLess(time.monotonic(), deadline,
                                    'the first job did not start:\n%s' % err)
                    time.sleep(0.1)
                if tool.poll() is not None:
                    skip_if_no_shaping(self, tool.returncode, err)
                    self.fail('the tool exited %s before its first job:\n%s'
                              % (tool.returncode, err))
                time.sleep(3)  # the job's processes are up and training
                self.assertIsNone(tool.poll(), 'the tool ended early:\n%s' % err)
                before = leftovers(tag)
                running = [l for l in before if l.startswith('process')]
                self.assertTrue(any('tessera-worker' in l for l in running),
                                'no worker running 3 s into the job: %s' % before)
                self.assertTrue(any(l.startswith('namespace') for l in before) and
                                any(l.startswith('link') for l in before),
                                'no namespace or link seen 3 s into the job: %s' % before)
                os.kill(tool.pid, signal.SIGKILL)
                tool.wait()
            finally:
                if tool.poll() is None:
                    os.kill(tool.pid, signal.SIGKILL)
                    tool.wait()
            killed_at = time.monotonic()
            left = wait_for_nothing_left(tag, GUARD_BOUND_S)
            sys.stderr.write('\nshaped_link_test: the guard cleaned up %.1f s after the '
                             'SIGKILL (killed with %d processes running)\n'
                             % (time.monotonic() - killed_at, len(running)))
            self.assertEqual(left, [], 'left %d s after the tool was SIGKILLed'
                             % GUARD_BOUND_S)

    def test_refused_worker_flag_exits_4(self):
        tag = self.tag('f')
        done = subprocess.run(tool_argv(tag, '--rates', '1gbit', '--modes', 'none', '--',
                                        '--no-such-flag', '1'),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, timeout=60)
        err = done.stderr.decode('utf-8', 'replace')
        self.assertEqual(done.returncode, EXIT_UNSUPPORTED_FLAG, err)
        self.assertIn("unknown flag '--no-such-flag'", err)
        self.assertIn('mode none', err)
        self.assertEqual(leftovers(tag), [])


if __name__ == '__main__':
    unittest.main()
