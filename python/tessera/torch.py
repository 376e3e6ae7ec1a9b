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
        trainer.step()                       # each layer's new weights: before its next forward
    trainer.wait_all()                       # all of them, e.g. before saving the model
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
ones, as tessera-worker does. The pulled values are written into a parameter
only inside the wait for its pull, never during backward.

When those waits happen (wait=):
- 'layer' (the default): step() does not wait. A forward pre-hook on each
  module that owns parameters (module.parameters(recurse=False)) waits for
  the push and pull of that module's own parameters just before its forward
  runs, so the first layers compute while the last layers' weights still
  travel (tessera-worker --wait-pulls layer). Parameters that no submodule of
  the module owns (a Trainer given a list of parameters) are waited for in
  step(). Between step() and the next forward a parameter may still hold its
  previous value: call wait_all() before reading the weights outside a
  forward (the params property, state_dict() of the module given and
  evaluation through forward already do). It assumes each parameter is read
  only in the forward of a module that owns it (or after it in the pass); a
  model that reads a submodule's weights from elsewhere should use 'step'.
- 'step': step() waits for every push and pull of the step, as before.
In dist_sync both end with the same weights, to the bit.

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
    wait: 'layer' (each module's parameters waited for just before its forward)
        or 'step' (everything waited for in step()).

    wait_seconds: seconds spent waiting for pushes and pulls (in step(), in the
    forward pre-hooks and in wait_all()); waits: how many operations were waited
    for by this Trainer.
    """

    WAIT_MODES = ('layer', 'step')

    def __init__(self, module, kvstore='dist_sync', optimizer='sgd', key_offset=0,
                 wait='layer', **optimizer_params):
        if not isinstance(wait, str) or wait not in self.WAIT_MODES:
            raise ValueError("Trainer: wait must be 'layer' (each module's parameters "
                             "waited for before its forward) or 'step' (all in step()), "
                             "got %r" % (wait,))
        self.wait_mode = wait
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
        self.wait_seconds = 0.0  # waiting for pushes and pulls to complete
        self.waits = 0  # operations waited for
        self._pending = [[] for _ in self._params]  # per parameter: its Ops not waited for
        self._pushed = [False] * len(self._params)
        self._zeros = {}
        self._accumulators = []  # keeps the hooked nodes (and so the hooks) alive
        for i, p in enumerate(self._params):
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._hook(i))
            self._accumulators.append(acc)
        self._hook_handles = []
        # Parameters whose ops step() waits for: all with wait='step', those no
        # module's pre-hook waits for with wait='layer'.
        self._waited_in_step = list(range(len(self._params)))
        if wait == 'layer' and isinstance(module, torch.nn.Module):
            self._waited_in_step = self._register_forward_waits(module)

    def _register_forward_waits(self, module):
        """A forward pre-hook on every module owning parameters (its own, not its
        children's) that waits for them; and a state_dict hook on `module` that
        waits for all. Returns the indexes of the parameters no module owns."""
        index = {id(p): i for i, p in enumerate(self._params)}
        hooked = set()
        for m in module.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if own:
                self._hook_handles.append(m.register_forward_pre_hook(self._pre_forward(own)))
                hooked.update(own)
        # state_dict() shares the parameters' memory: waiting after it has been
        # made still lands the pulled values in what it returns.
        if hasattr(module, '_register_state_dict_hook'):
            self._hook_handles.append(module._register_state_dict_hook(
                lambda *unused: self.wait_all()))
        return [i for i in range(len(self._params)) if i not in hooked]

    def _pre_forward(self, own):
        def wait(*unused):
            self._wait_for(own)
        return wait

    @property
    def params(self):
        """The parameters, in key order, once their pending pulls are in (wait_all)."""
        self.wait_all()
        return list(self._params)

    @property
    def keys(self):
        return list(self._keys)

    @property
    def pending(self):
        """How many pushes and pulls were started and not yet waited for."""
        return sum(1 for ops in self._pending for op in ops if not op.done)

    def pending_of(self, i):
        """The Ops of parameter i (key order) not yet waited for."""
        return [op for op in self._pending[i] if not op.done]

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
        # The last step's pull of this parameter, if no forward waited for it (a
        # module not called in this step's forward).
        self._wait_for([i])
        self._pushed[i] = True
        key, p = self._keys[i], self._params[i]
        self._pending[i].append(self.kv.push_async(key, grad))
        self._pending[i].append(self.kv.pull_async(key, p.detach()))

    def _wait_for(self, indexes):
        """Waits for the pending Ops of the parameters `indexes` (all of them, even
        after an error), counting the time; raises the first error."""
        first_error = None
        start = time.monotonic()
        for i in indexes:
            ops, self._pending[i] = self._pending[i], []
            for op in ops:
                if op.done:  # waited for by the store's close() or leave()
                    continue
                self.waits += 1
                try:
                    op.wait()
                except TesseraError as e:
                    first_error = first_error or e
        self.wait_seconds += time.monotonic() - start
        if first_error is not None:
            raise first_error

    def wait_all(self):
        """Waits for every push and pull not yet waited for: afterwards every
        parameter holds the servers' latest weights. Raises the first error."""
        self._wait_for(range(len(self._params)))

    synchronize = wait_all

    def step(self):
        """Ends the step: pushes zeros for parameters without a gradient and sets
        every p.grad to None. With wait='step' it waits for the step's pushes and
        pulls (afterwards the parameters hold the servers' new weights); with
        wait='layer' it waits only for parameters no module's forward waits for,
        and the others' new weights land just before their module's next forward
        (or at wait_all())."""
        for i, p in enumerate(self._params):
            if not self._pushed[i]:
                grad = p.grad
                if grad is None:
                    grad = self._zeros.get(i)
                    if grad is None:
                        grad = self._zeros[i] = torch.zeros_like(p, memory_format=
                                                                 torch.contiguous_format)
                self._start(i, grad)
        self._pushed = [False] * len(self._params)
        for p in self._params:
            p.grad = None  # the pushes keep their gradients alive until waited for
        self._wait_for(self._waited_in_step)
        self.steps += 1

    def zero_grad(self, set_to_none=True):
        """Nothing to do: step() leaves every p.grad None (kept for the
        torch.optim habit)."""
