#!/usr/bin/env python3
"""A server's peak memory and round time against the number of workers.

For each worker count W it runs a real job on loopback: a scheduler, one
server and W copies of tools/bench/round_worker (C API), which initialise one
key of --mb megabytes (not split: one server holds it whole) and run --rounds
dist_sync rounds of push + pull. It samples the server's peak resident set
(VmHWM in /proc/PID/status, every 20 ms until it exits) and reads worker 0's
per-round push time (a dist_sync push returns once its round is applied: the
round's completion latency as a worker sees it).

    tools/bench/server_memory.py [--build build] [--source .] [--workers 1,2,4,8]
                                 [--mb 64] [--rounds 3] [--wide] [--label NAME] [--json FILE]

--wide pushes values whose magnitudes spread over 2^-30..2^29 (round_worker.c:
sums that need more than a double) instead of rank+1; every worker checks
1,000 places of each round's sum against the exact sum, and the line gains
the hash of rank 0's last pulled sum, the same on every run when the sum is
reproducible.

--build may be any Tessera build (an earlier commit's too): the worker is
compiled from this folder's round_worker.c against that build's libtessera and
headers (--source, the build's source tree), so both are measured the same way.
Prints one line per worker count: workers, server peak MB, shard MB, peak over
shard, median round ms (rounds after the first), wall seconds.
Exit status: 0 when every job finished and its checks passed, 1 otherwise.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..'))
from tessera_launch.hosts import free_port_run  # noqa: E402


def free_port():
    """A free port below the ephemeral range (tessera_launch.hosts.free_port_run)."""
    return free_port_run(1)


def peak_kb(pid):
    try:
        with open('/proc/%d/status' % pid) as f:
            for line in f:
                if line.startswith('VmHWM:'):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def build_worker(build, source, out_dir):
    worker = os.path.join(out_dir, 'round_worker')
    lib = os.path.join(build, 'worker')
    subprocess.run(['cc', '-O2', '-o', worker, os.path.join(HERE, 'round_worker.c'),
                    '-I', os.path.join(source, 'include'), '-L', lib, '-ltessera',
                    '-Wl,-rpath,' + lib, '-lm'], check=True)
    return worker


def run_job(build, worker, workers, values, rounds, timeout, wide=False):
    env = dict(os.environ, DMLC_PS_ROOT_URI='127.0.0.1', DMLC_PS_ROOT_PORT=str(free_port()),
               DMLC_NUM_SERVER='1', DMLC_NUM_WORKER=str(workers),
               TESSERA_BIGARRAY_BOUND=str(1 << 40), TESSERA_SERVER_THREADS='1',
               MXNET_KVSTORE_BIGARRAY_BOUND=str(1 << 40))
    logs = tempfile.mkdtemp(prefix='tessera-server-memory-')
    # Secured as launch.py runs jobs (a build from before job keys ignores them).
    sys.path.insert(0, os.path.join(HERE, '..'))
    from tessera_launch import keys  # noqa: E402
    if env.get('TESSERA_INSECURE') != '1':
        keys.write_job_keys(logs)
        env['TESSERA_KEY_DIR'] = logs
    procs = []

    def start(name, argv, role):
        out = open(os.path.join(logs, name + '.log'), 'w')
        p = subprocess.Popen(argv, env=dict(env, DMLC_ROLE=role), stdout=out,
                             stderr=subprocess.STDOUT)
        procs.append((name, p, out))
        return p

    t0 = time.monotonic()
    start('scheduler', [os.path.join(build, 'scheduler', 'tessera-scheduler')], 'scheduler')
    server = start('server', [os.path.join(build, 'server', 'tessera-server')], 'server')
    for w in range(workers):
        start('worker-%d' % w, [worker, str(values), str(rounds)] + (['wide'] if wide else []),
              'worker')
    peak = 0
    failed = None
    while True:
        kb = peak_kb(server.pid)
        if kb:
            peak = max(peak, kb)
        if all(p.poll() is not None for _, p, _ in procs):
            break
        if time.monotonic() - t0 > timeout:
            failed = 'still running after %d s' % timeout
            break
        if any(p.poll() not in (None, 0) for _, p, _ in procs):
            failed = ', '.join('%s exited %s' % (n, p.poll()) for n, p, _ in procs
                               if p.poll() not in (None, 0))
            break
        time.sleep(0.02)
    for _, p, out in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        out.close()
    wall = time.monotonic() - t0
    rounds_ms = []  # printed by rank 0, whichever process that is
    sum_hash = ''
    for w in range(workers):
        for line in open(os.path.join(logs, 'worker-%d.log' % w)):
            m = re.match(r'ROUND (\d+) push_ms=([\d.]+)', line)
            if m:
                rounds_ms.append(float(m.group(2)))
            m = re.match(r'SUMHASH \d+ ([0-9a-f]+)', line)
            if m:
                sum_hash = m.group(1)
    if failed is None and len(rounds_ms) != rounds:
        failed = 'rank 0 reported %d of %d rounds' % (len(rounds_ms), rounds)
    if failed:
        tails = []
        for name, _, _ in procs:
            with open(os.path.join(logs, name + '.log')) as f:
                tails.append('--- %s\n%s' % (name, ''.join(f.readlines()[-5:])))
        failed += '\n' + '\n'.join(tails[:6])
    else:
        subprocess.run(['rm', '-rf', logs])
    return peak, rounds_ms, wall, failed, sum_hash


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--build', default=os.path.join(HERE, '..', '..', 'build'))
    p.add_argument('--source', help='the build\'s source tree (default: its parent)')
    p.add_argument('--workers', default='1,2,4,8,16,32,64')
    p.add_argument('--mb', type=float, default=64, help='key size in MB (1e6 bytes)')
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--timeout', type=int, default=600, help='seconds per job')
    p.add_argument('--wide', action='store_true',
                   help='values spread over 2^-30..2^29 (sums that need more than a double)')
    p.add_argument('--label', default='')
    p.add_argument('--json', dest='json_out')
    args = p.parse_args(argv)
    build = os.path.abspath(args.build)
    source = os.path.abspath(args.source or os.path.join(build, '..'))
    try:
        counts = [int(x) for x in args.workers.split(',')]
    except ValueError:
        p.error('--workers=%s: expected numbers separated by commas' % args.workers)
    values = int(args.mb * 1e6 / 4)
    shard_mb = values * 4 / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        worker = build_worker(build, source, tmp)
        print('server_memory: %s key of %.1f MB, %d rounds, %s values, build %s%s'
              % ('dist_sync', shard_mb, args.rounds, 'wide-range' if args.wide else 'rank+1',
                 build,
                 (' (%s)' % args.label) if args.label else ''))
        print('%8s %12s %10s %12s %16s %8s %17s' % ('workers', 'peak MB', 'shard MB',
                                                    'peak/shard', 'round ms (p50)', 'wall s',
                                                    'sum hash' if args.wide else ''))
        results = []
        ok = True
        for w in counts:
            peak, rounds_ms, wall, failed, sum_hash = run_job(
                build, worker, w, values, args.rounds, args.timeout, args.wide)
            if failed:
                print('%8d  FAILED: %s' % (w, failed))
                ok = False
                continue
            later = rounds_ms[1:] or rounds_ms
            median = statistics.median(later)
            print('%8d %12.1f %10.1f %12.2f %16.1f %8.1f %17s' % (
                w, peak / 1000.0, shard_mb, peak / 1000.0 / shard_mb, median, wall, sum_hash))
            sys.stdout.flush()
            results.append({'workers': w, 'peak_mb': peak / 1000.0, 'shard_mb': shard_mb,
                            'round_ms': rounds_ms, 'round_ms_p50': median, 'wall_s': wall,
                            'sum_hash': sum_hash})
    if args.json_out:
        with open(args.json_out, 'w') as f:
            json.dump({'label': args.label, 'build': build, 'mb': args.mb, 'wide': args.wide,
                       'rounds': args.rounds, 'results': results}, f, indent=1)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
