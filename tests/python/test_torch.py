"""tessera.torch: gradients pushed while backward still runs (a recording store,
in this process); a restarted worker resumes from the servers' weights and the
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
        def __init__(self, done):
            self.done = done

        def wait(self):
            self.done()


def test_gradients_are_pushed_while_backward_still_runs_and_step_writes_the_pulls():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 1))
    kv = RecordingStore()
    trainer = tessera.torch.Trainer(model, kv, 'sgd', lr=0.1, momentum=0.9)
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


def test_parameters_must_be_contiguous_float32():
    with pytest.raises(TypeError, match='expected a dense float32 CPU tensor'):
        tessera.torch.Trainer(torch.nn.Linear(2, 2).double(), RecordingStore())
    with pytest.raises(ValueError, match='no trainable parameters'):
        tessera.torch.Trainer(torch.nn.ReLU(), RecordingStore())


def checksums(out, steps):
    return re.findall(r'torch ok: rank \d of 2, %d steps, checksum=([0-9a-f]{16})' % steps, out)


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
