"""tessera.KVStore in real jobs: MXNet's nightly values, 2-bit compression of
pushes and of pulls, MXNet's list forms, every bad argument, the GIL released
while calls block, dist_async; and the package's errors without a job."""
import os
import subprocess
import sys

import pytest

from conftest import HERE, PACKAGE_DIR

CHECK = os.path.join(HERE, 'kv_check.py')


def run_check(job, mode, workers, servers, timeout=120):
    code, out, took = job.python(workers, servers, CHECK, mode, timeout=timeout)
    assert code == 0, out
    for rank in range(workers):
        assert '%s ok: rank %d of %d' % (mode, rank, workers) in out, out
    return out, took


def test_mxnet_nightly_values_with_three_workers_and_two_servers(job):
    # A (2,3) key and a 1200x1200 key split over both servers (1.44 M >= 1 M values).
    out, _ = run_check(job, 'nightly', 3, 2)
    assert '2 servers, 7 rounds' in out


def test_two_bit_compression_pulls_match_mxnet(job):
    run_check(job, 'compress', 2, 2)


def test_pull_compression_set_from_python_brings_two_bit_coded_changes(job):
    # Ranks 0 and 2 pull 2-bit coded changes, rank 1 the exact weights.
    out, _ = run_check(job, 'pull_compress', 3, 2)
    assert 'rank 0 of 3, 2-bit pulls' in out and 'rank 1 of 3, float32 pulls' in out, out


def test_mxnet_list_forms_async_ops_and_torch_tensors(job):
    pytest.importorskip('torch')
    run_check(job, 'forms', 2, 1)


def test_every_bad_argument_raises_a_clear_error_and_changes_nothing(job):
    pytest.importorskip('torch')
    run_check(job, 'errors', 2, 1)


def test_another_python_thread_runs_while_a_pull_and_a_barrier_block(job):
    out, _ = run_check(job, 'gil', 2, 1)
    assert 'rank 0: blocking pull took' in out and 'rank 0: blocking barrier took' in out


def test_row_sparse_keys_sum_rows_by_id_with_three_workers_and_two_servers(job):
    # A 100x8 key on one server and a 1000x1200 key split over both by rows.
    out, _ = run_check(job, 'rows', 3, 2)
    assert 'rank 2 of 3, 2 servers' in out


def test_hashed_keys_take_any_64_bit_ids_with_three_workers_and_two_servers(job):
    out, _ = run_check(job, 'hashed', 3, 2)
    assert 'hashed ok: rank 2 of 3, 2 servers' in out


def test_dist_async_applies_every_push(job):
    run_check(job, 'async', 2, 2)


def test_dist_ssp_pulls_stay_within_the_staleness_bound(job):
    run_check(job, 'ssp', 3, 2)


def test_priorities_through_python_and_the_sums_unchanged(job):
    run_check(job, 'priority', 2, 2)


def run_python(code, **env):
    """Runs `code` in a fresh interpreter with the package from the source tree."""
    full = dict(os.environ, PYTHONPATH=PACKAGE_DIR, **env)
    for name in ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT'):
        full.pop(name, None)
    return subprocess.run([sys.executable, '-c', code], env=full, capture_output=True,
                          text=True, timeout=60)


def test_without_a_job_the_store_raises_tessera_error_naming_the_variable():
    r = run_python('import tessera\n'
                   'try:\n'
                   '    tessera.KVStore("dist_sync")\n'
                   'except tessera.TesseraError as e:\n'
                   '    print(e.code, e.name, type(e).__name__, "|", e)\n')
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ('3 INVALID_ARGUMENT InvalidArgumentError | INVALID_ARGUMENT: '
                                'DMLC_ROLE is not set: expected scheduler, server or worker'), \
        r.stdout


def test_tessera_error_carries_the_c_apis_code_its_name_and_a_subclass():
    if PACKAGE_DIR not in sys.path:
        sys.path.insert(0, PACKAGE_DIR)
    import tessera  # no library is loaded before a KVStore is made
    for name, code in tessera.STATUS_CODES.items():
        e = tessera.TesseraError('%s: what went wrong' % name)
        assert (e.code, e.name, str(e)) == (code, name, '%s: what went wrong' % name)
        assert isinstance(e, tessera.TesseraError) and isinstance(e, RuntimeError)
    for name, cls in (('INVALID_ARGUMENT', tessera.InvalidArgumentError),
                      ('DEADLINE_EXCEEDED', tessera.DeadlineExceededError),
                      ('FAILED_PRECONDITION', tessera.FailedPreconditionError),
                      ('UNAVAILABLE', tessera.UnavailableError),
                      ('ABORTED', tessera.AbortedError)):
        assert type(tessera.TesseraError(name + ': x')) is cls
    e = tessera.TesseraError('something without a code')
    assert (e.code, e.name, type(e)) == (2, 'UNKNOWN', tessera.TesseraError)
    assert tessera.InvalidArgumentError('INVALID_ARGUMENT: y').code == 3


def test_a_missing_library_is_a_tessera_error_naming_where_it_looked():
    r = run_python('import tessera\n'
                   'try:\n'
                   '    tessera.KVStore("dist_sync")\n'
                   'except tessera.TesseraError as e:\n'
                   '    print(e)\n', TESSERA_LIBRARY='/nonexistent/libtessera.so')
    assert r.returncode == 0, r.stderr
    assert 'cannot load libtessera' in r.stdout, r.stdout
    assert '/nonexistent/libtessera.so ($TESSERA_LIBRARY): no such file' in r.stdout, r.stdout
