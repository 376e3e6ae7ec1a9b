#!/usr/bin/env python3
"""A click-through model on hashed feature ids: each sparse feature's embedding is a
hashed row key (issue #29), so ids are arbitrary 64-bit values, rows appear for
the ids the servers admit, and a server holds at most --capacity of them.

    tools/launch.py -n 2 -s 2 --launcher local python3 examples/ctr_hashed.py

Data, generated (the same on every worker, each taking its share): every example
has --features sparse features (think user, item, query, a cross); feature f's
value is the id of a rank drawn from a Zipf law over --id-space values (P(rank
r) ~ 1/r, drawn as floor(N^u)), hashed to 64 bits, so a few ids are frequent
and most are seen once or never. The label is a click drawn with probability
sigmoid(bias + sum_f t_f(rank)), where each (feature, rank) has a hidden
effect t drawn from a normal law (a function of the pair alone): frequent ids
can be learned, the long tail cannot.

Model: one hashed key per feature (--dim floats a row; init normal std 0.01,
admit_after --admit-after, --capacity rows per server, expire_after
--expire-after rounds), the embeddings concatenated -> a dense layer (ReLU) ->
one logit; AdaGrad on the servers. A step pulls its batch's rows (pull_rows of
the unique ids of each feature) and the dense weights, computes the gradients
with NumPy, and pushes them. Prints MXNet-style progress, then after each epoch
the holdout's logloss and AUC, and what the hashed keys hold.
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

W1, B1, W2, B2 = 100, 101, 102, 103
MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix(x):
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over='ignore'):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & MASK
        return x ^ (x >> np.uint64(31))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--features', type=int, default=4)
    p.add_argument('--id-space', type=float, default=1e8, help='values per feature')
    p.add_argument('--dim', type=int, default=8)
    p.add_argument('--hidden', type=int, default=16)
    p.add_argument('--train', type=int, default=200000, help='examples')
    p.add_argument('--holdout', type=int, default=20000)
    p.add_argument('--batch-size', type=int, default=500, help='per worker')
    p.add_argument('--epochs', type=int, default=2)
    p.add_argument('--lr', type=float, default=0.1, help='AdaGrad')
    p.add_argument('--admit-after', type=int, default=2)
    p.add_argument('--capacity', type=int, default=500000, help='rows per key per server')
    p.add_argument('--expire-after', type=int, default=0, help='rounds (0: never)')
    p.add_argument('--seed', type=int, default=1)
    p.add_argument('--log-every', type=int, default=50, help='batches')
    args = p.parse_args(argv)
    for name in ('features', 'dim', 'hidden', 'train', 'holdout', 'batch_size', 'epochs',
                 'admit_after', 'log_every'):
        if getattr(args, name) < 1:
            p.error('--%s: expected at least 1, got %d' % (name.replace('_', '-'),
                                                           getattr(args, name)))
    if args.id_space < 2:
        p.error('--id-space: expected at least 2, got %g' % args.id_space)
    return args


def make_examples(args, count, rng):
    """(ids: count x features uint64, clicks: count float32)."""
    ranks = np.floor(np.power(args.id_space, rng.random((count, args.features))))
    ranks = np.minimum(ranks, args.id_space - 1).astype(np.uint64)
    feature = np.arange(args.features, dtype=np.uint64)[None, :]
    salt = np.uint64(args.seed) * np.uint64(0x2545F4914F6CDD1D)
    ids = mix(ranks ^ mix(feature ^ salt))
    # Hidden effects: a normal value per (feature, rank), from two hashes.
    h1 = mix(ids ^ np.uint64(0xD1B54A32D192ED03))
    h2 = mix(h1)
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    effect = np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
    logit = -1.5 + 0.9 * effect.sum(axis=1)
    clicks = (rng.random(count) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, clicks


def auc(scores, labels):
    """Area under the ROC curve by ranks (ties share their mean rank)."""
    order = np.argsort(scores, kind='mergesort')
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    s = scores[order]
    start = 0
    for i in range(1, len(s) + 1):  # average the ranks of tied scores
        if i == len(s) or s[i] != s[start]:
            ranks[order[start:i]] = (start + 1 + i) / 2.0
            start = i
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    if n_pos == 0 or n_neg == 0:
        return float('nan')
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class Model(object):
    def __init__(self, kv, args):
        self.kv, self.args = kv, args
        self.w1 = np.zeros((args.features * args.dim, args.hidden), np.float32)
        self.b1 = np.zeros(args.hidden, np.float32)
        self.w2 = np.zeros((args.hidden, 1), np.float32)
        self.b2 = np.zeros(1, np.float32)

    def pull(self, ids):
        """The batch's embeddings (batch x features*dim), and what to push them by."""
        parts, keep = [], []
        for f in range(self.args.features):
            uniq, inverse = np.unique(ids[:, f], return_inverse=True)
            rows = self.kv.pull_rows(f, uniq)
            parts.append(rows[inverse])
            keep.append((uniq, inverse))
        for key, arr in ((W1, self.w1), (B1, self.b1), (W2, self.w2), (B2, self.b2)):
            self.kv.pull(key, out=arr)
        return np.concatenate(parts, axis=1), keep

    def forward(self, x):
        h_pre = x @ self.w1 + self.b1
        h = np.maximum(h_pre, 0)
        z = (h @ self.w2 + self.b2)[:, 0]
        return h_pre, h, 1 / (1 + np.exp(-z))

    def step(self, ids, clicks):
        x, keep = self.pull(ids)
        h_pre, h, p = self.forward(x)
        n = len(clicks)
        dz = ((p - clicks) / n)[:, None].astype(np.float32)
        dw2 = h.T @ dz
        dh = (dz @ self.w2.T) * (h_pre > 0)
        dw1 = x.T @ dh
        dx = dh @ self.w1.T
        d = self.args.dim
        for f, (uniq, inverse) in enumerate(keep):
            g = np.zeros((len(uniq), d), np.float32)
            np.add.at(g, inverse, dx[:, f * d:(f + 1) * d])
            self.kv.push_rows(f, uniq, g)
        self.kv.push(W1, dw1.astype(np.float32))
        self.kv.push(B1, dh.sum(axis=0).astype(np.float32))
        self.kv.push(W2, dw2.astype(np.float32))
        self.kv.push(B2, dz.sum(axis=0).astype(np.float32))
        return p

    def predict(self, ids):
        x, _ = self.pull(ids)
        return self.forward(x)[2]


def main(argv):
    args = parse(argv)
    with tessera.KVStore('dist_sync') as kv:
        n, rank = kv.num_workers, kv.rank
        data_rng = np.random.default_rng(args.seed + 1)  # the same data everywhere
        train_ids, train_y = make_examples(args, args.train, data_rng)
        hold_ids, hold_y = make_examples(args, args.holdout, data_rng)
        train_ids, train_y = train_ids[rank::n], train_y[rank::n]
        steps = (args.train // n) // args.batch_size
        if steps == 0:
            raise SystemExit('ctr_hashed: --train %d over %d workers gives no batch of '
                             '--batch-size %d' % (args.train, n, args.batch_size))
        kv.set_optimizer('adagrad', lr=args.lr, rescale_grad=1.0 / n)
        for f in range(args.features):
            kv.init_hashed(f, args.dim, init='normal', std=0.01, seed=args.seed + f,
                           admit_after=args.admit_after, expire_after=args.expire_after,
                           capacity=args.capacity)
        model = Model(kv, args)
        init_rng = np.random.default_rng(args.seed + 2)
        model.w1[:] = (init_rng.standard_normal(model.w1.shape) /
                       np.sqrt(model.w1.shape[0])).astype(np.float32)
        model.w2[:] = (init_rng.standard_normal(model.w2.shape) /
                       np.sqrt(model.w2.shape[0])).astype(np.float32)
        for key, arr in ((W1, model.w1), (B1, model.b1), (W2, model.w2), (B2, model.b2)):
            kv.init(key, arr)  # rank 0's is stored
        order_rng = np.random.default_rng(args.seed + 3 + rank)
        started = time.monotonic()
        for epoch in range(args.epochs):
            order = order_rng.permutation(len(train_y))
            tic, seen, loss_sum = time.monotonic(), 0, 0.0
            for step in range(steps):
                batch = order[step * args.batch_size:(step + 1) * args.batch_size]
                p = model.step(train_ids[batch], train_y[batch])
                y = train_y[batch]
                eps = 1e-7
                loss_sum += float(-(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)).sum())
                seen += len(batch)
                if (step + 1) % args.log_every == 0:
                    print('Epoch[%d] Batch[%d] Speed: %.1f samples/sec logloss=%.4f'
                          % (epoch, step + 1, seen / (time.monotonic() - tic), loss_sum / seen),
                          flush=True)
            kv.barrier()  # the last round applied before anyone evaluates
            p = np.concatenate([model.predict(hold_ids[i:i + 5000])
                                for i in range(0, len(hold_y), 5000)])
            eps = 1e-7
            logloss = float(-(hold_y * np.log(p + eps) +
                              (1 - hold_y) * np.log(1 - p + eps)).mean())
            base = float(hold_y.mean())
            base_loss = -(base * np.log(base) + (1 - base) * np.log(1 - base))
            print('Epoch[%d] Train-logloss=%.4f' % (epoch, loss_sum / seen))
            print('Epoch[%d] Validation-logloss=%.4f Validation-auc=%.4f '
                  '(click rate %.3f; its constant predictor: logloss %.4f, auc 0.5)'
                  % (epoch, logloss, auc(p, hold_y), base, base_loss), flush=True)
            kv.barrier()  # every worker's holdout pulls before the next round
        print('rank %d of %d: %d steps in %.1f s' % (rank, n, steps * args.epochs,
                                                     time.monotonic() - started))
        distinct = [len(np.unique(train_ids[:, f])) for f in range(args.features)]
        print('rank %d: its share named %s distinct ids per feature (of %.0e possible); '
              'the servers keep rows only for those pushed %d times or more'
              % (rank, distinct, args.id_space, args.admit_after))
        print('rank %d final Validation-logloss=%.4f Validation-auc=%.4f'
              % (rank, logloss, auc(p, hold_y)), flush=True)


if __name__ == '__main__':
    main(sys.argv[1:])
