"""tessera.KVStore: a worker's view of a Tessera key-value store, with MXNet's
Python KVStore names.

    import numpy as np, tessera
    with tessera.KVStore("dist_sync") as kv:         # joins the job in DMLC_*
        kv.set_optimizer("sgd", lr=0.1)
        w = np.zeros(10, np.float32)
        kv.init(0, w)                                  # rank 0's value is stored
        kv.push(0, np.ones(10, np.float32))
        kv.pull(0, out=w)                              # fills w in place

Arrays are float32 NumPy arrays or CPU torch tensors, C-contiguous; their
buffers are handed to the C API as they are (no copy), so an array that is not
float32 or not contiguous is refused (TypeError / ValueError) rather than
converted. Keys are non-negative ints below 2**64.

Thread-safety: every method may be called from several threads at once. While a
call waits for the servers the GIL is released (ctypes.CDLL), so other Python
threads run. close() waits for calls in flight on other threads and for every
operation started with *_async that was not waited for. A store still open when
the interpreter exits normally is closed then (MXNet scripts never close
theirs); after an unhandled exception it is not, so the process ends at once and
tools/launch.py stops the job.

Errors: tessera.TesseraError for everything the C API reports (its text is
tessera_last_error()'s, e.g. "INVALID_ARGUMENT: ..."; .code holds the first
word), and for any call after close(); TypeError / ValueError for arguments
that are wrong before they reach the C API.
"""
import atexit
import ctypes
import numbers
import sys
import threading

import numpy as np

from . import _capi

_U64_MAX = (1 << 64) - 1


# The C API's status codes (TesseraStatusCode in include/tessera/c_api.h: Abseil's).
STATUS_CODES = {
    'CANCELLED': 1, 'UNKNOWN': 2, 'INVALID_ARGUMENT': 3, 'DEADLINE_EXCEEDED': 4,
    'NOT_FOUND': 5, 'ALREADY_EXISTS': 6, 'PERMISSION_DENIED': 7, 'RESOURCE_EXHAUSTED': 8,
    'FAILED_PRECONDITION': 9, 'ABORTED': 10, 'OUT_OF_RANGE': 11, 'UNIMPLEMENTED': 12,
    'INTERNAL': 13, 'UNAVAILABLE': 14, 'DATA_LOSS': 15, 'UNAUTHENTICATED': 16,
}


class TesseraError(RuntimeError):
    """An error of the Tessera C API (or a call on a closed KVStore).

    str(e) is the C API's message, "NAME: text". e.code is the status code as the C
    API returns it (3 for INVALID_ARGUMENT: TesseraStatusCode in tessera/c_api.h) and
    e.name its name ("INVALID_ARGUMENT", "UNAVAILABLE", ...). The common codes raise a
    subclass, so that `except tessera.DeadlineExceededError:` catches one kind only:
    InvalidArgumentError, DeadlineExceededError, NotFoundError, AlreadyExistsError,
    PermissionDeniedError, ResourceExhaustedError, FailedPreconditionError,
    AbortedError, OutOfRangeError, UnimplementedError, InternalError,
    UnavailableError, DataLossError, CancelledError.
    """

    def __new__(cls, message='', *args, **kwargs):
        if cls is TesseraError:
            cls = _SUBCLASS.get(_name_of(message), TesseraError)
        return super().__new__(cls, message)

    def __init__(self, message=''):
        super().__init__(message)
        name = _name_of(message)
        self.name = name if name in STATUS_CODES else 'UNKNOWN'
        self.code = STATUS_CODES[self.name]


def _name_of(message):
    head = str(message).split(':', 1)[0]
    return head if head.isupper() and ' ' not in head else 'UNKNOWN'


class InvalidArgumentError(TesseraError):
    """INVALID_ARGUMENT (3): a bad argument or variable, named in the message."""


class DeadlineExceededError(TesseraError):
    """DEADLINE_EXCEEDED (4): a wait ran past its time-out (TESSERA_TIMEOUT, start-up)."""


class NotFoundError(TesseraError):
    """NOT_FOUND (5)."""


class AlreadyExistsError(TesseraError):
    """ALREADY_EXISTS (6)."""


class PermissionDeniedError(TesseraError):
    """PERMISSION_DENIED (7)."""


class ResourceExhaustedError(TesseraError):
    """RESOURCE_EXHAUSTED (8): no memory, or a limit reached."""


class FailedPreconditionError(TesseraError):
    """FAILED_PRECONDITION (9): a call in the wrong state (a closed store, a key
    not yet initialised)."""


class AbortedError(TesseraError):
    """ABORTED (10): the job ended (a node died; the message names it)."""


class OutOfRangeError(TesseraError):
    """OUT_OF_RANGE (11)."""


class UnimplementedError(TesseraError):
    """UNIMPLEMENTED (12)."""


class InternalError(TesseraError):
    """INTERNAL (13)."""


class UnavailableError(TesseraError):
    """UNAVAILABLE (14): a peer or the library cannot be reached."""


class DataLossError(TesseraError):
    """DATA_LOSS (15)."""


class CancelledError(TesseraError):
    """CANCELLED (1)."""


_SUBCLASS = {
    'INVALID_ARGUMENT': InvalidArgumentError, 'DEADLINE_EXCEEDED': DeadlineExceededError,
    'NOT_FOUND': NotFoundError, 'ALREADY_EXISTS': AlreadyExistsError,
    'PERMISSION_DENIED': PermissionDeniedError,
    'RESOURCE_EXHAUSTED': ResourceExhaustedError,
    'FAILED_PRECONDITION': FailedPreconditionError, 'ABORTED': AbortedError,
    'OUT_OF_RANGE': OutOfRangeError, 'UNIMPLEMENTED': UnimplementedError,
    'INTERNAL': InternalError, 'UNAVAILABLE': UnavailableError,
    'DATA_LOSS': DataLossError, 'CANCELLED': CancelledError,
}


def _type_name(x):
    return type(x).__name__


def _raise_last(what):
    raise TesseraError(_capi.last_error() or ('%s failed' % what))


# --------------------------------------------------------------------------------------
# Arguments


def _key(key):
    if isinstance(key, bool) or not isinstance(key, numbers.Integral):
        raise TypeError('key: expected an int (Tessera keys are uint64), got %s %r'
                        % (_type_name(key), key))
    key = int(key)
    if key < 0 or key > _U64_MAX:
        raise ValueError('key: expected 0 <= key < 2**64, got %d' % key)
    return key


def _torch_tensor_type():
    torch = sys.modules.get('torch')  # a tensor can only exist once torch is imported
    return getattr(torch, 'Tensor', None) if torch is not None else None


def _is_array(x):
    if isinstance(x, np.ndarray):
        return True
    tensor = _torch_tensor_type()
    return tensor is not None and isinstance(x, tensor)


def _buffer(x, what, writable):
    """(address, number of floats) of an array's own memory; refuses anything
    that would need a copy."""
    if isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            raise TypeError('%s: expected a float32 array, got dtype %s (convert with '
                            '.astype(numpy.float32))' % (what, x.dtype))
        if not x.flags.c_contiguous:
            raise ValueError('%s: expected a C-contiguous array, got strides %s for shape %s '
                             '(numpy.ascontiguousarray makes a copy)'
                             % (what, x.strides, x.shape))
        if writable and not x.flags.writeable:
            raise ValueError('%s: the array is read-only; pulled values need a writable '
                             'array' % what)
        return x.__array_interface__['data'][0], x.size
    tensor = _torch_tensor_type()
    if tensor is not None and isinstance(x, tensor):
        import torch
        if x.layout != torch.strided:
            raise TypeError('%s: expected a dense tensor, got layout %s' % (what, x.layout))
        if x.device.type != 'cpu':
            raise TypeError('%s: expected a CPU tensor, got one on %s (.cpu() makes a copy)'
                            % (what, x.device))
        if x.dtype != torch.float32:
            raise TypeError('%s: expected a float32 tensor, got %s (.float() makes a copy)'
                            % (what, x.dtype))
        if not x.is_contiguous():
            raise ValueError('%s: expected a contiguous tensor, got strides %s for shape %s '
                             '(.contiguous() makes a copy)'
                             % (what, tuple(x.stride()), tuple(x.shape)))
        return x.data_ptr(), x.numel()
    raise TypeError('%s: expected a float32 NumPy array or a CPU torch.Tensor, got %s'
                    % (what, _type_name(x)))


def _numpy_view(x):
    """A NumPy array sharing x's memory (x already checked by _buffer)."""
    if isinstance(x, np.ndarray):
        return x
    return x.detach().numpy()


def _pairs(keys, values, what, name):
    """MXNet's key/value forms as a list of (key, [arrays]):
    key + array, key + [arrays], [keys] + [arrays], [keys] + [[arrays], ...]."""
    if isinstance(keys, (list, tuple)):
        if not isinstance(values, (list, tuple)):
            raise TypeError('%s: a list of %d keys needs a list of %s, got %s'
                            % (what, len(keys), name, _type_name(values)))
        if len(keys) != len(values):
            raise ValueError('%s: %d keys but %d %s' % (what, len(keys), len(values), name))
        out = []
        for i, (k, v) in enumerate(zip(keys, values)):
            arrays = list(v) if isinstance(v, (list, tuple)) else [v]
            if not arrays:
                raise ValueError('%s: key %r has an empty list of %s' % (what, k, name))
            out.append((_key(k), arrays, '%s: %s %d' % (what, name, i)))
        return out
    if isinstance(values, (list, tuple)):
        if not values:
            raise ValueError('%s: an empty list of %s' % (what, name))
        odd = [v for v in values if not _is_array(v)]
        if odd:
            raise TypeError('%s: %s: expected a float32 NumPy array or a CPU torch.Tensor, or '
                            'a list of them for one key, got a list holding %s'
                            % (what, name, _type_name(odd[0])))
        return [(_key(keys), list(values), '%s: %s' % (what, name))]
    return [(_key(keys), [values], '%s: %s' % (what, name))]


def _count(what, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError('%s: expected an int, got %s %r' % (what, _type_name(value), value))
    if value < 1:
        raise ValueError('%s: expected at least 1, got %d' % (what, value))
    return int(value)


def _row_ids(row_ids, what):
    """Row ids as a C-contiguous uint64 NumPy array (a copy when they are not
    one already: ids are few next to the rows they name)."""
    tensor = _torch_tensor_type()
    if tensor is not None and isinstance(row_ids, tensor):
        row_ids = row_ids.detach().cpu().numpy()
    if isinstance(row_ids, (str, bytes)) or np.isscalar(row_ids):
        raise TypeError('%s: expected a sequence of ints, got %s %r'
                        % (what, _type_name(row_ids), row_ids))
    ids = np.asarray(row_ids)
    if ids.dtype.kind in 'fO' and isinstance(row_ids, (list, tuple)) and all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in row_ids):
        # Python ints past 2**63 (hashed feature ids): NumPy guesses float64 or
        # object; they are uint64 ids.
        if any(x < 0 for x in row_ids):
            raise ValueError('%s: row ids are >= 0, got %d' % (what, min(row_ids)))
        if any(x > _U64_MAX for x in row_ids):
            raise ValueError('%s: row ids are < 2**64, got %d' % (what, max(row_ids)))
        ids = np.array(row_ids, dtype=np.uint64)
    if ids.ndim != 1:
        raise ValueError('%s: expected a 1-D sequence of row ids, got shape %s'
                         % (what, ids.shape))
    if ids.size == 0:
        return np.zeros(0, np.uint64)
    if ids.dtype.kind not in 'iu':
        raise TypeError('%s: expected integer row ids, got dtype %s' % (what, ids.dtype))
    if ids.dtype.kind == 'i' and ids.min() < 0:
        raise ValueError('%s: row ids are >= 0, got %d' % (what, ids.min()))
    return np.ascontiguousarray(ids, dtype=np.uint64)


def _float(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError('set_optimizer: %s: expected a number, got %s %r'
                        % (name, _type_name(value), value))
    return repr(float(value))


# --------------------------------------------------------------------------------------
# Asynchronous operations


class Op:
    """An operation started by KVStore.push_async / pull_async / pushpull_async.

    wait() waits for it (the GIL released), raises TesseraError on failure and
    returns the pulled array (None for a push). The arrays it was given are
    kept alive, and must stay unchanged (pushed) or unread (pulled), until
    wait() has returned. An Op never waited for is waited for by close().
    """

    __slots__ = ('_kv', '_handle', '_keep', '_result', '_lock', '_done', '__weakref__')

    def __init__(self, kv, handle, keep, result):
        self._kv = kv
        self._handle = handle
        self._keep = keep
        self._result = result
        self._lock = threading.Lock()
        self._done = False

    @property
    def done(self):
        """True once wait() has returned (or raised)."""
        return self._done

    def wait(self):
        with self._lock:
            if self._done:
                raise TesseraError('FAILED_PRECONDITION: this operation was already waited for')
            return self._finish_locked()

    def _finish(self):
        """wait(), or nothing when another thread already waited."""
        with self._lock:
            if not self._done:
                self._finish_locked()

    def _finish_locked(self):
        try:
            self._kv._wait_handle(self._handle)
        finally:
            self._done = True
            self._kv._forget(self._handle)
            self._keep = None
        return self._result


# --------------------------------------------------------------------------------------
# The store


_open_stores = set()  # open stores stay alive until closed, at the latest at exit


@atexit.register
def _close_at_exit():
    """A script that ends without closing its store (as MXNet scripts do) leaves
    the job cleanly; after an unhandled exception (the interpreter has set
    sys.last_value) the store is left open, so the process exits at once and the
    launcher stops the job instead of this worker waiting in the closing barrier."""
    for kv in list(_open_stores):
        if kv.closed:
            continue
        if hasattr(sys, 'last_value'):
            sys.stderr.write('tessera: rank %d failed; leaving the job without closing its '
                             'KVStore\n' % kv.rank)
            continue
        try:
            kv.close()
        except TesseraError as e:
            sys.stderr.write('tessera: closing the KVStore of rank %d at exit: %s\n'
                             % (kv.rank, e))


class _Lent:
    """Frees a lent pull (tessera_pulled_free) once nothing refers to it."""

    def __init__(self, lib, pulled):
        self._lib = lib
        self.pulled = pulled

    def free(self):
        pulled, self.pulled = self.pulled, None
        if pulled:
            self._lib.tessera_pulled_free(pulled)

    def __del__(self):
        self.free()


MAX_STALENESS = 1000000  # kMaxStaleness (common/options.h)


def _check_staleness(staleness):
    """dist_ssp's bound as an int; TypeError / ValueError naming what was
    expected (the library's own message: TesseraError INVALID_ARGUMENT)."""
    if isinstance(staleness, bool) or not isinstance(staleness, numbers.Integral):
        raise TypeError('staleness: expected a whole number of steps in 0..%d, got %s %r'
                        % (MAX_STALENESS, _type_name(staleness), staleness))
    if not 0 <= int(staleness) <= MAX_STALENESS:
        raise ValueError('staleness %d: expected a whole number of steps in 0..%d'
                         % (staleness, MAX_STALENESS))
    return int(staleness)


MAX_PRIORITY = 1000000000


def _check_priority(priority):
    """A request's priority as an int (higher is more urgent); TypeError /
    ValueError naming what was expected."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError('priority: expected an integer in -%d..%d (higher is more '
                        'urgent), got %s %r'
                        % (MAX_PRIORITY, MAX_PRIORITY, _type_name(priority), priority))
    if not -MAX_PRIORITY <= int(priority) <= MAX_PRIORITY:
        raise ValueError('priority %d: expected an integer in -%d..%d (higher is more '
                         'urgent)' % (priority, MAX_PRIORITY, MAX_PRIORITY))
    return int(priority)


class KVStore:
    """Joins the Tessera job given by the DMLC_* environment as a worker.

    type: "dist_sync" (every round's pushes summed, then the optimizer applied
    once), "dist_device_sync" (dist_sync with the workers of each host
    summing their pushes there first: docs/local_groups.md), "dist_async"
    (every push applied as it arrives) or "dist_ssp"
    (bounded staleness: pushes applied as they arrive, and a pull made after
    c pushes to a key waits until every worker in the job has had c - s of
    its pushes to it applied; docs/consistency.md). `staleness`: dist_ssp's
    bound s, 0..1000000 (None: TESSERA_STALENESS's; set_staleness may give
    it later, before the first init). Raises TesseraError when the
    environment does not describe a job or the scheduler cannot be reached,
    or for a bad staleness.
    """

    def __init__(self, type='dist_sync', staleness=None):
        if not isinstance(type, str):
            raise TypeError('KVStore type: expected a str such as "dist_sync", got %s'
                            % _type_name(type))
        if staleness is not None:
            # Checked before joining: a store that joined cannot leave
            # without its workers' barrier.
            if type != 'dist_ssp':
                raise ValueError("KVStore: staleness is dist_ssp's, not %s's" % type)
            _check_staleness(staleness)
        try:
            lib = _capi.load()
        except _capi.LibraryNotFound as e:
            raise TesseraError('UNAVAILABLE: %s' % e) from None
        self._lib = lib
        self._type = type
        self._lock = threading.Condition()
        self._active = 0       # C calls in flight on any thread
        self._closing = False
        self._ops = {}         # handle -> Op not yet waited for
        self._row_lengths = {}  # row-sparse key -> row length (init_rows)
        handle = ctypes.c_void_p()
        if lib.tessera_kv_create(type.encode(), ctypes.byref(handle)) != 0:
            _raise_last('tessera_kv_create')
        self._handle = handle
        self._rank = self._get_int(lib.tessera_kv_rank)
        self._num_workers = self._get_int(lib.tessera_kv_num_workers)
        self._num_servers = self._get_int(lib.tessera_kv_num_servers)
        _open_stores.add(self)
        if staleness is not None:
            self.set_staleness(staleness)

    def _get_int(self, fn):
        out = ctypes.c_int()
        if fn(self._handle, ctypes.byref(out)) != 0:
            _raise_last(fn.__name__)
        return out.value

    # -- calls into the C API, refused once close() has begun ------------------

    def _enter(self, closing_ok=False):
        """Counts a call in flight and returns the C handle; close() waits for
        the count to fall to zero before it frees the handle."""
        with self._lock:
            if self._handle is None or (self._closing and not closing_ok):
                raise TesseraError('FAILED_PRECONDITION: the KVStore is closed')
            self._active += 1
            return self._handle

    def _exit(self):
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._lock.notify_all()

    def _call(self, name, *args, closing_ok=False):
        handle = self._enter(closing_ok)
        try:
            if getattr(self._lib, name)(handle, *args) != 0:
                _raise_last(name)
        finally:
            self._exit()

    def _start(self, name, keep, result, args):
        """Starts an asynchronous operation; it is registered before the call
        counts as finished, so close() always finds it."""
        h = ctypes.c_uint64()
        handle = self._enter()
        try:
            if getattr(self._lib, name)(handle, *args, ctypes.byref(h)) != 0:
                _raise_last(name)
            op = Op(self, h.value, keep, result)
            with self._lock:
                self._ops[h.value] = op
            return op
        finally:
            self._exit()

    def _wait_handle(self, handle):
        self._call('tessera_kv_wait', ctypes.c_uint64(handle), closing_ok=True)

    def _forget(self, handle):
        with self._lock:
            self._ops.pop(handle, None)

    # -- properties -------------------------------------------------------------

    @property
    def type(self):
        return self._type

    @property
    def rank(self):
        """This worker's rank, 0..num_workers-1."""
        return self._rank

    @property
    def num_workers(self):
        return self._num_workers

    @property
    def num_servers(self):
        return self._num_servers

    @property
    def closed(self):
        return self._handle is None

    # -- settings (before the first init) ----------------------------------------

    def set_optimizer(self, optimizer, **params):
        """Sets the optimizer the servers run, as a spec or a name and keywords:

            kv.set_optimizer("sgd lr=0.1 momentum=0.9")
            kv.set_optimizer("sgd", lr=0.1, momentum=0.9, wd=1e-4)

        Optimizers: sgd, adam, adamax, adagrad, none (server/optimizer.h). REQUIRES:
        before the first init. TesseraError for an unknown optimizer or parameter."""
        if not isinstance(optimizer, str):
            raise TypeError('set_optimizer: expected a str such as "sgd", got %s'
                            % _type_name(optimizer))
        parts = [optimizer.strip()]
        for name, value in params.items():
            parts.append('%s=%s' % (name, _float(name, value)))
        self._call('tessera_kv_set_optimizer', ' '.join(parts).encode())

    def set_staleness(self, staleness):
        """dist_ssp: the staleness bound s, a whole number of steps in
        0..1000000 (overrides TESSERA_STALENESS). A pull made after c pushes
        to a key waits until every worker in the job has had c - s of its
        pushes to the key applied. REQUIRES: before the first init.
        TypeError for a non-integer, ValueError out of range; TesseraError
        (FAILED_PRECONDITION) in another store type or after an init."""
        self._call('tessera_kv_set_staleness',
                   ctypes.c_int64(_check_staleness(staleness)))

    def set_gradient_compression(self, compression_params):
        """MXNet's spelling: {"type": "2bit", "threshold": 0.5} (threshold
        defaults to 0.5) or {"type": "none"}. REQUIRES: before the first init."""
        if not isinstance(compression_params, dict):
            raise TypeError('set_gradient_compression: expected a dict such as '
                            '{"type": "2bit", "threshold": 0.5}, got %s'
                            % _type_name(compression_params))
        unknown = sorted(set(compression_params) - {'type', 'threshold'})
        if unknown:
            raise ValueError('set_gradient_compression: unknown field(s) %s; expected type '
                             'and threshold' % ', '.join(map(repr, unknown)))
        if 'type' not in compression_params:
            raise ValueError('set_gradient_compression: the dict needs a "type" ("2bit" or '
                             '"none")')
        kind = compression_params['type']
        if not isinstance(kind, str):
            raise TypeError('set_gradient_compression: type: expected a str, got %s'
                            % _type_name(kind))
        threshold = compression_params.get('threshold', 0.5)
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise TypeError('set_gradient_compression: threshold: expected a number, got %s %r'
                            % (_type_name(threshold), threshold))
        self._call('tessera_kv_set_gradient_compression', kind.encode(),
                   ctypes.c_float(float(threshold)))

    def set_pull_compression(self, compression):
        """Pull compression: "2bit" or "none" (the default). With "2bit" a pull
        brings only the change of the weights since this worker's last pull,
        2-bit coded against a threshold the server chooses per change (the mean
        absolute change); what is not sent yet stays on the server for later
        pulls, and this worker keeps a copy of each key (one copy of the
        weights) that the changes are added to. The first pull of a key, and a
        pull after a restart, brings the weights whole. A pull therefore returns
        the weights as compression has brought them so far, not the servers'
        exact weights; pushpull replies stay float32 and row-sparse pulls bring
        bfloat16 rows (rounded to nearest even; docs/compression.md). REQUIRES: before the first init. TesseraError
        (INVALID_ARGUMENT) for another type, (FAILED_PRECONDITION) after an
        init."""
        if not isinstance(compression, str):
            raise TypeError('set_pull_compression: expected a str, "2bit" or "none", got %s'
                            % _type_name(compression))
        self._call('tessera_kv_set_pull_compression', compression.encode())

    # -- dense keys ---------------------------------------------------------------

    def init(self, key, value):
        """Declares key(s) with their arrays' lengths; every worker calls it for
        the same keys in the same order and rank 0's values are stored. Returns
        after a barrier of the workers."""
        pairs = _pairs(key, value, 'init', 'value')
        checked = []
        for k, arrays, label in pairs:
            if len(arrays) != 1:
                raise ValueError('init: key %d takes one array, got a list of %d'
                                 % (k, len(arrays)))
            checked.append((k, _buffer(arrays[0], label, writable=False)))
        for k, (addr, n) in checked:
            self._call('tessera_kv_init', k, addr, n)

    def set_priority(self, key, priority):
        """How urgent key(s)' pushes and pulls are from now on, higher first
        (docs/priority.md): an integer in -1000000000..1000000000. By default a
        key's is minus the number of keys initialised before it, so the first
        layer's slices go first. TypeError / ValueError for a bad priority;
        TesseraError (NOT_FOUND) for a key not initialised."""
        p = _check_priority(priority)
        keys = key if isinstance(key, (list, tuple)) else [key]
        for k in keys:
            self._call('tessera_kv_set_priority', _key(k), ctypes.c_int64(p))

    def priority(self, key):
        """The key's priority (set_priority)."""
        out = ctypes.c_int64()
        self._call('tessera_kv_priority', _key(key), ctypes.byref(out))
        return out.value

    def _prioritise(self, keys, priority):
        # MXNet's `priority` argument, after the call's other arguments were
        # checked: the keys' priority from now on; None keeps theirs. A key not
        # initialised is left to the call itself to name.
        if priority is None:
            return
        p = _check_priority(priority)
        handle = self._enter()
        try:
            for k in keys:
                code = self._lib.tessera_kv_set_priority(handle, _key(k), ctypes.c_int64(p))
                if code not in (0, STATUS_CODES['NOT_FOUND']):
                    _raise_last('tessera_kv_set_priority')
        finally:
            self._exit()

    def push(self, key, value, priority=None):
        """Pushes gradient(s). A list of arrays for one key is summed first (MXNet's
        one-per-device form). The pushes of several keys are in flight at once;
        returns when all are done (dist_sync: their rounds applied). `priority`
        (MXNet's): when given, becomes the keys' priority from this call on
        (set_priority; MXNet's is per call: pass the same one every time, e.g.
        priority=-index, or None to keep the default order). It is set once the
        call's other arguments are checked."""
        pairs = _pairs(key, value, 'push', 'value')
        grads = [(k, self._summed(arrays, label)) for k, arrays, label in pairs]
        self._prioritise([k for k, _, _ in pairs], priority)
        if len(grads) == 1:
            k, (addr, n, _) = grads[0]
            self._call('tessera_kv_push', k, addr, n)
            return
        self._run([('tessera_kv_push_async', keep, None, (k, addr, n))
                   for k, (addr, n, keep) in grads])

    def pull(self, key, out=None, priority=None, ignore_sparse=True):
        """Pulls key(s) into `out` in place and returns `out`. A list of arrays
        for one key receives the value in each. The pulls of several keys are in
        flight at once. `priority`: as push's."""
        if out is None:
            raise TypeError('pull: out= is required (the array(s) the values go into)')
        pairs = _pairs(key, out, 'pull', 'out')
        outs = [(k, self._outputs(arrays, label)) for k, arrays, label in pairs]
        self._prioritise([k for k, _, _ in pairs], priority)
        if len(outs) == 1:
            k, (addr, n, _) = outs[0]
            self._call('tessera_kv_pull', k, addr, n)
        else:
            self._run([('tessera_kv_pull_async', keep, None, (k, addr, n))
                       for k, (addr, n, keep) in outs])
        self._broadcast(pairs)
        return out

    def pull_view(self, key):
        """Pulls one key without copying it into an array of yours, and returns
        a read-only 1-D float32 array. When the key arrived in one part (a key
        of at most TESSERA_CHUNK_BYTES that lives on one server) the array lies
        on the received frame itself, which stays alive as long as the array
        (or a view of it) does: no copy at all. A key in several parts is
        gathered into one new array (one copy, as pull makes)."""
        k = _key(key)
        lib = self._lib
        pulled = ctypes.c_void_p()
        self._call('tessera_kv_pull_view', k, ctypes.byref(pulled))
        lent = _Lent(lib, pulled.value)
        size = lib.tessera_pulled_size(lent.pulled)
        parts = lib.tessera_pulled_num_parts(lent.pulled)
        offset, n = ctypes.c_size_t(), ctypes.c_size_t()
        if parts == 1:
            addr = lib.tessera_pulled_part(lent.pulled, 0, ctypes.byref(offset),
                                           ctypes.byref(n))
            frame = (ctypes.c_float * n.value).from_address(addr)
            frame._lent = lent  # the frame is freed with the last array over it
            out = np.frombuffer(frame, np.float32)
        else:
            out = np.empty(size, np.float32)
            for i in range(parts):
                addr = lib.tessera_pulled_part(lent.pulled, i, ctypes.byref(offset),
                                               ctypes.byref(n))
                part = np.frombuffer((ctypes.c_float * n.value).from_address(addr),
                                     np.float32)
                out[offset.value:offset.value + n.value] = part
            lent.free()
        out.flags.writeable = False
        return out

    def pushpull(self, key, value, out=None, priority=None):
        """Pushes value(s) and pulls the result into `out` (into `value` when out
        is None, as MXNet does); returns what was filled. `priority`: as
        push's."""
        if out is None:
            out = value
        pushes = _pairs(key, value, 'pushpull', 'value')
        pulls = _pairs(key, out, 'pushpull', 'out')
        if [k for k, _, _ in pushes] != [k for k, _, _ in pulls]:
            raise ValueError('pushpull: value and out must name the same keys')
        calls = []
        for (k, arrays, label), (_, outs, out_label) in zip(pushes, pulls):
            g_addr, g_n, g_keep = self._summed(arrays, label)
            o_addr, o_n, o_keep = self._outputs(outs, out_label)
            if g_n != o_n:
                raise ValueError('pushpull: key %d: value has %d elements but out has %d'
                                 % (k, g_n, o_n))
            calls.append((k, g_addr, o_addr, g_n, (g_keep, o_keep)))
        self._prioritise([k for k, _, _ in pushes], priority)
        if len(calls) == 1:
            self._call('tessera_kv_pushpull', *calls[0][:4])
        else:
            self._run([('tessera_kv_pushpull_async', keep, None, (k, g, o, n))
                       for k, g, o, n, keep in calls])
        self._broadcast(pulls)
        return out

    def push_async(self, key, value):
        """Starts a push of one array and returns its Op at once; the array must
        stay unchanged until op.wait() has returned."""
        k = _key(key)
        addr, n = _buffer(value, 'push_async: value', writable=False)
        return self._start('tessera_kv_push_async', value, None, (k, addr, n))

    def pull_async(self, key, out):
        """Starts a pull into `out` and returns its Op at once; op.wait() writes
        the values into out and returns it. Leave out unread until then."""
        k = _key(key)
        addr, n = _buffer(out, 'pull_async: out', writable=True)
        return self._start('tessera_kv_pull_async', out, out, (k, addr, n))

    def pushpull_async(self, key, value, out):
        """Starts a push of value and a pull of the result into out."""
        k = _key(key)
        g_addr, g_n = _buffer(value, 'pushpull_async: value', writable=False)
        o_addr, o_n = _buffer(out, 'pushpull_async: out', writable=True)
        if g_n != o_n:
            raise ValueError('pushpull_async: value has %d elements but out has %d' % (g_n, o_n))
        return self._start('tessera_kv_pushpull_async', (value, out), out,
                           (k, g_addr, o_addr, g_n))

    # -- row-sparse keys -----------------------------------------------------------

    def init_rows(self, key, value=None, num_rows=None, row_length=None):
        """Declares a row-sparse key: a num_rows x row_length float32 matrix whose
        pushes and pulls name some of its rows (MXNet's row_sparse). `value` is a
        2-D array (rank 0's is stored), or None with num_rows= and row_length= for
        zeros (then no values cross the wire: a 1 GB embedding starts at once).
        Every worker calls it for the same keys in the same order. A matrix of at
        least TESSERA_BIGARRAY_BOUND values is split over the servers by rows."""
        k = _key(key)
        if value is None:
            if num_rows is None or row_length is None:
                raise TypeError('init_rows: without a value, num_rows= and row_length= '
                                'are required (the zero matrix\'s shape)')
            rows = _count('init_rows: num_rows', num_rows)
            length = _count('init_rows: row_length', row_length)
            addr = None
        else:
            shape = tuple(value.shape) if _is_array(value) else None
            addr, _ = _buffer(value, 'init_rows: value', writable=False)
            if len(shape) != 2:
                raise ValueError('init_rows: value: expected a 2-D array (num_rows, '
                                 'row_length), got shape %s' % (shape,))
            rows, length = shape
            for name, given, actual in (('num_rows', num_rows, rows),
                                        ('row_length', row_length, length)):
                if given is not None and given != actual:
                    raise ValueError('init_rows: %s=%r but value has shape %s'
                                     % (name, given, shape))
            if rows < 1 or length < 1:
                raise ValueError('init_rows: value: expected at least one row of at least '
                                 'one value, got shape %s' % (shape,))
        self._call('tessera_kv_init_rows', k, addr, rows, length)
        with self._lock:
            self._row_lengths[k] = length

    def init_hashed(self, key, dim, init='zeros', low=None, high=None, mean=None, std=None,
                    seed=0, admit_after=1, expire_after=0, capacity=0):
        """Declares a hashed row key: rows of `dim` float32 named by any uint64 id
        (feature ids, hashed crosses), spread over the servers by a hash of the id;
        push_rows and pull_rows take any ids. A server creates an id's row when a
        push names it, from `init` ('zeros', 'uniform' with low/high, 'normal' with
        mean/std; seeded by `seed`, the same row on every server and run); a pull
        of an id without a row reads the row it would start as. admit_after=N: an id
        gets a row once N pushes named it (counted in a compact sketch; before that
        its gradients are dropped); expire_after=R: rows not pushed for R rounds are
        evicted (0: never); capacity=C: a server holds at most C rows of the key
        (the least recently pushed are evicted first; 0: no bound). Every worker
        calls it for the same keys in the same order (docs/embeddings.md)."""
        k = _key(key)
        length = _count('init_hashed: dim', dim)
        if init not in ('zeros', 'uniform', 'normal'):
            raise ValueError("init_hashed: init: expected 'zeros', 'uniform' or 'normal', "
                             "got %r" % (init,))
        parts = ['init=%s' % init]
        for name, value in (('low', low), ('high', high), ('mean', mean), ('std', std)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise TypeError('init_hashed: %s: expected a number, got %s %r'
                                    % (name, _type_name(value), value))
                parts.append('%s=%r' % (name, float(value)))
        for name, value, least in (('seed', seed, 0), ('admit_after', admit_after, 1),
                                   ('expire_after', expire_after, 0),
                                   ('capacity', capacity, 0)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError('init_hashed: %s: expected an int, got %s %r'
                                % (name, _type_name(value), value))
            if value < least:
                raise ValueError('init_hashed: %s: expected at least %d, got %d'
                                 % (name, least, value))
            parts.append('%s=%d' % (name, value))
        self._call('tessera_kv_init_hashed', k, length, ' '.join(parts).encode())
        with self._lock:
            self._row_lengths[k] = length

    def push_rows(self, key, row_ids, rows):
        """Pushes the gradients of some rows: rows[i] is row row_ids[i]'s (shape
        (len(row_ids), row_length), or any C-contiguous float32 array of that many
        values). Ids may repeat (summed). In dist_sync every worker pushes once a
        round, an empty set of rows too (row_ids=[], rows=None); the optimizer then
        updates only the rows present in the round (the others keep their weights
        and optimizer state); with no optimizer the rows present become the round's
        sum."""
        k = _key(key)
        length = self._row_length(k, 'push_rows')
        ids = _row_ids(row_ids, 'push_rows: row_ids')
        if rows is None and len(ids) == 0:
            addr, n = None, 0
        else:
            addr, n = _buffer(rows, 'push_rows: rows', writable=False)
        if n != len(ids) * length:
            raise ValueError('push_rows: key %d: %d row id(s) of %d values need %d values '
                             'in rows, got %d' % (k, len(ids), length, len(ids) * length, n))
        self._call('tessera_kv_push_rows', k, ids.ctypes.data, len(ids), addr)

    def pull_rows(self, key, row_ids, out=None):
        """Pulls the named rows, in that order (ids may repeat; an empty list is
        allowed), into `out` in place and returns it; with out=None into a new
        (len(row_ids), row_length) float32 array."""
        k = _key(key)
        length = self._row_length(k, 'pull_rows')
        ids = _row_ids(row_ids, 'pull_rows: row_ids')
        if out is None:
            out = np.empty((len(ids), length), np.float32)
        addr, n = _buffer(out, 'pull_rows: out', writable=True)
        if n != len(ids) * length:
            raise ValueError('pull_rows: key %d: %d row id(s) of %d values need an out of '
                             '%d values, got %d' % (k, len(ids), length, len(ids) * length, n))
        self._call('tessera_kv_pull_rows', k, ids.ctypes.data, len(ids), addr)
        return out

    def row_sparse_pull(self, key, out=None, priority=None, row_ids=None):
        """MXNet's name: pull_rows(key, row_ids, out). `priority`: as push's."""
        if row_ids is None:
            raise TypeError('row_sparse_pull: row_ids= is required (the rows to pull)')
        self._prioritise([key], priority)
        return self.pull_rows(key, row_ids, out=out)

    def _row_length(self, key, what):
        with self._lock:
            length = self._row_lengths.get(key)
        if length is None:
            # The C API cannot check a buffer's size: without the row length the
            # call would read or write past the array.
            raise TesseraError('INVALID_ARGUMENT: %s: key %d is not a row-sparse key of '
                               'this KVStore (declare it with init_rows first)' % (what, key))
        return length

    # -- job ------------------------------------------------------------------------

    def barrier(self):
        """Waits until every worker has called barrier()."""
        self._call('tessera_kv_barrier')

    _barrier = barrier  # MXNet's name

    def resume_round(self):
        """After the inits: in a worker restarted into a running job
        (tools/launch.py --restarts), the number of pushes of every key the
        servers took from its earlier life, i.e. the step to resume at; 0 in a
        first life."""
        out = ctypes.c_uint64()
        self._call('tessera_kv_resume_round', ctypes.byref(out))
        return out.value

    def close(self):
        """Waits for operations not yet waited for and for calls in flight, then
        a barrier of the workers, then leaves the job. A second close() does
        nothing; any other call after close() raises TesseraError."""
        self._end('tessera_kv_close')

    def leave(self):
        """Elastic jobs (TESSERA_ELASTIC, launch.py --elastic): waits for operations
        not yet waited for, then leaves the job before its end, without the workers'
        barrier (e.g. on SIGTERM, between steps). The scheduler takes this worker out
        of the job and the servers complete every later round without it. A second
        leave() or close() does nothing; TesseraError (FailedPrecondition) in a job
        that is not elastic."""
        self._end('tessera_kv_leave')

    def _end(self, how):
        with self._lock:
            if self._handle is None or self._closing:
                return
            self._closing = True  # from here on only waits for started operations
            while self._active > 0:
                self._lock.wait()
            pending = list(self._ops.values())
        first_error = None
        for op in pending:
            try:
                op._finish()
            except TesseraError as e:
                first_error = first_error or e
        with self._lock:
            while self._active > 0:  # another thread's wait of one of them
                self._lock.wait()
            handle, self._handle = self._handle, None
        _open_stores.discard(self)
        if getattr(self._lib, how)(handle) != 0:
            _raise_last(how)
        if first_error is not None:
            raise first_error

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        # On an exception the job is failing: leaving without the closing barrier
        # lets the process exit at once and the launcher stop the job.
        return False

    def __repr__(self):
        if self.closed:
            return '<tessera.KVStore %s closed>' % self._type
        return '<tessera.KVStore %s rank %d of %d workers, %d servers>' % (
            self._type, self._rank, self._num_workers, self._num_servers)

    # -- helpers --------------------------------------------------------------------

    def _run(self, starts):
        """Starts every (C function, keep, result, args) operation, then waits for
        all of them; raises the first error once every started one is done."""
        ops, first_error = [], None
        try:
            for name, keep, result, args in starts:
                ops.append(self._start(name, keep, result, args))
        except TesseraError as e:
            first_error = e
        for op in ops:
            try:
                op.wait()
            except TesseraError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    @staticmethod
    def _summed(arrays, label):
        """(address, n, array to keep) of one key's gradient: the array itself, or
        the sum of a list of them (MXNet's one-per-device form)."""
        checked = [_buffer(a, label if len(arrays) == 1 else '%s[%d]' % (label, i),
                           writable=False) for i, a in enumerate(arrays)]
        if len(arrays) == 1:
            return checked[0] + (arrays[0],)
        if any(n != checked[0][1] for _, n in checked):
            raise ValueError('%s: the arrays of one key differ in size: %s'
                             % (label, [n for _, n in checked]))
        total = _numpy_view(arrays[0]).reshape(-1).copy()
        for a in arrays[1:]:
            total += _numpy_view(a).reshape(-1)
        return total.__array_interface__['data'][0], total.size, total

    @staticmethod
    def _outputs(arrays, label):
        """(address, n, array) of the first output of one key; every other output
        checked now (writable, same size), filled by _broadcast."""
        checked = [_buffer(a, label if len(arrays) == 1 else '%s[%d]' % (label, i),
                           writable=True) for i, a in enumerate(arrays)]
        if any(n != checked[0][1] for _, n in checked):
            raise ValueError('%s: the arrays of one key differ in size: %s'
                             % (label, [n for _, n in checked]))
        return checked[0] + (arrays[0],)

    @staticmethod
    def _broadcast(pairs):
        for _, arrays, _ in pairs:
            if len(arrays) > 1:
                first = _numpy_view(arrays[0]).reshape(-1)
                for a in arrays[1:]:
                    np.copyto(_numpy_view(a).reshape(-1), first)


def create(name='dist_sync'):
    """MXNet's spelling: tessera.create("dist_sync") is tessera.KVStore("dist_sync")."""
    return KVStore(name)
