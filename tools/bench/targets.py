#!/usr/bin/env python3
"""Judges tessera-bench's targets over several runs, by the median.

One tessera-bench run measures its raw ZeroMQ baseline before and after the jobs,
but on a shared 2-core machine the load drifts by 2x within a run, so one run's
ratio can land either side of a target. This runs the focused benchmark (1 server,
1 worker, no optimizer; 4 KB and 1 MB) RUNS times, each with its own same-run
baseline, and prints per target every run's ratio, their median and the verdict by
the median.

    tools/bench/targets.py [--runs 7] [--bench build/tools/bench/tessera-bench]
                           [--json FILE] [-- extra tessera-bench flags]

With --bench given twice (say a build of the tree before a change and one
after), the two binaries run alternately, run for run, so both see the same
drift of the machine's load; each gets its own table.

Exit status: 0 when it measured (whatever the verdicts), 1 when a run failed,
2 on a usage error.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def default_bench():
    root = os.path.normpath(os.path.join(HERE, '..', '..'))
    for build in ('build', 'build-bench', 'build-ci'):
        path = os.path.join(root, build, 'tools', 'bench', 'tessera-bench')
        if os.access(path, os.X_OK):
            return path
    return 'tessera-bench'


def report(bench, command, runs):
    """Prints one binary's table; returns its summary."""
    print('command: %s (x%d)' % (' '.join([bench] + command[1:]), len(runs)))
    print('%-34s %-21s %-8s %s' % ('target', 'rule', 'median', 'per run (ratio to that '
                                   'run\'s raw ZeroMQ)'))
    summary = []
    for k, first in enumerate(runs[0]['targets']):
        ratios = [r['targets'][k]['ratio'] for r in runs if r['targets'][k]['measured']]
        if not ratios:
            continue
        median = statistics.median(ratios)
        bound = float(first['rule'].split()[1].rstrip('x'))
        met = median >= bound if first['rule'].startswith('>=') else median <= bound
        met_runs = sum(1 for r in runs if r['targets'][k]['met'])
        print('%-34s %-21s %5.2fx   %s  -> %s (met in %d of %d runs)' %
              (first['what'], first['rule'], median,
               ' '.join('%.2f' % x for x in ratios), 'met' if met else 'NOT MET',
               met_runs, len(runs)))
        summary.append({'what': first['what'], 'rule': first['rule'], 'median': median,
                        'ratios': ratios, 'met': met, 'met_runs': met_runs})
    two_way = [statistics.median([b['zmq_two_way_gbps'] / b['zmq_gbps']
                                  for b in r['baseline'] if b['size'] == 1 << 20])
               for r in runs]
    print('raw ZeroMQ itself, 1 MB both ways at once: %.2fx of one-way per direction '
          '(median; per run %s)' % (statistics.median(two_way),
                                    ' '.join('%.2f' % x for x in two_way)))
    # The raw baselines the ratios were taken against, and Tessera's own
    # figures, per run.
    rows = [('raw 1 MB one-way GB/s', 1 << 20, 'zmq_gbps', '%.2f'),
            ('raw 1 MB two-way GB/s/dir', 1 << 20, 'zmq_two_way_gbps', '%.2f'),
            ('raw 4 KB rtt p50 us', 4096, 'zmq_rtt_p50_us', '%.0f')]
    for label, size, field, fmt in rows:
        values = [b[field] for r in runs for b in r['baseline'] if b['size'] == size]
        print('%-34s median %s; per run %s' % (label, fmt % statistics.median(values),
                                              ' '.join(fmt % v for v in values)))
    pairs = ['%.0f/%.0f' % (b['zmq_rtt_p50_before_us'], b['zmq_rtt_p50_after_us'])
             for r in runs for b in r['baseline']
             if b['size'] == 4096 and 'zmq_rtt_p50_before_us' in b]
    if pairs:
        print('%-34s per run %s' % ('  (before/after the job)', ' '.join(pairs)))

    def job_values(op, size, pick):
        values = []
        for r in runs:
            rows = [x for x in r['jobs'][0]['results'] if x['op'] == op and x['size'] == size]
            if rows:
                values.append(pick(rows))
        return values

    for label, op, size, pick, fmt in (
            ('tessera 4 KB pushpull p50 us', 'pushpull', 4096,
             lambda rows: [x for x in rows if x['inflight'] == 1][0]['p50_us'], '%.0f'),
            ('tessera 1 MB push GB/s (best)', 'push', 1 << 20,
             lambda rows: max(x['gbps'] for x in rows), '%.2f'),
            ('tessera 1 MB pull GB/s (best)', 'pull', 1 << 20,
             lambda rows: max(x['gbps'] for x in rows), '%.2f'),
            ('tessera 1 MB pullview GB/s (best)', 'pullview', 1 << 20,
             lambda rows: max(x['gbps'] for x in rows), '%.2f'),
            ('tessera 1 MB pushpull GB/s (best)', 'pushpull', 1 << 20,
             lambda rows: max(x['gbps'] for x in rows), '%.2f')):
        values = job_values(op, size, pick)
        if values:
            print('%-34s median %s; per run %s' % (label, fmt % statistics.median(values),
                                                  ' '.join(fmt % v for v in values)))
    return summary, two_way


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--runs', type=int, default=7, help='runs of tessera-bench (default 7)')
    p.add_argument('--bench', action='append',
                   help='the tessera-bench binary; twice: two binaries, run alternately')
    p.add_argument('--seconds', default='0.4', help='tessera-bench --seconds (default 0.4)')
    p.add_argument('--security', default='none',
                   help='tessera-bench --security (default none: the targets compare with '
                        'raw ZeroMQ, which has no security; curve judges a secured job; empty: '
                        'pass nothing, for a binary older than the flag)')
    p.add_argument('--json', dest='json_out', help='also write every run and the medians here')
    p.add_argument('extra', nargs='*', help='more tessera-bench flags (after --)')
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error('--runs=%d: expected a number >= 1' % args.runs)
    benches = args.bench or [default_bench()]
    if len(benches) > 2:
        p.error('--bench: at most two binaries')
    command = ['tessera-bench', '--sizes=4K,1M', '--jobs=1x1:none', '--inflight=1,4,8',
               '--seconds=' + args.seconds, '--json'] + args.extra
    if args.security:  # empty: for a binary older than --security
        command.insert(5, '--security=' + args.security)
    runs = {b: [] for b in benches}
    for i in range(args.runs):
        for bench in benches:
            done = subprocess.run([bench] + command[1:], capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write('targets.py: run %d: %s exited %d\n%s' %
                                 (i + 1, ' '.join([bench] + command[1:]),
                                  done.returncode, done.stderr))
                return 1
            run = json.loads(done.stdout)
            runs[bench].append(run)
            base = {b['size']: b for b in run['baseline']}
            sys.stderr.write('run %d/%d%s: raw 1 MB %.2f GB/s, raw 4 KB rtt p50 %.0f us\n' %
                             (i + 1, args.runs, '' if len(benches) == 1 else ' ' + bench,
                              base[1 << 20]['zmq_gbps'], base[4096]['zmq_rtt_p50_us']))
    results = []
    for n, bench in enumerate(benches):
        if n:
            print()
        summary, two_way = report(bench, command, runs[bench])
        results.append({'command': [bench] + command[1:], 'runs': runs[bench],
                        'targets': summary, 'two_way_over_one_way': two_way})
    if args.json_out:
        with open(args.json_out, 'w') as f:
            json.dump(results[0] if len(results) == 1 else {'benches': results}, f,
                      indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
