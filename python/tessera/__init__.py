"""Tessera from Python: NumPy arrays and PyTorch models through a Tessera job.

    import numpy as np, tessera
    with tessera.KVStore("dist_sync") as kv:   # the job comes from DMLC_* (tools/launch.py)
        kv.set_optimizer("sgd", lr=0.1)
        kv.init(0, w)
        kv.push(0, grad)
        kv.pull(0, out=w)

tessera.torch (imported on its own: `import tessera.torch`) trains a
torch.nn.Module data-parallel through the servers. See examples/ and
docs/python.md.
"""
from .kvstore import (STATUS_CODES, AbortedError, AlreadyExistsError, CancelledError,
                      DataLossError, DeadlineExceededError, FailedPreconditionError,
                      InternalError, InvalidArgumentError, KVStore, NotFoundError, Op,
                      OutOfRangeError, PermissionDeniedError, ResourceExhaustedError,
                      TesseraError, UnavailableError, UnimplementedError, create)


def _source_tree_version():
    """The VERSION file of the source tree this package is imported from."""
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'VERSION')
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return '0+unknown'


try:
    from ._version import __version__  # written by cmake --install or pip's build
except ImportError:  # imported from the source tree (python/)
    __version__ = _source_tree_version()

__all__ = ['KVStore', 'Op', 'TesseraError', 'create', 'library_path', 'library_version',
           'STATUS_CODES', 'AbortedError', 'AlreadyExistsError', 'CancelledError',
           'DataLossError', 'DeadlineExceededError', 'FailedPreconditionError',
           'InternalError', 'InvalidArgumentError', 'NotFoundError', 'OutOfRangeError',
           'PermissionDeniedError', 'ResourceExhaustedError', 'UnavailableError',
           'UnimplementedError']


def library_path():
    """The path libtessera was loaded from, or None before the first KVStore."""
    from . import _capi
    return _capi.path()


def library_version():
    """The version of the libtessera this package loads (tessera_version());
    loads it. Raises TesseraError when it cannot be loaded."""
    from . import _capi
    try:
        lib = _capi.load()
    except _capi.LibraryNotFound as e:
        raise TesseraError('UNAVAILABLE: %s' % e) from None
    return lib.tessera_version().decode()
