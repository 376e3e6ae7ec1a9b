"""Loads libtessera (the C API, include/tessera/c_api.h) with ctypes.

Why ctypes and not an extension module: the C API already is the stable,
language-neutral surface of the client, so ctypes needs no compile step, no
Python headers (python3-dev) and no build per Python version; the same files
work from the source tree and after `cmake --install`. Every call goes through
ctypes.CDLL, which releases the GIL for the duration of the foreign call, so a
blocking push, pull or barrier lets the program's other Python threads run.
A call costs about a microsecond of ctypes overhead, against tens of
microseconds for the shortest round trip to a server.

Where the library is looked for, first found wins:
  1. $TESSERA_LIBRARY (a path to libtessera.so; only this one when set);
  2. an installed package's library: the lib directory recorded in
     tessera/_install.py by `cmake --install` (relative to the package) or by
     `pip install ./python` (where pkg-config found libtessera at build time);
  3. a build tree: $TESSERA_BUILD_DIR/worker, then <source>/build/worker when
     the package is imported from <source>/python;
  4. the system's search path (ctypes.util.find_library('tessera')).
"""
import ctypes
import ctypes.util
import os
import threading

_LIB_NAMES = ('libtessera.so.0', 'libtessera.so')

_lock = threading.Lock()
_lib = None
_path = None


class LibraryNotFound(OSError):
    pass


def _candidates():
    """(path, why) pairs in the order they are tried."""
    env = os.environ.get('TESSERA_LIBRARY')
    if env:
        return [(env, '$TESSERA_LIBRARY')]
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    try:
        from . import _install  # written by `cmake --install`
    except ImportError:
        _install = None
    if _install is not None:
        libdir = os.path.normpath(os.path.join(here, _install.LIBDIR_FROM_PACKAGE))
        out += [(os.path.join(libdir, n), 'the install prefix') for n in _LIB_NAMES]
    build = os.environ.get('TESSERA_BUILD_DIR')
    if build:
        out.append((os.path.join(build, 'worker', 'libtessera.so'), '$TESSERA_BUILD_DIR'))
    source_build = os.path.normpath(os.path.join(here, '..', '..', 'build', 'worker',
                                                 'libtessera.so'))
    out.append((source_build, 'the source tree\'s build folder'))
    found = ctypes.util.find_library('tessera')
    if found:
        out.append((found, 'the system library path'))
    return out


def _declare(lib):
    c_int_p = ctypes.POINTER(ctypes.c_int)
    u64 = ctypes.c_uint64
    u64_p = ctypes.POINTER(ctypes.c_uint64)
    vp = ctypes.c_void_p  # float buffers travel as plain addresses
    kv = ctypes.c_void_p
    size = ctypes.c_size_t
    sigs = {
        'tessera_kv_create': [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)],
        'tessera_kv_rank': [kv, c_int_p],
        'tessera_kv_num_workers': [kv, c_int_p],
        'tessera_kv_num_servers': [kv, c_int_p],
        'tessera_kv_init': [kv, u64, vp, size],
        'tessera_kv_push': [kv, u64, vp, size],
        'tessera_kv_pull': [kv, u64, vp, size],
        'tessera_kv_pushpull': [kv, u64, vp, vp, size],
        'tessera_kv_push_async': [kv, u64, vp, size, u64_p],
        'tessera_kv_pull_async': [kv, u64, vp, size, u64_p],
        'tessera_kv_pushpull_async': [kv, u64, vp, vp, size, u64_p],
        'tessera_kv_wait': [kv, u64],
        'tessera_kv_barrier': [kv],
        'tessera_kv_set_optimizer': [kv, ctypes.c_char_p],
        'tessera_kv_set_gradient_compression': [kv, ctypes.c_char_p, ctypes.c_float],
        'tessera_kv_set_pull_compression': [kv, ctypes.c_char_p],
        'tessera_kv_set_staleness': [kv, ctypes.c_int64],
        'tessera_kv_set_priority': [kv, u64, ctypes.c_int64],
        'tessera_kv_priority': [kv, u64, ctypes.POINTER(ctypes.c_int64)],
        'tessera_kv_close': [kv],
        'tessera_kv_leave': [kv],
        'tessera_kv_resume_round': [kv, u64_p],
        # Row-sparse keys: ids travel as the address of a uint64 array.
        'tessera_kv_init_rows': [kv, u64, vp, size, size],
        'tessera_kv_init_hashed': [kv, u64, size, ctypes.c_char_p],
        'tessera_kv_push_rows': [kv, u64, vp, size, vp],
        'tessera_kv_pull_rows': [kv, u64, vp, size, vp],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    # A pull that lends the received frames (see KVStore.pull_view).
    lib.tessera_kv_pull_view.argtypes = [kv, u64, ctypes.POINTER(ctypes.c_void_p)]
    lib.tessera_kv_pull_view.restype = ctypes.c_int
    pulled = ctypes.c_void_p
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.tessera_pulled_size.argtypes = [pulled]
    lib.tessera_pulled_size.restype = size
    lib.tessera_pulled_num_parts.argtypes = [pulled]
    lib.tessera_pulled_num_parts.restype = size
    lib.tessera_pulled_part.argtypes = [pulled, size, size_p, size_p]
    lib.tessera_pulled_part.restype = ctypes.c_void_p
    lib.tessera_pulled_free.argtypes = [pulled]
    lib.tessera_pulled_free.restype = None
    lib.tessera_last_error.argtypes = []
    lib.tessera_last_error.restype = ctypes.c_char_p
    lib.tessera_version.argtypes = []
    lib.tessera_version.restype = ctypes.c_char_p


def load():
    """The loaded library (once per process). Raises LibraryNotFound naming
    every place it looked."""
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path, why in _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append('%s (%s): no such file' % (path, why))
                continue
            try:
                lib = ctypes.CDLL(path)
                _declare(lib)
            except (OSError, AttributeError) as e:
                tried.append('%s (%s): %s' % (path, why, e))
                continue
            _lib, _path = lib, path
            return lib
        raise LibraryNotFound(
            'cannot load libtessera: set TESSERA_LIBRARY to its path, install Tessera '
            '(cmake --install), or build it (cmake --build build). Tried: '
            + ('; '.join(tried) if tried else 'nothing'))


def path():
    """The path libtessera was loaded from, or None before the first load."""
    return _path


def last_error():
    return load().tessera_last_error().decode('utf-8', 'replace')
