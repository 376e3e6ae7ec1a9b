"""Process supervision: starts the job's processes (Node), relays their output
line by line with a [role i] prefix, restarts them (--restarts), and stops
every process group of the job when one fails, the workers are done, or the
launcher gets a signal (Job).

    job = Job(nodes, timeout=30.0, restarts=0, verbose=False)
    install_signal_handlers(job)
    status = job.run()   # the launcher's exit status

Thread-safety: see Job.
"""

import atexit
import ctypes
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

from .options import PROG
from .remote import REMOTE_PID_MARKER

# Seconds between SIGTERM and SIGKILL when stopping a process group.
TERM_GRACE_S = 3.0
POLL_INTERVAL_S = 0.05


def pdeathsig_preexec():
    """A preexec_fn that has the kernel SIGKILL the child if the launcher dies."""
    if not sys.platform.startswith('linux'):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec():
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    return preexec


def signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return 'signal %d' % signum


def describe_status(rc, remote, transport='ssh'):
    """'exited with status 3' / 'killed by signal SIGKILL' for a Popen returncode;
    remote: the status came through `transport` (ssh or srun)."""
    if rc < 0:
        return 'killed by signal %s' % signal_name(-rc)
    if remote and rc == 255 and transport == 'ssh':
        return 'exited with status 255 (ssh failed, or the remote process exited 255)'
    if remote and 128 < rc < 128 + 65:
        return 'exited with status %d (128+%s)' % (rc, signal_name(rc - 128))
    return 'exited with status %d' % rc


class Node(object):
    """One process of the job. `spawn(restart_count)` returns (argv, env, cwd).

    Its name ('worker 1') is the rank the scheduler gives it, so that the
    launcher's lines and the daemons' name a process the same way: the
    scheduler ranks each role in start order (DMLC_TASK_ID), so that is
    `index`, unless `rank` says otherwise (the servers of a job with
    TESSERA_MAX_SERVERS take ranks spread over the most, config.server_rank)."""

    def __init__(self, role, index, spawn, host=None, remote=False, primary=False,
                 restartable=False, rank=None):
        self.role = role
        self.index = index  # start order within the role
        self.rank = index if rank is None else rank
        self.spawn = spawn
        self.host = host
        self.remote = remote
        self.primary = primary  # the job is done when all primaries exited 0
        self.restartable = restartable
        self.proc = None
        self.readers = []
        self.restarts = 0
        self.returncode = None
        self.lost = False  # a server that died in a replicated job
        self.remote_pid = None
        self.pgids = []  # every process group this node ever had
        self.tag_map = None  # mpirun: rank -> prefix bytes
        self.split_stderr = False  # relay stderr on its own pipe (mpirun)
        # Remote: what goes down the ssh channel's stdin first (the node's key,
        # see REMOTE_WRAPPER); never on a command line.
        self.stdin_data = None
        # Remote: what carries the process there (ssh, or srun for slurm).
        self.transport = 'ssh'

    @property
    def name(self):
        return self.role if self.rank is None else '%s %d' % (self.role, self.rank)

    @property
    def prefix(self):
        return ('[%s] ' % self.name).encode()

    @property
    def running(self):
        return self.proc is not None and self.returncode is None

    def label(self):
        """'worker 1 on hostB (pid 42)' for messages."""
        where = ' on %s' % self.host.name if self.host is not None else ''
        if self.remote and self.remote_pid:
            pid = 'pid %d' % self.remote_pid
        elif self.remote:
            pid = '%s pid %d' % (self.transport, self.proc.pid)
        else:
            pid = 'pid %d' % self.proc.pid
        return '%s%s (%s)' % (self.name, where, pid)


_MPI_TAG_RE = re.compile(rb'\[\d+,(\d+)\]<(std(?:out|err|diag))>:')


class Job(object):
    """Starts nodes, relays their output, and supervises them to the end.

    Thread-safety: only the main thread starts, polls and kills; reader threads
    only write output under `_out_lock`. Signal handlers only set `stop_signal`.
    """

    def __init__(self, nodes, timeout, restarts, verbose, quiet_notice=60.0, replicas=1,
                 elastic=''):
        self.nodes = nodes
        self.timeout = timeout
        self.quiet_notice = quiet_notice
        self.last_output = time.monotonic()  # under _out_lock
        self.max_restarts = restarts
        # TESSERA_REPLICAS > 1: a server that dies is survived when each of its
        # slices has a live replica; the scheduler decides, and ends the job
        # (non-zero) when one has none.
        self.replicas = replicas
        # TESSERA_ELASTIC=MIN:MAX: a worker that dies is survived while at
        # least MIN remain; the scheduler decides, and ends the job (non-zero)
        # when fewer do. A worker that left is not restarted (it could not
        # rejoin).
        self.elastic = elastic
        self.verbose = verbose
        self.stop_signal = None
        self._out_lock = threading.Lock()
        self._preexec = pdeathsig_preexec()
        self._torn_down = False
        atexit.register(self._at_exit)

    def _at_exit(self):
        if not self._torn_down:  # an unexpected exit: leave nothing behind
            self.kill_now()

    # -- output

    def say(self, message):
        with self._out_lock:
            try:
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            try:
                sys.stderr.write('%s: %s\n' % (PROG, message))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def _emit(self, data):
        with self._out_lock:
            self.last_output = time.monotonic()
            try:
                out = getattr(sys.stdout, 'buffer', None)
                if out is None:
                    sys.stdout.write(data.decode('utf-8', 'replace'))
                else:
                    out.write(data)
                sys.stdout.flush()
            except (OSError, ValueError):
                pass  # Our stdout is gone; keep draining the pipe anyway.

    @staticmethod
    def _tag_prefix(node, key):
        return node.prefix if key is None else node.tag_map(key[0])

    def _relay_tagged(self, node, line, partial):
        """Splits mpirun --tag-output text into lines per rank. mpirun tags each
        chunk a rank writes ('[1,2]<stdout>:text'), and a chunk need not end a
        line, so chunks of several ranks can share one line of mpirun's output."""
        key, start = None, 0
        pieces = []
        for m in _MPI_TAG_RE.finditer(line):
            pieces.append((key, line[start:m.start()]))
            key, start = (int(m.group(1)), m.group(2)), m.end()
        pieces.append((key, line[start:]))
        for key, text in pieces:
            if not text:
                continue
            text = partial.pop(key, b'') + text
            *lines, rest = text.split(b'\n')
            for one in lines:
                self._emit(self._tag_prefix(node, key) + one + b'\n')
            if rest:
                partial[key] = rest

    def _relay(self, node, pipe):
        partial = {}  # mpirun: (rank, stream) -> text of an unfinished line
        try:
            for line in iter(pipe.readline, b''):
                if not line.endswith(b'\n'):
                    line += b'\n'
                if node.remote and line.startswith(REMOTE_PID_MARKER):
                    try:
                        node.remote_pid = int(line[len(REMOTE_PID_MARKER):])
                        continue
                    except ValueError:
                        pass
                if node.tag_map is not None:
                    self._relay_tagged(node, line, partial)
                else:
                    self._emit(node.prefix + line)
        except (OSError, ValueError):
            pass
        finally:
            for key, text in partial.items():
                if text:
                    self._emit(self._tag_prefix(node, key) + text + b'\n')
            try:
                pipe.close()
            except OSError:
                pass

    # -- processes

    def start(self, node):
        """Starts node. Returns an error message or None."""
        argv, env, cwd = node.spawn(node.restarts)
        try:
            proc = subprocess.Popen(
                argv, env=env, cwd=cwd,
                stdin=subprocess.PIPE if node.remote else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE if node.split_stderr else subprocess.STDOUT,
                start_new_session=True, preexec_fn=self._preexec)
        except OSError as e:
            return 'cannot start %s: %s' % (node.name, e)
        node.proc, node.returncode, node.remote_pid = proc, None, None
        node.pgids.append(proc.pid)
        if node.stdin_data is not None and proc.stdin is not None:
            try:  # a few hundred bytes: the pipe takes them without blocking
                proc.stdin.write(node.stdin_data)
                proc.stdin.flush()
            except OSError:
                pass  # ssh exited at once; its status says why
        node.readers = []
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                reader = threading.Thread(target=self._relay, args=(node, pipe),
                                          name='relay %s' % node.name, daemon=True)
                reader.start()
                node.readers.append(reader)
        if self.verbose:
            self.say('started %s: %s' % (node.label(), ' '.join(shlex.quote(a) for a in argv)))
        return None

    @staticmethod
    def _killpg(pgid, sig):
        try:
            os.killpg(pgid, sig)
            return True
        except OSError:
            return False  # ESRCH: the group is gone; EPERM: not ours any more.

    def _poll(self, node):
        if node.running:
            rc = node.proc.poll()
            if rc is not None:
                node.returncode = rc
                for reader in node.readers:  # its last lines go before our message
                    reader.join(0.5)
                return True
        return False

    def _group_alive(self, pgid):
        try:
            os.killpg(pgid, 0)
            return True
        except OSError:
            return False

    def teardown(self):
        """Stops every process group of the job: SIGTERM, then SIGKILL after 3 s."""
        if self._torn_down:
            return
        self._torn_down = True
        for node in self.nodes:
            if node.remote and node.proc is not None and node.proc.stdin:
                try:  # EOF on the channel: the remote watchdog stops the process.
                    node.proc.stdin.close()
                except OSError:
                    pass
        for node in self.nodes:
            for pgid in node.pgids:
                if not node.remote:
                    self._killpg(pgid, signal.SIGTERM)
        # Remote processes get TERM_GRACE_S from their watchdog, plus transit.
        grace = TERM_GRACE_S + (1.5 if any(n.remote for n in self.nodes) else 0.0)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for node in self.nodes:
                self._poll(node)
            if not any(self._group_alive(g) for n in self.nodes for g in n.pgids):
                break
            time.sleep(POLL_INTERVAL_S)
        self.kill_now()
        for node in self.nodes:
            for reader in node.readers:
                reader.join(1.0)

    def kill_now(self):
        """SIGKILLs every process group of the job and reaps the leaders."""
        for node in self.nodes:
            for pgid in node.pgids:
                self._killpg(pgid, signal.SIGKILL)
        for node in self.nodes:
            if node.running:
                try:
                    node.returncode = node.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass

    def _stop(self, message, status):
        self.teardown()  # first, so that the message is the job's last line
        self.say(message)
        return status

    def _exit_status(self, node, rc):
        if node.role in ('worker', 'added worker', 'mpirun') and rc > 0:
            return rc
        return 1

    def run(self):
        """Runs the job to its end. Returns the launcher's exit status."""
        try:
            return self._run()
        finally:
            self.teardown()

    def _run(self):
        for node in self.nodes:
            if self.stop_signal:
                break
            error = self.start(node)
            if error:
                return self._stop('%s; stopping the job' % error, 1)
        primaries = [n for n in self.nodes if n.primary]
        daemons = [n for n in self.nodes if not n.primary]
        grace_since = None
        started = last_notice = time.monotonic()
        while True:
            now = time.monotonic()
            with self._out_lock:
                last_output = self.last_output
            if now - max(last_output, last_notice) >= self.quiet_notice:
                # A job that prints nothing for a long time is not taken for a hung one.
                last_notice = now
                self.say('no output for %d s (job running %d s); still running: %s'
                         % (now - last_output, now - started,
                            ', '.join(n.name for n in self.nodes if n.running)))
            if self.stop_signal:
                return self._stop('received %s; stopping the job' % signal_name(self.stop_signal),
                                  128 + self.stop_signal)
            for node in self.nodes:
                if not self._poll(node):
                    continue
                rc = node.returncode
                if rc == 0:
                    if self.verbose:
                        self.say('%s exited with status 0' % node.label())
                    continue
                what = '%s %s' % (node.label(), describe_status(rc, node.remote,
                                                                node.transport))
                # A replicated job's restarted server takes its rank back as a
                # replacement and catches up from its slices' replicas.
                elastic_worker = node.role == 'worker' and self.elastic
                if (node.restartable and node.restarts < self.max_restarts
                        and not elastic_worker):
                    node.restarts += 1
                    self.say('%s; restarting it (restart %d of %d)'
                             % (what, node.restarts, self.max_restarts))
                    self._killpg(node.proc.pid, signal.SIGKILL)  # leftovers of the old one
                    if node.proc.stdin:
                        node.proc.stdin.close()
                    error = self.start(node)
                    if error:
                        return self._stop('%s; stopping the job' % error, 1)
                    continue
                if elastic_worker:
                    if not node.lost:
                        node.lost = True
                        self.say('%s; TESSERA_ELASTIC=%s: the job goes on without it (the '
                                 'scheduler ends it if fewer than the minimum remain)'
                                 % (what, self.elastic))
                    continue
                if node.role in ('server', 'spare') and self.replicas > 1:
                    if not node.lost:
                        node.lost = True
                        self.say('%s; TESSERA_REPLICAS=%d: its key slices fail over to their '
                                 'replicas and the job goes on (the scheduler ends it if a '
                                 'slice has none left)' % (what, self.replicas))
                    continue
                return self._stop('%s; stopping the job' % what, self._exit_status(node, rc))
            primaries_done = all(n.returncode == 0 or n.lost for n in primaries)
            daemons_done = all(n.returncode == 0 or n.lost for n in daemons)
            if primaries_done and daemons_done:
                return 0
            # The grace for the others starts when one side has ended, not when
            # it has nothing to end: a launcher with only primaries (launch.py
            # --add-servers, mpirun) waits for them as long as they run.
            if (primaries and primaries_done) or (daemons and daemons_done):
                now = time.monotonic()
                grace_since = grace_since or now
                if now - grace_since > self.timeout:
                    late = [n for n in self.nodes if n.running]
                    scheduler_ok = any(n.role == 'scheduler' and n.returncode == 0
                                       for n in self.nodes)
                    if (primaries_done and scheduler_ok and self.replicas > 1
                            and late and all(n.role in ('server', 'spare') for n in late)):
                        # The scheduler ended the job OK without them: servers it
                        # declared dead whose processes (or ssh sessions to a host
                        # that is gone) never ended. Their slices had failed over.
                        return self._stop('%s still running %g s after the job ended OK; '
                                          'TESSERA_REPLICAS=%d: taken for lost (its key '
                                          'slices failed over); stopping it'
                                          % (', '.join(n.label() for n in late),
                                             self.timeout, self.replicas), 0)
                    after = ('all workers finished' if primaries_done
                             else 'the scheduler and servers exited')
                    for node in late[1:]:
                        self.say('%s still running %g s after %s' % (node.label(), self.timeout,
                                                                     after))
                    return self._stop('%s still running %g s after %s; stopping the job'
                                      % (late[0].label(), self.timeout, after), 1)
            time.sleep(POLL_INTERVAL_S)


def install_signal_handlers(job):
    def handler(signum, _frame):
        if job.stop_signal is None:
            job.stop_signal = signum
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
