"""The build of the tessera package; its metadata is in pyproject.toml.

Two files are written into the built package, from the templates beside this
one (python/CMakeLists.txt writes the same two for `cmake --install`):
  tessera/_version.py  __version__, from the VERSION file at the top of the
                       source tree (the one place the version is written);
  tessera/_install.py  the directory of the installed libtessera, as
                       `pkg-config --variable=libdir tessera` gives it (so
                       PKG_CONFIG_PATH chooses an install prefix, as it does
                       for a C program). Without pkg-config or an installed
                       tessera.pc it is not written, and the package looks for
                       the library when imported ($TESSERA_LIBRARY, then the
                       system's search path; see tessera/_capi.py).
"""
import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_NAMES = ('libtessera.so.0', 'libtessera.so')


def read_version():
    path = os.path.join(HERE, '..', 'VERSION')
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise SystemExit('tessera: cannot read the version from %s (%s); build the package '
                         'from a Tessera source tree (pip install ./python)' % (path, e))


def installed_libdir():
    """The directory of the installed libtessera, or None."""
    try:
        r = subprocess.run(['pkg-config', '--variable=libdir', 'tessera'],
                           capture_output=True, text=True, check=False)
    except OSError:
        return None
    libdir = r.stdout.strip()
    if r.returncode != 0 or not libdir:
        return None
    libdir = os.path.realpath(libdir)
    if not any(os.path.exists(os.path.join(libdir, n)) for n in LIB_NAMES):
        return None
    return libdir


def write_template(template, target, name, value):
    with open(os.path.join(HERE, template)) as f:
        text = f.read().replace('@%s@' % name, value)
    with open(target, 'w') as f:
        f.write(text)


class BuildPy(build_py):
    def run(self):
        super().run()
        package = os.path.join(self.build_lib, 'tessera')
        write_template('_version.py.in', os.path.join(package, '_version.py'),
                       'PROJECT_VERSION', VERSION)
        libdir = installed_libdir()
        install_py = os.path.join(package, '_install.py')
        if os.path.exists(install_py):  # from an earlier build in the same folder
            os.remove(install_py)
        if libdir is None:
            sys.stderr.write('tessera: pkg-config finds no installed libtessera (tessera.pc; '
                             'set PKG_CONFIG_PATH to <prefix>/lib/pkgconfig); the package will '
                             'look for it when imported: $TESSERA_LIBRARY, then the system '
                             'library path\n')
            return
        write_template('_install.py.in', install_py, 'TESSERA_LIBDIR_FROM_PACKAGE',
                       libdir.replace('\\', '\\\\').replace("'", "\\'"))


VERSION = read_version()
setup(version=VERSION, cmdclass={'build_py': BuildPy})
