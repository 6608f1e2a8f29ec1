"""Gradient descent on linear regression, written out by hand, then with autograd and torch.optim.

The update rule moves the *parameters*, not the gradient:

    θ ← θ − η · ∂L/∂θ

with L the mean squared error over a batch of m examples. One update per batch; each batch starts
from the parameters the previous batch left. Memory: the parameters and their gradients are d + 1
numbers each; what grows with the batch size is the batch itself and what the forward pass keeps
for backward (m numbers of residuals here, b·width per layer in an MLP; chapter 01 measures those
with `companion.memory.track`). `steps_to_loss` measures the updates a batch size needs,
`fit_pareto_front` turns those counts into the critical batch size, `noise_scale` predicts it;
`max_stable_lr` is the learning rate above which full-batch descent diverges, `noiseless_lr` the
best rate of one full-batch step. `best_lr` finds the learning rate that serves a batch size best,
with SGD or Adam, and `scaling_exponent` fits how it grows with the batch (the linear and
square-root rules).

Example:
    >>> X, y, w_true, b_true = make_regression(256, 4)
    >>> w, b = torch.zeros(4), torch.zeros(())
    >>> for _ in range(20):
    ...     w, b, losses = train_epoch(X, y, w, b, lr=0.1, batch_size=32)
"""
from __future__ import annotations

import math
import statistics

import torch

__all__ = [
    "mse_loss",
    "mse_gradient",
    "autograd_gradient",
    "sgd_step",
    "torch_sgd_step",
    "batches",
    "train_epoch",
    "train",
    "steps_to_loss",
    "noise_scale",
    "mse_hessian",
    "fit_pareto_front",
    "max_stable_lr",
    "noiseless_lr",
    "least_squares_loss",
    "excess_loss",
    "best_lr",
    "scaling_exponent",
    "explore",
]


def mse_loss(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """L = (1/m) Σᵢ (xᵢ·w + b − yᵢ)², the mean over the batch of m examples."""
    r = X @ w + b - y                 # (m,) residuals
    return (r * r).mean()


def mse_gradient(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂L/∂w, ∂L/∂b) by hand: (2/m)·Xᵀr and (2/m)·Σr, with r = Xw + b − y."""
    m = X.shape[0]
    r = X @ w + b - y                 # (m,)
    return 2.0 / m * (X.T @ r), 2.0 / m * r.sum()   # (d,), ()


def autograd_gradient(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                      b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same gradient, from autograd: mark w and b as requiring grad, then backward."""
    w = w.detach().requires_grad_(True)
    b = b.detach().requires_grad_(True)
    mse_loss(X, y, w, b).backward()   # autograd saves X and r for this
    return w.grad, b.grad


def sgd_step(w: torch.Tensor, b: torch.Tensor, dw: torch.Tensor, db: torch.Tensor,
             lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """θ ← θ − η·∂L/∂θ: new parameters; the gradients are inputs and stay as they were.
    (`lr` may be passed by position or by name: sgd_step(w, b, dw, db, 0.1) or ..., lr=0.1.)"""
    return w - lr * dw, b - lr * db


def torch_sgd_step(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, *,
                   lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step the way real training code does it: parameters, loss.backward(), optimizer.step()."""
    w = torch.nn.Parameter(w.detach().clone())
    b = torch.nn.Parameter(b.detach().clone())
    opt = torch.optim.SGD([w, b], lr=lr)
    opt.zero_grad()
    mse_loss(X, y, w, b).backward()
    opt.step()                        # in place: w.data -= lr * w.grad
    return w.detach(), b.detach()


def batches(m: int, batch_size: int, *, generator: torch.Generator | None = None):
    """Index tensors covering range(m) in batches of batch_size (the last may be smaller).

    In order when `generator` is None, else shuffled by it (a new order each epoch)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = torch.arange(m) if generator is None else torch.randperm(m, generator=generator)
    return list(order.split(batch_size))


def train_epoch(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, *, lr: float,
                batch_size: int, generator: torch.Generator | None = None):
    """One pass over the data: one update per batch, each from the previous batch's parameters.

    Returns (w, b, losses) with the loss of each batch before its update."""
    losses = []
    for idx in batches(X.shape[0], batch_size, generator=generator):
        Xb, yb = X[idx], y[idx]                    # (B, d), (B,)
        losses.append(float(mse_loss(Xb, yb, w, b)))
        dw, db = mse_gradient(Xb, yb, w, b)
        w, b = sgd_step(w, b, dw, db, lr=lr)       # the next batch starts here
    return w, b, losses


def train(X: torch.Tensor, y: torch.Tensor, *, lr: float, batch_size: int, epochs: int,
          seed: int = 0) -> dict:
    """Mini-batch SGD from zero parameters, shuffling each epoch.

    Returns {"w", "b", "step_loss": loss of each batch, "epoch_loss": full-data loss after each
    epoch, "diverged": True if the loss became inf or NaN or ended above where it started}."""
    g = torch.Generator().manual_seed(seed)
    w, b = torch.zeros(X.shape[1], dtype=X.dtype), torch.zeros((), dtype=X.dtype)
    step_loss, epoch_loss = [], []
    for _ in range(epochs):
        w, b, losses = train_epoch(X, y, w, b, lr=lr, batch_size=batch_size, generator=g)
        step_loss += losses
        epoch_loss.append(float(mse_loss(X, y, w, b)))
        if not torch.isfinite(torch.tensor(epoch_loss[-1])):
            break
    losses = torch.tensor(step_loss + epoch_loss)
    diverged = not bool(torch.isfinite(losses).all()) or epoch_loss[-1] > step_loss[0]
    return {"w": w, "b": b, "step_loss": step_loss, "epoch_loss": epoch_loss, "diverged": diverged}


def steps_to_loss(X: torch.Tensor, y: torch.Tensor, *, lr: float, batch_size: int,
                  target: float, max_steps: int = 1000, seed: int = 0) -> int | None:
    """Updates of mini-batch SGD (from zero parameters, shuffled each epoch) until the MSE on all
    the data is at most `target`; None if that takes more than `max_steps` or the loss diverges."""
    g = torch.Generator().manual_seed(seed)
    w, b = torch.zeros(X.shape[1], dtype=X.dtype), torch.zeros((), dtype=X.dtype)
    step = 0
    while step < max_steps:
        for idx in batches(X.shape[0], batch_size, generator=g):
            w, b = sgd_step(w, b, *mse_gradient(X[idx], y[idx], w, b), lr=lr)
            step += 1
            loss = float(mse_loss(X, y, w, b))
            if loss <= target:
                return step
            if not loss < 1e6 or step >= max_steps:           # diverged (or NaN), or too long
                return None
    return None


def noise_scale(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, *,
                hessian: bool = False) -> float:
    """The gradient noise scale at (w, b) (McCandlish et al., 2018, "An Empirical Model of
    Large-Batch Training", section 2), G the full-batch gradient, Σ the covariance of the
    per-example gradients, H the Hessian of the loss.

    hessian=False: B_simple = tr(Σ) / |G|², what the paper measures (it needs no Hessian). A batch
    of B examples has gradient noise tr(Σ)/B, as large as |G|² at B = B_simple. hessian=True:
    B_noise = tr(HΣ) / GᵀHG, the batch at which the best step improves the loss half as much as a
    noiseless one; the two are equal when H is a multiple of the identity. Either predicts the
    critical batch size to within a factor."""
    if X.shape[0] < 2:
        raise ValueError(f"the noise scale needs the gradients of at least 2 examples to measure "
                         f"their spread, got {X.shape[0]}")
    r = X @ w + b - y                                       # (m,)
    per_example = torch.cat([2 * X * r[:, None], 2 * r[:, None]], dim=1)   # (m, d + 1)
    G = per_example.mean(dim=0)
    if not hessian:
        return float(per_example.var(dim=0).sum() / (G @ G))
    H = mse_hessian(X).to(X.dtype)                          # (d + 1, d + 1)
    sigma = per_example.T.cov()                             # (d + 1, d + 1), like var: 1/(m − 1)
    return float(torch.trace(H @ sigma) / (G @ H @ G))


def mse_hessian(X: torch.Tensor) -> torch.Tensor:
    """The Hessian of the MSE of ŷ = Xw + b over (w, b), in float64: (2/m)·X̃ᵀX̃ with X̃ = [X, 1]
    (the bias is a parameter too). It does not depend on y, w or b: the loss is quadratic."""
    m = X.shape[0]
    if m == 0:
        raise ValueError("X has no rows: an empty batch has no loss and no Hessian; "
                         "pass at least one example")
    Xt = torch.cat([X, torch.ones(m, 1, dtype=X.dtype)], dim=1).double()   # (m, d + 1)
    return 2.0 / m * Xt.T @ Xt                                              # (d + 1, d + 1)


def fit_pareto_front(batch_sizes, steps) -> tuple[float, float]:
    """(S_min, E_min) of the trade-off between updates S and examples E = B·S (McCandlish et al.,
    2018, "An Empirical Model of Large-Batch Training", section 2): (S/S_min − 1)(E/E_min − 1) = 1.

    With E = B·S the front is S = S_min + E_min / B: linear in (S_min, E_min), fitted here by least
    squares on the relative error of S (counts range from hundreds to a few). S_min is the fewest
    updates (a huge batch), E_min the fewest examples (batch 1); B_crit = E_min / S_min is the batch
    at which a run takes twice the minimum of both. Example:
        >>> [round(v, 6) for v in fit_pareto_front([1, 10, 100], [110, 20, 11])]  # S = 10 + 100/B
        [10.0, 100.0]
    """
    B = torch.as_tensor(batch_sizes, dtype=torch.float64)
    S = torch.as_tensor(steps, dtype=torch.float64)
    A = torch.stack([torch.ones_like(B), 1 / B], dim=1) / S[:, None]     # (n, 2), rows / S
    s_min, e_min = torch.linalg.lstsq(A, torch.ones_like(S)[:, None]).solution.flatten().tolist()
    return s_min, e_min


def max_stable_lr(X: torch.Tensor) -> float:
    """The largest learning rate at which full-batch gradient descent on the MSE of ŷ = Xw + b
    does not diverge: 2 / λ_max of the Hessian (2/m)·X̃ᵀX̃, X̃ = [X, 1] (the bias is a parameter
    too). Along the eigenvector of λ_max each step multiplies the error by (1 − η·λ_max), which
    stays within ±1 only for η < 2/λ_max (LeCun, Bottou, Orr and Müller, 1998, "Efficient
    BackProp", section 5: twice the optimal 1/λ_max)."""
    return 2.0 / float(torch.linalg.eigvalsh(mse_hessian(X))[-1])


def noiseless_lr(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> float:
    """η_max = |G|² / GᵀHG: the learning rate of the full-batch step −η·G from (w, b) that lowers
    the MSE most (McCandlish et al., 2018, section 2, the best rate of a noiseless step; a batch
    of B examples has best rate η_max / (1 + B_noise / B)). Exact here, since the loss is
    quadratic: L(θ − ηG) = L(θ) − η|G|² + ½η²·GᵀHG. It lies between 1/λ_max and 1/λ_min of H, and
    changes as (w, b) moves, unlike the edge of stability 2/λ_max."""
    G = torch.cat([g.reshape(-1) for g in mse_gradient(X, y, w, b)]).double()   # (d + 1,)
    curvature = float(G @ mse_hessian(X) @ G)
    if curvature == 0.0:
        raise ValueError("the gradient is zero (or along a flat direction) at (w, b): no step "
                         "improves the loss, so there is no best learning rate")
    return float(G @ G) / curvature


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} has NaN or infinite entries: clean the data before fitting it")


def least_squares_loss(X: torch.Tensor, y: torch.Tensor) -> float:
    """The lowest MSE any (w, b) reaches on (X, y), in float64: the floor training aims at."""
    _check_finite("X", X)
    _check_finite("y", y)
    if X.shape[0] == 0:
        raise ValueError("X has no rows: pass at least one example")
    Xt = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], dim=1).double()   # (m, d + 1)
    solution = torch.linalg.lstsq(Xt, y.double()[:, None]).solution                 # (d + 1, 1)
    return float(((Xt @ solution).flatten() - y.double()).square().mean())


def excess_loss(X: torch.Tensor, y: torch.Tensor, *, lr: float, batch_size: int, epochs: int = 1,
                seed: int = 0, optimizer: type[torch.optim.Optimizer] = torch.optim.SGD) -> float:
    """MSE on all the data above `least_squares_loss` after `epochs` of mini-batch training from
    zero parameters, shuffled each epoch as `train` does; inf if the run diverged.

    `optimizer` is a torch.optim class with its default options (torch.optim.SGD takes the same
    steps as `sgd_step`; torch.optim.Adam keeps two moments per parameter); it steps on the
    hand-written gradient."""
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(X.shape[1], dtype=X.dtype, requires_grad=True)
    b = torch.zeros((), dtype=X.dtype, requires_grad=True)
    opt = optimizer([w, b], lr=lr)
    for _ in range(epochs):
        for idx in batches(X.shape[0], batch_size, generator=g):
            w.grad, b.grad = mse_gradient(X[idx], y[idx], w.detach(), b.detach())
            opt.step()
    loss = float(mse_loss(X.double(), y.double(), w.detach().double(), b.detach().double()))
    return loss - least_squares_loss(X, y) if math.isfinite(loss) else math.inf


def best_lr(X: torch.Tensor, y: torch.Tensor, *, batch_size: int, lrs, epochs: int = 1,
            seeds=range(5), optimizer: type[torch.optim.Optimizer] = torch.optim.SGD
            ) -> tuple[float, float]:
    """(lr, loss): the learning rate at which runs end lowest after `epochs`, and the
    `excess_loss` of the best rate of the grid `lrs`, averaged over the shuffles `seeds` (a
    diverged shuffle rules a rate out). The rate is the grid's best refined by a parabola through
    log-loss against log-rate at it and its two neighbours, so it can fall between grid points.

    Every batch size sees the same examples, the setting of the scaling rules (Goyal et al., 2017,
    "Accurate, Large Minibatch SGD", section 2; Malladi et al., 2022, "On the SDEs and Scaling
    Rules for Adaptive Gradient Algorithms"). Raises ValueError if the best rate is at an end of
    the grid: the optimum may lie beyond it."""
    lrs, seeds = sorted(_positive("learning rates", lrs)), list(seeds)   # a generator runs once
    if len(lrs) < 3:
        raise ValueError(f"give at least three learning rates to search, got {lrs}")
    if len(set(lrs)) < len(lrs):
        raise ValueError(f"the grid repeats a learning rate: {lrs}; give each rate once")
    if not seeds:
        raise ValueError("give at least one shuffle seed (seeds=range(5), say)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or \
            not 1 <= batch_size <= len(X):
        raise ValueError(f"batch_size is a whole number from 1 to the {len(X)} examples, got "
                         f"{batch_size!r}")
    scores = [statistics.fmean(excess_loss(X, y, lr=lr, batch_size=batch_size, epochs=epochs,
                                           seed=seed, optimizer=optimizer) for seed in seeds)
              for lr in lrs]
    i = min(range(len(lrs)), key=scores.__getitem__)
    if i in (0, len(lrs) - 1):
        raise ValueError(f"batch {batch_size}: the best learning rate is {lrs[i]:g}, at an end of "
                         f"the grid {lrs[0]:g}..{lrs[-1]:g}; widen the grid on that side")
    x = [math.log(lr) for lr in lrs[i - 1:i + 2]]
    f = [math.log(max(v, 1e-300)) for v in scores[i - 1:i + 2]]
    if not all(math.isfinite(v) for v in f):           # a neighbour diverged: keep the grid's rate
        return lrs[i], scores[i]
    # vertex of the parabola through the three points (x, f), kept between the neighbours
    d1, d2 = (f[1] - f[0]) / (x[1] - x[0]), (f[2] - f[1]) / (x[2] - x[1])
    curvature = (d2 - d1) / (x[2] - x[0])
    vertex = (x[0] + x[1]) / 2 - d1 / (2 * curvature) if curvature > 0 else x[1]
    return math.exp(min(max(vertex, x[0]), x[2])), scores[i]


def scaling_exponent(batch_sizes, lrs) -> float:
    """α of lr ∝ B^α, fitted by least squares on log-log axes: 1 is the linear rule for SGD
    (Goyal et al., 2017), 0.5 the square-root rule for Adam (Malladi et al., 2022)."""
    batch_sizes, lrs = _positive("batch sizes", batch_sizes), _positive("learning rates", lrs)
    if len(batch_sizes) != len(lrs):
        raise ValueError(f"got {len(batch_sizes)} batch sizes but {len(lrs)} learning rates; "
                         "give one rate per batch size")
    log_b = torch.log(torch.tensor(batch_sizes, dtype=torch.float64))
    if len(set(log_b.tolist())) < 2:
        raise ValueError(f"need at least two different batch sizes to fit an exponent, got {batch_sizes}")
    log_lr = torch.log(torch.tensor(lrs, dtype=torch.float64))
    A = torch.stack([log_b, torch.ones_like(log_b)], dim=1)                 # (n, 2)
    return float(torch.linalg.lstsq(A, log_lr[:, None]).solution[0, 0])


def _positive(name: str, values) -> list[float]:
    """The values as a list of floats, each finite and above zero (a log axis needs them so)."""
    values = [float(v) for v in values]
    bad = [v for v in values if not (0 < v < math.inf)]
    if bad:
        raise ValueError(f"{name} must be finite and above zero, got {bad[0]!r} in {values}")
    return values


def explore(X: torch.Tensor, y: torch.Tensor, *, lr: float, batch_size: int, epochs: int,
            seed: int = 0) -> dict:
    """What the learning-rate / batch-size explorer shows, as plain data.

    Returns {"examples_seen": x axis, "step_loss": y axis, "updates": count, "final_loss",
    "diverged", "batch_bytes": bytes of one batch of X and y, "summary": one line of text}."""
    run = train(X, y, lr=lr, batch_size=batch_size, epochs=epochs, seed=seed)
    sizes = [len(i) for i in batches(X.shape[0], batch_size)] * epochs
    seen = torch.tensor(sizes[: len(run["step_loss"])]).cumsum(0).tolist()
    batch_bytes = min(batch_size, X.shape[0]) * (X.shape[1] + 1) * X.element_size()
    final = run["epoch_loss"][-1]
    summary = (f"lr={lr:.3g}, batch={batch_size}: {len(run['step_loss'])} updates, "
               + ("diverged (the loss grew instead of falling): lower the learning rate" if run["diverged"]
                  else f"final loss {final:.4f}") + f"; one batch of data = {batch_bytes:,} bytes")
    return {"examples_seen": seen, "step_loss": run["step_loss"], "updates": len(run["step_loss"]),
            "final_loss": final, "diverged": run["diverged"], "batch_bytes": batch_bytes,
            "summary": summary}
