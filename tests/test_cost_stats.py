"""companion.cost.stats: Spearman's rank correlation and the ranks it is made of (the other
statistics of the module are tested in test_cost.py)."""
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from companion.cost import stats


def test_ranks_share_the_average_over_ties():
    assert stats.rankdata([30, 10, 20]) == [3, 1, 2]
    assert stats.rankdata([10, 20, 20, 30]) == [1, 2.5, 2.5, 4]
    assert stats.rankdata([5, 5, 5]) == [2, 2, 2]


def test_spearman_by_hand():
    # no ties: d = (1, 1, 1, 1, 0), 1 - 6·4 / (5·24) = 0.8
    assert stats.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # ties: ranks (1, 2, 3, 4) and (1, 2.5, 2.5, 4), centred (-1.5, -0.5, 0.5, 1.5) and
    # (-1.5, 0, 0, 1.5): 4.5 / sqrt(5 · 4.5) = 3 / sqrt(10), scipy's spearmanr gives the same
    assert stats.spearman([1, 2, 3, 4], [10, 20, 20, 30]) == pytest.approx(3 / math.sqrt(10))
    assert stats.spearman([1, 2, 3], [0.1, 5, 900]) == 1.0                # only order counts
    assert stats.spearman([1, 2, 3], [3, 2, 1]) == -1.0


def test_spearman_agrees_with_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for n in (3, 8, 20):
        a = [rng.choice([1.0, 2.0, 3.0, rng.random()]) for _ in range(n)]   # ties and not
        b = [x + rng.gauss(0, 1) for x in a]
        assert stats.spearman(a, b) == pytest.approx(scipy_stats.spearmanr(a, b)[0])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-10**6, 10**6), min_size=2, max_size=12, unique=True))
def test_spearman_of_a_list_with_itself_and_its_reverse(xs):
    assert stats.spearman(xs, xs) == pytest.approx(1.0)
    assert stats.spearman(xs, [-x for x in xs]) == pytest.approx(-1.0)
    assert stats.spearman(xs, [x**3 for x in xs]) == pytest.approx(1.0)      # monotone


@pytest.mark.parametrize("a, b, match", [([1, 2, 3], [1, 2], "same length"),
                                         ([1], [1], "at least 2"),
                                         ([1, 2, 3], [4, 4, 4], "single value"),
                                         ([1, float("nan")], [1, 2], "NaN")])
def test_spearman_rejects_what_has_no_order(a, b, match):
    with pytest.raises(ValueError, match=match):
        stats.spearman(a, b)
