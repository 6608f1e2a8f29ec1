"""Chapter 01's checks pass on the reference and fail on known-wrong answers."""
import pytest
import torch

from companion import gd
from companion.checks.ch01 import check_mse_gradient, check_sgd_step, check_train_epoch
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


def test_sgd_step_reference_passes():
    check_sgd_step(lambda w, b, dw, db, lr: gd.sgd_step(w, b, dw, db, lr=lr))


def test_sgd_step_passes_with_lr_by_position_as_the_exercise_calls_it():
    check_sgd_step(gd.sgd_step)


def test_sgd_step_in_place_update_of_parameters_is_fine_and_said(capsys):
    def in_place(w, b, dw, db, lr):
        w -= lr * dw
        b -= lr * db
        return w, b
    check_sgd_step(in_place)
    assert "in place, as torch.optim does" in capsys.readouterr().out
    check_sgd_step(lambda w, b, dw, db, lr: (w - lr * dw, b - lr * db))
    assert "in place" not in capsys.readouterr().out


def _updates_the_gradient(w, b, dw, db, lr):
    """The notes' rule: "new gradient = old gradient - learning rate x derivative"."""
    dw -= lr * dw
    db -= lr * db
    return w, b


@pytest.mark.parametrize("wrong, hint", [
    (lambda w, b, dw, db, lr: (w + lr * dw, b + lr * db), "against the gradient"),
    (lambda w, b, dw, db, lr: (dw - lr * w, db - lr * b), "changes the parameter"),
    (lambda w, b, dw, db, lr: (w - dw, b - db), "learning rate"),
    (lambda w, b, dw, db, lr: ((w - lr * dw, b - lr * db), dw.zero_())[0], "changed the gradient"),
    (_updates_the_gradient, "not the gradient"),
    (lambda w, b, dw, db, lr: (dw - lr * dw, db - lr * db), "the gradient after a step"),
    (lambda w, b, dw, db, lr: (w, b), "unchanged"),
])
def test_sgd_step_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint or None):
        check_sgd_step(wrong)


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


@pytest.mark.parametrize("check", [check_mse_gradient, check_sgd_step, check_train_epoch])
@pytest.mark.parametrize("garbage", [None, "answer", 1.0, lambda *a: None, lambda *a: 1 / 0,
                                     lambda *a: (torch.tensor(float("nan")),) * 2])
def test_garbage_fails_cleanly(check, garbage):
    with pytest.raises(CheckFailed):
        check(garbage)
