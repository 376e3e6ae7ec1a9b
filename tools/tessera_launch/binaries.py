"""Finding the daemons (tessera-scheduler, tessera-server) and checking the
worker command.

    fallback = own_build_dirs(os.environ, script='/opt/tessera/bin/tessera-launch')
    find_binary('tessera-server', '--server-binary', None, ['python3', 'train.py'],
                os.environ['PATH'], fallback)     # an absolute path

Errors: UsageError naming where it looked and the flag that would help.
"""

import os
import shutil

from .options import UsageError

# The CMake target that builds every program a job needs (the daemons, the worker
# and tessera-keygen); errors about a missing program name it.
RUNTIME_TARGET = 'tessera-runtime'
BUILD_HINT = 'build them with: cmake --build build --target %s' % RUNTIME_TARGET

# The launch.py of the source tree this package sits in (tools/launch.py):
# what own_build_dirs assumes when the entry point does not say which script ran.
SOURCE_TREE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  'launch.py')


def _is_executable(path):
    return os.path.isfile(path) and os.access(path, os.X_OK)


def own_build_dirs(environ, script=SOURCE_TREE_SCRIPT):
    """Where daemons are looked for last, for worker commands such as `python3
    train.py` that say nothing about a build: $TESSERA_BUILD_DIR, the folder of
    `script` (the launch.py that runs: installed as bin/tessera-launch beside
    bin/tessera-scheduler), and the build folder of the checkout it is in
    (tools/../build)."""
    here = os.path.dirname(os.path.abspath(script))
    dirs = []
    if environ.get('TESSERA_BUILD_DIR'):
        dirs.append(environ['TESSERA_BUILD_DIR'])
    dirs += [here, os.path.join(os.path.dirname(here), 'build')]
    out = []
    for d in dirs:
        out += [d, os.path.join(d, 'scheduler'), os.path.join(d, 'server')]
    return out


def find_binary(name, flag, explicit, worker_command, path_env, fallback_dirs=()):
    """Finds a daemon binary: the flag, next to the worker command, PATH, then
    `fallback_dirs` (own_build_dirs in a real run).

    Returns an absolute path. Raises UsageError naming where it looked.
    """
    if explicit:
        if not _is_executable(explicit):
            raise UsageError('%s %s: not an executable file' % (flag, explicit))
        return os.path.abspath(explicit)
    looked = []
    if worker_command and '/' in worker_command[0]:
        # The build puts binaries in <build>/scheduler, <build>/server and the worker
        # somewhere below <build> (worker/, tests/core/, ...): look up to 3 levels up.
        here = os.path.dirname(os.path.abspath(worker_command[0]))
        candidates = []
        anc = here
        for _ in range(4):
            candidates += [anc, os.path.join(anc, 'scheduler'), os.path.join(anc, 'server')]
            anc = os.path.dirname(anc)
        for d in candidates:
            d = os.path.normpath(d)
            if d in looked:
                continue
            looked.append(d)
            if _is_executable(os.path.join(d, name)):
                return os.path.join(d, name)
    found = shutil.which(name, path=path_env)
    if found:
        return os.path.abspath(found)
    for d in fallback_dirs:
        if _is_executable(os.path.join(d, name)):
            return os.path.abspath(os.path.join(d, name))
    where = 'next to the worker command (%s) or ' % ', '.join(looked) if looked else ''
    last = ' and in %s' % ', '.join(fallback_dirs) if fallback_dirs else ''
    raise UsageError('cannot find %s: looked %son PATH%s; %s, or pass %s PATH'
                     % (name, where, last, BUILD_HINT, flag))


def check_command(command, path_env):
    """Checks that the worker command can be run here (local and mpi launchers)."""
    prog = command[0]
    if '/' in prog:
        if not _is_executable(prog):
            raise UsageError('COMMAND %s: not an executable file' % prog)
    elif not shutil.which(prog, path=path_env):
        raise UsageError('COMMAND %s: not found on PATH' % prog)
