#!/usr/bin/env python3
"""What security costs: tessera-bench with TESSERA_INSECURE=1, TESSERA_AUTH_ONLY=1 and
the default (sealed links), alternated within each run and rotated between runs.

Each run is one `tessera-bench --sizes=4K,1M --jobs=1x1:none --ops=push,pull,pushpull
--inflight=1,4 --security=A,B,C --json`, which runs the same job once per setting, one
after the other; the order rotates from run to run so that the machine's drifting load
falls on every setting alike. Prints, per setting, the median over the runs of: 1 MB
push, pull and pushpull throughput (the best in-flight setting of each run), 1 MB push
and pull blocking (in-flight 1), the 4 KB pushpull round trip (p50, in-flight 1), and
each as a ratio to the insecure setting; then the median over the runs of each figure
over that run's plain raw ZeroMQ baseline (tessera-bench's, before and after the jobs).

    tools/bench/security_ab.py [--runs 5] [--bench build/tools/bench/tessera-bench]
                               [--json FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import default_bench  # noqa: E402

MODES = ['none', 'auth', 'sealed']
NAMES = {'none': 'insecure (TESSERA_INSECURE=1)',
         'auth': 'authenticated (TESSERA_AUTH_ONLY=1)',
         'sealed': 'sealed (default)'}
MB = 1 << 20


def figures(job):
    """{metric: value} of one job's results."""
    out = {}
    for op in ('push', 'pull', 'pushpull'):
        rows = [r for r in job['results'] if r['op'] == op and r['size'] == MB]
        out['1 MB %s GB/s' % op] = max(r['gbps'] for r in rows)
    for op in ('push', 'pull'):
        rows = [r for r in job['results']
                if r['op'] == op and r['size'] == MB and r['inflight'] == 1]
        out['1 MB %s blocking GB/s' % op] = rows[0]['gbps']
    rtt = [r for r in job['results']
           if r['op'] == 'pushpull' and r['size'] == 4096 and r['inflight'] == 1]
    out['4 KB round trip p50 us'] = rtt[0]['p50_us']
    return out


def raw(result):
    """The run's plain raw ZeroMQ baseline: {metric: value} for the metrics
    figures() gives, where one applies (1 MB one-way stream, 4 KB round trip)."""
    base = dict((b['size'], b) for b in result['baseline'])
    out = {}
    for name in ('1 MB push GB/s', '1 MB pull GB/s', '1 MB push blocking GB/s',
                 '1 MB pull blocking GB/s'):
        out[name] = base[MB]['zmq_gbps']
    out['1 MB pushpull GB/s'] = base[MB]['zmq_two_way_gbps']
    out['4 KB round trip p50 us'] = base[4096]['zmq_rtt_p50_us']
    return out


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--runs', type=int, default=5)
    p.add_argument('--bench', default=default_bench())
    p.add_argument('--seconds', default='0.4')
    p.add_argument('--json', dest='json_out')
    args = p.parse_args(argv)
    samples = {m: {} for m in MODES}
    to_raw = {m: {} for m in MODES}  # each run's figure over its raw baseline
    for run in range(args.runs):
        order = MODES[run % 3:] + MODES[:run % 3]
        command = [args.bench, '--sizes=4K,1M', '--jobs=1x1:none', '--ops=push,pull,pushpull',
                   '--inflight=1,4', '--seconds=' + args.seconds,
                   '--security=' + ','.join(order), '--json']
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write('security_ab.py: %s exited %d\n%s' %
                             (' '.join(command), done.returncode, done.stderr))
            return 1
        result = json.loads(done.stdout)
        line = []
        base = raw(result)
        for job in result['jobs']:
            for name, value in figures(job).items():
                samples[job['security']].setdefault(name, []).append(value)
                to_raw[job['security']].setdefault(name, []).append(value / base[name])
            line.append('%s %.2f GB/s' % (job['security'],
                                          figures(job)['1 MB push GB/s']))
        sys.stderr.write('run %d/%d (%s): 1 MB push %s\n' % (run + 1, args.runs,
                                                            ','.join(order), ', '.join(line)))
    metrics = list(samples['none'])
    medians = {m: {k: statistics.median(v) for k, v in samples[m].items()} for m in MODES}
    print('%-24s %s' % ('median of %d runs' % args.runs,
                        ' '.join('%30s' % NAMES[m] for m in MODES)))
    for k in metrics:
        cells = []
        for m in MODES:
            ratio = medians[m][k] / medians['none'][k]
            cells.append('%30s' % ('%.2f (%.2fx)' % (medians[m][k], ratio)))
        print('%-24s %s' % (k, ' '.join(cells)))
    medians_raw = {m: {k: statistics.median(v) for k, v in to_raw[m].items()}
                   for m in MODES}
    print()
    print('%-24s %s' % ('median ratio to raw ZMQ', ' '.join('%30s' % NAMES[m] for m in MODES)))
    for k in metrics:
        print('%-24s %s' % (k, ' '.join('%30s' % ('%.2fx' % medians_raw[m][k]) for m in MODES)))
    print('(each run\'s figure over that run\'s plain raw ZeroMQ: the one-way 1 MB stream, '
          'for pushpull the two-way one, the 4 KB round trip)')
    if args.json_out:
        with open(args.json_out, 'w') as f:
            json.dump({'samples': samples, 'medians': medians, 'to_raw': to_raw,
                       'medians_to_raw': medians_raw}, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
