#!/usr/bin/env python3
"""Linear regression by SGD through a Tessera job, with NumPy: every worker
computes the gradient of its own generated data, the servers sum the pushes of
a round and run SGD, every worker pulls the new weights.

    tools/launch.py -n 2 -s 1 --launcher local python3 examples/numpy_linear_regression.py
"""
import os
import sys

import numpy as np

try:
    import tessera
except ImportError:  # run from a checkout: the package is in ../python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'python'))
    import tessera

DIM, SAMPLES, BATCH, STEPS = 10, 4000, 100, 200
true_w = np.linspace(-1, 1, DIM).astype(np.float32)  # what every worker's data follows

with tessera.KVStore('dist_sync') as kv:
    rng = np.random.default_rng(kv.rank)  # each worker its own data
    x = rng.standard_normal((SAMPLES, DIM), dtype=np.float32)
    y = x @ true_w + 0.01 * rng.standard_normal(SAMPLES, dtype=np.float32)

    kv.set_optimizer('sgd', lr=0.1, rescale_grad=1.0 / kv.num_workers)  # mean over workers
    w = np.zeros(DIM, np.float32)
    kv.init(0, w)  # rank 0's value is stored
    grad = np.empty_like(w)
    for step in range(STEPS):
        i = rng.integers(0, SAMPLES, BATCH)
        grad[:] = 2 * x[i].T @ (x[i] @ w - y[i]) / BATCH  # d/dw of the mean squared error
        kv.push(0, grad)
        kv.pull(0, out=w)  # the round's update, the same on every worker
        if step % 50 == 0 or step == STEPS - 1:
            loss = np.mean((x @ w - y) ** 2)
            print('rank %d step %d: loss %.6f' % (kv.rank, step, loss), flush=True)
    print('rank %d of %d: |w - true_w| = %.4f' % (kv.rank, kv.num_workers,
                                                  np.linalg.norm(w - true_w)))
