"""tessera.torch: gradients pushed while backward still runs (a recording store,
in this process); with wait='layer' each module waits for its own pulls just
before its forward and step() for none, and a job ends with the same weights as
with wait='step'; a restarted worker resumes from the servers' weights and the
job ends with the weights of a run without the fault; the PyTorch example
trains its CNN on Fashion-MNIST to a stated loss in a short run."""
import os
import re

import pytest

torch = pytest.importorskip('torch')

import tessera.torch  # noqa: E402  (after the skip: needs torch)
from conftest import DATA, EXAMPLES, HERE  # noqa: E402

CHECK = os.path.join(HERE, 'torch_check.py')
# The example's short run below: 2 epochs of the first 6,000 images, 2 workers, 2-bit
# pushes. From ln(10) = 2.30, it measured a training cross-entropy of 0.71 in its second
# epoch and 0.681 validation accuracy on the first 2,000 test images (the same on every run
# here: the sums are taken in rank order); the bounds leave room for other CPUs' rounding.
LOSS_AFTER_TWO_EPOCHS = 0.9
ACCURACY_AFTER_TWO_EPOCHS = 0.6


class RecordingStore:
    """Stands in for tessera.KVStore and records the order of events; a pull's
    values (the key, repeated) land in its output only when it is waited for,
    as the C API's do."""

    type, rank, num_workers = 'dist_sync', 0, 2

    def __init__(self):
        self.events = []
        self.optimizer = None

    def set_optimizer(self, name, **params):
        self.optimizer = (name, params)

    def init(self, key, value):
        self.events.append(('init', key))

    def pull(self, keys, out):
        self.events.append(('pull', tuple(keys)))

    def resume_round(self):
        return 0

    def push_async(self, key, grad):
        self.events.append(('push', key))
        return self.Op(lambda: self.events.append(('push done', key)))

    def pull_async(self, key, out):
        def land():
            out.fill_(float(key))
            self.events.append(('pull done', key))
        return self.Op(land)

    class Op:
        """As tessera's Op: done once waited for; a second wait is an error."""

        def __init__(self, land):
            self._land = land
            self.done = False

        def wait(self):
            assert not self.done, 'an operation waited for twice'
            self.done = True
            self._land()


def three_layers():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_gradients_are_pushed_while_backward_still_runs_and_step_writes_the_pulls():
    model = three_layers()
    kv = RecordingStore()
    trainer = tessera.torch.Trainer(model, kv, 'sgd', lr=0.1, momentum=0.9, wait='step')
    assert kv.optimizer == ('sgd', {'lr': 0.1, 'momentum': 0.9, 'rescale_grad': 0.5})
    assert trainer.keys == [0, 1, 2, 3, 4, 5]  # W and b of three layers
    assert kv.events == [('init', k) for k in range(6)] + [('pull', (0, 1, 2, 3, 4, 5))]
    kv.events.clear()
    x = torch.randn(4, 8, requires_grad=True)  # its gradient is the last thing backward makes
    x.register_hook(lambda g: kv.events.append(('backward reaches the input', None)))
    model(x).sum().backward()
    end = kv.events.index(('backward reaches the input', None))
    pushed_before = {k for what, k in kv.events[:end] if what == 'push'}
    assert {2, 3, 4, 5} <= pushed_before, kv.events  # the last two layers, during backward
    assert not any(what.endswith('done') for what, _ in kv.events), kv.events
    assert all(p.grad is not None for p in model.parameters())
    trainer.step()
    assert sorted(k for what, k in kv.events if what == 'push') == list(range(6))
    for key, p in enumerate(model.parameters()):
        assert torch.all(p.detach() == float(key)), 'parameter %d lacks its pulled value' % key
        assert p.grad is None
    # A second backward before step() is a mistake that would break rounds.
    model(x).sum().backward()
    with pytest.raises(tessera.TesseraError, match='second gradient before step'):
        model(x).sum().backward()


def test_each_layer_waits_for_its_own_pulls_just_before_its_forward():
    # wait='layer' (the default): step() waits for nothing; the next forward waits
    # for each Linear's push and pull just before that Linear runs, while the later
    # layers' are still pending.
    model = three_layers()
    kv = RecordingStore()
    trainer = tessera.torch.Trainer(model, kv, 'sgd', lr=0.1)
    assert trainer.wait_mode == 'layer'
    linears = [model[0], model[2], model[4]]
    seen = []  # per Linear's forward: (its weight, pending ops of each layer's keys)

    def record(j):
        def hook(module, inputs):  # runs after the Trainer's hook (registered later)
            kv.events.append(('forward', j))
            seen.append((module.weight.detach().clone(),
                         [len(trainer.pending_of(k)) for k in range(6)]))
        return hook

    for j, layer in enumerate(linears):
        layer.register_forward_pre_hook(record(j))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    seen.clear()
    kv.events.clear()
    trainer.step()
    assert trainer.steps == 1
    assert not any(what.endswith('done') for what, _ in kv.events), kv.events
    assert trainer.waits == 0 and trainer.pending == 12  # a push and a pull per key
    assert all(p.grad is None for p in model.parameters())
    assert torch.all(model[0].weight.detach() != 0.0)  # not yet the pulled value (key 0)
    model(x)
    order = [e for e in kv.events if e[0] in ('forward', 'pull done', 'push done')]
    assert order == [('push done', 0), ('pull done', 0), ('push done', 1), ('pull done', 1),
                     ('forward', 0),
                     ('push done', 2), ('pull done', 2), ('push done', 3), ('pull done', 3),
                     ('forward', 1),
                     ('push done', 4), ('pull done', 4), ('push done', 5), ('pull done', 5),
                     ('forward', 2)], order
    for j, (weight, pending) in enumerate(seen):
        assert torch.all(weight == float(2 * j)), 'layer %d ran without its pulled weight' % j
        assert pending == [0] * (2 * j + 2) + [2] * (4 - 2 * j), (j, pending)
    assert trainer.waits == 12 and trainer.pending == 0
    # A second forward (evaluation, say) finds nothing to wait for.
    model(x)
    assert trainer.waits == 12
    assert trainer.wait_seconds >= 0


def test_step_mode_waits_for_all_in_step_and_wait_all_and_params_drain_layer_mode():
    x = torch.randn(4, 8)
    counts = {}
    for wait in ('step', 'layer'):
        model = three_layers()
        kv = RecordingStore()
        trainer = tessera.torch.Trainer(model, kv, wait=wait)
        model(x).sum().backward()
        trainer.step()
        counts[wait] = (trainer.waits, trainer.pending)
        if wait == 'layer':
            trainer.wait_all()
            assert (trainer.waits, trainer.pending) == (12, 0)
            trainer.wait_all()  # nothing left: nothing waited twice
            model(x).sum().backward()
            trainer.step()
            assert trainer.pending == 12
            params = trainer.params  # waits: the weights it gives are the servers'
            assert trainer.pending == 0
        else:
            params = trainer.params
        for key, p in enumerate(params):
            assert torch.all(p.detach() == float(key)), (wait, key)
    assert counts == {'step': (12, 0), 'layer': (0, 12)}


def test_state_dict_waits_and_unhooked_parameters_are_waited_for_in_step():
    model = three_layers()
    kv = RecordingStore()
    trainer = tessera.torch.Trainer(model, kv)
    model(torch.randn(4, 8)).sum().backward()
    trainer.step()
    assert trainer.pending == 12
    state = model.state_dict()
    assert trainer.pending == 0
    assert torch.all(state['4.bias'] == 5.0)
    # A list of parameters has no modules to hook: step() waits for them.
    model = three_layers()
    trainer = tessera.torch.Trainer(list(model.parameters()), RecordingStore())
    model(torch.randn(4, 8)).sum().backward()
    trainer.step()
    assert (trainer.waits, trainer.pending) == (12, 0)


def test_a_module_left_out_of_a_forward_has_its_last_pull_waited_before_its_next_push():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 1)
            self.b = torch.nn.Linear(3, 1)

        def forward(self, x, head):
            return (self.a if head == 'a' else self.b)(x)

    model = TwoHeads()
    kv = RecordingStore()
    trainer = tessera.torch.Trainer(model, kv)
    x = torch.randn(2, 3)
    for head in ('a', 'a', 'b'):
        model(x, head).sum().backward()
        trainer.step()  # b's keys (2, 3) get zeros; their last pull waited before
    assert trainer.steps == 3
    pushes = [k for what, k in kv.events if what == 'push']
    assert pushes.count(2) == 3 and pushes.count(3) == 3
    trainer.wait_all()
    assert trainer.pending == 0


def test_wait_must_be_layer_or_step():
    with pytest.raises(ValueError, match=r"wait must be 'layer' .* or 'step' .*got 'all'"):
        tessera.torch.Trainer(torch.nn.Linear(2, 2), RecordingStore(), wait='all')
    with pytest.raises(ValueError, match='got None'):
        tessera.torch.Trainer(torch.nn.Linear(2, 2), RecordingStore(), wait=None)


def test_parameters_must_be_contiguous_float32():
    with pytest.raises(TypeError, match='expected a dense float32 CPU tensor'):
        tessera.torch.Trainer(torch.nn.Linear(2, 2).double(), RecordingStore())
    with pytest.raises(ValueError, match='no trainable parameters'):
        tessera.torch.Trainer(torch.nn.ReLU(), RecordingStore())


def checksums(out, steps):
    return re.findall(r'torch ok: rank \d of 2, %d steps, checksum=([0-9a-f]{16})' % steps, out)


def test_waiting_layer_by_layer_ends_with_the_weights_of_waiting_per_step(job):
    # dist_sync: the rounds and the weights each forward reads are the same whether a
    # layer's pulls are waited for before its forward or all of them in step().
    steps = 30
    out = {}
    for wait in ('step', 'layer'):
        job.env['TORCH_CHECK_WAIT'] = wait
        code, out[wait], _ = job.python(2, 1, CHECK, steps, timeout=120)
        assert code == 0, out[wait]
    want = checksums(out['step'], steps)
    assert len(want) == 2 and want[0] == want[1], out['step']
    assert checksums(out['layer'], steps) == want, out['layer']
    # step() waited for every op with 'step' and for none with 'layer': there the
    # forward pre-hooks did (2 Linears x 2 keys x push and pull, a step), and the
    # last step's at the end.
    for wait, in_step in (('step', 8 * steps), ('layer', 0)):
        got = re.findall(r'rank \d: wait=(\w+), (\d+) ops waited for in step\(\), (\d+) in all',
                         out[wait])
        assert got == [(wait, str(in_step), str(8 * steps))] * 2, out[wait]


def test_rank_0s_weights_are_stored_and_a_restarted_worker_resumes_from_the_servers(job):
    # A restarted worker imports torch before it rejoins: more than the 2 s time-out
    # the other tests use on a busy machine.
    job.env['PS_HEARTBEAT_TIMEOUT'] = '20'
    steps = 30
    code, clean, _ = job.python(2, 1, CHECK, steps, timeout=120)
    assert code == 0, clean
    want = checksums(clean, steps)
    assert len(want) == 2 and want[0] == want[1], clean
    # Every worker starts from rank 0's initial weights, not its own.
    starts = dict((int(r), (own, start)) for r, own, start in re.findall(
        r'rank (\d) life 0: own initial weights (\w+), starts from (\w+)', clean))
    assert len(starts) == 2 and starts[0][0] != starts[1][0], clean
    assert starts[0][1] == starts[1][1] == starts[0][0], clean
    code, out, _ = job.python(2, 1, CHECK, steps, 9, timeout=120, restarts=1)
    assert code == 0, out
    assert re.search(r'launch.py: worker \d \(pid \d+\) killed by signal SIGKILL; restarting it',
                     out), out
    assert 'rank 1: life 1 resumes at step 10' in out, out
    # Its new life's own initial weights are replaced by the servers' current ones.
    life1 = re.findall(r'rank 1 life 1: own initial weights (\w+), starts from (\w+)', out)
    assert len(life1) == 1 and life1[0][0] != life1[0][1], out
    assert checksums(out, steps) == want, out
    applied = re.findall(r'pushes applied \d+ \(([^)]*)\)', out)
    assert applied and all(int(n) == 2 * steps
                           for line in applied for n in re.findall(r'key \d+: (\d+)', line)), out


@pytest.mark.skipif(not os.path.exists(os.path.join(DATA, 'train-images-idx3-ubyte.gz')),
                    reason='Fashion-MNIST is not installed (dataset-fashion-mnist)')
def test_cnn_example_lowers_its_loss_on_fashion_mnist_with_two_bit_pushes(job):
    code, out, _ = job.python(2, 1, os.path.join(EXAMPLES, 'fashion_mnist_cnn.py'),
                              '--epochs', 2, '--train-subset', 6000, '--test-subset', 2000,
                              '--log-every', 20, timeout=240)
    assert code == 0, out
    assert re.search(r'Epoch\[0\] Batch\[20\] Speed: [\d.]+ samples/sec accuracy=[\d.]+', out), out
    losses = [float(v) for v in re.findall(r'Epoch\[\d\] Train-cross-entropy=([\d.]+)', out)]
    assert len(losses) == 4, out  # 2 epochs x 2 workers
    assert max(losses[-2:]) < LOSS_AFTER_TWO_EPOCHS, out
    accuracy = [float(v) for v in re.findall(r'Epoch\[1\] Validation-accuracy=([\d.]+)', out)]
    assert len(accuracy) == 1 and accuracy[0] > ACCURACY_AFTER_TWO_EPOCHS, out


def test_two_workers_in_a_local_group_train_to_the_same_bits_with_half_the_pushes(job):
    # TESSERA_LOCAL_GROUP=1 (docs/local_groups.md): the two workers of this host sum
    # their gradients in shared memory and push each key once. With two members the
    # group's float32 sum a + b is the server's exactly rounded sum of the two pushes,
    # so the job ends with the same weights as without the group.
    steps = 30
    code, flat, _ = job.python(2, 1, CHECK, steps, timeout=120)
    assert code == 0, flat
    job.env['TESSERA_LOCAL_GROUP'] = '1'
    code, grouped, _ = job.python(2, 1, CHECK, steps, timeout=120)
    assert code == 0, grouped
    assert ('2 worker(s) asked to group with the workers on their host '
            '(TESSERA_LOCAL_GROUP=1): 2 in 1 group(s)') in grouped, grouped
    want = checksums(flat, steps)
    assert len(want) == 2 and checksums(grouped, steps) == want, grouped
    applied = re.findall(r'pushes applied \d+ \(([^)]*)\)', grouped)
    assert applied and all(int(n) == steps
                           for line in applied for n in re.findall(r'key \d+: (\d+)', line)), \
        grouped
