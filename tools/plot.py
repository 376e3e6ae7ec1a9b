#!/usr/bin/env python3
"""Figures of a Tessera job: PNGs from its traces, metrics JSON and benchmark output.

    tools/plot.py steps TRACE... -o steps.png          # where a step's time goes
    tools/plot.py epochs METRICS... -o epochs.png      # throughput and accuracy per epoch
    tools/plot.py bench BENCH.json... -o bench.png     # tessera-bench beside raw ZeroMQ

steps   TESSERA_TRACE files of tessera-worker processes (one per worker): per worker, a
        training step's time split into compute (forward, backward, commit), communication
        (issuing pushes and pulls: 2-bit compression and handing the requests over),
        waiting for the pushes and pulls, and waiting for the next batch, stacked, over the
        job's time (steps averaged over up to 120 windows). tessera-worker --metrics-out
        files are accepted too: the same split per epoch, from their "epoch_log".
        A tessera-server trace among them adds a row marking, for each dist_sync
        round, the rank it waited for (the last to push), so a straggler shows at a
        glance.
epochs  tessera-worker --metrics-out files (one per worker, "{rank}" in the flag): samples
        per second per epoch, per worker and their sum; training accuracy per worker and
        validation accuracy (rank 0 evaluates after every epoch).
bench   tessera-bench --json output: throughput of each job's push, pull and pushpull (best
        in-flight setting) beside the same run's raw ZeroMQ stream (one-way; two-way for
        pushpull), and the 4 KB pushpull round trip beside ZeroMQ's.

Needs matplotlib (Debian: python3-matplotlib, which tools/install-deps.sh installs); an
interpreter without it (a venv python3 first on PATH) hands over to /usr/bin/python3.
Exit status: 0 when the figure was written; 2 on a usage error or bad input (one line
naming the file and what is wrong); 1 when the PNG cannot be written.
"""
import argparse
import json
import os
import sys

PROG = 'plot.py'
SYSTEM_PYTHON = '/usr/bin/python3'

# Step parts: (name in the figure, colour), in stacking order.
PARTS = [
    ('compute', '#4c72b0'),
    ('communication', '#dd8452'),
    ('waiting for pushes/pulls', '#c44e52'),
    ('waiting for data', '#8c8c8c'),
]
# tessera-worker's step phases (worker/trainer/training_loop.cc); "issue"
# spans lie inside "backward", "layer-wait" spans (--wait-pulls layer) inside
# "forward".
PHASES = ('data-wait', 'forward', 'backward', 'issue', 'layer-wait', 'comm-wait', 'commit')
MAX_WINDOWS = 120


class InputError(Exception):
    pass


def import_pyplot():
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
        raise InputError('%s: %s' % (path, e.strerror or e))
    except UnicodeDecodeError as e:
        raise InputError('%s: not JSON (%s)' % (path, e))
    except ValueError as e:
        raise InputError('%s: not JSON (%s)' % (path, e))


def number(value, path, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError('%s: %s: expected a number, got %r' % (path, what, value))
    return float(value)


# --- inputs -------------------------------------------------------------------------


def is_trace(doc):
    return isinstance(doc, dict) and isinstance(doc.get('traceEvents'), list)


def is_worker_metrics(doc):
    return isinstance(doc, dict) and 'rank' in doc and isinstance(doc.get('epoch_log'), list)


def worker_metrics(path, doc=None):
    """(rank, [epoch records]) of one tessera-worker --metrics-out file."""
    doc = load_json(path) if doc is None else doc
    if not is_worker_metrics(doc):
        raise InputError('%s: expected tessera-worker --metrics-out JSON (with "rank" and '
                         '"epoch_log")' % path)
    fields = ('epoch', 'seconds', 'samples', 'samples_per_second', 'train_accuracy',
              'validation_accuracy', 'time_compute_s', 'time_comm_s', 'time_issue_s',
              'time_data_s')
    log = []
    for i, record in enumerate(doc['epoch_log']):
        if not isinstance(record, dict):
            raise InputError('%s: epoch_log[%d]: expected an object' % (path, i))
        for field in fields:
            if field not in record:
                raise InputError('%s: epoch_log[%d]: no "%s"' % (path, i, field))
        log.append({f: number(record[f], path, 'epoch_log[%d].%s' % (i, f)) for f in fields})
    if not log:
        raise InputError('%s: "epoch_log" is empty (the run trained no epoch)' % path)
    return int(number(doc['rank'], path, 'rank')), log


def trace_steps(path, doc):
    """(rank, [(start_s, {part: seconds})]) of one tessera-worker trace's steps."""
    rank = doc.get('otherData', {}).get('rank', -1) if isinstance(doc.get('otherData'),
                                                                   dict) else -1
    complete = []
    for i, e in enumerate(doc['traceEvents']):
        if not isinstance(e, dict):
            raise InputError('%s: traceEvents[%d]: expected an object' % (path, i))
        if e.get('ph') == 'X' and (e.get('name') == 'step' or e.get('name') in PHASES):
            ts = number(e.get('ts'), path, 'traceEvents[%d].ts' % i)
            dur = number(e.get('dur'), path, 'traceEvents[%d].dur' % i)
            complete.append((e['name'], e.get('tid'), ts, dur))
    steps = sorted((c for c in complete if c[0] == 'step'), key=lambda c: c[2])
    if not steps:
        raise InputError('%s: no "step" spans (is it a trace of tessera-worker?)' % path)
    main_tid = steps[0][1]
    phases = sorted((c for c in complete if c[0] != 'step' and c[1] == main_tid),
                    key=lambda c: c[2])
    out = []
    i = 0
    for _, _, begin, dur in steps:
        end = begin + dur
        t = dict.fromkeys(PHASES, 0.0)
        while i < len(phases) and phases[i][2] < begin:
            i += 1
        while i < len(phases) and phases[i][2] <= end:
            t[phases[i][0]] += phases[i][3] / 1e6
            i += 1
        out.append((begin / 1e6, {
            'compute': max(0.0, t['forward'] + t['backward'] - t['issue'] - t['layer-wait'])
                       + t['commit'],
            'communication': t['issue'],
            'waiting for pushes/pulls': t['comm-wait'] + t['layer-wait'],
            'waiting for data': t['data-wait'],
        }))
    return int(rank), out


def trace_rounds(path, doc):
    """(server rank, [(start_s, waited_for rank)]) of a tessera-server trace's dist_sync
    rounds (their "round" spans carry the rank whose push completed them)."""
    other = doc.get('otherData') if isinstance(doc.get('otherData'), dict) else {}
    rounds = []
    for i, e in enumerate(doc['traceEvents']):
        if not (isinstance(e, dict) and e.get('ph') == 'b' and e.get('name') == 'round'):
            continue
        args = e.get('args') if isinstance(e.get('args'), dict) else {}
        if 'waited_for' not in args:
            continue
        rounds.append((number(e.get('ts'), path, 'traceEvents[%d].ts' % i) / 1e6,
                       int(number(args['waited_for'], path,
                                  'traceEvents[%d].args.waited_for' % i))))
    return int(other.get('rank', -1)), sorted(rounds)


def is_server_trace(doc):
    other = doc.get('otherData')
    return isinstance(other, dict) and other.get('role') == 'server'


def bench_rows(paths):
    """[(job, group, label, tessera, baseline, unit)] of throughput and latency bars."""
    rows = []
    for path in paths:
        b = load_json(path)
        if not (isinstance(b, dict) and isinstance(b.get('jobs'), list)
                and isinstance(b.get('baseline'), list)):
            raise InputError('%s: expected tessera-bench --json output ("baseline" and '
                             '"jobs")' % path)
        try:
            base = {x['size']: x for x in b['baseline']}
            securities = {job.get('security', 'curve') for job in b['jobs']}
            for job in b['jobs']:
                name = '%dx%d %s' % (job['servers'], job['workers'],
                                     job['optimizer'].split(' ')[0])
                if len(securities) > 1:
                    name += ' ' + job.get('security', 'curve')
                best = {}
                for r in job['results']:
                    key = (r['op'], r['size'])
                    if key not in best or r['gbps'] > best[key]['gbps']:
                        best[key] = r
                for (op, size), r in sorted(best.items(), key=lambda x: (x[0][1], x[0][0])):
                    raw = base.get(size, {})
                    ref = raw.get('zmq_two_way_gbps' if op == 'pushpull' else 'zmq_gbps')
                    rows.append((name, 'throughput', '%s\n%s' % (op, human(size)),
                                 number(r['gbps'], path, 'gbps'), ref, 'GB/s'))
                lat = [r for r in job['results'] if r['op'] == 'pushpull'
                       and r['size'] == 4096 and r['inflight'] == 1 and 'p50_us' in r]
                if lat:
                    rows.append((name, 'latency', 'pushpull\n4 KB',
                                 number(lat[0]['p50_us'], path, 'p50_us'),
                                 base.get(4096, {}).get('zmq_rtt_p50_us'), 'us'))
        except (KeyError, TypeError, AttributeError) as e:
            raise InputError('%s: not the shape tessera-bench --json writes (%s: %s)'
                             % (path, type(e).__name__, e))
    if not rows:
        raise InputError('%s: no results' % ', '.join(paths))
    return rows


def human(size):
    for unit, n in (('M', 1 << 20), ('K', 1 << 10)):
        if size >= n and size % n == 0:
            return '%d %sB' % (size // n, unit)
    return '%d B' % size


# --- figures ------------------------------------------------------------------------


def plot_steps(plt, paths, out, dpi):
    """Step breakdown per worker from traces, or per epoch from metrics files."""
    workers, epochs, servers, server_paths = [], [], [], []
    for path in paths:
        doc = load_json(path)
        if is_trace(doc) and is_server_trace(doc):
            servers.append(trace_rounds(path, doc))
            server_paths.append(path)
        elif is_trace(doc):
            workers.append(trace_steps(path, doc))
        elif is_worker_metrics(doc):
            epochs.append(worker_metrics(path, doc))
        else:
            raise InputError('%s: expected a TESSERA_TRACE file of tessera-worker (Chrome '
                             'trace JSON) or a tessera-worker --metrics-out file' % path)
    if workers and epochs:
        raise InputError('give either trace files or metrics files, not both')
    if servers and not workers:
        raise InputError('%s: a tessera-server trace marks the rounds of worker traces: '
                         'give the workers\' TESSERA_TRACE files too' % server_paths[0])
    rows = sorted(workers or epochs, key=lambda w: w[0])
    servers.sort()
    fig, axes = plt.subplots(len(rows) + len(servers), 1,
                             figsize=(8, 2.2 * (len(rows) + len(servers)) + 0.9),
                             sharex=True, squeeze=False)
    if workers:
        t0 = min(steps[0][0] for _, steps in workers)
        t1 = max(steps[-1][0] for _, steps in workers)
        for ax, (rank, steps) in zip(axes[:, 0], rows):
            step_windows(ax, rank, steps, t0, max(t1 - t0, 1e-9))
        summaries = []
        for ax, (rank, rounds) in zip(axes[len(rows):, 0], servers):
            summaries.append(waited_for(ax, rank, rounds, t0))
        axes[-1, 0].set_xlabel('seconds since the first step')
        fig.suptitle("Where a training step's time goes")
        summary = '; '.join(['worker %d: %d steps' % (rank, len(steps))
                             for rank, steps in rows] + summaries)
    else:
        for ax, (rank, log) in zip(axes[:, 0], rows):
            epoch_bars(ax, rank, log)
        axes[-1, 0].set_xlabel('epoch')
        fig.suptitle("Where each epoch's training time goes")
        summary = '; '.join('worker %d: %d epochs' % (rank, len(log)) for rank, log in rows)
    axes[0, 0].legend(loc='upper right', fontsize=7, ncol=4)
    save(fig, plt, out, dpi)
    return summary


def waited_for(ax, rank, rounds, t0):
    """One server's rounds: the rank each waited for, over time. Returns the summary."""
    if not rounds:
        ax.set_title('server %d: no dist_sync rounds in its trace' % rank, fontsize=8)
        return 'server %d: 0 rounds' % rank
    counts = {}
    for _, r in rounds:
        counts[r] = counts.get(r, 0) + 1
    last, n = max(counts.items(), key=lambda x: (x[1], -x[0]))
    share = 100.0 * n / len(rounds)
    ax.scatter([t - t0 for t, _ in rounds], [r for _, r in rounds], s=10, marker='|',
               color='#c44e52')
    ax.set_yticks(sorted(counts))
    ax.set_ylabel('rank waited for', fontsize=7)
    ax.set_title('server %d: %d rounds, each marked at the rank it waited for (the last to '
                 'push); rank %d in %.0f%%' % (rank, len(rounds), last, share), fontsize=8)
    return 'server %d: %d rounds, the last to push: rank %d in %.0f%%' % (
        rank, len(rounds), last, share)


def step_windows(ax, rank, steps, t0, span):
    windows = min(MAX_WINDOWS, len(steps))
    sums = [[0.0] * len(PARTS) for _ in range(windows)]
    counts = [0] * windows
    for start, split in steps:
        k = min(windows - 1, int((start - t0) / span * windows))
        counts[k] += 1
        for i, (part, _) in enumerate(PARTS):
            sums[k][i] += split[part]
    xs, ys = [], [[] for _ in PARTS]
    for k in range(windows):
        if counts[k]:
            xs.append((k + 0.5) * span / windows)
            for i in range(len(PARTS)):
                ys[i].append(1000.0 * sums[k][i] / counts[k])
    ax.stackplot(xs, *ys, labels=[p for p, _ in PARTS], colors=[c for _, c in PARTS])
    mean = {p: sum(split[p] for _, split in steps) / len(steps) for p, _ in PARTS}
    total = sum(mean.values())
    share = [100.0 * mean[p] / total if total else 0.0 for p, _ in PARTS]
    ax.set_title('worker %d: %d steps, %.2f ms each on average: compute %.0f%%, '
                 'communication %.0f%%, waiting for pushes/pulls %.0f%%, for data %.0f%%'
                 % ((rank, len(steps), 1000.0 * total) + tuple(share)), fontsize=8)
    ax.set_ylabel('ms per step')
    ax.set_ylim(0, 1.3 * max(sum(y[k] for y in ys) for k in range(len(xs))))  # the legend
    ax.grid(alpha=0.3)


def epoch_bars(ax, rank, log):
    xs = [e['epoch'] for e in log]
    parts = {'compute': [e['time_compute_s'] for e in log],
             'communication': [e['time_issue_s'] for e in log],
             'waiting for pushes/pulls': [e['time_comm_s'] for e in log],
             'waiting for data': [e['time_data_s'] for e in log]}
    bottom = [0.0] * len(xs)
    for part, colour in PARTS:
        ax.bar(xs, parts[part], bottom=bottom, color=colour, label=part)
        bottom = [b + v for b, v in zip(bottom, parts[part])]
    ax.set_title('worker %d' % rank, fontsize=9)
    ax.set_ylabel('seconds')
    ax.grid(alpha=0.3, axis='y')


def plot_epochs(plt, paths, out, dpi):
    workers = sorted((worker_metrics(p) for p in paths), key=lambda w: w[0])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    total = {}
    for rank, log in workers:
        xs = [int(e['epoch']) for e in log]
        ys = [e['samples_per_second'] for e in log]
        left.plot(xs, ys, marker='o', label='worker %d' % rank)
        for x, y in zip(xs, ys):
            total[x] = total.get(x, 0.0) + y
    if len(workers) > 1:
        xs = sorted(total)
        left.plot(xs, [total[x] for x in xs], marker='s', color='black', label='job (sum)')
    left.set_title('Throughput per epoch (training time only)', fontsize=10)
    left.set_xlabel('epoch')
    left.set_ylabel('samples / second')
    left.set_ylim(bottom=0)
    for rank, log in workers:
        right.plot([int(e['epoch']) for e in log], [e['train_accuracy'] for e in log],
                   linestyle='--', marker='.', label='training, worker %d' % rank)
        val = [(int(e['epoch']), e['validation_accuracy']) for e in log
               if e['validation_accuracy'] >= 0]
        if val:
            right.plot([v[0] for v in val], [v[1] for v in val], marker='o', linewidth=2,
                       color='black', label='validation (worker %d)' % rank)
    right.set_title('Accuracy per epoch', fontsize=10)
    right.set_xlabel('epoch')
    right.set_ylabel('accuracy')
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.xaxis.get_major_locator().set_params(integer=True)
    save(fig, plt, out, dpi)
    last = max(total)
    val = [e['validation_accuracy'] for _, log in workers for e in log
           if int(e['epoch']) == last and e['validation_accuracy'] >= 0]
    return '%d worker(s), epochs %d..%d; epoch %d: %.1f samples/s (job)%s' % (
        len(workers), min(total), last, last, total[last],
        ', validation accuracy %.4f' % val[0] if val else '')


def plot_bench(plt, paths, out, dpi):
    rows = bench_rows(paths)
    jobs = []
    for r in rows:
        if r[0] not in jobs:
            jobs.append(r[0])
    groups = [g for g in ('throughput', 'latency') if any(r[1] == g for r in rows)]
    widths = [max(2, max(sum(1 for r in rows if r[0] == j and r[1] == g) for j in jobs))
              for g in groups]
    fig, axes = plt.subplots(len(jobs), len(groups),
                             figsize=(2.5 + 0.75 * sum(widths), 2.6 * len(jobs) + 0.6),
                             gridspec_kw={'width_ratios': widths}, squeeze=False)
    for row, job in enumerate(jobs):
        for ax, group in zip(axes[row], groups):
            sel = [r for r in rows if r[0] == job and r[1] == group]
            if not sel:
                ax.set_axis_off()
                continue
            xs = list(range(len(sel)))
            ax.bar([x - 0.2 for x in xs], [r[3] for r in sel], width=0.4, color='#4c72b0',
                   label='Tessera')
            ax.bar([x + 0.2 for x in xs], [r[4] or 0 for r in sel], width=0.4,
                   color='#999999', label='raw ZeroMQ')
            for x, r in zip(xs, sel):
                if r[4]:
                    ax.annotate('%.2fx' % (r[3] / r[4]), (x - 0.2, r[3]), ha='center',
                                va='bottom', fontsize=7)
            ax.set_xticks(xs)
            ax.set_xticklabels([r[2] for r in sel], fontsize=7)
            if group == 'throughput':  # bars as wide in every row
                ax.set_xlim(-0.6, widths[0] - 0.4)
            ax.set_ylim(0, 1.3 * max(max(r[3], r[4] or 0) for r in sel))
            ax.set_ylabel(sel[0][5])
            ax.set_title('%s: %s' % (job, 'throughput (higher is better)' if group == 'throughput'
                                     else 'round trip p50\n(lower is better)'), fontsize=8)
            ax.grid(alpha=0.3, axis='y')
            if group == groups[0]:
                ax.legend(fontsize=6, loc='upper left')
    fig.suptitle('tessera-bench beside the same run\'s raw ZeroMQ baseline\n'
                 '(pushpull against the two-way stream; jobs SERVERSxWORKERS optimizer)',
                 fontsize=9)
    save(fig, plt, out, dpi)
    return '%d job(s); %d throughput and %d round-trip bar pairs' % (
        len(jobs), sum(1 for r in rows if r[1] == 'throughput'),
        sum(1 for r in rows if r[1] == 'latency'))


def save(fig, plt, out, dpi):
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=dpi, format='png')
    except OSError as e:
        raise OSError('%s: %s' % (out, e.strerror or e))
    finally:
        plt.close(fig)


def main(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split('\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog='\n'.join(__doc__.split('\n')[1:]))
    sub = p.add_subparsers(dest='what', metavar='{steps,epochs,bench}')
    sub.required = True
    for name, inputs, helptext in (
            ('steps', 'FILE', 'step breakdown per worker (traces or metrics files)'),
            ('epochs', 'METRICS', 'throughput and accuracy per epoch'),
            ('bench', 'BENCH', 'tessera-bench --json figures beside their baseline')):
        s = sub.add_parser(name, help=helptext)
        s.add_argument('inputs', nargs='+', metavar=inputs)
        s.add_argument('-o', '--out', required=True, metavar='PNG', help='figure to write')
        s.add_argument('--dpi', type=int, default=90, help='resolution (default 90)')
    args = p.parse_args(argv)
    if not args.out.lower().endswith('.png'):
        p.error('-o %s: expected a .png file name' % args.out)
    if args.dpi < 20 or args.dpi > 600:
        p.error('--dpi %d: expected 20..600' % args.dpi)
    plt = import_pyplot()
    draw = {'steps': plot_steps, 'epochs': plot_epochs, 'bench': plot_bench}[args.what]
    try:
        summary = draw(plt, args.inputs, args.out, args.dpi)
    except InputError as e:
        sys.stderr.write('%s: %s\n' % (PROG, e))
        return 2
    except OSError as e:
        sys.stderr.write('%s: cannot write %s\n' % (PROG, e))
        return 1
    print('%s: %s' % (args.out, summary))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
