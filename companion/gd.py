"""Gradient descent on linear regression, written out by hand, then with autograd and torch.optim.

The update rule moves the *parameters*, not the gradient:

    θ ← θ − η · ∂L/∂θ

with L the mean squared error over a batch of m examples. One update per batch; each batch starts
from the parameters the previous batch left. Memory: the parameters and their gradients are d + 1
numbers each; what grows with the batch size is the batch itself and what the forward pass keeps
for backward (m numbers of residuals here, b·width per layer in an MLP; chapter 01 measures those
with `companion.memory.track`). `steps_to_loss` measures the updates a batch size needs,
`fit_pareto_front` turns those counts into the critical batch size, `noise_scale` predicts it, and
`max_stable_lr` is the learning rate above which full-batch descent diverges.

Example:
    >>> X, y, w_true, b_true = make_regression(256, 4)
    >>> w, b = torch.zeros(4), torch.zeros(())
    >>> for _ in range(20):
    ...     w, b, losses = train_epoch(X, y, w, b, lr=0.1, batch_size=32)
"""
from __future__ import annotations

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
    "fit_pareto_front",
    "max_stable_lr",
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


def noise_scale(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> float:
    """The simple gradient noise scale B = tr(Σ) / |G|² at (w, b) (McCandlish et al., 2018, "An
    Empirical Model of Large-Batch Training", eq. 2.8): G the full-batch gradient, Σ the covariance
    of the per-example gradients. A batch of B examples has gradient noise tr(Σ)/B, as large as
    |G|² at B = B_simple: much smaller batches are dominated by noise, much larger ones add
    examples that barely change the step. It predicts the critical batch size to within a factor."""
    r = X @ w + b - y                                       # (m,)
    per_example = torch.cat([2 * X * r[:, None], 2 * r[:, None]], dim=1)   # (m, d + 1)
    G = per_example.mean(dim=0)
    return float(per_example.var(dim=0).sum() / (G @ G))


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
    m = X.shape[0]
    Xt = torch.cat([X, torch.ones(m, 1, dtype=X.dtype)], dim=1).double()   # (m, d + 1)
    hessian = 2.0 / m * Xt.T @ Xt                                           # (d + 1, d + 1)
    return 2.0 / float(torch.linalg.eigvalsh(hessian)[-1])


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
