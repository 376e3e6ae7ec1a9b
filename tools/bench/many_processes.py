#!/usr/bin/env python3
"""Many processes on one machine (issue #19): jobs of W workers and S servers.

For each job WxS it starts a scheduler, S tessera-servers and W scale_workers
(tools/bench/scale_worker.c: join, barriers, ROUNDS sync rounds of push and
pull on a VALUES-float key, checked exactly) with fresh job keys, as launch.py
would, and prints one row:

  wall       spawn of the scheduler to the last process's exit
  form       spawn to the last worker's return from tessera_kv_create
  barrier    a worker barrier, ms (mean of BARRIERS, rank 0's view)
  rounds     ROUNDS rounds of push + pull, ms (rank 0)
  end        the last worker's close to the last process's exit, s
  threads, sockets, RSS   per process of each role (sampled every 0.25 s while
             the job runs: the most threads and sockets seen; VmHWM last read)
  hb/s       heartbeats the scheduler handled per second (its own count)
  cpu s      CPU time (user + system) of all the job's processes together
  us/msg     CPU time of the scheduler's thread per message it handled (its exit summary;
             ZeroMQ's I/O thread not included)

    tools/bench/many_processes.py [--jobs 8x2,16x4,32x8,64x16] [--values 1000]
        [--rounds 20] [--barriers 5] [--build build] [--json FILE]

Needs `ulimit -n` above the sockets of the biggest process (it raises its soft
limit to the hard one).
"""
import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..'))
from tessera_launch import keys as job_keys  # noqa: E402  (the job keys)
from tessera_launch.hosts import free_port_run  # noqa: E402


def free_port():
    """A free port below the ephemeral range (tessera_launch.hosts.free_port_run)."""
    return free_port_run(1)


def sample(pid):
    """(threads, sockets, VmHWM kB) of a running process, or None."""
    try:
        threads = len(os.listdir('/proc/%d/task' % pid))
        sockets = 0
        for fd in os.listdir('/proc/%d/fd' % pid):
            try:
                if os.readlink('/proc/%d/fd/%s' % (pid, fd)).startswith('socket:'):
                    sockets += 1
            except OSError:
                pass
        with open('/proc/%d/status' % pid) as f:
            hwm = int(re.search(r'VmHWM:\s+(\d+)', f.read()).group(1))
        return threads, sockets, hwm
    except (OSError, AttributeError):
        return None


def run_job(args, workers, servers):
    tmp = tempfile.mkdtemp(prefix='tessera-many-')
    env = dict((k, v) for k, v in os.environ.items() if not k.startswith('DMLC_'))
    env['TESSERA_CORE_DUMPS'] = '1'  # /proc/PID/fd of the daemons, read without root
    env.update(DMLC_PS_ROOT_URI='127.0.0.1', DMLC_PS_ROOT_PORT=str(free_port()),
               DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers),
               TESSERA_START_TIMEOUT='120')
    if env.get('TESSERA_INSECURE') != '1':
        keys = os.path.join(tmp, 'keys')
        os.mkdir(keys, 0o700)
        job_keys.write_job_keys(keys)
        env['TESSERA_KEY_DIR'] = keys
    b = args.build
    plan = ([('scheduler', [os.path.join(b, 'scheduler/tessera-scheduler')])] +
            [('server', [os.path.join(b, 'server/tessera-server')])] * servers +
            [('worker', [os.path.join(b, 'tools/bench/scale_worker'), str(args.values),
                         str(args.rounds), str(args.barriers)])] * workers)
    procs = []
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    for i, (role, argv) in enumerate(plan):
        log = open(os.path.join(tmp, '%s-%d.log' % (role, i)), 'w')
        procs.append((role, subprocess.Popen(argv, env=dict(env, DMLC_ROLE=role),
                                             stdout=log, stderr=subprocess.STDOUT), log))
    watched = {}  # role -> the first process of that role
    for role, p, _ in procs:
        watched.setdefault(role, p)
    peak = {role: [0, 0, 0] for role in watched}
    deadline = start + args.timeout
    while any(p.poll() is None for _, p, _ in procs):
        for role, p in watched.items():
            s = sample(p.pid) if p.poll() is None else None
            if s is not None:
                peak[role] = [max(peak[role][0], s[0]), max(peak[role][1], s[1]), s[2]]
        if time.time() > deadline:
            for _, p, _ in procs:
                p.kill()
            break
        time.sleep(0.25)
    end = time.time()
    for _, p, log in procs:
        p.wait()
        log.close()
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    failed = ['%s %d exited %d' % (role, i, p.returncode)
              for i, (role, p, _) in enumerate(procs) if p.returncode != 0]
    joined, barrier, rounds, close = [], None, None, []
    for i, (role, _, _) in enumerate(procs):
        if role != 'worker':
            continue
        text = open(os.path.join(tmp, '%s-%d.log' % (role, i))).read()
        m = re.search(r'SCALE rank=(\d+) joined_unix_ms=([\d.]+) barrier_ms=([\d.]+) '
                      r'rounds_ms=([\d.]+) close_ms=([\d.]+)', text)
        if m:
            joined.append(float(m.group(2)) / 1e3)
            if m.group(1) == '0':
                barrier, rounds = float(m.group(3)), float(m.group(4))
            close.append(float(m.group(5)))
    sched = open(os.path.join(tmp, 'scheduler-0.log')).read()
    m = re.search(r'handled (\d+) messages \((\d+) heartbeats\) in ([\d.]+)(ms|s)', sched)
    hb_rate = None
    cpu_m = re.search(r'(\d+) ms of CPU on the scheduler', sched)
    per_msg_us = None
    if m and cpu_m and int(m.group(1)) > 0:
        per_msg_us = int(cpu_m.group(1)) * 1e3 / int(m.group(1))
    if m:
        secs = float(m.group(3)) / (1e3 if m.group(4) == 'ms' else 1)
        hb_rate = int(m.group(2)) / secs if secs > 0 else None
    row = {'workers': workers, 'servers': servers, 'wall_s': end - start, 'cpu_s': cpu,
           'formation_s': (max(joined) - start) if len(joined) == workers else None,
           'barrier_ms': barrier, 'rounds_ms': rounds,
           'peak': peak, 'scheduler_heartbeats_per_s': hb_rate,
           'scheduler_messages': int(m.group(1)) if m else None,
           'scheduler_cpu_us_per_message': per_msg_us, 'failed': failed,
           'logs': tmp}
    if not failed and not args.keep:
        shutil.rmtree(tmp)
    return row


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--jobs', default='8x2,16x4,32x8,64x16',
                   help='WORKERSxSERVERS, comma-separated (default 8x2,16x4,32x8,64x16)')
    p.add_argument('--values', type=int, default=1000)
    p.add_argument('--rounds', type=int, default=20)
    p.add_argument('--barriers', type=int, default=5)
    p.add_argument('--build', default=os.path.join(HERE, '..', '..', 'build'))
    p.add_argument('--timeout', type=float, default=300, help='per job, seconds')
    p.add_argument('--keep', action='store_true', help='keep the logs of jobs that passed')
    p.add_argument('--json', dest='json_out')
    args = p.parse_args(argv)
    jobs = []
    for spec in args.jobs.split(','):
        m = re.fullmatch(r'(\d+)x(\d+)', spec.strip())
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            p.error('--jobs: %r: expected WORKERSxSERVERS, e.g. 64x16' % spec)
        jobs.append((int(m.group(1)), int(m.group(2))))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print('many_processes: %d cores, %s, values %d, rounds %d, barriers %d' %
          (os.cpu_count(), 'insecure' if os.environ.get('TESSERA_INSECURE') == '1'
           else 'CURVE', args.values, args.rounds, args.barriers))
    print('%-9s %5s %7s %7s %8s %9s %6s  %-17s %-17s %-17s %7s %6s %8s' %
          ('job', 'procs', 'wall s', 'form s', 'barr ms', 'rounds ms', 'end s',
           'sched thr/sock/MB', 'server thr/sock/MB', 'worker thr/sock/MB', 'hb/s', 'cpu s',
           'us/msg'))
    rows, rc = [], 0
    for w, s in jobs:
        r = run_job(args, w, s)
        rows.append(r)

        def cell(role):
            t, k, kb = r['peak'].get(role, [0, 0, 0])
            return '%d/%d/%.0f' % (t, k, kb / 1024.0)
        print('%-9s %5d %7.2f %7s %8s %9s %6s  %-17s %-17s %-17s %7s %6.1f %8s' % (
            '%dx%d' % (w, s), w + s + 1, r['wall_s'],
            '%.2f' % r['formation_s'] if r['formation_s'] is not None else '-',
            '%.2f' % r['barrier_ms'] if r['barrier_ms'] is not None else '-',
            '%.0f' % r['rounds_ms'] if r['rounds_ms'] is not None else '-',
            '%.2f' % (r['wall_s'] - (r['formation_s'] or 0) - (r['rounds_ms'] or 0) / 1e3
                      - (r['barrier_ms'] or 0) * args.barriers / 1e3),
            cell('scheduler'), cell('server'), cell('worker'),
            '%.1f' % r['scheduler_heartbeats_per_s']
            if r['scheduler_heartbeats_per_s'] is not None else '-', r['cpu_s'],
            '%.1f' % r['scheduler_cpu_us_per_message']
            if r['scheduler_cpu_us_per_message'] is not None else '-'), flush=True)
        if r['failed']:
            rc = 1
            print('  FAILED: %s; logs in %s' % ('; '.join(r['failed'][:5]), r['logs']))
    if args.json_out:
        with open(args.json_out, 'w') as f:
            json.dump(rows, f, indent=1)
    return rc


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
