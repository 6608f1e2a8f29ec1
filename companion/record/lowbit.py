"""Chapter 11's experiments: bytes per parameter by layout, and the course GPT trained with each
optimizer that keeps fewer bits, over several seeds.

`train_curve` trains `companion.models.GPT` at the sizes `S` with one of `KINDS` (or
`STABLE_EMBEDDING`: 8-bit Adam with the token embedding's states in 32 bits) and returns its
losses and, per step, the fraction of weights the step left unchanged (for pure bf16 without
compensation, the updates that rounding to nearest dropped). "bf16 (nearest)" rounds its weights'
updates to nearest (its moments, `BF16AdamW`'s default, stochastically); the other bf16 kinds
name the compensation of their weights. `fewer_bits` is the recorded run.

Example:
    >>> losses, unchanged = train_curve("bf16 (nearest)", 0, sizes("cpu"), torch.device("cpu"), steps=50)
    >>> fewer_bits(sizes("cpu"), torch.device("cpu"), repeats=2)["measured"]["bytes_per_param"]
"""
from __future__ import annotations

import contextlib
import statistics

import torch
import torch.nn.functional as F

from companion import models
from companion.lowbit import Adam8bit, BF16AdamW, fp32_products, layouts
from companion.results import curve

__all__ = ["KINDS", "STABLE_EMBEDDING", "train_curve", "layout_bytes", "figures", "fewer_bits",
           "final_loss"]

KINDS = ("fp32 Adam", "Adam8bit", "bf16 (nearest)", "bf16 + stochastic", "bf16 + Kahan", "bf16 + Adam8bit")
STABLE_EMBEDDING = "Adam8bit, 32-bit embedding states"    # the stable embedding's optimizer half


def _optimizer(kind: str, model: models.GPT, lr: float) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if kind == STABLE_EMBEDDING:
        rest = [p for p in params if p is not model.tok.weight]
        return Adam8bit([{"params": [model.tok.weight], "min_8bit_size": 2**62},
                         {"params": rest}], lr=lr)
    if kind == "fp32 Adam":
        return torch.optim.Adam(params, lr=lr)
    if kind == "Adam8bit":
        return Adam8bit(params, lr=lr)
    if kind == "bf16 + Adam8bit":                    # the 6-byte layout, rounded stochastically
        return Adam8bit(params, lr=lr, stochastic_round=True)
    mode = {"bf16 (nearest)": "none", "bf16 + stochastic": "stochastic", "bf16 + Kahan": "kahan"}[kind]
    return BF16AdamW(params, lr=lr, weight_decay=0.0, compensation=mode)


def train_curve(kind: str, seed: int, S, device: torch.device, *, steps: int,
                batch: int | None = None, lr: float = 1e-3,
                chain: int = 0) -> tuple[list[float], list[float]]:
    """(loss per step, fraction of weights unchanged by each step) of the course GPT trained with
    `kind` from seed `seed` on the Markov chain `chain` (`models.make_tokens`); the same seed
    gives every kind the same initial weights (rounded to bf16 for the bf16 kinds) and batches.
    `batch` sequences per step: by default 8, or fewer where the device's sizes say so. The loss
    is computed in fp32 from the logits (a bf16 loss is 1/64 apart near 2.7, too coarse to
    compare kinds by).
    On the CPU the bf16 kinds' matrix products run under `lowbit.fp32_products` (a bf16 GEMM's
    result from fp32 products, on every CPU alike: on one without bf16 matrix instructions it is
    several times faster than PyTorch's bf16 GEMM, on one with AVX512-BF16 or AMX it need not be;
    benchmarks/README.md, bf16_products); on a GPU they are the GPU's bf16 GEMMs."""
    batch = min(8, S.amp_gpt_batch) if batch is None else batch
    if kind not in KINDS + (STABLE_EMBEDDING,):
        raise ValueError(f"kind is one of {KINDS + (STABLE_EMBEDDING,)}, got {kind!r}")
    dtype = torch.bfloat16 if kind.startswith("bf16") else torch.float32
    gpt = models.GPT(S.vocab, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads, seed=seed,
                     device=device).to(dtype)
    params = list(gpt.parameters())
    opt = _optimizer(kind, gpt, lr)
    x, y = (t.to(device) for t in models.make_tokens(32 * batch, S.seq_len, vocab=S.vocab,
                                                      seed=chain))
    order = torch.Generator().manual_seed(seed)
    n = sum(p.numel() for p in params)
    emulate = dtype == torch.bfloat16 and torch.device(device).type == "cpu"
    products = fp32_products if emulate else contextlib.nullcontext
    losses, unchanged = [], []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=order).to(device)
        with products():
            logits = gpt(x[idx])                     # bf16 logits upcast: the loss in fp32
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y[idx].flatten())
            loss.backward()
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        unchanged.append(sum(int((b == p).sum()) for b, p in zip(before, params)) / n)
        losses.append(loss.item())
    return losses, unchanged


def final_loss(losses: list[float], last: int = 10) -> float:
    """The mean of the last `last` losses: one number per run, less noisy than the last loss."""
    return statistics.fmean(losses[-last:])


def layout_bytes(S, device: torch.device) -> dict[str, tuple[layouts.LayoutBytes,
                                                             layouts.LayoutBytes]]:
    """{layout: (measured, predicted)} for the course GPT at sizes S (QLoRA at rank 8)."""
    x, y = (t.to(device) for t in models.make_tokens(4, S.seq_len, vocab=S.vocab, seed=0))
    make = lambda: models.GPT(S.vocab, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads,
                              device=device)
    return {name: (layouts.measure(make, name, x, y), layouts.predict(make(), name))
            for name in layouts.LAYOUTS}


def figures(rows: dict, runs: dict[str, list]) -> tuple[dict, dict]:
    """(measured, predicted) as the recorder writes them, from `layout_bytes`'s rows and
    {kind: [train_curve(...) for each seed]}."""
    measured = {f"bytes_per_param_{k}": round(m.per_param, 4) for k, (m, _) in rows.items()}
    predicted = {f"bytes_per_param_{k}": round(p.per_param, 4) for k, (_, p) in rows.items()}
    for kind, rs in runs.items():
        steps = len(rs[0][0])
        median = [statistics.median(r[0][i] for r in rs) for i in range(steps)]
        name = kind.replace(" + ", "_").replace(" ", "_").strip("()").replace("(", "")\
            .replace(")", "").lower()
        measured[f"loss_{name}"] = curve(list(range(1, steps + 1)), median, xlabel="step",
                                         ylabel="loss (median over seeds)",
                                         title=f"{kind}: training loss")
        measured[f"final_loss_{name}"] = round(statistics.median(final_loss(r[0]) for r in rs), 4)
        measured[f"unchanged_{name}"] = round(statistics.fmean(
            statistics.fmean(r[1][steps // 5:]) for r in rs), 4)
    return measured, predicted


def fewer_bits(S, device: torch.device, *, repeats: int = 3) -> dict:
    """The recorded run: bytes per parameter of each layout, and each kind's loss curve (the
    median over `repeats` seeds) with the fraction of weights each step left unchanged."""
    steps = 100
    runs = {kind: [train_curve(kind, seed, S, device, steps=steps) for seed in range(repeats)]
            for kind in KINDS}
    measured, predicted = figures(layout_bytes(S, device), runs)
    return {"experiment": f"model states by layout, and the course GPT trained {steps} steps "
                          f"with {len(KINDS)} optimizers over {repeats} seeds",
            "measured": measured, "predicted": predicted}
