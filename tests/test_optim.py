"""companion.optim: Adam from scratch against torch.optim.Adam, its state and temporaries measured,
and the optimizer step fused into backward."""
import copy

import pytest
import torch

from companion import optim
from companion.memory import track
from companion.models import MLP, make_classification


def _params_and_grads(seed, shapes=((7, 5), (5,), (3, 1, 2))):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(6)]
    return params, grads


@pytest.mark.parametrize("lr, betas, eps", [(1e-3, (0.9, 0.999), 1e-8), (0.1, (0.5, 0.9), 1e-3)])
def test_adam_step_is_torch_adam_bit_for_bit(lr, betas, eps):
    params, grads = _params_and_grads(0)
    theirs = [p.clone().requires_grad_() for p in params]
    torch_opt = torch.optim.Adam(theirs, lr=lr, betas=betas, eps=eps, foreach=False)
    states = [{} for _ in params]
    for step_grads in grads:
        for p, g, state in zip(params, step_grads, states):
            optim.adam_step(p, g, state, lr=lr, betas=betas, eps=eps)
        for p, g in zip(theirs, step_grads):
            p.grad = g.clone()
        torch_opt.step()
    for p, q, state in zip(params, theirs, states):
        assert torch.equal(p, q.detach())
        theirs_state = torch_opt.state[q]
        assert set(state) == set(theirs_state)
        assert all(torch.equal(state[k], theirs_state[k]) for k in state)


def test_adam_class_swaps_with_torch_adam_and_matches_fused():
    torch.manual_seed(0)
    model = MLP(6, 16, 2, 3)
    X, y = make_classification(20, 6, 3)
    ours, fused = model, copy.deepcopy(model)
    opts = [optim.Adam(ours.parameters(), lr=1e-2), torch.optim.Adam(fused.parameters(), lr=1e-2,
                                                                      fused=True)]
    for _ in range(5):
        for m, opt in zip((ours, fused), opts):
            opt.zero_grad()
            m.loss(X, y).backward()
            opt.step()
    for p, q in zip(ours.parameters(), fused.parameters()):
        torch.testing.assert_close(p, q)


def test_adam_state_is_8_bytes_per_parameter_and_one_temporary():
    model = MLP(32, 64, 3, 10)
    X, y = make_classification(8, 32, 10)
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    opt = optim.Adam(model.parameters())
    model.loss(X, y).backward()
    with track("cpu") as first:
        opt.step()
    tensors = len(list(model.parameters()))
    assert first.breakdown("current")["optimizer_state"] == 8 * n + 4 * tensors
    with track("cpu") as second:
        opt.step()
    assert second.current == 0 and second.peak == largest         # the denominator, freed
    theirs = torch.optim.Adam(model.parameters(), foreach=False)
    theirs.step()
    with track("cpu") as torch_step:          # sqrt(v), then a new tensor for / bias correction,
        theirs.step()                         # and the previous parameter's denominator
    assert 2 * largest < torch_step.peak < 3 * largest


@pytest.mark.parametrize("bad", [{"lr": -1.0}, {"betas": (1.0, 0.9)}, {"eps": -1e-8}])
def test_adam_rejects_bad_hyperparameters(bad):
    with pytest.raises(ValueError, match="need lr"):
        optim.Adam([torch.zeros(2, requires_grad=True)], **bad)


def test_optimizer_in_backward_takes_the_same_step_and_frees_each_gradient():
    torch.manual_seed(0)
    model = MLP(64, 256, 4, 10)
    X, y = make_classification(4, 64, 10)
    plain = copy.deepcopy(model)
    opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    with track("cpu") as together:
        plain.loss(X, y).backward()
        opt.step()
    optimizers, handles = optim.optimizer_in_backward(model.parameters(), torch.optim.Adam,
                                                      lr=1e-2)
    with track("cpu") as fused:
        model.loss(X, y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)
        assert p.grad is None
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert together.breakdown("peak")["gradients"] == grad_bytes
    assert fused.breakdown("peak")["gradients"] < grad_bytes / 2
    assert len(optimizers) == len(handles) == len(list(model.parameters()))
    for handle in handles:
        handle.remove()
    model.loss(X, y).backward()
    assert all(p.grad is not None for p in model.parameters())
