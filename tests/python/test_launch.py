"""Python workers through tools/launch.py as users start them: the NumPy example
run unchanged (launch.py finds the daemons, the example finds the package); a
script that never closes its store ends the job cleanly; a worker that raises
ends the job at once, naming it."""
import os
import re
import sys

from conftest import EXAMPLES, HERE


def test_numpy_example_runs_unchanged_through_launch_py(job):
    # No --scheduler-binary/--server-binary and no PYTHONPATH: launch.py looks in
    # $TESSERA_BUILD_DIR, the example in ../python.
    del job.env['PYTHONPATH']
    code, out, took = job.run(
        2, 1, [sys.executable, os.path.join(EXAMPLES, 'numpy_linear_regression.py')], timeout=120)
    assert code == 0, out
    assert re.search(r'\[worker \d\] rank 0 step 0: loss [\d.]+', out), out
    errors = [float(e) for e in re.findall(r'rank \d of 2: \|w - true_w\| = ([\d.]+)', out)]
    assert len(errors) == 2 and errors[0] == errors[1], out  # one model, pulled by both
    assert errors[0] < 0.01, out
    first = [float(v) for v in re.findall(r'rank \d step 0: loss ([\d.]+)', out)]
    last = [float(v) for v in re.findall(r'rank \d step 199: loss ([\d.]+)', out)]
    assert len(first) == len(last) == 2 and max(last) < 0.01 * min(first), out


def test_sparse_bow_example_learns_through_row_sparse_keys(job):
    # 2 workers, 2 servers, 2 short epochs of the generated bag-of-words task (10
    # classes: chance is 0.10); measured 0.862 and 0.861, the same in every run.
    code, out, took = job.python(
        2, 2, os.path.join(EXAMPLES, 'sparse_bow_classifier.py'), '--epochs', '2',
        '--train-docs', '20000', '--test-docs', '2000', timeout=120)
    assert code == 0, out
    accuracy = [float(a) for a in re.findall(r'rank \d final Validation-accuracy=([\d.]+)', out)]
    assert len(accuracy) == 2 and min(accuracy) > 0.80, out
    assert len(re.findall(r'Epoch\[1\] Validation-accuracy=', out)) == 2, out
    # Each step moved the rows of its batch's words, not the 50,000-row embedding.
    less = [float(x) for x in re.findall(r'dense \(([\d.]+)x less\)', out)]
    assert len(less) == 2 and min(less) > 20, out
    # 200 steps per worker: 200 rounds of the embedding, split over both servers' rows.
    rounds = [int(r) for r in re.findall(r'pushes applied \d+ \(key 0: (\d+)', out)]
    assert rounds and all(r == 400 for r in rounds), out


def test_ctr_example_learns_through_hashed_keys(job):
    # 2 workers, 2 servers, 1 epoch of 100,000 generated examples over 10^8 possible
    # ids per feature: the holdout AUC beats chance clearly (0.5) and the logloss the
    # constant predictor's; the same bits on both workers.
    code, out, took = job.python(
        2, 2, os.path.join(EXAMPLES, 'ctr_hashed.py'), '--epochs', '1', '--train', '100000',
        '--holdout', '10000', timeout=120)
    assert code == 0, out
    finals = re.findall(r'rank \d final Validation-logloss=([\d.]+) Validation-auc=([\d.]+)', out)
    assert len(finals) == 2 and finals[0] == finals[1], out
    logloss, auc = float(finals[0][0]), float(finals[0][1])
    constant = float(re.search(r'its constant predictor: logloss ([\d.]+)', out).group(1))
    assert auc > 0.62 and logloss < constant, out
    assert len(re.findall(r'distinct ids per feature', out)) == 2, out


def test_a_python_worker_that_raises_ends_the_job_at_once_naming_it(job):
    code, out, took = job.python(2, 1, os.path.join(HERE, 'kv_check.py'), 'fail', timeout=60)
    assert code != 0, out
    assert 'RuntimeError: rank 1 gives up' in out, out
    assert re.search(r'launch.py: worker \d \(pid \d+\) exited with status 1; stopping the job',
                     out), out
    assert "rank 1 failed; leaving the job without closing" in out, out
    assert took < 20, out  # not the 60 s TESSERA_TIMEOUT of rank 0's push


def test_a_script_that_never_closes_its_store_ends_the_job_cleanly(job):
    code, out, took = job.python(2, 1, os.path.join(HERE, 'kv_check.py'), 'noclose', timeout=60)
    assert code == 0, out
    assert 'noclose ok: rank 0 of 2' in out and 'noclose ok: rank 1 of 2' in out, out
    assert took < 20, out  # not the heartbeat time-out of a worker that vanished
