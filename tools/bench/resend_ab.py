#!/usr/bin/env python3
"""What acknowledged delivery costs: tessera-bench with PS_RESEND=0 and =1, alternated.

Runs `tessera-bench --sizes=4K,1M --jobs=1x1:none --seconds=0.4 --json` RUNS times per
setting (default 3), alternating PS_RESEND=0 and PS_RESEND=1 so that the machine's
drifting load falls on both alike, and prints per operation, size and in-flight
setting the median GB/s, ratio to that run's raw ZeroMQ and p50 latency of each.

    tools/bench/resend_ab.py [--runs 3] [--bench build/tools/bench/tessera-bench]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import default_bench  # noqa: E402


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--bench', default=default_bench())
    args = p.parse_args(argv)
    rows = {}
    for rep in range(args.runs):
        for resend in ('0', '1'):
            env = dict(os.environ, PS_RESEND=resend)
            done = subprocess.run([args.bench, '--sizes=4K,1M', '--jobs=1x1:none',
                                   '--seconds=0.4', '--security=none', '--json'],
                                  env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write('resend_ab.py: tessera-bench exited %d\n%s' %
                                 (done.returncode, done.stderr))
                return 1
            j = json.loads(done.stdout)
            for r in j['jobs'][0]['results']:
                rows.setdefault((resend, r['op'], r['size'], r['inflight']), []).append(r)
            sys.stderr.write('run %d PS_RESEND=%s: raw %s\n' % (
                rep + 1, resend, ', '.join('%d B %.2f GB/s rtt %.0f us' % (
                    b['size'], b['zmq_gbps'], b['zmq_rtt_p50_us']) for b in j['baseline'])))
    for op in ('push', 'pull', 'pushpull'):
        for size in (4096, 1 << 20):
            for inflight in (1, 4):
                line = '%-9s %8d %d' % (op, size, inflight)
                for resend in ('0', '1'):
                    v = rows[(resend, op, size, inflight)]
                    line += ' | PS_RESEND=%s %.3f GB/s (%.2fx raw)' % (
                        resend, statistics.median(r['gbps'] for r in v),
                        statistics.median(r['ratio_to_zmq'] for r in v))
                    p50 = [r['p50_us'] for r in v if 'p50_us' in r]
                    if p50:
                        line += ' p50 %.0f us' % statistics.median(p50)
                print(line)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
