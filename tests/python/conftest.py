"""Fixtures of the Python package's tests: whole jobs through tools/launch.py
(--launcher local) with the real tessera-scheduler and tessera-server on
127.0.0.1, and Python workers run by the interpreter running pytest, with the
package from the source tree (python/) and libtessera.so from the build tree.

Needs TESSERA_BUILD_DIR (the CMake build folder) and TESSERA_SOURCE_DIR; ctest
sets both.
"""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get('TESSERA_SOURCE_DIR', os.path.normpath(os.path.join(HERE, '..', '..')))
BUILD = os.environ.get('TESSERA_BUILD_DIR', os.path.join(SOURCE, 'build'))
LAUNCH = os.path.join(SOURCE, 'tools', 'launch.py')
PACKAGE_DIR = os.path.join(SOURCE, 'python')
DATA = os.environ.get('FASHION_MNIST_DIR', '/usr/share/datasets/fashion-mnist')
EXAMPLES = os.path.join(SOURCE, 'examples')

# In-process tests import the package from the source tree too.
sys.path.insert(0, PACKAGE_DIR)
os.environ.setdefault('TESSERA_BUILD_DIR', BUILD)


def marked_pids(mark):
    """Live processes whose environment holds TESSERA_TEST_MARK=mark."""
    pids = []
    needle = ('TESSERA_TEST_MARK=' + mark).encode()
    for entry in os.listdir('/proc'):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open('/proc/%s/environ' % entry, 'rb') as f:
                if needle not in f.read().split(b'\0'):
                    continue
            with open('/proc/%s/stat' % entry) as s:
                if s.read().split(') ')[-1].startswith('Z'):
                    continue
            pids.append(int(entry))
        except OSError:
            pass
    return pids


class Job:
    """Runs tools/launch.py jobs; kills what they leave behind at the end."""

    def __init__(self, tmp):
        self.mark = uuid.uuid4().hex
        self.tmp = tmp
        # TESSERA_CORE_DUMPS=1: daemons whose /proc/PID/environ the cleanup reads without root.
        self.env = dict(os.environ, TESSERA_TEST_MARK=self.mark, TESSERA_CORE_DUMPS='1',
                        PS_HEARTBEAT_INTERVAL='0.2',
                        PS_HEARTBEAT_TIMEOUT='2', TESSERA_TIMEOUT='60',
                        PYTHONPATH=os.pathsep.join(
                            [PACKAGE_DIR] + [p for p in [os.environ.get('PYTHONPATH')] if p]),
                        TESSERA_BUILD_DIR=BUILD, OMP_NUM_THREADS='1')
        self.proc = None

    def argv(self, workers, servers, command, restarts=0):
        args = [sys.executable, LAUNCH, '-n', str(workers), '-s', str(servers),
                '--launcher', 'local',
                '--scheduler-binary', os.path.join(BUILD, 'scheduler', 'tessera-scheduler'),
                '--server-binary', os.path.join(BUILD, 'server', 'tessera-server')]
        if restarts:
            args += ['--restarts', str(restarts)]
        return args + list(command)

    def run(self, workers, servers, command, timeout, restarts=0):
        """(exit code, output, seconds) of a whole job."""
        start = time.monotonic()
        self.proc = subprocess.Popen(self.argv(workers, servers, command, restarts),
                                     env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            pytest.fail('launch.py did not end within %s s:\n%s' % (timeout, out))
        return self.proc.returncode, out, time.monotonic() - start

    def python(self, workers, servers, script, *args, timeout=120, restarts=0):
        return self.run(workers, servers, [sys.executable, script] + [str(a) for a in args],
                        timeout, restarts)

    def cleanup(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in marked_pids(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def job(tmp_path):
    for binary in ('scheduler/tessera-scheduler', 'server/tessera-server', 'worker/libtessera.so'):
        if not os.path.exists(os.path.join(BUILD, binary)):
            pytest.fail('%s is not built in %s (TESSERA_BUILD_DIR)' % (binary, BUILD))
    j = Job(str(tmp_path))
    yield j
    j.cleanup()
    assert marked_pids(j.mark) == [], 'processes left behind'
