#!/usr/bin/env python3
"""One worker of PyTorch DDP (gloo) training the quick-start MLP: the peer that
tools/bench/ddp_compare.py measures Tessera's quick-start job against.

The same job as tools/quickstart.sh's tessera-worker flags: MLP 784-256-128-10
(ReLU), Fashion-MNIST scaled to [0, 1], batch 128 per worker, each worker the
images i with i % world == rank, shuffled per epoch, SGD lr 0.3 without momentum
on the mean gradient of all workers' samples (DDP averages; Tessera's dist_sync
sums and rescales by 1 / (batch x workers): the same step), a test-set evaluation
after every epoch, one CPU thread per worker (tessera-worker runs one OpenBLAS
thread).

    ddp_mlp.py --rank R --world W --master ADDR:PORT [--epochs 3] [--hook none]
        [--data /usr/share/datasets/fashion-mnist] [--out FILE.json]

--hook: none (DDP's own all-reduce of 25 MB buckets: the whole model is one
bucket), fp16 (torch's fp16_compress_hook: half the bytes), powersgd (its
PowerSGD hook, rank 2, compressing from the second step, error feedback on).

Writes one JSON object (--out, else stdout): wall_seconds from the first step to
the end of the last epoch's evaluation (what tessera-worker's --metrics-out calls
wall_seconds), test_accuracy after the last epoch, steps, the hook.
"""
import argparse
import gzip
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def load_idx(path):
    with gzip.open(path, 'rb') as f:
        data = f.read()
    magic = struct.unpack('>I', data[:4])[0]
    ndim = magic & 0xff
    dims = struct.unpack('>' + 'I' * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir, kind):
    images = load_idx(os.path.join(data_dir, '%s-images-idx3-ubyte.gz' % kind))
    labels = load_idx(os.path.join(data_dir, '%s-labels-idx1-ubyte.gz' % kind))
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rank', type=int, required=True)
    p.add_argument('--world', type=int, required=True)
    p.add_argument('--master', required=True, help='ADDR:PORT of rank 0')
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--lr', type=float, default=0.3)
    p.add_argument('--hook', default='none', choices=('none', 'fp16', 'powersgd'))
    p.add_argument('--data', default=os.environ.get('FASHION_MNIST_DIR',
                                                    '/usr/share/datasets/fashion-mnist'))
    p.add_argument('--out')
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(42)
    addr, port = args.master.rsplit(':', 1)
    dist.init_process_group('gloo', init_method='tcp://%s:%s' % (addr, port),
                            rank=args.rank, world_size=args.world)
    x_train, y_train = load(args.data, 'train')
    x_test, y_test = load(args.data, 't10k')
    shard = torch.arange(args.rank, len(x_train), args.world)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    ddp = DDP(model)
    if args.hook == 'fp16':
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == 'powersgd':
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.0)
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = len(shard) // args.batch  # the same on every rank
    gen = torch.Generator().manual_seed(1000 + args.rank)
    dist.barrier()
    start = time.monotonic()
    steps = 0
    accuracy = 0.0
    for epoch in range(args.epochs):
        order = shard[torch.randperm(len(shard), generator=gen)]
        ddp.train()
        for b in range(steps_per_epoch):
            idx = order[b * args.batch:(b + 1) * args.batch]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            steps += 1
        ddp.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        print('[ddp %d] Epoch[%d] Validation-accuracy=%.4f' % (args.rank, epoch, accuracy),
              flush=True)
    wall = time.monotonic() - start
    dist.barrier()
    dist.destroy_process_group()
    record = {'rank': args.rank, 'wall_seconds': wall, 'test_accuracy': accuracy,
              'steps': steps, 'hook': args.hook, 'torch': torch.__version__}
    text = json.dumps(record)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text + '\n')
    else:
        print(text)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
