"""tessera.torch: trains a torch.nn.Module data-parallel through a Tessera job,
with the optimizer running on the servers (MXNet Gluon's Trainer with
update_on_kvstore=True).

    import tessera, tessera.torch
    kv = tessera.KVStore("dist_sync")
    trainer = tessera.torch.Trainer(model, kv, "sgd", lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(batches):
        if step < trainer.resume_step:      # a worker restarted by launch.py --restarts
            continue
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()                      # each gradient is pushed as backward produces it
        trainer.step()                       # the new weights are now in the parameters
    kv.close()

How: every trainable parameter is a key (key_offset, key_offset+1, ... in
module.parameters() order, so every worker must build the same model). The
constructor sets the optimizer, inits every key (rank 0's initial weights are
stored) and pulls them, so every worker starts from rank 0's weights; a worker
restarted into a running job pulls the servers' current weights instead and
resume_step says how many steps its earlier life completed. During backward, a
hook on each parameter's gradient accumulator fires once its gradient is in
p.grad and starts the push of that buffer and the pull of the parameter
(tessera_kv_push_async / pull_async: nothing is copied, the GIL is released),
so the pushes of the last layers travel while backward still runs on the first
ones, as tessera-worker does. step() waits for them all; the pulled values are
written into the parameters inside that wait, never during backward.

Rules: every worker calls backward() then step() the same number of times (in
dist_sync a round needs every worker's push of every key); one backward per
step. A parameter that got no gradient in a step is pushed zeros. Gradients are
averaged over workers in dist_sync (rescale_grad=1/num_workers unless given),
so a loss averaged over the local batch keeps its single-process meaning. Only
parameters are kept in the store: buffers such as BatchNorm's running
statistics stay per worker.

Elastic jobs (TESSERA_ELASTIC, launch.py --elastic MIN:MAX): a worker may leave
between steps with kv.leave() (e.g. when it gets SIGTERM; install the handler
yourself) or die; the other workers' rounds then complete without it and the
servers scale each round's sum by num_workers / pushes, so the update is still
the mean gradient of the workers that pushed. A worker started with the job's
keys and the scheduler's address while the job runs joins it (below MAX):
Trainer's pull of the parameters gives it the current weights, and its first
step's pushes enter every key's rounds at one round (its rank, kv.rank, may be
one that left or one from DMLC_NUM_WORKER up). Which data each worker reads
stays the script's business: a worker that left takes its shard with it, and a
joiner should pick a shard from its rank (e.g. rank % DMLC_NUM_WORKER with its
own shuffling seed, as tessera-worker does).

Errors: TypeError / ValueError for parameters that are not contiguous float32
CPU tensors; tessera.TesseraError from the store.
"""
import time

import torch

from .kvstore import KVStore, TesseraError


class Trainer:
    """See the module's documentation.

    module: a torch.nn.Module (or an iterable of parameters).
    kvstore: a tessera.KVStore, or a type ("dist_sync", "dist_async") to create one.
    optimizer: the servers' optimizer, a name ("sgd") with keyword parameters or a
        whole spec ("sgd lr=0.1 momentum=0.9"); None leaves the store's as it is.
    key_offset: the first key (keys key_offset .. key_offset + #parameters - 1).
    """

    def __init__(self, module, kvstore='dist_sync', optimizer='sgd', key_offset=0,
                 **optimizer_params):
        params = module.parameters() if isinstance(module, torch.nn.Module) else module
        self._params = []
        seen = set()
        for p in params:
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            self._params.append(p)
        if not self._params:
            raise ValueError('Trainer: the module has no trainable parameters')
        for i, p in enumerate(self._params):
            if p.dtype != torch.float32 or p.device.type != 'cpu' or p.layout != torch.strided:
                raise TypeError('Trainer: parameter %d: expected a dense float32 CPU tensor, got '
                                '%s on %s' % (i, p.dtype, p.device))
            if not p.is_contiguous():
                raise ValueError('Trainer: parameter %d is not contiguous; the pulled weights '
                                 'are written into its memory' % i)
        self.kv = KVStore(kvstore) if isinstance(kvstore, str) else kvstore
        self._keys = [key_offset + i for i in range(len(self._params))]
        if optimizer is not None:
            spec_has_rescale = 'rescale_grad' in optimizer
            if (self.kv.type in ('dist_sync', 'dist_device_sync') and not spec_has_rescale
                    and 'rescale_grad' not in optimizer_params
                    and (optimizer.split() or ['none'])[0] != 'none'):
                optimizer_params['rescale_grad'] = 1.0 / self.kv.num_workers
            self.kv.set_optimizer(optimizer, **optimizer_params)
        with torch.no_grad():
            for key, p in zip(self._keys, self._params):
                self.kv.init(key, p.detach())
            self.kv.pull(self._keys, out=[p.detach() for p in self._params])
        self.resume_step = self.kv.resume_round()
        self.steps = 0
        self.wait_seconds = 0.0  # in step(), waiting for pushes and pulls to complete
        self._ops = []
        self._pushed = [False] * len(self._params)
        self._zeros = {}
        self._accumulators = []  # keeps the hooked nodes (and so the hooks) alive
        for i, p in enumerate(self._params):
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._hook(i))
            self._accumulators.append(acc)

    @property
    def params(self):
        """The parameters, in key order."""
        return list(self._params)

    @property
    def keys(self):
        return list(self._keys)

    def _hook(self, i):
        def ready(*unused):
            self._start(i, self._params[i].grad)
        return ready

    def _start(self, i, grad):
        if self._pushed[i]:
            raise TesseraError('FAILED_PRECONDITION: parameter %d (key %d) got a second '
                               'gradient before step(); call trainer.step() after each '
                               'backward()' % (i, self._keys[i]))
        if grad.layout != torch.strided:
            raise TypeError('Trainer: parameter %d: sparse gradients are not supported' % i)
        if not grad.is_contiguous():
            grad = grad.contiguous()  # a push loses nothing; only unusual layouts get here
        self._pushed[i] = True
        key, p = self._keys[i], self._params[i]
        self._ops.append(self.kv.push_async(key, grad))
        self._ops.append(self.kv.pull_async(key, p.detach()))

    def step(self):
        """Waits for this step's pushes and pulls: afterwards the parameters hold
        the servers' new weights and every p.grad is None."""
        for i, p in enumerate(self._params):
            if not self._pushed[i]:
                grad = p.grad
                if grad is None:
                    grad = self._zeros.get(i)
                    if grad is None:
                        grad = self._zeros[i] = torch.zeros_like(p, memory_format=
                                                                 torch.contiguous_format)
                self._start(i, grad)
        ops, self._ops = self._ops, []
        first_error = None
        start = time.monotonic()
        for op in ops:
            try:
                op.wait()
            except TesseraError as e:
                first_error = first_error or e
        self.wait_seconds += time.monotonic() - start
        self._pushed = [False] * len(self._params)
        for p in self._params:
            p.grad = None
        if first_error is not None:
            raise first_error
        self.steps += 1

    def zero_grad(self, set_to_none=True):
        """Nothing to do: step() leaves every p.grad None (kept for the
        torch.optim habit)."""
