#!/usr/bin/env python3
"""What a change of an elastic job's membership costs the workers that stay: the
time from a worker's death, goodbye or arrival to the rounds going on.

Runs `launch.py -n 3 -s 2 --elastic 2:3 kv_check_worker soak ROUNDS SLEEP_MS` (2:4 for
the join; every
key split over both servers: TESSERA_BIGARRAY_BOUND=1000; SOAK_PRINT_ROUNDS=1: each
worker prints when each of its rounds was complete), with the job's keys in a folder of
its own (TESSERA_KEY_DIR) so that a worker started by hand can join. Three scenes, each
--runs times:

  death    launch.py's worker 2 SIGKILLed after --kill-after s (SOAK_CHECK=0: nobody
           knows which rounds it reached): from the kill to the scheduler declaring it
           dead (its log line) and to the first round a survivor completed after that;
  goodbye  rank 2 leaves after round 100 (SOAK_LEAVE, every round checked exactly):
           the survivors' round after the goodbye against their median round;
  join     a fourth worker started by hand after --kill-after s (SOAK_JOIN=1; the
           others check every round exactly, SOAK_JOINER): from its start to the
           scheduler's line, to its first round, and the survivors' longest round
           around the join against their median.
  server-leave  3 servers, --replicas 2 (no --elastic): launch.py's server 1 gets
           SIGTERM after --kill-after s and leaves, its slices failing over (every
           round checked exactly): from the signal to the scheduler's line, to the
           first round completed after that, and the workers' longest round
           around it against their median.
  server-join  2 servers of at most 3 (--replicas 2 --max-servers 3; rank 2 has no
           server): a third server started by hand (TESSERA_SPARE=1) after
           --kill-after s takes rank 2, catches up by state transfer and takes back
           its place (hand-back; every round checked exactly): from its start to
           the scheduler placing it and to the hand-back's end, the hand-back's own
           duration (the most a moving slice's pushes wait), the bytes moved per
           slice, and the workers' longest round around it against their median.

  With --one-copy the two server scenes run without replicas, each key slice
  having one copy (TESSERA_MAX_SERVERS, docs/faults.md "One copy"): server-leave
  with -s 3 --max-servers 3 (the leaver sends its slices to the next server first;
  also the move's own time from the scheduler's line), server-join with -s 2
  --max-servers 3.

    tools/bench/elastic.py --build /abs/build [--runs 3] [--heartbeat-timeout 2]
        [--security default|none] [--one-copy]
"""
import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SOURCE, 'tools'))
from tessera_launch import hosts as launch_hosts  # noqa: E402
from tessera_launch import keys as launch_keys  # noqa: E402
from failover import log_time, marked_pid  # noqa: E402


def rounds_by_worker(out):
    """{launch.py worker index: [(round, unix time)]}."""
    done = {}
    for w, i, t in re.findall(r'^\[worker (\d+)\] round (\d+) done at (\d+\.\d+)$', out, re.M):
        done.setdefault(int(w), []).append((int(i), float(t)))
    return done


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else float('nan')


def one_run(args, scene, mark, key_dir):
    env = dict(os.environ, TESSERA_TEST_MARK=mark, TESSERA_BIGARRAY_BOUND='1000',
               SOAK_PRINT_ROUNDS='1', PS_HEARTBEAT_INTERVAL=str(args.heartbeat_timeout / 4),
               PS_HEARTBEAT_TIMEOUT=str(args.heartbeat_timeout))
    if args.security == 'none':
        env['TESSERA_INSECURE'] = '1'
    else:
        env['TESSERA_KEY_DIR'] = key_dir
    worker = os.path.join(args.build, 'tests', 'core', 'kv_check_worker')
    port = launch_hosts.free_port_run(1)
    extra = {'death': ['--env-worker', 'SOAK_CHECK:0'],
             'goodbye': ['--env-worker', 'SOAK_LEAVE:2:100'],
             'join': ['--env-worker', 'SOAK_JOINER:3'],
             'server-leave': [], 'server-join': []}[scene]
    bounds = '2:4' if scene == 'join' else '2:3'
    copies = ['--max-servers', '3'] if args.one_copy else ['--replicas', '2']
    shape = {'server-leave': ['-s', '3'] + copies,
             'server-join': ['-s', '2', '--max-servers', '3'] + (
                 [] if args.one_copy else ['--replicas', '2'])}.get(
                 scene, ['-s', '2', '--elastic', bounds])
    if args.big_values:
        env['SOAK_BIG_VALUES'] = str(args.big_values)
    cmd = [sys.executable, os.path.join(SOURCE, 'tools', 'launch.py'), '-n', '3'] + shape + [
           '--port', str(port)] + extra + [
               worker, 'soak', str(args.rounds), str(args.sleep_ms)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    first_worker = 5 if scene == 'server-leave' else 4  # task ids: servers first
    deadline = time.monotonic() + 60
    while marked_pid(mark, 'worker', first_worker) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(args.kill_after)
    event = time.time()
    joiner = None
    if scene in ('death', 'server-leave'):
        # launch.py's worker 2 (task id 4) SIGKILLed, or its server 1 SIGTERMed.
        role, task_id, sig = (('worker', 4, 9) if scene == 'death' else ('server', 1, 15))
        pid = marked_pid(mark, role, task_id)
        if pid is None or proc.poll() is not None:
            proc.kill()
            sys.exit('elastic.py: %s (task id %d) is not running (job ended early?)'
                     % (role, task_id))
        os.kill(pid, sig)
    elif scene == 'server-join':
        joiner = subprocess.Popen(
            [os.path.join(args.build, 'server', 'tessera-server')],
            env=dict(env, TESSERA_SPARE='1', DMLC_ROLE='server', DMLC_PS_ROOT_URI='127.0.0.1',
                     DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_WORKER='3', DMLC_NUM_SERVER='2',
                     TESSERA_REPLICAS='1' if args.one_copy else '2',
                     TESSERA_MAX_SERVERS='3'),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    elif scene == 'join':
        joiner = subprocess.Popen(
            [worker, 'soak', str(args.rounds * 2), str(args.sleep_ms)],
            env=dict(env, SOAK_JOIN='1', DMLC_ROLE='worker', DMLC_PS_ROOT_URI='127.0.0.1',
                     DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_WORKER='3', DMLC_NUM_SERVER='2',
                     TESSERA_ELASTIC='2:4'),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=args.job_timeout)
        joined_out = joiner.communicate(timeout=60)[0] if joiner else ''
    except subprocess.TimeoutExpired:
        for p in (proc, joiner):
            if p is not None:
                p.kill()
        out = proc.communicate()[0]
        joined_out = joiner.communicate()[0] if joiner else ''
        sys.exit('elastic.py: %s: the job did not end within %d s:\n%s\n--- joiner:\n%s'
                 % (scene, args.job_timeout, out[-6000:], joined_out[-3000:]))
    if proc.returncode != 0 or (joiner and joiner.returncode != 0):
        sys.exit('elastic.py: %s: the job exited %d (joiner %s):\n%s\n%s'
                 % (scene, proc.returncode, joiner and joiner.returncode, out[-4000:],
                    joined_out[-2000:]))
    sums = re.findall(r'soak ok: .* checksum=([0-9a-f]{16})', out)
    if len(set(sums)) != 1:
        sys.exit('elastic.py: soak checksums %s:\n%s' % (sums, out[-4000:]))
    day = datetime.date.today()
    done = rounds_by_worker(out)
    gone = {'death': 2}.get(scene)
    if scene == 'goodbye':
        left = re.search(r'^\[worker (\d+)\] soak left: rank 2 after round 100$', out, re.M)
        gone = int(left.group(1)) if left else None
    survivors = [w for w in done if w != gone]
    gaps = [b - a for w in survivors for (_, a), (_, b) in zip(done[w], done[w][1:])]
    result = {'median_round_ms': 1000 * median(gaps), 'checksum': sums[0]}
    if scene == 'death':
        declared = None
        for line in out.splitlines():
            if line.startswith('[scheduler]') and 'stopped heart-beating' in line:
                declared = log_time(line, day)
        after = min(t for w in survivors for _, t in done[w] if declared and t > declared)
        result.update(declared_s=declared - event, next_round_s=after - event)
    elif scene == 'server-leave':
        left = None
        moved_ms = float('nan')
        for line in out.splitlines():
            if line.startswith('[scheduler]') and 'left the job (it said goodbye' in line:
                left = log_time(line, day)
                m = re.search(r'its key slices moved in ([0-9.]+)(us|ms|s)\)', line)
                if m:
                    moved_ms = float(m.group(1)) * {'us': 1e-3, 'ms': 1.0,
                                                    's': 1e3}[m.group(2)]
        if left is None:
            sys.exit('elastic.py: server-leave: the scheduler never took the leave:\n'
                     + out[-4000:])
        after = min(t for w in survivors for _, t in done[w] if t > left)
        window = [b - a for w in survivors for (_, a), (_, b) in zip(done[w], done[w][1:])
                  if event - 1 < b < event + 3]
        result.update(left_s=left - event, next_round_s=after - event, moved_ms=moved_ms,
                      longest_round_ms=1000 * max(window) if window else float('nan'))
    elif scene == 'server-join':
        placed = handed = None
        took = float('nan')
        for line in out.splitlines():
            if not line.startswith('[scheduler]'):
                continue
            if 'which had no server' in line:
                placed = log_time(line, day)
            m = re.search(r'hand-back in ([0-9.]+)(us|ms|s)\)', line)
            if m:
                handed = log_time(line, day)
                took = float(m.group(1)) * {'us': 1e-3, 'ms': 1.0, 's': 1e3}[m.group(2)]
        caught = re.search(r'caught up: (\d+) key slice\(s\), (\d+) bytes, in ([0-9.]+)(us|ms|s)',
                           joined_out)
        if placed is None or handed is None or caught is None:
            sys.exit('elastic.py: server-join: no placement, catch-up or hand-back:\n%s\n%s'
                     % (out[-4000:], joined_out[-2000:]))
        slices, moved = int(caught.group(1)), int(caught.group(2))
        window = [b - a for w in survivors for (_, a), (_, b) in zip(done[w], done[w][1:])
                  if event - 1 < b < handed + 2]
        result.update(placed_s=placed - event, handed_back_s=handed - event,
                      handback_ms=took, slices=float(slices),
                      bytes_per_slice=float(moved) / max(slices, 1),
                      catch_up_ms=float(caught.group(3)) * {'us': 1e-3, 'ms': 1.0,
                                                            's': 1e3}[caught.group(4)],
                      longest_round_ms=1000 * max(window) if window else float('nan'))
    elif scene == 'goodbye':
        steps = []
        for w in survivors:
            at = dict(done[w])
            if 100 in at and 101 in at:
                steps.append(at[101] - at[100])
        result.update(round_after_ms=1000 * max(steps))
    else:
        line = [x for x in out.splitlines() if x.startswith('[scheduler]') and
                'joins the job' in x]
        first = re.search(r'^round 0 done at (\d+\.\d+)$', joined_out, re.M)
        window = [b - a for w in survivors for (_, a), (_, b) in zip(done[w], done[w][1:])
                  if event - 1 < b < event + 3]
        result.update(scheduler_s=log_time(line[0], day) - event if line else float('nan'),
                      first_round_s=float(first.group(1)) - event if first else float('nan'),
                      longest_round_ms=1000 * max(window) if window else float('nan'))
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--build', required=True, help='the CMake build folder (absolute)')
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--rounds', type=int, default=400)
    p.add_argument('--sleep-ms', type=int, default=10)
    p.add_argument('--kill-after', type=float, default=1.5)
    p.add_argument('--heartbeat-timeout', type=float, default=2.0)
    p.add_argument('--security', choices=('default', 'none'), default='default')
    p.add_argument('--big-values', type=int, default=0,
                   help='the soak\'s big key\'s length (SOAK_BIG_VALUES; 0: its 5000)')
    p.add_argument('--scenes', default='death,goodbye,join,server-leave,server-join',
                   help='comma-separated')
    p.add_argument('--job-timeout', type=int, default=120)
    p.add_argument('--one-copy', action='store_true',
                   help='server scenes without replicas (TESSERA_MAX_SERVERS)')
    args = p.parse_args()
    copies = '--max-servers 3, one copy' if args.one_copy else '--replicas 2'
    print('elastic.py: 3 workers, 2 servers, --elastic 2:3 (join: 2:4; server-leave: '
          '3 servers, %s; server-join: --max-servers 3%s), soak %d '
          'rounds (%d ms apart, big key %s values), '
          'PS_HEARTBEAT_TIMEOUT=%gs, security %s; uptime: %s'
          % (copies, ', one copy' if args.one_copy else ' --replicas 2', args.rounds,
             args.sleep_ms, args.big_values or 5000, args.heartbeat_timeout,
             args.security,
             subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()))
    with tempfile.TemporaryDirectory(prefix='elastic-bench-') as tmp:
        key_dir = os.path.join(tmp, 'keys')
        launch_keys.write_job_keys(key_dir, keygen=os.path.join(args.build, 'tools', 'keygen',
                                                                'tessera-keygen'))
        for scene in args.scenes.split(','):
            results = [one_run(args, scene, 'elastic-%d-%s-%d' % (os.getpid(), scene, i),
                               key_dir) for i in range(args.runs)]
            for i, r in enumerate(results):
                print('%s run %d: %s' % (scene, i, ', '.join(
                    '%s %s' % (k, ('%.3f' % v) if isinstance(v, float) else v)
                    for k, v in sorted(r.items()))))
            for k in sorted(results[0]):
                if k != 'checksum':
                    print('%s median %s %.3f' % (scene, k, median([r[k] for r in results])))


if __name__ == '__main__':
    main()
