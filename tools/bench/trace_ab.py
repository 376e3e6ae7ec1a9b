#!/usr/bin/env python3
"""What TESSERA_TRACE costs: tessera-bench 4 KB pushpull round trips with and without
tracing, alternated run for run.

Each run is one `tessera-bench --sizes=4K --jobs=1x1:none --ops=pushpull --inflight=1
--seconds=S --json` (1 server, 1 worker, CURVE as launch.py's jobs; blocking pushpulls,
one in flight), with TESSERA_TRACE unset or set to a fresh folder (every process of the
job traces: the worker's request, wait and compression spans, the server's rounds and
updates). The two alternate and the order flips every pair, so the machine's drifting
load falls on both alike. Prints every run's p50 and p99, the medians, the median of the
pairwise ratios (traced / untraced) and the events the traced runs recorded.

    tools/bench/trace_ab.py [--pairs 9] [--seconds 1] [--bench build/tools/bench/tessera-bench]
                            [--json FILE]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import default_bench  # noqa: E402


def run_once(bench, seconds, trace_dir):
    command = [bench, '--sizes=4K', '--jobs=1x1:none', '--ops=pushpull', '--inflight=1',
               '--seconds=%s' % seconds, '--json']
    env = dict(os.environ)
    env.pop('TESSERA_TRACE', None)
    if trace_dir is not None:
        env['TESSERA_TRACE'] = os.path.join(trace_dir, '{role}-{rank}.json')
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError('%s exited %d\n%s' % (' '.join(command), done.returncode,
                                                   done.stderr))
    result = json.loads(done.stdout)
    row = [r for r in result['jobs'][0]['results']
           if r['op'] == 'pushpull' and r['size'] == 4096 and r['inflight'] == 1][0]
    events = 0
    if trace_dir is not None:
        for name in os.listdir(trace_dir):
            with open(os.path.join(trace_dir, name)) as f:
                events += json.load(f)['otherData']['events']
    return {'p50_us': row['p50_us'], 'p99_us': row['p99_us'],
            'raw_rtt_p50_us': result['baseline'][0]['zmq_rtt_p50_us'], 'events': events}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--pairs', type=int, default=9)
    p.add_argument('--seconds', default='1')
    p.add_argument('--bench', default=default_bench())
    p.add_argument('--json', dest='json_out')
    args = p.parse_args(argv)
    runs = {'off': [], 'on': []}
    ratios = []
    for pair in range(args.pairs):
        order = ['off', 'on'] if pair % 2 == 0 else ['on', 'off']
        got = {}
        for mode in order:
            trace_dir = tempfile.mkdtemp(prefix='tessera-trace-ab-') if mode == 'on' else None
            try:
                got[mode] = run_once(args.bench, args.seconds, trace_dir)
            except RuntimeError as e:
                sys.stderr.write('trace_ab.py: %s\n' % e)
                return 1
            finally:
                if trace_dir:
                    shutil.rmtree(trace_dir, ignore_errors=True)
            runs[mode].append(got[mode])
        ratios.append(got['on']['p50_us'] / got['off']['p50_us'])
        sys.stderr.write('pair %d/%d (%s first): p50 off %.1f us, on %.1f us (%.3fx), '
                         '%d events\n' % (pair + 1, args.pairs, order[0], got['off']['p50_us'],
                                          got['on']['p50_us'], ratios[-1],
                                          got['on']['events']))
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in ('p50_us', 'p99_us')}
           for m in runs}
    print('4 KB pushpull round trip, 1 server x 1 worker, %d alternated pairs of %s s runs'
          % (args.pairs, args.seconds))
    print('  p50 per run, untraced  (us): %s' % ' '.join('%.1f' % r['p50_us'] for r in runs['off']))
    print('  p50 per run, traced    (us): %s' % ' '.join('%.1f' % r['p50_us'] for r in runs['on']))
    print('  median p50: untraced %.1f us, traced %.1f us -> %.3fx' %
          (med['off']['p50_us'], med['on']['p50_us'], med['on']['p50_us'] / med['off']['p50_us']))
    print('  median p99: untraced %.1f us, traced %.1f us -> %.3fx' %
          (med['off']['p99_us'], med['on']['p99_us'], med['on']['p99_us'] / med['off']['p99_us']))
    print('  median of the pairwise p50 ratios (traced/untraced): %.3fx' %
          statistics.median(ratios))
    print('  events recorded per traced run (all processes): median %d' %
          statistics.median(r['events'] for r in runs['on']))
    if args.json_out:
        with open(args.json_out, 'w') as f:
            json.dump({'runs': runs, 'pairwise_p50_ratios': ratios, 'medians': med}, f,
                      indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
