"""A PyTorch worker for the tests beside it: a small regression model trained
through tessera.torch.Trainer in dist_sync on data that depends only on (step,
rank), so any run of it ends with the same weights.

    torch_check.py STEPS [KILL_AT]

TORCH_CHECK_WAIT=layer|step is the Trainer's wait= (default layer).
Prints the checksums of its own initial weights and of those it starts from,
how many operations step() waited for, then "torch ok: rank R of N, S steps, checksum=HEX" (SHA-256 of the final
parameters). Initial weights differ per rank and life. With KILL_AT, rank 1 SIGKILLs itself in its first life
(TESSERA_RESTART_COUNT unset or 0) right after the step KILL_AT (from 0) and its pushes; its
next life (launch.py --restarts) resumes at the step the servers give it.
"""
import hashlib
import os
import signal
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import tessera
import tessera.torch

steps = int(sys.argv[1])
kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1
life = int(os.environ.get('TESSERA_RESTART_COUNT') or 0)
torch.set_num_threads(1)


def checksum(params):
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 1))
with tessera.KVStore('dist_sync') as kv:
    # Initial weights of this rank and life: the Trainer must replace them with
    # rank 0's (first lives) or the servers' (a later life).
    torch.manual_seed(100 + 10 * kv.rank + life)
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    own = checksum(model.parameters())
    trainer = tessera.torch.Trainer(model, kv, 'sgd', lr=0.05, momentum=0.9,
                                    wait=os.environ.get('TORCH_CHECK_WAIT', 'layer'))
    print('rank %d life %d: own initial weights %s, starts from %s'
          % (kv.rank, life, own, checksum(trainer.params)), flush=True)
    if life:
        print('rank %d: life %d resumes at step %d' % (kv.rank, life, trainer.resume_step),
              flush=True)
    in_step = 0  # operations step() waited for
    for step in range(trainer.resume_step, steps):
        g = torch.Generator().manual_seed(1000 * step + kv.rank)
        x = torch.randn(32, 20, generator=g)
        F.mse_loss(model(x), 0.1 * x.sum(1, keepdim=True)).backward()
        before = trainer.waits
        trainer.step()
        in_step += trainer.waits - before
        if kv.rank == 1 and life == 0 and step == kill_at:
            # Dies once this step's pushes are in (wait='layer' leaves them in
            # flight after step()), so its next life resumes at the next step.
            trainer.wait_all()
            os.kill(os.getpid(), signal.SIGKILL)
    trainer.wait_all()
    print('rank %d: wait=%s, %d ops waited for in step(), %d in all'
          % (kv.rank, trainer.wait_mode, in_step, trainer.waits), flush=True)
    print('torch ok: rank %d of %d, %d steps, checksum=%s'
          % (kv.rank, kv.num_workers, steps, checksum(trainer.params)), flush=True)
