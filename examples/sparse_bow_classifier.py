#!/usr/bin/env python3
"""A sparse-input model through row-sparse keys: a bag-of-words classifier whose
word embedding is a row-sparse key, so each step pushes and pulls only the rows
of the words its batch contains (issue #15's end-to-end example).

    tools/launch.py -n 2 -s 2 --launcher local python3 examples/sparse_bow_classifier.py

Data, generated (the same on every worker, each taking its share): documents of
--doc-len words from a --vocab word vocabulary in --classes classes. A fraction
--signal of a document's words come from its class's own Zipf-like distribution
(a class ranks the vocabulary in its own random order; rank k is drawn with
probability proportional to 1/k**1.1), the rest from one background distribution
shared by all classes, so most words say nothing about the class and the task is
learnable but not trivial.

Model: the mean of the document's word embeddings (--vocab x --dim, row-sparse
key 0) -> a dense layer (--dim x --classes, key 1, bias key 2) -> softmax
cross-entropy. Gradients are NumPy; SGD runs on the servers. A step pulls the
embedding rows of its batch's words (pull_rows) and the dense weights, computes
the gradients, and pushes those rows (push_rows) and the dense gradients. Prints
MXNet-style progress, the validation accuracy of each epoch and the bytes a step
moved against what a dense embedding would have moved.
"""
import argparse
import os
import sys
import time

import numpy as np

try:
    import tessera
except ImportError:  # run from a checkout: the package is in ../python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'python'))
    import tessera

EMBEDDING, WEIGHT, BIAS = 0, 1, 2


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--vocab', type=int, default=50000)
    p.add_argument('--dim', type=int, default=32)
    p.add_argument('--classes', type=int, default=10)
    p.add_argument('--doc-len', type=int, default=20)
    p.add_argument('--signal', type=float, default=0.25,
                   help="fraction of a document's words drawn from its class")
    p.add_argument('--train-docs', type=int, default=40000)
    p.add_argument('--test-docs', type=int, default=4000)
    p.add_argument('--batch-size', type=int, default=100, help='per worker')
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--lr', type=float, default=5.0)
    p.add_argument('--seed', type=int, default=1)
    p.add_argument('--log-every', type=int, default=50, help='batches')
    args = p.parse_args(argv)
    for name in ('vocab', 'dim', 'classes', 'doc_len', 'train_docs', 'test_docs',
                 'batch_size', 'epochs', 'log_every'):
        if getattr(args, name) < 1:
            p.error('--%s: expected at least 1, got %d' % (name.replace('_', '-'),
                                                           getattr(args, name)))
    if not 0 < args.signal <= 1:
        p.error('--signal: expected a fraction in (0, 1], got %r' % args.signal)
    return args


def make_documents(args, count, rng):
    """(words: count x doc_len int64, labels: count) drawn as the docstring says."""
    ranks = np.arange(1, args.vocab + 1, dtype=np.float64)
    zipf = 1.0 / ranks ** 1.1
    zipf /= zipf.sum()
    cdf = np.cumsum(zipf)
    # The background and each class rank the vocabulary in their own order (the
    # permutations come from the seed alone, so every call agrees on them).
    perm_rng = np.random.default_rng(args.seed)
    orders = [perm_rng.permutation(args.vocab) for _ in range(args.classes + 1)]
    labels = rng.integers(0, args.classes, count)
    draws = np.searchsorted(cdf, rng.random((count, args.doc_len)))
    draws = np.minimum(draws, args.vocab - 1)
    own = rng.random((count, args.doc_len)) < args.signal
    words = np.empty((count, args.doc_len), np.int64)
    for c in range(args.classes):
        rows = labels == c
        words[rows] = np.where(own[rows], orders[c][draws[rows]],
                               orders[args.classes][draws[rows]])
    return words, labels


def forward(emb_rows, inverse, w, b, doc_len):
    """Mean embedding per document (emb_rows indexed by `inverse`), logits, softmax."""
    h = emb_rows[inverse].mean(axis=1)  # batch x dim
    logits = h @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return h, p


def main(argv):
    args = parse(argv)
    with tessera.KVStore('dist_sync') as kv:
        n, rank = kv.num_workers, kv.rank
        data_rng = np.random.default_rng(args.seed + 1)  # the same data on every worker
        train_x, train_y = make_documents(args, args.train_docs, data_rng)
        test_x, test_y = make_documents(args, args.test_docs, data_rng)
        train_x, train_y = train_x[rank::n], train_y[rank::n]
        test_x, test_y = test_x[rank::n], test_y[rank::n]
        # Every worker takes the same number of steps (dist_sync).
        steps = (args.train_docs // n) // args.batch_size
        if steps == 0:
            raise SystemExit('sparse_bow_classifier: --train-docs %d over %d workers gives '
                             'no batch of --batch-size %d'
                             % (args.train_docs, n, args.batch_size))

        kv.set_optimizer('sgd', lr=args.lr, rescale_grad=1.0 / n)  # mean over workers
        init_rng = np.random.default_rng(args.seed + 2)
        kv.init_rows(EMBEDDING, (0.1 * init_rng.standard_normal(
            (args.vocab, args.dim))).astype(np.float32))  # rank 0's is stored
        w = np.zeros((args.dim, args.classes), np.float32)
        b = np.zeros(args.classes, np.float32)
        kv.init(WEIGHT, w)
        kv.init(BIAS, b)

        order_rng = np.random.default_rng(args.seed + 3 + rank)
        rows_moved, started = 0, time.monotonic()
        for epoch in range(args.epochs):
            order = order_rng.permutation(len(train_x))
            tic, seen, correct = time.monotonic(), 0, 0
            for step in range(steps):
                batch = order[step * args.batch_size:(step + 1) * args.batch_size]
                words, labels = train_x[batch], train_y[batch]
                ids, inverse = np.unique(words, return_inverse=True)
                inverse = inverse.reshape(words.shape)
                emb = kv.pull_rows(EMBEDDING, ids)
                kv.pull(WEIGHT, out=w)
                kv.pull(BIAS, out=b)
                h, p = forward(emb, inverse, w, b, args.doc_len)
                correct += int((p.argmax(axis=1) == labels).sum())
                seen += len(batch)
                d_logits = p
                d_logits[np.arange(len(batch)), labels] -= 1
                d_logits /= len(batch)
                d_h = d_logits @ w.T / args.doc_len  # each word's share of the mean
                d_emb = np.zeros_like(emb)
                np.add.at(d_emb, inverse, d_h[:, None, :])
                kv.push_rows(EMBEDDING, ids, d_emb)
                kv.push(WEIGHT, (h.T @ d_logits).astype(np.float32))
                kv.push(BIAS, d_logits.sum(axis=0).astype(np.float32))
                rows_moved += 2 * len(ids)  # pulled and pushed
                if (step + 1) % args.log_every == 0:
                    now = time.monotonic()
                    print('Epoch[%d] Batch[%d] Speed: %.1f samples/sec accuracy=%.4f'
                          % (epoch, step + 1, seen / (now - tic), correct / seen),
                          flush=True)
            # Validation on this worker's share, with the servers' current weights.
            ids, inverse = np.unique(test_x, return_inverse=True)
            emb = kv.pull_rows(EMBEDDING, ids)
            kv.pull(WEIGHT, out=w)
            kv.pull(BIAS, out=b)
            _, p = forward(emb, inverse.reshape(test_x.shape), w, b, args.doc_len)
            accuracy = float((p.argmax(axis=1) == test_y).mean())
            print('Epoch[%d] Train-accuracy=%.4f' % (epoch, correct / seen))
            print('Epoch[%d] Validation-accuracy=%.4f' % (epoch, accuracy), flush=True)
            kv.barrier()  # every worker's validation pulls before the next round

        total_steps = steps * args.epochs
        row_bytes = args.dim * 4
        sparse = rows_moved * row_bytes / total_steps
        dense = 2 * args.vocab * row_bytes
        print('rank %d of %d: %d steps in %.1f s; embedding bytes per step %.0f KB through '
              'row-sparse keys against %.0f KB dense (%.1fx less)'
              % (rank, n, total_steps, time.monotonic() - started, sparse / 1e3, dense / 1e3,
                 dense / sparse))
        print('rank %d final Validation-accuracy=%.4f' % (rank, accuracy), flush=True)


if __name__ == '__main__':
    main(sys.argv[1:])
