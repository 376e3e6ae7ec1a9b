#!/usr/bin/env python3
"""Sealed links against an attacker on the link (issue #25), with real daemons.

A job (tessera-scheduler, 2 tessera-servers, 2 kv_check_worker "nightly", whose
5.76 MB key travels in 1 MiB slices of several sealed records each) runs in a
network namespace of its own, where nftables sends every TCP connection
through a transparent proxy in this test. The proxy parses ZeroMQ's framing
(ZMTP 3.0) and, on the sealed lanes from workers to servers, does once each:

  flip      a copy of a data record with one bit flipped, ahead of the record
  replay    the record again, right after it
  truncate  a copy of a message's first record one byte short, ahead of it
  moved     a record of the same worker's link to the other server, ahead of
            a record of this link
  other job a record sealed under another job's keys (captured from an earlier
            job through the same proxy) with this link's prefix, ahead of it

Every one must be dropped and counted by the server it reached (its exit
summary: "sealed drops 5 (...)"), the job must end 0 with every value
exactly right (nightly checks them) and every server applying exactly the
pushes of an undisturbed run. The proxy also keeps every byte it relayed:
the pushed and pulled tensors' plaintext (runs of one float value) must be
nowhere in the secured jobs' traffic, and is found in that of a job run with
TESSERA_INSECURE=1 (so the search itself can see plaintext).

Needs root, iproute2 and nftables; otherwise prints "sealed_tamper_test:
SKIPPED: <why>" and exits 0.

    tests/faults/sealed_tamper_test.py [--build build] [--keep]
"""
import argparse
import asyncio
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', '..', 'tools'))
from tessera_launch.hosts import free_port_run  # noqa: E402
ROOT = os.path.normpath(os.path.join(HERE, '..', '..'))
MARK = 0x5ea1      # the proxy's own connections, which nftables lets through
SO_ORIGINAL_DST = 80
TIMEOUT = 120


def skip(why):
    sys.stdout.write('sealed_tamper_test: SKIPPED: %s\n' % why)
    sys.exit(0)


# --- The proxy ---------------------------------------------------------------

class Tamper:
    """The attacks, each done once, on records sealed by workers."""

    def __init__(self, other_job_record):
        self.other = other_job_record      # a first record of another job
        self.lock = threading.Lock()
        self.done = []                     # names of the attacks done
        self.seen = 0
        self.first_by_key = {}             # node key -> {conn: last first record}

    def records(self, conn, record):
        """The records to send instead of `record` on connection `conn`."""
        if record[5] != 2:                 # sealed by a worker
            return [record]
        first = record[4] & 1
        key = bytes(record[8:40])
        with self.lock:
            self.seen += 1
            if first:
                self.first_by_key.setdefault(key, {})[conn] = record
            if self.seen < 40 or len(self.done) == 5:
                return [record]
            step = ['flip', 'replay', 'truncate', 'moved', 'other job'][len(self.done)]
            if step in ('flip', 'replay') and (first or len(record) < 64 * 1024):
                return [record]
            if step in ('truncate', 'other job') and not first:
                return [record]
            if step == 'moved':
                others = [r for c, r in self.first_by_key.get(key, {}).items() if c != conn]
                if not first or not others:
                    return [record]
                self.done.append(step)
                return [others[-1], record]
            self.done.append(step)
            if step == 'flip':
                bad = bytearray(record)
                bad[64 + 1000] ^= 0x10
                return [bytes(bad), record]
            if step == 'replay':
                return [record, record]
            if step == 'truncate':
                return [record[:-1], record]
            # Another job's ciphertext and tag under this link's prefix: the
            # same record number, so that the server tries to open it.
            forged = bytearray(record[:64]) + self.other[64:]
            forged[56:60] = struct.pack('<I', len(self.other) - 80)
            return [bytes(forged), record]


class Proxy:
    """A transparent TCP proxy (nftables redirects to it) that keeps every
    byte it relays and hands the sealed records of PLAIN connections (the
    sealed lanes) to a Tamper, or collects first records from them."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.captured = []                 # every chunk relayed, both ways
        self.tamper = None
        self.collect = None                # list to put first records into
        self.conns = 0
        self.port = None
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait()

    def _run(self, started):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, '127.0.0.1', 0, limit=1 << 22))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    def reset(self, tamper=None, collect=None):
        self.captured = []
        self.tamper = tamper
        self.collect = collect

    async def _handle(self, reader, writer):
        sock = writer.get_extra_info('socket')
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, = struct.unpack('!H', raw[2:4])
        host = socket.inet_ntoa(raw[4:8])
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
        up.setblocking(False)
        try:
            await self.loop.sock_connect(up, (host, port))
        except OSError:
            up.close()
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(sock=up, limit=1 << 22)
        self.conns += 1
        conn = self.conns
        await asyncio.gather(self._client_to_server(conn, reader, up_writer),
                             self._raw(up_reader, writer), return_exceptions=True)

    async def _raw(self, reader, writer):
        try:
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    break
                self.captured.append(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def _client_to_server(self, conn, reader, writer):
        """Relays ZMTP frame by frame; records of PLAIN connections may be
        replaced by what the Tamper says."""
        try:
            # The 64-byte greeting is relayed as it comes: ZeroMQ sends its
            # first bytes and waits for the peer's before the rest.
            greeting = b''
            while len(greeting) < 64:
                chunk = await reader.read(64 - len(greeting))
                if not chunk:
                    return
                greeting += chunk
                self.captured.append(chunk)
                writer.write(chunk)
                await writer.drain()
            sealed_lane = greeting[12:17] == b'PLAIN'
            while True:
                flags = (await reader.readexactly(1))[0]
                size_bytes = await reader.readexactly(8 if flags & 2 else 1)
                size = int.from_bytes(size_bytes, 'big')
                body = await reader.readexactly(size)
                self.captured.append(body)
                out = [body]
                if (sealed_lane and not flags & 4 and not flags & 1 and
                        body[:4] == b'TSL1' and len(body) >= 80):
                    if self.collect is not None and body[4] & 1 and len(body) < 4096:
                        self.collect.append(body)
                    if self.tamper is not None:
                        out = self.tamper.records(conn, body)
                for b in out:
                    f = flags & ~2 & 0xff
                    if len(b) > 255:
                        writer.write(bytes([f | 2]) + len(b).to_bytes(8, 'big') + b)
                    else:
                        writer.write(bytes([f, len(b)]) + b)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


# --- The jobs ----------------------------------------------------------------

def free_port():
    """A free port below the ephemeral range (tessera_launch.hosts.free_port_run)."""
    return free_port_run(1)


def run_job(build, tmp, name, secure=True):
    """Runs the nightly job; returns ({process: log text}, {process: exit})."""
    env = dict((k, v) for k, v in os.environ.items()
               if not k.startswith(('DMLC_', 'TESSERA_', 'PS_')))
    env.update(DMLC_PS_ROOT_URI='127.0.0.1', DMLC_PS_ROOT_PORT=str(free_port()),
               DMLC_NUM_SERVER='2', DMLC_NUM_WORKER='2', TESSERA_START_TIMEOUT='60')
    if secure:
        keys = os.path.join(tmp, name + '-keys')
        os.mkdir(keys, 0o700)
        subprocess.run([os.path.join(build, 'tools/keygen/tessera-keygen'), keys],
                       check=True, capture_output=True)
        env['TESSERA_KEY_DIR'] = keys
    else:
        env['TESSERA_INSECURE'] = '1'
    plan = [('scheduler', 'scheduler', [os.path.join(build, 'scheduler/tessera-scheduler')])]
    plan += [('server %d' % i, 'server', [os.path.join(build, 'server/tessera-server')])
             for i in range(2)]
    plan += [('worker %d' % i, 'worker',
              [os.path.join(build, 'tests/core/kv_check_worker'), 'nightly'])
             for i in range(2)]
    procs = []
    for label, role, argv in plan:
        log = open(os.path.join(tmp, '%s-%s.log' % (name, label.replace(' ', ''))), 'w+')
        procs.append((label, subprocess.Popen(argv, env=dict(env, DMLC_ROLE=role),
                                              stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.time() + TIMEOUT
    while any(p.poll() is None for _, p, _ in procs) and time.time() < deadline:
        time.sleep(0.1)
    logs, codes = {}, {}
    for label, p, log in procs:
        if p.poll() is None:
            p.kill()
        codes[label] = p.wait()
        log.seek(0)
        logs[label] = log.read()
        log.close()
    return logs, codes


def sealed_drops(log):
    """{reason: n} of a server's exit summary, "sealed drops 5 (replayed 1,
    ...)", with the total under 'sealed drops'."""
    m = re.search(r'sealed drops (\d+)(?: \(([^)]*)\))?', log)
    if not m:
        return {}
    out = {'sealed drops': int(m.group(1))}
    for part in (m.group(2) or '').split(', '):
        if part:
            reason, n = part.rsplit(' ', 1)
            out[reason] = int(n)
    return out


def pushes(log):
    m = re.search(r'pushes applied \d+ \([^)]*\)', log)
    return m.group(0) if m else None


def plaintext_runs(captured):
    """Runs of 8 equal float32 values the nightly job pushes (1.0 and 2.0) or
    pulls (1 + 6 (i + 1)), found in the captured bytes."""
    data = b''.join(captured)
    values = [1.0, 2.0] + [1.0 + 6 * (i + 1) for i in range(7)]
    return [v for v in values if struct.pack('<f', v) * 8 in data]


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def inside(build, keep):
    proxy = Proxy()
    subprocess.run(['nft', '-f', '-'], check=True, input=(
        'table ip tamper {\n'
        '  chain out {\n'
        '    type nat hook output priority -100; policy accept;\n'
        '    meta mark %d return\n'
        '    ip daddr 127.0.0.1 tcp dport != %d redirect to :%d\n'
        '  }\n'
        '}\n' % (MARK, proxy.port, proxy.port)).encode())
    tmp = tempfile.mkdtemp(prefix='sealed-tamper-')
    try:
        # 1. Another job, undisturbed: its pushes, and first records of its
        # sealed lanes for the "other job" attack.
        other_records = []
        proxy.reset(collect=other_records)
        logs, codes = run_job(build, tmp, 'other')
        check(all(c == 0 for c in codes.values()),
              'the undisturbed job failed: %s\n%s' % (codes, logs))
        # Which process gets which keys depends on the ranks, which follow
        # the (random) ports: the servers' summaries are compared as a set.
        undisturbed = sorted(pushes(logs[s]) or '' for s in ('server 0', 'server 1'))
        check(all(undisturbed), 'no summary in %s' % logs)
        check(not plaintext_runs(proxy.captured),
              'plaintext in the undisturbed secured job: %s' % plaintext_runs(proxy.captured))
        worker_records = [r for r in other_records if r[5] == 2]
        check(worker_records, 'no sealed record captured from the first job')
        print('undisturbed job: %s' % undisturbed)

        # 2. The attacked job.
        tamper = Tamper(worker_records[0])
        proxy.reset(tamper=tamper)
        logs, codes = run_job(build, tmp, 'attacked')
        print('attacks done: %s' % tamper.done)
        check(tamper.done == ['flip', 'replay', 'truncate', 'moved', 'other job'],
              'not every attack found its record: %s' % tamper.done)
        check(all(c == 0 for c in codes.values()),
              'the attacked job failed: %s\n%s' % (codes, logs))
        for w in ('worker 0', 'worker 1'):
            check('nightly ok' in logs[w], '%s did not check its values:\n%s' % (w, logs[w]))
        applied = sorted(pushes(logs[s]) or '' for s in ('server 0', 'server 1'))
        check(applied == undisturbed,
              'the servers applied %s, undisturbed %s' % (applied, undisturbed))
        total = dict((r, 0) for r in ('sealed drops', 'unauthentic', 'replayed',
                                      'malformed', 'out of order', 'incomplete',
                                      'unknown key', 'wrong sender', 'unsealed'))
        for s in ('server 0', 'server 1'):
            drops = sealed_drops(logs[s])
            check(drops, 'no sealed drops in the summary of %s:\n%s' % (s, logs[s]))
            for reason, n in drops.items():
                total[reason] += n
        print('dropped by the servers: %s' % total)
        check(total['sealed drops'] == 5, 'expected 5 drops: %s' % total)
        check(total['malformed'] == 1, 'the truncated record: %s' % total)
        # flip and other job fail to open; replay is a replay; the moved
        # record is one or the other (its link is newer or older).
        check(total['unauthentic'] >= 2 and total['replayed'] >= 1 and
              total['unauthentic'] + total['replayed'] == 4, 'drops by reason: %s' % total)
        check(not plaintext_runs(proxy.captured),
              'plaintext in the attacked job: %s' % plaintext_runs(proxy.captured))

        # 3. The same job insecure: the search finds its plaintext.
        proxy.reset()
        logs, codes = run_job(build, tmp, 'insecure', secure=False)
        check(all(c == 0 for c in codes.values()), 'the insecure job failed: %s' % codes)
        found = plaintext_runs(proxy.captured)
        print('plaintext runs found in the insecure job: %s' % found)
        check(len(found) >= 3, 'the search found no plaintext in an insecure job: %s' % found)
        print('sealed_tamper_test: OK')
        return 0
    except Failure as f:
        print('sealed_tamper_test: FAILED: %s' % f)
        keep = True
        return 1
    finally:
        if keep:
            print('sealed_tamper_test: logs kept in %s' % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--build', default=os.environ.get('TESSERA_BUILD_DIR',
                                                     os.path.join(ROOT, 'build')))
    p.add_argument('--keep', action='store_true', help='keep the logs')
    p.add_argument('--inside', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('-v', action='store_true', help='(ctest compatibility)')
    args = p.parse_args(argv)
    build = os.path.abspath(args.build)
    if args.inside:
        return inside(build, args.keep)
    if os.geteuid() != 0:
        skip('needs root (a network namespace and nftables)')
    for tool, package in (('ip', 'iproute2'), ('nft', 'nftables')):
        if not shutil.which(tool):
            skip('%s not found (Debian: apt-get install %s)' % (tool, package))
    for binary in ('scheduler/tessera-scheduler', 'server/tessera-server',
                   'tests/core/kv_check_worker', 'tools/keygen/tessera-keygen'):
        if not os.access(os.path.join(build, binary), os.X_OK):
            skip('%s not built' % binary)
    ns = 'tsl%d' % os.getpid()
    made = subprocess.run(['ip', 'netns', 'add', ns], capture_output=True, text=True)
    if made.returncode != 0:
        skip('`ip netns add` does not work here: %s' % made.stderr.strip())
    try:
        subprocess.run(['ip', '-n', ns, 'link', 'set', 'lo', 'up'], check=True)
        cmd = ['ip', 'netns', 'exec', ns, sys.executable, os.path.abspath(__file__),
               '--inside', '--build', build] + (['--keep'] if args.keep else [])
        return subprocess.run(cmd, timeout=4 * TIMEOUT).returncode
    finally:
        subprocess.run(['ip', 'netns', 'del', ns], capture_output=True)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
