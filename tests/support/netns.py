"""Hosts made of Linux network namespaces, for the tests and benchmarks that run a
real job over several "machines" on this one: each host is a namespace whose
`eth0` is one end of a veth pair, the other end a port of one bridge.

Everything a run makes (namespaces, links, processes, folders) is listed in a
state file as it is made, and removed from it at the end: by
Resources.teardown() (call it on every path; teardown_on_exit() adds atexit and
SIGINT/SIGTERM/SIGHUP), and, should the run be SIGKILLed (a ctest time-out),
by a guard process, detached in its own session, that waits for the run's pipe
to close. Every name starts with the run's tag, so runs side by side never
touch each other's.

    sys.path.insert(0, os.path.join(SOURCE_DIR, 'tests', 'support'))
    import netns

    reason = netns.namespaces_problem(tag)            # None, or why not here
    res = netns.Resources('my_test', 'mine', tag)      # temp folder, state, guard
    netns.teardown_on_exit(res)
    netns.make_bridge(res, tag + 'br')
    for i, ns in enumerate(namespaces):
        netns.make_namespace(res, ns)
        netns.connect_to_bridge(res, ns, tag + 'br', '%sv%d' % (tag, i),
                                '%sp%d' % (tag, i), ['10.81.0.%d/24' % (i + 1)])
    worker = netns.Proc(res, namespaces[1], 'worker 0', argv, env)
    ...
    res.teardown()

Used by tests/faults/netfault_test.py, tests/multihost/multihost_test.py and
slurm_test.py, and tools/bench/shaped_link.py (and through it seed_step.py).
Needs root and iproute2. Thread-safety: one thread makes and tears down;
run() and the queries may be called from any thread. Errors: run() raises
RuntimeError naming the command, its status and output; the clean-up never
raises.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest


def run(argv, check=True, timeout=30, ns=None, **kw):
    """Runs a short command; in namespace ns when given. Returns CompletedProcess
    with .out (stdout and stderr together). stdin is /dev/null unless `input`
    is given. Raises RuntimeError when check and it exits non-zero."""
    if ns is not None:
        argv = ['ip', 'netns', 'exec', ns] + list(argv)
    if 'input' not in kw:
        kw['stdin'] = subprocess.DEVNULL
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout, **kw)
    proc.out = proc.stdout.decode('utf-8', 'replace')
    if check and proc.returncode != 0:
        raise RuntimeError('%s: exit %d: %s' % (' '.join(argv), proc.returncode,
                                                proc.out.strip()))
    return proc


def quiet(argv):
    """Runs a clean-up command, ignoring its output and any failure."""
    try:
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       stdin=subprocess.DEVNULL, timeout=20)
    except (OSError, subprocess.SubprocessError):
        pass


def tail_of(path, n=25):
    """The last n lines of a log file, or a line saying why there are none."""
    try:
        with open(path, 'rb') as f:
            lines = f.read().decode('utf-8', 'replace').splitlines()
    except OSError as e:
        return '(no output: %s)' % e
    return '\n'.join(lines[-n:]) if lines else '(no output)'


def namespaces_problem(tag, check_inside=None):
    """Why network namespaces and a bridge cannot be made here, or None. Makes
    and removes a namespace and a bridge named after `tag`; check_inside(ns),
    when given, probes more in that namespace and returns a reason or None.
    The caller checks for root and its own tools first."""
    probe, bridge = tag + 'probe', tag + 'probebr'
    try:
        made = run(['ip', 'netns', 'add', probe], check=False)
        if made.returncode != 0:
            return '`ip netns add` does not work here: %s' % made.out.strip()
        works = run(['ip', 'link', 'set', 'lo', 'up'], ns=probe, check=False)
        if works.returncode != 0:
            return '`ip netns exec` does not work here: %s' % works.out.strip()
        if check_inside is not None:
            why = check_inside(probe)
            if why:
                return why
        made = run(['ip', 'link', 'add', bridge, 'type', 'bridge'], check=False)
        if made.returncode != 0:
            return 'cannot create a bridge here: %s' % made.out.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return 'probing network namespaces failed: %s' % e
    finally:
        quiet(['ip', 'link', 'del', bridge])
        quiet(['ip', 'netns', 'del', probe])
    return None


# ----------------------------------------------------------------------------
# Clean-up, driven by a state file so that a separate guard process can do it


def start_time(pid):
    """The process's start time in clock ticks since boot (field 22 of
    /proc/PID/stat), to tell it from a later process given the same pid."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            return int(f.read().rsplit(')', 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def namespace_pids(ns):
    try:
        out = subprocess.run(['ip', 'netns', 'pids', ns], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=10).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(ns):
    """SIGKILLs every process in ns (every one of them was started by the run)."""
    for _ in range(50):
        pids = [p for p in namespace_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)


def namespace_processes(namespaces, skip=None):
    """(namespace, pid, program) of every process in `namespaces` but those for
    which skip(pid, program) is true."""
    found = []
    for ns in namespaces:
        for pid in namespace_pids(ns):
            try:
                program = os.path.basename(os.readlink('/proc/%d/exe' % pid))
            except OSError:
                continue  # gone meanwhile
            if skip is None or not skip(pid, program):
                found.append((ns, pid, program))
    return found


def kill_leftovers(processes, bound_s):
    """Waits up to bound_s for processes() (a list of (namespace, pid, program),
    as namespace_processes returns) to be empty, then SIGKILLs what is left and
    returns that list: what a finished job left behind."""
    deadline = time.monotonic() + bound_s
    left = processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes()
    for _, pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def cleanup_from_state(path):
    """Removes what the state file at path lists: processes (by pid and start
    time, and by pid file), then everything in the namespaces, the namespaces,
    links and folders. Idempotent; never raises."""
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return
    for pid, started in state.get('pids', []):
        if start_time(pid) == started:  # still the process the run started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for pidfile in state.get('pidfiles', []):
        try:
            with open(pidfile) as f:
                os.kill(int(f.read().split()[0]), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
    for ns in state.get('namespaces', []):
        kill_namespace_processes(ns)
    for ns in state.get('namespaces', []):
        quiet(['ip', 'netns', 'del', ns])
    for link in state.get('links', []):
        quiet(['ip', 'link', 'del', link])
    for d in state.get('dirs', []):
        shutil.rmtree(d, ignore_errors=True)
    for d in state.get('empty_dirs', []):
        try:
            os.rmdir(d)  # only if nothing else lives there now
        except OSError:
            pass
    try:
        os.unlink(path)
    except OSError:
        pass


def guard_main(state_path):
    """The guard: waits for the run's pipe (stdin) to close, then cleans up."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    cleanup_from_state(state_path)
    return 0


def start_guard(state_path):
    """Starts a guard detached from this process (double fork, own session, no
    inherited output pipes) so that neither a SIGKILL of this process nor a
    process-tree kill by ctest takes it along. Returns the write end of its pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(r, 0)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.closerange(3, 65536)
            os.execv(sys.executable, [sys.executable, os.path.abspath(__file__),
                                      '--cleanup-guard', state_path])
        finally:
            os._exit(127)
    os.close(r)
    os.waitpid(pid, 0)
    return w


class Resources(object):
    """What one run made, in its state file: the temporary folder (tmp) and
    whatever remember() adds; a guard removes it all should the run die.

    `label` starts the run's messages; the folder is tessera-<kind>-<tag>-*
    and the state file tessera-<kind>-<tag>.json in the temporary folder."""

    KINDS = ('pids', 'pidfiles', 'namespaces', 'links', 'dirs', 'empty_dirs')

    def __init__(self, label, kind, tag):
        self.label = label
        self.tag = tag
        self.tmp = tempfile.mkdtemp(prefix='tessera-%s-%s-' % (kind, tag))
        self.state_path = os.path.join(tempfile.gettempdir(),
                                       'tessera-%s-%s.json' % (kind, tag))
        self.state = dict((k, []) for k in self.KINDS)
        self.state['dirs'].append(self.tmp)
        self.logs_kept = False
        self._torn_down = False
        self._save()
        self.guard_fd = start_guard(self.state_path)

    def _save(self):
        tmp = self.state_path + '.new'
        with open(tmp, 'w') as f:
            json.dump(self.state, f)
        os.replace(tmp, self.state_path)

    def remember(self, kind, value):
        """Lists value (a pid and its start time, a pid file, a namespace, a link,
        a folder, or a folder to remove when empty) for the clean-up."""
        self.state[kind].append(value)
        self._save()

    def forget(self, kind, value):
        if value in self.state[kind]:
            self.state[kind].remove(value)
            self._save()

    def keep_logs(self):
        """Keeps the temporary folder (every process's whole output) after the run;
        teardown() names it."""
        self.forget('dirs', self.tmp)
        self.logs_kept = True

    def teardown(self):
        if self._torn_down:
            return
        self._torn_down = True
        cleanup_from_state(self.state_path)
        if self.guard_fd is not None:
            os.close(self.guard_fd)  # the guard finds nothing left and exits
            self.guard_fd = None
        if self.logs_kept:
            sys.stderr.write('%s: the logs of every process are kept in %s\n'
                             % (self.label, self.tmp))


def teardown_on_exit(resources):
    """Tears `resources` down at exit and on SIGINT, SIGTERM and SIGHUP (the
    signal then ends this process as it would have)."""
    atexit.register(resources.teardown)

    def handler(signum, _frame):
        resources.teardown()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def require(label, missing_prerequisite, binaries, build_dir):
    """The checks of a test module's setUpModule: adds /usr/sbin and /sbin to
    PATH; when missing_prerequisite() gives a reason, says "LABEL: SKIPPED:
    <reason>" (what ctest's SKIP_REGULAR_EXPRESSION looks for) and raises
    unittest.SkipTest; raises RuntimeError naming a binary that is not built."""
    os.environ['PATH'] = os.environ.get('PATH', '') + ':/usr/sbin:/sbin'
    reason = missing_prerequisite()
    if reason:
        sys.stderr.write('%s: SKIPPED: %s\n' % (label, reason))
        raise unittest.SkipTest(reason)
    for path in binaries:
        if not os.access(path, os.X_OK):
            raise RuntimeError('%s not built (TESSERA_BUILD_DIR=%s)' % (path, build_dir))


def set_up(resources):
    """teardown_on_exit(resources), then resources.setup(); tears down and
    re-raises when that fails. Returns resources (a test module's topology)."""
    teardown_on_exit(resources)
    try:
        resources.setup()
    except BaseException:
        resources.teardown()
        raise
    return resources


# ----------------------------------------------------------------------------
# Hosts


def make_bridge(res, name):
    run(['ip', 'link', 'add', name, 'type', 'bridge'])
    res.remember('links', name)
    run(['ip', 'link', 'set', name, 'up'])


def make_namespace(res, ns):
    """A network namespace with its loopback up."""
    run(['ip', 'netns', 'add', ns])
    res.remember('namespaces', ns)
    run(['ip', 'link', 'set', 'lo', 'up'], ns=ns)


def connect_to_bridge(res, ns, bridge, host_end, peer, addresses):
    """Gives ns an `eth0` on the bridge: a veth pair host_end (a port of the
    bridge) and peer (moved into ns, renamed eth0, given `addresses`, such as
    '10.77.0.1/24' or 'fd77::1/64', IPv6 without duplicate address detection)."""
    run(['ip', 'link', 'add', host_end, 'type', 'veth', 'peer', 'name', peer])
    res.remember('links', host_end)
    run(['ip', 'link', 'set', host_end, 'master', bridge])
    run(['ip', 'link', 'set', host_end, 'up'])
    run(['ip', 'link', 'set', peer, 'netns', ns])
    run(['ip', 'link', 'set', peer, 'name', 'eth0'], ns=ns)
    for address in addresses:
        run(['ip', 'addr', 'add', address, 'dev', 'eth0'] + (['nodad'] if ':' in address
                                                             else []), ns=ns)
    run(['ip', 'link', 'set', 'eth0', 'up'], ns=ns)


# ----------------------------------------------------------------------------
# Processes


class Proc(object):
    """One process (in namespace ns when given), its output to a log file (by
    default one in res.tmp named after the label). Listed in the state file
    while it runs; ended by pid."""

    def __init__(self, res, ns, label, argv, env, log=None):
        self.res = res
        self.label = label
        self.ns = ns
        self.log = log or os.path.join(res.tmp, '%s-%d.log' % (label.replace(' ', '-'),
                                                               time.monotonic_ns()))
        if ns is not None:
            argv = ['ip', 'netns', 'exec', ns] + list(argv)  # execs: the same pid
        with open(self.log, 'wb') as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=res.tmp, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pid = self.proc.pid
        self.entry = [self.pid, start_time(self.pid)]
        res.remember('pids', self.entry)

    def poll(self):
        code = self.proc.poll()
        if code is not None:
            self.res.forget('pids', self.entry)
        return code

    def end(self, sig=signal.SIGTERM, wait_s=5):
        """Ends the process by pid (if still running): sig, then SIGKILL. Returns
        its exit status."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)  # still our unreaped child: the pid is ours
                self.proc.wait(wait_s)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.proc.wait()
        self.poll()
        return self.proc.returncode

    def output(self):
        try:
            with open(self.log, 'rb') as f:
                return f.read().decode('utf-8', 'replace')
        except OSError:
            return ''

    def tail(self, n=25):
        return tail_of(self.log, n)


def wait_all(procs, deadline, grace_s, timeout_why, watch=None, poll_s=0.1, expected=None):
    """Waits for every Proc of a job to exit: until `deadline` (a time.monotonic()),
    until grace_s after the first one failed (exited non-zero, other than the code
    `expected` gives its label, e.g. {'worker 1': -9} for one the test killed), or
    until watch(), called every poll, returns a reason. Then SIGKILLs by pid whatever
    still runs.

    Returns (why, ended): why is None when every process exited by itself, else
    what ended the wait (timeout_why at the deadline) and which processes were
    killed; ended is the time.monotonic() at which the wait ended."""
    why = None
    first_failure = None
    expected = expected or {}
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if first_failure is None and any(
                c not in (None, 0, expected.get(p.label)) for p, c in zip(procs, codes)):
            first_failure = now
        if watch is not None:
            why = watch()
            if why:
                break
        if now > deadline:
            why = timeout_why
            break
        if first_failure is not None and now > first_failure + grace_s:
            why = 'a process failed and the others were still running %d s later' % grace_s
            break
        time.sleep(poll_s)
    ended = time.monotonic()
    running = [p.label for p in procs if p.poll() is None]
    for p in procs:
        p.end(signal.SIGKILL)
    if running:
        why = '%s; killed: %s' % (why, ', '.join(running))
    return why, ended


if __name__ == '__main__':
    if len(sys.argv) == 3 and sys.argv[1] == '--cleanup-guard':
        sys.exit(guard_main(sys.argv[2]))
    sys.stderr.write('usage: netns.py --cleanup-guard STATE_FILE (started by start_guard)\n')
    sys.exit(2)
