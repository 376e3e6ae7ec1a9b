"""Tessera from Python: NumPy arrays and PyTorch models through a Tessera job.

    import numpy as np, tessera
    with tessera.KVStore("dist_sync") as kv:   # the job comes from DMLC_* (tools/launch.py)
        kv.set_optimizer("sgd", lr=0.1)
        kv.init(0, w)
        kv.push(0, grad)
        kv.pull(0, out=w)

tessera.torch (imported on its own: `import tessera.torch`) trains a
torch.nn.Module data-parallel through the servers. See examples/ and
python/README.md.
"""
from .kvstore import KVStore, Op, TesseraError, create

__version__ = '0.1.0'
__all__ = ['KVStore', 'Op', 'TesseraError', 'create', 'library_path']


def library_path():
    """The path libtessera was loaded from, or None before the first KVStore."""
    from . import _capi
    return _capi.path()
