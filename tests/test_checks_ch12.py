"""Chapter 12's checks pass on the reference solutions (the code of the notebook's solution
cells) over several seeds, and fail, with a hint that names the mistake, on the wrong answers a
learner writes; bad input fails cleanly."""
import functools
import itertools
import math

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from companion.checks.ch12 import check_budget_policy, check_choose_remat, check_fused_chunk
from companion.checks.core import CheckFailed, evaluate, seeded
from companion.grader import wire
from elsewhere import Elsewhere

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- exercise 1: the reference

def _most_flops(items, room):
    """The notebook's knapsack: which of `items` (RegionOps) to keep within `room` bytes for the
    most FLOPs kept (the solution cell's body, shared by the wrong answers below)."""
    unit = math.gcd(*(op.nbytes for op in items)) or 1
    cells = max(0, room) // unit
    best = np.zeros(cells + 1)
    took = np.zeros((len(items), cells + 1), dtype=bool)
    for i, op in enumerate(items):
        w = op.nbytes // unit
        if w <= cells:
            candidate = np.full(cells + 1, -1.0)
            candidate[w:] = best[:cells + 1 - w] + op.flops
            took[i] = candidate > best
            best = np.maximum(best, candidate)
    keep, c = set(), cells
    for i in reversed(range(len(items))):
        if took[i, c]:
            keep.add(items[i].index)
            c -= items[i].nbytes // unit
    return keep


def _policy(keep):
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        i = counts[ctx.is_recompute]
        counts[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if i in keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def budget_policy(region, budget_bytes):
    """The reference: the table of `_most_flops` over the outputs worth keeping, as a policy."""
    items = [op for op in region.ops
             if op.can_keep and op.flops > 0 and op.replayed and not op.output]
    return _policy(_most_flops(items, budget_bytes - region.input_bytes))


@pytest.mark.parametrize("seed", range(4))
def test_budget_policy_reference_passes(seed):
    with seeded(seed):
        check_budget_policy(budget_policy)


def test_budget_policy_reference_passes_fresh_draws():
    check_budget_policy(budget_policy)


# ---------------------------------------------------------------- exercise 1: wrong answers

def _keep_all(region, budget_bytes):
    return lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE


def _recompute_all(region, budget_bytes):
    return lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE


def _greedy(region, budget_bytes, *, stop):
    room, keep = budget_bytes - region.input_bytes, {op.index for op in region.ops if op.output}
    for op in sorted((op for op in region.ops
                      if op.can_keep and op.flops and op.replayed and not op.output),
                     key=lambda op: -op.flops / op.nbytes):
        if op.nbytes <= room:
            room, keep = room - op.nbytes, keep | {op.index}
        elif stop:
            break
    return _policy(keep)


def _greedy_skipping(region, budget_bytes):
    """By FLOPs per byte, skipping what does not fit and going on."""
    return _greedy(region, budget_bytes, stop=False)


def _greedy_stopping(region, budget_bytes):
    """By FLOPs per byte, until the first that does not fit."""
    return _greedy(region, budget_bytes, stop=True)


def _by_name(region, budget_bytes):
    """Every matmul's output, whatever the budget."""
    return _policy({op.index for op in region.ops if op.flops and op.can_keep})


def _inputs_ignored(region, budget_bytes):
    items = [op for op in region.ops
             if op.can_keep and op.flops > 0 and op.replayed and not op.output]
    return _policy(_most_flops(items, budget_bytes) | {op.index for op in region.ops if op.output})


def _output_counted(region, budget_bytes):
    """The region's output counted as held by the checkpoint, against the budget."""
    items = [op for op in region.ops
             if op.can_keep and op.flops > 0 and op.replayed and not op.output]
    output = sum(op.nbytes for op in region.ops if op.output)
    return _policy(_most_flops(items, budget_bytes - region.input_bytes - output))


@functools.lru_cache
def _cached(region, budget_bytes):
    """The same policy object for the same region and budget."""
    return budget_policy(region, budget_bytes)


_SHARED = {False: 0, True: 0}


def _shared_count(region, budget_bytes):
    """A count that lives outside budget_policy: the second policy starts where the first
    stopped."""
    items = [op for op in region.ops
             if op.can_keep and op.flops > 0 and op.replayed and not op.output]
    keep = _most_flops(items, budget_bytes - region.input_bytes) | \
        {op.index for op in region.ops if op.output}

    def policy(ctx, op, *args, **kwargs):
        i = _SHARED[ctx.is_recompute]
        _SHARED[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if i in keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@pytest.mark.parametrize("wrong, hint", [
    (_keep_all, "keeps every output it can"),
    (_recompute_all, "keeps no output that costs FLOPs"),
    (_greedy_skipping, "order of FLOPs per byte"),
    (_greedy_stopping, "order of FLOPs per byte"),
    (_by_name, "every operator that has FLOPs whatever the budget"),
    (_inputs_ignored, "what else does a checkpointed region hold"),
    (_output_counted, "you counted the region's output against the budget"),
    (_cached, "the policy object it returned for an earlier call"),
    (_shared_count, "must not carry into the next"),
])
@pytest.mark.parametrize("seed", range(3))
def test_budget_policy_wrong_answers_fail_with_their_hint(wrong, hint, seed):
    _cached.cache_clear()
    _SHARED.update({False: 0, True: 0})
    with seeded(seed), pytest.raises(CheckFailed, match=hint):
        check_budget_policy(wrong)


def test_budget_policy_a_count_left_from_an_earlier_check_fails():
    """The shared count, left where a first run of the check stopped: the second check's
    policies keep nothing."""
    for seed in range(2):
        with seeded(seed), pytest.raises(CheckFailed, match="is its count at 0"):
            check_budget_policy(_shared_count)


@pytest.mark.parametrize("m", [1, 2])
def test_the_mlp_case_separates_each_mistake_at_every_size_the_check_draws(m):
    """At the MLP's first budget, for every rows and m the check draws: the optimum beats
    both greedy orders, keeping everything with FLOPs, ignoring the inputs (over budget) and
    counting the output (more FLOPs), so no draw lets one of them pass."""
    from companion.checkpointing import region_ops, solve
    from companion.checks.ch12.budget_policy import _build
    for rows in range(3, 10):
        region = region_ops(*_build(("mlp", 0, rows, m)))
        budget = region.input_bytes + 4 * rows * 17 * m
        best = solve(region, budget, seconds_per_flop=1.0, seconds_per_byte=0.0, grid=1)

        def recomputed(keep):
            return sum(op.flops for op in region.ops if op.index not in keep and op.replayed)

        def held(keep):
            return region.input_bytes + sum(op.nbytes for op in region.ops
                                            if op.index in keep and not op.output)
        greedy = [{i for i, k in enumerate(_run_keeps(wrong, region, budget)) if k}
                  for wrong in (_greedy_skipping, _greedy_stopping)]
        assert all(recomputed(k) > best.recompute_flops for k in greedy)
        assert held(best.indices("keep")) <= budget
        assert held({op.index for op in region.ops if op.flops}) > budget
        ignored = _most_flops([op for op in region.ops if op.flops and not op.output], budget)
        assert held(ignored) > budget
        output = sum(op.nbytes for op in region.ops if op.output)
        counted = _most_flops([op for op in region.ops if op.flops and op.replayed],
                              budget - region.input_bytes - output)
        assert recomputed(counted) > best.recompute_flops


def _run_keeps(answer, region, budget):
    """What a policy keeps, asked once per operator in run order (these policies read only
    the count)."""
    policy = answer(region, budget)
    ctx = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)
    return [policy(ctx, op) == CheckpointPolicy.MUST_SAVE for op in region.ops]


def test_one_counter_for_forward_and_recompute_is_not_a_mistake_in_this_torch():
    """torch 2.13's SAC asks the policy in forward only (`is_recompute` is deprecated, always
    False): a policy that counts forward and recompute together keeps what the reference keeps."""
    def one_counter(region, budget_bytes):
        keep = _most_flops([op for op in region.ops if op.can_keep and op.flops > 0
                            and op.replayed and not op.output], budget_bytes - region.input_bytes)
        keep |= {op.index for op in region.ops if op.output}
        count = [0]

        def policy(ctx, op, *args, **kwargs):
            count[0] += 1
            return (CheckpointPolicy.MUST_SAVE if count[0] - 1 in keep
                    else CheckpointPolicy.PREFER_RECOMPUTE)
        return policy
    with seeded(0):
        check_budget_policy(one_counter)


def _keeps_a_changed_output(region, budget_bytes):
    """Keeps an output that a later operator changes in place (Llama's RMSNorm mean): SAC
    refuses in backward."""
    policy = budget_policy(region, budget_bytes)
    changed = {op.index for op in region.ops if op.nbytes and not op.can_keep}

    def keeps(ctx, op, *args, **kwargs):
        i = keeps.count
        keeps.count += 1
        return CheckpointPolicy.MUST_SAVE if i in changed else policy(ctx, op, *args, **kwargs)
    keeps.count = 0
    return keeps


@pytest.mark.parametrize("answer, match", [
    (lambda region, budget: None, "not a policy function"),
    (lambda region, budget: torch.tensor(float("nan")), "not a policy function"),
    (lambda region, budget: (lambda ctx, op, *a, **k: "save"), "expected a CheckpointPolicy"),
    (lambda region, budget: (lambda ctx, op, *a, **k: 1 / 0), "ZeroDivisionError"),
    (lambda region, budget: region.nope, "AttributeError"),
    (_keeps_a_changed_output, "changes in place cannot be kept"),
])
def test_budget_policy_bad_answers_fail_cleanly(answer, match):
    with seeded(0), pytest.raises(CheckFailed, match=match):
        check_budget_policy(answer)


def test_budget_policy_a_policy_that_never_returns_fails_within_its_limit():
    def slow(region, budget):
        def policy(ctx, op, *a, **k):
            while True:
                pass
        return policy
    with pytest.raises(CheckFailed, match="did not finish within 2 s"):
        check_budget_policy(slow, timeout=2.0)


# ---------------------------------------------------------------- exercise 2

def fused_chunk(h, weight, targets, n_tokens):
    """One chunk's share of the mean cross-entropy of h @ weight.T, and its gradients."""
    exact = torch.promote_types(h.dtype, torch.float32)
    logits = (h @ weight.T).to(exact)                         # (c, V): this chunk's only
    counted = targets != -100                                 # (c,)
    safe = targets.where(counted, 0)                          # an index even where ignored
    logp = logits.log_softmax(-1)                             # the max is taken out inside
    loss = -(logp.gather(1, safe[:, None])[:, 0] * counted).sum() / n_tokens
    grad = logp.exp()                                         # softmax
    grad[torch.arange(len(targets)), safe] -= 1.0             # minus the one-hot target
    grad = (grad * counted[:, None] / n_tokens).to(h.dtype)   # (c, V): d loss / d logits
    return loss.to(h.dtype), grad @ weight, grad.T @ h        # (), (c, d), (V, d)


@pytest.mark.parametrize("seed", range(5))
def test_fused_chunk_reference_passes(seed):
    with seeded(seed):
        check_fused_chunk(fused_chunk)


def _parts(h, weight, targets, *, stable=True, masked=True):
    """(softmax - one-hot, counted mask) with optional mistakes: no max taken out, or the
    ignored rows' gradient kept."""
    logits = (h @ weight.T).to(torch.promote_types(h.dtype, torch.float32))
    counted = targets != -100
    safe = targets.where(counted, 0)
    p = logits.softmax(-1) if stable else logits.exp() / logits.exp().sum(-1, keepdim=True)
    loss_rows = -p.gather(1, safe[:, None])[:, 0].log() * counted
    grad = p.clone()
    grad[torch.arange(len(targets)), safe] -= 1.0
    return loss_rows, grad * (counted[:, None] if masked else 1.0)


def _variant(*, scale=lambda n, t: 1 / n, sign=1.0, stable=True, masked=True, shape="right"):
    def answer(h, weight, targets, n_tokens):
        rows, grad = _parts(h, weight, targets, stable=stable, masked=masked)
        s = scale(n_tokens, targets)
        grad = (sign * grad * s).to(h.dtype)
        grad_w = grad.T @ h
        return ((rows.sum() * s).to(h.dtype), grad if shape == "no weight" else grad @ weight,
                grad_w.T if shape == "transposed" else grad_w)
    return answer


def _autograd(h, weight, targets, n_tokens):
    with torch.enable_grad():
        h2, w2 = h.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = (h2 @ w2.T).log_softmax(-1)
        counted = targets != -100
        loss = -(logp.gather(1, targets.where(counted, 0)[:, None])[:, 0] * counted).sum()
        loss = loss / n_tokens
        gh, gw = torch.autograd.grad(loss, (h2, w2))
    return loss.detach(), gh, gw


def _autograd_on_inputs(h, weight, targets, n_tokens):
    logp = (h @ weight.T).log_softmax(-1)
    loss = -logp.gather(1, targets.clamp(min=0)[:, None]).sum() / n_tokens
    return (loss, *torch.autograd.grad(loss, (h, weight)))


@pytest.mark.parametrize("wrong, hint", [
    (_variant(scale=lambda n, t: 1.0), "count of the whole batch"),
    (_variant(scale=lambda n, t: 1 / max(int((t != -100).sum()), 1)), "the whole batch"),
    (_variant(scale=lambda n, t: 1 / int((t != -100).sum())), "division by this chunk's count"),
    (_variant(stable=False), "overflows"),
    (_variant(masked=False), "target is -100 got a gradient"),
    (_variant(shape="transposed"), "expected shape"),
    (_variant(shape="no weight"), "expected shape"),
    (_variant(sign=-1.0), "wrong way"),
    (_autograd, "autograd cannot give them here"),
    (_autograd_on_inputs, "autograd cannot give them here"),
    (lambda h, w, t, n: tuple(x.double() for x in fused_chunk(h, w, t, n)), "dtype"),
])
@pytest.mark.parametrize("seed", range(3))
def test_fused_chunk_wrong_answers_fail_with_their_hint(wrong, hint, seed):
    with seeded(seed), pytest.raises(CheckFailed, match=hint):
        check_fused_chunk(wrong)


@pytest.mark.parametrize("answer, match", [
    (lambda h, w, t, n: None, "expected \\(loss, grad_h, grad_weight\\)"),
    (lambda h, w, t, n: (torch.tensor(float("nan")),) * 3, "NaN"),
    (lambda h, w, t, n: h.reshape(-1)[99999], "IndexError"),
])
def test_fused_chunk_bad_answers_fail_cleanly(answer, match):
    with pytest.raises(CheckFailed, match=match):
        check_fused_chunk(answer)


# ---------------------------------------------------------------- exercise 3

def choose_remat(tensors, budget_bytes, host_bytes_per_second, window_seconds):
    """Keep, recompute or offload each (nbytes, recompute_seconds), within the budget."""
    best, choice = float("inf"), None
    for option in itertools.product(("keep", "recompute", "offload"), repeat=len(tensors)):
        total = {"keep": 0, "recompute": 0.0, "offload": 0}
        for (nbytes, seconds), c in zip(tensors, option):
            total[c] += seconds if c == "recompute" else nbytes
        if total["keep"] > budget_bytes:
            continue
        exposed = max(0.0, total["offload"] / host_bytes_per_second - window_seconds)
        added = total["recompute"] + 2 * exposed              # down in forward, up in backward
        if added < best:
            best, choice = added, list(option)
    return choice


@pytest.mark.parametrize("seed", range(5))
def test_choose_remat_reference_passes(seed):
    with seeded(seed):
        check_choose_remat(choose_remat)


def _search(words, price):
    """The least `price(option)` over options of `words` (a wrong answer's search)."""
    def answer(tensors, budget, rate, window):
        options = [o for o in itertools.product(words, repeat=len(tensors))
                   if sum(b for (b, _), c in zip(tensors, o) if c == "keep") <= budget]
        return list(min(options, key=lambda o: price(tensors, o, rate, window)))
    return answer


def _priced(*, times=2, window=True, free=False):
    def price(tensors, option, rate, w):
        down = sum(b for (b, _), c in zip(tensors, option) if c == "offload") / rate
        exposed = 0.0 if free else times * max(0.0, down - (w if window else 0.0))
        return sum(s for (_, s), c in zip(tensors, option) if c == "recompute") + exposed
    return price


def _greedy_remat(tensors, budget, rate, window):
    """Keep by seconds per byte while it fits; then offload while it lowers the added time."""
    choice, room = ["recompute"] * len(tensors), budget
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i][1] / tensors[i][0]):
        if tensors[i][0] <= room:
            choice[i], room = "keep", room - tensors[i][0]
    for i in range(len(tensors)):
        if choice[i] == "recompute":
            trial = choice[:i] + ["offload"] + choice[i + 1:]
            if _priced()(tensors, trial, rate, window) < _priced()(tensors, choice, rate, window):
                choice = trial
    return choice


@pytest.mark.parametrize("wrong, hint", [
    (_search(("keep", "recompute"), _priced()), "can hide copies"),
    (_search(("keep", "recompute", "offload"), _priced(window=False)), "can hide copies"),
    (_search(("keep", "recompute", "offload"), _priced(free=True)), "are exposed"),
    (_search(("keep", "recompute", "offload"), _priced(times=1)), "up again in backward"),
    (_greedy_remat, "two smaller ones"),
    (lambda t, budget, rate, w: ["keep"] * len(t), "over the budget"),
    (lambda t, budget, rate, w: ["keep"] * (len(t) - 1), "expected a list of"),
    (lambda t, budget, rate, w: ["save"] * len(t), "each choice is"),
    (lambda t, budget, rate, w: "recompute", "expected a list of"),
])
@pytest.mark.parametrize("seed", range(5))
def test_choose_remat_wrong_answers_fail_with_their_hint(wrong, hint, seed):
    with seeded(seed), pytest.raises(CheckFailed, match=hint):
        check_choose_remat(wrong)


# ---------------------------------------------------------------- as the grader runs them

class _OverTheWire(Elsewhere):
    """The answer in "another process": arguments pickled, results sent as the sandbox sends
    them (wire.encode, then decoded as the grader decodes them: plain data only)."""

    def call(self, args, kwargs):
        return _wire(super().call(args, kwargs))

    def run_harness(self, fn, args, kwargs):
        return _wire(super().run_harness(fn, args, kwargs))


def _wire(value):
    return wire.decode(wire.dumps({"value": wire.encode(value)}))["value"]


@pytest.mark.parametrize("name, right, wrong, hint", [
    ("check_budget_policy", budget_policy, _greedy_skipping, "order of FLOPs per byte"),
    ("check_fused_chunk", fused_chunk, _autograd, "autograd cannot give them here"),
    ("check_choose_remat", choose_remat, _greedy_remat, "two smaller ones"),
])
def test_each_check_gives_its_verdicts_through_a_remote(name, right, wrong, hint):
    with seeded(0):
        assert evaluate(name, _OverTheWire(right))
    with seeded(0), pytest.raises(CheckFailed, match=hint):
        evaluate(name, _OverTheWire(wrong))


# ---- the independent review's wrong answers (issue 59) ------------------------------------------

def _ignores_can_keep(region, budget_bytes):
    """The right knapsack over every operator with FLOPs, whether or not it can be kept."""
    items = [op for op in region.ops if op.flops > 0 and op.replayed and not op.output]
    return _policy(_most_flops(items, budget_bytes - region.input_bytes))


def test_budget_policy_a_policy_that_keeps_a_changed_output_fails():
    with seeded(0), pytest.raises(CheckFailed, match="changes in place cannot be kept"):
        check_budget_policy(_ignores_can_keep)


def _rewrites_targets(h, weight, targets, n_tokens):
    """Right numbers, but the ignored targets are overwritten in the caller's tensor."""
    counted = targets != -100
    targets[~counted] = 0
    logp = (h @ weight.T).to(torch.promote_types(h.dtype, torch.float32)).log_softmax(-1)
    loss = -(logp.gather(1, targets[:, None])[:, 0] * counted).sum() / n_tokens
    grad = logp.exp()
    grad[torch.arange(len(targets)), targets] -= 1.0
    grad = (grad * counted[:, None] / n_tokens).to(h.dtype)
    return loss.to(h.dtype), grad @ weight, grad.T @ h


def test_fused_chunk_that_changes_its_arguments_fails():
    with seeded(0), pytest.raises(CheckFailed, match="changed its argument targets in place"):
        check_fused_chunk(_rewrites_targets)


def _keep_sets_then_greedy_offload(tensors, budget, rate, window):
    """Every keep set, then offload added greedily by seconds per byte."""

    def cost(option):
        recompute = sum(s for (_, s), c in zip(tensors, option) if c == "recompute")
        moved = sum(b for (b, _), c in zip(tensors, option) if c == "offload")
        return recompute + 2 * max(0.0, moved / rate - window)
    best, choice = float("inf"), None
    for keep in itertools.product((0, 1), repeat=len(tensors)):
        if sum(b for (b, _), k in zip(tensors, keep) if k) > budget:
            continue
        option = ["keep" if k else "recompute" for k in keep]
        for i in sorted((i for i, k in enumerate(keep) if not k),
                        key=lambda i: -tensors[i][1] / tensors[i][0]):
            trial = option[:i] + ["offload"] + option[i + 1:]
            if cost(trial) < cost(option):
                option = trial
        if cost(option) < best:
            best, choice = cost(option), option
    return choice


@pytest.mark.parametrize("seed", range(4))
def test_choose_remat_greedy_offload_after_every_keep_set_fails(seed):
    with seeded(seed), pytest.raises(CheckFailed, match="adds"):
        check_choose_remat(_keep_sets_then_greedy_offload)


def _keep_by_unhidden_price(tensors, budget, rate, window):
    """Keeps the set worth most at min(recompute, an unhidden copy), then splits the rest."""
    n, best_value, keep = len(tensors), -1.0, 0
    for mask in range(1 << n):
        if sum(tensors[i][0] for i in range(n) if mask >> i & 1) > budget:
            continue
        value = sum(min(tensors[i][1], 2 * tensors[i][0] / rate)
                    for i in range(n) if mask >> i & 1)
        if value > best_value:
            best_value, keep = value, mask
    rest = [i for i in range(n) if not keep >> i & 1]
    best, choice = float("inf"), None
    for split in range(1 << len(rest)):
        option = ["keep"] * n
        for j, i in enumerate(rest):
            option[i] = "offload" if split >> j & 1 else "recompute"
        recompute = sum(s for (_, s), c in zip(tensors, option) if c == "recompute")
        moved = sum(b for (b, _), c in zip(tensors, option) if c == "offload")
        added = recompute + 2 * max(0.0, moved / rate - window)
        if added < best:
            best, choice = added, option
    return choice


@pytest.mark.parametrize("seed", range(4))
def test_choose_remat_keeping_by_the_unhidden_price_fails(seed):
    with seeded(seed), pytest.raises(CheckFailed, match="adds"):
        check_choose_remat(_keep_by_unhidden_price)


def _coarse_grid(grid):
    """The right table, on cells of `grid` bytes (the room rounded down, weights up)."""
    def answer(region, budget_bytes):
        items = [op for op in region.ops
                 if op.can_keep and op.flops > 0 and op.replayed and not op.output]
        cells = max(0, budget_bytes - region.input_bytes) // grid
        weights = [-(-op.nbytes // grid) for op in items]
        best = [0] * (cells + 1)
        took = [[False] * (cells + 1) for _ in items]
        for i, (op, w) in enumerate(zip(items, weights)):
            for c in range(cells, w - 1, -1):
                if best[c - w] + op.flops > best[c]:
                    best[c], took[i][c] = best[c - w] + op.flops, True
        keep, c = set(), cells
        for i in reversed(range(len(items))):
            if took[i][c]:
                keep.add(items[i].index)
                c -= weights[i]
        return _policy(keep)
    return answer


@pytest.mark.parametrize("grid", [8, 16, 1024])
def test_budget_policy_on_a_coarse_byte_grid_fails(grid):
    for seed in range(3):
        with seeded(seed), pytest.raises(CheckFailed, match="recomputes"):
            check_budget_policy(_coarse_grid(grid))
