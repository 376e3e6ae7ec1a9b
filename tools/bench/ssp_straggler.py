#!/usr/bin/env python3
"""Bounded staleness against a straggler (issue #49): the quick-start MLP job, four workers,
one of them slow, under dist_sync, dist_ssp and dist_async.

Each configuration runs `launch.py -n WORKERS -s 1 tessera-worker` with the quick start's
training flags (2-bit pushes, lr 0.3, no momentum, fused keys; `--epochs`), and, for the
straggler runs, `--slow-every 5 --slow-factor 5 --slow-rank LAST` (every 5th step of the
last worker takes 5x its compute, the rest slept). Runs alternate between configurations
(A B C ... A B C ...) so that a change in the machine's load falls on all of them. Per
run: the job's wall time from the launch to its exit (it must exit 0) and rank 0's final
test accuracy (its --metrics-out JSON); then the medians, and each configuration's time
against dist_sync's with the same straggler (the same-run baseline).

    tools/bench/ssp_straggler.py --build /abs/build [--runs 3] [--epochs 3]
        [--workers 4] [--staleness 3] [--security default|none] [--only NAME,...]
        [--hidden W1,W2,...]   # wider layers: a step where compute dominates

Security is the launcher's default (sealed links) unless --security none
(TESSERA_INSECURE=1); the output says which.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))

QUICK_START = ['--gc-type', '2bit', '--gc-threshold', '1', '--lr', '0.3', '--momentum', '0',
               '--lr-step-epochs', '12', '--fuse-keys', 'on']


def configurations(args):
    slow = ['--slow-every', '5', '--slow-factor', '5', '--slow-rank', str(args.workers - 1)]
    ssp = ['--kv-store', 'dist_ssp', '--staleness', str(args.staleness)]
    return [
        ('sync+straggler', ['--kv-store', 'dist_sync'] + slow),
        ('ssp%d+straggler' % args.staleness, ssp + slow),
        ('async+straggler', ['--kv-store', 'dist_async'] + slow),
        ('sync', ['--kv-store', 'dist_sync']),
        ('ssp%d' % args.staleness, ssp),
    ]


def one_run(args, flags, folder):
    metrics = os.path.join(folder, 'metrics-{rank}.json')
    env = dict(os.environ)
    if args.security == 'none':
        env['TESSERA_INSECURE'] = '1'
    worker = os.path.join(args.build, 'worker', 'tessera-worker')
    cmd = [sys.executable, os.path.join(SOURCE, 'tools', 'launch.py'), '-n',
           str(args.workers), '-s', '1', '--launcher', 'local', worker] + QUICK_START + \
        ['--epochs', str(args.epochs), '--metrics-out', metrics] + \
        (['--hidden', args.hidden] if args.hidden else []) + flags
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=args.timeout)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit('ssp_straggler: the job exited %d: %s' % (proc.returncode,
                                                                   ' '.join(cmd)))
    with open(metrics.replace('{rank}', '0')) as f:
        m = json.load(f)
    return wall, m['test_accuracy'], m['steps']


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--build', required=True, help='the build folder (absolute)')
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--workers', type=int, default=4)
    p.add_argument('--staleness', type=int, default=3)
    p.add_argument('--security', choices=['default', 'none'], default='default')
    p.add_argument('--only', default='', help='comma-separated configuration names')
    p.add_argument('--timeout', type=float, default=1800)
    p.add_argument('--hidden', default='', help="tessera-worker's --hidden (its default: 256,128)")
    args = p.parse_args()
    if args.runs < 1 or args.epochs < 1 or args.workers < 2 or args.staleness < 0:
        p.error('--runs and --epochs >= 1, --workers >= 2, --staleness >= 0')
    configs = configurations(args)
    if args.only:
        names = args.only.split(',')
        unknown = [n for n in names if n not in [c[0] for c in configs]]
        if unknown:
            p.error('--only: unknown %s; expected some of %s' % (
                ','.join(unknown), ','.join(c[0] for c in configs)))
        configs = [c for c in configs if c[0] in names]
    print('ssp_straggler: %d workers, 1 server, %d epochs, hidden %s, security %s, %d cores' % (
        args.workers, args.epochs, args.hidden or '256,128',
        'off (TESSERA_INSECURE=1)' if args.security == 'none' else 'on (sealed links)',
        os.cpu_count()))
    results = {name: [] for name, _ in configs}
    for run in range(args.runs):
        for name, flags in configs:
            with tempfile.TemporaryDirectory(prefix='ssp-bench-') as folder:
                wall, acc, steps = one_run(args, flags, folder)
            results[name].append((wall, acc))
            print('run %d %-16s %7.1f s  accuracy %.4f  (%d steps, rank 0)' % (
                run + 1, name, wall, acc, steps), flush=True)
    base = results.get('sync+straggler')
    base_wall = statistics.median(w for w, _ in base) if base else None
    base_acc = statistics.median(a for _, a in base) if base else None
    print('\n%-16s %10s %10s %18s %14s' % ('configuration', 'median s', 'accuracy',
                                          'x sync+straggler', 'acc - sync+s'))
    for name, _ in configs:
        wall = statistics.median(w for w, _ in results[name])
        acc = statistics.median(a for _, a in results[name])
        speed = '%.2fx' % (base_wall / wall) if base_wall else '-'
        dacc = '%+.2f pts' % (100 * (acc - base_acc)) if base_acc is not None else '-'
        print('%-16s %10.1f %10.4f %18s %14s' % (name, wall, acc, speed, dacc))


if __name__ == '__main__':
    main()
