#!/usr/bin/env python3
"""Figures of a Tessera job: PNGs from its metrics JSON, traces and benchmark output.

    tools/plot.py --out DIR [--metrics FILE...] [--trace FILE...] [--bench FILE...]

  --metrics  tessera-worker --metrics-out files (one per worker; "epoch_log" inside)
  --trace    TESSERA_TRACE files of tessera-worker processes (their "step" spans)
  --bench    tessera-bench --json output

What it draws (each when its input is given):
  step_breakdown.png  per worker, a training step's time split into compute (forward and
                      backward), communication (issuing pushes and pulls: 2-bit compression
                      and the requests) and waiting (for the pushes and pulls to finish, and
                      for the next batch), stacked, over the job's time (from --trace; from
                      --metrics, per epoch, when no trace is given)
  throughput.png      samples per second per epoch, per worker and their sum
  accuracy.png        validation accuracy (rank 0) and training accuracy per epoch
  bench.png           tessera-bench throughput and round-trip latency, each bar beside
                      the same run's raw ZeroMQ baseline

Needs matplotlib (Debian: python3-matplotlib, which tools/install-deps.sh installs); an
interpreter without it (a pyenv or venv python3 first on PATH) hands over to
/usr/bin/python3. Exit 0 when every figure asked for was written, 2 on bad input (one line
naming the file and what is wrong).
"""
import argparse
import json
import os
import sys

PROG = 'plot.py'
SYSTEM_PYTHON = '/usr/bin/python3'

# Colours of the step phases, and the order they stack in.
PHASES = [('compute', '#4c72b0'), ('communication', '#dd8452'), ('waiting', '#c44e52')]


class InputError(Exception):
    pass


def import_matplotlib():
    try:
        import matplotlib
    except ImportError:
        me = os.path.realpath(sys.executable or '')
        if (os.environ.get('TESSERA_PLOT_REEXEC') != '1' and os.path.exists(SYSTEM_PYTHON)
                and os.path.realpath(SYSTEM_PYTHON) != me):
            env = dict(os.environ, TESSERA_PLOT_REEXEC='1')
            os.execve(SYSTEM_PYTHON, [SYSTEM_PYTHON, os.path.abspath(__file__)] + sys.argv[1:],
                      env)
        sys.stderr.write('%s: matplotlib is not installed for %s (Debian: apt-get install '
                         'python3-matplotlib; tools/install-deps.sh installs it)\n'
                         % (PROG, sys.executable))
        sys.exit(2)
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise InputError('%s: %s' % (path, e.strerror))
    except ValueError as e:
        raise InputError('%s: not JSON (%s)' % (path, e))


# --- inputs -------------------------------------------------------------------------


def read_metrics(paths):
    """[(rank, metrics dict)] sorted by rank."""
    out = []
    for path in paths:
        m = load_json(path)
        if not isinstance(m, dict) or 'rank' not in m or 'epoch_log' not in m:
            raise InputError('%s: expected tessera-worker --metrics-out JSON with "rank" and '
                             '"epoch_log"' % path)
        out.append((m['rank'], m))
    return sorted(out, key=lambda x: x[0])


def step_phases(path):
    """(rank, [(start_s, {phase: seconds})]) of one worker trace's steps."""
    trace = load_json(path)
    if not isinstance(trace, dict) or 'traceEvents' not in trace:
        raise InputError('%s: expected a TESSERA_TRACE file (Chrome trace JSON)' % path)
    rank = trace.get('otherData', {}).get('rank', -1)
    complete = [e for e in trace['traceEvents'] if e.get('ph') == 'X']
    steps = sorted((e for e in complete if e['name'] == 'step'), key=lambda e: e['ts'])
    if not steps:
        raise InputError('%s: no "step" spans (is it a tessera-worker trace?)' % path)
    main_tid = steps[0]['tid']
    # Phases lie inside their step on the main thread: assign by start time.
    phases = sorted((e for e in complete if e['tid'] == main_tid and e['name'] in
                     ('data-wait', 'forward', 'backward', 'issue', 'comm-wait')),
                    key=lambda e: e['ts'])
    out = []
    i = 0
    for step in steps:
        begin, end = step['ts'], step['ts'] + step['dur']
        t = {'data-wait': 0.0, 'forward': 0.0, 'backward': 0.0, 'issue': 0.0,
             'comm-wait': 0.0}
        while i < len(phases) and phases[i]['ts'] < begin:
            i += 1
        j = i
        while j < len(phases) and phases[j]['ts'] <= end:
            t[phases[j]['name']] += phases[j]['dur'] / 1e6
            j += 1
        i = j
        split = {
            'compute': max(0.0, t['forward'] + t['backward'] - t['issue']),
            'communication': t['issue'],
            'waiting': t['comm-wait'] + t['data-wait'],
        }
        out.append((begin / 1e6, split))
    return rank, out


def bench_rows(paths):
    """[(label, tessera, baseline, unit)] of throughput and latency bars."""
    rows = []
    for path in paths:
        b = load_json(path)
        if not isinstance(b, dict) or 'jobs' not in b or 'baseline' not in b:
            raise InputError('%s: expected tessera-bench --json output' % path)
        base = {x['size']: x for x in b['baseline']}
        for job in b['jobs']:
            name = '%dx%d %s' % (job['servers'], job['workers'], job['optimizer'])
            best = {}
            for r in job['results']:
                key = (r['op'], r['size'])
                if key not in best or r['gbps'] > best[key]['gbps']:
                    best[key] = r
            for (op, size), r in sorted(best.items(), key=lambda x: (x[0][1], x[0][0])):
                raw = base.get(size, {})
                ref = raw.get('zmq_two_way_gbps' if op == 'pushpull' else 'zmq_gbps')
                rows.append(('throughput', '%s %s\n%s' % (op, human(size), name),
                             r['gbps'], ref, 'GB/s'))
                if op == 'pushpull' and size == 4096:
                    lat = [x for x in job['results'] if x['op'] == op and x['size'] == size
                           and x['inflight'] == 1]
                    if lat:
                        rows.append(('latency', 'pushpull 4 KB p50\n%s' % name,
                                     lat[0]['p50_us'], raw.get('zmq_rtt_p50_us'), 'us'))
    if not rows:
        raise InputError('%s: no results' % ', '.join(paths))
    return rows


def human(size):
    for unit, n in (('M', 1 << 20), ('K', 1 << 10)):
        if size >= n and size % n == 0:
            return '%d %sB' % (size // n, unit)
    return '%d B' % size


# --- figures ------------------------------------------------------------------------


def plot_step_breakdown_traces(plt, traces, out):
    workers = [step_phases(p) for p in traces]
    workers.sort(key=lambda w: w[0])
    t0 = min(steps[0][0] for _, steps in workers)
    fig, axes = plt.subplots(len(workers), 1, figsize=(9, 2.6 * len(workers) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (rank, steps) in zip(axes[:, 0], workers):
        # Steps are many and short: average them over up to 120 windows of time.
        span = max(steps[-1][0] - t0, 1e-9)
        bins = min(120, len(steps))
        sums = [[0.0] * len(PHASES) for _ in range(bins)]
        counts = [0] * bins
        for start, split in steps:
            k = min(bins - 1, int((start - t0) / span * bins))
            counts[k] += 1
            for i, (phase, _) in enumerate(PHASES):
                sums[k][i] += split[phase]
        xs, ys = [], [[] for _ in PHASES]
        for k in range(bins):
            if counts[k] == 0:
                continue
            xs.append(t0 + (k + 0.5) * span / bins - t0)
            for i in range(len(PHASES)):
                ys[i].append(1000.0 * sums[k][i] / counts[k])
        ax.stackplot(xs, *ys, labels=[p for p, _ in PHASES], colors=[c for _, c in PHASES],
                     alpha=0.9)
        mean = {p: sum(split[p] for _, split in steps) / len(steps) for p, _ in PHASES}
        ax.set_ylabel('ms per step')
        ax.set_title('worker %d: %d steps, %.1f ms per step on average (%s)' %
                     (rank, len(steps), 1000.0 * sum(mean.values()),
                      ', '.join('%s %.1f' % (p, 1000.0 * mean[p]) for p, _ in PHASES)),
                     fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc='upper right', fontsize=8, ncol=3)
    axes[-1, 0].set_xlabel('seconds since the first step')
    fig.suptitle('Where a training step\'s time goes')
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_step_breakdown_epochs(plt, metrics, out):
    fig, axes = plt.subplots(len(metrics), 1, figsize=(9, 2.6 * len(metrics) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (rank, m) in zip(axes[:, 0], metrics):
        log = m['epoch_log']
        xs = [e['epoch'] for e in log]
        parts = {'compute': [e['time_compute_s'] for e in log],
                 'communication': [e['time_issue_s'] for e in log],
                 'waiting': [e['time_comm_s'] + e['time_data_s'] for e in log]}
        bottom = [0.0] * len(xs)
        for phase, colour in PHASES:
            ax.bar(xs, parts[phase], bottom=bottom, color=colour, label=phase)
            bottom = [b + v for b, v in zip(bottom, parts[phase])]
        ax.set_ylabel('seconds')
        ax.set_title('worker %d' % rank, fontsize=10)
        ax.grid(alpha=0.3, axis='y')
    axes[0, 0].legend(loc='upper right', fontsize=8, ncol=3)
    axes[-1, 0].set_xlabel('epoch')
    fig.suptitle('Where each epoch\'s time goes')
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_throughput(plt, metrics, out):
    fig, ax = plt.subplots(figsize=(8, 4))
    total = {}
    for rank, m in metrics:
        log = m['epoch_log']
        xs = [e['epoch'] for e in log]
        ys = [e['samples_per_second'] for e in log]
        ax.plot(xs, ys, marker='o', label='worker %d' % rank)
        for x, y in zip(xs, ys):
            total[x] = total.get(x, 0.0) + y
    if len(metrics) > 1:
        xs = sorted(total)
        ax.plot(xs, [total[x] for x in xs], marker='s', color='black', label='job (sum)')
    ax.set_xlabel('epoch')
    ax.set_ylabel('samples / second')
    ax.set_ylim(bottom=0)
    ax.set_title('Training throughput per epoch')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_accuracy(plt, metrics, out):
    fig, ax = plt.subplots(figsize=(8, 4))
    for rank, m in metrics:
        log = m['epoch_log']
        ax.plot([e['epoch'] for e in log], [e['train_accuracy'] for e in log],
                linestyle='--', marker='.', label='training, worker %d' % rank)
        val = [(e['epoch'], e['validation_accuracy']) for e in log
               if e['validation_accuracy'] >= 0]
        if val:
            ax.plot([v[0] for v in val], [v[1] for v in val], marker='o', linewidth=2,
                    label='validation (worker %d)' % rank)
    ax.set_xlabel('epoch')
    ax.set_ylabel('accuracy')
    ax.set_title('Accuracy per epoch')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_bench(plt, rows, out):
    groups = [g for g in ('throughput', 'latency') if any(r[0] == g for r in rows)]
    widths = [max(1, sum(1 for r in rows if r[0] == g)) for g in groups]
    fig, axes = plt.subplots(1, len(groups), figsize=(3 + 1.2 * sum(widths), 4.5),
                             gridspec_kw={'width_ratios': widths}, squeeze=False)
    for ax, group in zip(axes[0], groups):
        sel = [r for r in rows if r[0] == group]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [r[2] for r in sel], width=0.4, color='#4c72b0',
               label='Tessera')
        ax.bar([x + 0.2 for x in xs], [r[3] or 0 for r in sel], width=0.4, color='#999999',
               label='raw ZeroMQ (same run)')
        for x, r in zip(xs, sel):
            if r[3]:
                ax.annotate('%.2fx' % (r[2] / r[3]), (x - 0.2, r[2]), ha='center',
                            va='bottom', fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r[1] for r in sel], fontsize=8)
        unit = sel[0][4]
        ax.set_ylabel(unit)
        ax.set_title('throughput (higher is better)' if group == 'throughput'
                     else 'round trip (lower is better)', fontsize=10)
        ax.grid(alpha=0.3, axis='y')
        ax.legend(fontsize=8)
    fig.suptitle('tessera-bench beside its raw ZeroMQ baseline')
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split('\n')[0])
    p.add_argument('--out', required=True, help='folder for the PNG files (created)')
    p.add_argument('--metrics', nargs='+', default=[], metavar='FILE')
    p.add_argument('--trace', nargs='+', default=[], metavar='FILE')
    p.add_argument('--bench', nargs='+', default=[], metavar='FILE')
    args = p.parse_args(argv)
    if not (args.metrics or args.trace or args.bench):
        sys.stderr.write('%s: nothing to draw: give --metrics, --trace or --bench\n' % PROG)
        return 2
    plt = import_matplotlib()
    try:
        metrics = read_metrics(args.metrics)
        bench = bench_rows(args.bench) if args.bench else None
        os.makedirs(args.out, exist_ok=True)
        written = []

        def out(name):
            written.append(os.path.join(args.out, name))
            return written[-1]
        if args.trace:
            plot_step_breakdown_traces(plt, args.trace, out('step_breakdown.png'))
        elif metrics:
            plot_step_breakdown_epochs(plt, metrics, out('step_breakdown.png'))
        if metrics:
            plot_throughput(plt, metrics, out('throughput.png'))
            plot_accuracy(plt, metrics, out('accuracy.png'))
        if bench:
            plot_bench(plt, bench, out('bench.png'))
    except InputError as e:
        sys.stderr.write('%s: %s\n' % (PROG, e))
        return 2
    except (KeyError, TypeError, IndexError) as e:
        sys.stderr.write('%s: unexpected input (%s: %s)\n' % (PROG, type(e).__name__, e))
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
