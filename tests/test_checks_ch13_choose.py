"""Chapter 13, exercise 3 (choose t, p, d and ZeRO): the check passes the reference over several
seeds, fails the wrong answers a learner writes with a message that names the mistake, and
turns bad input into a clear failure."""
import pytest

from companion.checks.ch13.choose_parallel import (TOLERANCE, _WHERE, _best, _found, _property,
                                                   check_choose_parallel, exercise_layout)
from companion.checks.core import CheckFailed, evaluate, seeded
from companion.grader import wire
from companion.plan.parallel import estimate, memory, step_time
from elsewhere import Elsewhere

GPU = "H100 SXM"


def _price(shape, layout, seq, node):
    """(bytes, seconds) of a layout by the chapter's formulas (what a learner calls)."""
    return (sum(x.value for x in memory(shape, layout, seq)[1]),
            sum(x.value for x in step_time(shape, layout, seq, gpu=GPU, gpus_per_node=node)))


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _choose(*, node_rule=True, heads_rule=True, kv_rule=True, layers_rule=True, batch_rule=True,
            fit=True, only_t=None, least_p=1, zeros=lambda d: (0, 1) if d > 1 else (0,),
            price_node=None, key=1):
    """A search over (t, p, d, zero), each rule switchable: the reference has them all.
    price_node: price as if a node held that many GPUs; key 0: least memory, 1: fastest."""
    def answer(model, gpus, gpus_per_node, limit, seq_len, batch_tokens):
        batch = batch_tokens // seq_len
        options = []
        for t in _divisors(gpus):
            if (node_rule and (t > gpus_per_node or gpus_per_node % t)) or \
                    (heads_rule and model.heads % t) or (kv_rule and model.kv_heads % t) or \
                    (only_t is not None and t != only_t(model, gpus_per_node)):
                continue
            for p in _divisors(gpus // t):
                d = gpus // (t * p)
                if (layers_rule and model.layers % p) or (batch_rule and batch % d) or \
                        d > batch or p < least_p:
                    continue
                for zero in zeros(d):
                    layout = exercise_layout(t, p, d, zero, batch)
                    nbytes = _price(model, layout, seq_len, gpus_per_node)[0]
                    seconds = _price(model, layout, seq_len, price_node or gpus_per_node)[1]
                    if nbytes <= limit or not fit:
                        options.append(((nbytes, seconds)[key], (t, p, d, zero)))
        return min(options)[1] if options else (1, 1, gpus, 1)
    return answer


reference = _choose()


@pytest.mark.parametrize("seed", range(5))
def test_reference_passes(seed):
    with seeded(seed):
        check_choose_parallel(reference)


def _max_t(model, node):
    return max(t for t in _divisors(node) if model.heads % t == 0 and model.kv_heads % t == 0)


WRONG = [
    ("always the largest t", _choose(only_t=_max_t), "tensor parallelism than needed"),
    ("always t = 1", _choose(only_t=lambda model, node: 1), "over the limit"),
    ("the fastest, fit or not", _choose(fit=False), "over the limit"),
    ("t across nodes", _choose(node_rule=False), "crosses the node"),
    ("p that does not divide the layers", _choose(layers_rule=False), "does not divide the"),
    ("t that does not divide the heads", _choose(heads_rule=False, node_rule=False),
     "crosses the node|does not divide"),
    # the reviewer's (chapter 13's exercises, second review): each passed before the cases below
    ("t that does not divide the key/value heads", _choose(kv_rule=False),
     "key/value heads"),
    ("d that does not divide the sequences", _choose(batch_rule=False), "does not divide the"),
    ("never ZeRO-1", _choose(zeros=lambda d: (0,)), "takes|over the limit"),
    ("ZeRO-1 to fit, reported as ZeRO-0",
     lambda *a: reference(*a)[:3] + (0,), "takes|over the limit"),
    ("the least memory, not the fastest", _choose(key=0), "takes"),
    ("never one pipeline stage", _choose(least_p=2), "takes"),
    ("priced as if a node held 8 GPUs", _choose(price_node=8), "takes"),
]


@pytest.mark.parametrize("label, wrong, message", WRONG, ids=[w[0] for w in WRONG])
@pytest.mark.parametrize("seed", range(3))
def test_wrong_answers_fail(label, wrong, message, seed):
    with seeded(seed), pytest.raises(CheckFailed, match=message):
        check_choose_parallel(wrong)


def test_zero_1_over_one_rank_is_accepted():
    """ZeRO-1 at d = 1 runs (it shards over one rank) and is priced as ZeRO-0: not a mistake."""
    with seeded(0):
        check_choose_parallel(_choose(zeros=lambda d: (1, 0)))


def _try_everything(model, gpus, gpus_per_node, limit, seq_len, batch_tokens):
    """Every factorisation, the estimator's ValueError skipping the layouts it refuses: but it
    does not refuse a d that leaves sequences over, so this picks one that cannot run."""
    batch, best = batch_tokens // seq_len, None
    for t in _divisors(gpus):
        for p in _divisors(gpus // t):
            d = gpus // (t * p)
            for zero in (0, 1):
                try:
                    e = estimate(model, exercise_layout(t, p, d, zero, batch), seq_len, gpu=GPU,
                                 gpus_per_node=gpus_per_node)
                except ValueError:
                    continue
                if e.fits(limit) and (best is None or e.seconds < best[0]):
                    best = (e.seconds, (t, p, d, zero))
    return best[1]


@pytest.mark.parametrize("seed", range(3))
def test_trusting_the_estimator_for_the_rules_fails(seed):
    with seeded(seed), pytest.raises(CheckFailed, match="does not divide the .* sequences"):
        check_choose_parallel(_try_everything)


@pytest.mark.parametrize("kind", sorted(_WHERE))
def test_each_crafted_case_has_its_property(kind):
    """The search in _WHERE finds each case, and the case's fastest layout is as its name
    says; the wrong pick it is built against is more than the tolerance slower (or breaks a
    rule): _property, checked here against the layout itself."""
    shape, gpus, node, limit, seq, batch = _found(kind)
    assert _property(kind, shape, gpus, node, seq, batch, limit)
    seconds, (t, p, d, zero), _ = _best(shape, gpus, node, limit, seq, batch)
    if kind == "p = 1":
        assert p == 1
    elif kind == "t = 1":
        assert t == 1
    elif kind == "ZeRO-1":
        assert zero == 1 and d == 2
        no_zero = _choose(zeros=lambda d: (0,))(shape, gpus, node, limit, seq, batch * seq)
        assert _price(shape, exercise_layout(*no_zero, batch), seq, node)[1] > \
            seconds * (1 + TOLERANCE) or _price(shape, exercise_layout(*no_zero, batch), seq,
                                                 node)[0] > limit
    elif kind == "the node":
        assert node in (2, 4)
    elif kind == "key/value heads":
        assert shape.kv_heads in (2, 4)
    elif kind == "the batch":
        assert any(batch % k for k in _divisors(gpus))


def test_t_beyond_the_heads_fails_by_name():
    """A t that divides the GPUs and fits in the node but not the 24 heads of the 3B-like shape
    (t = 16 on a node of 16 is not drawn: the check's nodes hold 2 to 8): named directly."""
    def answer(model, gpus, gpus_per_node, limit, seq_len, batch_tokens):
        return (16, 1, gpus // 16, 0) if model.heads == 24 else reference(
            model, gpus, gpus_per_node, limit, seq_len, batch_tokens)
    with seeded(0), pytest.raises(CheckFailed, match="crosses the node|does not divide"):
        check_choose_parallel(answer)


@pytest.mark.parametrize("bad, message", [
    (lambda *a: None, "four whole numbers"),
    (lambda *a: (1, 2, 3), "four whole numbers"),
    (lambda *a: (1.0, 1, a[1], 0), "whole numbers"),
    (lambda *a: (1, 1, a[1], 2), "zero_stage 0 or 1"),
    (lambda *a: (1, 1, 1, 0), "not the"),
    (lambda *a: 1 / 0, "ZeroDivisionError"),
])
def test_bad_input_fails_clearly(bad, message):
    with seeded(0), pytest.raises(CheckFailed, match=message):
        check_choose_parallel(bad)


def test_not_a_function_and_an_endless_loop_fail_cleanly():
    with pytest.raises(CheckFailed, match="got None"):
        check_choose_parallel(None)
    def forever(*args):
        while True:
            pass
    with pytest.raises(CheckFailed, match="did not finish within 2 s"):
        check_choose_parallel(forever, timeout=2.0)


class _OverTheWire(Elsewhere):
    """The answer in "another process": arguments pickled, its result sent as the grader's
    sandbox sends it (plain data only)."""

    def call(self, args, kwargs):
        value = super().call(args, kwargs)
        return wire.decode(wire.dumps({"value": wire.encode(value)}))["value"]


def test_the_check_gives_its_verdicts_through_a_remote():
    with seeded(0):
        assert evaluate("check_choose_parallel", _OverTheWire(reference))
    with seeded(0), pytest.raises(CheckFailed, match="crosses the node"):
        evaluate("check_choose_parallel", _OverTheWire(_choose(node_rule=False)))
