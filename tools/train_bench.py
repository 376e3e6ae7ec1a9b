#!/usr/bin/env python3
"""Runs the training figures of docs/benchmarks.md: accuracy after 15 epochs for the
configurations the training issue names, and throughput for 1, 2 and 4 workers, with
the time a step spends in compute, issuing (compression + hand-off) and communication.

    python3 tools/train_bench.py [--build build] [--quick] [--device cpu]

Prints a Markdown table per part. Each job is a local cluster started by launch.py.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One schedule for every accuracy run, so they differ only in what is compared.
COMMON = ['--lr', '0.3', '--momentum', '0', '--lr-step-epochs', '12']


def run_job(build, workers, args, tmp):
    metrics = os.path.join(tmp, 'm-{rank}.json')
    for rank in range(workers):
        path = metrics.format(rank=rank)
        if os.path.exists(path):
            os.remove(path)
    cmd = [sys.executable, os.path.join(ROOT, 'tools', 'launch.py'), '-n', str(workers), '-s', '1',
           os.path.join(build, 'worker', 'tessera-worker')] + args + ['--metrics-out', metrics]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.exit('train_bench: job failed (%s):\n%s' % (' '.join(cmd), proc.stdout[-3000:]))
    out = []
    for rank in range(workers):
        with open(metrics.format(rank=rank)) as f:
            out.append(json.load(f))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--build', default=os.path.join(ROOT, 'build'))
    parser.add_argument('--quick', action='store_true', help='2 epochs instead of 15')
    parser.add_argument('--device', default='cpu')
    opts = parser.parse_args()
    epochs = '2' if opts.quick else '15'
    dev = ['--device', opts.device]
    with tempfile.TemporaryDirectory() as tmp:
        print('### Accuracy (%s epochs, 1 server, batch 128 per worker, flags: %s)\n'
              % (epochs, ' '.join(COMMON)))
        print('| workers | kv-store | compression | test accuracy | final loss | wall s |')
        print('|---|---|---|---|---|---|')
        for workers, store, gc in ((2, 'dist_sync', ['--gc-type', '2bit', '--gc-threshold', '1']),
                                   (2, 'dist_sync', ['--gc-type', 'none']),
                                   (1, 'dist_sync', ['--gc-type', 'none']),
                                   (2, 'dist_async', ['--gc-type', 'none'])):
            m = run_job(opts.build, workers, ['--kv-store', store, '--epochs', epochs] + gc +
                        COMMON + dev, tmp)
            rank0 = next(x for x in m if x['rank'] == 0)
            print('| %d | %s | %s | %.4f | %.4f | %.1f |' % (
                workers, store, ' '.join(gc), rank0['test_accuracy'], rank0['final_loss'],
                rank0['wall_seconds']))
            sys.stdout.flush()
        print('\n### Throughput (3 epochs, dist_sync, 1 server; per-worker step time split)\n')
        print('| workers | compression | samples/s (all workers) | compute s | issue s '
              '(compress + send) | comm wait s | data wait s | pushed MB | pulled MB |')
        print('|---|---|---|---|---|---|---|---|---|')
        for gc in ('none', '2bit'):
            for workers in (1, 2, 4):
                m = run_job(opts.build, workers, ['--epochs', '3', '--gc-type', gc,
                                                  '--gc-threshold', '1'] + COMMON + dev, tmp)
                total = sum(x['samples_per_second'] for x in m)
                avg = lambda k: sum(x[k] for x in m) / len(m)
                print('| %d | %s | %.0f | %.2f | %.2f | %.2f | %.2f | %.1f | %.1f |' % (
                    workers, gc, total, avg('time_compute_s'), avg('time_issue_s'),
                    avg('time_comm_s'), avg('time_data_s'), avg('bytes_pushed') / 1e6,
                    avg('bytes_pulled') / 1e6))
                sys.stdout.flush()


if __name__ == '__main__':
    main()
