"""companion.chunked_loss: the same loss and gradients as F.cross_entropy, without the logits."""
import pytest
import torch
import torch.nn.functional as F

from companion.chunked_loss import chunked_cross_entropy, fused_linear_cross_entropy
from companion.memory import track


def _problem(N=61, C=12, V=97, seed=0, ignored=7):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g, requires_grad=True)
    weight = torch.randn(V, C, generator=g, requires_grad=True)
    bias = torch.randn(V, generator=g, requires_grad=True)
    targets = torch.randint(V, (N,), generator=g)
    targets[torch.randperm(N, generator=g)[:ignored]] = -100
    return hidden, weight, bias, targets


@pytest.mark.parametrize("chunks", [1, 3, 8, 61])
def test_same_loss_and_gradients_as_cross_entropy(chunks):
    hidden, weight, bias, targets = _problem()
    ours = chunked_cross_entropy(hidden, weight, targets, bias=bias, chunks=chunks)
    theirs = F.cross_entropy(F.linear(hidden, weight, bias), targets)
    torch.testing.assert_close(ours, theirs)
    ours_grads = torch.autograd.grad(ours, (hidden, weight, bias))
    theirs_grads = torch.autograd.grad(theirs, (hidden, weight, bias))
    for a, b in zip(ours_grads, theirs_grads):
        torch.testing.assert_close(a, b)


def test_without_bias_and_in_bf16_the_loss_is_fp32():
    hidden, weight, _, targets = _problem()
    hidden, weight = hidden.detach().bfloat16(), weight.detach().bfloat16()
    ours = chunked_cross_entropy(hidden, weight, targets, chunks=4)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, F.cross_entropy(F.linear(hidden, weight).float(), targets))


def test_no_logits_saved_and_a_slice_at_a_time_in_backward():
    N, C, V, k = 512, 16, 2048, 8
    hidden, weight, _, targets = _problem(N, C, V, ignored=0)
    logits_bytes = N * V * 4
    peaks = {}
    for chunks in (None, k):
        h = hidden.detach().clone().requires_grad_()
        with track("cpu") as t:
            if chunks is None:
                loss = F.cross_entropy(h @ weight.T, targets)
            else:
                loss = chunked_cross_entropy(h, weight, targets, chunks=chunks)
            saved = t.current - loss.untyped_storage().nbytes()
            loss.backward()
        peaks[chunks] = (saved, t.peak)
    assert peaks[None][0] >= logits_bytes                      # the log-softmax, fp32
    assert peaks[k][0] < logits_bytes / 50                     # nothing of the logits
    assert peaks[k][1] < peaks[None][1] / 4


@pytest.mark.parametrize("kwargs, message", [({"chunks": 0}, "chunks"), ({"chunks": 999}, "chunks")])
def test_bad_chunks_say_what_is_allowed(kwargs, message):
    hidden, weight, _, targets = _problem()
    with pytest.raises(ValueError, match=message):
        chunked_cross_entropy(hidden, weight, targets, **kwargs)
    with pytest.raises(ValueError, match="flatten"):
        chunked_cross_entropy(hidden[None], weight, targets, chunks=2)


@pytest.mark.parametrize("chunk_size", [1, 7, 61, 200])
def test_fused_loss_and_gradients_equal_cross_entropys_in_fp64(chunk_size):
    hidden, weight, bias, targets = (t.double() if t.is_floating_point() else t
                                     for t in _problem())
    leaves = [x.detach().requires_grad_() for x in (hidden, weight, bias)]
    ours = fused_linear_cross_entropy(leaves[0], leaves[1], targets, bias=leaves[2],
                                      chunk_size=chunk_size)
    theirs = F.cross_entropy(F.linear(*leaves), targets)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=0)
    for a, b in zip(torch.autograd.grad(2.5 * ours, leaves), torch.autograd.grad(2.5 * theirs, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_fused_loss_frozen_weight_bf16_and_no_target_counted():
    hidden, weight, _, targets = _problem()
    h = hidden.detach().bfloat16().requires_grad_()
    ours = fused_linear_cross_entropy(h, weight.detach().bfloat16(), targets, chunk_size=16)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, F.cross_entropy(F.linear(h, weight.detach().bfloat16())
                                                     .float(), targets))
    ours.backward()
    assert h.grad.dtype == torch.bfloat16 and h.grad.abs().sum() > 0
    nothing = torch.full_like(targets, -100)
    loss = fused_linear_cross_entropy(hidden, weight, nothing, chunk_size=8)
    assert loss.isnan()                                         # as F.cross_entropy's mean
    loss.backward()
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_fused_loss_runs_no_matmul_in_backward_and_keeps_no_logits():
    from torch.utils.flop_counter import FlopCounterMode
    N, C, V, size = 512, 16, 2048, 64
    hidden, weight, _, targets = _problem(N, C, V, ignored=0)
    counted = {}
    for name, loss_fn in {"fused": lambda h, w: fused_linear_cross_entropy(h, w, targets,
                                                                          chunk_size=size),
                          "chunked": lambda h, w: chunked_cross_entropy(h, w, targets,
                                                                         chunks=N // size)}.items():
        h, w = (x.detach().clone().requires_grad_() for x in (hidden, weight))
        with track("cpu") as t:
            loss = loss_fn(h, w)
            kept = t.current
            with FlopCounterMode(display=False) as flops:
                loss.backward()
            peak = t.peak
        counted[name] = (flops.get_total_flops(), kept, peak)
    assert counted["fused"][0] == 0 < counted["chunked"][0]      # backward only scales
    logits = N * V * 4
    assert counted["fused"][2] < logits / 2                      # no whole logits, ever
    assert counted["fused"][1] >= (N * C + V * C) * 4            # the gradients kept from forward
    # the peak: the kept gradients and one chunk's (n, V), the log-softmax, loss and softmax made
    # in its place, backward scaling in place; a few (n, 1) row statistics beside them
    one_chunk = size * V * 4
    assert 0 <= counted["fused"][2] - ((N * C + V * C) * 4 + one_chunk) <= 128 * size


def test_fused_loss_backward_runs_once():
    hidden, weight, _, targets = _problem(64, 8, 32, ignored=0)
    h = hidden.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, targets, chunk_size=16)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"chunk_size": 0}, ValueError, "chunk_size"), ({"chunk_size": 2.0}, ValueError, "chunk_size"),
    ({"chunk_size": True}, ValueError, "chunk_size")])
def test_fused_loss_bad_arguments_say_what_to_do(kwargs, error, message):
    hidden, weight, _, targets = _problem()
    with pytest.raises(error, match=message):
        fused_linear_cross_entropy(hidden, weight, targets, **kwargs)
    with pytest.raises(ValueError, match="flatten"):
        fused_linear_cross_entropy(hidden[None], weight, targets, chunk_size=2)
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_cross_entropy(hidden, weight.T, targets, chunk_size=2)
    with pytest.raises(TypeError, match="tensors"):
        fused_linear_cross_entropy(hidden.tolist(), weight, targets, chunk_size=2)
