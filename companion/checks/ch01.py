"""Checks for chapter 01, gradient descent."""
from __future__ import annotations

import torch

from companion import gd
from companion.checks.core import call, compare, exercise, fresh_seeds, require
from companion.models import make_regression

__all__ = ["check_mse_gradient", "check_sgd_step", "check_train_epoch"]


def _problem(seed: int, m: int, d: int):
    """Fresh data and a random (not optimal) starting point."""
    X, y, _, _ = make_regression(m, d, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return X, y, torch.randn(d, generator=g), torch.randn((), generator=g)


@exercise(points=1, reference=("companion.gd.mse_gradient",
                               "companion.gd.autograd_gradient",
                               "companion.gd.torch_sgd_step",
                               "companion.accumulation.accumulated_gradients",
                               "companion.accumulation.accumulation_step",
                               "companion.ddp.accumulation_step"))
def check_mse_gradient(answer) -> str:
    """answer(X, y, w, b) -> (dw, db), the gradient of the mean squared error by hand."""
    for seed, (m, d) in zip(fresh_seeds(3), [(37, 5), (1, 3), (128, 1)]):
        X, y, w, b = _problem(seed, m, d)
        got = call(answer, X.clone(), y.clone(), w.clone(), b.clone())
        dw, db = gd.mse_gradient(X, y, w, b)
        compare(got, (dw, db), name="(dw, db)", known_wrong={
            "the loss is a mean over the m examples: divide the sums by m.": (dw * m, db * m),
            "d/dr of r² is 2r: keep the factor 2.": (dw / 2, db / 2),
            "r = Xw + b − y, so the gradient points along +Xᵀr; check the sign.": (-dw, -db),
            "b shifts every prediction by the same amount (∂rᵢ/∂b = 1): its gradient is the "
            "mean of 2rᵢ, not zero.": (dw, torch.zeros_like(db)),
        })
    return "matches the hand-derived gradient (2/m)·Xᵀr, (2/m)·Σr on 3 random batches"


_GRADIENT_UPDATED = ("the update changes the parameter, not the gradient: return w − lr·dw and "
                     "b − lr·db. (The notes this course grew from write \"new gradient = old "
                     "gradient − learning rate × derivative\": that is the mistake.)")


@exercise(points=1, reference="companion.gd.sgd_step")
def check_sgd_step(answer) -> str:
    """answer(w, b, dw, db, lr) -> (w_new, b_new): one gradient-descent update."""
    in_place = False
    for seed, d in zip(fresh_seeds(3), [5, 1, 17]):
        g = torch.Generator().manual_seed(seed)
        w, b, dw, db = (torch.randn(d, generator=g), torch.randn((), generator=g),
                        torch.randn(d, generator=g), torch.randn((), generator=g))
        lr = 0.05 + 0.1 * torch.rand((), generator=g).item()
        w_in, b_in, dw_in, db_in = w.clone(), b.clone(), dw.clone(), db.clone()
        got = call(answer, w_in, b_in, dw_in, db_in, lr)
        require(torch.equal(dw_in, dw) and torch.equal(db_in, db),
                "your step changed the gradient tensors it was given", hint=_GRADIENT_UPDATED)
        compare(got, gd.sgd_step(w, b, dw, db, lr), name="(w_new, b_new)", known_wrong={
            "descent goes against the gradient: θ − η·∂L/∂θ, not θ + η·∂L/∂θ.":
                (w + lr * dw, b + lr * db),
            _GRADIENT_UPDATED: (dw - lr * w, db - lr * b),
            "that is the gradient after a step, dw − lr·dw: " + _GRADIENT_UPDATED:
                (dw - lr * dw, db - lr * db),
            "you returned the parameters unchanged: the rule moves them, w − lr·dw.": (w, b),
            "scale the gradient by the learning rate.": (w - dw, b - db),
        })
        in_place |= not (torch.equal(w_in, w) and torch.equal(b_in, b))
    note = (" (you updated w and b in place, as torch.optim does: fine here, since the caller "
            "keeps no use for the old values)" if in_place else "")
    return "θ ← θ − η·∂L/∂θ moves the parameters and leaves the gradients alone" + note


def _one_batch_for_all(X, y, w, b, lr, batch_size):
    """A known-wrong epoch: every batch's gradient taken at the starting parameters."""
    steps = [gd.mse_gradient(X[i], y[i], w, b) for i in gd.batches(len(y), batch_size)]
    for dw, db in steps:
        w, b = gd.sgd_step(w, b, dw, db, lr=lr)
    return w, b


@exercise(points=2, reference=("companion.gd.train_epoch", "companion.gd.train"))
def check_train_epoch(answer) -> str:
    """answer(X, y, w, b, lr, batch_size) -> (w, b) after one in-order epoch of mini-batch SGD."""
    for seed, (m, d, bs) in zip(fresh_seeds(3), [(50, 3, 8), (29, 4, 29), (33, 2, 10)]):
        X, y, w, b = _problem(seed, m, d)
        lr = 0.1
        got = call(answer, X.clone(), y.clone(), w.clone(), b.clone(), lr, bs)
        if isinstance(got, tuple) and len(got) == 3:
            got = got[:2]
        w_ref, b_ref, _ = gd.train_epoch(X, y, w, b, lr=lr, batch_size=bs)
        keep = m - m % bs
        dropped = gd.train_epoch(X[:keep], y[:keep], w, b, lr=lr, batch_size=bs)[:2]
        whole = gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), lr=lr)
        compare(got, (w_ref, b_ref), name="(w, b) after one epoch", known_wrong={
            "each batch must start from the parameters the previous batch left: compute the "
            "gradient inside the loop, after the last update.": _one_batch_for_all(X, y, w, b, lr, bs),
            "the last batch may be smaller than batch_size: keep it, do not drop it.": dropped,
            "one update per batch of batch_size examples, not one for the whole data set.": whole,
        })
    return "one update per batch, each from the previous batch's parameters, short last batch kept"
