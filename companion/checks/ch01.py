"""Checks for chapter 01, gradient descent."""
from __future__ import annotations

import math
import numbers

import torch

from companion import gd
from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds, require
from companion.models import make_regression

__all__ = ["check_mse_gradient", "check_largest_stable_lr", "check_train_epoch"]


def _number(value, name: str) -> float:
    """A learner's number as a float, or a CheckFailed that says what came back instead."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckFailed(f"{name}: expected a number, got a {type(value).__name__}: {value!r:.80}",
                          hint="return a Python float, e.g. with .item().")
    return float(value)


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
        dw, db = gd.mse_gradient(X, y, w, b)
        wrong = {
            "the loss is a mean over the m examples: divide the sums by m.": (dw * m, db * m),
            "d/dr of r² is 2r: keep the factor 2.": (dw / 2, db / 2),
            "r = Xw + b − y, so the gradient points along +Xᵀr; check the sign.": (-dw, -db),
            "b shifts every prediction by the same amount (∂rᵢ/∂b = 1): its gradient is the "
            "mean of 2rᵢ, not zero.": (dw, torch.zeros_like(db)),
        }
        got = call(answer, X, y, w, b)
        compare(got, (dw, db), name="(dw, db)", known_wrong=wrong)
    return "matches the hand-derived gradient (2/m)·Xᵀr, (2/m)·Σr on 3 random batches"


def _features(seed: int, m: int, d: int, kind: str) -> torch.Tensor:
    """Feature matrices unlike the chapter's: shifted, scaled, correlated, or wider than tall."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(m, d, generator=g)
    if kind == "shifted":                       # mean far from zero: the bias matters
        return X + 1.5
    if kind == "correlated":                    # mixed columns of very different scales
        return X @ torch.randn(d, d, generator=g) * torch.logspace(-1, 1, d) - 0.5
    return 3 * X - 2                            # "scaled"


def _hessian(X: torch.Tensor, *, bias: bool = True, factor: float = 2.0, mean: bool = True):
    """The MSE's Hessian over (w, b), or what a usual mistake makes of it, in float64."""
    m = X.shape[0]
    Xt = torch.cat([X, torch.ones(m, 1)], dim=1) if bias else X
    Xt = Xt.double()
    return factor / (m if mean else 1) * Xt.T @ Xt


def _descends(X: torch.Tensor, lr: float, steps: int = 300) -> bool:
    """Does full-batch descent at `lr` end below where it started (from a random point)?

    The loss is quadratic, so `steps` steps of gd.sgd_step with gd.mse_gradient have a closed
    form: along each eigenvector of the Hessian H (eigenvalue λ > 0) the distance to the minimum
    is multiplied by (1 - lr λ) per step, and its share of the loss above the minimum is
    λ/2 times that distance squared; along λ = 0 the gradient is zero and nothing moves. Taken
    this way (one 11 x 11 eigendecomposition) the check's own work stays far below its time limit
    on a loaded machine, where 2,400 tiny steps took seconds (issue 54, review finding 8).
    """
    g = torch.Generator().manual_seed(0)
    X = X.double()
    m = X.shape[0]
    y = torch.randn(m, generator=g, dtype=torch.float64)
    w = torch.randn(X.shape[1], generator=g, dtype=torch.float64)
    b = torch.randn((), generator=g, dtype=torch.float64)
    Xt = torch.cat([X, torch.ones(m, 1, dtype=torch.float64)], dim=1)
    lam, Q = torch.linalg.eigh(2 / m * Xt.T @ Xt)
    z = Q.T @ torch.cat([w, b.reshape(1)])                     # the start, in the eigenbasis
    c = Q.T @ (2 / m * Xt.T @ y)                               # gradient = H θ - c
    live = lam > lam[-1] * 1e-12                               # directions with curvature
    delta = z[live] - c[live] / lam[live]                      # start minus the minimum
    shrink = (1 - lr * lam[live]) ** (2 * steps)
    return bool((lam[live] * delta ** 2 * (shrink - 1)).sum() < 0)


_TRY_IT = ("run full-batch descent on this X yourself (gd.mse_gradient and gd.sgd_step, a few hundred "
           "steps) at your rate and at a slightly larger one: below the edge the loss falls, above "
           "it the loss grows. Which property of the loss sets where that happens?")


@exercise(points=2, timeout=15.0, reference=("companion.gd.max_stable_lr",
                                              "companion.gd.mse_hessian",
                                              "companion.checks.ch01._hessian"))
def check_largest_stable_lr(answer) -> str:
    """answer(X) -> float: the learning rate above which full-batch descent on the MSE diverges."""
    cases = [(48, 3, "shifted"), (7, 10, "scaled"), (300, 1, "scaled"), (64, 6, "correlated")]
    for seed, (m, d, kind) in zip(fresh_seeds(len(cases)), cases):
        X = _features(seed, m, d, kind)
        eig = torch.linalg.eigvalsh(_hessian(X))
        wrong = {
            "b is a parameter too: the Hessian is over (w, b), so X gets a column of ones, and "
            "features whose mean is far from zero make that column matter.":
                2 / float(torch.linalg.eigvalsh(_hessian(X, bias=False))[-1]),
            "1/λ_max is the rate that reaches the minimum along the steepest direction in one "
            "step. Descent still converges a while past it: per step, the error along that "
            "direction is multiplied by a factor; how far may that factor go?":
                1 / float(eig[-1]),
            "the loss is a mean of r², and d²(r²)/dr² = 2: the Hessian carries that factor 2.":
                2 / float(torch.linalg.eigvalsh(_hessian(X, factor=1.0))[-1]),
            "the loss is a mean over the m examples, so its Hessian is one too: divide by m.":
                2 / float(torch.linalg.eigvalsh(_hessian(X, mean=False))[-1]),
            "the direction of the largest curvature diverges first, not the flattest one.":
                2 / float(eig[0]) if float(eig[0]) > 0 else math.inf,
            "the trace is larger than every eigenvalue, so 2/trace is safe but below the edge: "
            "the edge is set by one eigenvalue.": 2 / float(eig.sum()),
            "the diagonal of the Hessian holds its eigenvalues only when the features are "
            "uncorrelated (and the bias column is not): take the eigenvalues of the whole matrix.":
                2 / float(_hessian(X).diagonal().max()),
        }
        want = float(gd.max_stable_lr(X))
        got = _number(call(answer, X), f"largest_stable_lr(X of shape ({m}, {d}))")
        compare(got, want, name=f"the edge for X of shape ({m}, {d}), {kind}",
                rtol=1e-4, atol=0.0, known_wrong=wrong, hint=_TRY_IT)
        require(_descends(X, 0.98 * got) and not _descends(X, 1.02 * got),
                f"descent at 0.98 and 1.02 times your rate does not change behaviour on X of shape "
                f"({m}, {d})", hint="the edge is where a step stops shrinking the error along every "
                "direction.")
    return (f"full-batch descent converges at 0.98 and diverges at 1.02 times your rate on "
            f"{len(cases)} feature matrices (one with fewer rows than parameters)")


def _one_batch_for_all(X, y, w, b, lr, batch_size):
    """A known-wrong epoch: every batch's gradient taken at the starting parameters."""
    steps = [gd.mse_gradient(X[i], y[i], w, b) for i in gd.batches(len(y), batch_size)]
    for dw, db in steps:
        w, b = gd.sgd_step(w, b, dw, db, lr=lr)
    return w, b


@exercise(points=2, reference=("companion.gd.train_epoch", "companion.gd.train"))
def check_train_epoch(answer) -> str:
    """answer(X, y, w, b, lr, batch_size) -> (w, b) after one in-order epoch of mini-batch SGD."""
    # the last case's short batch is a single example: a loop that stops one row early drops it
    cases = [(50, 3, 8), (29, 4, 29), (33, 2, 10), (25, 3, 8)]
    for seed, (m, d, bs) in zip(fresh_seeds(len(cases)), cases):
        X, y, w, b = _problem(seed, m, d)
        lr = 0.1
        w_ref, b_ref, _ = gd.train_epoch(X, y, w, b, lr=lr, batch_size=bs)
        keep = m - m % bs
        dropped = gd.train_epoch(X[:keep], y[:keep], w, b, lr=lr, batch_size=bs)[:2]
        whole = gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), lr=lr)
        wrong = {
            "each batch must start from the parameters the previous batch left: compute the "
            "gradient inside the loop, after the last update.": _one_batch_for_all(X, y, w, b, lr, bs),
            "the last batch may be smaller than batch_size: keep it, do not drop it.": dropped,
            "one update per batch of batch_size examples, not one for the whole data set.": whole,
        }
        got = call(answer, X, y, w, b, lr, bs)
        if isinstance(got, tuple) and len(got) == 3:
            got = got[:2]
        compare(got, (w_ref, b_ref), name="(w, b) after one epoch", known_wrong=wrong)
    return "one update per batch, each from the previous batch's parameters, short last batch kept"
