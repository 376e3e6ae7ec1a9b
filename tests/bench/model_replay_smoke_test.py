#!/usr/bin/env python3
"""Smoke test of tools/bench/model_replay.py and model_replay (issue #48).

Checks the models' lists against their published counts (model_replay
--describe: no job), then runs a 2-step replay of the quick-start MLP on
loopback (2 workers, 2 servers, through tools/launch.py) with float32 and with
2-bit pushes, and checks the exit status, the number of keys, every worker's
bytes per step (computed here from the shapes, and counted by KVWorker::stats)
and the bounds' arithmetic. TESSERA_BIGARRAY_BOUND=30000 splits fc1.weight and
fc2.weight over both servers and TESSERA_CHUNK_BYTES=4096 cuts every part into
slices of 1024 values, so the 2-bit codes' per-slice padding is checked too.
No figure of time is asserted beyond a step lasting at least its compute.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.environ.get('TESSERA_SOURCE_DIR',
                        os.path.normpath(os.path.join(os.path.dirname(__file__), '..', '..')))
BUILD = os.environ.get('TESSERA_BUILD_DIR', os.path.join(SOURCE, 'build'))
BENCH = os.path.join(BUILD, 'tools', 'bench', 'model_replay')
DRIVER = os.path.join(SOURCE, 'tools', 'bench', 'model_replay.py')

# The quick-start MLP, PyTorch's order: (in, out) of fc1..fc3.
MLP = [(784, 256), (256, 128), (128, 10)]
BOUND, CHUNK = 30000, 1024  # values; TESSERA_CHUNK_BYTES = 4 * CHUNK
WORKERS, SERVERS, BATCH, TFLOPS, LINK_GBPS = 2, 2, 32, 0.001, 0.1


def mlp_tensors():
    out = []
    for i, o in MLP:
        out += [o * i, o]
    return out


def slices(n):
    """The slice lengths of a key of n values (split at BOUND over the servers)."""
    parts = ([n * (s + 1) // SERVERS - n * s // SERVERS for s in range(SERVERS)]
             if n >= BOUND else [n])
    return [min(CHUNK, p - at) for p in parts for at in range(0, p, CHUNK)]


def expected_bytes(gc):
    """(pushed, pulled) per step per worker."""
    lens = [s for n in mlp_tensors() for s in slices(n)]
    if gc == '2bit':  # 16 values a 32-bit word, per slice
        return sum(4 * ((s + 15) // 16) for s in lens), 4 * sum(lens)
    return 4 * sum(lens), 4 * sum(lens)


class DescribeTest(unittest.TestCase):
    """The lists of shapes: counts as published, first and last tensors."""

    CASES = {
        'resnet50': (161, 25557032, ('conv1.weight', [64, 3, 7, 7]), ('fc.bias', [1000])),
        'vgg16': (32, 138357544, ('features.0.weight', [64, 3, 3, 3]),
                  ('classifier.6.bias', [1000])),
        'bert-base': (199, 109482240, ('embeddings.word_embeddings.weight', [30522, 768]),
                      ('pooler.dense.bias', [768])),
        'mlp': (6, 235146, ('fc1.weight', [256, 784]), ('fc3.bias', [10])),
    }

    def test_every_model_has_its_published_counts(self):
        for model, (keys, params, first, last) in self.CASES.items():
            run = subprocess.run([BENCH, '--model=' + model, '--describe', '--batch=8'],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
            self.assertEqual(run.returncode, 0, run.stderr.decode())
            d = json.loads(run.stdout.decode())
            tensors = [p for layer in d['layer_list'] for p in layer['params']]
            self.assertEqual((d['keys'], d['params']), (keys, params), model)
            self.assertEqual(len(tensors), keys, model)
            total = 0
            for p in tensors:
                size = 1
                for dim in p['shape']:
                    size *= dim
                total += size
            self.assertEqual(total, params, model)
            self.assertEqual((tensors[0]['name'], tensors[0]['shape']), first, model)
            self.assertEqual((tensors[-1]['name'], tensors[-1]['shape']), last, model)
            flops = sum(layer['forward_flops'] for layer in d['layer_list'])
            self.assertAlmostEqual(d['compute_ms'], 3 * 8 * flops / 15e12 * 1e3, places=2)

    def test_published_multiply_adds(self):
        """Convolutions and Linears: ResNet-50 4.09 G, VGG-16 15.47 G an image."""
        for model, gmac in (('resnet50', 4.09), ('vgg16', 15.47)):
            d = json.loads(subprocess.run([BENCH, '--model=' + model, '--describe'],
                                          stdout=subprocess.PIPE, timeout=60).stdout)
            convs = sum(layer['forward_flops'] for layer in d['layer_list']
                        if len(layer['params'][0]['shape']) > 1)
            self.assertAlmostEqual(convs / 2e9, gmac, delta=0.01, msg=model)

    def test_a_bad_order_is_refused_naming_it(self):
        run = subprocess.run([BENCH, '--model=mlp', '--describe', '--order=lifo'],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        self.assertEqual(run.returncode, 2)
        self.assertIn('--order', run.stdout.decode())
        self.assertIn('fifo or priority', run.stdout.decode())


class ReplayTest(unittest.TestCase):

    def test_a_two_step_replay_moves_the_bytes_of_its_shapes(self):
        env = dict(os.environ, TESSERA_BIGARRAY_BOUND=str(BOUND),
                   TESSERA_CHUNK_BYTES=str(4 * CHUNK))
        with tempfile.TemporaryDirectory(prefix='model-replay-smoke-') as tmp:
            out = os.path.join(tmp, 'figures.json')
            argv = [sys.executable, DRIVER, '--build', BUILD, '--models', 'mlp',
                    '--gc', 'none,2bit', '--orders', 'fifo,priority',
                    '--runs', '1', '--steps', '2', '--warmup', '1',
                    '--batch', str(BATCH), '--tflops', str(TFLOPS),
                    '--tag', 'ms%d' % (os.getpid() % 10000), '--json', out,
                    '--', '--link-gbps=%g' % LINK_GBPS]
            run = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 timeout=240, env=env)
            text = run.stdout.decode('utf-8', 'replace')
            self.assertEqual(run.returncode, 0, text)
            for row in ('none | fifo', 'none | priority', '2bit | fifo', '2bit | priority'):
                self.assertIn('| mlp | %s |' % row, text)
            with open(out) as f:
                record = json.load(f)
        self.assertEqual([(r['gc'], r['order']) for r in record['runs']],
                         [('none', 'fifo'), ('none', 'priority'), ('2bit', 'fifo'),
                          ('2bit', 'priority')])
        flops = 2 * sum(i * o for i, o in MLP)  # a sample's forward
        compute_ms = 3 * BATCH * flops / (TFLOPS * 1e12) * 1e3
        for job in record['runs']:
            self.assertEqual(len(job['worker_metrics']), WORKERS)
            for m in job['worker_metrics']:
                self.check_worker(job['gc'], m, compute_ms)

    def check_worker(self, gc, m, compute_ms):
        what = '%s, rank %d' % (gc, m['rank'])
        pushed, pulled = expected_bytes(gc)
        self.assertEqual((m['keys'], m['layers'], m['params']), (6, 3, 235146), what)
        self.assertEqual((m['bytes_pushed_per_step'], m['bytes_pulled_per_step']),
                         (pushed, pulled), what)
        self.assertEqual((m['measured_bytes_pushed_per_step'],
                          m['measured_bytes_pulled_per_step']), (pushed, pulled), what)
        self.assertEqual(sum(m['server_bytes_in_per_step']), WORKERS * pushed, what)
        self.assertEqual(sum(m['server_bytes_out_per_step']), WORKERS * pulled, what)
        # Each server holds half of each split key at least.
        half = [n // SERVERS for n in mlp_tensors() if n >= BOUND]
        for s in range(SERVERS):
            self.assertGreaterEqual(m['server_bytes_out_per_step'][s],
                                    WORKERS * 4 * sum(half), what)
        self.assertAlmostEqual(m['compute_ms'], compute_ms, places=2)
        busiest = max([pushed, pulled] + m['server_bytes_in_per_step'] +
                      m['server_bytes_out_per_step'])
        link_ms = busiest * 8 / (LINK_GBPS * 1e9) * 1e3
        self.assertAlmostEqual(m['link_ms'], link_ms, places=2)
        self.assertAlmostEqual(m['overlap_bound_ms'], max(link_ms, compute_ms), places=2)
        self.assertEqual(len(m['step_ms']), 2, what)
        self.assertTrue(0 <= m['median_first_wait_ms'] <= m['median_wait_ms'] <=
                        max(m['step_ms']), what)
        # The waits are sleeps: no step is shorter than its compute (less one
        # sleep's lateness carried from the step before).
        self.assertGreater(min(m['step_ms']), 0.9 * compute_ms, what)
        self.assertGreaterEqual(m['measured_compute_ms'], 0.99 * compute_ms, what)


if __name__ == '__main__':
    unittest.main()
