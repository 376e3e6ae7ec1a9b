#!/usr/bin/env python3
"""Tessera's quick-start job against PyTorch DDP training the same MLP (issue #27).

For every run (--runs) and every rate (--rates), in turn, so that the machine's
drifting load falls on all alike:

  tessera        the quick-start job: tools/quickstart.sh's tessera-worker flags
                 for --epochs, 2 workers, 1 server. On loopback it is started as
                 a user does, `tools/launch.py -n 2 -s 1 --launcher local ...`
                 (default security: sealed links, a key per process); at a shaped
                 rate every node runs in a namespace of its own with a tbf link of
                 that rate (tools/bench/shaped_link.py), secured with fresh job
                 keys. --tessera-modes picks its compression: push2bit (the
                 quick-start's --gc-type 2bit, the default on loopback),
                 both2bit (also --gc-pull 2bit, the default at shaped rates), none;
                 a mode with +fused adds --fuse-keys on (one key, one round a
                 step, as the quick start runs)
  ddp-none       PyTorch DDP (gloo), tools/bench/ddp_mlp.py, 2 processes
  ddp-fp16       ... with DDP's fp16_compress_hook
  ddp-powersgd   ... with its PowerSGD hook (rank 2)

At a shaped rate the two DDP processes run in the namespaces of the job's two
workers, so each has its own link of that rate, as Tessera's workers do (DDP has
no server: gloo's ring all-reduce goes worker to worker).

Printed per rate: a Markdown table, medians over the runs, of
  wall s   the slowest worker's training time: first step to the end of the
           last epoch's evaluation (tessera-worker's and ddp_mlp.py's
           wall_seconds); start-up (loading data, joining, importing torch)
           is not in it
  job s    from starting the first process to the last one's exit
  test acc rank 0's test accuracy after the last epoch
and each against the tessera row ("x tessera": the row's wall s over Tessera's).

    [sudo] tools/bench/ddp_compare.py [--rates loopback,1gbit] [--runs 3]
        [--epochs 3] [--build build] [--json FILE] [--tessera-modes push2bit]
        [--ddp none,fp16,powersgd]

The DDP workers run under the Python that has torch (Debian's python3-torch:
/usr/bin/python3, else this one). Exit status: 0 every job finished; 1 a job
failed; 2 a usage error; 3 shaped links cannot be built here (not root).
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

DDP_HOOKS = ('none', 'fp16', 'powersgd')
TESSERA_MODES = ('none', 'push2bit', 'both2bit')
DDP_PORT = 29400


def torch_python():
    for py in ('/usr/bin/python3', sys.executable):
        if os.access(py, os.X_OK) and subprocess.run(
                [py, '-c', 'import torch, numpy'], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL).returncode == 0:
            return py
    return None


def parse_args(argv):
    p = argparse.ArgumentParser(prog='ddp_compare.py', description=__doc__.split('\n')[0])
    p.add_argument('--rates', default='loopback')
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--build', default=os.path.join(sl.SOURCE_DIR, 'build'))
    p.add_argument('--json')
    p.add_argument('--tessera-modes', default='',
                   help='push2bit on loopback and both2bit at shaped rates unless given')
    p.add_argument('--ddp', default=','.join(DDP_HOOKS))
    p.add_argument('--timeout', type=int, default=600)
    p.add_argument('--tag', default='dc%d' % (os.getpid() % 100000))
    args = p.parse_args(argv)
    args.rates = [r.strip().lower() for r in args.rates.split(',') if r.strip()]
    for r in args.rates:
        if r != sl.LOOPBACK and (sl.parse_rate(r) is None or sl.parse_rate(r) <= 0):
            p.error('--rates: expected loopback or tc rates such as 1gbit, got %r' % r)
    args.ddp = [h for h in args.ddp.split(',') if h]
    for h in args.ddp:
        if h not in DDP_HOOKS:
            p.error('--ddp: expected some of %s, got %r' % (','.join(DDP_HOOKS), h))
    args.tessera_modes = [m for m in args.tessera_modes.split(',') if m]
    for m in args.tessera_modes:
        if m.replace('+fused', '') not in TESSERA_MODES:
            p.error('--tessera-modes: expected some of %s, got %r' % (','.join(TESSERA_MODES), m))
    if args.runs < 1 or args.epochs < 1:
        p.error('--runs and --epochs must be positive')
    return args


def tessera_flags(mode, epochs):
    fused = ['--fuse-keys', 'on'] if mode.endswith('+fused') else []
    return (sl.QUICKSTART_FLAGS + ['--epochs', str(epochs)] +
            sl.MODES[mode.replace('+fused', '')] + fused)


def run_tessera_loopback(res, build, mode, epochs, name, timeout):
    """As a user starts it: launch.py, default security."""
    metrics = os.path.join(res.tmp, name + '-{rank}.json')
    argv = [sys.executable, os.path.join(sl.SOURCE_DIR, 'tools', 'launch.py'), '-n', '2', '-s',
            '1', '--launcher', 'local', os.path.join(build, 'worker', 'tessera-worker')] + \
        tessera_flags(mode, epochs) + ['--metrics-out', metrics]
    env = dict((k, v) for k, v in os.environ.items()
               if not k.startswith('DMLC_') and k not in ('TESSERA_INSECURE',
                                                         'TESSERA_AUTH_ONLY'))
    start = time.monotonic()
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          timeout=timeout)
    job_s = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError('tessera job exit %d:\n%s' % (done.returncode,
                                                         done.stdout.decode()[-3000:]))
    ms = []
    for rank in range(2):
        with open(metrics.replace('{rank}', str(rank))) as f:
            ms.append(json.load(f))
    return ms, job_s


def run_tessera_shaped(res, topo, binaries, mode, epochs, name, port, timeout):
    job = sl.Job(res, topo, binaries, [binaries['worker']] + tessera_flags(mode, epochs), 1, 2,
                 name, port)
    if not job.wait(timeout):
        res.keep_logs()
        raise RuntimeError('tessera job %s failed: %s\n%s' % (name, job.why, job.report()))
    return job.worker_metrics(2), job.elapsed


def run_ddp(res, topo, py, hook, epochs, name, port, timeout):
    if topo is None:
        hosts = [None, None]
        master = '127.0.0.1'
    else:
        w0 = topo.first('worker')
        hosts = [topo.namespaces[w0], topo.namespaces[w0 + 1]]
        master = topo.nodes[w0][1]
    outs = [os.path.join(res.tmp, '%s-%d.json' % (name, r)) for r in range(2)]
    env = dict(os.environ)
    if topo is not None:
        env['GLOO_SOCKET_IFNAME'] = 'eth0'  # else gloo offers its peer 127.0.0.1
    start = time.monotonic()
    procs = []
    for rank in range(2):
        argv = [py, os.path.join(HERE, 'ddp_mlp.py'), '--rank', str(rank), '--world', '2',
                '--master', '%s:%d' % (master, port), '--epochs', str(epochs), '--hook', hook,
                '--out', outs[rank]]
        procs.append(sl.netns.Proc(res, hosts[rank], 'ddp %d' % rank, argv, env,
                                   os.path.join(res.tmp, '%s-%d.log' % (name, rank))))
    why, ended = sl.netns.wait_all(procs, start + timeout, 10,
                                   'still running %d s after it started' % timeout)
    codes = [p.proc.returncode for p in procs]
    if why is not None or any(codes):
        res.keep_logs()
        raise RuntimeError('ddp %s failed (%s, exits %s):\n%s' % (
            name, why, codes, '\n'.join(p.tail(15) for p in procs)))
    ms = []
    for path in outs:
        with open(path) as f:
            ms.append(json.load(f))
    return ms, ended - start


def figures(ms, job_s):
    r0 = next(m for m in ms if m['rank'] == 0)
    return {'wall_s': max(m['wall_seconds'] for m in ms), 'job_s': job_s,
            'test_acc': r0['test_accuracy']}


def main(argv):
    args = parse_args(argv)
    py = torch_python()
    if py is None and args.ddp:
        sl.say('no Python with torch and numpy here (Debian: apt-get install python3-torch)')
        return sl.EXIT_USAGE
    binaries = {'scheduler': os.path.join(args.build, 'scheduler', 'tessera-scheduler'),
                'server': os.path.join(args.build, 'server', 'tessera-server'),
                'worker': os.path.join(args.build, 'worker', 'tessera-worker')}
    for path in binaries.values():
        if not os.access(path, os.X_OK):
            sl.say('%s not built (--build %s)' % (path, args.build))
            return sl.EXIT_USAGE
    shaped = [r for r in args.rates if r != sl.LOOPBACK]
    os.environ['PATH'] = os.environ.get('PATH', '') + ':/usr/sbin:/sbin'
    if shaped:
        why = sl.missing_prerequisite(args.tag)
        if why:
            sl.say('cannot build shaped links: %s' % why)
            return sl.EXIT_NO_SHAPING
    res = sl.start_resources(args.tag)
    record = {'command': ' '.join(['tools/bench/ddp_compare.py'] + argv),
              'started': time.strftime('%Y-%m-%d %H:%M:%S %z'), 'uptime_before': sl.uptime(),
              'epochs': args.epochs, 'runs': []}
    rows = {}
    try:
        topo = None
        if shaped:
            topo = sl.Topology(res, 1, 2, sl.BURST_BYTES, sl.LATENCY)
            topo.setup()
        n = 0
        for run in range(args.runs):
            for rate in args.rates:
                modes = args.tessera_modes or (['push2bit'] if rate == sl.LOOPBACK
                                               else ['both2bit'])
                if rate != sl.LOOPBACK:
                    topo.shape(rate)
                configs = [('tessera-' + m, m) for m in modes] + \
                    [('ddp-' + h, h) for h in args.ddp]
                for label, what in configs:
                    n += 1
                    name = 'r%d-%s-%s' % (run + 1, rate, label)
                    load = sl.uptime()
                    sl.say('%s: started (%s)' % (name, load))
                    if label.startswith('tessera'):
                        if rate == sl.LOOPBACK:
                            ms, job_s = run_tessera_loopback(res, args.build, what, args.epochs,
                                                             name, args.timeout)
                        else:
                            ms, job_s = run_tessera_shaped(res, topo, binaries, what,
                                                           args.epochs, name,
                                                           sl.ROOT_PORT + n % 500, args.timeout)
                    else:
                        ms, job_s = run_ddp(res, topo if rate != sl.LOOPBACK else None, py,
                                            what, args.epochs, name, DDP_PORT + n % 500,
                                            args.timeout)
                    fig = figures(ms, job_s)
                    sl.say('%s: wall %.2f s, job %.2f s, test acc %.4f' % (
                        name, fig['wall_s'], fig['job_s'], fig['test_acc']))
                    rows.setdefault(rate, {}).setdefault(label, []).append(fig)
                    record['runs'].append(dict(fig, run=run + 1, rate=rate, config=label,
                                               uptime_before=load, worker_metrics=ms))
        record['uptime_after'] = sl.uptime()
        print('## Quick-start MLP, %d epochs, 2 workers: Tessera against PyTorch DDP (gloo)\n'
              % args.epochs)
        print('command: %s  ' % record['command'])
        print('uptime before: %s  \nuptime after: %s  ' % (record['uptime_before'],
                                                          record['uptime_after']))
        for rate in args.rates:
            print('\n### %s, medians of %d runs\n' % (
                'loopback' if rate == sl.LOOPBACK else '%s per node (tbf both ends)' % rate,
                args.runs))
            print('| config | wall s | job s | test acc | wall s x tessera | runs (wall s) |')
            print('|---|---:|---:|---:|---:|---|')
            base = None
            for label, figs in rows[rate].items():
                wall = statistics.median(f['wall_s'] for f in figs)
                if base is None and label.startswith('tessera'):
                    base = wall
                print('| %s | %.2f | %.2f | %.4f | %s | %s |' % (
                    label, wall, statistics.median(f['job_s'] for f in figs),
                    statistics.median(f['test_acc'] for f in figs),
                    '%.2f' % (wall / base) if base else '-',
                    ', '.join('%.2f' % f['wall_s'] for f in figs)))
        sys.stdout.flush()
        if args.json:
            sl.write_json(args.json, record)
        return 0
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        sl.say(str(e))
        return sl.EXIT_JOB_FAILED
    finally:
        res.teardown()


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
