"""The activation-budget solver (companion.checkpointing.budget, budget_run): the operators'
bytes against what torch's own selective checkpointing keeps, measured to the byte; the knapsack
against brute force; the plan's policy run through torch.utils.checkpoint, offload included,
equal to the plain block; fit measured under its budget. Each check also fails a known-wrong
variant (a solver that ignores bytes or one that recomputes everything, a policy that saves
nothing)."""
import dataclasses
import functools
import itertools
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from companion.checkpointing import (RegionOp, RematPlan, activation_bytes, checkpoint_with_plan,
                                     fit, held_bytes, plan_policy, region_ops, solve)
from companion.memory import track
from companion.models import GPT, Llama

pytestmark = pytest.mark.usefixtures("one_thread")

RATES = dict(seconds_per_flop=1 / 26e9, seconds_per_byte=1 / 15e9)   # CostModel's CPU
HOST = 1 / 2.9e9


def _gpt():
    return GPT(64, 16, 32, 1, 4, seed=0).blocks[0]


def _llama():
    return Llama(64, 16, 32, 1, 4, kv_heads=2, intermediate=64, seed=0).blocks[0]


def _x(seed=0):
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed),
                       requires_grad=True)


def _sac_held(block, x, policy) -> int:
    """Bytes torch's SAC holds after forward under `policy`: inputs counted, output not."""
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    with track() as t:
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context)
        return t.current - y.untyped_storage().nbytes() + x.untyped_storage().nbytes()


def _must_save_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


# 1. region_ops -------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_saving_every_operator_holds_what_torchs_sac_holds_to_the_byte(make):
    block, x = make(), _x()
    region = region_ops(block, x)
    everything = sum(op.nbytes for op in region.ops if not op.output)
    # torch's SAC with MUST_SAVE on every operator (views too: they add no storage)
    assert _sac_held(block, x, _must_save_all) == region.input_bytes + everything
    # and nothing saved: only the input (the checkpoint)
    assert _sac_held(block, x, lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE) == \
        region.input_bytes == 2 * 16 * 32 * 4
    assert region.output_bytes == 2 * 16 * 32 * 4


def test_region_ops_counts_bytes_flops_and_what_backward_needs():
    block, x = _gpt(), _x()
    region = region_ops(block, x)
    names = [op.name for op in region.ops]
    assert "aten.detach.default" not in names                  # SAC does not count it
    linears = [op for op in region.ops if op.name == "aten.addmm.default"]
    N, C = 2 * 16, 32
    assert [op.flops for op in linears] == [2 * N * C * 3 * C, 2 * N * C * C,
                                            2 * N * C * 4 * C, 2 * N * 4 * C * C]
    assert [op.nbytes for op in linears] == [4 * N * 3 * C, 4 * N * C, 4 * N * 4 * C, 4 * N * C]
    views = [op for op in region.ops if op.name in ("aten.view.default", "aten.t.default",
                                                    "aten.transpose.int", "aten.split.Tensor")]
    assert views and all(op.nbytes == op.moved_bytes == 0 and not op.can_keep for op in views)
    gelu = next(op for op in region.ops if op.name == "aten.gelu.default")
    assert (gelu.flops, gelu.moved_bytes, gelu.needed) == (0, 2 * 4 * N * 4 * C, True)
    assert [op.output for op in region.ops].index(True) == len(region.ops) - 1
    # what backward needs: the storages autograd saves, besides the input
    needed = sum(op.nbytes for op in region.ops if op.needed)
    assert needed + region.input_bytes == activation_bytes(block, x)


def test_an_output_changed_in_place_later_cannot_be_kept():
    block, x = _llama(), _x()
    region = region_ops(block, x)
    # RMSNorm: mean, then add_(eps) on it: SAC would raise if the mean were kept
    means = [op for op in region.ops if op.name == "aten.mean.dim"]
    assert len(means) == 2 and not any(op.can_keep for op in means)
    assert all(op.nbytes == 2 * 16 * 4 for op in means)
    sdpa = next(op for op in region.ops if "scaled_dot_product" in op.name)
    assert sdpa.flops == 2 * (2 * 2 * 4 * 16 * 8 * 16)          # q·kᵀ and weights·v
    # backward's saved bytes, besides the input and the rotary's cos and sin buffers
    buffers = 2 * 16 * 8 * 4
    assert sum(op.nbytes for op in region.ops if op.needed) + region.input_bytes + buffers == \
        activation_bytes(block, x)
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad enabled"):
        region_ops(block, x)


# 2. solve --------------------------------------------------------------------------------------

def _random_ops(rng: random.Random, n: int) -> list[RegionOp]:
    return [RegionOp(i, "aten.op", rng.choice([0, 4, 8, 12, 20, 32, 36]),
                     rng.choice([0, 100, 1000, 5000]), rng.choice([0, 8, 64, 256]),
                     rng.random() < 0.5, rng.random() < 0.8, rng.random() < 0.1)
            for i in range(n)]


def _brute(ops, budget, base, host):
    """The least added seconds over every combination, and its kept bytes."""
    spf, spb = RATES["seconds_per_flop"], RATES["seconds_per_byte"]
    best = None
    for combo in itertools.product(("keep", "recompute", "offload"), repeat=len(ops)):
        kept, seconds = base, 0.0
        for op, c in zip(ops, combo):
            if c == "keep":
                if not op.can_keep:
                    break
                kept += 0 if op.output else op.nbytes
            elif c == "recompute":
                seconds += op.flops * spf + op.moved_bytes * spb
            elif host is None or op.nbytes == 0:
                break
            else:
                seconds += 2 * op.nbytes * host
        else:
            if kept <= budget and (best is None or seconds < best):
                best = seconds
    return best


def _check_solver(solver, seeds=range(40)):
    """The solver's plan fits, and costs what brute force's best costs."""
    for seed in seeds:
        rng = random.Random(seed)
        ops = _random_ops(rng, rng.randint(1, 6))
        base = rng.choice([0, 16])
        budget = base + rng.randint(0, sum(op.nbytes for op in ops))
        host = HOST if seed % 2 else None
        plan = solver(ops, budget, host_seconds_per_byte=host, input_bytes=base, **RATES)
        kept = base + sum(op.nbytes for op, c in zip(ops, plan.choices)
                          if c == "keep" and not op.output)
        assert plan.kept_bytes == kept <= budget, (seed, plan)
        assert plan.seconds == pytest.approx(_brute(ops, budget, base, host), abs=1e-15), seed
        assert all(op.can_keep for op, c in zip(ops, plan.choices) if c == "keep")
        assert host is not None or "offload" not in plan.choices


def test_solve_matches_brute_force_on_random_small_cases():
    _check_solver(solve)


def _keeps_everything(ops, budget, **kwargs):
    """Wrong: ignores the bytes, keeps whatever can be kept."""
    plan = solve(ops, 10**9, **kwargs)
    return dataclasses.replace(plan, choices=tuple("keep" if op.can_keep else c
                                                   for op, c in zip(ops, plan.choices)))


def _recomputes_everything(ops, budget, **kwargs):
    """Wrong: fits any budget, but pays for it."""
    plan = solve(ops, budget, **kwargs)
    kept = plan.input_bytes
    return dataclasses.replace(plan, choices=("recompute",) * len(ops), kept_bytes=kept,
                               seconds=sum(op.flops * RATES["seconds_per_flop"] + op.moved_bytes *
                                           RATES["seconds_per_byte"] for op in ops))


@pytest.mark.parametrize("wrong", [_keeps_everything, _recomputes_everything])
def test_the_brute_force_check_fails_known_wrong_solvers(wrong):
    with pytest.raises(AssertionError):
        _check_solver(wrong)


def test_the_replay_stops_at_the_last_operator_backward_needs():
    # A GPT block ends with the MLP's second matmul and the residual add: backward needs neither
    # output, so SAC's early stop never runs them again, and a plan prices them at nothing.
    block, x = _gpt(), _x()
    region = region_ops(block, x)
    last = max(op.index for op in region.ops if op.needed)
    assert [op.replayed for op in region.ops] == [op.index <= last for op in region.ops]
    assert region.ops[-1].output and not region.ops[-1].replayed
    assert any(op.flops and not op.replayed for op in region.ops)          # the last matmul
    plan = solve(region, region.input_bytes, **RATES)
    counted = _recomputed_flops(block, x, plan)
    assert counted == plan.recompute_flops < sum(op.flops for op in region.ops)


def _recomputed_flops(block, x, plan):
    """FLOPs backward runs beyond a plain backward's, counted by flop_counter's formulas."""
    from companion.checkpointing.budget import _flops

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.n += _flops(func, args, kwargs or {}, out)
            return out

    def backward_flops(run):
        y = run()
        Count.n = 0
        with Count():
            y.backward(torch.ones_like(y))
        return Count.n

    plain = backward_flops(lambda: block(x))
    return backward_flops(lambda: checkpoint_with_plan(block, x, plan=plan)) - plain


def test_a_coarse_grid_still_fits_and_never_beats_the_exact_plan():
    rng = random.Random(7)
    for _ in range(20):
        ops = _random_ops(rng, 6)
        budget = rng.randint(0, sum(op.nbytes for op in ops))
        exact = solve(ops, budget, **RATES)
        coarse = solve(ops, budget, grid=24, **RATES)
        assert exact.grid == 4 and coarse.grid == 24
        assert coarse.kept_bytes <= budget and coarse.seconds >= exact.seconds - 1e-15


def test_an_impossible_budget_names_the_least_feasible_one():
    region = region_ops(_gpt(), _x())
    with pytest.raises(ValueError, match=f"least feasible budget is {region.input_bytes} bytes"):
        solve(region, region.input_bytes - 1, **RATES)
    plan = solve(region, region.input_bytes, **RATES)            # the inputs alone: every
    assert plan.kept_bytes == region.input_bytes                 # operator recomputed; the
    assert plan.indices("keep") == set()                         # output, past the early stop,
    assert not region.ops[-1].replayed                           # costs nothing either way
    with pytest.raises(ValueError, match="seconds_per_flop"):
        solve(region, 10**6, seconds_per_flop=-1.0, seconds_per_byte=0.0)
    with pytest.raises(TypeError, match="budget_bytes"):
        solve(region, "1 MiB", **RATES)
    with pytest.raises(TypeError, match="region_ops"):
        solve([4096, 8192], 10**6, **RATES)


# 3. plan_policy and checkpoint_with_plan -------------------------------------------------------

def _same_as_plain(block, x, run):
    y = run(block, x)
    grads = torch.autograd.grad(y.sum(), [x, *block.parameters()])
    y0 = block(x)
    torch.testing.assert_close(y, y0)
    for got, want in zip(grads, torch.autograd.grad(y0.sum(), [x, *block.parameters()])):
        torch.testing.assert_close(got, want)


def _check_policy(make_policy, block, x, plan):
    """The policy saves exactly the plan's kept operators: SAC's held bytes are the plan's."""
    chosen = []

    def recording(ctx, op, *args, **kwargs):
        choice = policy(ctx, op, *args, **kwargs)
        if choice == CheckpointPolicy.MUST_SAVE:
            chosen.append(len(calls))
        calls.append(op)
        return choice

    calls, policy = [], make_policy(plan)
    assert _sac_held(block, x, recording) == plan.kept_bytes
    assert set(chosen) == plan.indices("keep")


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_the_plans_policy_keeps_exactly_its_operators(make):
    block, x = make(), _x()
    region = region_ops(block, x)
    everything = sum(op.nbytes for op in region.ops if not op.output and op.can_keep)
    plan = solve(region, region.input_bytes + everything // 3, **RATES)
    assert region.input_bytes < plan.kept_bytes <= region.input_bytes + everything // 3
    _check_policy(plan_policy, block, x, plan)
    with pytest.raises(AssertionError):                          # a policy that saves nothing
        _check_policy(lambda p: lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE, block, x, plan)
    _same_as_plain(block, x, lambda b, t: checkpoint_with_plan(b, t, plan=plan))


def test_a_plan_for_another_region_is_refused():
    plan = solve(region_ops(_gpt(), _x()), 10**6, **RATES)
    with pytest.raises(RuntimeError, match="region_ops"):
        checkpoint_with_plan(_llama(), _x(), plan=plan)
    offloading = solve(region_ops(_gpt(), _x()), 0 + 2048 * 2, host_seconds_per_byte=HOST,
                       **RATES)
    assert offloading.offloaded_bytes > 0
    with pytest.raises(ValueError, match="checkpoint_with_plan"):
        plan_policy(offloading)


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_offload_moves_bytes_to_the_host_and_gives_the_plain_gradients(make):
    block, x = make(), _x()
    region = region_ops(block, x)
    plan = solve(region, region.input_bytes + 4096, host_seconds_per_byte=HOST, **RATES)
    assert plan.offloaded_bytes > 0
    device, host, _ = held_bytes(block, (x,), plan)
    assert (device, host) == (plan.kept_bytes, plan.offloaded_bytes)
    # the same plan keeping what it offloads holds those bytes on the device instead
    keeps = dataclasses.replace(plan, choices=tuple(
        "keep" if c == "offload" and op.can_keep else c for op, c in zip(plan.ops, plan.choices)))
    moved = sum(op.nbytes for op, c in zip(plan.ops, plan.choices)
                if c == "offload" and op.can_keep)
    assert moved > 0
    assert held_bytes(block, (x,), keeps)[:2] == (device + moved, host - moved)
    _same_as_plain(block, x, lambda b, t: checkpoint_with_plan(b, t, plan=plan))
    # backward runs again the recomputed operators, not the offloaded ones
    forward_only = ("aten.addmm.default",
                    "aten._scaled_dot_product_flash_attention_for_cpu.default")
    redone = [op.name for op, c in zip(plan.ops, plan.choices)
              if c == "recompute" and op.replayed]
    offloaded = [op.name for op, c in zip(plan.ops, plan.choices) if c == "offload"]
    assert any(name in forward_only for name in offloaded)
    y = checkpoint_with_plan(block, x, plan=plan)
    with _InBackward() as ran:
        y.sum().backward()
    assert [n for n in ran.names if n in forward_only] == [n for n in redone if n in forward_only]


class _InBackward(TorchDispatchMode):
    """The operators that run inside backward, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


# 4. fit ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("share", [0.25, 0.6])
def test_fit_measures_under_its_budget_and_gives_the_plain_gradients(make, share):
    block, x = make(), _x(1)
    region = region_ops(block, x)
    everything = sum(op.nbytes for op in region.ops if not op.output and op.can_keep)
    budget = region.input_bytes + int(share * everything)
    fitted = fit(block, (x,), budget, **RATES)
    assert fitted.measured_bytes == fitted.plan.kept_bytes <= budget
    assert fitted.tries == ((budget, fitted.measured_bytes),)
    assert fitted.plan.recompute_flops < sum(op.flops for op in region.ops)
    _same_as_plain(block, x, lambda b, t: checkpoint_with_plan(b, t, plan=fitted.plan))
    assert all(p.grad is None for p in block.parameters())        # fit changed no .grad
    if share == 0.25:                                # rates by default: CostModel's CPU ones
        assert fit(block, (x,), budget).plan == fitted.plan


def test_fit_lowers_the_budget_by_what_it_measured_over_and_refuses_what_cannot_fit():
    held, w = [], torch.randn(32, 32)
    free_bytes = dict(seconds_per_flop=1e-9, seconds_per_byte=0.0)   # element-wise ops cost 0

    def leaky(x):
        h = x @ w                                    # (2, 16, 32): worth keeping
        held.append(h.sin())                         # held outside anything checkpointing sees
        return h.tanh()

    x = _x()
    extra = x.untyped_storage().nbytes()             # the sin's (2, 16, 32)
    region = region_ops(leaky, x)
    budget = region.input_bytes + extra              # room for h, not for h and the leak
    fitted = fit(leaky, (x,), budget, **free_bytes)
    assert fitted.tries == ((budget, budget + extra), (budget - extra, budget))
    assert fitted.measured_bytes == budget
    assert fitted.plan.recompute_flops == 2 * 32 * 32 * 32      # h: kept first, then redone
    with pytest.raises(ValueError, match=f"tightest measured held {budget} bytes after 2"):
        fit(leaky, (x,), budget - extra // 2, **free_bytes)
    with pytest.raises(ValueError, match="least feasible"):
        fit(leaky, (x,), 16, **free_bytes)
    with pytest.raises(TypeError, match="tuple"):
        fit(leaky, x, budget, **free_bytes)
    with pytest.raises(ValueError, match="rounds"):
        fit(leaky, (x,), budget, rounds=0, **free_bytes)
