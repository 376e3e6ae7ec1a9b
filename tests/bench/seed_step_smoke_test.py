#!/usr/bin/env python3
"""Smoke test of tools/bench/seed_step.py and seed_step_bench (issue #15), and
of ps_bound_bench (issue #27).

Runs every mode on loopback with tiny shapes (a 1000 x 16 embedding, 16 x 8 and
8 x 1000 dense layers, 2 workers, 2 servers, one timed step after one warm-up)
and a tiny --okrows job, and checks the exit status and that every worker's
bytes per step are exactly what the shapes give. TESSERA_BIGARRAY_BOUND=1000
splits the embedding (by rows) and the 8 x 1000 layer over both servers, so
the sums over parts are checked too. No figure of time is asserted.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.environ.get('TESSERA_SOURCE_DIR',
                        os.path.normpath(os.path.join(os.path.dirname(__file__), '..', '..')))
BUILD = os.environ.get('TESSERA_BUILD_DIR', os.path.join(SOURCE, 'build'))
E, D, H, O = 1000, 16, 8, 1000
FRACTIONS = (0.01, 0.05, 0.2)


def expected_bytes(mode, fraction):
    """(pushed, pulled, pulled as float32) per step per worker."""
    dense = D * H + H * O  # values of the dense layers
    if mode == 'dense':
        b = 4 * (E * D + dense)
        return b, b, b
    k = round(fraction * E)
    if mode == 'rows':
        # Row ids (8 bytes each) and rows float32; dense layers float32.
        return k * (8 + 4 * D) + 4 * dense, 4 * k * D + 4 * dense, 4 * k * D + 4 * dense
    # rows2bit: ids, rows at 2 bits per value (every part's length is a
    # multiple of 16 here, so no padding), dense layers 2-bit both ways (one
    # version per step), pulled rows bfloat16 (2 bytes a value).
    return 8 * k + k * D // 4 + dense // 4, 2 * k * D + dense // 4, 4 * k * D + 4 * dense


class SeedStepSmokeTest(unittest.TestCase):

    def test_every_mode_moves_exactly_the_bytes_of_its_shapes(self):
        with tempfile.TemporaryDirectory(prefix='seed-step-smoke-') as tmp:
            out = os.path.join(tmp, 'figures.json')
            argv = [sys.executable, os.path.join(SOURCE, 'tools', 'bench', 'seed_step.py'),
                    '--build', BUILD, '--steps', '1', '--warmup', '1',
                    '--fractions', ','.join(str(f) for f in FRACTIONS),
                    '--okrows', '10,100', '--ok-keys', '100,1000', '--ok-reps', '1',
                    '--bigarray-bound', '1000', '--tag', 'sm%d' % (os.getpid() % 10000),
                    '--json', out, '--',
                    '--emb-rows=%d' % E, '--emb-dim=%d' % D, '--hidden=%d' % H,
                    '--outputs=%d' % O]
            run = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 timeout=240)
            text = run.stdout.decode('utf-8', 'replace')
            self.assertEqual(run.returncode, 0, text)
            self.assertIn('| dense | all |', text)
            with open(out) as f:
                record = json.load(f)
        jobs = record['rates']['loopback']
        seen = [(j['mode'], j['fraction']) for j in jobs]
        self.assertEqual(seen, [('dense', 0.01)] +
                         [('rows', f) for f in FRACTIONS] + [('rows2bit', f) for f in FRACTIONS])
        for job in jobs:
            want = expected_bytes(job['mode'], job['fraction'])
            self.assertEqual(len(job['worker_metrics']), 2)
            for m in job['worker_metrics']:
                what = '%s at %g, rank %d' % (job['mode'], job['fraction'], m['rank'])
                got = (m['bytes_pushed_per_step'], m['bytes_pulled_per_step'],
                       m['bytes_pulled_float32_per_step'])
                self.assertEqual(got, want, what)
                self.assertEqual(len(m['step_ms']), 1, what)
                if job['mode'] != 'dense':
                    self.assertEqual(m['rows_per_batch'], round(job['fraction'] * E), what)
        ok = record['okrows']['results']
        self.assertEqual([(r['key_rows'], r['k']) for r in ok],
                         [(100, 10), (100, 100), (1000, 10), (1000, 100)])
        for r in ok:
            self.assertEqual(r['bytes'], 2 * r['k'] * (8 + 4 * D))
            # The worker's CPU for an operation: some, and no more than its
            # threads (the caller and ZeroMQ's I/O thread, at most a few
            # more) could spend in its time.
            self.assertGreater(r['median_cpu_ms'], 0)
            self.assertLess(r['median_cpu_ms'], 8 * max(r['ms']) + 1)

    def test_pulls_overlapping_the_pushes_pull_the_same_values(self):
        """--overlap issues each step's pulls before its pushes completed: the
        server holds each pull until the worker's push of that slice is in the
        round's result, so every pulled value (hashed over the timed steps) is
        what the blocking step pulls."""
        hashes = {}
        for overlap in (False, True):
            with tempfile.TemporaryDirectory(prefix='seed-step-overlap-') as tmp:
                out = os.path.join(tmp, 'figures.json')
                argv = [sys.executable, os.path.join(SOURCE, 'tools', 'bench', 'seed_step.py'),
                        '--build', BUILD, '--steps', '3', '--warmup', '1',
                        '--modes', 'dense,rows,rows2bit', '--fractions', '0.05',
                        '--okrows', '100', '--ok-keys', '1000', '--ok-reps', '2',
                        '--bigarray-bound', '1000', '--tag', 'so%d' % (os.getpid() % 10000),
                        '--no-baseline', '--json', out] + \
                    (['--overlap'] if overlap else []) + \
                    ['--', '--emb-rows=%d' % E, '--emb-dim=%d' % D, '--hidden=%d' % H,
                     '--outputs=%d' % O]
                run = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     timeout=240)
                text = run.stdout.decode('utf-8', 'replace')
                self.assertEqual(run.returncode, 0, text)
                with open(out) as f:
                    record = json.load(f)
            got = {}
            for job in record['rates']['loopback']:
                for m in job['worker_metrics']:
                    self.assertEqual(m['overlap'], overlap)
                    got[(job['mode'], m['rank'])] = m['pulled_fnv']
            got['okrows'] = record['okrows']['pulled_fnv']
            self.assertEqual(len(got), 7, got)
            hashes[overlap] = got
        self.assertEqual(hashes[True], hashes[False])
        # The ranks pull the same weights of the dense layers but their own
        # rows: the hashes differ between modes (a hash of nothing would not).
        self.assertNotEqual(hashes[True][('dense', 0)], hashes[True][('rows2bit', 0)])


class PsBoundBenchTest(unittest.TestCase):
    """ps_bound_bench: a bad flag names itself and what was expected; a tiny
    run prints one row of rates whose ratios are the rates' quotients, and the
    medians. No figure of time is asserted."""

    BENCH = os.path.join(BUILD, 'tools', 'bench', 'ps_bound_bench')

    def test_a_bad_flag_names_itself(self):
        for flag in ('--window=0', '--row-length=3', '--optimizer=nesterov', '--span'):
            run = subprocess.run([self.BENCH, flag], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, timeout=30)
            self.assertEqual(run.returncode, 2, flag)
            err = run.stderr.decode()
            self.assertIn('bad flag %s (expected' % flag, err)
            self.assertIn('--window=N>0', err)

    def test_a_tiny_run_prints_its_rates_and_ratios(self):
        run = subprocess.run([self.BENCH, '--mb=8', '--runs=2', '--span-mb=64'],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        out = run.stdout.decode()
        self.assertEqual(run.returncode, 0, out + run.stderr.decode())
        rows = re.findall(r'^\| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) '
                          r'\| ([\d.]+) \|$', out, re.M)
        self.assertEqual([r[0] for r in rows], ['1', '2'], out)
        h = 0.005  # every figure is printed to two places
        for _, raw, ideal, ideal_x, rows_gbps, rows_x in rows:
            raw = float(raw)
            self.assertGreater(raw, h, out)
            for rate, ratio in ((float(ideal), float(ideal_x)),
                                (float(rows_gbps), float(rows_x))):
                self.assertGreater(rate, 0, out)
                # The ratio of the unrounded rates, rounded: within what the
                # printed rates' rounding allows.
                lo = max(rate - h, 0) / (raw + h) - h
                hi = (rate + h) / (raw - h) + h
                self.assertTrue(lo <= ratio <= hi, (rate, raw, ratio, out))
        self.assertRegex(out, r'\nmedian: ideal [\d.]+x raw, rows [\d.]+x raw\n')
        self.assertIn('8 MB moved per run, 1 MiB messages, window 16, store 64 MiB, '
                      'rows of 1024, optimizer "sgd lr=0.1"', out)


if __name__ == '__main__':
    unittest.main()
