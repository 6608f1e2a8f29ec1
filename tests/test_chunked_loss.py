"""companion.chunked_loss: the same loss and gradients as F.cross_entropy, without the logits."""
import pytest
import torch
import torch.nn.functional as F

from companion.chunked_loss import chunked_cross_entropy
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
