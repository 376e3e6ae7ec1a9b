#!/usr/bin/env python3
"""Failover time of a replicated job: from a server's SIGKILL to the first round
completed after it.

Runs `launch.py -n 2 -s 3 --replicas 2 kv_check_worker soak ROUNDS SLEEP_MS` (every key
split over the three servers: TESSERA_BIGARRAY_BOUND=1000, so every round needs the
dead server's slices), with SOAK_PRINT_ROUNDS=1 (the workers print when each round was
complete), SIGKILLs server 1 after --kill-after seconds of rounds, and prints, per run:
the heartbeat time-out, the time from the kill to the scheduler declaring it dead (its
log line), and from the kill to the first round completed after it on worker 0. The
job must end 0 with both workers' soak checksums equal.

    tools/bench/failover.py --build /abs/build [--runs 3] [--heartbeat-timeout 2]
        [--security default|none]

With --spare-mb MB the job also has a spare server (--spare-servers 1) and the big key
holds 1.5 x MB megabytes, so each server's primary share is MB/2 and a replacement of
rank r receives MB (its own share and its backup share of rank r-1's): the run then also
prints the catch-up, from the spare's own log line ("caught up: N key slice(s), B bytes,
in T") and from the kill to the scheduler's "caught up" line, while the rounds go on.
"""
import argparse
import datetime
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))


def marked_pid(mark, role, task_id):
    want = {b'TESSERA_TEST_MARK=' + mark.encode(), b'DMLC_ROLE=' + role.encode(),
            b'DMLC_TASK_ID=' + str(task_id).encode()}
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open('/proc/%s/environ' % entry, 'rb') as f:
                if want <= set(f.read().split(b'\0')):
                    return int(entry)
        except OSError:
            pass
    return None


def log_time(line, day):
    """The HH:MM:SS.mmm stamp of a Tessera log line as Unix seconds (local day)."""
    m = re.search(r'\] (\d\d):(\d\d):(\d\d)\.(\d{3}) ', line)
    if not m:
        return None
    h, mi, s, ms = (int(x) for x in m.groups())
    t = datetime.datetime.combine(day, datetime.time(h, mi, s, ms * 1000))
    return t.timestamp()


def one_run(args, mark):
    # TESSERA_CORE_DUMPS=1: daemons whose /proc/PID/environ this reads without root.
    env = dict(os.environ, TESSERA_TEST_MARK=mark, TESSERA_CORE_DUMPS='1',
               TESSERA_BIGARRAY_BOUND='1000',
               SOAK_PRINT_ROUNDS='1', PS_HEARTBEAT_INTERVAL=str(args.heartbeat_timeout / 4),
               PS_HEARTBEAT_TIMEOUT=str(args.heartbeat_timeout),
               PS_RESEND_TIMEOUT=str(args.resend_timeout_ms))
    if args.security == 'none':
        env['TESSERA_INSECURE'] = '1'
    worker = os.path.join(args.build, 'tests', 'core', 'kv_check_worker')
    spare = ['--spare-servers', '1'] if args.spare_mb else []
    if args.spare_mb:
        env['SOAK_BIG_VALUES'] = str(int(args.spare_mb * 1.5e6 / 4))
    cmd = [sys.executable, os.path.join(SOURCE, 'tools', 'launch.py'), '-n', '2', '-s', '3',
           '--replicas', '2'] + spare + [worker, 'soak', str(args.rounds), str(args.sleep_ms)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 60
    while marked_pid(mark, 'worker', 4) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(args.kill_after)
    if args.spare_mb:
        # A big key: wait for the first round (the inits take a while).
        first = None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if re.match(r'^\[worker 0\] round 1 done at ', line):
                first = line
                break
        if first is None:
            proc.kill()
            sys.exit('failover.py: no round done:\n' + ''.join(lines)[-4000:])
    victim = marked_pid(mark, 'server', 1)
    if victim is None or proc.poll() is not None:
        proc.kill()
        sys.exit('failover.py: server 1 is not running (job ended early?)')
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    out, _ = proc.communicate(timeout=900)
    if args.spare_mb:
        out = ''.join(lines) + out
    if proc.returncode != 0:
        sys.exit('failover.py: the job exited %d:\n%s' % (proc.returncode, out[-4000:]))
    sums = re.findall(r'soak ok: .* checksum=([0-9a-f]{16})', out)
    if len(sums) != 2 or sums[0] != sums[1]:
        sys.exit('failover.py: soak checksums %s:\n%s' % (sums, out[-4000:]))
    day = datetime.date.today()
    declared = None
    for line in out.splitlines():
        if line.startswith('[scheduler]') and 'fail over to their next replica' in line:
            declared = log_time(line, day)
    rounds = [(int(i), float(t)) for i, t in
              re.findall(r'^\[worker 0\] round (\d+) done at (\d+\.\d+)$', out, re.M)]
    caught = None
    caught_line = None
    for line in out.splitlines():
        if line.startswith('[scheduler]') and ' caught up: it holds the key slices' in line:
            caught = log_time(line, day)
        m = re.search(r'\] caught up: (\d+) key slice\(s\), (\d+) bytes, in (\S+)$', line)
        if m:
            caught_line = m.groups()
    after = [t for _, t in rounds if t > killed]
    before = [t for _, t in rounds if t <= killed]
    gaps = [b - a for a, b in zip(before, before[1:])]
    return {
        'declared_s': None if declared is None else declared - killed,
        'first_round_s': after[0] - killed if after else None,
        'rounds_before': len(before),
        'median_round_ms': 1000 * sorted(gaps)[len(gaps) // 2] if gaps else None,
        'checksum': sums[0],
        'caught_up_s': None if caught is None else caught - killed,
        'transfer': caught_line,
        'rounds_after': len(after),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--build', required=True, help='the CMake build folder (absolute)')
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--rounds', type=int, default=400)
    p.add_argument('--sleep-ms', type=int, default=10)
    p.add_argument('--kill-after', type=float, default=1.5)
    p.add_argument('--heartbeat-timeout', type=float, default=2.0)
    p.add_argument('--resend-timeout-ms', type=int, default=200)
    p.add_argument('--security', choices=('default', 'none'), default='default')
    p.add_argument('--spare-mb', type=float, default=0,
                   help='a spare server, and a replacement catching up on MB megabytes')
    args = p.parse_args()
    print('failover.py: 2 workers, 3 servers, --replicas 2%s, soak %d rounds (%d ms apart), '
          'PS_HEARTBEAT_TIMEOUT=%gs, PS_RESEND_TIMEOUT=%dms, security %s; uptime: %s'
          % (' --spare-servers 1, big key %g MB' % (1.5 * args.spare_mb) if args.spare_mb
             else '', args.rounds, args.sleep_ms, args.heartbeat_timeout, args.resend_timeout_ms,
             args.security, subprocess.run(['uptime'], capture_output=True,
                                           text=True).stdout.strip()))
    results = []
    for i in range(args.runs):
        r = one_run(args, 'failover-%d-%d' % (os.getpid(), i))
        results.append(r)
        print('run %d: declared dead %.2f s after the kill; first round completed %.2f s '
              'after it (%.2f s past the time-out); %d rounds before, median round %.1f ms; '
              'checksum %s' % (i, r['declared_s'] or float('nan'),
                               r['first_round_s'] or float('nan'),
                               (r['first_round_s'] or float('nan')) - args.heartbeat_timeout,
                               r['rounds_before'], r['median_round_ms'] or float('nan'),
                               r['checksum']))
        if args.spare_mb:
            t = r['transfer']
            print('run %d: spare caught up %.2f s after the kill (scheduler\'s line); its own '
                  'count: %s key slice(s), %s bytes in %s; %d rounds completed after the kill'
                  % (i, r['caught_up_s'] or float('nan'), t[0] if t else '?',
                     t[1] if t else '?', t[2] if t else '?', r['rounds_after']))
    firsts = sorted(r['first_round_s'] for r in results if r['first_round_s'] is not None)
    if firsts:
        print('median: first round %.2f s after the kill, %.2f s past the heartbeat time-out'
              % (firsts[len(firsts) // 2], firsts[len(firsts) // 2] - args.heartbeat_timeout))


if __name__ == '__main__':
    main()
