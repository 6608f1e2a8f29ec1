"""Chapter 12's measurements, one function per section, shared by the notebook and the recorder.

Each returns plain rows (bytes measured beside predicted, milliseconds from interleaved rounds),
so that the notebook prints them and `activations_budget`, the recorded run, writes them.

Example:
    >>> rows = policy_rows(sizes("cpu"), torch.device("cpu"))
    >>> rows["save matmuls"]["gpt"].held_bytes
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from companion import models
from companion.checkpointing import (attention_core_policy, budget_curve,
                                     checkpoint_with_plan, fit, held_bytes, region_ops, solve,
                                     tiled_mlp, where_is_the_peak)
from companion.checkpointing.policy_run import measure_policy
from companion.checkpointing.selective import alternate_matmuls, save_matmuls
from companion.chunked_loss import chunked_cross_entropy, fused_linear_cross_entropy
from companion.cost.clock import now
from companion.cost.stats import interleave
from companion.memory import track

__all__ = ["blocks", "POLICIES", "policy_rows", "budget_rows", "method_rows", "loss_rows",
           "tiled_rows", "peak_rows", "figures", "activations_budget"]


def blocks(S, device) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """The chapter's two blocks and their inputs: the course GPT's (written attention, so its
    (T, T) core is there to keep or drop) and a Llama block (SDPA, SwiGLU, RMSNorm, rotary)."""
    gen = torch.Generator().manual_seed(0)
    gpt = models.gpt.Block(S.gpt_width, S.gpt_heads).to(device)
    llama = models.Llama(S.vocab, S.seq_len, S.gpt_width, 1, S.gpt_heads,
                         kv_heads=max(1, S.gpt_heads // 2), seed=0, device=device).blocks[0]
    x = torch.randn(S.remat_batch, S.seq_len, S.gpt_width, generator=gen).to(device)
    return {"gpt": (gpt, x.clone().requires_grad_()), "llama": (llama, x.clone().requires_grad_())}


def _keep_if(test: Callable[[object, object], bool], region) -> Callable[[], Callable]:
    """A policy factory: keep the operators `test(op, row)` accepts (`row`: its RegionOp), if
    they can be kept, by run order (torch 2.13 asks in forward only)."""
    def make():
        count = [0]

        def policy(ctx, op, *args, **kwargs):
            i = count[0]
            count[0] += 1
            row = region.ops[i] if i < len(region.ops) else None
            keep = row is not None and row.can_keep and test(op, row)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return policy
    return make


POLICIES = ("recompute all", "save matmuls", "every second matmul", "keep all outside the core",
            "keep all")


def policy_rows(S, device) -> dict[str, dict]:
    """Each policy of POLICIES on each block: `measure_policy`'s PolicyRun (held bytes and
    recompute FLOPs, measured and predicted), or None where it does not apply (the attention
    core is written out only in the GPT block). "keep all outside the core" keeps every output
    `selective.attention_core_policy` leaves out of the core, some that backward never reads
    among them (Korthikanti et al.'s own set is `selective.selective_block`'s)."""
    rows: dict[str, dict] = {name: {} for name in POLICIES}
    for kind, (block, x) in blocks(S, device).items():
        region = region_ops(block, x)
        makers = {"recompute all": _keep_if(lambda op, row: False, region),
                  "save matmuls": lambda: save_matmuls,
                  "every second matmul": alternate_matmuls,
                  "keep all outside the core": (
                      _keep_if(lambda op, row: attention_core_policy(op), region)
                      if kind == "gpt" else None),
                  "keep all": _keep_if(lambda op, row: True, region)}
        for name, make in makers.items():
            rows[name][kind] = measure_policy(block, (x,), make) if make else None
    return rows


def _step(fn: Callable[[], torch.Tensor], wrt: list[torch.Tensor]) -> Callable[[], object]:
    def run():
        out = fn()
        return torch.autograd.grad(out, wrt, torch.ones_like(out))
    return run


def budget_rows(S, device, budgets: tuple[float, ...] = (0, .25, .5, .75, 1), *,
                rounds: int = 5):
    """`budget_curve` on the GPT block: the compiler at each budget, our solver (`fit`) at the
    bytes it chose, and eager's two ends (plain autograd, a whole-block checkpoint)."""
    block, x = blocks(S, device)["gpt"]
    return budget_curve(block, x, budgets, rounds=rounds)


def method_rows(S, device, fractions: tuple[float, ...] = (0.5, 0.25), *, rounds: int = 7
                ) -> dict:
    """Every method on the GPT block at two budgets, the bytes `torch.compile` saves at each of
    `fractions` (plus the input): the compiler there, our solver there (`fit`: keep or
    recompute; `solve` with the host link: offload too), and the fixed points (plain autograd,
    a whole-block checkpoint, save the matmuls, every second matmul). Bytes held between forward
    and backward, input counted, measured; each step's seconds from one interleaved run."""
    from companion.checkpointing.compiled import compiled_step
    from companion.checkpointing.policy_run import measure_policy
    from companion.plan.costmodel import CostModel

    block, x = blocks(S, device)["gpt"]
    wrt = [x, *block.parameters()]
    region = region_ops(block, x)
    cost = CostModel.for_device(device.type)
    rates = dict(seconds_per_flop=1 / cost.flops, seconds_per_byte=1 / cost.memory_bandwidth)
    host = 1 / (cost.activation_bandwidth or cost.host_bandwidth)
    sac = lambda make: lambda: torch.utils.checkpoint.checkpoint(
        block, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(
            make()))
    fixed = {"plain autograd": (lambda: block(x), None),
             "whole-block checkpoint": (lambda: torch.utils.checkpoint.checkpoint(
                 block, x, use_reentrant=False), lambda: _never),
             "save matmuls": (sac(lambda: save_matmuls), lambda: save_matmuls),
             "every second matmul": (sac(alternate_matmuls), alternate_matmuls)}
    rows, steps = {}, {}
    for name, (run, make) in fixed.items():
        held = (measure_policy(block, (x,), make).held_bytes if make else
                region.input_bytes + sum(op.nbytes for op in region.ops
                                         if op.needed and not op.output))
        rows[name] = dict(budget=None, held=held)
        steps[name] = _step(run, wrt)
    for f in fractions:
        compiled, steps[f"compiled {f:g}"] = compiled_step(block, x, budget=f)
        budget = region.input_bytes + compiled.saved_bytes
        rows[f"compiled {f:g}"] = dict(budget=budget, held=budget,
                                       compile_seconds=compiled.compile_seconds)
        fitted = fit(block, (x,), budget, **rates)
        rows[f"fit {f:g}"] = dict(budget=budget, held=fitted.measured_bytes,
                                  predicted=fitted.plan.kept_bytes, tries=fitted.tries,
                                  recompute_flops=fitted.plan.recompute_flops,
                                  seconds=fitted.plan.seconds)
        offload = solve(region, budget, host_seconds_per_byte=host, **rates)
        device_bytes, host_bytes, _ = held_bytes(block, (x,), offload)
        rows[f"offload {f:g}"] = dict(budget=budget, held=device_bytes,
                                      predicted=offload.kept_bytes, host=host_bytes,
                                      predicted_host=offload.offloaded_bytes,
                                      recompute_flops=offload.recompute_flops,
                                      seconds=offload.seconds)
        for name, plan in ((f"fit {f:g}", fitted.plan), (f"offload {f:g}", offload)):
            steps[name] = _step(lambda plan=plan: checkpoint_with_plan(block, x, plan=plan), wrt)
    times = interleave(steps, rounds=rounds, clock=lambda: now(device))
    return {"rows": rows, "times": times, "fractions": fractions}


def _never(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def loss_rows(S, device, *, rounds: int = 5) -> dict:
    """Plain, chunked and fused cross-entropy of a head over `S.loss_vocab` classes for
    `S.loss_tokens` tokens of width `S.gpt_width`: bytes after forward and at the peak of
    forward + backward, measured, and each step's seconds from interleaved rounds."""
    gen = torch.Generator().manual_seed(0)
    n, c, v = S.loss_tokens, S.gpt_width, S.loss_vocab
    h = torch.randn(n, c, generator=gen).to(device).requires_grad_()
    w = (0.02 * torch.randn(v, c, generator=gen)).to(device).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen).to(device)
    chunk = max(1, n // 8)
    ways = {"plain": lambda: F.cross_entropy(h @ w.T, t),
            "chunked": lambda: chunked_cross_entropy(h, w, t, chunks=8),
            "fused": lambda: fused_linear_cross_entropy(h, w, t, chunk_size=chunk)}
    out = {"tokens": n, "width": c, "vocab": v, "chunk": chunk, "rows": {}}
    for name, way in ways.items():
        with track(device) as tracker:
            loss = way()
            after = tracker.current - loss.untyped_storage().nbytes()
            grads = torch.autograd.grad(loss, [h, w])
        out["rows"][name] = dict(after_forward=after, peak=tracker.peak, loss=float(loss.detach()),
                                 grads=[g.cpu() for g in grads])
    out["times"] = interleave({k: _step(f, [h, w]) for k, f in ways.items()}, rounds=rounds,
                              clock=lambda: now(device))
    return out


def tiled_rows(S, device, tiles: tuple[int, ...] = (1, 4, 16)) -> dict[int, tuple[int, int]]:
    """The GPT block's MLP over `S.tiled_tokens` tokens, plain (1) and tiled: (bytes it holds
    after forward beyond its output, peak of forward + backward), measured."""
    block, _ = blocks(S, device)["gpt"]
    mlp = lambda h: block.out(F.gelu(block.fc(h)))
    params = [*block.fc.parameters(), *block.out.parameters()]
    x = torch.randn(S.tiled_tokens, S.gpt_width, device=device, requires_grad=True)
    rows = {}
    for k in tiles:
        with track(device) as tracker:
            y = mlp(x) if k == 1 else tiled_mlp(mlp, x, tiles=k, params=params)
            held = tracker.current - y.untyped_storage().nbytes()
            torch.autograd.grad(y, [x, *params], torch.ones_like(y))
        rows[k] = (held, tracker.peak)
    return rows


def peak_rows(S, device) -> dict[str, dict]:
    """`where_is_the_peak` for the course GPT's blocks in two regimes: few tokens (a block's
    gradients outweigh its input) and many (the inputs set the peak)."""
    out = {}
    for name, (depth, tokens, width) in {"few tokens": (4, S.seq_len // 2, S.gpt_width),
                                         "many tokens": (S.offload_depth_long, S.seq_len * 4,
                                                         S.gpt_width // 4)}.items():
        model = models.GPT(32, tokens, width, depth, 4, seed=0, attention="sdpa", device=device)
        idx = torch.randint(0, 32, (2, tokens), generator=torch.Generator().manual_seed(0))
        idx = idx.to(device)
        with torch.no_grad():
            x = model.tok(idx) + model.pos(torch.arange(tokens, device=device))
        x.requires_grad_()
        head = _Head(model, idx)
        out[name] = dict(depth=depth, tokens=2 * tokens, width=width,
                         rows=where_is_the_peak(list(model.blocks), x, head))
    return out


class _Head(torch.nn.Module):
    """The GPT's final norm, head and loss against next tokens, as one module."""

    def __init__(self, model, idx):
        super().__init__()
        self.ln, self.head, self.targets = model.ln, model.head, idx.roll(-1, 1)

    def forward(self, h):
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.flatten(0, 1), self.targets.flatten())


def _ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 3)


def figures(policies: dict, curve, loss: dict, tiled: dict, peaks: dict,
            methods: dict | None = None) -> tuple[dict, dict]:
    """(measured, predicted) as the recorder writes them, from the sections' rows."""
    measured, predicted = {}, {}
    for name, row in (methods or {"rows": {}})["rows"].items():
        key = name.replace(" ", "_").replace("-", "_")
        measured[f"method_held_{key}"] = row["held"]
        if "predicted" in row:
            predicted[f"method_held_{key}"] = row["predicted"]
        measured[f"method_ms_{key}"] = _ms(methods["times"][name])
    for name, by_kind in policies.items():
        for kind, run in by_kind.items():
            if run is not None:
                key = f"{kind}_{name.replace(' ', '_')}"
                measured[f"held_bytes_{key}"] = run.held_bytes
                predicted[f"held_bytes_{key}"] = run.predicted_bytes
                measured[f"recompute_flops_{key}"] = run.recompute_flops
                predicted[f"recompute_flops_{key}"] = run.predicted_flops
    for p in curve.points:
        measured[f"compiled_bytes_{p.budget:g}"] = p.compiled.saved_bytes
        measured[f"compiled_ms_{p.budget:g}"] = round(p.compiled_ms, 3)
        measured[f"fit_bytes_{p.budget:g}"] = p.fit_bytes
        measured[f"fit_ms_{p.budget:g}"] = round(p.fit_ms, 3)
    measured["eager_ms"], measured["checkpoint_ms"] = (round(curve.eager_ms, 3),
                                                       round(curve.checkpoint_ms, 3))
    for name, row in loss["rows"].items():
        measured[f"loss_peak_{name}"] = row["peak"]
        measured[f"loss_ms_{name}"] = _ms(loss["times"][name])
    for k, (held, peak) in tiled.items():
        measured[f"tiled_{k}_held"], measured[f"tiled_{k}_peak"] = held, peak
    for regime, found in peaks.items():
        for mode, row in found["rows"].items():
            key = f"{regime.replace(' ', '_')}_{mode}_peak"
            measured[key], predicted[key] = row.peak, row.predicted_peak
    return measured, predicted


def activations_budget(S, device: torch.device, *, repeats: int = 5) -> dict:
    """The recorded run: every section of chapter 12 at the device's sizes."""
    policies = policy_rows(S, device)
    curve = budget_rows(S, device, rounds=repeats)
    loss = loss_rows(S, device, rounds=repeats)
    measured, predicted = figures(policies, curve, loss, tiled_rows(S, device),
                                  peak_rows(S, device), method_rows(S, device, rounds=repeats))
    return {"experiment": "SAC policies, torch.compile's memory budget beside our solver, "
                          "plain / chunked / fused loss, a tiled MLP, and offloaded checkpoint "
                          "inputs, on one GPT block and one Llama block",
            "measured": measured, "predicted": predicted}
