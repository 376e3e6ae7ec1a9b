#!/usr/bin/env python3
"""TESSERA_TRACE: Chrome trace-event JSON of a short job's processes.

A 2-worker, 2-server job of metrics_worker (a known number of pushes, pulls
and rounds) writes one trace per process; each must parse as JSON, every push,
pull, pushpull and init must have exactly one begin and one end event (same
id, end after begin, with key, bytes, server and compression arguments), and
the counts must be the job's. A short tessera-worker job's traces must hold,
per training step, one step span with data-wait, forward, backward and
comm-wait inside it, and in the forward a layer-wait span per layer (the
default --wait-pulls layer). An unwritable TESSERA_TRACE is exit 2 naming it.

Run by ctest (trace_job); by hand:
    TESSERA_BUILD_DIR=build python3 tests/metrics/trace_test.py -v
"""

import collections
import decimal
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.environ.get('TESSERA_SOURCE_DIR',
                        os.path.dirname(os.path.dirname(os.path.dirname(
                            os.path.abspath(__file__)))))
BUILD = os.environ.get('TESSERA_BUILD_DIR', os.path.join(SOURCE, 'build'))
LAUNCH = os.path.join(SOURCE, 'tools', 'launch.py')

ROUNDS = 5
LENGTHS = {0: 100, 1: 1000, 2: 300, 3: 4000}  # metrics_worker's keys
BIGARRAY_BOUND = 2000  # key 3 is split over the two servers


def load(path):
    # Times are exact nanoseconds written as microseconds with three decimals
    # (about 1.8e15 us since the epoch): a double keeps only about a quarter
    # of a microsecond of them, so read them as decimals and compare exactly.
    with open(path) as f:
        return json.load(f, parse_float=decimal.Decimal)


def spans(events, name):
    """{id: (begin, end)} of async spans; fails on an id begun or ended twice."""
    begins, ends = {}, {}
    for e in events:
        if e.get('name') != name or e['ph'] not in 'be':
            continue
        side = begins if e['ph'] == 'b' else ends
        if e['id'] in side:
            raise AssertionError('%s %s: two %r events' % (name, e['id'], e['ph']))
        side[e['id']] = e
    if set(begins) != set(ends):
        raise AssertionError('%s: unmatched ids: begun %s, ended %s'
                             % (name, sorted(set(begins) - set(ends)),
                                sorted(set(ends) - set(begins))))
    return {i: (begins[i], ends[i]) for i in begins}


class TraceJobTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix='tessera-trace-test-')

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def launch(self, command, extra_env, servers=2):
        env = dict(os.environ)
        env.update(extra_env)
        env['TESSERA_TRACE'] = os.path.join(self.dir, 'trace-{role}-{rank}.json')
        got = subprocess.run([sys.executable, LAUNCH, '-n', '2', '-s', str(servers),
                              '--launcher', 'local'] + command,
                             env=env, capture_output=True, text=True, timeout=240)
        self.assertEqual(got.returncode, 0, got.stdout + got.stderr)
        names = sorted(os.listdir(self.dir))
        expected = ['trace-scheduler-0.json'] + \
            ['trace-server-%d.json' % s for s in range(servers)] + \
            ['trace-worker-0.json', 'trace-worker-1.json']
        self.assertTrue(set(expected) <= set(names), names)
        traces = {}
        for name in expected:
            trace = load(os.path.join(self.dir, name))
            role, rank = name[len('trace-'):-len('.json')].split('-')
            self.assertEqual(trace['otherData']['role'], role)
            self.assertEqual(trace['otherData']['rank'], int(rank))
            self.assertEqual(trace['otherData']['dropped_events'], 0)
            events = trace['traceEvents']
            process = [e for e in events if e.get('name') == 'process_name']
            self.assertEqual(len(process), 1)
            self.assertEqual(process[0]['args']['name'],
                             'scheduler' if role == 'scheduler' else '%s %s' % (role, rank))
            for e in events:
                self.assertIn(e['ph'], 'XbeM', e)
                if e['ph'] == 'X':
                    self.assertGreaterEqual(e['dur'], 0, e)
            traces[(role, int(rank))] = events
        return traces

    def test_every_request_has_one_span_and_the_counts_are_the_jobs(self):
        open(os.path.join(self.dir, 'go'), 'w').close()  # no scrape: close at once
        traces = self.launch([os.path.join(BUILD, 'tests', 'metrics', 'metrics_worker'),
                              self.dir, str(ROUNDS)],
                             {'TESSERA_BIGARRAY_BOUND': str(BIGARRAY_BOUND)})
        R = ROUNDS
        for rank in range(2):
            events = traces[('worker', rank)]
            push, pull = spans(events, 'push'), spans(events, 'pull')
            pushpull, init = spans(events, 'pushpull'), spans(events, 'init')
            # Keys 0 and 1 one request a push, key 3 two (one per server).
            self.assertEqual(len(push), 4 * R, rank)
            self.assertEqual(len(pushpull), R, rank)
            self.assertEqual(len(pull), 5 + 4 * R, rank)
            self.assertEqual(len(init), 5 if rank == 0 else 0, rank)  # rank 0 stores
            # set_optimizer and goodbye to both servers; rank 0 asks KV_STATS.
            self.assertEqual(len(spans(events, 'request')), 6 if rank == 0 else 4)
            per_key = collections.Counter()
            for b, e in list(push.values()) + list(pushpull.values()):
                self.assertGreaterEqual(e['ts'], b['ts'])
                self.assertEqual(e['args']['ok'], 1)
                key = b['args']['key']
                per_key[key] += 1
                self.assertEqual(b['args']['compressed'], 0)
                self.assertIn(b['args']['server'], (0, 1))
                part = LENGTHS[key] // (2 if key == 3 else 1)
                self.assertEqual(b['args']['bytes'], 4 * part, b)
            self.assertEqual(per_key, {0: R, 1: R, 2: R, 3: 2 * R})
            for b, e in pull.values():
                key = b['args']['key']
                part = LENGTHS[key] // (2 if key == 3 else 1)
                self.assertEqual(e['args']['reply_bytes'], 4 * part, e)
                self.assertEqual(b['args']['bytes'], 0)
            for b, e in pushpull.values():
                self.assertEqual(e['args']['reply_bytes'], 4 * LENGTHS[2])
            waits = [e for e in events if e.get('name') == 'wait' and e['ph'] == 'X']
            # Every operation metrics_worker waits for: pulls, pushes,
            # pushpulls, settings and goodbye (and rank 0's inits and KV_STATS).
            self.assertEqual(len(waits), (4 + 3 * R) + 4 * R + 2 + (5 if rank == 0 else 0))
        rounds = 0
        for s in range(2):
            events = traces[('server', s)]
            round_spans = spans(events, 'round')
            updates = [e for e in events if e.get('name') == 'update' and e['ph'] == 'X']
            self.assertEqual(len(updates), len(round_spans))
            keys = collections.Counter(b['args']['key'] for b, _ in round_spans.values())
            for key, n in keys.items():
                self.assertEqual(n, R, 'server %d key %d' % (s, key))
            for b, e in round_spans.values():
                self.assertLessEqual(b['ts'], e['ts'])
                self.assertEqual(b['args']['workers'], 2)
            rounds += len(round_spans)
        self.assertEqual(rounds, R * 5)  # keys 0, 1, 2 and both halves of key 3

    def test_training_steps_hold_their_phases(self):
        traces = self.launch(
            [os.path.join(BUILD, 'worker', 'tessera-worker'), '--epochs', '2',
             '--train-subset', '2048', '--test-subset', '256', '--batch-size', '64',
             '--gc-type', '2bit', '--log-every', '1000'],
            {'OPENBLAS_NUM_THREADS': '1'}, servers=1)
        steps_per_epoch = 2048 // 2 // 64
        for rank in range(2):
            events = traces[('worker', rank)]
            by_name = collections.defaultdict(list)
            for e in events:
                if e['ph'] == 'X':
                    by_name[e['name']].append(e)
            steps = by_name['step']
            self.assertEqual(len(steps), 2 * steps_per_epoch)
            self.assertEqual(sorted((s['args']['epoch'], s['args']['batch']) for s in steps),
                             [(e, b) for e in range(2) for b in range(steps_per_epoch)])
            for phase in ('data-wait', 'forward', 'backward', 'comm-wait', 'commit'):
                self.assertEqual(len(by_name[phase]), len(steps), phase)
            # Three layers: an issue span each (in backward), with each of the
            # layer's two keys compressed inside it.
            self.assertEqual(len(by_name['issue']), 3 * len(steps))
            # --wait-pulls layer (the default): the wait for each layer's pushes and
            # pulls of the step before, inside the forward, layers 0, 1, 2.
            self.assertEqual(len(by_name['layer-wait']), 3 * len(steps))
            forwards = sorted((f['ts'], f['ts'] + f['dur']) for f in by_name['forward'])
            waits = sorted(by_name['layer-wait'], key=lambda e: e['ts'])
            for i, (begin, end) in enumerate(forwards):
                inside = waits[3 * i:3 * i + 3]
                self.assertEqual([w['args']['layer'] for w in inside], [0, 1, 2])
                for w in inside:
                    self.assertTrue(begin <= w['ts'] and w['ts'] + w['dur'] <= end, (w, begin))
            self.assertEqual(len(by_name['compress']), 6 * len(steps))
            main = steps[0]['tid']
            for step in steps:
                self.assertEqual(step['tid'], main)
                begin = step['ts']
                end = begin + step['dur']
                inside = [e for name in ('data-wait', 'forward', 'backward', 'comm-wait')
                          for e in by_name[name]
                          if begin <= e['ts'] and e['ts'] + e['dur'] <= end]
                self.assertEqual(sorted(e['name'] for e in inside),
                                 ['backward', 'comm-wait', 'data-wait', 'forward'])
            threads = {e['args']['name'] for e in events if e.get('name') == 'thread_name'}
            self.assertTrue({'main', 'receiver', 'heartbeat'} <= threads, threads)
            # 2-bit pushes are marked compressed.
            pushes = spans(events, 'push')
            self.assertEqual(len(pushes), 6 * len(steps))
            self.assertTrue(all(b['args']['compressed'] == 1 for b, _ in pushes.values()))

    def test_unwritable_trace_file_is_exit_2_naming_it(self):
        env = dict(os.environ)
        for name in list(env):
            if name.startswith(('DMLC_', 'TESSERA_', 'PS_')):
                del env[name]
        env.update({'DMLC_ROLE': 'server', 'DMLC_PS_ROOT_URI': '127.0.0.1',
                    'DMLC_PS_ROOT_PORT': '9', 'DMLC_NUM_SERVER': '1',
                    'DMLC_NUM_WORKER': '1', 'TESSERA_INSECURE': '1',
                    'TESSERA_TRACE': '/nonexistent-dir/t-{rank}.json'})
        for role, binary in (('server', 'server/tessera-server'),
                             ('scheduler', 'scheduler/tessera-scheduler')):
            got = subprocess.run([os.path.join(BUILD, binary)], env=dict(env, DMLC_ROLE=role),
                                 capture_output=True, text=True, timeout=30)
            self.assertEqual(got.returncode, 2, got.stderr)
            self.assertIn("TESSERA_TRACE='/nonexistent-dir/t-{rank}.json': expected a "
                          "writable file path", got.stderr)


if __name__ == '__main__':
    unittest.main()
