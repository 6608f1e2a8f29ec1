"""companion.activation_offload: the host copies, and saved tensors offloaded in forward, beside
torch.autograd.graph.save_on_cpu, the API it mirrors: the same gradients, the same options."""
import pytest
import torch
import torch.utils.checkpoint as tuc

from companion import checkpointing
from companion.activation_offload import can_pin, offload_activations, to_device, to_host
from companion.checkpointing import saved_for_backward
from companion.memory import track
from companion.models import GPT, make_tokens


def _gpt(seed=0, dtype=torch.float32):
    return GPT(32, 16, 32, 2, 4, seed=seed, dtype=dtype)


def _data(seed=0):
    return make_tokens(6, 16, vocab=32, seed=seed)


@pytest.mark.parametrize("fn", [to_host, lambda t: to_device(t, "cpu")])
def test_to_host_and_to_device_reject_what_is_not_a_tensor(fn):
    with pytest.raises(TypeError, match="tensor"):
        fn([1, 2])


def test_to_host_is_counted_on_the_host_and_to_device_makes_a_new_tensor():
    x = torch.randn(5, 7).t()                              # not contiguous
    with track("cpu") as t:
        h = to_host(x, dtype=torch.float64)
        d = to_device(h, "cpu")
    assert (t.host_current, t.current) == (35 * 8, 35 * 8)
    assert torch.equal(d, x.double()) and d.untyped_storage().data_ptr() != h.data_ptr()


# ---------------------------------------------------------------- activation offload

def _loss_and_grads(model, x, y, context):
    model.zero_grad(set_to_none=True)
    with context:
        loss = model.loss(x, y)
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def test_activation_offload_gives_the_same_gradients_and_counts_bytes():
    model, (x, y) = _gpt(), _data()
    min_bytes = 2048
    saved = saved_for_backward(model.loss, x, y)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    expected = sum(s.nbytes for s in saved if s.nbytes >= min_bytes and s.storage not in params)
    plain = _loss_and_grads(model, x, y, torch.enable_grad())
    moved = offload_activations(min_bytes=min_bytes)
    offloaded = _loss_and_grads(model, x, y, moved)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    assert moved.bytes_to_host == moved.bytes_to_device == expected > 0
    assert moved.tensors_moved + moved.tensors_kept == len(saved)


def test_pack_then_unpack_restores_every_saved_tensor_exactly():
    hooks = offload_activations(min_bytes=0)
    base = torch.randn(6, 10, requires_grad=True) * 3     # not a leaf: it is moved
    for t in [base, base.t(), base[::2, 1:], base.to(torch.bfloat16), torch.arange(12.0).exp()]:
        packed = hooks._pack(t)
        back = hooks._unpack(packed)
        assert isinstance(packed, tuple) and back.dtype == t.dtype and torch.equal(back, t)
        assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_activation_offload_leaves_parameters_and_small_tensors():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64)
    with offload_activations(min_bytes=0) as moved:
        y = (x @ weight.t()).relu()                        # saves x, weight.t() (a view), y
    assert moved.bytes_to_host == (x.numel() + y.numel()) * 4   # not the weight
    with offload_activations(min_bytes=10**9) as moved:
        (torch.randn(8, 64, requires_grad=True) * 2).exp()
    assert (moved.tensors_moved, moved.bytes_to_host) == (0, 0)


def test_activation_offload_lowers_the_device_peak_by_what_it_moves():
    model, (x, y) = _gpt(), _data()
    model.loss(x, y).backward()                            # gradients exist before measuring
    with track("cpu") as plain:
        model.loss(x, y).backward()
    with track("cpu") as offloaded:
        with offload_activations(min_bytes=2048) as moved:
            loss = model.loss(x, y)
        loss.backward()
    assert offloaded.peak < plain.peak and offloaded.host_peak == moved.bytes_to_host


@pytest.mark.parametrize("bad", [-1, 1.5, "1 MiB", True])
def test_activation_offload_rejects_a_bad_threshold(bad):
    with pytest.raises(ValueError, match="min_bytes"):
        offload_activations(min_bytes=bad)


# ---------------------------------------------------------------- the contract of save_on_cpu
# The same scenario under torch.autograd.graph.save_on_cpu and ours.

SAVE_ON_CPU = lambda **kw: torch.autograd.graph.save_on_cpu(**kw)
OURS = lambda **kw: offload_activations(min_bytes=0, **kw)


@pytest.mark.parametrize("pin_memory", [False, True])
def test_same_loss_and_gradients_as_save_on_cpu_with_either_pin_setting(pin_memory):
    """pin_memory=True on a machine without an accelerator: save_on_cpu does not pin, nor do we
    (torch.empty(pin_memory=True) would raise there)."""
    model, (x, y) = _gpt(), _data()
    theirs = _loss_and_grads(model, x, y, SAVE_ON_CPU(pin_memory=pin_memory))
    ours = _loss_and_grads(model, x, y, OURS(pin_memory=pin_memory))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert to_host(torch.ones(3), pin_memory=pin_memory).is_pinned() == (pin_memory and can_pin())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_saved_dtypes_survive_the_round_trip_as_with_save_on_cpu(dtype):
    model, (x, y) = _gpt(dtype=dtype), _data()
    theirs = _loss_and_grads(model, x, y, SAVE_ON_CPU())
    ours = _loss_and_grads(model, x, y, OURS())
    assert all(a.dtype == b.dtype == dtype and torch.equal(a, b) for a, b in zip(ours[1:], theirs[1:]))


def test_retain_graph_and_double_backward_unpack_again_like_save_on_cpu():
    results = []
    for context in (SAVE_ON_CPU, OURS):
        x = torch.linspace(-1, 1, 12, requires_grad=True)
        with context():
            y = (x.sin() * x).exp().sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)   # unpacks every saved tensor
        (gg,) = torch.autograd.grad(g.sum(), x, retain_graph=True)
        y.backward()                                          # and once more
        results.append((g.detach(), gg, x.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_inside_and_around_a_checkpoint_like_save_on_cpu_around_torchs():
    """Saved-tensor hooks nest: the innermost wins, so a checkpointed block inside an offload
    keeps only its inputs (offloaded) and recomputes the rest on the device."""
    block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(5, 8, requires_grad=True)
    grads = []
    for context, ckpt in ((SAVE_ON_CPU, lambda t: tuc.checkpoint(block, t, use_reentrant=False)),
                          (OURS, lambda t: checkpointing.checkpoint(block, t, use_reentrant=False))):
        block.zero_grad(set_to_none=True)
        x.grad = None
        with context() as hooks:
            y = ckpt(x.tanh()).square().sum()
        y.backward()
        grads.append([x.grad] + [p.grad for p in block.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert hooks.tensors_moved == 2          # tanh's output and square's input; the block's
                                             # input is held by the checkpoint, not saved


def test_a_saved_tensor_changed_after_forward_gives_forwards_gradient():
    """Plain autograd refuses (the saved tensor's version changed); our copy holds forward's
    value, so the gradient is that of the function computed. (save_on_cpu on a CPU-only machine
    keeps the tensor itself and would use the changed value: see the docstring.)"""
    x = torch.linspace(-1, 1, 6, requires_grad=True)
    with offload_activations(min_bytes=0):
        y = (x * 2).exp()                                # exp saves its result
    y.mul_(3)
    y.sum().backward()
    assert torch.allclose(x.grad, 6 * (2 * x.detach()).exp())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z = (x * 2).exp()
        z.mul_(3)
        z.sum().backward()
