"""Chapter 01's checks pass on the reference and fail on known-wrong answers."""
import pytest
import torch

from companion import gd
from companion.checks import ch01
from companion.checks.ch01 import check_largest_stable_lr, check_mse_gradient, check_train_epoch
from companion.checks.core import CheckFailed


def test_mse_gradient_reference_passes():
    check_mse_gradient(gd.mse_gradient)


@pytest.mark.parametrize("wrong, hint", [
    (lambda X, y, w, b: tuple(g * X.shape[0] for g in gd.mse_gradient(X, y, w, b)), "divide"),
    (lambda X, y, w, b: tuple(g / 2 for g in gd.mse_gradient(X, y, w, b)), "factor 2"),
    (lambda X, y, w, b: tuple(-g for g in gd.mse_gradient(X, y, w, b)), "sign"),
    (lambda X, y, w, b: (gd.mse_gradient(X, y, w, b)[0], torch.zeros(())), "∂rᵢ/∂b = 1"),
    (lambda X, y, w, b: gd.mse_gradient(X, y, w, b)[0], ""),
    (lambda X, y, w, b: (X.T @ (X @ w - y) * 2 / len(y), 2 * (X @ w - y).mean()), ""),
])
def test_mse_gradient_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint or None):
        check_mse_gradient(wrong)


def _with_bias(X):
    return torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], dim=1)


def _edge(X, *, bias=True, factor=2.0, mean=True, pick=-1, numerator=2.0):
    """2/λ of the MSE's Hessian, or what a usual mistake makes of it."""
    Xt = _with_bias(X) if bias else X
    hessian = factor / (X.shape[0] if mean else 1) * Xt.T @ Xt
    return numerator / torch.linalg.eigvalsh(hessian)[pick].item()


def test_largest_stable_lr_reference_passes():
    check_largest_stable_lr(gd.max_stable_lr)


@pytest.mark.parametrize("right", [
    _edge,                                                                 # float32 eigvalsh
    lambda X: torch.tensor(_edge(X)),                                      # a 0-d tensor
    lambda X: X.shape[0] / torch.linalg.svdvals(_with_bias(X).double())[0].item() ** 2,
])
def test_largest_stable_lr_other_right_answers_pass(right):
    check_largest_stable_lr(right)


@pytest.mark.parametrize("wrong, hint", [
    (lambda X: _edge(X, bias=False), "column of ones"),
    (lambda X: _edge(X, numerator=1.0), "in one step"),
    (lambda X: _edge(X, factor=1.0), "factor 2"),
    (lambda X: _edge(X, mean=False), "divide by m"),
    (lambda X: _edge(X, pick=0), "flattest"),
    (lambda X: 2 / (2 / X.shape[0] * _with_bias(X).T @ _with_bias(X)).trace().item(), "trace"),
    (lambda X: 2 / (2 / X.shape[0] * _with_bias(X).T @ _with_bias(X)).diagonal().max().item(),
     "diagonal"),
    (lambda X: 0.5, "at your rate and at a slightly larger one"),          # the chapter's own edge
    (lambda X: "2/λ", "expected a number"),
    (lambda X: float("nan"), "NaN"),
])
def test_largest_stable_lr_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_largest_stable_lr(wrong)


def _stepped(X, lr, steps=300):
    """Full-batch descent step by step, as the check ran it before (2,400 tiny steps a run)."""
    g = torch.Generator().manual_seed(0)
    X = X.double()
    y = torch.randn(X.shape[0], generator=g, dtype=torch.float64)
    w = torch.randn(X.shape[1], generator=g, dtype=torch.float64)
    b = torch.randn((), generator=g, dtype=torch.float64)
    start = gd.mse_loss(X, y, w, b)
    for _ in range(steps):
        w, b = gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), lr=lr)
    return bool(gd.mse_loss(X, y, w, b) < start)


@pytest.mark.parametrize("shape", [(48, 3, "shifted"), (7, 10, "scaled"), (300, 1, "scaled"),
                                   (64, 6, "correlated")])
def test_the_closed_form_descent_agrees_with_stepping(shape):
    # the check's own 2,400 descent steps made the notebook's solution time out on a loaded
    # machine (review 54a, finding 8); their closed form must say what stepping says
    for seed in range(3):
        X = ch01._features(seed, *shape)
        edge = gd.max_stable_lr(X)
        for factor in (0.5, 0.98, 1.02, 1.5):
            assert ch01._descends(X, factor * edge) == _stepped(X, factor * edge) == (factor < 1)


def _epoch(X, y, w, b, lr, bs):
    return gd.train_epoch(X, y, w, b, lr=lr, batch_size=bs)[:2]


def test_train_epoch_reference_passes():
    check_train_epoch(_epoch)
    check_train_epoch(lambda X, y, w, b, lr, bs: gd.train_epoch(X, y, w, b, lr=lr, batch_size=bs))


def _stale(X, y, w, b, lr, bs):
    grads = [gd.mse_gradient(X[s:s + bs], y[s:s + bs], w, b) for s in range(0, len(y), bs)]
    for dw, db in grads:
        w, b = gd.sgd_step(w, b, dw, db, lr=lr)
    return w, b


def _drops_last(X, y, w, b, lr, bs):
    keep = len(y) - len(y) % bs
    return _epoch(X[:keep], y[:keep], w, b, lr, bs)


@pytest.mark.parametrize("wrong, hint", [
    (_stale, "previous batch"),
    (_drops_last, "smaller"),
    (lambda X, y, w, b, lr, bs: gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), lr=lr), "one update per batch"),
    (lambda X, y, w, b, lr, bs: _epoch(X.flip(0), y.flip(0), w, b, lr, bs), ""),
    (lambda X, y, w, b, lr, bs: (w, b), ""),
])
def test_train_epoch_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint or None):
        check_train_epoch(wrong)


def _stops_one_early(X, y, w, b, lr, bs):
    """The loop's bound one row short (range(0, len(y) - 1, bs)): a last batch of one example
    is never visited (bench_mutants' survivor of issue 54)."""
    for start in range(0, X.shape[0] - 1, bs):
        dw, db = gd.mse_gradient(X[start:start + bs], y[start:start + bs], w, b)
        w, b = gd.sgd_step(w, b, dw, db, lr)
    return w, b


def test_train_epoch_fails_a_loop_that_stops_one_row_early_every_time():
    for _ in range(20):
        with pytest.raises(CheckFailed, match="smaller"):
            check_train_epoch(_stops_one_early)
        check_train_epoch(_epoch)


@pytest.mark.parametrize("check", [check_mse_gradient, check_largest_stable_lr,
                                   check_train_epoch])
@pytest.mark.parametrize("garbage", [None, "answer", 1.0, lambda *a: None, lambda *a: 1 / 0,
                                     lambda *a: (torch.tensor(float("nan")),) * 2])
def test_garbage_fails_cleanly(check, garbage):
    with pytest.raises(CheckFailed):
        check(garbage)
