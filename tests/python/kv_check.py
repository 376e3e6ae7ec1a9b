"""A Python worker that checks the store's semantics through the tessera package
from inside a real job (started by tools/launch.py from the tests beside it).
Exits 0 and prints "<mode> ok: rank R of N" when every check passed; an
exception (non-zero exit) otherwise.

    kv_check.py nightly     MXNet's nightly dist_sync check (sgd lr=-2), 7 rounds
    kv_check.py compress    2-bit pushes 0,.4,.1,.2,.3,.5 pull 0,0,n,n,2n,3n
    kv_check.py pull_compress
                            2-bit pulls on even ranks (set_pull_compression), exact
                            float32 pulls on odd ones, both against the same key
    kv_check.py forms       MXNet's list forms, pushpull without out, async ops,
                            all-reduce without an optimizer, torch tensors
    kv_check.py errors      every bad argument fails clearly and changes nothing
    kv_check.py ssp         dist_ssp, staleness=1: every pulled value within the bound
    kv_check.py priority    priorities: init order by default, set_priority and
                            MXNet's priority= argument, bad ones refused; the
                            nightly values unchanged
    kv_check.py gil         another thread runs while a pull and a barrier block
    kv_check.py async       dist_async: every push applied once
    kv_check.py fail        rank 1 raises inside `with` (the job must end at once)
    kv_check.py noclose     ends without close() (closed at exit)
    kv_check.py rows        row-sparse keys: exact sums by row id (overlapping rows,
                            repeated ids), untouched rows, empty pushes and pulls, a
                            key split over the servers by rows, errors
"""
import sys
import threading
import time

import numpy as np

import tessera

SMALL, BIG = 3, 99
BIG_SHAPE = (1200, 1200)


def expect_all(a, want, what):
    a = np.asarray(a)
    bad = np.flatnonzero(a.reshape(-1) != np.float32(want))
    if bad.size:
        raise AssertionError('%s: element %d is %r, expected %r'
                             % (what, bad[0], a.reshape(-1)[bad[0]], want))


def nightly():
    with tessera.KVStore('dist_sync') as kv:
        n = kv.num_workers
        kv.set_optimizer('sgd lr=-2')
        small = np.ones((2, 3), np.float32)
        big = np.ones(BIG_SHAPE, np.float32)
        kv.init([SMALL, BIG], [small, big])
        for i in range(7):
            kv.push(SMALL, np.full((2, 3), kv.rank + 1, np.float32))
            kv.push(BIG, np.full(BIG_SHAPE, kv.rank + 1, np.float32))
            kv.pull(SMALL, out=small)
            assert kv.pull(BIG, out=big) is big
            want = 1 + 2 * n * (n + 1) / 2 * (i + 1)
            expect_all(small, want, 'small key, round %d' % i)
            expect_all(big, want, '1200x1200 key, round %d' % i)
            # The same values lent: the small key's frame itself (read-only),
            # the split key gathered from its parts.
            view = kv.pull_view(SMALL)
            assert view.shape == (6,) and view.dtype == np.float32, view
            assert not view.flags.writeable
            expect_all(view, want, 'small key viewed, round %d' % i)
            if i == 6:
                whole = kv.pull_view(BIG)
                assert whole.shape == (1200 * 1200,), whole.shape
                expect_all(whole, want, '1200x1200 key viewed')
                kept = view[2:]  # a view of the lent array keeps the frame alive
                del view
                expect_all(kept, want, 'a slice of the lent array')
                try:
                    kv.pull_view(4242)
                    raise AssertionError('pull_view of an unknown key succeeded')
                except tessera.TesseraError as e:
                    assert 'never initialised' in str(e), e
        print('nightly ok: rank %d of %d, %d servers, 7 rounds' % (kv.rank, n, kv.num_servers))


def compress():
    with tessera.KVStore('dist_sync') as kv:
        n = kv.num_workers
        kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
        kv.set_optimizer('sgd', lr=-2)
        small = np.zeros(6, np.float32)
        big = np.zeros(BIG_SHAPE, np.float32)
        kv.init([SMALL, BIG], [small, big])
        for i, (g, want) in enumerate(zip([0, 0.4, 0.1, 0.2, 0.3, 0.5], [0, 0, 1, 1, 2, 3])):
            kv.push([SMALL, BIG], [np.full(6, g, np.float32), np.full(BIG_SHAPE, g, np.float32)])
            kv.pull([SMALL, BIG], out=[small, big])
            expect_all(small, want * n, '2-bit small key, round %d' % i)
            expect_all(big, want * n, '2-bit 1200x1200 key, round %d' % i)
        print('compress ok: rank %d of %d' % (kv.rank, n))


def pull_compress():
    """set_pull_compression("2bit") on even ranks: with no optimizer (a round's sum
    replaces the value) the weights go 0, s*[0,1,2,5], 0 (s = n(n+1)/2). A
    compressed pull brings the change since the last one coded against its mean
    absolute value t (docs/compression.md): [0,s,2s,5s] has t = 2s, so only 2s and
    5s reach it and come as 2s; then -[0,0,2s,2s] has t = s. Odd ranks pull the
    exact weights of the same key."""
    E = tessera.TesseraError
    with tessera.KVStore('dist_sync') as kv:
        n, r = kv.num_workers, kv.rank
        s = n * (n + 1) // 2
        compressed = r % 2 == 0
        e = expect_error(E, "pull compression type '3bit': expected 2bit or none",
                         kv.set_pull_compression, '3bit')
        assert (e.name, e.code) == ('INVALID_ARGUMENT', 3), (e.name, e.code)
        assert isinstance(e, tessera.InvalidArgumentError), type(e)
        expect_error(TypeError, 'expected a str', kv.set_pull_compression, {'type': '2bit'})
        kv.set_pull_compression('2bit' if compressed else 'none')
        w = np.zeros(4, np.float32)
        kv.init(0, w)
        e = expect_error(E, 'before the first init', kv.set_pull_compression, 'none')
        assert (e.name, e.code) == ('FAILED_PRECONDITION', 9), (e.name, e.code)
        assert isinstance(e, tessera.FailedPreconditionError), type(e)
        kv.pull(0, out=w)  # a first compressed pull brings the weights whole
        expect_equal(w, [0, 0, 0, 0], 'first pull')
        kv.push(0, np.array([0, 1, 2, 5], np.float32) * (r + 1))
        kv.pull(0, out=w)
        expect_equal(w, [0, 0, 2 * s, 2 * s] if compressed else [0, s, 2 * s, 5 * s],
                     'pull after round 1')
        kv.push(0, np.zeros(4, np.float32))
        kv.pull(0, out=w)
        expect_equal(w, [0, 0, s, s] if compressed else [0, 0, 0, 0], 'pull after round 2')
        print('pull_compress ok: rank %d of %d, %s pulls'
              % (r, n, '2-bit' if compressed else 'float32'))


def expect_equal(a, want, what):
    if not np.array_equal(a, np.asarray(want, np.float32)):
        raise AssertionError('%s: got %s, expected %s' % (what, list(a), list(want)))


def forms():
    import torch
    with tessera.KVStore('dist_sync') as kv:
        n, r = kv.num_workers, kv.rank
        s = n * (n + 1) / 2  # sum over ranks of (rank + 1)
        # No optimizer: a round's sum replaces the value (an all-reduce).
        a, b = np.zeros(4, np.float32), torch.zeros(2, 5)
        kv.init([1, 2], [a, b])
        # A list of arrays for one key is summed before the push (one per device).
        kv.push(1, [np.full(4, r + 1, np.float32), torch.full((4,), float(r + 1))])
        outs = [np.zeros(4, np.float32), torch.zeros(4)]
        assert kv.pull(1, out=outs) is outs
        expect_all(outs[0], 2 * s, 'list push, out 0')
        expect_all(outs[1].numpy(), 2 * s, 'list pull, out 1 (torch)')
        # Lists of keys with nested lists of values.
        kv.push([1, 2], [[np.ones(4, np.float32)], [torch.ones(2, 5), torch.ones(2, 5)]])
        kv.pull([1, 2], out=[a, [b]])
        expect_all(a, n, 'nested push, key 1')
        expect_all(b.numpy(), 2 * n, 'nested push, key 2')
        # pushpull without out fills the pushed array in place, as MXNet's does.
        g = np.full(4, r + 1, np.float32)
        assert kv.pushpull(1, g) is g
        expect_all(g, s, 'pushpull in place')
        got = torch.zeros(2, 5)
        kv.pushpull(2, torch.full((2, 5), float(r + 1)), out=got)
        expect_all(got.numpy(), s, 'pushpull torch')
        # Asynchronous operations, all in flight at once.
        push1 = kv.push_async(1, np.full(4, 2 * (r + 1), np.float32))
        push2 = kv.push_async(np.uint64(2), torch.full((10,), float(r + 1)).view(2, 5))
        pull1, pull2 = kv.pull_async(1, np.zeros(4, np.float32)), kv.pull_async(2, torch.zeros(10))
        assert push1.wait() is None and push2.wait() is None
        expect_all(pull1.wait(), 2 * s, 'async pull, key 1')
        expect_all(pull2.wait().numpy(), s, 'async pull, key 2')
        try:
            pull2.wait()
            raise AssertionError('a second wait succeeded')
        except tessera.TesseraError as e:
            assert 'already waited' in str(e), e
        # An Op never waited for is waited for by close().
        left = kv.pushpull_async(1, np.ones(4, np.float32), np.zeros(4, np.float32))
        print('forms ok: rank %d of %d' % (r, n))
    assert left.done


def expect_error(exc_type, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        if text not in str(e):
            raise AssertionError('%s raised %r, which lacks %r' % (fn.__name__, e, text))
        return e
    raise AssertionError('%s(%r, %r) did not raise %s' % (fn.__name__, args, kwargs,
                                                          exc_type.__name__))


def errors():
    import torch
    E, T, V = tessera.TesseraError, TypeError, ValueError
    expect_error(T, 'expected a str', tessera.KVStore, 5)
    expect_error(E, "KV store type 'local': expected dist_sync, dist_async, dist_ssp or dist_device_sync",
                 tessera.KVStore, 'local')
    expect_error(V, "KVStore: staleness is dist_ssp's, not dist_sync's",
                 tessera.KVStore, 'dist_sync', staleness=2)
    expect_error(V, 'staleness -1: expected a whole number of steps in 0..1000000',
                 tessera.KVStore, 'dist_ssp', staleness=-1)
    expect_error(V, 'staleness 1000001: expected a whole number of steps in 0..1000000',
                 tessera.KVStore, 'dist_ssp', staleness=1000001)
    expect_error(T, "staleness: expected a whole number of steps in 0..1000000, got str '3'",
                 tessera.KVStore, 'dist_ssp', staleness='3')
    kv = tessera.KVStore('dist_sync')
    n = kv.num_workers
    v = np.ones(8, np.float32)
    out = np.zeros(8, np.float32)
    # Settings: the C API's messages, and the package's own checks.
    e = expect_error(E, "unknown optimizer 'bogus'", kv.set_optimizer, 'bogus lr=1')
    assert (e.name, e.code) == ('INVALID_ARGUMENT', 3), (e.name, e.code)
    assert isinstance(e, tessera.InvalidArgumentError), type(e)
    expect_error(E, "unknown parameter 'foo'", kv.set_optimizer, 'sgd', foo=1)
    expect_error(E, 'expected a finite number', kv.set_optimizer, 'sgd lr=abc')
    expect_error(T, 'lr: expected a number', kv.set_optimizer, 'sgd', lr='0.1')
    expect_error(T, 'momentum: expected a number', kv.set_optimizer, 'sgd', momentum=True)
    expect_error(T, 'expected a str', kv.set_optimizer, None)
    expect_error(T, 'expected a dict', kv.set_gradient_compression, '2bit')
    expect_error(V, 'needs a "type"', kv.set_gradient_compression, {'threshold': 0.5})
    expect_error(V, "unknown field(s) 'thresh'", kv.set_gradient_compression,
                 {'type': '2bit', 'thresh': 0.5})
    expect_error(T, 'threshold: expected a number', kv.set_gradient_compression,
                 {'type': '2bit', 'threshold': '0.5'})
    expect_error(E, 'expected a number > 0', kv.set_gradient_compression,
                 {'type': '2bit', 'threshold': 0})
    expect_error(E, 'expected 2bit or none', kv.set_gradient_compression, {'type': '4bit'})
    kv.set_optimizer('sgd', lr=-2)
    # Keys.
    expect_error(T, "expected an int (Tessera keys are uint64), got str 'w'", kv.push, 'w', v)
    expect_error(T, 'got float', kv.pull, 1.0, out=out)
    expect_error(T, 'got bool', kv.pull, True, out=out)
    expect_error(V, 'expected 0 <= key < 2**64, got -1', kv.init, -1, v)
    expect_error(V, 'got 18446744073709551616', kv.push, 1 << 64, v)
    # Arrays: the wrong kind is refused, never copied.
    expect_error(T, 'init: value: expected a float32 array, got dtype float64', kv.init, 2,
                 np.ones(8))
    expect_error(T, 'expected a float32 NumPy array or a CPU torch.Tensor, got dict', kv.init,
                 2, {})
    expect_error(T, 'or a list of them for one key, got a list holding float', kv.init, 2,
                 [1.0] * 8)
    expect_error(V, 'expected a C-contiguous array', kv.init, 2, np.ones(16, np.float32)[::2])
    expect_error(V, 'expected a C-contiguous array', kv.init, 2, np.ones((4, 2), np.float32).T)
    expect_error(T, 'expected a float32 tensor, got torch.float64', kv.init, 2,
                 torch.ones(8, dtype=torch.float64))
    expect_error(V, 'expected a contiguous tensor', kv.init, 2, torch.ones(4, 2).t())
    expect_error(T, 'expected a CPU tensor, got one on meta', kv.init, 2,
                 torch.empty(8, device='meta'))
    expect_error(T, 'expected a dense tensor', kv.init, 2, torch.ones(8).to_sparse())
    # Forms.
    expect_error(V, 'init: 2 keys but 1 value', kv.init, [2, 4], [v])
    expect_error(T, 'a list of 2 keys needs a list of value', kv.init, [2, 4], v)
    expect_error(V, 'init: key 2 takes one array, got a list of 2', kv.init, 2, [v, v])
    expect_error(T, 'pull: out= is required', kv.pull, 2)
    # Unknown keys fail in the C API and hang nothing.
    expect_error(E, 'never initialised', kv.pull, 42, out=out)
    expect_error(E, 'never initialised', kv.push, 42, v)
    kv.init(2, v)
    # Lengths are the key's.
    expect_error(E, 'the key has 8', kv.push, 2, np.ones(7, np.float32))
    expect_error(E, 'the key has 8', kv.pull, 2, out=np.zeros(9, np.float32))
    expect_error(V, 'value has 8 elements but out has 9', kv.pushpull, 2, v,
                 out=np.zeros(9, np.float32))
    expect_error(V, 'the arrays of one key differ in size', kv.push, 2,
                 [v, np.ones(4, np.float32)])
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    expect_error(V, 'pull: out: the array is read-only', kv.pull, 2, out=ro)
    expect_error(V, 'pull: out[1]: the array is read-only', kv.pull, 2, out=[out, ro])
    expect_error(T, 'expected a float32 array', kv.pull, 2, out=[out, np.zeros(8)])
    # Settings after the first init.
    expect_error(E, 'before the first init', kv.set_optimizer, 'adam')
    expect_error(E, 'before the first init', kv.set_gradient_compression, {'type': '2bit'})
    expect_error(E, 'INVALID_ARGUMENT: pull_rows: key 2 is not a row-sparse key', kv.pull_rows,
                 2, [0], out)
    # None of the rejected calls counted toward a round: one real round gives exactly.
    kv.push(2, v)
    kv.pull(2, out=out)
    expect_all(out, 1 + 2 * n, 'after errors')
    rank = kv.rank
    kv.close()
    kv.close()  # a second close does nothing
    assert kv.closed
    for call, args in [(kv.push, (2, v)), (kv.pull, (2, out)), (kv.barrier, ()),
                       (kv.init, (5, v)), (kv.set_optimizer, ('sgd',)),
                       (kv.push_async, (2, v)), (kv.resume_round, ())]:
        e = expect_error(E, 'the KVStore is closed', call, *args)
        assert (e.name, e.code) == ('FAILED_PRECONDITION', 9), (e.name, e.code)
        assert isinstance(e, tessera.FailedPreconditionError), type(e)
    print('errors ok: rank %d of %d' % (rank, n))


def gil():
    """Rank 1 comes 1 s late; rank 0's pull of the round and its barrier block
    meanwhile, and a Python thread must make progress in most tenths of a
    second of that wait (with the GIL held through the call, it makes none)."""
    with tessera.KVStore('dist_sync') as kv:
        kv.set_optimizer('sgd lr=-1')
        w = np.zeros(1000, np.float32)
        kv.init(0, w)
        if kv.rank != 0:
            time.sleep(1.0)
            kv.push(0, np.ones(1000, np.float32))
            time.sleep(1.0)
            kv.barrier()
            print('gil ok: rank %d of %d' % (kv.rank, kv.num_workers))
            return
        for what in ('pull', 'barrier'):
            if what == 'pull':
                push = kv.push_async(0, np.ones(1000, np.float32))
            ticks = {}  # tenth of a second since t0 -> iterations of the other thread
            stop = threading.Event()
            t0 = time.monotonic()

            def spin():
                while not stop.is_set():
                    tenth = int((time.monotonic() - t0) * 10)
                    ticks[tenth] = ticks.get(tenth, 0) + 1

            t = threading.Thread(target=spin)
            t.start()
            time.sleep(0.05)
            start = time.monotonic() - t0
            if what == 'pull':
                kv.pull(0, out=w)  # answered once rank 1 has pushed too
                push.wait()
            else:
                kv.barrier()
            end = time.monotonic() - t0
            stop.set()
            t.join()
            inside = range(int(start * 10) + 1, int(end * 10))  # whole tenths inside the call
            idle = [i for i in inside if not ticks.get(i)]
            print('rank 0: blocking %s took %.2f s; the other thread ran %d times in it, '
                  'and not at all in %d of its %d tenths of a second'
                  % (what, end - start, sum(ticks.get(i, 0) for i in inside), len(idle),
                     len(inside)))
            assert end - start > 0.5, 'the %s did not block (%.2f s)' % (what, end - start)
            # Held by the call, the GIL stops the thread in every tenth; released, the
            # thread runs in nearly all (a loaded machine may deschedule it in a few).
            assert len(idle) <= len(inside) // 2, \
                'the other thread was stopped while the %s blocked' % what
        expect_all(w, kv.num_workers, 'pulled sum')
        print('gil ok: rank %d of %d' % (kv.rank, kv.num_workers))


def async_():
    with tessera.KVStore('dist_async') as kv:
        n = kv.num_workers
        kv.set_optimizer('sgd', lr=-1)
        w = np.zeros(1500000, np.float32)  # split over the servers
        kv.init(5, w)
        g = np.full(w.shape, kv.rank + 1, np.float32)
        for _ in range(5):
            kv.push(5, g)
        kv.barrier()
        kv.pull(5, out=w)
        expect_all(w, 5 * n * (n + 1) / 2, 'async key')
        print('async ok: rank %d of %d' % (kv.rank, n))


def ssp():
    """dist_ssp with staleness=1 from Python: value j counts rank j % n's
    pushes (sgd lr=-1), so a pull after c pushes must hold this rank's c and
    every other rank's c - 1 .. c + 2 (docs/consistency.md)."""
    import random
    with tessera.KVStore('dist_ssp', staleness=1) as kv:
        n, r = kv.num_workers, kv.rank
        kv.set_optimizer('sgd', lr=-1)
        w = np.zeros(3 * n, np.float32)
        kv.init(7, w)
        g = np.zeros_like(w)
        g[r::n] = 1
        for c in range(1, 11):
            time.sleep(random.random() * (0.03 if r == 0 else 0.005))
            kv.push(7, g)
            kv.pull(7, out=w)
            for j, v in enumerate(w):
                lo, hi = (c, c) if j % n == r else (c - 1, c + 2)
                if not lo <= v <= hi:
                    raise AssertionError('rank %d step %d: value %d is %g, expected %d..%d'
                                         % (r, c, j, v, lo, hi))
        print('ssp ok: rank %d of %d' % (r, n))


def priority():
    """Priorities from Python (docs/priority.md): keys 0..3 get 0, -1, -2, -3
    by default; set_priority and push/pull's priority= change a key's; bad
    ones are refused naming what was expected and change nothing; the sums
    are MXNet's nightly values whatever the order."""
    with tessera.KVStore('dist_sync') as kv:
        n = kv.num_workers
        kv.set_optimizer('sgd', lr=-2)
        keys = [0, 1, 2, 3]
        ws = [np.ones(s, np.float32) for s in (6, 300000, 7, 400000)]
        kv.init(keys, ws)
        expect_equal([kv.priority(k) for k in keys], [0, -1, -2, -3], 'defaults')
        kv.set_priority(3, 5)
        kv.set_priority([1, 2], -7)
        expect_equal([kv.priority(k) for k in keys], [0, -7, -7, 5], 'set_priority')
        expect_error(ValueError, 'priority 1000000001: expected an integer in '
                     '-1000000000..1000000000 (higher is more urgent)',
                     kv.set_priority, 0, 10**9 + 1)
        expect_error(TypeError, "priority: expected an integer in -1000000000..1000000000 "
                     "(higher is more urgent), got float 1.5", kv.push, 0, ws[0],
                     priority=1.5)
        expect_error(TypeError, "priority: expected an integer in -1000000000..1000000000 "
                     "(higher is more urgent), got bool True", kv.set_priority, 0, True)
        expect_error(tessera.NotFoundError, 'cannot set the priority of key 9: it is not '
                     'initialised here (Init it first)', kv.set_priority, 9, 1)
        # A call's own errors come first, and a refused call sets no priority.
        expect_error(tessera.NotFoundError, 'the key was never initialised', kv.push, 9,
                     ws[0], priority=3)
        expect_error(ValueError, 'pushpull: key 0: value has 6 elements but out has 300000',
                     kv.pushpull, 0, ws[0], out=ws[1], priority=4)
        expect_equal([kv.priority(k) for k in keys], [0, -7, -7, 5], 'after refusals')
        for i in range(3):
            for k, w in zip(keys, ws):
                # MXNet's form: the priority argument per call.
                kv.push(k, np.full_like(w, kv.rank + 1), priority=-k)
            for k, w in zip(keys, ws):
                kv.pull(k, out=w, priority=-k)
            for k, w in zip(keys, ws):
                expect_all(w, 1 + n * (n + 1) * (i + 1), 'key %d round %d' % (k, i))
        expect_equal([kv.priority(k) for k in keys], [0, -1, -2, -3], 'priority=')
        print('priority ok: rank %d of %d' % (kv.rank, n))


def fail():
    """Rank 1 raises inside its `with` while rank 0 waits in a round for it."""
    with tessera.KVStore('dist_sync') as kv:
        kv.init(0, np.zeros(10, np.float32))
        if kv.rank == 1:
            raise RuntimeError('rank 1 gives up')
        kv.push(0, np.ones(10, np.float32))


def noclose():
    """Ends without close(), as MXNet scripts do."""
    kv = tessera.KVStore('dist_sync')
    kv.init(0, np.zeros(10, np.float32))
    kv.push(0, np.ones(10, np.float32))
    print('noclose ok: rank %d of %d' % (kv.rank, kv.num_workers))


def rows():
    """Row-sparse keys with sgd lr=-1, so a round adds the sum of the rows pushed
    to them. Each rank r pushes rank+1 into rows r, 10+r and 50 (all ranks), rank 0
    row 0 twice; after c rounds row r holds 1 + c(r+1) (row 0: 1 + 2c), row 10+r
    1 + c(r+1), row 50 1 + c n(n+1)/2, every other row 1."""
    E = tessera.TesseraError
    with tessera.KVStore('dist_sync') as kv:
        n, r = kv.num_workers, kv.rank
        kv.set_optimizer('sgd lr=-1')
        kv.init_rows(10, np.ones((100, 8), np.float32))
        # 1000 x 1200 = 1.2 M values: split over the servers by rows.
        kv.init_rows(11, None, num_rows=1000, row_length=1200)
        kv.init(12, np.zeros(4, np.float32))  # a dense key beside them
        # Errors before any round: nothing is sent, nothing counted.
        e = expect_error(E, 'row push of key 10: row id 100 is past its 100 rows',
                         kv.push_rows, 10, [100], np.ones((1, 8), np.float32))
        assert (e.name, e.code) == ('INVALID_ARGUMENT', 3), (e.name, e.code)
        assert isinstance(e, tessera.InvalidArgumentError), type(e)
        expect_error(E, 'row pull of key 11: row id 1000 is past its 1000 rows',
                     kv.pull_rows, 11, [0, 1000])
        expect_error(ValueError, 'push_rows: key 10: 2 row id(s) of 8 values need 16 values '
                     'in rows, got 8', kv.push_rows, 10, [1, 2], np.ones(8, np.float32))
        expect_error(ValueError, 'pull_rows: row_ids: row ids are >= 0, got -1',
                     kv.pull_rows, 10, [3, -1])
        expect_error(TypeError, 'pull_rows: row_ids: expected integer row ids, got dtype '
                     'float64', kv.pull_rows, 10, [1.5])
        expect_error(TypeError, 'push_rows: rows: expected a float32 array, got dtype '
                     'float64', kv.push_rows, 10, [1], np.ones((1, 8)))
        expect_error(E, 'INVALID_ARGUMENT: push_rows: key 12 is not a row-sparse key',
                     kv.push_rows, 12, [0], np.ones((1, 4), np.float32))
        expect_error(E, 'the key is row-sparse (init_rows): use push_rows / pull_rows',
                     kv.push, 10, np.ones(800, np.float32))
        expect_error(ValueError, 'init_rows: value: expected a 2-D array',
                     kv.init_rows, 13, np.ones(8, np.float32))
        expect_error(TypeError, 'init_rows: without a value, num_rows= and row_length= are '
                     'required', kv.init_rows, 13)
        expect_error(ValueError, 'init_rows: row_length: expected at least 1, got 0',
                     kv.init_rows, 13, None, num_rows=5, row_length=0)
        empty = kv.pull_rows(10, [])
        assert empty.shape == (0, 8) and empty.dtype == np.float32, empty.shape

        mine = [r, 10 + r, 50] + ([0] if r == 0 else [])
        big_mine = [r, 999 - r, 500]
        for c in range(1, 4):
            kv.push_rows(10, mine, np.full((len(mine), 8), r + 1, np.float32))
            kv.push_rows(11, np.array(big_mine, np.int64),
                         np.full((3, 1200), r + 1, np.float32))
            ids = [50, 0, 99, 50] + list(range(10, 10 + n)) + list(range(n)) + [20]
            out = np.zeros((len(ids), 8), np.float32)
            assert kv.pull_rows(10, ids, out=out) is out
            want = {50: 1 + c * n * (n + 1) / 2, 99: 1, 20: 1}
            for w in range(n):
                want[w] = 1 + c * (w + 1)
                want[10 + w] = 1 + c * (w + 1)
            want[0] = 1 + 2 * c
            for i, row in enumerate(ids):
                expect_all(out[i], want[row], 'key 10 round %d row %d' % (c, row))
            big_ids = list(range(n)) + [500] + [999 - w for w in range(n)] + [600, 999 - n]
            big = kv.row_sparse_pull(11, row_ids=big_ids)
            assert big.shape == (len(big_ids), 1200), big.shape
            big_want = {500: c * n * (n + 1) / 2, 600: 0, 999 - n: 0}
            for w in range(n):
                big_want[w] = big_want[999 - w] = c * (w + 1)
            for i, row in enumerate(big_ids):
                expect_all(big[i], big_want[row], 'key 11 round %d row %d' % (c, row))
        # A round in which every worker pushes no rows changes nothing.
        kv.push_rows(10, [], None)
        kv.push_rows(11, np.zeros(0, np.uint64), np.zeros((0, 1200), np.float32))
        after = kv.pull_rows(10, [50, 99])
        expect_all(after[0], 1 + 3 * n * (n + 1) / 2, 'key 10 row 50 after an empty round')
        expect_all(after[1], 1, 'key 10 row 99 after an empty round')
        expect_all(kv.pull_rows(11, [500])[0], 3 * n * (n + 1) / 2,
                   'key 11 row 500 after an empty round')
        print('rows ok: rank %d of %d, %d servers' % (r, n, kv.num_servers))


def hashed():
    """Hashed row keys from Python: any 64-bit ids, sgd lr=-1 (a round adds the sum
    of the rows pushed), zeros to start. Each rank r pushes rank+1 into ids
    2**63 + r and 7 (all ranks); after c rounds id 2**63 + r holds c(r+1), id 7
    c n(n+1)/2, and an id never pushed its initial row (zeros). With
    admit_after=2 (key 21), an id named by one push a round gets its row at its
    second round; ids named by every rank at their first."""
    E = tessera.TesseraError
    with tessera.KVStore('dist_sync') as kv:
        n, r = kv.num_workers, kv.rank
        assert n > 1, 'run the hashed check with 2 or more workers'
        kv.set_optimizer('sgd lr=-1')
        kv.init_hashed(20, 4)
        kv.init_hashed(21, 2, admit_after=2, capacity=100)
        expect_error(ValueError, "init_hashed: init: expected 'zeros', 'uniform' or "
                     "'normal', got 'ones'", kv.init_hashed, 22, 4, init='ones')
        expect_error(ValueError, 'init_hashed: admit_after: expected at least 1, got 0',
                     kv.init_hashed, 22, 4, admit_after=0)
        expect_error(TypeError, 'init_hashed: capacity: expected an int',
                     kv.init_hashed, 22, 4, capacity=1.5)
        expect_error(ValueError, 'init_hashed: dim: expected at least 1, got 0',
                     kv.init_hashed, 22, 0)
        mine = [2 ** 63 + r, 7]
        for c in range(1, 3):
            kv.push_rows(20, mine, np.full((2, 4), r + 1, np.float32))
            kv.push_rows(21, [1000 + r, 5], np.ones((2, 2), np.float32))
            got = kv.pull_rows(20, [2 ** 63 + q for q in range(n)] + [7, 2 ** 64 - 1])
            for q in range(n):
                assert (got[q] == c * (q + 1)).all(), (c, q, got[q])
            assert (got[n] == c * n * (n + 1) // 2).all(), (c, got[n])
            assert (got[n + 1] == 0).all(), got[n + 1]
            lone = kv.pull_rows(21, [1000 + r, 5])
            want_lone = 0.0 if c == 1 else 1.0  # admitted at its second push
            assert (lone[0] == want_lone).all(), (c, lone[0], want_lone)
            assert (lone[1] == c * n).all(), (c, lone[1])
            kv.barrier()
        print('hashed ok: rank %d of %d, %d servers' % (r, n, kv.num_servers))


MODES = {'nightly': nightly, 'compress': compress, 'pull_compress': pull_compress,
         'forms': forms, 'errors': errors, 'ssp': ssp, 'priority': priority,
         'gil': gil, 'async': async_, 'fail': fail, 'noclose': noclose,
         'rows': rows, 'hashed': hashed}

if __name__ == '__main__':
    MODES[sys.argv[1]]()
