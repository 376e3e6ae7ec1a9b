#!/usr/bin/env python3
"""The seed model's step (issue #15): what row-sparse keys and 2-bit buy.

Runs tools/bench/seed_step_bench (see its header for the step, the modes and
the Zipf batches) as the workers of real jobs: a tessera-scheduler, S
tessera-servers and W workers, one job per (mode, fraction), on this machine's
loopback and, for each shaped rate, with every node in its own network
namespace and its link shaped with tbf on both ends (tools/bench/shaped_link.py
builds them; needs root). The dense mode does not depend on the fraction and
runs once per rate. Then, with --okrows, one more loopback job (1 worker, 1
server) times PushRows+PullRows of k random rows on row-sparse keys of
--ok-keys rows.

Printed per rate, a Markdown table with one row per job:
  step ms      median over the timed steps, the slowest worker's
  push ms      its median push half (until every push's round was applied);
               the rest of a step is the pulls
  x dense      the dense job's step ms over this one's
  MB pushed, MB pulled     per step per worker (KVWorker::stats, 10^6 bytes)
  baseline ms  loopback: the step's bytes of all workers at the raw ZeroMQ
               one-way 1 MB rate measured before and after the jobs (mean), with
               plain (the jobs' encryption is part of what they cost);
               shaped: a worker's pushed + pulled bytes at the link's rate
               (times W/S when more workers than servers share a server's link)
  memcpy ms    one thread copying a worker's step bytes (the worker, same run)

    tools/bench/seed_step.py [--rates loopback,1gbit] [--modes dense,rows,rows2bit]
        [--fractions 0.01,0.05,0.2] [--workers 2] [--servers 2] [--steps 5]
        [--warmup 1] [--zipf 1.0] [--okrows 2500,25000,250000]
        [--ok-keys 25000,250000] [--ok-rate loopback|RATE] [--security sealed|auth|none]
        [--build build]
        [--overlap] [--json FILE] [-- bench flags]

--overlap: every step (and the --okrows push + pull) issues its pulls right
after its pushes instead of after they completed; the pulled values are the
same (the jobs print a hash of them), only the waiting differs.

PS_RESEND_TIMEOUT is set to --resend-timeout-ms (60000) for every job: with the
default 1 s, a dense step (1.4 GB per worker each way) on a loaded 2-core
machine outlives the resend timer, and the resent slices (thousands per step)
would make the dense figure slower than the protocol is.

Exit status: 0 every job finished; 1 a job failed (its logs are kept and their
last lines printed); 2 a usage error; 3 shaped links cannot be built here.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import shaped_link as sl  # noqa: E402  (namespaces, tbf, jobs, clean-up)

MODES = ('dense', 'rows', 'rows2bit')


def parse_args(argv):
    extra = []
    if '--' in argv:
        i = argv.index('--')
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog='seed_step.py', description=__doc__.split('\n')[0])
    p.add_argument('--rates', default='loopback',
                   help='loopback and/or tc rates such as 1gbit (loopback)')
    p.add_argument('--modes', default='dense,rows,rows2bit')
    p.add_argument('--fractions', default='0.01,0.05,0.2')
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--servers', type=int, default=2)
    p.add_argument('--steps', type=int, default=5)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--zipf', type=float, default=1.0)
    p.add_argument('--okrows', default='', help='k list for the O(k) job (none: skip it)')
    p.add_argument('--ok-keys', default='25000,250000')
    p.add_argument('--ok-reps', type=int, default=7)
    p.add_argument('--ok-rate', default='loopback',
                   help='the --okrows job\'s link: loopback, or a tc rate such as 1gbit '
                        '(worker and server in their own namespaces, shaped both ways)')
    p.add_argument('--build', default=os.path.join(sl.SOURCE_DIR, 'build'))
    p.add_argument('--json', help='write every figure there')
    p.add_argument('--security', default='sealed', choices=('sealed', 'auth', 'none'),
                   help='the jobs\' connections: sealed (encrypted, the default), auth '
                   '(TESSERA_AUTH_ONLY=1), none (TESSERA_INSECURE=1)')
    p.add_argument('--resend-timeout-ms', type=int, default=60000)
    p.add_argument('--bigarray-bound', type=int,
                   help='TESSERA_BIGARRAY_BOUND for every job (default: the library\'s)')
    p.add_argument('--overlap', action='store_true',
                   help='each step issues its pulls right after its pushes, without '
                        'waiting for them (as a training loop calling push then pull '
                        'does); the server orders them')
    p.add_argument('--no-baseline', action='store_true', help='skip raw ZeroMQ')
    p.add_argument('--no-link-check', action='store_true')
    p.add_argument('--burst', default=str(sl.BURST_BYTES))
    p.add_argument('--latency', default=sl.LATENCY)
    # The tag names the state file, namespaces and links: one per run, so two
    # runs at once (another engineer's, a test's) never clean up each other's.
    p.add_argument('--tag', default='ss%d' % (os.getpid() % 10000))
    p.add_argument('--timeout', type=int, default=900, help='seconds per job')
    args = p.parse_args(argv)
    args.extra = extra + (['--overlap'] if args.overlap else [])
    args.rates = [r for r in args.rates.split(',') if r]
    args.modes = [m for m in args.modes.split(',') if m]
    args.fractions = [float(f) for f in args.fractions.split(',') if f]
    for m in args.modes:
        if m not in MODES:
            p.error('--modes: %s is not one of %s' % (m, ', '.join(MODES)))
    for r in args.rates:
        if r != sl.LOOPBACK and sl.parse_rate(r) is None:
            p.error('--rates: %s is neither loopback nor a tc rate' % r)
    if args.ok_rate != sl.LOOPBACK and sl.parse_rate(args.ok_rate) is None:
        p.error('--ok-rate: %s is neither loopback nor a tc rate' % args.ok_rate)
    b = args.burst.lower()
    args.burst = int(b[:-1]) * {'k': 1024, 'm': 1 << 20}[b[-1]] if b[-1] in 'km' else int(b)
    return args


def raw_baseline(bench):
    out = subprocess.run([bench, '--raw-baseline'], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, timeout=120)
    if out.returncode != 0:
        raise RuntimeError('raw baseline failed: %s' % out.stderr.decode()[-2000:])
    return json.loads(out.stdout.decode())


def run_job(res, topo, binaries, argv, servers, workers, name, port, timeout):
    job = sl.Job(res, topo, binaries, argv, servers, workers, name, port)
    ok = job.wait(timeout)
    metrics = None
    if ok:
        try:
            metrics = job.worker_metrics(workers)
        except (OSError, ValueError) as e:
            ok, job.why = False, 'no --metrics-out JSON: %s' % e
    if topo is not None:
        left = topo.processes()
        if left:
            ok, job.why = False, (job.why or '') + '; left behind: %s' % left
    if not ok:
        res.keep_logs()
        sl.say('job %s failed: %s\n%s' % (name, job.why, job.report()))
        return None, job.elapsed
    return metrics, job.elapsed


def summarize(metrics, job_s):
    slowest = max(metrics, key=lambda m: m['median_step_ms'])
    n = len(metrics)
    return {
        'mode': metrics[0]['mode'], 'fraction': metrics[0]['fraction'],
        'rows_per_batch': metrics[0]['rows_per_batch'],
        'step_ms': slowest['median_step_ms'],
        'push_ms': slowest['median_push_ms'],
        'bytes_pushed': sum(m['bytes_pushed_per_step'] for m in metrics) / n,
        'bytes_pulled': sum(m['bytes_pulled_per_step'] for m in metrics) / n,
        'bytes_pulled_float32': sum(m['bytes_pulled_float32_per_step'] for m in metrics) / n,
        'memcpy_ms': max(m['memcpy_ms_per_step'] for m in metrics),
        'job_s': job_s,
        # Hash of every value rank 0 pulled in the timed steps: equal with and
        # without --overlap (the same rounds, pulled after the same pushes).
        'pulled_fnv': metrics[0].get('pulled_fnv'),
    }


def print_table(rate, rows, args, zmq_gbps):
    dense = next((r['step_ms'] for r in rows if r['mode'] == 'dense'), None)
    print('\n### %s, %d workers, %d servers\n' % (
        'loopback' if rate == sl.LOOPBACK else '%s per node (tbf both ends)' % rate,
        args.workers, args.servers))
    print('| mode | rows touched | rows/batch | step ms | push ms | x dense | MB pushed '
          '| MB pulled | baseline ms | memcpy ms |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    for r in rows:
        step_bytes = r['bytes_pushed'] + r['bytes_pulled']
        if rate == sl.LOOPBACK:
            base = step_bytes * args.workers / (zmq_gbps * 1e9) * 1e3 if zmq_gbps else None
        else:
            base = (step_bytes * 8 / sl.parse_rate(rate) * 1e3 *
                    max(1.0, args.workers / float(args.servers)))
        r['baseline_ms'] = base
        r['x_dense'] = dense / r['step_ms'] if dense and r['step_ms'] > 0 else None
        print('| %s | %s | %d | %.1f | %.1f | %s | %.2f | %.2f | %s | %.2f |' % (
            r['mode'], 'all' if r['mode'] == 'dense' else '%g%%' % (100 * r['fraction']),
            r['rows_per_batch'], r['step_ms'], r['push_ms'],
            '%.1f' % r['x_dense'] if r['x_dense'] else '-',
            r['bytes_pushed'] / 1e6, r['bytes_pulled'] / 1e6,
            '%.1f' % base if base is not None else '-', r['memcpy_ms']))


def main(argv):
    args = parse_args(argv)
    b = args.build
    binaries = {'scheduler': os.path.join(b, 'scheduler', 'tessera-scheduler'),
                'server': os.path.join(b, 'server', 'tessera-server'),
                'bench': os.path.join(b, 'tools', 'bench', 'seed_step_bench')}
    for path in binaries.values():
        if not os.access(path, os.X_OK):
            sl.say('%s not built (--build %s)' % (path, b))
            return sl.EXIT_USAGE
    shaped = [r for r in args.rates if r != sl.LOOPBACK]
    ok_shaped = bool(args.okrows) and args.ok_rate != sl.LOOPBACK
    os.environ['PATH'] = os.environ.get('PATH', '') + ':/usr/sbin:/sbin'
    os.environ['PS_RESEND_TIMEOUT'] = str(args.resend_timeout_ms)
    os.environ['TESSERA_INSECURE'] = '1' if args.security == 'none' else '0'
    os.environ['TESSERA_AUTH_ONLY'] = '1' if args.security == 'auth' else '0'
    if args.bigarray_bound:
        os.environ['TESSERA_BIGARRAY_BOUND'] = str(args.bigarray_bound)
    if shaped or ok_shaped:
        why = sl.missing_prerequisite(args.tag)
        if why:
            sl.say('cannot build shaped links: %s' % why)
            return sl.EXIT_NO_SHAPING
    res = sl.start_resources(args.tag)
    record = {'command': ' '.join(['tools/bench/seed_step.py'] + argv),
              'started': time.strftime('%Y-%m-%d %H:%M:%S %z'),
              'uptime_before': sl.uptime(), 'workers': args.workers,
              'servers': args.servers, 'steps': args.steps, 'warmup': args.warmup,
              'zipf': args.zipf, 'bench_flags': args.extra, 'rates': {},
              'security': args.security,
              'link_check_mbit_s': {}, 'jobs': []}
    sl.say('uptime: %s' % record['uptime_before'])
    common = ['--steps=%d' % args.steps, '--warmup=%d' % args.warmup,
              '--zipf=%g' % args.zipf]
    try:
        zmq = []
        if not args.no_baseline:
            zmq.append(raw_baseline(binaries['bench']))
        topo = None
        if shaped or ok_shaped:
            topo = sl.Topology(res, args.servers, args.workers, args.burst, args.latency)
            topo.setup()
            for rate in shaped:
                if args.no_link_check:
                    continue
                topo.shape(rate)
                mbit, why = sl.link_check(res, topo)
                record['link_check_mbit_s'][rate] = mbit
                sl.say('link check at %s: %s' % (rate, '%.0f Mbit/s' % mbit if mbit else why))
        plan = []
        for mode in args.modes:
            for f in ([args.fractions[0]] if mode == 'dense' else args.fractions):
                plan.append((mode, f))
        n = 0
        for rate in args.rates:
            rows = record['rates'].setdefault(rate, [])
            for mode, f in plan:
                n += 1
                if rate == sl.LOOPBACK:
                    job_topo, port = None, sl.free_port()
                else:
                    topo.shape(rate)
                    job_topo, port = topo, sl.ROOT_PORT + n % 500
                name = '%s-%s-%g' % (rate, mode, f)
                argv_w = [binaries['bench'], '--mode=' + mode, '--fraction=%g' % f] + \
                    common + args.extra
                load = sl.uptime()
                sl.say('job %s: started (%s)' % (name, load))
                metrics, job_s = run_job(res, job_topo, binaries, argv_w, args.servers,
                                         args.workers, name, port, args.timeout)
                if metrics is None:
                    return sl.EXIT_JOB_FAILED
                fig = summarize(metrics, job_s)
                fig.update(uptime_before=load, worker_metrics=metrics)
                rows.append(fig)
                sl.say('job %s: step %.1f ms, %.2f MB pushed, %.2f MB pulled per worker, '
                       'pulled values hash %s'
                       % (name, fig['step_ms'], fig['bytes_pushed'] / 1e6,
                          fig['bytes_pulled'] / 1e6, fig['pulled_fnv']))
        okrows = None
        if args.okrows:
            argv_w = [binaries['bench'], '--okrows=' + args.okrows,
                      '--ok-keys=' + args.ok_keys, '--ok-reps=%d' % args.ok_reps] + args.extra
            load = sl.uptime()
            sl.say('job okrows: started at %s (%s)' % (args.ok_rate, load))
            if ok_shaped:
                topo.shape(args.ok_rate)
                ok_topo, ok_port = topo, sl.ROOT_PORT + (n + 1) % 500
            else:
                ok_topo, ok_port = None, sl.free_port()
            metrics, _ = run_job(res, ok_topo, binaries, argv_w, 1, 1, 'okrows',
                                 ok_port, args.timeout)
            if metrics is None:
                return sl.EXIT_JOB_FAILED
            okrows = metrics[0]['okrows']
            record['okrows'] = {'uptime_before': load, 'results': okrows,
                                'rate': args.ok_rate,
                                'pulled_fnv': metrics[0].get('pulled_fnv')}
            sl.say('job okrows: pulled values hash %s' % metrics[0].get('pulled_fnv'))
        if not args.no_baseline:
            zmq.append(raw_baseline(binaries['bench']))
        record['raw_baseline'] = zmq
        raw_key = 'zmq_1mb_gbps'
        zmq_gbps = statistics.mean(z[raw_key] for z in zmq) if zmq else None
        record['uptime_after'] = sl.uptime()
        print('## seed_step: %d workers, %d servers, %d timed steps after %d, Zipf s=%g, '
              'security %s%s\n' % (args.workers, args.servers, args.steps, args.warmup,
                                   args.zipf, args.security,
                                   ', pulls overlapping the pushes' if args.overlap else ''))
        print('command: %s  ' % record['command'])
        print('started: %s  ' % record['started'])
        print('uptime before: %s  ' % record['uptime_before'])
        print('uptime after: %s  ' % record['uptime_after'])
        if zmq:
            print('raw ZeroMQ 1 MB one-way: %s GB/s plain, %s GB/s CURVE (before/after), '
                  'memcpy %s GB/s  ' % (
                '/'.join('%.2f' % z['zmq_1mb_gbps'] for z in zmq),
                '/'.join('%.2f' % z['zmq_curve_1mb_gbps'] for z in zmq),
                '/'.join('%.2f' % z['memcpy_64mb_gbps'] for z in zmq)))
        for rate, mbit in record['link_check_mbit_s'].items():
            print('link check %s: %s Mbit/s  ' % (rate, '%.0f' % mbit if mbit else '-'))
        for rate in args.rates:
            print_table(rate, record['rates'][rate], args, zmq_gbps)
        if okrows:
            print('\n### push+pull of k random rows, 1 worker, 1 server, %s (median of %d)\n'
                  % (args.ok_rate, args.ok_reps))
            print('| key rows | k | ms | push ms | worker CPU ms | us per row | MB moved '
                  '| memcpy ms |')
            print('|---:|---:|---:|---:|---:|---:|---:|---:|')
            for r in okrows:
                print('| %d | %d | %.2f | %.2f | %.2f | %.2f | %.1f | %.2f |' % (
                    r['key_rows'], r['k'], r['median_ms'], r['median_push_ms'],
                    r['median_cpu_ms'], r['us_per_row'], r['bytes'] / 1e6, r['memcpy_ms']))
        sys.stdout.flush()
        if args.json:
            sl.write_json(args.json, record)
        return 0
    finally:
        res.teardown()


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
