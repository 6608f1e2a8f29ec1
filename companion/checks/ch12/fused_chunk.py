"""Chapter 12, exercise 2: one chunk of the fused linear cross-entropy, its loss and gradients
computed in forward, without autograd."""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from companion.checks.core import (CheckFailed, call_inplace, compare, exercise, fresh_seeds,
                                   harness, require)

__all__ = ["check_fused_chunk"]

_NO_AUTOGRAD = "[no autograd here]"


def _refuse(t):
    raise RuntimeError(f"{_NO_AUTOGRAD} autograd saved a tensor for backward")


@harness
def _chunks(answer, hidden, weight, targets, sizes, n_tokens) -> list:
    """The answer on each chunk, as the fused loss's forward calls it: under torch.no_grad(),
    inputs that do not require grad, and no graph allowed (a tensor saved for backward raises)."""
    out, start = [], 0
    for size in sizes:
        given = hidden[start:start + size], weight, targets[start:start + size]
        h, w, t = (x.clone() for x in given)
        with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(_refuse, _refuse):
            out.append(call_inplace(answer, h, w, t, n_tokens))
        for name, mine, original in zip(("h", "weight", "targets"), (h, w, t), given):
            require(torch.equal(mine, original), f"chunk {len(out) - 1}: your function changed "
                    f"its argument {name} in place",
                    hint="the fused loss passes views of the batch's own tensors: a chunk that "
                         "writes into them changes the batch for every later step (and the "
                         "count of tokens). Work on new tensors.")
        start += size
    return out


def _expected(hidden, weight, targets, sizes, n_tokens) -> list:
    """Each chunk's (loss, grad_h, grad_weight) by autograd on F.cross_entropy of the whole
    batch's mean, the chunk's tokens alone counted in its share; in float64, then in hidden's
    dtype."""
    want, start = [], 0
    for size in sizes:
        h = hidden[start:start + size].double().requires_grad_()
        w = weight.double().requires_grad_()
        t = targets[start:start + size]
        loss = F.cross_entropy(h @ w.T, t, ignore_index=-100, reduction="sum") / n_tokens
        grads = torch.autograd.grad(loss, (h, w))
        want.append(tuple(x.detach().to(hidden.dtype) for x in (loss, *grads)))
        start += size
    return want


def _case(rng: random.Random, dtype: torch.dtype, large: bool) -> tuple:
    """hidden (N, d), weight (V, d), targets (N,) with some -100, chunk sizes (one chunk all
    ignored); `large`: logits scaled so that the largest is 1000."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    N, d = rng.randrange(20, 41), rng.choice([5, 7, 9, 11, 13])
    V = rng.choice([17, 23, 29, 31, 37, 41])
    hidden = torch.randn(N, d, generator=g, dtype=torch.float64)
    weight = torch.randn(V, d, generator=g, dtype=torch.float64) / d ** 0.5
    if large:
        hidden *= 1000 / float((hidden @ weight.T).max())
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < 0.2] = -100
    cuts = sorted(rng.sample(range(1, N), rng.randrange(2, 5)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [N])]
    ignored = sizes.index(min(sizes))                    # one chunk of ignored tokens only
    start = sum(sizes[:ignored])
    targets[start:start + sizes[ignored]] = -100
    return hidden.to(dtype), weight.to(dtype), targets, sizes


def _known_wrong(want, n_tokens: int, counted: int) -> dict:
    return {
        "the loss and gradients are n_tokens times too large: a chunk's share is its tokens' "
        "summed losses divided by the count of the whole batch.": tuple(x * n_tokens for x in want),
        "this chunk is divided by its own count of tokens: summed over the chunks, the shares "
        "must give the mean over the whole batch.":
            tuple(x * n_tokens / max(counted, 1) for x in want),
        "the gradients point the wrong way: which of the two terms grows when the loss "
        "grows?": (want[0], -want[1], -want[2]),
    }


@exercise(points=2, timeout=20.0, reference=("companion.chunked_loss.fused_linear_cross_entropy",
                                             "companion.chunked_loss._FusedLinearCrossEntropy",
                                             "torch.nn.functional.cross_entropy"))
def check_fused_chunk(answer) -> str:
    """answer(h, weight, targets, n_tokens) -> (loss, grad_h, grad_weight): one chunk's share of
    the mean cross-entropy of h @ weight.T and its gradients, under torch.no_grad()."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = [(torch.float64, False), (torch.float32, False), (torch.float64, True),
             (torch.float32, True)]
    for dtype, large in cases:
        hidden, weight, targets, sizes = _case(rng, dtype, large)
        n_tokens = int((targets != -100).sum())
        want = _expected(hidden, weight, targets, sizes, n_tokens)
        try:
            got = _chunks(answer, hidden, weight, targets, sizes, n_tokens)
        except CheckFailed as failure:
            if _NO_AUTOGRAD in failure.summary or "does not require grad" in failure.summary:
                failure.hint = ("the fused loss computes its gradients inside forward, under "
                                "torch.no_grad() on tensors that do not require grad: autograd "
                                "cannot give them here; write them from the loss's formula.")
            raise
        # tolerances on each gradient's scale over the whole batch: a chunk whose tokens the
        # head predicts with margins of hundreds has gradients near 0 (float32's last bits)
        rel = 1e-10 if dtype == torch.float64 else 5e-4
        scales = [max(float(w[j].abs().max()) for w in want) or 1.0 for j in range(3)]
        label = (f"{dtype} hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                 f"{n_tokens} tokens counted" + (", logits up to 1000" if large else ""))
        start = 0
        for i, (size, mine, right) in enumerate(zip(sizes, got, want)):
            t = targets[start:start + size]
            chunk = (f"{label}: chunk {i} (tokens {start} to {start + size - 1}, "
                     f"{int((t != -100).sum())} of them counted)")
            start += size
            require(isinstance(mine, (tuple, list)) and len(mine) == 3,
                    f"{chunk}: expected (loss, grad_h, grad_weight), got {type(mine).__name__}")
            _finite(mine, chunk, large)
            _ignored_rows(mine[1], t, chunk)
            wrong = _known_wrong(right, n_tokens, int((t != -100).sum()))
            for j, what in enumerate(("loss", "grad_h", "grad_weight")):
                compare(mine[j], right[j], name=f"{chunk}: {what}", rtol=rel,
                        atol=rel * scales[j], known_wrong={k: v[j] for k, v in wrong.items()},
                        hint="compare one token's numbers with F.cross_entropy and autograd "
                             "on a tiny batch.")
    return ("each chunk's loss share and gradients match F.cross_entropy and autograd, in "
            "float64 and float32, with ignored tokens, a chunk of ignored tokens only and "
            "logits up to 1000")


def _finite(mine, chunk: str, large: bool) -> None:
    for name, value in zip(("loss", "grad_h", "grad_weight"), mine):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and \
                not bool(torch.isfinite(value).all()):
            raise CheckFailed(f"{chunk}: {name} holds NaN or inf",
                              hint="exp of a logit of 1000 overflows float32 and float64 alike."
                              if large else "look for a division by a count that can be 0 (a "
                              "chunk whose tokens are all ignored adds zeros), or a log of 0.")


def _ignored_rows(grad_h, t: torch.Tensor, chunk: str) -> None:
    """Rows of grad_h for ignored tokens are exactly zero."""
    if not isinstance(grad_h, torch.Tensor) or grad_h.shape[:1] != t.shape:
        return                                           # compare says what is wrong with it
    ignored = grad_h[t == -100]
    if ignored.numel() and bool((ignored != 0).any()):
        raise CheckFailed(f"{chunk}: tokens whose target is -100 got a gradient (grad_h's "
                          f"rows {(t == -100).nonzero().flatten().tolist()} should be zero)",
                          hint="an ignored token counts in neither the loss nor the gradients.")
