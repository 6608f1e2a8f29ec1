"""Chapter 03, exercise 2: accumulation that weighs every token alike (the summed loss divided
by the token count)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from companion import accumulation
from companion.checks.ch03._common import (_interleaved, _reject_known_wrong, _released, _stale,
                                           _watched)
from companion.checks.core import call_inplace, compare, exercise, fresh_seeds, harness, require

__all__ = ["check_token_normalized_step"]


_IGNORE = -100


def _token_setup(seed: int, rows: tuple, T: int = 7, V: int = 19):
    """A per-token model (embedding, then a Linear to the vocabulary), SGD with momentum, and
    micro-batches of `rows` sequences whose real lengths differ (the rest is padding, -100)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Tanh(), torch.nn.Linear(8, V))
    micro = []
    for b in rows:
        x, y = torch.randint(V, (b, T), generator=g), torch.randint(V, (b, T), generator=g)
        lengths = torch.randint(1, T + 1, (b,), generator=g)
        y[torch.arange(T)[None, :] >= lengths[:, None]] = _IGNORE
        micro.append((x, y))
    return model, micro


def _token_variant(seed: int, rows: tuple, variant: str = "reference") -> tuple:
    """Parameters after one step: the reference, or a known-wrong normalization."""
    model, micro = _token_setup(seed, rows)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for p, g in zip(model.parameters(), _stale(model, seed)):
        p.grad = g.clone() if variant == "no_zero_grad" else None
    if variant == "reference":
        accumulation.token_normalized_step(model, opt, micro)
        return tuple(p.detach().clone() for p in model.parameters())
    tokens = sum(int((y != _IGNORE).sum()) for _, y in micro)
    for x, y in micro:
        logits, target = model(x).flatten(0, 1), y.flatten()
        total = F.cross_entropy(logits, target, ignore_index=_IGNORE, reduction="sum")
        mean = F.cross_entropy(logits, target, ignore_index=_IGNORE)
        loss = {"mean_over_k": mean / len(micro), "mean": mean, "sum": total,
                "with_padding": total / sum(y.numel() for _, y in micro),
                "no_zero_grad": total / tokens}[variant]
        loss.backward()
    opt.step()
    return tuple(p.detach().clone() for p in model.parameters())


@harness
def _token_run(answer, seed: int, rows: tuple) -> tuple:
    """Run the answer (stale gradients in .grad); (its parameters, optimizer steps, rows seen)."""
    model, micro = _token_setup(seed, rows)
    opt, seen, steps, order, held = _watched(model, seed, lr=0.5)
    call_inplace(answer, model, opt, [(x.clone(), y.clone()) for x, y in micro])
    return tuple(p.detach() for p in model.parameters()), len(steps), seen, order, held


@exercise(points=2, timeout=30.0, reference="companion.accumulation.token_normalized_step")
def check_token_normalized_step(answer) -> str:
    """answer(model, optimizer, micro_batches): one optimizer step on token micro-batches
    [(x, y), ...] (y is -100 on padding) equal to the step on all of them at once."""
    for seed, rows in zip(fresh_seeds(3), [(3, 1, 4), (2, 5), (1, 1, 1, 6)]):
        expected = _token_variant(seed, rows)
        got, steps, seen, order, held = _token_run(answer, seed, rows)
        require(steps == 1, f"optimizer.step() ran {steps} times; expected once",
                hint="accumulate the gradients of every micro-batch, then step once, after the "
                     "loop.")
        require(seen == list(rows), f"the model saw batches of {seen} rows; expected the "
                f"micro-batches one by one, {list(rows)}",
                hint="run the model on each micro-batch in turn: concatenating them first would "
                     "hold the activations of the whole batch.")
        _interleaved(order, len(rows))
        _released(held)
        if not all(torch.allclose(g, e, rtol=1e-4, atol=1e-6) for g, e in zip(got, expected)):
            _reject_known_wrong(got, {
                "each micro-batch's mean over its own tokens, divided by k, weights a token of a "
                "short micro-batch more than one of a long micro-batch: that is the 2024 bug. Sum "
                "the token losses (reduction=\"sum\") and divide by the real tokens of the whole "
                "batch.": _token_variant(seed, rows, "mean_over_k"),
                "the micro-batch means are added up, k times too large and weighted by micro-batch: "
                "sum the token losses and divide by the tokens of the whole batch.":
                    _token_variant(seed, rows, "mean"),
                "divide the summed loss by the number of real tokens in the whole batch, counted "
                "before the first backward.": _token_variant(seed, rows, "sum"),
                "count only the real tokens, those whose target is not -100: padding has no loss "
                "and must not count in the mean.": _token_variant(seed, rows, "with_padding"),
                "start with optimizer.zero_grad(): backward adds to whatever .grad holds, here "
                "gradients left over from an earlier step.":
                    _token_variant(seed, rows, "no_zero_grad"),
            })
        compare(got, expected, name="parameters after the step",
                hint="backward sums what each micro-batch's loss contributes: which loss per "
                     "micro-batch makes that sum the mean over all the real tokens of the batch, "
                     "and what does .grad hold before the first backward?")
    return ("the same step as the whole batch, however the tokens fall into micro-batches: "
            "loss summed over tokens, divided by the tokens of the whole batch")
