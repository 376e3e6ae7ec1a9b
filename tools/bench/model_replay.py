#!/usr/bin/env python3
"""Model replay (issue #48): a real model's step on a real job, against its bounds.

Runs tools/bench/model_replay (see its header: one key per parameter tensor of
ResNet-50, VGG-16 or BERT-base, each layer's compute a wait of its FLOPs at
--tflops, forward layer by layer waiting for each layer's pulls, backward
pushing and pulling each tensor when its layer's backward ends) as the workers
of real jobs: a tessera-scheduler, S tessera-servers and W workers (2 and 2 by
default), one job per (model, compression, order), on this machine's loopback
through tools/launch.py, and, for each shaped rate, with every node in its own
network namespace and its link shaped with tbf on both ends (the namespace
functions of tools/bench/shaped_link.py; needs root).

For every run (--runs, 3), every rate, every model, every --gc and every
--order in turn, one job, so the machine's drifting load falls on all alike;
--orders fifo,priority puts the FIFO baseline beside priority in the same run.

Printed per rate, a Markdown table with one row per (model, gc, order):
  step ms        median over the runs of the slowest worker's median step
  runs           each run's figure
  compute ms     forward + backward at --tflops for --batch samples: the
                 compute-only bound
  link ms        the busiest direction of the busiest node's link at the rate
                 (each node has its own full-duplex link; on loopback none)
  bound ms       the perfect-overlap bound, max(compute, link)
  x bound        step / bound (1.00: communication perfectly hidden)
  wait ms        the median over the runs of the slowest worker's time a step's
                 forward waited for weights, and in brackets the first layer's
                 share (what sending the first layer first would save)
  x fifo         the same run's fifo step over this row's (speed-up)
  MB up, MB down what one worker pushes and pulls a step (10^6 bytes)

    tools/bench/model_replay.py [--models vgg16,resnet50] [--rates loopback,1gbit]
        [--gc none,2bit] [--orders fifo] [--runs 3] [--steps 5] [--warmup 1]
        [--batch 32] [--tflops 15] [--workers 2] [--servers 2] [--json FILE]
        [--security sealed|auth|none] [--build build] [-- model_replay flags]

PS_RESEND_TIMEOUT is --resend-timeout-ms (60000) for every job: a VGG-16 step
moves 553 MB each way per worker, and on a loaded 2-core machine a slice can
outlive the 1 s default, whose resends would be measured instead of the model.

Exit status: 0 every job finished; 1 a job failed (its logs' last lines are
printed); 2 a usage error; 3 shaped links cannot be built here.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import shaped_link as sl  # noqa: E402  (namespaces, tbf, jobs, clean-up)

MODELS = ('resnet50', 'vgg16', 'bert-base', 'mlp')
GCS = ('none', '2bit')
ORDERS = ('fifo', 'priority')


def say(text):
    sys.stderr.write('model_replay: %s\n' % text)
    sys.stderr.flush()


def parse_list(p, name, text, allowed):
    items = [x for x in text.split(',') if x]
    for x in items:
        if x not in allowed:
            p.error('--%s: %s is not one of %s' % (name, x, ', '.join(allowed)))
    if not items:
        p.error('--%s: empty' % name)
    return items


def parse_args(argv):
    extra = []
    if '--' in argv:
        i = argv.index('--')
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog='model_replay.py', description=__doc__.split('\n')[0])
    p.add_argument('--models', default='vgg16,resnet50')
    p.add_argument('--rates', default='loopback',
                   help='loopback and/or tc rates such as 1gbit,10gbit (loopback)')
    p.add_argument('--gc', default='none', help='none and/or 2bit (none)')
    p.add_argument('--orders', default='fifo', help='fifo and/or priority (fifo)')
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--steps', type=int, default=5)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--batch', type=int, default=32)
    p.add_argument('--tflops', type=float, default=15.0)
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--servers', type=int, default=2)
    p.add_argument('--build', default=os.path.join(sl.SOURCE_DIR, 'build'))
    p.add_argument('--json', help='write every figure there')
    p.add_argument('--security', default='sealed', choices=('sealed', 'auth', 'none'),
                   help='sealed (the default), auth (TESSERA_AUTH_ONLY=1), none '
                   '(TESSERA_INSECURE=1)')
    p.add_argument('--resend-timeout-ms', type=int, default=60000)
    p.add_argument('--no-link-check', action='store_true')
    p.add_argument('--burst', default=str(sl.BURST_BYTES))
    p.add_argument('--latency', default=sl.LATENCY)
    p.add_argument('--tag', default='mr%d' % (os.getpid() % 10000),
                   help='prefix of the namespaces and links (one per run)')
    p.add_argument('--timeout', type=int, default=900, help='seconds per job')
    args = p.parse_args(argv)
    args.extra = extra
    args.models = parse_list(p, 'models', args.models, MODELS)
    args.gc = parse_list(p, 'gc', args.gc, GCS)
    args.orders = parse_list(p, 'orders', args.orders, ORDERS)
    args.rates = [r for r in args.rates.split(',') if r]
    for r in args.rates:
        if r != sl.LOOPBACK and sl.parse_rate(r) is None:
            p.error('--rates: %s is neither loopback nor a tc rate' % r)
    if min(args.runs, args.steps, args.batch, args.workers, args.servers) < 1:
        p.error('--runs, --steps, --batch, --workers and --servers must be positive')
    b = args.burst.lower()
    args.burst = int(b[:-1]) * {'k': 1024, 'm': 1 << 20}[b[-1]] if b[-1] in 'km' else int(b)
    return args


def worker_argv(args, bench, model, gc, order, rate):
    argv = [bench, '--model=' + model, '--gc=' + gc, '--order=' + order,
            '--steps=%d' % args.steps, '--warmup=%d' % args.warmup,
            '--batch=%d' % args.batch, '--tflops=%g' % args.tflops]
    if rate != sl.LOOPBACK:
        argv.append('--link-gbps=%g' % (sl.parse_rate(rate) / 1e9))
    return argv + args.extra


def read_metrics(pattern, workers):
    out = []
    for rank in range(workers):
        with open(pattern.replace('{rank}', str(rank))) as f:
            out.append(json.load(f))
    return out


# The launch.py processes running now: a signal that ends this driver ends
# them first, with SIGTERM, so that each stops its job (the resources' own
# clean-up SIGKILLs the processes it lists, which would orphan a job).
ACTIVE_LAUNCHERS = []


def end_launchers_on_signal():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        then = signal.getsignal(sig)

        def handler(signum, frame, then=then):
            for p in list(ACTIVE_LAUNCHERS):
                p.end(signal.SIGTERM, wait_s=20)
            if callable(then):
                then(signum, frame)
        signal.signal(sig, handler)


def run_loopback(args, res, binaries, argv, name):
    """One job through tools/launch.py; (worker metrics or None, seconds)."""
    metrics = os.path.join(res.tmp, name + '-{rank}.json')
    log = os.path.join(res.tmp, name + '.log')
    cmd = [sys.executable, os.path.join(sl.SOURCE_DIR, 'tools', 'launch.py'),
           '-n', str(args.workers), '-s', str(args.servers),
           '--scheduler-binary', binaries['scheduler'], '--server-binary', binaries['server'],
           ] + argv + ['--metrics-out=' + metrics]
    t0 = time.monotonic()
    proc = sl.Proc(res, None, 'launch.py ' + name, cmd, dict(os.environ), log)
    ACTIVE_LAUNCHERS.append(proc)
    try:
        code = proc.proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        code = 'timed out after %d s' % args.timeout
    finally:
        proc.end(signal.SIGTERM, wait_s=20)  # launch.py stops its job
        ACTIVE_LAUNCHERS.remove(proc)
    seconds = time.monotonic() - t0
    if code != 0:
        say('job %s failed (%s); last lines of %s:\n%s' % (name, code, log,
                                                           sl.tail_of(log, 30)))
        return None, seconds
    try:
        return read_metrics(metrics, args.workers), seconds
    except (OSError, ValueError) as e:
        say('job %s: no --metrics-out JSON: %s' % (name, e))
        return None, seconds


def run_shaped(args, res, topo, binaries, argv, name, port):
    """One job in the namespaces (shaped_link.Job adds --metrics-out)."""
    job = sl.Job(res, topo, binaries, argv, args.servers, args.workers, name, port)
    ok = job.wait(args.timeout)
    metrics = None
    if ok:
        try:
            metrics = job.worker_metrics(args.workers)
        except (OSError, ValueError) as e:
            ok, job.why = False, 'no --metrics-out JSON: %s' % e
    left = topo.processes()
    if left:
        ok, job.why = False, (job.why or '') + '; left behind: %s' % left
    if not ok:
        res.keep_logs()
        say('job %s failed: %s\n%s' % (name, job.why, job.report()))
        return None, job.elapsed
    return metrics, job.elapsed


def summarize(metrics, job_s):
    """One job's figures: the slowest worker's median step, the bounds."""
    slowest = max(metrics, key=lambda m: m['median_step_ms'])
    m0 = metrics[0]
    return {
        'step_ms': slowest['median_step_ms'], 'compute_ms': m0['compute_ms'],
        'wait_ms': slowest['median_wait_ms'], 'first_wait_ms': slowest['median_first_wait_ms'],
        'measured_compute_ms': max(m['measured_compute_ms'] for m in metrics),
        'link_ms': m0['link_ms'], 'busiest_link': m0['busiest_link'],
        'bound_ms': m0['overlap_bound_ms'],
        'bytes_pushed': m0['bytes_pushed_per_step'],
        'bytes_pulled': m0['bytes_pulled_per_step'],
        'bytes_match': all(m['measured_bytes_pushed_per_step'] == m['bytes_pushed_per_step'] and
                           m['measured_bytes_pulled_per_step'] == m['bytes_pulled_per_step']
                           for m in metrics),
        'keys': m0['keys'], 'params': m0['params'], 'job_s': job_s,
    }


def table_rows(runs, args, rate):
    """Per (model, gc, order): medians over the runs, and x fifo of the same runs."""
    rows = []
    for model in args.models:
        for gc in args.gc:
            fifo = [r for r in runs if (r['rate'], r['model'], r['gc'], r['order']) ==
                    (rate, model, gc, 'fifo')]
            for order in args.orders:
                mine = [r for r in runs if (r['rate'], r['model'], r['gc'], r['order']) ==
                        (rate, model, gc, order)]
                if not mine:
                    continue
                step = statistics.median(r['step_ms'] for r in mine)
                row = dict(mine[0], step_ms=step, runs=[r['step_ms'] for r in mine],
                           wait_ms=statistics.median(r['wait_ms'] for r in mine),
                           first_wait_ms=statistics.median(r['first_wait_ms'] for r in mine))
                row['x_bound'] = step / row['bound_ms']
                row['x_fifo'] = (statistics.median(r['step_ms'] for r in fifo) / step
                                 if fifo else None)
                rows.append(row)
    return rows


def print_table(rate, rows, args, link_mbit):
    where = ('plain loopback (no link bound: the bound is the compute)' if rate == sl.LOOPBACK
             else '%s per node (tbf both ends)' % rate)
    print('\n### %s, %d workers, %d servers\n' % (where, args.workers, args.servers))
    if link_mbit:
        print('link check: bulk TCP worker 0 -> server 0: %.0f Mbit/s\n' % link_mbit)
    print('| model | gc | order | step ms | runs | wait ms (first layer) | compute ms | link ms '
          '| bound ms | x bound | x fifo | MB up | MB down |')
    print('|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|')
    for r in rows:
        link = '%.1f (%s)' % (r['link_ms'], r['busiest_link']) if r['link_ms'] else '-'
        print('| %s | %s | %s | %.1f | %s | %.0f (%.0f) | %.1f | %s | %.1f | %.2f | %s | %.1f '
              '| %.1f |' % (
                  r['model'], r['gc'], r['order'], r['step_ms'],
                  ', '.join('%.0f' % x for x in r['runs']), r['wait_ms'], r['first_wait_ms'],
                  r['compute_ms'], link, r['bound_ms'], r['x_bound'],
                  '%.2f' % r['x_fifo'] if r['x_fifo'] else '-',
                  r['bytes_pushed'] / 1e6, r['bytes_pulled'] / 1e6))
    sys.stdout.flush()


def check_orders(bench, orders):
    """None, or why model_replay refuses one of `orders`."""
    for order in orders:
        done = subprocess.run([bench, '--model=mlp', '--describe', '--order=' + order],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        if done.returncode != 0:
            return done.stderr.decode('utf-8', 'replace').strip().splitlines()[0]
    return None


def set_environment(args):
    os.environ['PATH'] = os.environ.get('PATH', '') + ':/usr/sbin:/sbin'
    os.environ['PS_RESEND_TIMEOUT'] = str(args.resend_timeout_ms)
    os.environ['TESSERA_INSECURE'] = '1' if args.security == 'none' else '0'
    os.environ['TESSERA_AUTH_ONLY'] = '1' if args.security == 'auth' else '0'


def shaped_topology(args, res, shaped, record):
    topo = sl.Topology(res, args.servers, args.workers, args.burst, args.latency)
    topo.setup()
    for rate in shaped:
        if args.no_link_check:
            continue
        topo.shape(rate)
        mbit, why = sl.link_check(res, topo)
        record['link_check_mbit_s'][rate] = mbit
        say('link check at %s: %s' % (rate, '%.0f Mbit/s' % mbit if mbit else why))
    return topo


def run_all(args, binaries, res, topo, record):
    """Every job; False when one failed."""
    plan = [(run, rate, model, gc, order) for run in range(1, args.runs + 1)
            for rate in args.rates for model in args.models for gc in args.gc
            for order in args.orders]
    for n, (run, rate, model, gc, order) in enumerate(plan, 1):
        name = 'r%d-%s-%s-%s-%s' % (run, rate, model, gc, order)
        argv = worker_argv(args, binaries['bench'], model, gc, order, rate)
        load = sl.uptime()
        say('job %d/%d %s: started (%s)' % (n, len(plan), name, load))
        if rate == sl.LOOPBACK:
            metrics, job_s = run_loopback(args, res, binaries, argv, name)
        else:
            topo.shape(rate)
            metrics, job_s = run_shaped(args, res, topo, binaries, argv, name,
                                        sl.ROOT_PORT + n % 500)
        if metrics is None:
            return False
        fig = summarize(metrics, job_s)
        fig.update(run=run, rate=rate, model=model, gc=gc, order=order,
                   uptime_before=load, worker_metrics=metrics)
        record['runs'].append(fig)
        say('job %s: step %.1f ms (compute %.1f, bound %.1f), bytes as computed: %s'
               % (name, fig['step_ms'], fig['compute_ms'], fig['bound_ms'],
                  fig['bytes_match']))
    return True


def main(argv):
    args = parse_args(argv)
    b = os.path.abspath(args.build)
    binaries = {'scheduler': os.path.join(b, 'scheduler', 'tessera-scheduler'),
                'server': os.path.join(b, 'server', 'tessera-server'),
                'bench': os.path.join(b, 'tools', 'bench', 'model_replay')}
    for path in binaries.values():
        if not os.access(path, os.X_OK):
            say('%s not built (--build %s)' % (path, b))
            return sl.EXIT_USAGE
    refused = check_orders(binaries['bench'], args.orders)
    if refused:
        say(refused)
        return sl.EXIT_USAGE
    set_environment(args)
    shaped = [r for r in args.rates if r != sl.LOOPBACK]
    if shaped:
        why = sl.missing_prerequisite(args.tag)
        if why:
            say('cannot build shaped links: %s' % why)
            return sl.EXIT_NO_SHAPING
    res = sl.start_resources(args.tag)
    end_launchers_on_signal()
    record = {'command': ' '.join(['tools/bench/model_replay.py'] + argv),
              'started': time.strftime('%Y-%m-%d %H:%M:%S %z'),
              'uptime_before': sl.uptime(), 'workers': args.workers,
              'servers': args.servers, 'steps': args.steps, 'warmup': args.warmup,
              'batch': args.batch, 'tflops': args.tflops, 'security': args.security,
              'bench_flags': args.extra, 'link_check_mbit_s': {}, 'runs': []}
    say('uptime: %s' % record['uptime_before'])
    try:
        topo = shaped_topology(args, res, shaped, record) if shaped else None
        if not run_all(args, binaries, res, topo, record):
            res.keep_logs()
            if args.json:  # the jobs that finished
                sl.write_json(args.json, record)
            return sl.EXIT_JOB_FAILED
        record['uptime_after'] = sl.uptime()
        print('## model replay: %d workers, %d servers, batch %d per worker, %g TFLOP/s, '
              '%d timed steps after %d, medians of %d run(s), security %s\n'
              % (args.workers, args.servers, args.batch, args.tflops, args.steps,
                 args.warmup, args.runs, args.security))
        for key in ('command', 'started', 'uptime_before', 'uptime_after'):
            print('%s: %s  ' % (key.replace('_', ' '), record[key]))
        record['tables'] = {}
        for rate in args.rates:
            rows = table_rows(record['runs'], args, rate)
            record['tables'][rate] = [dict((k, v) for k, v in r.items()
                                           if k != 'worker_metrics') for r in rows]
            print_table(rate, rows, args, record['link_check_mbit_s'].get(rate))
        if args.json:
            sl.write_json(args.json, record)
        return 0
    finally:
        res.teardown()


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
