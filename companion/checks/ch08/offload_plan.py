"""Chapter 08, exercise 2: what to offload, the fastest rung of the ladder that fits the GPU
and the host."""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import random

from companion import cost, estimate
from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds, require
from companion.memory import format_bytes

__all__ = ["check_offload_plan"]


_PLAN_GPUS = ("V100", "T4", "A10", "L4", "RTX 4090", "A100 40GB", "A100 80GB", "H100 SXM", "H200")


def _plan_cases(seed: int) -> list[dict]:
    """Models, GPUs, hosts and batches drawn at random: every GPU of the table, a GPT of 0.5 to
    60 bytes of GPU memory per parameter, host RAM from 32 GiB to 2 TiB, host AdamW from 0.2 to
    4 billion parameters a second, 1 to 16 micro-batches, 16-bit or fp32 weights."""
    rng, out = random.Random(seed), []
    for _ in range(60):
        name = rng.choice(_PLAN_GPUS)
        dtype = "fp16" if name in ("V100", "T4") else "bf16"
        speeds = dataclasses.replace(cost.Speeds.for_gpu(name, dtype),
                                     host_adam_rate=rng.uniform(2e8, 4e9))
        memory = cost.gpus.gpu(name).memory_bytes
        params = memory / rng.choice([0.5, 1, 2, 3, 5, 8, 20, 60])
        depth = rng.choice([12, 24, 32, 48, 64, 96])
        width = max(256, round((params / (12 * depth)) ** 0.5 / 128) * 128)
        seq = rng.choice([512, 1024, 2048])
        tokens = seq * rng.choice([1, 2, 4, 8])
        out.append(dict(layers=cost.gpt_layers(width, depth, seq, 50257, tokens, dtype_bytes=2),
                        speeds=speeds, k=rng.choice([1, 1, 2, 4, 8, 16]), device_bytes=memory,
                        host_bytes=2**30 * rng.choice([64, 256, 512, 1024, 2048, 4096]),
                        activation_bytes=int(memory * rng.uniform(0.02, 0.5)),
                        disk_bandwidth=rng.choice([2e9, 3.5e9, 7e9]),
                        weight_bytes=rng.choice([2, 2, 4]), gpu=name))
    return out


def _fixed_plan_cases() -> list[dict]:
    """A case placed where a count without the largest layer gives another answer: an 87.6B GPT
    on a T4 with fp32 weights, whose largest layer (1.81B parameters) and the next, weights and
    gradients, cost 29 GB on the device once the parameters are offloaded, over the T4's 16 GiB
    (nothing fits; leaving the layer out, the parameters' rung does beside 12 GiB of
    activations, and no other count of `_wrong_plans` gives that answer)."""
    speeds = dataclasses.replace(cost.Speeds.for_gpu("T4", "fp16"), host_adam_rate=1e9)
    return [dict(layers=cost.gpt_layers(12288, 48, 1024, 50257, 2048, dtype_bytes=2),
                 speeds=speeds, k=1, device_bytes=cost.gpus.gpu("T4").memory_bytes,
                 host_bytes=2048 * 2**30, activation_bytes=12 * 2**30, disk_bandwidth=7e9,
                 weight_bytes=4, gpu="T4")]


def _exact_fit_plan_cases() -> list[dict]:
    """Two cases where the fastest rung that fits fills a memory exactly: a 6.65B GPT on an
    A100 40GB (16-bit weights), whose gradients' rung (the fastest that fits) leaves exactly
    the activations' bytes free on the GPU in the first and needs exactly the host's RAM in the
    second. A fit tested with >= (a rung fits only with room to spare) chooses another rung."""
    speeds = dataclasses.replace(cost.Speeds.for_gpu("A100 40GB", "bf16"), host_adam_rate=1e9)
    layers = cost.gpt_layers(4096, 32, 1024, 50257, 4096, dtype_bytes=2)
    memory = cost.gpus.gpu("A100 40GB").memory_bytes
    placed = estimate.rung_placement(sum(l.params for l in layers), "gradients", weight_bytes=2,
                                     largest_layer_params=max(l.params for l in layers))
    base = dict(layers=layers, speeds=speeds, k=1, device_bytes=memory, disk_bandwidth=7e9,
                weight_bytes=2, gpu="A100 40GB")
    return [dict(base, host_bytes=2048 * 2**30, activation_bytes=memory - placed.device),
            dict(base, host_bytes=placed.host, activation_bytes=10 * 2**30)]


def _best_rung(layers, speeds, *, k, device_bytes, host_bytes, activation_bytes, disk_bandwidth,
               weight_bytes, first_fit=False, with_activations=True, with_host=True,
               time_k=None, time_bytes=None, part=None, memory=True, largest=True,
               every=False, strict=False):
    """The reference's decision, or a known mistake: the fastest rung (the least offloaded of
    equals) whose model states plus activations fit the device and whose host bytes fit RAM.
    `every`: {rung: seconds} of every rung that fits instead; `strict`: a rung fits only with
    bytes to spare (a known mistake)."""
    P = sum(l.params for l in layers if l.trainable)
    L = max(l.params for l in layers) if largest else 0
    tb = weight_bytes if time_bytes is None else time_bytes
    ladder = _ladder(tuple(layers), speeds, k if time_k is None else time_k, tb, disk_bandwidth)
    best, times = None, {}
    for rung in cost.OFFLOAD_RUNGS:
        placed = estimate.rung_placement(P, rung, weight_bytes=weight_bytes,
                                         largest_layer_params=L)
        device = placed.device + (activation_bytes if with_activations else 0)
        room = (lambda need, have: need < have) if strict else (lambda need, have: need <= have)
        fits = not memory or (room(device, device_bytes)
                              and (not with_host or room(placed.host, host_bytes)))
        if not fits:
            continue
        t = ladder[rung].total if part is None else getattr(ladder[rung], part)
        times[rung] = t
        if best is None or t < best[1]:
            best = (rung, t)
        if first_fit:
            break
    return times if every else best


@functools.lru_cache(maxsize=256)
def _ladder(layers, speeds, k, weight_bytes, disk_bandwidth):
    return cost.offload_ladder(layers, speeds, k=k, weight_bytes=weight_bytes,
                               grad_bytes=weight_bytes, disk_bandwidth=disk_bandwidth)


def _wrong_plans(case: dict) -> dict:
    kw = {k: v for k, v in case.items() if k != "gpu"}
    return {
        "the rungs are not in order of speed on every machine: time each rung that fits and take "
        "the fastest, not the first that fits.": _best_rung(**kw, first_fit=True),
        "activations live on the device too: the model states and the activations must fit "
        "together.": _best_rung(**kw, with_activations=False),
        "the host's RAM must hold what is offloaded: check the host bytes too.":
            _best_rung(**kw, with_host=False),
        "time the step with all k micro-batches: each one computes, and on the gradients' rung "
        "each one's gradients cross the link.": _best_rung(**kw, time_k=1),
        "the weights' dtype sets the bytes on the link and on the host: pass weight_bytes to "
        "the time model as well as to the placement.": _best_rung(**kw, time_bytes=2),
        "predict the whole step (StepTime.total: compute, transfers and host step), not the "
        "compute alone.": _best_rung(**kw, part="compute"),
        "a rung must fit before it can be chosen: the fastest rung overall may not fit.":
            _best_rung(**kw, memory=False),
        "with the parameters offloaded the device still holds a layer's weights and gradients, "
        "the one computing and the next: count the largest layer.":
            _best_rung(**kw, largest=False),
        "a rung that needs exactly the bytes there are still fits: it must need at most the "
        "device's bytes and at most the host's, no less.": _best_rung(**kw, strict=True),
    }


@exercise(points=1, timeout=20.0, reference="companion.checks.ch08.offload_plan._best_rung")
def check_offload_plan(answer) -> str:
    """answer(layers, speeds, *, k, device_bytes, host_bytes, activation_bytes, disk_bandwidth,
    weight_bytes) -> (rung, seconds): the rung of cost.OFFLOAD_RUNGS to train on and its
    predicted step time, or None when nothing fits."""
    cases = _exact_fit_plan_cases() + _fixed_plan_cases() + _plan_cases(fresh_seeds(1)[0])
    chosen = {}
    for case in cases:
        kw = {k: v for k, v in case.items() if k != "gpu"}
        want, wrong_plans = _best_rung(**kw), _wrong_plans(case)
        got = call(answer, **kw)
        P = sum(l.params for l in case["layers"])
        where = (f"{P / 1e9:.2f}B parameters ({case['weight_bytes']}-byte weights) on a "
                 f"{case['gpu']}, {case['k']} micro-batch(es), activations "
                 f"{format_bytes(case['activation_bytes'])}, host RAM "
                 f"{format_bytes(case['host_bytes'])}, host AdamW "
                 f"{case['speeds'].host_adam_rate / 1e9:.2f}B parameters/s")
        if want is None:
            wrong = [text for text, value in wrong_plans.items() if value == got]
            require(got is None, f"{where}: nothing fits, but you chose {got!r:.80}",
                    hint=wrong[0] if wrong else "return None when no rung fits.")
            chosen["None"] = chosen.get("None", 0) + 1
            continue
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], str)):
            raise CheckFailed(f"{where}: expected (rung, seconds), got {got!r:.80}",
                              hint=f"return a pair: a name from cost.OFFLOAD_RUNGS "
                                   f"{cost.OFFLOAD_RUNGS} and the predicted seconds.")
        wrong = {text: value for text, value in wrong_plans.items() if value != want}
        tied = _best_rung(**kw, every=True).get(got[0])     # a rung as fast as the best: any
        if tied is not None and got[0] != want[0] and math.isclose(tied, want[1], rel_tol=1e-9):
            want = (got[0], tied)
        if got[0] != want[0]:
            same = [text for text, value in wrong.items() if value and value[0] == got[0]
                    and _close(got[1], value[1])]
            hints = same or [text for text, value in wrong.items() if value and value[0] == got[0]]
            raise CheckFailed(f"{where}: you chose {got[0]!r}; the fastest rung that fits is "
                              f"{want[0]!r} ({want[1]:.3f} s a step)",
                              hint=" Or: ".join(hints) if hints else "for each rung, check that "
                              "it fits, then compare the predicted step times.")
        if isinstance(got[1], bool) or not isinstance(got[1], numbers.Real):
            raise CheckFailed(f"{where}: the step time is {got[1]!r:.80}, not a number of seconds",
                              hint="return the predicted seconds as a number: "
                                   "StepTime.total of that rung.")
        compare(float(got[1]), want[1], name=f"{where}: the step time on {want[0]!r}",
                rtol=1e-6, atol=0.0, known_wrong={t: v[1] for t, v in wrong.items()
                                                   if v and v[0] == want[0]},
                hint="the step time is the cost model's prediction for that rung, with every "
                     "setting of the case.")
        chosen[want[0]] = chosen.get(want[0], 0) + 1
    return ("the fastest rung that fits, and its time, in " + ", ".join(
        f"{n} case(s) on {r!r}" for r, n in sorted(chosen.items())))


def _close(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    except (TypeError, ValueError):
        return False
