"""Chapter 08's checks pass on the reference and fail on known-wrong answers, each with its hint."""
import dataclasses

import pytest
import torch

from repeats import REVIEW_RUNS
from companion import cost, estimate, offload
from companion.checks.ch08 import (check_offload_hooks, check_offload_plan,
                                   check_offload_schedule, check_offloaded_step)
from companion.checks.ch08.offload_plan import _best_rung, _plan_cases
from companion.checks.core import CheckFailed


# ---------------------------------------------------------------- exercise 1: the offloaded step

def _step(params, masters, host_grads, optimizer, link, *, free="before sync", sync=True,
          up="after", in_place=True, via_link=True, device_grad=False, up_by_link=False):
    for p, m, g in zip(params, masters, host_grads):
        if via_link:
            link.copy(g, p.grad)                          # device -> host, queued
        else:
            g.copy_(p.grad)                               # a blocking copy: hides the GPU's way
        m.grad = p.grad if device_grad else g
        if free == "before sync":
            p.grad = None
    if sync:
        link.synchronize()                                # every gradient has landed
    if free == "after sync":
        for p in params:
            p.grad = None
    if up == "before":
        _up(params, masters, in_place, link if up_by_link else None)
    optimizer.step()
    if free == "after step":
        for p in params:
            p.grad = None
    if up == "after":
        _up(params, masters, in_place, link if up_by_link else None)


def _up(params, masters, in_place, link=None):
    with torch.no_grad():
        for p, m in zip(params, masters):
            if not in_place:
                p.data = m
            elif link is not None:
                link.copy(p, m)                           # host -> device, queued
            else:
                p.copy_(m)                                # host -> device


def test_offloaded_step_reference_passes():
    check_offloaded_step(_step)
    check_offloaded_step(lambda *a: _step(*a, free="after sync"))
    check_offloaded_step(lambda *a: _step(*a, up_by_link=True))


def test_the_link_copies_and_counts():
    link = offload.Link("cpu")
    dst = torch.zeros(3)
    link.copy(dst, torch.ones(3))
    link.synchronize()
    assert dst.tolist() == [1, 1, 1] and link.copies == 1 and link.bytes == 12
    with pytest.raises(ValueError, match="shape"):
        link.copy(torch.zeros(2), torch.ones(3))
    with pytest.raises(TypeError, match="two tensors"):
        link.copy(dst, None)


@pytest.mark.parametrize("options, hint", [
    ({"sync": False}, "wait for the link"),                      # read before the copies land
    ({"free": "after step"}, "device memory they free"),          # freed only after the step
    ({"free": None}, "device memory they free"),
    ({"via_link": False}, "through link.copy"),
    ({"up": None}, "must go up, after the host step"),
    ({"up": "before"}, "must go up, after the host step"),
    ({"in_place": False}, "own storage"),
    ({"device_grad": True}, "not the device gradients"),
])
def test_offloaded_step_wrong_answers_fail(options, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_offloaded_step(lambda *args: _step(*args, **options))


def test_offloaded_step_with_its_own_optimizer_on_the_device_fails():
    own = {}

    def device_adamw(params, masters, host_grads, optimizer, link):
        if own.get("params") is not params[0]:
            own.update(params=params[0], opt=torch.optim.AdamW(params, lr=0.05,
                                                                 weight_decay=0.1, fused=True))
        for p, g in zip(params, host_grads):
            link.copy(g, p.grad)
        link.synchronize()
        for p, m, g in zip(params, masters, host_grads):
            p.grad, m.grad = None, g
        own["opt"].step()                                # never steps `optimizer`
    with pytest.raises(CheckFailed, match=r"called optimizer.step\(\) 0 times"):
        check_offloaded_step(device_adamw)


def test_offloaded_step_that_overwrites_the_masters_fails():
    def backwards_copy(params, masters, host_grads, optimizer, link):
        _step(params, masters, host_grads, optimizer, link)
        with torch.no_grad():
            for p, m in zip(params, masters):
                m.copy_(p * 1.0001)                       # masters no longer what AdamW made
    with pytest.raises(CheckFailed, match="do not overwrite them"):
        check_offloaded_step(backwards_copy)


def test_offloaded_step_that_steps_twice_fails():
    def twice(params, masters, host_grads, optimizer, link):
        _step(params, masters, host_grads, optimizer, link)
        optimizer.step()
        _up(params, masters, True)
    with pytest.raises(CheckFailed, match="2 times"):
        check_offloaded_step(twice)


# ---------------------------------------------------------------- exercise 2: what to offload

def _plan(layers, speeds, *, k, device_bytes, host_bytes, activation_bytes, disk_bandwidth,
          weight_bytes):
    P = sum(l.params for l in layers)
    L = max(l.params for l in layers)
    times = cost.offload_ladder(layers, speeds, k=k, weight_bytes=weight_bytes,
                                grad_bytes=weight_bytes, disk_bandwidth=disk_bandwidth)
    fits = []
    for rung in cost.OFFLOAD_RUNGS:
        placed = estimate.rung_placement(P, rung, weight_bytes=weight_bytes,
                                         largest_layer_params=L)
        if placed.device + activation_bytes <= device_bytes and placed.host <= host_bytes:
            fits.append((times[rung].total, rung))
    if not fits:
        return None
    seconds, rung = min(fits, key=lambda f: f[0])
    return rung, seconds


def test_offload_plan_reference_passes():
    check_offload_plan(_plan)
    check_offload_plan(lambda layers, speeds, **kw: _best_rung(layers, speeds, **kw))


def test_offload_plan_cases_reach_every_rung_and_none():
    chosen = {(_best_rung(**{k: v for k, v in c.items() if k != "gpu"}) or ("None",))[0]
              for seed in range(3) for c in _plan_cases(seed)}
    assert chosen == {*cost.OFFLOAD_RUNGS, "None"}


def _wrong_plan(**options):
    return lambda layers, speeds, **kw: _best_rung(layers, speeds, **{**kw, **options})


@pytest.mark.parametrize("wrong, hint", [
    (_wrong_plan(first_fit=True), "not the first that fits"),
    (_wrong_plan(with_activations=False), "activations live on the device"),
    (_wrong_plan(with_host=False), "host's RAM"),
    (_wrong_plan(time_k=1), "all k micro-batches"),
    (_wrong_plan(time_bytes=2), "weights' dtype"),
    (_wrong_plan(part="compute"), r"not the\s+compute alone"),
    (_wrong_plan(memory=False), "must fit before"),
    (_wrong_plan(largest=False), "count the largest layer"),
    (_wrong_plan(strict=True), "needs exactly the bytes there are still fits"),
    (lambda layers, speeds, **kw: (_best_rung(layers, speeds, **kw) or (None,))[0],
     r"expected \(rung, seconds\)"),
])
def test_offload_plan_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_offload_plan(wrong)


def _most_offloaded_of_equals(layers, speeds, **kw):
    """Correct: on an exact tie in time, the more offloaded rung (the review's answer, failed 1
    run in 3: 'nvme' ties 'parameters' whenever the disk hides behind the host step)."""
    times = _best_rung(layers, speeds, **kw, every=True)
    if not times:
        return None
    best = min(times.values())
    return [(r, t) for r, t in times.items() if t == best][-1]


def test_offload_plan_fixed_case_needs_the_largest_layer():
    from companion.checks.ch08.offload_plan import _fixed_plan_cases
    for case in _fixed_plan_cases():
        kw = {k: v for k, v in case.items() if k != "gpu"}
        assert _best_rung(**kw) is None and _best_rung(**kw, largest=False)[0] == "parameters"


@pytest.mark.slow
def test_offload_plan_review_answers_20_runs():
    """Issue 54: the reference and the most offloaded of equals pass 20 of 20 runs (ties failed
    7 of 20 before); a count without the largest layer fails 20 of 20 (passed 4 of 20)."""
    for _ in range(REVIEW_RUNS):
        check_offload_plan(_plan)
        check_offload_plan(_most_offloaded_of_equals)
        with pytest.raises(CheckFailed, match="nothing fits") as failed:
            check_offload_plan(_wrong_plan(largest=False))
        assert "count the largest layer" in failed.value.hint


def _plan_with_room_to_spare(device, host):
    """The notebook's solution with a fit that needs bytes to spare: on the device (`device`)
    or on the host (`host`); bench_mutants' survivors (issue 54), > turned >=."""
    def plan_offload(layers, speeds, *, k, device_bytes, host_bytes, activation_bytes,
                     disk_bandwidth, weight_bytes):
        n = sum(l.params for l in layers)
        largest_layer = max(l.params for l in layers)
        times = cost.offload_ladder(layers, speeds, k=k, weight_bytes=weight_bytes,
                                    grad_bytes=weight_bytes, disk_bandwidth=disk_bandwidth)
        best = None
        for rung in cost.OFFLOAD_RUNGS:
            placed = estimate.rung_placement(n, rung, weight_bytes=weight_bytes,
                                             largest_layer_params=largest_layer)
            on_device = placed.device + activation_bytes
            if (on_device >= device_bytes if device else on_device > device_bytes) or (
                    placed.host >= host_bytes if host else placed.host > host_bytes):
                continue
            if best is None or times[rung].total < best[1]:
                best = (rung, times[rung].total)
        return best
    return plan_offload


def test_offload_plan_exact_fit_cases_fill_the_memory_with_the_fastest_rung():
    from companion.checks.ch08.offload_plan import _exact_fit_plan_cases
    for case in _exact_fit_plan_cases():
        kw = {k: v for k, v in case.items() if k != "gpu"}
        assert _best_rung(**kw)[0] == "gradients"
        assert _best_rung(**kw, strict=True)[0] != "gradients"
        assert _plan(**kw) == _best_rung(**kw)


@pytest.mark.parametrize("device, host", [(True, False), (False, True), (True, True)])
def test_offload_plan_fails_a_fit_that_needs_bytes_to_spare_every_time(device, host):
    for _ in range(20):
        with pytest.raises(CheckFailed, match="the fastest rung that fits is 'gradients'") as e:
            check_offload_plan(_plan_with_room_to_spare(device, host))
        assert "needs exactly the bytes there are still fits" in e.value.hint


def test_offload_plan_with_seconds_that_are_not_a_number_fails_clearly():
    def text(layers, speeds, **kw):
        best = _best_rung(layers, speeds, **kw)
        return best and (best[0], f"{best[1]:.3f} s")
    with pytest.raises(CheckFailed, match="not a number of seconds"):
        check_offload_plan(text)


def test_offload_schedule_takes_numpy_floats():
    import numpy as np
    check_offload_schedule(lambda *a, **kw: {k: np.float64(v) for k, v in _schedule(*a, **kw).items()})


def test_offload_plan_that_never_says_none_fails():
    def always(layers, speeds, **kw):
        return _best_rung(layers, speeds, **kw) or ("nvme", 1.0)
    with pytest.raises(CheckFailed, match="nothing fits"):
        check_offload_plan(always)


# ---------------------------------------------------------------- exercise 3: the pipeline

def _schedule(ready, down, step, up, barrier=False):
    return offload.schedule_groups(ready, down, step, up, barrier=barrier)


def _stage_by_stage(ready, down, step, up, barrier=False):
    from companion.checks.ch08.pipeline import _stage_by_stage as mistake
    return mistake(ready, down, step, up)


def _always_barrier(ready, down, step, up, barrier=False):
    """Waits for every gradient even when nothing clips or checks for overflow."""
    from companion.checks.ch08.pipeline import _after_all_downs as mistake
    return mistake(ready, down, step, up)


def _ignores_barrier(ready, down, step, up, barrier=False):
    """The pipeline without the barrier, whatever the flag says (the exercise before issue 56)."""
    return _schedule(ready, down, step, up)


def _barrier_inverted(ready, down, step, up, barrier=False):
    return _schedule(ready, down, step, up, barrier=not barrier)


def _barrier_at_backward_end(ready, down, step, up, barrier=False):
    """With the barrier, the host steps once backward has ended (the last gradient made), not
    once it has landed on the host."""
    out = _schedule(ready, down, step, up)
    if barrier:
        host = max(ready)
        for g in range(len(ready)):
            out[("step", g)] = host = max(host, out[("down", g)] + down[g])
            host += step[g]
            out[("up", g)] = max(out[("up", g)], host, out[("up", g - 1)] + up[g - 1] if g else 0)
    return out


def _one_link(ready, down, step, up, barrier=False):
    from companion.checks.ch08.pipeline import _one_link as mistake
    return mistake(ready, down, step, up, barrier)


def _no_wait(ready, down, step, up, barrier=False):
    """Each host step starts with its copy down: it reads a buffer still in flight."""
    out = _schedule(ready, down, step, up, barrier)
    for g in range(len(ready)):
        out[("step", g)] = out[("down", g)]
    return out


def _up_with_step(ready, down, step, up, barrier=False):
    out = _schedule(ready, down, step, up, barrier)
    for g in range(len(ready)):
        out[("up", g)] = out[("step", g)]
    return out


def _ignores_ready(ready, down, step, up, barrier=False):
    return _schedule([0.0] * len(ready), down, step, up, barrier)


def _all_ups_at_once(ready, down, step, up, barrier=False):
    out = _schedule(ready, down, step, up, barrier)
    last = max(out[("step", g)] + step[g] for g in range(len(ready)))
    out.update({("up", g): last for g in range(len(ready))})
    return out


def _johnson_after_barrier(ready, down, step, up, barrier=False):
    """Right, and sometimes shorter than in order: after the barrier every group is ready for
    the host at once, a two-machine flow shop (host, link up) that Johnson's rule orders."""
    out = _schedule(ready, down, step, up, barrier)
    if not barrier:
        return out
    n = len(ready)
    first = sorted((g for g in range(n) if step[g] < up[g]), key=lambda g: step[g])
    order = first + sorted((g for g in range(n) if step[g] >= up[g]), key=lambda g: -up[g])
    host = link = max(out[("down", g)] + down[g] for g in range(n))
    for g in order:
        out[("step", g)] = host
        host += step[g]
        out[("up", g)] = link = max(link, host)
        link += up[g]
    return out


def test_offload_schedule_reference_passes():
    check_offload_schedule(_schedule)


def test_offload_schedule_passes_a_better_order_after_the_barrier():
    check_offload_schedule(_johnson_after_barrier)
    ready, down, step, up = [0.0, 0.0], [0.5, 0.5], [5.0, 1.0], [1.0, 5.0]
    end = {k: max(t + {"down": down, "step": step, "up": up}[k[0]][k[1]]
                  for k, t in f(ready, down, step, up, True).items())
           for k, f in (("in order", _schedule), ("johnson", _johnson_after_barrier))}
    assert end["johnson"] < end["in order"]


def test_schedule_groups_by_hand():
    got = offload.schedule_groups([0, 1], [1, 1], [2, 2], [1, 1])
    assert got == {("down", 0): 0, ("step", 0): 1, ("up", 0): 3,
                   ("down", 1): 1, ("step", 1): 3, ("up", 1): 5}
    got = offload.schedule_groups([0, 1], [1, 1], [2, 2], [1, 1], barrier=True)
    assert got == {("down", 0): 0, ("step", 0): 2, ("up", 0): 4,
                   ("down", 1): 1, ("step", 1): 4, ("up", 1): 6}
    with pytest.raises(ValueError, match="one value per group"):
        offload.schedule_groups([0], [1, 1], [1], [1])
    with pytest.raises(ValueError, match="non-negative"):
        offload.schedule_groups([0], [float("nan")], [1], [1])


@pytest.mark.parametrize("wrong, hint", [
    (_stage_by_stage, "the stages can overlap"),
    (_always_barrier, "with barrier=False nothing clips"),
    (_ignores_barrier, "before the last gradient has landed"),
    (_barrier_inverted, "with barrier=False nothing clips|before the last gradient has landed"),
    (_barrier_at_backward_end, "before the last gradient has landed"),
    (_one_link, "full duplex"),
    (_no_wait, "reads its gradient buffer before"),
    (_up_with_step, "reads its updated weights before"),
    (_ignores_ready, r"before\s+backward made its gradients"),
    (_all_ups_at_once, "host-to-device link runs groups"),
    (lambda *a, **k: list(_schedule(*a, **k).values()), "expected a dict"),
    (lambda *a, **k: {key: float("nan") for key in _schedule(*a, **k)}, "finite"),
])
def test_offload_schedule_wrong_answers_fail(wrong, hint):
    for _ in range(5):
        with pytest.raises(CheckFailed, match=hint):
            check_offload_schedule(wrong)


def test_offload_schedule_without_the_barrier_argument_fails_clearly():
    with pytest.raises(CheckFailed, match="barrier"):
        check_offload_schedule(lambda ready, down, step, up: _schedule(ready, down, step, up))


def _schedule_with_links_free_from(down, step, up):
    """The notebook's solution with the link down, the CPU and the link up taken to be free
    only from the given times (bench_mutants' survivor, issue 54: the link up from 1.0)."""
    def schedule(ready, down_s, step_s, up_s, barrier):
        starts, free = {}, {"down": down, "step": step, "up": up}
        for g in range(len(ready)):
            starts[("down", g)] = max(ready[g], free["down"])
            free["down"] = starts[("down", g)] + down_s[g]
        for g in range(len(ready)):
            at = max(starts[("down", h)] + down_s[h] for h in range(len(ready))) if barrier \
                else starts[("down", g)] + down_s[g]
            for stage, seconds in (("step", step_s), ("up", up_s)):
                starts[(stage, g)] = max(at, free[stage])
                at = free[stage] = starts[(stage, g)] + seconds[g]
        return starts
    return schedule


@pytest.mark.parametrize("free", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)])
def test_offload_schedule_fails_a_resource_busy_at_the_start_every_time(free):
    check_offload_schedule(_schedule_with_links_free_from(0.0, 0.0, 0.0))
    for _ in range(20):
        with pytest.raises(CheckFailed, match=r"2 group\(s\), ready \[0.0, 0.0\].*the pipeline can"):
            check_offload_schedule(_schedule_with_links_free_from(*free))


# ---------------------------------------------------------------- exercise 4: pack and unpack

def _is_parameter(t):
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def _hooks(min_bytes, *, skip_params=True, threshold=True, to_host=offload.to_host,
           back=offload.to_device):
    def pack(t):
        small = threshold and t.numel() * t.element_size() < min_bytes
        if small or (skip_params and _is_parameter(t)):
            return t
        return t.device, to_host(t)

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return back(host, device)
    return pack, unpack


def test_offload_hooks_reference_passes():
    check_offload_hooks(_hooks)
    check_offload_hooks(lambda min_bytes: (offload.offload_activations(min_bytes=min_bytes)._pack,
                                           offload.offload_activations(min_bytes=min_bytes)._unpack))


def _keeps_a_reference(min_bytes):
    pack, unpack = _hooks(min_bytes)

    def pack_and_keep(t):
        packed = pack(t)
        return packed if isinstance(packed, torch.Tensor) else (*packed, t)   # t stays alive
    return pack_and_keep, lambda packed: unpack(packed if isinstance(packed, torch.Tensor)
                                                else packed[:2])


def _storage_sized(min_bytes):
    """Sizes a tensor by its storage: moves a small view of a large one (passed 3/3 in the
    review)."""
    def pack(t):
        base = t._base if t._base is not None else t
        if t.untyped_storage().nbytes() < min_bytes or (base.is_leaf and base.requires_grad):
            return t
        return t.device, offload.to_host(t)
    return pack, _hooks(min_bytes)[1]


def test_offload_hooks_review_answers_20_runs():
    for _ in range(20):
        check_offload_hooks(_hooks)
        with pytest.raises(CheckFailed, match="fewer than min_bytes") as failed:
            check_offload_hooks(_storage_sized)
        assert "small view of a large storage" in failed.value.hint


def test_the_reference_moves_no_expanded_tensor():
    hooks = offload.offload_activations(min_bytes=0)
    source = torch.randn(1, 64, requires_grad=True) * 2
    expanded = source.expand(256, 64)                      # 256 KiB seen, 256 B stored
    assert hooks._pack(expanded) is expanded and hooks.bytes_to_host == 0


@pytest.mark.parametrize("wrong, hint", [
    (lambda m: (lambda t: t, lambda p: p), "to_host"),
    (lambda m: _hooks(m, to_host=lambda t: t.clone()), "clone"),
    (lambda m: _hooks(m, back=lambda host, device: host), "back to its device"),
    (lambda m: _hooks(m, skip_params=False), "leave parameters"),
    (lambda m: _hooks(m, threshold=False), "at least min_bytes"),
    (lambda m: _hooks(m, to_host=lambda t: offload.to_host(t, dtype=torch.float32)), "dtype"),
    (lambda m: _hooks(m)[0], "tuple \\(pack, unpack\\)"),
    (lambda m: tuple(reversed(_hooks(m))), "unpack_hook expected to be a Tensor"),
    (_keeps_a_reference, "don't keep a reference to t"),
])
def test_offload_hooks_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_offload_hooks(wrong)


CHECKS = [check_offload_hooks, check_offloaded_step, check_offload_plan, check_offload_schedule]


def _hangs(*args, **kwargs):
    while True:
        pass


@pytest.mark.parametrize("check", CHECKS)
def test_a_hang_fails_within_the_time_limit(check):
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hangs, timeout=1.0)
