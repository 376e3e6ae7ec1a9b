#!/usr/bin/env python3
"""Trains a small CNN on Fashion-MNIST with PyTorch, data-parallel through a
Tessera job: every worker trains on its shard, gradients are pushed (2-bit
compressed) as backward produces them, the servers run SGD.

    tools/launch.py -n 2 -s 1 --launcher local python3 examples/fashion_mnist_cnn.py

Prints MXNet-style progress (Epoch[e] Batch[b] Speed: ... samples/sec
accuracy=..., Epoch[e] Validation-accuracy=..., Epoch[e] Time cost=...). Reads
the IDX files of Debian's dataset-fashion-mnist (no downloads); --data DIR for
others. A worker restarted by `launch.py --restarts` resumes at the step the
servers have from it, with the servers' weights.
"""
import argparse
import gzip
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import tessera
except ImportError:  # run from a checkout: the package is in ../python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'python'))
    import tessera
import tessera.torch


def read_idx(path):
    """An IDX file of unsigned bytes (gzip or not) as a NumPy array."""
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rb') as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError('%s: not an IDX file' % path)
    zero, dtype, ndim = struct.unpack('>HBB', data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError('%s: expected an IDX file of unsigned bytes' % path)
    dims = struct.unpack('>%dI' % ndim, data[4:4 + 4 * ndim])
    body = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if body.size != np.prod(dims):
        raise ValueError('%s: %d bytes of data, the header says %s' % (path, body.size, dims))
    return body.reshape(dims)


def load(data_dir, split, limit):
    prefix = 'train' if split == 'train' else 't10k'
    images = read_idx(os.path.join(data_dir, '%s-images-idx3-ubyte.gz' % prefix))
    labels = read_idx(os.path.join(data_dir, '%s-labels-idx1-ubyte.gz' % prefix))
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)  # N x 1 x 28 x 28
    return x, torch.from_numpy(labels.astype(np.int64))


def make_model(kind):
    if kind == 'mlp':  # tessera-worker's model (--hidden 256,128), for comparing the two
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128),
                             nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(model, x, y, batch=1000):
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            correct += (model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct / len(x)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default='cnn', choices=['cnn', 'mlp'],
                   help='mlp: the 784-256-128-10 MLP of tessera-worker')
    p.add_argument('--kv-store', default='dist_sync', choices=['dist_sync', 'dist_async'])
    p.add_argument('--epochs', type=int, default=6)
    p.add_argument('--batch-size', type=int, default=64, help='per worker')
    p.add_argument('--lr', type=float, default=0.3)
    p.add_argument('--momentum', type=float, default=0.0)
    p.add_argument('--wd', type=float, default=0.0001)
    p.add_argument('--lr-factor', type=float, default=0.3,
                   help='multiply the learning rate by this every --lr-step-epochs epochs')
    p.add_argument('--lr-step-epochs', type=int, default=3, help='0: a constant rate')
    p.add_argument('--gc-type', default='2bit', choices=['2bit', 'none'])
    p.add_argument('--gc-threshold', type=float, default=0.5)
    p.add_argument('--data', default=os.environ.get('FASHION_MNIST_DIR',
                                                    '/usr/share/datasets/fashion-mnist'))
    p.add_argument('--train-subset', type=int, default=0, help='first N training images')
    p.add_argument('--test-subset', type=int, default=0, help='first N test images')
    p.add_argument('--log-every', type=int, default=100, help='batches between progress lines')
    p.add_argument('--seed', type=int, default=1)
    args = p.parse_args()

    torch.set_num_threads(1)  # workers and servers share the machine's cores
    torch.manual_seed(args.seed)  # initial weights; the Trainer gives every worker rank 0's
    train_x, train_y = load(args.data, 'train', args.train_subset)
    test_x, test_y = load(args.data, 'test', args.test_subset)
    model = make_model(args.model)

    with tessera.KVStore(args.kv_store) as kv:
        rank, n = kv.rank, kv.num_workers
        if args.gc_type != 'none':
            kv.set_gradient_compression({'type': args.gc_type, 'threshold': args.gc_threshold})
        # The pushed gradient is that of the batch's summed loss (as MXNet's), and 2-bit
        # thresholds apply to it; the servers scale it to the mean over every worker's
        # samples of a round (dist_sync) or over the one batch of a push (dist_async).
        scale = 1.0 / (args.batch_size * (n if args.kv_store == 'dist_sync' else 1))
        steps_per_epoch = len(train_x) // n // args.batch_size
        schedule = {}
        if args.lr_step_epochs > 0:  # the servers count updates: one a round in dist_sync
            schedule = dict(lr_factor=args.lr_factor, lr_step=args.lr_step_epochs *
                            steps_per_epoch * (1 if args.kv_store == 'dist_sync' else n))
        trainer = tessera.torch.Trainer(model, kv, 'sgd', lr=args.lr, momentum=args.momentum,
                                        wd=args.wd, rescale_grad=scale, **schedule)
        if trainer.resume_step:
            print('restarted: resuming at step %d (epoch %d, batch %d)'
                  % (trainer.resume_step, trainer.resume_step // steps_per_epoch,
                     trainer.resume_step % steps_per_epoch), flush=True)
        step = 0
        for epoch in range(args.epochs):
            # The same shuffle on every worker; rank r takes every n-th sample.
            order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(
                args.seed * 1000 + epoch))[rank::n]
            start = window = time.monotonic()
            seen = correct = window_seen = window_correct = 0
            loss_sum = 0.0
            for b in range(steps_per_epoch):
                step += 1
                if step <= trainer.resume_step:
                    continue
                idx = order[b * args.batch_size:(b + 1) * args.batch_size]
                x, y = train_x[idx], train_y[idx]
                out = model(x)
                loss = F.cross_entropy(out, y, reduction='sum')
                loss.backward()  # pushes each gradient as soon as backward has it
                trainer.step()  # each layer's new weights are waited for before its next forward
                loss_sum += loss.item()
                hits = (out.argmax(1) == y).sum().item()
                seen, correct = seen + len(y), correct + hits
                window_seen, window_correct = window_seen + len(y), window_correct + hits
                if (b + 1) % args.log_every == 0:
                    now = time.monotonic()
                    print('Epoch[%d] Batch[%d] Speed: %.2f samples/sec accuracy=%.6f'
                          % (epoch, b + 1, window_seen / (now - window),
                             window_correct / window_seen), flush=True)
                    window, window_seen, window_correct = now, 0, 0
            if not seen:
                continue  # an epoch its earlier life completed
            took = time.monotonic() - start
            print('Epoch[%d] Train-accuracy=%.6f' % (epoch, correct / seen))
            print('Epoch[%d] Train-cross-entropy=%.6f' % (epoch, loss_sum / seen))
            if rank == 0:
                print('Epoch[%d] Validation-accuracy=%.6f'
                      % (epoch, accuracy(model, test_x, test_y)))
            print('Epoch[%d] Time cost=%.3f' % (epoch, took), flush=True)
        trainer.wait_all()  # the last step's pushes and pulls
        print('rank %d: %d steps, %.1f s of them waiting for the servers (trainer.wait_seconds)'
              % (rank, trainer.steps, trainer.wait_seconds), flush=True)


if __name__ == '__main__':
    main()
