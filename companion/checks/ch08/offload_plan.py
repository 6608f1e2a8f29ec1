"""Checks for chapter 08, offload. The learner's hooks and step run inside `@harness` functions,
which return raw observations (tensors, byte counts); the verdicts are taken here."""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import random

import torch

from companion import cost, estimate
from companion.checkpointing import saved_for_backward
from companion.checks.core import (CheckFailed, call, call_inplace, compare, exercise,
                                   fresh_seeds, harness, require)
from companion.memory import format_bytes, track
from companion.models import GPT, MLP, make_tokens
from companion.offload import Link, offload_activations, schedule_groups, to_host

__all__ = ["check_offloaded_step", "check_offload_plan", "check_offload_schedule",
           "check_offload_hooks"]

_EXACT = {"rtol": 0.0, "atol": 0.0}


# ---------------------------------------------------------------- exercise 1: the offloaded step

def _mlp_case(seed: int):
    d_in, width = random.Random(seed).choice([(7, 13), (11, 9), (5, 17)])
    model = MLP(d_in, width, 2, 3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(6, d_in, generator=g), torch.randint(3, (6,), generator=g))
               for _ in range(3)]
    return model, batches


class _DeferredLink(Link):
    """A link whose copies land only at synchronize(), as a non_blocking copy into pinned memory
    does on a GPU: until then the destination holds NaN (bytes not yet arrived)."""

    def __init__(self):
        super().__init__("cpu")
        self.pending, self.copies, self.syncs = [], [], 0

    def copy(self, dst, src):
        self._check(dst, src)
        self.pending.append((dst, src.detach().clone()))
        self.copies.append((dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()))
        with torch.no_grad():
            dst.fill_(float("nan"))
        return dst

    def synchronize(self):
        with torch.no_grad():
            for dst, value in self.pending:
                dst.copy_(value)
        self.pending.clear()
        self.syncs += 1


@harness
def _observe_step(answer, seed: int) -> list[dict]:
    model, batches = _mlp_case(seed)
    params = list(model.parameters())
    masters = [to_host(p.detach(), dtype=torch.float32) for p in params]
    host_grads = [to_host(torch.zeros_like(p)) for p in params]
    buffers = {g.untyped_storage().data_ptr() for g in host_grads}
    optimizer = torch.optim.AdamW(masters, lr=0.05, weight_decay=0.1, fused=True)
    link, at_step = _DeferredLink(), {}

    def before_step(opt, args, kwargs):
        at_step.update(
            steps=at_step.get("steps", 0) + 1,
            freed=all(p.grad is None for p in params),
            landed=not any(d.untyped_storage().data_ptr() in buffers for d, _ in link.pending))

    optimizer.register_step_pre_hook(before_step)
    seen = []
    for x, y in batches:
        model.loss(x, y).backward()
        grads = {p.grad.untyped_storage().data_ptr() for p in params}
        storages = [p.untyped_storage().data_ptr() for p in params]
        at_step.clear()
        link.copies.clear()
        call_inplace(answer, params, masters, host_grads, optimizer, link)     # steps them
        link.synchronize()                 # the next forward runs after every queued copy
        seen.append({"weights": [p.detach().clone() for p in params],
                     "masters": [m.detach().clone() for m in masters],
                     "grads_on_host": all(m.grad is None or m.grad.data_ptr() == g.data_ptr()
                                          for m, g in zip(masters, host_grads)),
                     "stepped": all(len(optimizer.state[m]) > 0 for m in masters),
                     "host_grads": [g.clone() for g in host_grads],
                     "freed_before_step": at_step.get("freed"),
                     "landed_before_step": at_step.get("landed"),
                     "steps": at_step.get("steps", 0),
                     "down_by_link": sum(src in grads for _, src in link.copies),
                     "in_place": storages == [p.untyped_storage().data_ptr() for p in params]})
    return seen


def _plain_steps(seed: int) -> list[dict]:
    model, batches = _mlp_case(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    out = [{"weights": [p.detach().clone() for p in model.parameters()]}]
    for x, y in batches:
        model.loss(x, y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        out.append({"weights": [p.detach().clone() for p in model.parameters()], "grads": grads})
    return out


@exercise(points=2, timeout=20.0, reference="companion.offload.CPUOffloadOptimizer")
def check_offloaded_step(answer) -> str:
    """answer(params, masters, host_grads, optimizer, link): after backward, move each p.grad to
    its host buffer over `link` (asynchronous copies, landed at link.synchronize()), keep only
    the weights on the device, step `optimizer` over the host masters with those gradients, and
    put the updated weights back into the parameters in place."""
    for seed in fresh_seeds(2):
        plain = _plain_steps(seed)
        seen = _observe_step(answer, seed)
        for step, (got, before, want) in enumerate(zip(seen, plain, plain[1:]), 1):
            require(got["steps"] == 1, f"step {step} called optimizer.step() {got['steps']} "
                    "times", hint="step the optimizer you are given once per call: it updates "
                    "the host masters.")
            require(got["down_by_link"] == len(want["grads"]),
                    f"step {step} sent {got['down_by_link']} of {len(want['grads'])} gradients "
                    "through link.copy", hint="every gradient crosses the link: "
                    "link.copy(buffer, p.grad). A tensor's own copy_ hides what a GPU does: the "
                    "copy is asynchronous, and the host must wait for it.")
            require(got["landed_before_step"], f"at step {step} the optimizer read host "
                    "gradient buffers whose copies had not landed",
                    hint="a queued copy has not arrived when link.copy returns: the host must "
                         "wait for the link before anything reads the buffers.")
            require(got["freed_before_step"], f"at step {step} a device gradient was still "
                    "alive while the host stepped", hint="the point of moving gradients is the "
                    "device memory they free: once a gradient is on its way, the device copy is "
                    "not needed (the link keeps the stream's order), and the host step is the "
                    "longest part of the step.")
            require(got["in_place"], f"after step {step} a parameter has new storage",
                    hint="write the updated weights into the parameters' own storage (the "
                         "model holds those tensors); do not rebind p.data to the host master.")
            compare(got["host_grads"], want["grads"], name=f"host gradients after step {step}",
                    **_EXACT, hint="each parameter's gradient goes into its own host buffer, "
                                   "and that buffer is what its master's .grad must be.")
            require(got["grads_on_host"], f"after step {step} a master's .grad is not its host "
                    "buffer", hint="the optimizer runs on the host over the masters: their "
                    "gradients are the host buffers, not the device gradients.")
            require(got["stepped"], f"after step {step} the optimizer holds no state for the "
                    "masters", hint="step the optimizer you are given (it updates the host "
                    "masters), not one of your own over the device parameters.")
            compare(got["weights"], want["weights"], name=f"weights after step {step}", **_EXACT,
                    known_wrong={
                        "the device weights are still the ones from before this step: the "
                        "updated masters must go up, after the host step (before it, the weights "
                        "lag one step).": before["weights"],
                        "the device weights never changed: the updated masters must go back "
                        "up.": plain[0]["weights"]})
            compare(got["masters"], want["weights"], name=f"host masters after step {step}",
                    **_EXACT, hint="optimizer.step() updates the masters; do not overwrite them "
                                   "(the copy up goes masters -> parameters).")
    return ("the same weights as AdamW on the device (bit for bit on the CPU), with only the "
            "weights there, and no buffer read before its copy landed")


# ---------------------------------------------------------------- exercise 2: what to offload

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


@exercise(points=1, timeout=20.0, reference="companion.checks.ch08._best_rung")
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


# ---------------------------------------------------------------- exercise 3: the pipeline

def _schedule_cases(seed: int) -> list[tuple]:
    """Per-group times in every regime: host-bound, link-bound down, link-bound up, mixed, and
    gradients that were all ready at once (accumulated over micro-batches)."""
    rng, out = random.Random(seed), []
    for regime in ("host", "down", "up", "mixed", "mixed", "ready", "one"):
        n = 1 if regime == "one" else rng.randint(3, 9)
        scale = {"host": (1, 6, 1), "down": (6, 1, 1), "up": (1, 1, 6)}.get(regime, (2, 2, 2))
        draw = [[round(rng.uniform(0.2, 1.0) * s, 3) for _ in range(n)] for s in scale]
        backward = [round(rng.uniform(0.1, 2.0), 3) for _ in range(n)]
        ready = [0.0] * n if regime == "ready" else [round(sum(backward[:g + 1]), 3)
                                                     for g in range(n)]
        out.append((ready, *draw))
    return out


# A fixed case, first: two groups ready at once whose every stage takes under a second (a
# schedule whose link or CPU is taken to be free only from 1.0 ends late).
_SHORT_SCHEDULE = ([0.0, 0.0], [0.1, 0.2], [0.3, 0.1], [0.2, 0.1])


def _stage_by_stage(ready, down, step, up):
    """A known mistake (the course's own code before it was pipelined): copies down as the
    gradients are ready, then every host step, then every copy up."""
    out, t = {}, 0.0
    for g, at in enumerate(ready):
        out[("down", g)] = t = max(t, at)
        t += down[g]
    for name, seconds in (("step", step), ("up", up)):
        for g in range(len(ready)):
            out[(name, g)] = t
            t += seconds[g]
    return out


def _after_all_downs(ready, down, step, up):
    """A known mistake: the host waits for every copy down before its first step, then steps
    and copies up group by group."""
    later = _stage_by_stage(ready, down, step, up)
    last = max(later[("down", g)] + down[g] for g in range(len(ready)))
    out = schedule_groups([last] * len(ready), [0.0] * len(ready), step, up)
    out.update({("down", g): later[("down", g)] for g in range(len(ready))})
    return out


def _one_link(ready, down, step, up):
    """A known mistake: one link carrying both directions, one copy at a time."""
    out, link, host = {}, 0.0, 0.0
    downs = []
    for g, at in enumerate(ready):
        out[("down", g)] = start = max(at, link)
        link = start + down[g]
        downs.append(link)
    for g in range(len(ready)):
        out[("step", g)] = start = max(host, downs[g])
        host = start + step[g]
        out[("up", g)] = start = max(link, host)
        link = start + up[g]
    return out


def _end(schedule, down, step, up) -> float:
    lengths = {"down": down, "step": step, "up": up}
    return max(t + lengths[name][g] for (name, g), t in schedule.items())


def _validate_schedule(got, ready, down, step, up, where) -> dict:
    n = len(ready)
    keys = {(name, g) for name in ("down", "step", "up") for g in range(n)}
    if not isinstance(got, dict) or set(got) != keys:
        have = sorted(got)[:4] if isinstance(got, dict) else got
        raise CheckFailed(f"{where}: expected a dict with the keys ('down', g), ('step', g) and "
                          f"('up', g) for g in 0..{n - 1}, got {have!r:.120}",
                          hint="one start time per stage and group: {('down', 0): 0.0, ...}.")
    starts = {}
    for key in keys:
        value = got[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                math.isfinite(value) and value >= 0):
            raise CheckFailed(f"{where}: the start of {key} is {value!r}",
                              hint="start times are finite, non-negative seconds.")
        starts[key] = float(value)
    eps = 1e-9
    lengths = {"down": down, "step": step, "up": up}
    for g in range(n):
        require(starts[("down", g)] >= ready[g] - eps,
                f"{where}: group {g}'s copy down starts at {starts[('down', g)]:g}, before "
                f"backward made its gradients (at {ready[g]:g})",
                hint="a gradient can leave only once backward has made it: ready[g].")
        for before, after, what in (("down", "step", "the host step reads its gradient buffer"),
                                    ("step", "up", "the copy up reads its updated weights")):
            end = starts[(before, g)] + lengths[before][g]
            require(starts[(after, g)] >= end - eps,
                    f"{where}: group {g}'s {after} starts at {starts[(after, g)]:g}, before its "
                    f"{before} ends at {end:g}: {what} before they are there",
                    hint="a buffer can be used only once the stage that fills it has ended.")
    for name, what in (("down", "device-to-host link"), ("step", "CPU"),
                       ("up", "host-to-device link")):
        spans = sorted((starts[(name, g)], starts[(name, g)] + lengths[name][g], g)
                       for g in range(n))
        for (s0, e0, g0), (s1, _, g1) in zip(spans, spans[1:]):
            require(s1 >= e0 - eps, f"{where}: the {what} runs groups {g0} and {g1} at once "
                    f"({s0:g}-{e0:g} and from {s1:g})",
                    hint=f"the {what} does one thing at a time: start the next when it is free.")
    return starts


@exercise(points=1, timeout=10.0, reference="companion.offload.schedule_groups")
def check_offload_schedule(answer) -> str:
    """answer(ready, down, step, up) -> {(stage, g): start}: a schedule of every group's copy
    down, host step and copy up that uses no buffer before it is filled, one thing at a time
    per resource, and ends as early as the pipeline can."""
    cases = [_SHORT_SCHEDULE] + _schedule_cases(fresh_seeds(1)[0])
    saved = 0.0
    for ready, down, step, up in cases:
        where = (f"{len(ready)} group(s), ready {ready}, down {down}, step {step}, up {up}")
        best = _end(schedule_groups(ready, down, step, up), down, step, up)
        got = call(answer, list(ready), list(down), list(step), list(up))
        starts = _validate_schedule(got, ready, down, step, up, where)
        mine = _end(starts, down, step, up)
        wrong = {"the stages can overlap: while the host steps group g, the link can bring group "
                 "g+1 down and take group g-1 up.": _stage_by_stage(ready, down, step, up),
                 "nothing here clips the gradients by their global norm or checks them for "
                 "overflow (the exercise says so), so a group's host step needs only its own "
                 "gradients: it can start when that group's copy has landed. DeepSpeed's step "
                 "waits for every gradient because it does both; this pipeline does not.":
                     _after_all_downs(ready, down, step, up),
                 "the link carries both directions at once (PCIe is full duplex): a copy up "
                 "need not wait for the copies down.": _one_link(ready, down, step, up)}
        hints = [text for text, sched in wrong.items()
                 if abs(_end(sched, down, step, up) - mine) < 1e-9]
        require(mine <= best + 1e-9, f"{where}: your schedule ends at {mine:g}; the pipeline can "
                f"end at {best:g}", hint=hints[0] if hints else "start each stage as soon as its "
                "buffer is filled and its resource is free.")
        saved += _end(_stage_by_stage(ready, down, step, up), down, step, up) - mine
    return (f"valid and as short as the pipeline in {len(cases)} cases ({saved:.1f} time units "
            "saved in all against stage by stage)")


# ---------------------------------------------------------------- exercise 4: pack and unpack

def _gpt_case(seed: int):
    width, heads = random.Random(seed).choice([(24, 3), (40, 5), (36, 4)])
    model = GPT(29, 11, width, 2, heads, seed=seed)
    x, y = make_tokens(5, 11, vocab=29, seed=seed)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = [(s.nbytes, s.storage in weights) for s in saved_for_backward(model.loss, x, y)]
    sizes = sorted(n for n, is_weight in saved if not is_weight)
    return model, x, y, saved, sizes[len(sizes) // 2]      # min_bytes: half of them move


def _trip_tensors(seed: int, min_bytes: int) -> list[torch.Tensor]:
    """Three tensors of at least min_bytes that are not parameters: a strided view, a bf16 one,
    a leaf that does not require grad; then one that stays: a view of fewer than min_bytes bytes
    of a storage of more (as q is of a fused qkv's output)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(min_bytes // 24 + 1, 13, generator=g, requires_grad=True) * 2   # not a leaf
    fused = torch.randn(3, min_bytes // 4 + 1, generator=g, requires_grad=True) * 2
    return [base[:, 1::2], base.to(torch.bfloat16), base.detach().exp().T.contiguous(),
            fused[0, :min_bytes // 8]]


def _hooks_of(answer, min_bytes):
    hooks = call(answer, min_bytes)
    if not (isinstance(hooks, tuple) and len(hooks) == 2 and all(map(callable, hooks))):
        raise CheckFailed(f"expected a tuple (pack, unpack) of two functions, got {hooks!r:.80}",
                          hint="return pack, unpack  (the two functions, not their results).")
    return hooks


@harness
def _observe_hooks(answer, seed: int) -> dict:
    """Round trips of single tensors, then a GPT's forward and backward under the hooks."""
    model, x, y, _, min_bytes = _gpt_case(seed)
    pack, unpack = _hooks_of(answer, min_bytes)
    trips = []
    for t in _trip_tensors(seed, min_bytes):
        with track("cpu") as tr:
            packed = pack(t)
            host = tr.host_current
            back = unpack(packed)
            device = tr.current
        trips.append({"back": back, "host": host, "device": device,
                      "nbytes": t.numel() * t.element_size(),
                      "storage": t.untyped_storage().nbytes()})
    with track("cpu") as tr, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model.loss(x, y)
        loss.backward()
    return {"trips": trips, "grads": [p.grad for p in model.parameters()],
            "host_peak": tr.host_peak, "peak": tr.peak, "min_bytes": min_bytes}


def _plain_and_reference(seed: int):
    model, x, y, saved, min_bytes = _gpt_case(seed)
    with track("cpu") as tr:
        model.loss(x, y).backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with track("cpu") as offloaded, offload_activations(min_bytes=min_bytes) as moved:
        model.loss(x, y).backward()
    wrong = {
        "leave parameters where they are: they stay on the device anyway, so copying them saves "
        "nothing (skip leaves that require grad, and views of them: t._base).":
            moved.bytes_to_host + sum(n for n, is_weight in saved if is_weight and n >= min_bytes),
        "move only tensors of at least min_bytes: small ones cost a transfer and save little.":
            sum(n for n, is_weight in saved if not is_weight),
    }
    return grads, moved.bytes_to_host, tr.peak, offloaded.peak, wrong, min_bytes


def _check_trip(trip: dict, expected: torch.Tensor, index: int, min_bytes: int) -> None:
    compare(trip["back"], expected, name=f"unpack(pack(t)) for test tensor {index}", **_EXACT,
            hint="unpack must give back exactly the tensor pack received: same values, dtype "
                 "and shape.")
    if trip["nbytes"] < min_bytes:                  # judged by _check_kept, after the GPT's run
        return
    require(trip["host"] == trip["nbytes"],
            f"pack put {trip['host']} bytes on the host for a {trip['nbytes']}-byte tensor",
            hint="pack must copy a large tensor to the host with offload.to_host(t) (t.clone() "
                 "stays on the device; returning t moves nothing).")
    require(trip["device"] == trip["nbytes"],
            f"unpack allocated {trip['device']} device bytes; it should bring back "
            f"{trip['nbytes']}",
            hint="unpack must copy the tensor back to its device: offload.to_device(host, "
                 "device) (the host copy is not on the device).")


def _check_kept(trip: dict, min_bytes: int) -> None:
    """A tensor of fewer than min_bytes bytes (a small view of a larger storage) stays: checked
    after the GPT's run, whose host bytes name the mistake of moving every tensor."""
    require(trip["host"] == 0 and trip["device"] == 0,
            f"pack put {trip['host']} bytes on the host (unpack {trip['device']} on the device) "
            f"for a view holding {trip['nbytes']} bytes, fewer than min_bytes = {min_bytes}, of "
            f"a storage of {trip['storage']} bytes",
            hint="a view holds only its own elements' bytes, however large the storage it "
                 "views: a small view of a large storage stays where it is.")


@exercise(points=2, timeout=20.0, reference="companion.offload.OffloadActivations")
def check_offload_hooks(answer) -> str:
    """answer(min_bytes) -> (pack, unpack): saved-tensor hooks that move every saved tensor of at
    least min_bytes that is not a parameter to the host, and bring it back to its device."""
    for seed in fresh_seeds(2):
        grads, moved, plain_peak, reference_peak, wrong, min_bytes = _plain_and_reference(seed)
        expected = _trip_tensors(seed, min_bytes)
        seen = _observe_hooks(answer, seed)
        for i, (trip, want) in enumerate(zip(seen["trips"], expected)):
            _check_trip(trip, want.detach(), i, min_bytes)
        # Each tensor's round trip is checked exactly above; the gradients are computed in two
        # processes under the grader (its own and the sandbox's), whose thread counts may sum in
        # another order: the last bits may differ, a wrong round trip (fp16, a stale tensor) is
        # off by far more.
        compare(seen["grads"], grads, name="gradients with your hooks", rtol=1e-5, atol=1e-8,
                hint="every unpacked tensor must equal the one packed, so gradients do not change.")
        compare(seen["host_peak"], moved, name="bytes your hooks kept on the host",
                hint="move each saved tensor that holds at least min_bytes and is not a "
                     "parameter: nothing more, nothing less.", known_wrong=wrong)
        for trip in seen["trips"]:
            if trip["nbytes"] < min_bytes:
                _check_kept(trip, min_bytes)
        require(seen["peak"] <= reference_peak + reference_peak // 50 + 1024,
                f"the device peak with your hooks is {format_bytes(seen['peak'])}; moving the "
                f"same tensors should bring it to {format_bytes(reference_peak)} (without hooks: "
                f"{format_bytes(plain_peak)})",
                hint="don't keep a reference to t in what pack returns (or anywhere else): the "
                     "device copy must be free to go once its host copy is made.")
    return (f"gradients unchanged; {format_bytes(moved)} of saved tensors wait on the host; "
            f"device peak {format_bytes(plain_peak)} -> {format_bytes(seen['peak'])}")
