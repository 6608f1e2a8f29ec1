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


# ---------------------------------------------------------------- the contract of torch.optim.Adam
# A training script swaps `optim.Adam` for `torch.optim.Adam` (and back) mid-run.

def _train(model, opt, X, y, steps, scheduler=None, closure=False):
    for _ in range(steps):
        opt.zero_grad()
        if closure:
            def loss_fn():
                opt.zero_grad()
                loss = model.loss(X, y)
                loss.backward()
                return loss
            assert opt.step(loss_fn) is not None
        else:
            model.loss(X, y).backward()
            opt.step()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("first, second", [(optim.Adam, torch.optim.Adam),
                                           (torch.optim.Adam, optim.Adam)])
def test_a_state_dict_moves_between_ours_and_torchs_and_the_run_continues(first, second):
    X, y = make_classification(20, 6, 3)
    model, reference = MLP(6, 16, 2, 3, seed=1), MLP(6, 16, 2, 3, seed=1)
    options = {"lr": 1e-2, "betas": (0.8, 0.99)}
    opt = first(model.parameters(), **options)
    plain = torch.optim.Adam(reference.parameters(), foreach=False, **options)
    _train(model, opt, X, y, 3)
    resumed = second(model.parameters(), lr=0.5)          # the file's lr wins, as in torch
    resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["lr"] == 1e-2
    _train(model, resumed, X, y, 3)
    _train(reference, plain, X, y, 6)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_param_groups_schedulers_and_closures_work_as_with_torch_adam():
    X, y = make_classification(20, 6, 3)
    runs = []
    for make in (optim.Adam, lambda groups, **kw: torch.optim.Adam(groups, foreach=False, **kw)):
        model = MLP(6, 16, 2, 3, seed=2)
        layers = list(model.parameters())
        opt = make([{"params": layers[:2], "lr": 3e-2}], lr=1e-2)
        _train(model, opt, X, y, 2, closure=True)
        opt.add_param_group({"params": layers[2:], "betas": (0.5, 0.9)})
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        _train(model, opt, X, y, 4, scheduler=scheduler)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_optimizer_in_backward_takes_torchs_steps_with_groups_of_one():
    """PyTorch's recipe: one optimizer per parameter, stepped in a post-accumulate-grad hook."""
    X, y = make_classification(20, 6, 3)
    ours, theirs = MLP(6, 16, 2, 3, seed=3), MLP(6, 16, 2, 3, seed=3)
    _, handles = optim.optimizer_in_backward(ours.parameters(), torch.optim.AdamW, lr=1e-2)
    recipe = {p: torch.optim.AdamW([p], lr=1e-2) for p in theirs.parameters()}

    def step_now(q):
        recipe[q].step()
        recipe[q].zero_grad()
    for p in theirs.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    for _ in range(3):
        ours.loss(X, y).backward()
        theirs.loss(X, y).backward()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    for handle in handles:
        handle.remove()
    ours.loss(X, y).backward()                             # removed: a plain backward again
    assert all(p.grad is not None for p in ours.parameters())


def test_a_torch_option_ours_lacks_is_refused_not_ignored():
    model = MLP(6, 16, 2, 3, seed=4)
    X, y = make_classification(20, 6, 3)
    theirs = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    _train(model, theirs, X, y, 1)
    ours = optim.Adam(model.parameters())
    ours.load_state_dict(theirs.state_dict())
    model.loss(X, y).backward()
    with pytest.raises(ValueError, match="weight_decay"):
        ours.step()
