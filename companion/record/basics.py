"""Recorded experiments of the first chapters: what fills memory, the batch, number formats.

Each experiment runs on `device` at sizes `S` with the same companion functions its chapter
calls, and returns {"experiment", "measured", "predicted"} (values as `companion.results`
describes them). Memory comes from `companion.memory.track`: the caching allocator on CUDA.

Example:
    >>> out = anatomy(sizes("cpu"), torch.device("cpu"), repeats=1)
    >>> out["measured"]["gpt_step_peak_bytes"], out["predicted"]["gpt_step_peak_bytes"]
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from companion import estimate, floats
from companion.accumulation import accumulation_step, find_max_batch_size, step_memory
from companion.memory import memory_budget, track
from companion.models import GPT, MLP, make_classification, make_tokens
from companion.record.fit import gpt_step_bytes, mlp_step_peak
from companion.results import curve

__all__ = ["anatomy", "anatomy_figures", "batch_activations", "activation_figures",
           "adam_temporaries",
           "low_precision_sums", "sum_figures", "batch_memory", "batch_figures",
           "accumulation_peak"]


def anatomy_figures(step, saved: int, mlp_step) -> dict:
    """Chapter 00's measurements under the recorded names: `step` tracked a GPT training step from
    nothing (its model states by kind at the end, its peak), `saved` is the bytes its forward
    saved for backward, `mlp_step` tracked the MLP's step."""
    end = step.breakdown("current")
    out = {"gpt_parameters_bytes": end["parameters"], "gpt_gradients_bytes": end["gradients"],
           "gpt_optimizer_state_bytes": end["optimizer_state"], "gpt_activations_bytes": saved,
           "gpt_step_peak_bytes": step.peak, "gpt_peak_phase": step.peak_phase,
           "mlp_step_peak_bytes": mlp_step.peak}
    if step.device.type == "cuda":
        out["gpt_step_peak_reserved_bytes"] = step.peak_reserved
    return out


def anatomy(S, device: torch.device, *, repeats: int = 1) -> dict:
    """A training step (fp32 Adam) of the course GPT and of the MLP, from nothing: model states by
    kind at the end, activations saved by the forward, and the step's peak (on CUDA also what the
    caching allocator reserved), each beside the estimator's prediction."""
    tokens = [t.to(device) for t in make_tokens(S.anatomy_gpt_batch, S.seq_len, vocab=S.vocab)]
    n = estimate.gpt_params(S.vocab, S.seq_len, S.gpt_width, S.gpt_depth)
    torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)   # warm-up: cuBLAS's
    with track(device) as step:                       # workspace comes with the first matmul
        model = GPT(S.vocab, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads, device=device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model.loss(*tokens).backward()
        opt.step()
    with track(device) as forward:
        loss = model.loss(*tokens)
    saved = forward.current - loss.untyped_storage().nbytes()     # the loss is not saved
    del model, opt, loss
    x, y = (t.to(device) for t in make_classification(S.batch, S.width, 10))
    with track(device) as mlp_step:
        mlp = MLP(S.width, S.width, S.depth, 10, device=device)
        mlp_opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)
        mlp.loss(x, y).backward()
        mlp_opt.step()
    states = estimate.model_states(n)
    predicted = {"gpt_parameters_bytes": states.params, "gpt_gradients_bytes": states.grads,
                 "gpt_optimizer_state_bytes": states.optimizer,
                 "gpt_activations_bytes": estimate.gpt_activations(
                     S.anatomy_gpt_batch, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads,
                     S.vocab),
                 "gpt_step_peak_bytes": gpt_step_bytes(S, batch=S.anatomy_gpt_batch,
                                                       depth=S.gpt_depth),
                 "mlp_step_peak_bytes": mlp_step_peak(S.width, S.width, S.depth, 10,
                                                      batch=S.batch, device_type=device.type)}
    return {"experiment": "a training step of the GPT and of the MLP (fp32 Adam), by kind",
            "measured": anatomy_figures(step, saved, mlp_step), "predicted": predicted}


_PER_BATCH = {"xlabel": "batch size (examples)", "ylabel": "bytes saved for backward",
              "xscale": "log", "yscale": "log"}


def activation_figures(measured: dict[int, int], parameter_bytes: int) -> dict:
    """Chapter 01's {batch: activation bytes} (tracked, the input batch not counted) and the
    MLP's parameter bytes, under the recorded names."""
    return {"activation_bytes": curve(list(measured), list(measured.values()), **_PER_BATCH),
            "parameter_bytes": parameter_bytes}


def batch_activations(S, device: torch.device, *, repeats: int = 1) -> dict:
    """Bytes a 3-layer MLP (64 inputs, width S.width) keeps between forward and backward against
    the batch size (tracked; the input batch is data, not counted), against B·3·width·4:
    activations grow with the batch, the weights do not."""
    mlp = MLP(64, S.width, 3, 10, device=device)
    mlp(torch.randn(1, 64, device=device))    # warm-up: cuBLAS allocates its workspace once, on
    measured = {}                             # the first matmul, and it would count at batch 1
    for b in [1, 8, S.batch, 4 * S.batch, 16 * S.batch]:
        x = torch.randn(b, 64, device=device)
        with track(device) as t:
            out = mlp(x)
        measured[b] = t.current - out.untyped_storage().nbytes()     # the output is not saved
    return {"experiment": "activations of a 3-layer MLP against the batch size",
            "measured": activation_figures(measured, sum(p.nbytes for p in mlp.parameters())),
            "predicted": {"activation_bytes": curve(
                list(measured), [b * 3 * S.width * 4 for b in measured], **_PER_BATCH),
                "parameter_bytes": 4 * estimate.mlp_params(64, S.width, 3, 10)}}


def low_precision_sums(S, device: torch.device, *, repeats: int = 1) -> dict:
    """`torch.sum` of n copies of 0.01 stored in fp16 and bf16, on the device, against the same
    values added one at a time into an fp32 accumulator (`floats.running_sum`): PyTorch's
    reductions accumulate 16-bit inputs in fp32. Relative error against n·0.01 for growing n."""
    ns = [10**k for k in range(2, 7)]
    measured, predicted = {}, {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        errors = []
        for n in ns:
            total = torch.full((n,), 0.01, device=device).to(dtype).sum().item()
            errors.append(abs(total - 0.01 * n) / (0.01 * n))
        measured[f"torch_sum_{name}_relative_error"] = curve(
            ns, errors, xlabel="values summed (n)", ylabel="|sum - 0.01·n| / (0.01·n)",
            title=f"torch.sum of n x 0.01 in {name} on the device", xscale="log", yscale="log")
        predicted[f"torch_sum_1000_{name}"] = floats.running_sum(
            torch.full((1000,), 0.01), dtype, accumulate=torch.float32).item()
    measured.update(sum_figures(torch.full((1000,), 0.01, device=device)))
    return {"experiment": "sums of 16-bit values on the device (torch.sum)",
            "measured": measured, "predicted": predicted}


def sum_figures(values: torch.Tensor) -> dict:
    """Chapter 02's `torch.sum` of `values` (1000 x 0.01) stored in fp16 and in bf16."""
    return {f"torch_sum_{len(values)}_{name}": values.to(dtype).sum().item()
            for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))}


def adam_temporaries(S, *, foreach: bool, d_in: int = 32, classes: int = 10) -> int:
    """Bytes Adam's step allocates beyond the model states for chapter 03's MLP: foreach (torch's
    default on CUDA) takes √v of every tensor at once, 4 bytes per parameter; the per-tensor loop
    (the CPU's default) holds two temporaries of the largest weight, width x width."""
    if foreach:
        return 4 * estimate.mlp_params(d_in, S.width, S.depth, classes)
    return 2 * S.width * S.width * 4


def accumulation_peak(S, batch: int, accum_steps: int = 1, *, d_in: int = 32,
                      classes: int = 10, foreach: bool = False) -> int:
    """Chapter 03's prediction for an Adam step of the MLP (d_in, S.width, S.depth) on micro-batches
    of `batch`: in backward, weights, Adam state, one micro-batch's activations and two (b, width)
    gradients flowing back, plus the gradients when they accumulate; in the step, the model states
    and Adam's temporaries (`adam_temporaries`). The larger of the two."""
    states = estimate.model_states(estimate.mlp_params(d_in, S.width, S.depth, classes))
    grads_alive = states.grads if accum_steps > 1 else 0
    backward = (states.params + states.optimizer + grads_alive
                + estimate.mlp_activations(batch, S.width, S.depth, classes)
                + 2 * batch * S.width * 4)
    return max(backward, states.total + adam_temporaries(S, foreach=foreach, d_in=d_in,
                                                         classes=classes))


def _largest_batch(make, X: torch.Tensor, Y: torch.Tensor, budget: int, *, start: int,
                   device: torch.device, foreach: bool) -> int:
    """`find_max_batch_size` of Adam steps of `make()` under `memory_budget(budget)`."""
    with memory_budget(budget, device):
        model = make()
        opt = torch.optim.Adam(model.parameters(), foreach=foreach)

        def step(b: int) -> None:            # two: the first creates Adam's state, the second carries it
            for _ in range(2):
                accumulation_step(model, F.cross_entropy, opt, X[:b], Y[:b], accum_steps=1)

        return find_max_batch_size(step, start=start, device=device, limit=len(X))


_PEAK = {"xlabel": "batch size (examples)", "ylabel": "peak bytes of two Adam steps"}


def batch_figures(peaks: dict[int, int], accumulation: dict[int, int], budget: int,
                  largest: int, *, effective_batch: int) -> dict:
    """Chapter 03's measurements under the recorded names: {batch: peak}, {micro-batch: peak} at
    `effective_batch`, and the largest batch found under `budget` bytes."""
    return {"peak_bytes": curve(list(peaks), list(peaks.values()), **_PEAK),
            "accumulation_peak_bytes": curve(
                list(accumulation), list(accumulation.values()),
                xlabel=f"micro-batch b (effective batch {effective_batch})", ylabel="peak bytes"),
            "budget_bytes": budget, "largest_batch": largest}


def batch_memory(S, device: torch.device, *, repeats: int = 1,
                 foreach: bool | None = None) -> dict:
    """Peak memory of two Adam steps against the batch, and with accumulation at a fixed effective
    batch (`accumulation.step_memory`); the largest batch that fits a budget
    (`find_max_batch_size` under `memory_budget`, the allocator's cap on CUDA), each against
    `accumulation_peak`. `foreach`: Adam's implementation, by default torch's for the device
    (foreach on CUDA, whose temporaries the budget must hold too)."""
    d_in, classes = 32, 10
    foreach = torch.device(device).type == "cuda" if foreach is None else foreach
    X, Y = (t.to(device) for t in make_classification(64 * S.batch, d_in, classes))

    def make():
        return MLP(d_in, S.width, S.depth, classes, device=device)

    peaks = {b: step_memory(make, F.cross_entropy, X[:b], Y[:b], device=device,
                            foreach=foreach).peak for b in [S.batch * 2**i for i in range(7)]}
    B = 16 * S.batch
    acc = {B // k: step_memory(make, F.cross_entropy, X[:B], Y[:B], accum_steps=k,
                               device=device, foreach=foreach).peak for k in (1, 2, 4, 8, 16)}
    states = estimate.model_states(estimate.mlp_params(d_in, S.width, S.depth, classes))
    temporaries = adam_temporaries(S, foreach=foreach)
    budget = states.total + temporaries + 6 * S.batch * (S.depth + 2) * S.width * 4
    largest = _largest_batch(make, X, Y, budget, start=S.batch, device=device, foreach=foreach)
    peak = functools.partial(accumulation_peak, S, foreach=foreach)
    fits = [b for b in range(1, 64 * S.batch + 1) if peak(b) <= budget]
    if not fits:                                    # the budget is built to hold batch 6·S.batch
        raise AssertionError(f"no batch fits the budget {budget} by the prediction itself")
    predicted = batch_figures({b: peak(b) for b in peaks}, {b: peak(b, B // b) for b in acc},
                              budget, max(fits), effective_batch=B)
    return {"experiment": "peak memory against the batch; accumulation; the largest batch",
            "measured": batch_figures(peaks, acc, budget, largest, effective_batch=B),
            "predicted": predicted}
