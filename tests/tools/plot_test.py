#!/usr/bin/env python3
"""tools/plot.py on a short real job's output.

A 2-worker, 1-server tessera-worker job (2 epochs of 2048 Fashion-MNIST images)
writes its traces (TESSERA_TRACE) and metrics (--metrics-out); a short
tessera-bench --json run gives bench figures. Each subcommand must exit 0 and
write a PNG (signature, IHDR size as its figure size and dpi say) whose summary
line counts what the inputs hold; bad inputs are exit 2 naming the file.

Exit 77 (ctest: skipped) when no interpreter here has matplotlib.

Run by ctest (plot_tool); by hand:
    TESSERA_BUILD_DIR=build python3 tests/tools/plot_test.py -v
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.environ.get('TESSERA_SOURCE_DIR',
                        os.path.dirname(os.path.dirname(os.path.dirname(
                            os.path.abspath(__file__)))))
BUILD = os.environ.get('TESSERA_BUILD_DIR', os.path.join(SOURCE, 'build'))
LAUNCH = os.path.join(SOURCE, 'tools', 'launch.py')
PLOT = os.path.join(SOURCE, 'tools', 'plot.py')

EPOCHS = 2
TRAIN = 2048
BATCH = 64
STEPS = EPOCHS * (TRAIN // 2 // BATCH)  # per worker: the subset is split over 2
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'
DPI = 60


def has_matplotlib(python):
    return subprocess.run([python, '-c', 'import matplotlib'],
                          capture_output=True).returncode == 0


def png_size(path):
    """(width, height) from the IHDR chunk; fails on anything but a PNG."""
    with open(path, 'rb') as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b'IHDR':
        raise AssertionError('%s is not a PNG: %r' % (path, head))
    return struct.unpack('>II', head[16:24])


class PlotToolTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix='tessera-plot-test-')
        env = dict(os.environ, OPENBLAS_NUM_THREADS='1',
                   TESSERA_TRACE=os.path.join(cls.dir, 'trace-{role}-{rank}.json'))
        job = subprocess.run(
            [sys.executable, LAUNCH, '-n', '2', '-s', '1', '--launcher', 'local',
             os.path.join(BUILD, 'worker', 'tessera-worker'), '--epochs', str(EPOCHS),
             '--train-subset', str(TRAIN), '--test-subset', '256', '--batch-size', str(BATCH),
             '--log-every', '1000',
             '--metrics-out', os.path.join(cls.dir, 'metrics-{rank}.json')],
            env=env, capture_output=True, text=True, timeout=120)
        cls.job_output = job.stdout + job.stderr
        cls.job_rc = job.returncode
        bench = subprocess.run(
            [os.path.join(BUILD, 'tools', 'bench', 'tessera-bench'), '--json',
             '--sizes=4K,64K', '--jobs=1x1:none', '--ops=push,pushpull', '--inflight=1,4',
             '--seconds=0.1', '--log-dir=' + cls.dir],
            capture_output=True, text=True, timeout=120)
        cls.bench_rc = bench.returncode
        cls.bench_output = bench.stderr
        with open(os.path.join(cls.dir, 'bench.json'), 'w') as f:
            f.write(bench.stdout)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def plot(self, *args):
        return subprocess.run([sys.executable, PLOT] + list(args), capture_output=True,
                              text=True, timeout=60)

    def draw(self, *args):
        """Runs plot.py; expects exit 0 and a PNG; returns (summary, width, height)."""
        out = args[args.index('-o') + 1]
        got = self.plot(*args)
        self.assertEqual(got.returncode, 0, got.stdout + got.stderr)
        self.assertEqual(got.stderr, '')
        self.assertTrue(got.stdout.startswith(out + ': '), got.stdout)
        width, height = png_size(out)
        self.assertGreater(os.path.getsize(out), 5000)  # a drawing, not an empty canvas
        return got.stdout[len(out) + 2:].strip(), width, height

    def setUp(self):
        self.assertEqual(self.job_rc, 0, self.job_output)

    def test_steps_from_traces(self):
        traces = [self.path('trace-worker-%d.json' % r) for r in (0, 1)]
        summary, width, height = self.draw('steps', *traces, '-o', self.path('steps.png'),
                                           '--dpi', str(DPI))
        self.assertEqual(summary, 'worker 0: %d steps; worker 1: %d steps' % (STEPS, STEPS))
        # figsize (8, 2.2 per worker + 0.9) inches at DPI.
        self.assertAlmostEqual(width, 8 * DPI, delta=1)
        self.assertAlmostEqual(height, (2.2 * 2 + 0.9) * DPI, delta=1)
        summary, _, one_high = self.draw('steps', traces[1], '-o', self.path('steps1.png'),
                                         '--dpi', str(DPI))
        self.assertEqual(summary, 'worker 1: %d steps' % STEPS)
        self.assertAlmostEqual(one_high, (2.2 + 0.9) * DPI, delta=1)

    def test_server_trace_marks_the_rank_each_round_waited_for(self):
        traces = [self.path('trace-worker-%d.json' % r) for r in (0, 1)]
        server = self.path('trace-server-0.json')
        with open(server) as f:
            events = json.load(f)['traceEvents']
        waited = [e['args']['waited_for'] for e in events
                  if e.get('ph') == 'b' and e.get('name') == 'round']
        self.assertGreater(len(waited), 0)
        self.assertTrue(set(waited) <= {0, 1}, waited)
        counts = {r: waited.count(r) for r in set(waited)}
        last = max(counts.items(), key=lambda x: (x[1], -x[0]))
        summary, _, height = self.draw('steps', *traces, server, '-o',
                                       self.path('steps-rounds.png'), '--dpi', str(DPI))
        self.assertEqual(summary, 'worker 0: %d steps; worker 1: %d steps; server 0: %d '
                         'rounds, the last to push: rank %d in %.0f%%'
                         % (STEPS, STEPS, len(waited), last[0],
                            100.0 * last[1] / len(waited)))
        self.assertAlmostEqual(height, (2.2 * 3 + 0.9) * DPI, delta=1)
        alone = self.plot('steps', server, '-o', self.path('rounds-alone.png'))
        self.assertEqual(alone.returncode, 2)
        self.assertIn('%s: a tessera-server trace marks' % server, alone.stderr)

    def test_steps_from_metrics_are_per_epoch(self):
        metrics = [self.path('metrics-%d.json' % r) for r in (0, 1)]
        summary, width, _ = self.draw('steps', *metrics, '-o', self.path('steps-epochs.png'))
        self.assertEqual(summary, 'worker 0: %d epochs; worker 1: %d epochs'
                         % (EPOCHS, EPOCHS))
        self.assertAlmostEqual(width, 8 * 90, delta=1)  # the default dpi, 90

    def test_epochs_throughput_and_accuracy(self):
        metrics = [self.path('metrics-%d.json' % r) for r in (1, 0)]
        summary, width, height = self.draw('epochs', *metrics, '-o', self.path('epochs.png'),
                                           '--dpi', str(DPI))
        logs = []
        for path in metrics:
            with open(path) as f:
                logs.append(json.load(f)['epoch_log'])
        last = EPOCHS - 1
        job_speed = sum(log[last]['samples_per_second'] for log in logs)
        rank0 = [log for log, path in zip(logs, metrics) if path.endswith('-0.json')][0]
        self.assertEqual(summary, '2 worker(s), epochs 0..%d; epoch %d: %.1f samples/s (job), '
                         'validation accuracy %.4f' % (last, last, job_speed,
                                                       rank0[last]['validation_accuracy']))
        self.assertGreater(rank0[last]['validation_accuracy'], 0.3)  # it learned something
        self.assertAlmostEqual(width, 10 * DPI, delta=1)
        self.assertAlmostEqual(height, 3.8 * DPI, delta=1)

    def test_bench_bars_beside_the_baseline(self):
        self.assertEqual(self.bench_rc, 0, self.bench_output)
        # push and pushpull at 4K and 64K, and the 4 KB pushpull round trip.
        summary, width, height = self.draw('bench', self.path('bench.json'), '-o',
                                           self.path('bench.png'), '--dpi', str(DPI))
        self.assertEqual(summary, '1 job(s); 4 throughput and 1 round-trip bar pairs')
        # 4 throughput bar pairs and the round trip's panel (2 wide), one job.
        self.assertAlmostEqual(width, (2.5 + 0.75 * (4 + 2)) * DPI, delta=1)
        self.assertAlmostEqual(height, (2.6 + 0.6) * DPI, delta=1)

    def test_bad_inputs_are_exit_2_naming_the_file(self):
        bad = self.path('bad.json')
        with open(bad, 'w') as f:
            f.write('{"traceEvents": [')
        missing = self.path('missing.json')
        server_trace = self.path('trace-server-0.json')
        cases = [
            (['steps', bad], '%s: not JSON' % bad),
            (['steps', self.path('trace-worker-0.json'), missing],
             '%s: No such file or directory' % missing),
            (['steps', server_trace],
             "%s: a tessera-server trace marks the rounds of worker traces: give the "
             "workers' TESSERA_TRACE files too" % server_trace),
            (['epochs', self.path('trace-worker-0.json')],
             '%s: expected tessera-worker --metrics-out JSON' % self.path('trace-worker-0.json')),
            (['bench', self.path('metrics-0.json')],
             '%s: expected tessera-bench --json output' % self.path('metrics-0.json')),
        ]
        for args, message in cases:
            out = self.path('never.png')
            got = self.plot(*args, '-o', out)
            self.assertEqual(got.returncode, 2, (args, got.stdout, got.stderr))
            self.assertEqual(got.stderr, 'plot.py: %s' % got.stderr[len('plot.py: '):])
            self.assertIn(message, got.stderr)
            self.assertEqual(len(got.stderr.strip().splitlines()), 1, got.stderr)
            self.assertFalse(os.path.exists(out))
        got = self.plot('steps', self.path('trace-worker-0.json'), '-o', self.path('x.svg'))
        self.assertEqual(got.returncode, 2)
        self.assertIn('expected a .png file name', got.stderr)


if __name__ == '__main__':
    if not has_matplotlib(sys.executable) and not (
            os.path.exists('/usr/bin/python3') and has_matplotlib('/usr/bin/python3')):
        print('SKIPPED: matplotlib is not installed (Debian: apt-get install '
              'python3-matplotlib; tools/install-deps.sh installs it)')
        sys.exit(77)
    unittest.main()
